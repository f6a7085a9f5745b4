"""A pool of rollout workers (Ray actors): groups spread by load, generation ahead of training, dead workers replaced.

    pool = RolloutPool(rollout_config, reward=reward_config, weight_sync=sync_config)
    handle = pool.submit(problems, group_size=8)      # returns at once; generation runs on the workers
    ...                                               # train on the previous batch meanwhile (async mode)
    batch = pool.collect(handle)                      # RolloutBatch: len(problems) * 8 samples
    sender_endpoints = pool.receiver_addresses()      # push the next version here (re-read after every collect)
    pool.resync(failed_addresses)                     # workers the push did not reach: no work until caught up
    pool.set_policy_version(version)                  # ...and say it was committed
    pool.set_weight_publisher(push_to)                # push_to(addresses) -> version: catches up a lone replacement
    pool.shutdown()

Scheduling: the groups of one ``submit`` are cut into pieces of at most ``max_groups_per_dispatch`` groups (and no
more than an even share per worker); all samples of a group stay on one worker (they share the prompt's KV cache).
Each piece goes to the ready worker with the fewest groups in flight, so pieces of several outstanding submits
interleave.

Failure: a piece whose worker died is sent again to the least loaded live worker, and the dead worker is replaced
(at most ``num_worker_restarts`` times over the pool's life). A replacement takes no work until it serves the pool's
:attr:`policy_version`: the newest version the trainer committed, which the driver reports with
:meth:`set_policy_version` after every push (the pool also raises it to any version it sees a worker serve). The
replacement gets that version from, in this order: a live peer serving it (which pushes its retained copy over
gRPC); the weight publisher of :meth:`set_weight_publisher` (the trainer pushes its current weights to just that
worker: the source when no peer is left, e.g. in a pool of one); the checkpoint directory of :meth:`set_weight_source`;
or else the trainer's next regular push, which reaches it because :meth:`receiver_addresses` lists it from then on.
So a replacement never generates with weights older than the last committed version, and a batch hit by a death needs
no regeneration. A live worker that a push did not reach (its receiver failed or refused the update) is treated the
same way after :meth:`resync`: it keeps serving its old version, so it takes no new work until it has caught up from
those sources; if the weight publisher cannot reach it either, it is replaced. A replacement's receiver address
differs from the dead worker's, so the trainer's sender must follow :meth:`receiver_addresses`. Errors raised by a
worker itself (a reward function failing the step, a bad prompt) are not retried: they surface from :meth:`collect`;
a worker whose engine broke during a weight update (``EngineBrokenError``) counts as dead.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rollout.config import RolloutConfig, SamplingConfig
from rollout.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from rollout.rewards.config import RewardConfig
    from rollout.tasks.problem import Problem
    from weight_sync.config import WeightSyncConfig

__all__ = ["RolloutHandle", "RolloutPool"]

log = logging.getLogger(__name__)


@dataclass
class RolloutHandle:
    """What :meth:`RolloutPool.submit` returns; pass it to :meth:`RolloutPool.collect`."""

    handle_id: int
    num_groups: int
    group_size: int
    submitted_at: float


@dataclass
class _Worker:
    actor: Any
    address: str | None = None
    ready_ref: Any = None
    """In-flight call of a replacement that does not take work yet (starting, then catching up on weights); ``None``
    once it serves the pool's version."""
    awaiting_push: bool = False
    """The replacement waits for the trainer's next regular push (nothing else holds the version it needs)."""
    num_inflight_groups: int = 0


@dataclass
class _Piece:
    handle_id: int
    problems: list[Problem]
    group_ids: list[int]
    group_size: int
    sampling: SamplingConfig
    worker: _Worker | None = None
    ref: Any = None
    num_dispatches: int = 0
    done: bool = False


@dataclass
class _Pending:
    handle: RolloutHandle
    pieces: list[_Piece]
    results: list[RolloutBatch] = field(default_factory=list)
    num_redispatched: int = 0


class RolloutPool:
    """M :class:`rollout.worker.RolloutWorker` actors behind a submit/collect API; see the module docstring."""

    def __init__(
        self,
        config: RolloutConfig,
        reward: RewardConfig | None = None,
        weight_sync: WeightSyncConfig | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        import ray

        from rollout.worker import RolloutWorker

        self.config = config
        self._worker_args = (config, reward, weight_sync)
        # Threaded actors: health/version calls answer while a generation batch runs; the engine lock orders the rest.
        self._actor_cls = ray.remote(
            num_cpus=config.num_cpus_per_worker, num_gpus=config.num_gpus_per_worker, max_concurrency=4
        )(RolloutWorker)
        self._workers = [_Worker(self._actor_cls.remote(*self._worker_args)) for _ in range(config.num_workers)]
        addresses = ray.get([w.actor.receiver_address.remote() for w in self._workers], timeout=startup_timeout_s)
        for worker, address in zip(self._workers, addresses):
            worker.address = address
        self._num_restarts = 0
        self._ids = itertools.count()
        self._next_group_id = 0
        self._pending: dict[int, _Pending] = {}
        self._weight_source: tuple[str, int] | None = None
        self._publisher: Callable[[list[str]], int] | None = None
        self._policy_version = 0

    # -- public API ------------------------------------------------------------------------------------------------
    def submit(
        self, problems: Sequence[Problem], group_size: int, sampling: SamplingConfig | None = None
    ) -> RolloutHandle:
        """Start generating ``group_size`` samples for each problem; returns at once. Group ids are unique per pool."""
        if not problems:
            raise ValueError("submit() needs at least one problem")
        if group_size < 1:
            raise ValueError(f"group_size={group_size} must be at least 1")
        sampling = sampling or self.config.sampling
        handle = RolloutHandle(next(self._ids), len(problems), group_size, time.perf_counter())
        group_ids = list(range(self._next_group_id, self._next_group_id + len(problems)))
        self._next_group_id += len(problems)
        share = math.ceil(len(problems) / max(1, len(self._ready_workers())))
        size = max(1, min(self.config.max_groups_per_dispatch, share))
        pieces = [
            _Piece(handle.handle_id, list(problems[i : i + size]), group_ids[i : i + size], group_size, sampling)
            for i in range(0, len(problems), size)
        ]
        self._pending[handle.handle_id] = _Pending(handle, pieces)
        for piece in pieces:
            self._dispatch(piece)
        return handle

    def collect(self, handle: RolloutHandle, timeout_s: float | None = None) -> RolloutBatch:
        """Wait for every group of ``handle`` and return them (samples ordered by group id, then sample index).

        Re-dispatches pieces of dead workers and replaces those workers on the way (a replacement runs pieces only
        once it serves :attr:`policy_version`). Raises ``TimeoutError`` after ``timeout_s``, and ``RuntimeError`` when
        workers keep dying past ``num_worker_restarts`` or when no worker can serve without the trainer's next push.
        """
        import ray

        pending = self._pending.get(handle.handle_id)
        if pending is None:
            raise ValueError(f"unknown or already collected handle {handle.handle_id}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all(p.done for p in pending.pieces):
            for piece in pending.pieces:
                if piece.ref is None and not piece.done:
                    self._dispatch(piece)  # it waited for a ready worker
            refs = [p.ref for p in pending.pieces if p.ref is not None]
            self._check_progress(bool(refs))
            refs += [w.ready_ref for w in self._workers if w.ready_ref is not None]
            assert refs, "pieces left but neither a running piece nor a starting worker"
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(refs, num_returns=1, timeout=left)
            if not done:
                raise TimeoutError(f"rollout handle {handle.handle_id}: not complete after {timeout_s} s")
            self._settle(done[0], pending)
        del self._pending[handle.handle_id]
        return _merge(pending, time.perf_counter() - handle.submitted_at)

    def receiver_addresses(self) -> list[str]:
        """Weight receivers to push the next version to: the serving workers and replacements waiting for that push
        (changes when a worker is replaced)."""
        self._poll_startups()
        listed = [w for w in self._workers if w.ready_ref is None or w.awaiting_push]
        return [w.address for w in listed if w.address is not None]

    @property
    def policy_version(self) -> int:
        """Newest committed weights version the pool knows of; replacements take work only once they serve it."""
        return self._policy_version

    def set_policy_version(self, policy_version: int) -> None:
        """Tell the pool the trainer committed ``policy_version`` to its receivers (call after every push; it never
        moves back)."""
        self._policy_version = max(self._policy_version, policy_version)

    def resync(self, addresses: Sequence[str]) -> None:
        """Workers at ``addresses`` missed the last push (failed or refused): give them no new work until they serve
        :attr:`policy_version` again, caught up like a replacement (see the module docstring). Call it together with
        :meth:`set_policy_version` for that push; addresses that are not this pool's workers (external servers) and
        workers already catching up are ignored. Pieces already running on them finish as they are."""
        missed = set(addresses)
        for worker in self._workers:
            if worker.address in missed and worker.ready_ref is None:
                worker.ready_ref = worker.actor.policy_version.remote()

    def set_weight_publisher(self, publish: Callable[[list[str]], int] | None) -> None:
        """Register ``publish(addresses) -> policy_version``: push the trainer's current weights to just these
        receivers now, and return the version pushed (raise when the push failed).

        The pool calls it from :meth:`collect` / :meth:`wait_for_workers` for a replacement when no live peer serves
        :attr:`policy_version`. Without it such a replacement waits for the trainer's next regular push, which never
        comes while a synchronous loop blocks in :meth:`collect` on a pool that has no other worker.
        """
        self._publisher = publish

    def policy_versions(self) -> list[int]:
        """Weights version each serving worker has now."""
        import ray

        return ray.get([w.actor.policy_version.remote() for w in self._ready_workers()])

    def health(self) -> list[dict[str, Any]]:
        """Each serving worker's :meth:`RolloutWorker.health`."""
        import ray

        return ray.get([w.actor.health.remote() for w in self._ready_workers()])

    def wait_for_workers(self, timeout_s: float | None = None) -> None:
        """Block until every replacement worker serves :attr:`policy_version` and takes work."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(w.ready_ref is not None for w in self._workers):
            refs = [w.ready_ref for w in self._workers if w.ready_ref is not None]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(refs, num_returns=1, timeout=left)
            if not done:
                raise TimeoutError(f"rollout workers not ready after {timeout_s} s")
            self._settle_startup(done[0])

    def set_weight_source(self, checkpoint_dir: str, policy_version: int) -> None:
        """Register an HF checkpoint directory holding ``policy_version`` for replacements to start from, when no live
        peer and no weight publisher can give them the pool's version."""
        self._weight_source = (checkpoint_dir, policy_version)

    @property
    def workers(self) -> list[Any]:
        """Actor handles of the current workers (for monitoring and fault-injection tests)."""
        return [w.actor for w in self._workers]

    def shutdown(self) -> None:
        """Kill every worker actor."""
        import ray

        for worker in self._workers:
            ray.kill(worker.actor)
        self._workers = []

    # -- internals -------------------------------------------------------------------------------------------------
    def _poll_startups(self) -> None:
        """Advance replacements whose start-up or catch-up call has finished, without blocking."""
        import ray

        refs = [w.ready_ref for w in self._workers if w.ready_ref is not None]
        if refs:
            for ref in ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
                self._settle_startup(ref)

    def _ready_workers(self) -> list[_Worker]:
        return [w for w in self._workers if w.ready_ref is None]

    def _dispatch(self, piece: _Piece) -> None:
        ready = self._ready_workers()
        if not ready:
            piece.worker, piece.ref = None, None
            return
        worker = min(ready, key=lambda w: w.num_inflight_groups)
        worker.num_inflight_groups += len(piece.group_ids)
        piece.worker, piece.num_dispatches = worker, piece.num_dispatches + 1
        piece.ref = worker.actor.generate_groups.remote(
            piece.problems, piece.group_ids, piece.group_size, piece.sampling
        )

    def _settle(self, ref: Any, pending: _Pending) -> None:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

        from rollout.engine.vllm_engine import EngineBrokenError

        if self._settle_startup(ref):
            return
        piece = next(p for p in pending.pieces if p.ref == ref)
        worker = piece.worker
        try:
            batch = ray.get(ref)
        except (RayActorError, ActorDiedError, ActorUnavailableError, RayTaskError) as e:
            if isinstance(e, RayTaskError) and not isinstance(e.cause, EngineBrokenError):
                raise  # the worker's own error (reward function, prompt): retrying elsewhere would fail the same way
            self._replace(worker)
            return
        worker.num_inflight_groups -= len(piece.group_ids)
        self.set_policy_version(max(s.policy_version for s in batch.samples))  # what a worker serves was committed
        piece.ref = None
        pending.results.append(batch)
        piece.done = True

    def _settle_startup(self, ref: Any) -> bool:
        """Advance a replacement whose start-up or catch-up call ``ref`` finished; whether ``ref`` was one."""
        import ray

        starting = next((w for w in self._workers if w.ready_ref is not None and w.ready_ref == ref), None)
        if starting is None:
            return False
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError:
            self._replace(starting)  # the replacement (or its weight source) failed: try another one
            return True
        if starting.address is None:
            starting.address, version = result, 0  # started: it serves the model directory (version 0)
        else:
            version = result
        self._catch_up(starting, version)
        return True

    def _catch_up(self, worker: _Worker, version: int) -> None:
        """Let ``worker`` (serving ``version``) take work if that is the pool's version, else start its next step
        towards it; see the module docstring for the order of sources."""
        worker.awaiting_push = False
        target = self._policy_version
        if version >= target:
            worker.ready_ref = None
            return
        peer = self._newest_peer(exclude=worker, at_least=target)
        if peer is not None:
            worker.ready_ref = worker.actor.pull_weights.remote(peer)
        elif self._publisher is not None:
            try:
                pushed = self._publisher([worker.address])
            except Exception as e:  # noqa: BLE001 (whatever broke the push, this worker cannot get the weights)
                log.warning("weight publisher could not reach rollout worker %s (%s); replacing it", worker.address, e)
                self._replace(worker)
                return
            if pushed < target:
                raise RuntimeError(
                    f"the weight publisher pushed policy_version {pushed}, older than the {target} the pool was told "
                    "was committed; call set_policy_version with the trainer's version"
                )
            worker.ready_ref = worker.actor.policy_version.remote()
        elif self._weight_source is not None and self._weight_source[1] >= target:
            worker.ready_ref = worker.actor.pull_weights.remote(None, *self._weight_source)
        else:
            worker.awaiting_push = True
            worker.ready_ref = worker.actor.wait_for_version.remote(target)

    def _check_progress(self, pieces_running: bool) -> None:
        """Fail instead of blocking forever when only the trainer's next push could let pending pieces run."""
        starting = [w for w in self._workers if w.ready_ref is not None]
        if not pieces_running and starting and all(w.awaiting_push for w in starting):
            raise RuntimeError(
                f"no rollout worker can serve: the replacement(s) need policy_version {self._policy_version}, which no "
                "live peer, weight publisher or checkpoint source holds, and the trainer's next push comes only "
                "after this batch; register one with RolloutPool.set_weight_publisher"
            )

    def _replace(self, dead: _Worker) -> None:
        """Kill ``dead``'s actor, start a replacement in its slot (caught up before it takes work) and send the pieces
        it was running to the other workers."""
        import ray

        if self._num_restarts >= self.config.num_worker_restarts:
            raise RuntimeError(
                f"rollout workers died {self._num_restarts + 1} times (num_worker_restarts="
                f"{self.config.num_worker_restarts}); see the Ray logs of the dead actors"
            )
        self._num_restarts += 1
        ray.kill(dead.actor, no_restart=True)
        actor = self._actor_cls.remote(*self._worker_args)
        dead.actor, dead.ready_ref, dead.awaiting_push = actor, actor.receiver_address.remote(), False
        dead.num_inflight_groups, dead.address = 0, None
        # Whatever was running on it (a live worker can be replaced while generating) goes to the other workers now;
        # left to fail, each piece would replace this slot once more.
        for pend in self._pending.values():
            for piece in pend.pieces:
                if piece.worker is dead and piece.ref is not None:
                    piece.ref = None
                    pend.num_redispatched += 1
                    self._dispatch(piece)

    def _newest_peer(self, exclude: _Worker, at_least: int) -> Any:
        """The serving worker with the newest retained weights if it serves ``at_least``, else ``None``."""
        import ray

        best, best_version = None, -1
        for worker in self._ready_workers():
            if worker is exclude or not self.config.retain_latest_weights:
                continue
            try:
                version = ray.get(worker.actor.policy_version.remote(), timeout=30)
            except ray.exceptions.RayError:
                continue
            if version > best_version:
                best, best_version = worker.actor, version
        self.set_policy_version(best_version)
        return best if best_version >= at_least else None


def _merge(pending: _Pending, seconds: float) -> RolloutBatch:
    samples: list[Sample] = sorted(
        (s for batch in pending.results for s in batch.samples), key=lambda s: s.group_id
    )
    metrics: dict[str, float] = {}
    for batch in pending.results:
        for key, value in batch.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    rewards = [s.reward for s in samples]
    metrics["reward/mean"] = sum(rewards) / len(rewards)
    for name in samples[0].reward_terms:
        metrics[f"reward/{name}/mean"] = sum(s.reward_terms[name] for s in samples) / len(samples)
    versions = [s.policy_version for s in samples]
    metrics.update({
        "rollout/seconds": seconds,
        "rollout/num_samples": float(len(samples)),
        "rollout/num_redispatched": float(pending.num_redispatched),
        "rollout/min_policy_version": float(min(versions)),
        "rollout/max_policy_version": float(max(versions)),
        "rollout/tokens_per_s": metrics.get("rollout/num_completion_tokens", 0.0) / max(seconds, 1e-9),
    })
    return RolloutBatch(samples=samples, metrics=metrics)
