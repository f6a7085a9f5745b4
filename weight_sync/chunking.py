"""Turning one rank's shards into wire messages: local views, the split over parallel streams, chunks, deltas.

Pure functions and small value classes; the sender owns the network side. A rank's shards are spread over
`num_streams` Push streams of near-equal bytes (Python gRPC moves about twice as much with two streams as with one
here); a shard larger than an equal share is cut into row blocks, which the receiver sees as ordinary shards.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator
from concurrent import futures

import numpy as np
import torch
import xxhash
import zstandard

from protos import weight_sync_pb2 as pb
from weight_sync.codec import encode_chunk, sparse_encode, sparse_payload, xor_encode
from weight_sync.layout import box_error
from weight_sync.spec import TensorSpec, dtype_name, element_dtype

__all__ = [
    "Chunk", "DeltaCoder", "LocalShard", "Piece", "Shard", "as_dtype", "as_local", "piece_chunks", "plan_streams",
    "stream_chunks",
]


# Pieces (each one shard on the wire, with its own checksum) are cut to about this size: a stream waits for its first
# piece's hash, and later ones are hashed one piece ahead of it, close enough that their bytes may still be in cache.
# Receivers take up to 4,096 shards of a tensor from all ranks together: 256 pieces of each rank's shard leave room
# for 16 ranks whose shards of one tensor each exceed 2 GiB.
PIECE_BYTES = 8 << 20
MAX_PIECES_PER_SHARD = 256


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's piece of a parameter: HF name, the local tensor, the global shape and the piece's global offsets."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offsets: tuple[int, ...]


@dataclasses.dataclass
class LocalShard:
    name: str
    spec: TensorSpec
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    values: np.ndarray  # flat, unsigned elements (bit patterns), a view of the tensor's memory when on CPU

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return (self.name, self.offsets)


def as_dtype(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """``tensor`` in the dtype named ``dtype`` as the wire spells it (e.g. the one receivers declare:
    ``WeightSender.declared_dtypes``); ``tensor`` itself when None or already in it."""
    return tensor if dtype is None else tensor.to(getattr(torch, dtype))


def as_local(shard: Shard) -> LocalShard:
    """Validate a Shard and view its tensor as flat unsigned elements (a copy only for non-CPU or strided tensors)."""
    tensor = shard.tensor.detach()
    spec = TensorSpec(shard.name, tuple(shard.global_shape), dtype_name(tensor.dtype))
    problem = box_error(spec.shape, tuple(shard.global_offsets), tuple(tensor.shape))
    if problem:
        raise ValueError(f"shard of {shard.name}: {problem}")
    flat = tensor.cpu().contiguous().reshape(-1)
    elem = element_dtype(spec.dtype)
    values = flat.view(torch.uint8).numpy().view(elem) if flat.numel() else np.empty(0, elem)
    return LocalShard(shard.name, spec, tuple(shard.global_offsets), tuple(tensor.shape), values)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows [row0, row1) (along dim 0) of a local shard; the whole shard for 0-d tensors."""

    local: LocalShard
    row0: int
    row1: int

    @property
    def span(self) -> tuple[int, int]:
        """The piece's element range inside `local.values`."""
        rows = self.local.shape[0] if self.local.shape else 1
        inner = self.local.values.shape[0] // rows if rows else 0
        return self.row0 * inner, self.row1 * inner

    @property
    def nbytes(self) -> int:
        a, b = self.span
        return (b - a) * self.local.values.itemsize

    @property
    def values(self) -> np.ndarray:
        """The piece's elements: a view of `local.values`."""
        a, b = self.span
        return self.local.values[a:b]

    def checksum(self) -> int:
        """xxh3_64 (seed 0) of the piece's element bytes: its shard header's checksum."""
        return xxhash.xxh3_64_intdigest(self.values.data)


def plan_streams(locals_: list[LocalShard], num_streams: int) -> list[list[Piece]]:
    """Spread shards over `num_streams` groups of near-equal bytes, cutting shards larger than an equal share or than
    `PIECE_BYTES` into row blocks (at most `MAX_PIECES_PER_SHARD` of them)."""
    share = max(sum(local.values.nbytes for local in locals_) / num_streams, 1)
    share = min(share, PIECE_BYTES)
    pieces: list[Piece] = []
    for local in locals_:
        rows = local.shape[0] if local.shape else 1
        parts = 1
        if local.shape and rows > 1:
            parts = min(rows, MAX_PIECES_PER_SHARD, math.ceil(local.values.nbytes / share))
        bounds = [rows * i // max(parts, 1) for i in range(max(parts, 1) + 1)]
        pieces += [Piece(local, a, b) for a, b in zip(bounds, bounds[1:]) if b > a or rows == 0]
    groups: list[list[Piece]] = [[] for _ in range(num_streams)]
    loads = [0] * num_streams
    for piece in sorted(pieces, key=lambda p: p.nbytes, reverse=True):
        i = loads.index(min(loads))
        groups[i].append(piece)
        loads[i] += piece.nbytes
    return groups


@dataclasses.dataclass
class Chunk:
    """One chunk of a piece in its raw form (header + a view of the elements) and, when smaller, its delta form.

    Each transport takes what it needs: gRPC streams the serialized PushChunk (built once, shared by every stream),
    the socket plane writes the header and the element memory as they are (no copy).
    """

    header: pb.ChunkHeader
    values: np.ndarray
    base: np.ndarray | None = None
    """The same elements of the previous version (updated in place by `DeltaCoder.encode`), or None: raw only."""
    delta: tuple[pb.ChunkHeader, bytes] | None = None
    _messages: dict[bool, bytes] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def parts(self, delta: bool) -> tuple[pb.ChunkHeader, bytes | np.ndarray]:
        """(header, payload) of the delta form when `delta` and one exists, else of the raw form."""
        return self.delta if delta and self.delta is not None else (self.header, self.values)

    def message(self, delta: bool) -> bytes:
        """The serialized PushChunk of `parts(delta)`, cached."""
        key = delta and self.delta is not None
        if key not in self._messages:
            self._messages[key] = encode_chunk(*self.parts(delta))
        return self._messages[key]


class DeltaCoder:
    """Encodes chunks against the previous version ('sparse' or 'xor_zstd') and brings that base up to date.

    Thread-safe: chunks are disjoint, and each thread keeps its own zstd compressor and scratch buffer, so a sender
    encodes several chunks at once (the compare is compute-bound).
    """

    def __init__(self, encoding: str, zstd_level: int) -> None:
        self.encoding = encoding
        self.zstd_level = zstd_level
        self._local = threading.local()

    def encode(self, chunk: Chunk) -> Chunk:
        """Fill `chunk.delta` (None when raw is smaller) from `chunk.base`, which equals `chunk.values` afterwards."""
        new, old = chunk.values, chunk.base
        assert old is not None, "encode needs the chunk's base"
        if self.encoding == "sparse":
            found = sparse_encode(new, old)
            if found is None:
                np.copyto(old, new)
                return chunk
            idx, changed = found
            old[idx] = changed
            chunk.delta = _with_encoding(chunk.header, pb.ENCODING_SPARSE), sparse_payload(idx, changed)
            return chunk
        local = self._local
        if getattr(local, "compressor", None) is None:
            local.compressor, local.scratch = zstandard.ZstdCompressor(level=self.zstd_level), np.empty(0, np.uint8)
        if local.scratch.nbytes < new.nbytes:
            local.scratch = np.empty(new.nbytes, dtype=np.uint8)
        xored = xor_encode(new, old, local.compressor, local.scratch[: new.nbytes].view(new.dtype))
        np.copyto(old, new)
        if xored is not None:
            chunk.delta = _with_encoding(chunk.header, pb.ENCODING_XOR_ZSTD), xored
        return chunk


def _with_encoding(chunk: pb.ChunkHeader, encoding: pb.Encoding) -> pb.ChunkHeader:
    coded = pb.ChunkHeader()
    coded.CopyFrom(chunk)
    coded.encoding = encoding
    return coded


def stream_chunks(
    group: list[Piece], bases: dict[tuple[str, tuple[int, ...]], np.ndarray | None], chunk_bytes: int,
    pool: futures.Executor,
) -> Iterator[Chunk]:
    """The chunks of one stream's pieces in order (`piece_chunks`, with each piece's base from `bases` by key).

    Each piece's checksum is computed on `pool` while the piece before it streams (xxhash releases the GIL): one piece
    ahead, so that the first chunk does not wait for it and its bytes are still in cache when they are sent.
    """
    ahead = pool.submit(group[0].checksum) if group else None
    try:
        for k, piece in enumerate(group):
            checksum = ahead
            ahead = pool.submit(group[k + 1].checksum) if k + 1 < len(group) else None
            yield from piece_chunks(piece, bases.get(piece.local.key), chunk_bytes, checksum)
    finally:  # a push that stopped early does not hash for nothing
        if ahead is not None:
            ahead.cancel()


def piece_chunks(
    piece: Piece, base: np.ndarray | None, chunk_bytes: int, checksum: futures.Future[int] | None = None
) -> Iterator[Chunk]:
    """The chunks of a piece, each with its slice of `base` (the previous version of the whole local shard) when one is
    given: `DeltaCoder.encode` then adds the delta form and updates that slice. `checksum`: the piece's checksum being
    computed elsewhere (`stream_chunks`), else it is computed here before the first chunk."""
    local = piece.local
    a, b = piece.span
    values = piece.values
    old = base[a:b] if base is not None else None
    offsets, shape = list(local.offsets), list(local.shape)
    if shape:
        offsets[0] += piece.row0
        shape[0] = piece.row1 - piece.row0
    digest = checksum.result() if checksum is not None else piece.checksum()
    header = pb.ShardHeader(name=local.name, offsets=offsets, shape=shape, xxh3_64=digest)
    step = max(1, chunk_bytes // values.itemsize)
    for begin in range(0, max(values.shape[0], 1), step):
        new = values[begin : begin + step]
        chunk = pb.ChunkHeader(element_offset=begin, num_elements=new.shape[0])
        if begin == 0:
            chunk.shard.CopyFrom(header)
        yield Chunk(chunk, new, old[begin : begin + step] if old is not None else None)
