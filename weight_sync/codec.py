"""Chunk framing, delta coding and checksums: pure functions shared by the sender, the receiver and the relay.

Framing: a `PushChunk` is written by hand as field 1 (the small `ChunkHeader`) then field 2 (the payload), exactly what
any protobuf encoder emits, so stock stubs interoperate; the receiver parses only the header and keeps the payload as a
zero-copy view of the received message (protobuf `bytes` fields otherwise copy the payload several times).

Delta, two encodings of a chunk against the receiver's committed base (the receiver checks the decoded result against
the shard's xxh3_64 either way):
- sparse (default): the indices of the elements whose bit pattern changed and their new values; a vectorized compare,
  6 bytes per changed bf16 value;
- xor_zstd: `zstd(new_bits XOR base_bits)`; smaller on the wire but costlier to compute, so it only pays on slow links
  (`weight_sync/README.md` has the measured rates).
"""

from __future__ import annotations

import numpy as np
import zstandard

from protos import weight_sync_pb2 as pb

__all__ = ["DeltaError", "decode_chunk", "encode_chunk", "sparse_decode", "sparse_encode", "xor_decode", "xor_encode"]


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
    if isinstance(payload, np.ndarray):
        payload = payload.data  # the array's buffer, as memoryview(payload) gives it
    body = payload if isinstance(payload, bytes) else payload.cast("B")
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


def xor_encode(
    new: np.ndarray, base: np.ndarray, compressor: zstandard.ZstdCompressor, scratch: np.ndarray
) -> bytes | None:
    """zstd(new XOR base) for two equal 1-D arrays, or None when the result would not be smaller than `new`."""
    out = scratch[: new.shape[0]]
    np.bitwise_xor(new, base, out=out)
    packed = compressor.compress(out.data)
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


def sparse_encode(new: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(uint32 indices, new values) of the elements that differ, or None when that is not smaller than `new`."""
    idx = np.flatnonzero(new != base)
    if idx.shape[0] * (4 + new.itemsize) >= new.nbytes:
        return None
    return idx.astype(np.uint32), new[idx]


def sparse_payload(idx: np.ndarray, values: np.ndarray) -> bytes:
    return b"".join((idx.astype("<u4", copy=False).tobytes(), values.tobytes()))


def sparse_decode(payload: memoryview, count: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Indices and values of a sparse chunk of `count` elements; DeltaError when malformed or out of range."""
    k, rest = divmod(len(payload), 4 + dtype.itemsize)
    if rest:
        raise DeltaError(f"sparse payload of {len(payload)} bytes is not a whole number of (index, value) pairs")
    idx = np.frombuffer(payload, dtype="<u4", count=k)
    values = np.frombuffer(payload, dtype=dtype, count=k, offset=4 * k)
    if k and (int(idx[-1]) >= count or (k > 1 and not np.all(idx[1:] > idx[:-1]))):
        raise DeltaError(f"sparse indices are not strictly increasing inside [0, {count})")
    return idx, values
