"""One staged update: its state (`StagedUpdate`) and the writers of its Push streams (`StreamWriter`).

`weight_sync.staging.StagingArea` owns the updates, their buffers and the committed version; this module holds what
one update is made of and the per-chunk checks, with no locks of the area. A writer checks every chunk's header before
its payload is read, writes the payload into the update's staging buffer, and checks each shard's xxh3_64 at its end.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import numpy as np
import xxhash
import zstandard

from protos import weight_sync_pb2 as pb
from weight_sync.codec import DeltaError, sparse_decode, xor_decode
from weight_sync.layout import (
    Corners,
    add_box_corners,
    box_error,
    contiguous_range,
    read_range,
    shard_view,
    write_range,
)
from weight_sync.spec import TensorSpec, element_dtype

if TYPE_CHECKING:
    from weight_sync.staging import StagingArea

__all__ = ["MAX_SHARDS_PER_TENSOR", "StagedUpdate", "StreamWriter", "SyncError", "is_session_id", "shown"]

MAX_SHARDS_PER_TENSOR = 4096
Code = grpc.StatusCode


class SyncError(Exception):
    """A refused call: `code` is the gRPC status to answer with, `message` says what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def is_session_id(text: str) -> bool:
    """Whether ``text`` is a session id a Begin may carry: 1-256 printable ASCII characters."""
    return 1 <= len(text) <= 256 and text.isascii() and text.isprintable()


def shown(text: str, limit: int = 200) -> str:
    """A client's string as an error message quotes it: at most `limit` characters (a status message travels in gRPC
    metadata, whose size limit would otherwise replace the status with RESOURCE_EXHAUSTED)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r} (+{len(text) - limit} characters)"


@dataclasses.dataclass
class _Shard:
    name: str
    view: np.ndarray  # N-d view into the staging buffer (unsigned elements)
    base: np.ndarray | None  # same box in the committed base, for delta chunks
    numel: int
    checksum: int
    hasher: xxhash.xxh3_64
    pos: int = 0


@dataclasses.dataclass(eq=False)  # identity semantics: updates live in sets
class StagedUpdate:
    """One update being assembled. Mutated under `lock`; shard payload writes go to disjoint boxes without it."""

    session_id: str
    policy_version: int
    num_ranks: int
    specs: dict[str, TensorSpec] = dataclasses.field(default_factory=dict)
    buffers: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # owned by this update until released
    rank_specs: dict[int, tuple[TensorSpec, ...]] = dataclasses.field(default_factory=dict)
    rank_names: dict[int, frozenset[str]] = dataclasses.field(default_factory=dict)
    relay_targets: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)  # rank -> {address: data port}
    relay_sets: dict[frozenset[tuple[str, int]], dict[str, int]] = dataclasses.field(default_factory=dict)  # shared
    relay_fanout: dict[int, int] = dataclasses.field(default_factory=dict)
    delta_ranks: set[int] = dataclasses.field(default_factory=set)
    drop_base: bool = False  # some rank's Begin said it sends no delta against this version: keep no base of it
    rank_streams: dict[int, int] = dataclasses.field(default_factory=dict)  # streams each rank announced
    tickets: dict[int, bytes] = dataclasses.field(default_factory=dict)  # socket data-plane ticket per rank
    opened_streams: dict[int, int] = dataclasses.field(default_factory=dict)
    done_streams: dict[int, int] = dataclasses.field(default_factory=dict)
    writers: set[StreamWriter] = dataclasses.field(default_factory=set)  # streams that may still write
    offsets_seen: dict[str, set[tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    corners: dict[str, Corners] = dataclasses.field(default_factory=dict)  # signed box corners, see add_box_corners
    covered: dict[str, int] = dataclasses.field(default_factory=dict)
    failure: SyncError | None = None
    committing: bool = False
    num_waiters: int = 0  # Commits waiting for the one applying this update (StagingArea's lock)
    committed: threading.Event = dataclasses.field(default_factory=threading.Event)  # set when Commit has an answer
    outcome: float | SyncError | None = None  # that answer: the sink's apply seconds, or the refusal
    last_activity: float = dataclasses.field(default_factory=time.monotonic)
    opened: float = dataclasses.field(default_factory=time.monotonic)  # its first Begin
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def key(self) -> tuple[str, int]:
        return (self.session_id, self.policy_version)

    @property
    def update_id(self) -> str:
        return f"{self.session_id}@{self.policy_version}"

    def fail(self, error: SyncError) -> None:
        if self.failure is None:
            self.failure = error

    def waits_for_data(self) -> bool:
        """Some rank has not called Begin or has streams still to open or finish (caller holds `lock`)."""
        if len(self.rank_specs) < self.num_ranks:
            return True
        return any(self.done_streams.get(rank, 0) < streams for rank, streams in self.rank_streams.items())

    def check_alive(self) -> None:
        if self.failure is not None:
            raise SyncError(Code.ABORTED, f"update {self.update_id} was aborted: {self.failure.message}")


class StreamWriter:
    """Writes one rank's Push stream into the update; every method raises SyncError and never half-applies."""

    def __init__(self, area: StagingArea, update: StagedUpdate, rank: int) -> None:
        self.area, self.update, self.rank = area, update, rank
        self.delta = rank in update.delta_ranks
        self.shard: _Shard | None = None
        self.num_shards = 0
        self.bytes_received = 0
        self._pending: pb.ChunkHeader | None = None
        self._decompressor = zstandard.ZstdDecompressor()
        self._cancel: Callable[[], None] | None = None
        self.last_activity = time.monotonic()  # when the stream opened or its latest chunk began

    def set_cancel(self, cancel: Callable[[], None]) -> None:
        """How to cut this stream when its update is dropped (shut its socket, cancel its RPC and its relay): after
        `cancel()` the stream's thread must stop writing promptly and end with `close_failed`. Called at once when
        the update was already dropped."""
        with self.update.lock:
            self._cancel = cancel
            dropped = self.update.failure is not None
        if dropped:
            cancel()

    def cancel(self) -> None:
        """Cut this stream (its update was dropped); a no-op before `set_cancel`, which then cuts it itself."""
        if self._cancel is not None:
            self._cancel()

    def feed(self, header: pb.ChunkHeader, payload: memoryview) -> None:
        """Check and write one chunk (gRPC Push path)."""
        self.begin_chunk(header, len(payload))
        self.end_chunk(payload)

    def begin_chunk(self, header: pb.ChunkHeader, payload_bytes: int) -> memoryview | None:
        """Check a chunk's header before its payload is read; return the staging bytes a raw payload may be read into
        directly (contiguous destination), else None. Every call is followed by `end_chunk`."""
        update = self.update
        update.check_alive()
        update.last_activity = self.last_activity = time.monotonic()
        self.bytes_received += payload_bytes
        if header.HasField("shard"):
            if self.shard is not None and self.shard.pos != self.shard.numel:
                raise SyncError(Code.INVALID_ARGUMENT, f"shard of {self.shard.name} started before the previous ended")
            self.shard = self._declare(header.shard)
        shard = self.shard
        if shard is None:
            raise SyncError(Code.INVALID_ARGUMENT, "the first chunk of a stream must carry a shard header")
        n = header.num_elements
        elem = shard.view.dtype
        if header.element_offset != shard.pos:
            raise SyncError(
                Code.INVALID_ARGUMENT, f"{shard.name}: chunk at element {header.element_offset}, expected {shard.pos}"
            )
        if (n == 0 and shard.numel) or shard.pos + n > shard.numel:
            raise SyncError(
                Code.OUT_OF_RANGE,
                f"{shard.name}: chunk of {n} elements at {shard.pos} exceeds shard size {shard.numel}",
            )
        if n * elem.itemsize > self.area.max_chunk_bytes or payload_bytes > self.area.max_chunk_bytes:
            raise SyncError(
                Code.RESOURCE_EXHAUSTED,
                f"{shard.name}: chunk of {n * elem.itemsize} bytes (payload {payload_bytes}) exceeds "
                f"{self.area.max_chunk_bytes}",
            )
        self._pending = header
        if header.encoding == pb.ENCODING_RAW:
            if payload_bytes != n * elem.itemsize:
                raise SyncError(
                    Code.INVALID_ARGUMENT, f"{shard.name}: raw payload of {payload_bytes} bytes for {n} elements"
                )
            dest = contiguous_range(shard.view, shard.pos, n)
            return dest.data.cast("B") if dest is not None and n else None  # .data: memoryview(dest)
        if header.encoding in (pb.ENCODING_XOR_ZSTD, pb.ENCODING_SPARSE):
            if not self.delta or shard.base is None:
                raise SyncError(Code.FAILED_PRECONDITION, f"{shard.name}: delta chunk but Begin did not accept delta")
            return None
        raise SyncError(Code.INVALID_ARGUMENT, f"{shard.name}: unknown encoding {header.encoding}")

    @property
    def raw_hasher(self) -> xxhash.xxh3_64 | None:
        """The running checksum of the shard `begin_chunk` returned staging bytes of: a reader may feed it the bytes
        it reads there, in order (from cache, as they land), and say so with `end_chunk(None, hashed=True)`."""
        return self.shard.hasher if self.shard is not None else None

    def end_chunk(self, payload: memoryview | None, hashed: bool = False) -> None:
        """Write the chunk `begin_chunk` checked: `payload`, or None when it was read into the returned bytes (`hashed`:
        and fed to `raw_hasher` as it was read)."""
        header, shard = self._pending, self.shard
        assert header is not None and shard is not None, "end_chunk without begin_chunk"
        self._pending = None
        n = header.num_elements
        if header.encoding == pb.ENCODING_RAW:
            if payload is None:  # begin_chunk returned this range and the payload was read into it
                dest = contiguous_range(shard.view, shard.pos, n)
                assert dest is not None, "end_chunk(None) after a chunk with no contiguous destination"
                if not hashed:
                    shard.hasher.update(dest.data)
            else:
                values = np.frombuffer(payload, dtype=shard.view.dtype)
                shard.hasher.update(values.data)
                write_range(shard.view, shard.pos, values)
        else:
            assert payload is not None, "end_chunk(None) after a delta chunk"
            try:
                self._apply_delta(header.encoding, payload, shard, n)
            except DeltaError as e:
                raise SyncError(Code.DATA_LOSS, f"{shard.name}: {e}") from None
        shard.pos += n
        if shard.pos == shard.numel and shard.hasher.intdigest() != shard.checksum:
            raise SyncError(Code.DATA_LOSS, f"{shard.name}: checksum mismatch for shard ending at element {shard.pos}")

    def _apply_delta(self, encoding: int, payload: memoryview, shard: _Shard, n: int) -> None:
        assert shard.base is not None, "begin_chunk accepts delta chunks only for shards with a base"
        base = read_range(shard.base, shard.pos, n)
        if encoding == pb.ENCODING_SPARSE:
            idx, new = sparse_decode(payload, n, shard.view.dtype)
            dest = contiguous_range(shard.view, shard.pos, n)
            if dest is not None:  # dim-0 shards: patch the staging buffer in place, no temporary
                np.copyto(dest, base)
                dest[idx] = new
                shard.hasher.update(dest.data)
                return
            values = np.array(base, copy=True)
            values[idx] = new
        else:
            values = xor_decode(payload, base, self._decompressor)
        shard.hasher.update(values.data)
        write_range(shard.view, shard.pos, values)

    def _declare(self, msg: pb.ShardHeader) -> _Shard:
        """Check a new shard's box and record it; O(2^ndim), so any number of shards costs linear time.

        Overlaps that are certain here (a box declared twice, more elements than the tensor has) are refused now
        (INVALID_ARGUMENT); any other overlap leaves a gap too, and Commit's exact-tiling check refuses it.
        """
        update = self.update
        offsets, shape = tuple(msg.offsets), tuple(msg.shape)
        with update.lock:
            spec = update.specs.get(msg.name)
            if spec is None:
                if msg.name not in self.area.manifest:
                    raise SyncError(Code.NOT_FOUND, f"tensor {shown(msg.name)} is not in this receiver's manifest")
                raise SyncError(Code.FAILED_PRECONDITION, f"tensor {msg.name} was not announced in Begin")
            if msg.name not in update.rank_names[self.rank]:
                raise SyncError(Code.FAILED_PRECONDITION, f"rank {self.rank} did not announce {msg.name} in Begin")
            problem = box_error(spec.shape, offsets, shape)
            if problem:
                raise SyncError(Code.OUT_OF_RANGE, f"{msg.name}: {problem}")
            seen = update.offsets_seen[msg.name]
            if len(seen) >= MAX_SHARDS_PER_TENSOR:
                raise SyncError(Code.RESOURCE_EXHAUSTED, f"{msg.name}: more than {MAX_SHARDS_PER_TENSOR} shards")
            numel = 1
            for s in shape:
                numel *= s
            if spec.numel:
                if offsets in seen:
                    raise SyncError(Code.INVALID_ARGUMENT, f"{msg.name}: shard at {offsets} {shape} was pushed twice")
                if update.covered[msg.name] + numel > spec.numel:
                    raise SyncError(
                        Code.INVALID_ARGUMENT,
                        f"{msg.name}: shard at {offsets} {shape} overlaps others: its shards hold "
                        f"{update.covered[msg.name] + numel} elements of {spec.numel}",
                    )
            seen.add(offsets)
            add_box_corners(update.corners[msg.name], offsets, shape)
            update.covered[msg.name] += numel
        elem = element_dtype(spec.dtype)
        view = shard_view(update.buffers[msg.name].view(elem), spec.shape, offsets, shape)
        base = self.area.base_of(msg.name) if self.delta else None
        base_view = shard_view(base.view(elem), spec.shape, offsets, shape) if base is not None else None
        self.num_shards += 1
        shard = _Shard(msg.name, view, base_view, numel, msg.xxh3_64, xxhash.xxh3_64())
        if numel == 0 and shard.checksum != shard.hasher.intdigest():
            raise SyncError(Code.DATA_LOSS, f"{msg.name}: checksum mismatch for an empty shard")
        return shard

    def finish(self) -> None:
        """The stream ended cleanly: every shard it started must be complete."""
        update = self.update
        update.check_alive()
        if self.shard is not None and self.shard.pos != self.shard.numel:
            raise SyncError(
                Code.INVALID_ARGUMENT,
                f"stream ended inside shard of {self.shard.name} ({self.shard.pos} of {self.shard.numel} elements)",
            )
        self.area.writer_closed(self, done=True)

    def summary(self, seconds: float) -> str:
        """One log line about this stream after it ended cleanly in ``seconds``."""
        u, nbytes = self.update, self.bytes_received
        rate = nbytes / max(seconds, 1e-9) / 1e9
        return (
            f"{u.session_id}@{u.policy_version} rank {self.rank}: {self.num_shards} shards, "
            f"{nbytes / 1e6:.1f} MB in {seconds:.3f} s ({rate:.2f} GB/s)"
        )

    def close_failed(self, error: SyncError) -> None:
        """The stream failed or broke: it writes nothing more, and the whole update is dropped (the first stream of
        the update to fail is reported: ``StagingArea.stream_refused``)."""
        first = self.update.failure is None
        self.area.writer_closed(self, done=False)
        self.area.fail(self.update, error)
        if first:
            self.area.stream_refused(self.update, self.rank, error)

