"""The receiver's staging area: one update at a time, assembled from many streams, checked, then applied whole.

No gRPC server code and no torch here: every check raises `SyncError(status_code, message)` and the servicer turns it
into the gRPC status. State machine of an update keyed by (session_id, policy_version):
  open (ranks call Begin, streams write shards) -> committing (sink.apply running) -> gone (committed or dropped).
A failure anywhere (bad chunk, broken stream, Abort) marks it failed: nothing of it is ever applied.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Mapping

import grpc
import numpy as np
import xxhash
import zstandard

from protos import weight_sync_pb2 as pb
from weight_sync.codec import DeltaError, sparse_decode, xor_decode
from weight_sync.layout import box_error, boxes_overlap, contiguous_range, read_range, shard_view, write_range
from weight_sync.spec import TensorSpec, element_dtype

__all__ = ["StagedUpdate", "StagingArea", "StreamWriter", "SyncError"]

MAX_SHARDS_PER_TENSOR = 4096
MAX_RANKS = 65536
MAX_STREAMS_PER_RANK = 64
Code = grpc.StatusCode


class SyncError(Exception):
    """A refused call: `code` is the gRPC status to answer with, `message` says what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass
class _Shard:
    name: str
    view: np.ndarray  # N-d view into the staging buffer (unsigned elements)
    base: np.ndarray | None  # same box in the committed base, for delta chunks
    numel: int
    checksum: int
    hasher: xxhash.xxh3_64
    pos: int = 0


@dataclasses.dataclass
class StagedUpdate:
    """One update being assembled. Mutated under `lock`; shard payload writes go to disjoint boxes without it."""

    session_id: str
    policy_version: int
    num_ranks: int
    specs: dict[str, TensorSpec] = dataclasses.field(default_factory=dict)
    buffers: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    rank_specs: dict[int, tuple[TensorSpec, ...]] = dataclasses.field(default_factory=dict)
    delta_ranks: set[int] = dataclasses.field(default_factory=set)
    rank_streams: dict[int, int] = dataclasses.field(default_factory=dict)  # streams each rank announced
    tickets: dict[int, bytes] = dataclasses.field(default_factory=dict)  # socket data-plane ticket per rank
    opened_streams: dict[int, int] = dataclasses.field(default_factory=dict)
    done_streams: dict[int, int] = dataclasses.field(default_factory=dict)
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = dataclasses.field(default_factory=dict)
    covered: dict[str, int] = dataclasses.field(default_factory=dict)
    failure: SyncError | None = None
    committing: bool = False
    active_streams: int = 0
    last_activity: float = dataclasses.field(default_factory=time.monotonic)
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

    def check_alive(self) -> None:
        if self.failure is not None:
            raise SyncError(Code.ABORTED, f"update {self.update_id} was aborted: {self.failure.message}")


class StagingArea:
    """Receiver-side state: manifest, committed version, reusable staging buffers, delta bases, the open update."""

    def __init__(self, manifest: list[TensorSpec], *, keep_base: bool, idle_timeout_s: float, max_chunk_bytes: int):
        self.manifest = {spec.name: spec for spec in manifest}
        if len(self.manifest) != len(manifest):
            raise ValueError("the sink manifest lists a tensor name twice")
        self.keep_base = keep_base
        self.idle_timeout_s = idle_timeout_s
        self.max_chunk_bytes = max_chunk_bytes
        self.policy_version = 0
        self.version_changed = threading.Condition()
        self._lock = threading.Lock()
        self._update: StagedUpdate | None = None
        self._pool: dict[str, np.ndarray] = {}
        self._base: dict[str, np.ndarray] = {}

    # -- Begin ---------------------------------------------------------------------------------------------------
    def begin(self, req: pb.BeginRequest) -> tuple[StagedUpdate, bool]:
        """Open or join the update (idempotent per rank); return it and whether this rank may send delta chunks."""
        if not req.session_id or len(req.session_id) > 256:
            raise SyncError(Code.INVALID_ARGUMENT, "session_id must be 1-256 characters")
        if not 1 <= req.num_ranks <= MAX_RANKS or not 0 <= req.rank < req.num_ranks:
            raise SyncError(Code.INVALID_ARGUMENT, f"rank {req.rank} of num_ranks {req.num_ranks} is out of range")
        num_streams = max(req.num_streams, 1)
        if num_streams > MAX_STREAMS_PER_RANK:
            raise SyncError(Code.INVALID_ARGUMENT, f"num_streams {num_streams} exceeds {MAX_STREAMS_PER_RANK}")
        specs = tuple(self._check_spec(s) for s in req.tensors)
        if len({s.name for s in specs}) != len(specs):
            raise SyncError(Code.INVALID_ARGUMENT, "Begin lists a tensor twice")
        with self._lock:
            if req.policy_version <= self.policy_version:
                raise SyncError(
                    Code.FAILED_PRECONDITION,
                    f"policy_version {req.policy_version} is not newer than the current {self.policy_version}",
                )
            update = self._open_update(req)
            with update.lock:
                update.check_alive()
                if update.num_ranks != req.num_ranks:
                    raise SyncError(
                        Code.INVALID_ARGUMENT, f"num_ranks {req.num_ranks} != {update.num_ranks} of this update"
                    )
                if req.rank in update.rank_specs:
                    if update.rank_specs[req.rank] != specs or update.rank_streams[req.rank] != num_streams:
                        raise SyncError(Code.INVALID_ARGUMENT, f"rank {req.rank} called Begin again with other tensors")
                else:
                    self._add_specs(update, specs)
                    update.rank_specs[req.rank] = specs
                    update.rank_streams[req.rank] = num_streams
                    update.tickets[req.rank] = secrets.token_bytes(32)
                delta = (
                    self.keep_base
                    and req.base_version >= 0
                    and req.base_version == self.policy_version
                    and all(s.name in self._base for s in specs)
                )
                if delta:
                    update.delta_ranks.add(req.rank)
                update.last_activity = time.monotonic()
            return update, delta

    def _check_spec(self, msg: pb.TensorSpec) -> TensorSpec:
        spec = self.manifest.get(msg.name)
        if spec is None:
            raise SyncError(Code.NOT_FOUND, f"tensor {msg.name!r} is not in this receiver's manifest")
        if tuple(msg.shape) != spec.shape or msg.dtype != spec.dtype:
            raise SyncError(
                Code.INVALID_ARGUMENT,
                f"tensor {msg.name}: pushed {tuple(msg.shape)} {msg.dtype}, receiver expects {spec.shape} {spec.dtype}",
            )
        return spec

    def _open_update(self, req: pb.BeginRequest) -> StagedUpdate:
        current = self._update
        if current is not None and current.key == (req.session_id, req.policy_version):
            return current
        if current is not None:
            stale = time.monotonic() - current.last_activity > self.idle_timeout_s
            if current.committing or (current.failure is None and not stale):
                raise SyncError(
                    Code.ABORTED,
                    f"update {current.update_id} is in progress; retry after it commits or aborts",
                )
            self._drop(current, SyncError(Code.ABORTED, "replaced by a newer update"))
        self._update = StagedUpdate(req.session_id, req.policy_version, req.num_ranks)
        return self._update

    def _add_specs(self, update: StagedUpdate, specs: tuple[TensorSpec, ...]) -> None:
        for spec in specs:
            if spec.name in update.specs:
                continue
            buf = self._pool.get(spec.name)
            if buf is None:
                buf = np.empty(spec.nbytes, dtype=np.uint8)
                self._pool[spec.name] = buf
            update.specs[spec.name] = spec
            update.buffers[spec.name] = buf
            update.boxes[spec.name] = []
            update.covered[spec.name] = 0

    def _drop(self, update: StagedUpdate, reason: SyncError) -> None:
        """Forget `update` (caller holds self._lock). Buffers a live stream may still write to are not reused."""
        with update.lock:
            update.fail(reason)
            if update.active_streams:
                for name, buf in update.buffers.items():
                    if self._pool.get(name) is buf:
                        del self._pool[name]
        if self._update is update:
            self._update = None

    # -- Push ----------------------------------------------------------------------------------------------------
    def open_stream(
        self, session_id: str, policy_version: int, rank: int, ticket: bytes | None = None
    ) -> StreamWriter:
        """A writer for one of `rank`'s Push streams. `ticket`: the one Begin gave the rank (socket data plane)."""
        with self._lock:
            update = self._update
            if update is None or update.key != (session_id, policy_version):
                raise SyncError(Code.NOT_FOUND, f"no open update {session_id}@{policy_version}; call Begin first")
            with update.lock:
                update.check_alive()
                if rank not in update.rank_specs:
                    raise SyncError(Code.FAILED_PRECONDITION, f"rank {rank} pushed before calling Begin")
                if ticket is not None and not hmac.compare_digest(ticket, update.tickets[rank]):
                    raise SyncError(Code.UNAUTHENTICATED, f"data-plane ticket of rank {rank} does not match its Begin")
                opened = update.opened_streams.get(rank, 0)
                if opened >= update.rank_streams[rank]:
                    raise SyncError(Code.ALREADY_EXISTS, f"rank {rank} already opened its {opened} stream(s)")
                update.opened_streams[rank] = opened + 1
                update.active_streams += 1
        return StreamWriter(self, update, rank)

    def fail(self, update: StagedUpdate, error: SyncError) -> None:
        with self._lock:
            self._drop(update, error)

    def base_of(self, name: str) -> np.ndarray | None:
        return self._base.get(name)

    # -- Commit / Abort ------------------------------------------------------------------------------------------
    def commit(
        self,
        session_id: str,
        policy_version: int,
        apply: Callable[[int, Mapping[str, tuple[np.ndarray, TensorSpec]]], None],
    ) -> float:
        """Check completeness, call `apply(version, {name: (uint8 buffer, spec)})`, move the version; return seconds."""
        with self._lock:
            update = self._update
            if update is None or update.key != (session_id, policy_version):
                raise SyncError(Code.NOT_FOUND, f"no open update {session_id}@{policy_version} to commit")
            try:
                with update.lock:
                    update.check_alive()
                    self._check_complete(update)
                    update.committing = True
            except SyncError as e:
                self._drop(update, e)
                raise SyncError(Code.FAILED_PRECONDITION, f"commit refused, update dropped: {e.message}") from None
        start = time.perf_counter()
        try:
            apply(policy_version, {name: (update.buffers[name], spec) for name, spec in update.specs.items()})
        except ValueError as e:
            self._finish_failed(update, SyncError(Code.INVALID_ARGUMENT, f"sink rejected the update: {e}"))
        except Exception as e:  # the sink is user code: any failure rejects the update, the old version stays
            self._finish_failed(update, SyncError(Code.INTERNAL, f"sink failed to apply: {type(e).__name__}: {e}"))
        seconds = time.perf_counter() - start
        with self._lock:
            for name in update.specs:
                if self.keep_base:
                    old = self._base.get(name)
                    self._base[name] = update.buffers[name]
                    if old is not None:
                        self._pool[name] = old
                    else:
                        self._pool.pop(name, None)
            self.policy_version = policy_version
            self._update = None
        with self.version_changed:
            self.version_changed.notify_all()
        return seconds

    def _finish_failed(self, update: StagedUpdate, error: SyncError) -> None:
        with self._lock:
            update.committing = False
            self._drop(update, error)
        raise error

    @staticmethod
    def _check_complete(update: StagedUpdate) -> None:
        missing = sorted(set(range(update.num_ranks)) - set(update.rank_specs))
        if missing:
            raise SyncError(Code.FAILED_PRECONDITION, f"ranks {missing[:8]} never called Begin")
        unfinished = [r for r in range(update.num_ranks) if update.done_streams.get(r, 0) < update.rank_streams[r]]
        if unfinished:
            raise SyncError(Code.FAILED_PRECONDITION, f"ranks {unfinished[:8]} have not finished their push streams")
        for name, spec in update.specs.items():
            if update.covered[name] != spec.numel:
                raise SyncError(
                    Code.FAILED_PRECONDITION,
                    f"tensor {name}: {update.covered[name]} of {spec.numel} elements were pushed",
                )

    def abort(self, session_id: str, policy_version: int, reason: str) -> bool:
        with self._lock:
            update = self._update
            if update is None or update.key != (session_id, policy_version) or update.committing:
                return False
            self._drop(update, SyncError(Code.ABORTED, f"aborted by the sender: {reason or 'no reason given'}"))
            return True


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

    def feed(self, header: pb.ChunkHeader, payload: memoryview) -> None:
        """Check and write one chunk (gRPC Push path)."""
        self.begin_chunk(header, len(payload))
        self.end_chunk(payload)

    def begin_chunk(self, header: pb.ChunkHeader, payload_bytes: int) -> memoryview | None:
        """Check a chunk's header before its payload is read; return the staging bytes a raw payload may be read into
        directly (contiguous destination), else None. Every call is followed by `end_chunk`."""
        update = self.update
        update.check_alive()
        update.last_activity = time.monotonic()
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
                f"{shard.name}: chunk of {n * elem.itemsize} bytes exceeds {self.area.max_chunk_bytes}",
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

    def end_chunk(self, payload: memoryview | None) -> None:
        """Write the chunk `begin_chunk` checked: `payload`, or None when it was read into the returned bytes."""
        header, shard = self._pending, self.shard
        assert header is not None and shard is not None, "end_chunk without begin_chunk"
        self._pending = None
        n = header.num_elements
        if header.encoding == pb.ENCODING_RAW:
            if payload is None:  # begin_chunk returned this range and the payload was read into it
                dest = contiguous_range(shard.view, shard.pos, n)
                assert dest is not None, "end_chunk(None) after a chunk with no contiguous destination"
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
        update = self.update
        offsets, shape = tuple(msg.offsets), tuple(msg.shape)
        with update.lock:
            spec = update.specs.get(msg.name)
            if spec is None:
                if msg.name not in self.area.manifest:
                    raise SyncError(Code.NOT_FOUND, f"tensor {msg.name!r} is not in this receiver's manifest")
                raise SyncError(Code.FAILED_PRECONDITION, f"tensor {msg.name} was not announced in Begin")
            if msg.name not in {s.name for s in update.rank_specs[self.rank]}:
                raise SyncError(Code.FAILED_PRECONDITION, f"rank {self.rank} did not announce {msg.name} in Begin")
            problem = box_error(spec.shape, offsets, shape)
            if problem:
                raise SyncError(Code.OUT_OF_RANGE, f"{msg.name}: {problem}")
            boxes = update.boxes[msg.name]
            for other_off, other_shape in boxes:
                if boxes_overlap(offsets, shape, other_off, other_shape):
                    raise SyncError(
                        Code.INVALID_ARGUMENT,
                        f"{msg.name}: shard at {offsets} {shape} overlaps shard at {other_off} {other_shape}",
                    )
            if len(boxes) >= MAX_SHARDS_PER_TENSOR:
                raise SyncError(Code.RESOURCE_EXHAUSTED, f"{msg.name}: more than {MAX_SHARDS_PER_TENSOR} shards")
            numel = 1
            for s in shape:
                numel *= s
            boxes.append((offsets, shape))
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
        with update.lock:
            update.done_streams[self.rank] = update.done_streams.get(self.rank, 0) + 1
            update.active_streams -= 1

    def summary(self, seconds: float) -> str:
        """One log line about this stream after it ended cleanly in ``seconds``."""
        u, nbytes = self.update, self.bytes_received
        rate = nbytes / max(seconds, 1e-9) / 1e9
        return (
            f"{u.session_id}@{u.policy_version} rank {self.rank}: {self.num_shards} shards, "
            f"{nbytes / 1e6:.1f} MB in {seconds:.3f} s ({rate:.2f} GB/s)"
        )

    def close_failed(self, error: SyncError) -> None:
        with self.update.lock:
            self.update.active_streams -= 1
        self.area.fail(self.update, error)

