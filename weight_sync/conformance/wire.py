"""What the kit puts on the wire, built from PROTOCOL.md's rules alone (not with the sender's code): synthetic element
values, shard boxes cut into RAW chunks with their xxh3_64, delta payloads, and the socket plane's frame sizes."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from types import EllipsisType

import grpc
import numpy as np
import xxhash
import zstandard

from protos import weight_sync_pb2 as pb
from weight_sync.spec import TensorSpec, element_dtype, itemsize

MAX_HEADER_BYTES = 1 << 16  # PROTOCOL.md: hello and chunk-header frames
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
Box = tuple[list[int], list[int]]
"""A shard box: (offsets, shape) inside its tensor."""


def synthetic(spec: TensorSpec, seed: int) -> np.ndarray:
    """Flat little-endian element bit patterns of plausible values for `spec` (finite floats, small integers)."""
    rng = np.random.default_rng(seed)
    n, dtype = spec.numel, spec.dtype
    if dtype in ("float64", "float32", "float16"):
        values = rng.uniform(-1, 1, n).astype(f"<f{itemsize(dtype)}")
    elif dtype == "bfloat16":
        values = (rng.uniform(-1, 1, n).astype("<f4").view("<u4") >> 16).astype("<u2")
    elif dtype.startswith("float8"):
        values = rng.integers(0x20, 0x38, n, dtype=np.uint8)  # small positive normals in both float8 formats
    elif dtype == "bool":
        values = rng.integers(0, 2, n, dtype=np.uint8)
    else:
        values = rng.integers(0, 100, n).astype(f"<{np.dtype(dtype).str[1:]}")
    return values.view(element_dtype(dtype).newbyteorder("<"))


def whole(spec: TensorSpec) -> Box:
    """The box of the whole tensor."""
    return [0] * len(spec.shape), list(spec.shape)


def rows(spec: TensorSpec, start: int, stop: int) -> Box:
    """The box of rows [start, stop) along dim 0."""
    return [start] + [0] * (len(spec.shape) - 1), [stop - start, *spec.shape[1:]]


def box_values(spec: TensorSpec, values: np.ndarray, offsets: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """The elements of the box (`offsets`, `shape`) of a tensor held flat in `values`, in C order."""
    box: tuple[EllipsisType | slice, ...] = (Ellipsis, *(slice(o, o + s) for o, s in zip(offsets, shape)))
    return np.ascontiguousarray(values.reshape(spec.shape)[box]).reshape(-1)


def box_checksum(spec: TensorSpec, values: np.ndarray, box: Box | None = None) -> int:
    """The shard checksum PROTOCOL.md asks for: xxh3_64, seed 0, of the box's element bytes in C order."""
    return xxhash.xxh3_64_intdigest(box_values(spec, values, *(box or whole(spec))).tobytes())


def shard_chunks(
    spec: TensorSpec, values: np.ndarray, offsets: Sequence[int], shape: Sequence[int], max_chunk_bytes: int,
    *, checksum: int | None = None,
) -> list[pb.PushChunk]:
    """RAW chunks of one shard, each at most `max_chunk_bytes`, the first with the ShardHeader (xxh3_64, seed 0;
    `checksum` puts another value there)."""
    box = box_values(spec, values, offsets, shape)
    digest = xxhash.xxh3_64_intdigest(box.tobytes()) if checksum is None else checksum
    header = pb.ShardHeader(name=spec.name, offsets=offsets, shape=shape, xxh3_64=digest)
    step = max(1, max_chunk_bytes // box.itemsize)
    chunks = []
    for begin in range(0, max(box.shape[0], 1), step):
        part = box[begin : begin + step]
        chunk = pb.PushChunk(
            header=pb.ChunkHeader(element_offset=begin, num_elements=part.shape[0]), payload=part.tobytes()
        )
        if begin == 0:
            chunk.header.shard.CopyFrom(header)
        chunks.append(chunk)
    return chunks


def sparse_payload(new: np.ndarray, base: np.ndarray) -> bytes:
    """SPARSE: k u32 little-endian indices (strictly increasing, relative to the chunk), then the k new values."""
    idx = np.flatnonzero(new != base).astype("<u4")
    return idx.tobytes() + new[idx].tobytes()


def xor_payload(new: np.ndarray, base: np.ndarray) -> bytes:
    """XOR_ZSTD: one zstd frame, content size in its header, of the XOR of the chunk's new and base bytes."""
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(np.bitwise_xor(new, base).tobytes())


def other_ticket(ticket: bytes) -> bytes:
    """A 32-byte data ticket that is not `ticket`."""
    return bytes(32) if ticket != bytes(32) else b"\x01" * 32


def status_name(code: int) -> str:
    """The gRPC status name of a numeric code (as a DataReply carries it)."""
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), f"code {code}")
