"""Chunk framing, delta coding and checksums: pure functions shared by the sender, the receiver and the relay.

Framing: a `PushChunk` is written by hand as field 1 (the small `ChunkHeader`) then field 2 (the payload), exactly what
any protobuf encoder emits, so stock stubs interoperate; the receiver parses only the header and keeps the payload as a
zero-copy view of the received message (protobuf `bytes` fields otherwise copy the payload several times).

Delta: `zstd(new_bits XOR base_bits)`; when <= a few percent of the values changed the XOR is mostly zero bytes and
compresses by orders of magnitude. The receiver checks the decoded result against the shard's xxh3_64.
"""

from __future__ import annotations

import numpy as np
import zstandard

from protos import weight_sync_pb2 as pb

__all__ = ["DeltaError", "decode_chunk", "encode_chunk", "xor_decode", "xor_encode"]


class DeltaError(ValueError):
    """A delta payload that does not decode to the announced number of bytes."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated or oversized varint in chunk framing")


def encode_chunk(header: pb.ChunkHeader, payload: bytes | memoryview | np.ndarray) -> bytes:
    """Serialize a PushChunk (header, payload) with one copy of the payload."""
    head = header.SerializeToString()
    body = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    return b"".join((b"\x0a", _varint(len(head)), head, b"\x12", _varint(len(body)), body))


def decode_chunk(data: bytes) -> tuple[pb.ChunkHeader, memoryview]:
    """Parse a serialized PushChunk into its header and a view of its payload; raises ValueError when malformed."""
    buf = memoryview(data)
    try:
        if len(buf) and buf[0] == 0x0A:
            head_len, pos = _read_varint(buf, 1)
            header = pb.ChunkHeader.FromString(buf[pos : pos + head_len])
            pos += head_len
            if pos == len(buf):
                return header, buf[pos:]
            if buf[pos] == 0x12:
                body_len, pos = _read_varint(buf, pos + 1)
                if pos + body_len == len(buf):
                    return header, buf[pos:]
        message = pb.PushChunk.FromString(data)  # any other valid field order
    except Exception as e:  # protobuf raises its own DecodeError types
        raise ValueError(f"malformed PushChunk: {e}") from None
    return message.header, memoryview(message.payload)


def xor_encode(new: np.ndarray, base: np.ndarray, compressor: zstandard.ZstdCompressor, scratch: np.ndarray) -> bytes | None:
    """zstd(new XOR base) for two equal 1-D arrays, or None when the result would not be smaller than `new`."""
    out = scratch[: new.shape[0]]
    np.bitwise_xor(new, base, out=out)
    packed = compressor.compress(out)
    return packed if len(packed) < new.nbytes else None


def xor_decode(payload: memoryview, base: np.ndarray, decompressor: zstandard.ZstdDecompressor) -> np.ndarray:
    """Inverse of `xor_encode`: the new elements, same dtype and length as `base`; DeltaError on any mismatch."""
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as e:
        raise DeltaError(f"delta payload is not a zstd frame: {e}") from None
    if params.content_size != base.nbytes:  # refuse before allocating: bounds memory by the manifest
        raise DeltaError(f"delta frame announces {params.content_size} bytes, the chunk needs {base.nbytes}")
    try:
        raw = decompressor.decompress(payload, max_output_size=base.nbytes)
    except zstandard.ZstdError as e:
        raise DeltaError(f"delta payload does not decompress: {e}") from None
    if len(raw) != base.nbytes:
        raise DeltaError(f"delta decompressed to {len(raw)} bytes, expected {base.nbytes}")
    return np.bitwise_xor(np.frombuffer(raw, dtype=base.dtype), base)
