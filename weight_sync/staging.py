"""The receiver's staging area: one update at a time, assembled from many streams, checked, then applied whole.

No gRPC server code and no torch here: every check raises `SyncError(status_code, message)` and the servicer turns it
into the gRPC status. State machine of an update keyed by (session_id, policy_version):
  open (ranks call Begin, streams write shards) -> committing (sink.apply running) -> gone (committed or dropped).
A failure anywhere (bad chunk, broken stream, Abort) marks it failed: nothing of it is ever applied. One update's state
and the per-chunk checks of its stream writers live in `weight_sync/update.py`.

Promises kept against any client:
- versions only move forward: one `apply` per update (concurrent and repeated Commits wait for and repeat the first
  one's answer), a Begin must be newer than the committed version and at most `max_version_gap` ahead, and an update
  must announce at least one tensor and cover each announced tensor exactly once;
- bounded memory: staging buffers are owned by exactly one of the free pool, the open update, or the delta base, so
  they never exceed 1x the manifest's bytes (2x with `keep_base`). A dropped update's open streams are cut at once
  (`StreamWriter.set_cancel`) and its buffers return to the pool when the last of them has stopped writing; a new
  update waits for that (up to `RELEASE_WAIT_S`) instead of allocating more;
- checks in time linear in shards (exact tiling by signed box corners, `layout.add_box_corners`);
- relays only where the rank's Begin said (`BeginRequest.relay_targets`, bounded per rank and per update: ranks that
  announce the same targets share one copy; `weight_sync/relay_targets.py`);
- no client starves the others: an update that waits for data and got none for `stream_idle_s` gives way to another
  session's Begin, the trainer's session (the one of the last commit) preempts any other session's update that is not
  being applied, a newer version of a session supersedes its older open update, and at most `MAX_COMMIT_WAITERS`
  Commits wait at once for an apply (each holds an RPC thread).
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np

from protos import weight_sync_pb2 as pb
from weight_sync.config import MAX_COMMIT_WAITERS
from weight_sync.layout import tiles_exactly
from weight_sync.relay_targets import announced_relay_targets, check_relay, shared_relay_targets
from weight_sync.spec import TensorSpec
from weight_sync.update import StagedUpdate, StreamWriter, SyncError, is_session_id, shown

__all__ = ["StagedUpdate", "StagingArea", "StreamWriter", "SyncError"]

log = logging.getLogger("weight_sync.receiver")

MAX_RANKS = 65536
MAX_STREAMS_PER_RANK = 64
MAX_POLICY_VERSION = 2**53 - 1  # exact in a double: JSON and JavaScript clients read it without rounding
RELEASE_WAIT_S = 5.0  # how long a new update waits for the cut streams of a dropped one to stop writing
NUM_REMEMBERED_COMMITS = 64  # Commit outcomes kept to answer repeated Commits alike
Code = grpc.StatusCode


def _answer(outcome: float | SyncError | None) -> float:
    """A Commit's answer: the apply seconds, or raise the refusal (a fresh exception: several threads may raise it)."""
    if isinstance(outcome, SyncError):
        raise SyncError(outcome.code, outcome.message)
    assert outcome is not None, "a finished Commit always has an outcome"
    return outcome


class StagingArea:
    """Receiver-side state: manifest, committed version, reusable staging buffers, delta bases, the open update.

    `policy_version` starts at the sink's committed version (a restarted receiver must not accept older ones).
    """

    def __init__(
        self,
        manifest: list[TensorSpec],
        *,
        keep_base: bool,
        idle_timeout_s: float,
        max_chunk_bytes: int,
        policy_version: int = 0,
        max_version_gap: int = 1 << 20,
        stream_idle_s: float | None = None,
        max_update_s: float = float("inf"),
    ) -> None:
        self.manifest = {spec.name: spec for spec in manifest}
        if len(self.manifest) != len(manifest):
            raise ValueError("the sink manifest lists a tensor name twice")
        if not 0 <= policy_version <= MAX_POLICY_VERSION:
            raise ValueError(f"committed policy_version {policy_version} is outside [0, {MAX_POLICY_VERSION}]")
        self.keep_base = keep_base
        self.idle_timeout_s = idle_timeout_s
        self.stream_idle_s = min(idle_timeout_s, stream_idle_s if stream_idle_s is not None else idle_timeout_s)
        self.max_update_s = max_update_s
        # The session of the last commit (before any: the one the sink started with, `WeightReceiver`'s sink_session),
        # preferred over any other and reported in BeginReply.committed_session_id.
        self.trainer_session: str | None = None
        self.on_refused: Callable[[str, int, SyncError], None] | None = None
        """Told (session, version, refusal) of each update a failed stream dropped (``stream_refused``)."""
        self.max_chunk_bytes = max_chunk_bytes
        self.max_version_gap = max_version_gap
        self.policy_version = policy_version
        self.version_changed = threading.Condition()
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified when a dropped update's buffers come back
        self._update: StagedUpdate | None = None
        self._zombies: set[StagedUpdate] = set()  # dropped updates whose cut streams have not stopped yet
        self._pool: dict[str, np.ndarray] = {}  # free buffers
        self._base: dict[str, np.ndarray] = {}
        self._allocated = 0
        self._bound = sum(s.nbytes for s in self.manifest.values()) * (2 if keep_base else 1)
        self._outcomes: collections.OrderedDict[tuple[str, int], float | SyncError] = collections.OrderedDict()

    @property
    def staging_bytes(self) -> int:
        """Bytes of every staging buffer this area holds (free pool, open or dropped updates, delta bases)."""
        return self._allocated

    @property
    def staging_bound_bytes(self) -> int:
        """The most `staging_bytes` can reach: the manifest's bytes, twice with delta bases."""
        return self._bound

    # -- Begin ---------------------------------------------------------------------------------------------------
    def begin(self, req: pb.BeginRequest) -> tuple[StagedUpdate, bool]:
        """Open or join the update (idempotent per rank); return it and whether this rank may send delta chunks."""
        session = req.session_id
        if not is_session_id(session):
            raise SyncError(
                Code.INVALID_ARGUMENT, f"session_id {shown(session)} must be 1-256 printable ASCII characters"
            )
        if not 1 <= req.num_ranks <= MAX_RANKS or not 0 <= req.rank < req.num_ranks:
            raise SyncError(Code.INVALID_ARGUMENT, f"rank {req.rank} of num_ranks {req.num_ranks} is out of range")
        if not 0 <= req.num_streams <= MAX_STREAMS_PER_RANK:
            raise SyncError(
                Code.INVALID_ARGUMENT, f"num_streams {req.num_streams} is outside [0, {MAX_STREAMS_PER_RANK}]"
            )
        num_streams = max(req.num_streams, 1)
        specs = tuple(self._check_spec(s) for s in req.tensors)
        if len({s.name for s in specs}) != len(specs):
            raise SyncError(Code.INVALID_ARGUMENT, "Begin lists a tensor twice")
        relay_targets, relay_fanout = announced_relay_targets(req)
        with self._lock:
            update = self._open_update(req)
            with update.lock:
                update.check_alive()
                if update.num_ranks != req.num_ranks:
                    raise SyncError(
                        Code.INVALID_ARGUMENT, f"num_ranks {req.num_ranks} != {update.num_ranks} of this update"
                    )
                if req.rank in update.rank_specs:
                    same = (
                        update.rank_specs[req.rank] == specs
                        and update.rank_streams[req.rank] == num_streams
                        and update.relay_targets[req.rank] == relay_targets
                        and update.relay_fanout[req.rank] == relay_fanout
                    )
                    if not same:
                        raise SyncError(
                            Code.INVALID_ARGUMENT,
                            f"rank {req.rank} called Begin again with other tensors, streams or relay targets",
                        )
                else:
                    relay_targets = shared_relay_targets(update, relay_targets)
                    self._add_specs(update, specs)
                    update.rank_specs[req.rank] = specs
                    update.rank_names[req.rank] = frozenset(s.name for s in specs)
                    update.rank_streams[req.rank] = num_streams
                    update.relay_targets[req.rank] = relay_targets
                    update.relay_fanout[req.rank] = relay_fanout
                    update.tickets[req.rank] = secrets.token_bytes(32)
                    update.last_activity = time.monotonic()  # a repeated Begin is no progress: it keeps nothing alive
                delta = (
                    self.keep_base
                    and req.base_version >= 0
                    and req.base_version == self.policy_version
                    and all(s.name in self._base for s in specs)
                )
                if delta:
                    update.delta_ranks.add(req.rank)
                update.drop_base = update.drop_base or req.drop_base
            return update, delta

    def _check_spec(self, msg: pb.TensorSpec) -> TensorSpec:
        spec = self.manifest.get(msg.name)
        if spec is None:
            raise SyncError(Code.NOT_FOUND, f"tensor {shown(msg.name)} is not in this receiver's manifest")
        if tuple(msg.shape) != spec.shape or msg.dtype != spec.dtype:
            raise SyncError(
                Code.INVALID_ARGUMENT,
                f"tensor {msg.name}: pushed {tuple(msg.shape)} {shown(msg.dtype)}, receiver expects {spec.shape} "
                f"{spec.dtype}",
            )
        return spec

    def _check_version(self, policy_version: int) -> None:
        if policy_version <= self.policy_version:
            raise SyncError(
                Code.FAILED_PRECONDITION,
                f"policy_version {policy_version} is not newer than the current {self.policy_version}",
            )
        limit = min(self.policy_version + self.max_version_gap, MAX_POLICY_VERSION)
        if policy_version > limit:
            raise SyncError(
                Code.OUT_OF_RANGE,
                f"policy_version {policy_version} jumps past {limit} (the current {self.policy_version} + "
                f"max_version_gap {self.max_version_gap}, at most 2^53 - 1); push the trainer's real step count, or "
                "raise the receiver's max_version_gap",
            )

    def _open_update(self, req: pb.BeginRequest) -> StagedUpdate:
        """The update `req` joins: the open one with its key, or a new one (caller holds self._lock).

        A new update waits (releasing the lock) until dropped updates have given their buffers back, so staging
        memory never grows past its bound whatever earlier clients left behind.
        """
        deadline = time.monotonic() + RELEASE_WAIT_S
        while True:
            self._check_version(req.policy_version)
            current = self._update
            if current is not None and current.key == (req.session_id, req.policy_version):
                return current
            if current is not None:
                self._drop(current, SyncError(Code.ABORTED, self._give_way(current, req)))
            if not self._zombies:
                self._update = StagedUpdate(req.session_id, req.policy_version, req.num_ranks)
                self._outcomes.pop(self._update.key, None)  # a refused earlier update of this key answers no more
                return self._update
            left = deadline - time.monotonic()
            if left <= 0:
                held = ", ".join(sorted(f"{z.update_id} ({len(z.writers)} streams)" for z in self._zombies))
                raise SyncError(
                    Code.RESOURCE_EXHAUSTED,
                    f"staging buffers are still in use by the cut streams of dropped updates {held}, "
                    f"{RELEASE_WAIT_S:.0f} s after they were dropped; retry the Begin",
                )
            self._released.wait(left)

    def _give_way(self, current: StagedUpdate, req: pb.BeginRequest) -> str:
        """Why the open update `current` gives way to `req`'s new one, or raise ABORTED when it keeps its place.

        In this order: an update being applied keeps it; a failed one gives way; a newer version of the same session
        supersedes it; the trainer's session (of the last commit) preempts another session's; an update idle for
        `stream_idle_s` while it waits for data, or for `idle_timeout_s` when complete, gives way to anyone; so does
        one open longer than `max_update_s` (a client that trickles a byte now and then holds the slot no longer).
        """
        if current.committing:
            raise SyncError(Code.ABORTED, f"update {current.update_id} is being applied; retry after its Commit")
        if current.failure is not None:
            return f"replaced by {req.session_id}@{req.policy_version} after it failed: {current.failure.message}"
        if current.session_id == req.session_id:
            if req.policy_version > current.policy_version:
                return f"superseded by its session's newer update {req.session_id}@{req.policy_version}"
            raise SyncError(
                Code.ABORTED,
                f"session {req.session_id} already began the newer update {current.update_id}; commit or abort it "
                "first",
            )
        if req.session_id == self.trainer_session:
            return f"preempted by the trainer's session {req.session_id} (the session of the last commit)"
        idle = time.monotonic() - current.last_activity
        with current.lock:
            limit = self.stream_idle_s if current.waits_for_data() else self.idle_timeout_s
        if idle > limit:
            return f"replaced by {req.session_id}@{req.policy_version} after {idle:.1f} s without traffic"
        age = time.monotonic() - current.opened
        if age > self.max_update_s:
            return (f"replaced by {req.session_id}@{req.policy_version}: open {age:.0f} s, longer than any push may "
                    f"take ({self.max_update_s:.0f} s)")  # fmt: skip
        raise SyncError(
            Code.ABORTED,
            f"update {current.update_id} is in progress (last traffic {idle:.1f} s ago; another session may replace it "
            f"after {limit:.0f} s without traffic, or once it has been open {self.max_update_s:.0f} s); retry after "
            "it commits or aborts",
        )

    def _add_specs(self, update: StagedUpdate, specs: tuple[TensorSpec, ...]) -> None:
        for spec in specs:
            if spec.name in update.specs:
                continue
            buf = self._pool.pop(spec.name, None)
            if buf is None:
                buf = np.empty(spec.nbytes, dtype=np.uint8)
                self._allocated += buf.nbytes
                assert self._allocated <= self._bound, "staging memory past its bound: a buffer leaked"
            update.specs[spec.name] = spec
            update.buffers[spec.name] = buf
            update.offsets_seen[spec.name] = set()
            update.corners[spec.name] = {}
            update.covered[spec.name] = 0

    def _drop(self, update: StagedUpdate, reason: SyncError) -> None:
        """Fail and forget `update` (caller holds self._lock). Its open streams are cut; its buffers go back to the
        pool now, or when the last of those streams has stopped writing (`writer_closed`)."""
        with update.lock:
            update.fail(reason)
            writers = list(update.writers)
        if self._update is update:
            self._update = None
        if not writers:
            self._release(update)
            return
        self._zombies.add(update)
        for writer in writers:
            writer.cancel()

    def _to_pool(self, name: str, buf: np.ndarray) -> None:
        """Keep `buf` as the free buffer of `name`, or let it go when the pool has one already (caller holds
        self._lock)."""
        if name in self._pool:
            self._allocated -= buf.nbytes
        else:
            self._pool[name] = buf

    def _release(self, update: StagedUpdate) -> None:
        """Return a dropped update's buffers to the pool (caller holds self._lock; no stream writes to them)."""
        for name, buf in update.buffers.items():
            self._to_pool(name, buf)
        update.buffers = {}
        self._zombies.discard(update)
        self._released.notify_all()

    # -- Push ----------------------------------------------------------------------------------------------------
    def open_stream(
        self,
        session_id: str,
        policy_version: int,
        rank: int,
        ticket: bytes | None = None,
        relay: Sequence[tuple[str, int | None]] = (),
        fanout: int = 0,
        memory_bytes: int = 0,
    ) -> StreamWriter:
        """A writer for one of `rank`'s Push streams.

        `ticket`: the one Begin gave the rank (socket and shared-memory data planes). `memory_bytes`: the size of the
        shared memory a shm-plane stream brings, at most the bytes of the tensors the rank's Begin announced, else
        RESOURCE_EXHAUSTED. `relay`: the (address, data port or None for a gRPC relay) this stream asks to be forwarded
        to, `fanout` children at most; each must have been announced in the rank's Begin, else PERMISSION_DENIED. A
        refusal opens nothing: the update stays as it was.
        """
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
                announced = sum(spec.nbytes for spec in update.rank_specs[rank])
                if memory_bytes > announced:
                    raise SyncError(
                        Code.RESOURCE_EXHAUSTED,
                        f"a shared-memory stream of {memory_bytes} bytes from rank {rank}, whose Begin announced "
                        f"tensors of {announced} bytes: size the memfd to the stream's share",
                    )
                if relay:
                    check_relay(update, rank, relay, fanout)
                opened = update.opened_streams.get(rank, 0)
                if opened >= update.rank_streams[rank]:
                    raise SyncError(Code.ALREADY_EXISTS, f"rank {rank} already opened its {opened} stream(s)")
                update.opened_streams[rank] = opened + 1
                writer = StreamWriter(self, update, rank)
                update.writers.add(writer)
                update.last_activity = writer.last_activity
        return writer

    def writer_closed(self, writer: StreamWriter, done: bool) -> None:
        """A StreamWriter stopped writing (`done`: it ended cleanly); after the last, a dropped update's buffers return
        to the pool."""
        update = writer.update
        with self._lock:
            with update.lock:
                if writer not in update.writers:
                    return
                update.writers.discard(writer)
                if done:
                    update.done_streams[writer.rank] = update.done_streams.get(writer.rank, 0) + 1
                    update.last_activity = time.monotonic()
                last = not update.writers
            if last and update in self._zombies:
                self._release(update)

    def fail(self, update: StagedUpdate, error: SyncError) -> None:
        with self._lock:
            self._drop(update, error)

    def stream_refused(self, update: StagedUpdate, rank: int, error: SyncError) -> None:
        """A stream of ``update`` failed (a bad chunk, a checksum, the client gone), dropping it: said in the log, and
        told to :attr:`on_refused` (the receiver's count of refused updates), whichever data plane carried it."""
        log.warning("dropped update %s: rank %d's stream failed: %s: %s", update.update_id, rank, error.code.name,
                    error.message)  # fmt: skip
        if self.on_refused is not None:
            self.on_refused(update.session_id, update.policy_version, error)

    def cut_stream(self, writer: StreamWriter, error: SyncError) -> bool:
        """Drop the update of a stream that is still writing (an idle one), cutting all its streams; False when the
        stream already stopped, or its update is being applied or was dropped already."""
        update = writer.update
        with self._lock:
            with update.lock:
                writing = writer in update.writers and not update.committing and update.failure is None
            if writing:
                self._drop(update, error)
            return writing

    def base_of(self, name: str) -> np.ndarray | None:
        return self._base.get(name)

    # -- Commit / Abort ------------------------------------------------------------------------------------------
    def commit(
        self,
        session_id: str,
        policy_version: int,
        apply: Callable[[int, Mapping[str, tuple[np.ndarray, TensorSpec]]], None],
        is_active: Callable[[], bool] = lambda: True,
    ) -> float:
        """Check completeness, call `apply(version, {name: (uint8 buffer, spec)})` once, move the version forward;
        return the apply seconds.

        Idempotent: a Commit of an update whose apply is running waits for it (while `is_active()`), and a Commit of
        one of the last `NUM_REMEMBERED_COMMITS` finished updates gets the same answer again; neither applies twice.
        At most `MAX_COMMIT_WAITERS` wait at once (each holds an RPC thread); more are refused RESOURCE_EXHAUSTED.
        """
        key = (session_id, policy_version)
        with self._lock:
            update = self._update
            if update is None or update.key != key:
                if key in self._outcomes:
                    return _answer(self._outcomes[key])
                raise SyncError(Code.NOT_FOUND, f"no open update {session_id}@{policy_version} to commit")
            first = not update.committing
            if first:
                try:
                    with update.lock:
                        update.check_alive()
                        self._check_complete(update)
                        update.committing = True
                except SyncError as e:
                    refused = SyncError(Code.FAILED_PRECONDITION, f"commit refused, update dropped: {e.message}")
                    self._drop(update, e)
                    self._finish(update, refused)
                    raise refused from None
            elif update.num_waiters >= MAX_COMMIT_WAITERS:
                raise SyncError(
                    Code.RESOURCE_EXHAUSTED,
                    f"{update.num_waiters} Commits already wait for the apply of {update.update_id}; retry the Commit "
                    "after it (a repeated Commit gets the same answer)",
                )
            else:
                update.num_waiters += 1
        if first:
            return self._apply(update, apply)
        try:
            while not update.committed.wait(0.5):  # another Commit of this update is applying it
                if not is_active():
                    raise SyncError(
                        Code.CANCELLED, f"Commit of {update.update_id} cancelled while another one applies it"
                    )
        finally:
            with self._lock:
                update.num_waiters -= 1
        return _answer(update.outcome)

    def _apply(
        self, update: StagedUpdate, apply: Callable[[int, Mapping[str, tuple[np.ndarray, TensorSpec]]], None]
    ) -> float:
        """Run the sink's apply for the update this thread marked committing, then move the version or drop it."""
        start = time.perf_counter()
        error: SyncError | None = None
        try:
            apply(update.policy_version, {n: (update.buffers[n], spec) for n, spec in update.specs.items()})
        except ValueError as e:
            error = SyncError(Code.INVALID_ARGUMENT, f"sink rejected the update: {e}")
        except Exception as e:  # the sink is user code: any failure rejects the update, the old version stays
            error = SyncError(Code.INTERNAL, f"sink failed to apply: {type(e).__name__}: {e}")
        seconds = time.perf_counter() - start
        with self._lock:
            if error is not None:
                update.committing = False
                self._drop(update, error)
                self._finish(update, error)
                raise error
            keep_base = self.keep_base and not update.drop_base
            for name in update.specs:
                buf = update.buffers[name]
                old = self._base.pop(name, None)
                if keep_base:
                    self._base[name] = buf
                    if old is not None:
                        self._to_pool(name, old)
                else:
                    self._to_pool(name, buf)
                    if old is not None:  # a base nobody will send deltas against: its memory goes
                        self._allocated -= old.nbytes
            update.buffers = {}
            assert update.policy_version > self.policy_version, "versions only move forward: one update at a time"
            self.policy_version = update.policy_version
            self.trainer_session = update.session_id
            if self._update is update:
                self._update = None
            self._finish(update, seconds)
        with self.version_changed:
            self.version_changed.notify_all()
        return seconds

    def _finish(self, update: StagedUpdate, outcome: float | SyncError) -> None:
        """Record a Commit's answer for the Commits waiting on it and for repeats (caller holds self._lock)."""
        self._outcomes[update.key] = outcome
        self._outcomes.move_to_end(update.key)
        while len(self._outcomes) > NUM_REMEMBERED_COMMITS:
            self._outcomes.popitem(last=False)
        update.outcome = outcome
        update.committed.set()

    @staticmethod
    def _check_complete(update: StagedUpdate) -> None:
        missing = sorted(set(range(update.num_ranks)) - set(update.rank_specs))
        if missing:
            raise SyncError(Code.FAILED_PRECONDITION, f"ranks {missing[:8]} never called Begin")
        if not update.specs:
            raise SyncError(
                Code.FAILED_PRECONDITION, "the update announces no tensor: each rank's Begin lists what it pushes"
            )
        unfinished = [r for r in range(update.num_ranks) if update.done_streams.get(r, 0) < update.rank_streams[r]]
        if unfinished:
            raise SyncError(Code.FAILED_PRECONDITION, f"ranks {unfinished[:8]} have not finished their push streams")
        for name, spec in update.specs.items():
            if update.covered[name] != spec.numel:
                raise SyncError(
                    Code.FAILED_PRECONDITION,
                    f"tensor {name}: {update.covered[name]} of {spec.numel} elements were pushed",
                )
            if not tiles_exactly(update.corners[name], spec.shape):
                raise SyncError(
                    Code.FAILED_PRECONDITION,
                    f"tensor {name}: its shards overlap (some elements were pushed twice and others not at all)",
                )

    def abort(self, session_id: str, policy_version: int, reason: str) -> bool:
        with self._lock:
            update = self._update
            if update is None or update.key != (session_id, policy_version) or update.committing:
                return False
            self._drop(update, SyncError(Code.ABORTED, f"aborted by the sender: {reason or 'no reason given'}"))
            return True
