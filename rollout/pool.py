"""A pool of rollout workers (Ray actors) behind a submit/collect API: groups spread by load, generation running ahead
of training, and no batch lost when a worker dies.

    pool = RolloutPool(rollout_config, reward=reward_config, weight_sync=sync_config)
    pool.set_weight_publisher(push_to)                # push_to(addresses) -> version: the trainer's catch-up push
    handle = pool.submit(problems, group_size=8)      # returns at once; generation runs on the workers
    ...                                               # train on the previous batch meanwhile (async mode)
    batch = pool.collect(handle)                      # RolloutBatch: up to len(problems) * 8 samples
    pool.poll(); pool.receiver_addresses()            # where to push the next version
    pool.set_policy_version(version)                  # it was committed...
    pool.hold_back(failed_addresses)                  # ...but these workers missed it: no work until caught up
    pool.shutdown()

This module schedules; :mod:`rollout.fleet` owns the workers' lifecycle (start, replacement, catching up on the
committed weights as an explicit state machine).

Scheduling: the groups of one ``submit`` are cut into pieces of at most ``max_groups_per_dispatch`` groups (and no more
than an even share per worker); all samples of a group stay on one worker (they share the prompt's KV cache). Each
piece goes to the serving worker with the fewest groups in flight, so pieces of several outstanding submits
interleave. A piece whose worker died (or whose engine broke during a weight update, ``EngineBrokenError``) is sent
again to another worker and the dead worker is replaced; since a worker serves only the committed version, a batch hit
by a death needs no regeneration. Errors raised by a worker itself (a reward function failing, a bad prompt) are not
retried: they surface from :meth:`collect`.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.resources import actor_options
from rollout.config import RolloutConfig, SamplingConfig
from rollout.envs.failures import check_request_failures, check_request_kept
from rollout.fleet import Publisher, WorkerFleet, WorkerSlot
from rollout.metrics import sample_metrics, summed_metrics
from rollout.types import RolloutBatch, Sample

log = logging.getLogger("rl_align")

if TYPE_CHECKING:
    from rollout.envs.config import EnvironmentConfig
    from rollout.rewards.config import RewardConfig
    from rollout.tasks.problem import Problem
    from weight_sync.config import WeightSyncConfig

__all__ = ["FIRST_POOL_GROUP_ID", "RolloutHandle", "RolloutPool", "worker_resources"]

FIRST_POOL_GROUP_ID = 1 << 40
"""The first group id the pool counts itself (for submissions without ``first_group_id``); the ids below are the
training stream's positions."""


@dataclass
class RolloutHandle:
    """What :meth:`RolloutPool.submit` returns; pass it to :meth:`RolloutPool.collect`."""

    handle_id: int
    num_groups: int
    group_size: int
    submitted_at: float
    budget_of: int = 0
    """The episodes whose ``environment.max_failed_fraction`` the request may drop when more than its own (a
    dynamic-sampling refill: its step's batch's)."""

    @property
    def num_episodes(self) -> int:
        """The episodes the request runs."""
        return self.num_groups * self.group_size

    @property
    def budget_episodes(self) -> int:
        """The episodes ``environment.max_failed_fraction`` is of: its own, or ``budget_of`` when more."""
        return max(self.num_episodes, self.budget_of)


@dataclass(eq=False)
class _Piece:
    handle_id: int
    problems: list[Problem]
    group_ids: list[int]
    group_size: int
    sampling: SamplingConfig
    min_group_size: int
    request_episodes: int
    worker: WorkerSlot | None = None
    ref: Any = None
    done: bool = False


@dataclass
class _Pending:
    handle: RolloutHandle
    pieces: list[_Piece]
    results: list[RolloutBatch] = field(default_factory=list)
    num_redispatched: int = 0


def worker_resources(config: RolloutConfig) -> dict[str, float]:
    """What one rollout worker reserves: ``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker`` GPUs."""
    return {"CPU": config.num_cpus_per_worker, "GPU": config.num_gpus_per_worker}


class RolloutPool:
    """M :class:`rollout.worker.RolloutWorker` actors behind a submit/collect API; see the module docstring."""

    def __init__(
        self,
        config: RolloutConfig,
        reward: RewardConfig | None = None,
        weight_sync: WeightSyncConfig | None = None,
        startup_timeout_s: float = 600.0,
        runtime_env: dict[str, Any] | None = None,
        environment: EnvironmentConfig | None = None,
        placement: Sequence[dict[str, Any]] | None = None,
        trainer_session: str | None = None,
    ) -> None:
        """``runtime_env``: the Ray runtime environment of every worker (e.g. its ``env_vars``), beside the job's;
        ``environment``: what every episode runs in (default: single turn); ``placement``: more Ray actor options per
        worker slot, kept by its replacements (its placement-group bundle, see ``driver.reservation``), None: wherever
        Ray finds room; ``trainer_session``: the weight-sync session of the trainer whose base the engines start from
        (``RolloutWorker``). Each worker asks Ray for :func:`worker_resources`."""
        import ray

        from rollout.worker import RolloutWorker

        num_workers = config.num_workers
        if not isinstance(num_workers, int):
            raise ValueError("rollout.num_workers = 'auto' is decided by the run's placement "
                             "(driver.placement.plan_placement): give the pool its resolved config or a number")
        self.config = config
        self._max_failed_fraction = environment.max_failed_fraction if environment is not None else 0.0
        # Threaded actors: health/version calls answer while a generation batch runs; the engine loop orders the rest.
        options = {**actor_options(worker_resources(config)), "max_concurrency": 4}
        if runtime_env is not None:
            options["runtime_env"] = runtime_env
        if placement is not None and len(placement) != num_workers:
            raise ValueError(f"placement has {len(placement)} entries for {num_workers} worker(s)")
        per_slot = [{**options, **(placement[i] if placement else {})} for i in range(num_workers)]
        self.fleet = WorkerFleet(
            ray.remote(RolloutWorker), (config, reward, weight_sync, environment, trainer_session), num_workers,
            config.num_worker_restarts, on_replaced=self._hand_on, startup_timeout_s=startup_timeout_s,
            options=per_slot,
        )  # fmt: skip
        self._ids = itertools.count()
        self._next_group_id = FIRST_POOL_GROUP_ID
        self._pending: dict[int, _Pending] = {}

    # -- scheduling ------------------------------------------------------------------------------------------------
    def submit(
        self,
        problems: Sequence[Problem],
        group_size: int,
        sampling: SamplingConfig | None = None,
        first_group_id: int | None = None,
        min_group_size: int = 1,
        budget_of: int = 0,
    ) -> RolloutHandle:
        """Start generating ``group_size`` samples for each problem; returns at once. A group whose episodes failed
        (within ``environment.max_failed_fraction`` of the request's episodes, or of ``budget_of`` episodes when more:
        a dynamic-sampling refill drops as many as its step's batch may, where its own few would let none go) comes
        back smaller, or not at all when fewer than ``min_group_size`` episodes are left
        (``RolloutWorker.generate_groups``); a request that kept no group that way fails, but for such a refill,
        which comes back empty (one more round).

        Group ids (which seed a seeded sampling's random streams, ``rollout.sampling.turn_seed``) are
        ``first_group_id, first_group_id + 1, ...`` when given: the training stream's positions of the problems
        (``PromptDataset.stream_position``), below :data:`FIRST_POOL_GROUP_ID`, so a resumed sync run samples its steps
        with the streams the run would have used. Otherwise the pool counts them from :data:`FIRST_POOL_GROUP_ID`
        (evaluations): unique per pool either way, as long as callers give each stream position once."""
        if not problems:
            raise ValueError("submit() needs at least one problem")
        if group_size < 1:
            raise ValueError(f"group_size={group_size} must be at least 1")
        sampling = sampling or self.config.sampling
        handle = RolloutHandle(next(self._ids), len(problems), group_size, time.perf_counter(), budget_of)
        if first_group_id is None:
            first_group_id = self._next_group_id
            self._next_group_id += len(problems)
        elif not 0 <= first_group_id <= FIRST_POOL_GROUP_ID - len(problems):
            raise ValueError(f"first_group_id = {first_group_id}: a stream position from 0 to below "
                             f"{FIRST_POOL_GROUP_ID}")  # fmt: skip
        group_ids = list(range(first_group_id, first_group_id + len(problems)))
        share = math.ceil(len(problems) / max(1, len(self.fleet.serving())))
        size = max(1, min(self.config.max_groups_per_dispatch, share))
        pieces = [
            _Piece(handle.handle_id, list(problems[i : i + size]), group_ids[i : i + size], group_size, sampling,
                   min_group_size, handle.budget_episodes)
            for i in range(0, len(problems), size)
        ]
        self._pending[handle.handle_id] = _Pending(handle, pieces)
        for piece in pieces:
            self._dispatch(piece)
        return handle

    def collect(self, handle: RolloutHandle, timeout_s: float | None = None) -> RolloutBatch:
        """Wait for every group of ``handle`` and return them (samples ordered by group id, then sample index).

        Re-dispatches pieces of dead workers and advances the fleet on the way (a replacement runs pieces only once
        it serves :attr:`policy_version`). Raises ``TimeoutError`` after ``timeout_s``, and ``RuntimeError`` when
        workers keep dying past ``num_worker_restarts`` or when no worker can serve without the trainer's next push;
        :class:`~rollout.envs.EpisodeFailed` when more of its episodes failed than ``environment.max_failed_fraction``
        lets go. After an error other than ``TimeoutError`` the handle is gone.
        """
        import ray

        pending = self._pending.get(handle.handle_id)
        if pending is None:
            raise ValueError(f"unknown or already collected handle {handle.handle_id}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all(p.done for p in pending.pieces):
            for piece in pending.pieces:
                if piece.ref is None and not piece.done:
                    self._dispatch(piece)  # it waited for a serving worker
            refs = [p.ref for p in pending.pieces if p.ref is not None]
            self.fleet.check_progress(bool(refs))
            refs += self.fleet.pending_refs()
            assert refs, "pieces left but neither a running piece nor a worker on its way to serving"
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(refs, num_returns=1, timeout=left)
            if not done:
                raise TimeoutError(f"rollout handle {handle.handle_id}: not complete after {timeout_s} s")
            try:
                if not self.fleet.settle(done[0]):
                    self._settle_piece(done[0], pending)
            except Exception:
                self._forget(pending)  # the request failed: nothing collects it again
                raise
        del self._pending[handle.handle_id]
        if handle.budget_of <= handle.num_episodes:  # a refill that kept nothing is one more round, not a failure
            check_request_kept(sum(len(b.samples) for b in pending.results), _num_failed(pending), handle.num_episodes,
                               pending.pieces[0].min_group_size)  # fmt: skip
        return _merge(pending, time.perf_counter() - handle.submitted_at)

    def _forget(self, pending: _Pending) -> None:
        """Drop a failed request: its pieces still running are left to finish unread, and no longer count as their
        workers' load or get handed on when a worker is replaced."""
        for piece in pending.pieces:
            if piece.ref is not None and piece.worker is not None:
                piece.worker.num_inflight_groups -= len(piece.group_ids)
        self._pending.pop(pending.handle.handle_id, None)

    def _dispatch(self, piece: _Piece) -> None:
        serving = self.fleet.serving()
        if not serving:
            piece.worker, piece.ref = None, None
            return
        worker = min(serving, key=lambda w: w.num_inflight_groups)
        worker.num_inflight_groups += len(piece.group_ids)
        piece.worker = worker
        piece.ref = worker.actor.generate_groups.remote(
            piece.problems, piece.group_ids, piece.group_size, piece.sampling, piece.min_group_size,
            piece.request_episodes,
        )

    def _settle_piece(self, ref: Any, pending: _Pending) -> None:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

        from rollout.engine.errors import EngineBrokenError

        piece = next(p for p in pending.pieces if p.ref == ref)
        worker = piece.worker
        assert worker is not None
        try:
            batch = ray.get(ref)
        except (RayActorError, ActorDiedError, ActorUnavailableError, RayTaskError) as e:
            if isinstance(e, RayTaskError) and not isinstance(e.cause, EngineBrokenError):
                raise  # the worker's own error (reward function, prompt): retrying elsewhere would fail the same way
            self.fleet.replace(worker, f"died while generating ({type(e).__name__}: {e})")  # hands the piece on too
            return
        worker.num_inflight_groups -= len(piece.group_ids)
        # What a worker serves was committed: the pool learns versions pushed without its driver saying so.
        self.fleet.set_policy_version(max((s.policy_version for s in batch.samples), default=0))
        piece.ref = None
        pending.results.append(batch)
        piece.done = True
        # Each worker let its share's failures spend the whole request's budget: the request's sum decides.
        check_request_failures(_num_failed(pending), pending.handle.budget_episodes, self._max_failed_fraction)

    def _hand_on(self, replaced: WorkerSlot) -> None:
        """Send what a replaced worker was running to the other workers (left to fail, each piece would replace
        that slot once more)."""
        for pending in self._pending.values():
            for piece in pending.pieces:
                if piece.worker is replaced and piece.ref is not None:
                    piece.ref = None
                    pending.num_redispatched += 1
                    self._dispatch(piece)

    # -- weights: what the driver's weight publisher reads and says ------------------------------------------------
    def poll(self) -> None:
        """Take in workers that finished starting or catching up, without blocking (call before
        :meth:`receiver_addresses`)."""
        self.fleet.poll()

    def receiver_addresses(self) -> list[str]:
        """Weight receivers the next regular push must reach: the serving workers and those waiting for that push.
        Changes only when the fleet advances (:meth:`poll`, :meth:`collect`), e.g. after a worker was replaced."""
        return self.fleet.receiver_addresses()

    @property
    def policy_version(self) -> int:
        """Newest committed weights version the pool knows of; workers take work only once they serve it."""
        return self.fleet.policy_version

    def set_policy_version(self, policy_version: int) -> None:
        """Tell the pool the trainer committed ``policy_version`` to its receivers (it never moves back)."""
        self.fleet.set_policy_version(policy_version)

    def hold_back(self, addresses: Sequence[str]) -> None:
        """Workers at ``addresses`` missed the last push: no new work until they serve :attr:`policy_version` again
        (see :meth:`rollout.fleet.WorkerFleet.hold_back`)."""
        self.fleet.hold_back(addresses)

    def set_weight_publisher(self, publish: Publisher | None) -> None:
        """Register ``publish(addresses) -> policy_version``, the trainer's push to just these receivers, which
        catches up a replaced or held-back worker (see :mod:`rollout.fleet`)."""
        self.fleet.set_publisher(publish)

    # -- monitoring ------------------------------------------------------------------------------------------------
    def policy_versions(self) -> list[int]:
        """Weights version each serving worker has now."""
        import ray

        return ray.get([w.actor.policy_version.remote() for w in self.fleet.serving()])

    def prompts_too_long(self, problems: Sequence[Problem]) -> str | None:
        """Why some of ``problems`` cannot be generated from (prompts of ``rollout.engine.max_model_len`` tokens or
        more, rendered by a serving worker as the single-turn environment renders them), or None."""
        import ray

        start = time.perf_counter()
        worker = self.fleet.serving()[0].actor
        count, first = ray.get(worker.prompts_too_long.remote([(p.problem_id, p.prompt) for p in problems]))
        log.info("%d prompts measured against max_model_len in %.1f s", len(problems), time.perf_counter() - start)
        if not count:
            return None
        named = ", ".join(f"{problem_id!r} ({num_tokens} tokens)" for problem_id, num_tokens in first)
        more = f" and {count - len(first)} more" if count > len(first) else ""
        return (f"{count} problem(s) of the task have prompts that leave no room for a completion in "
                f"rollout.engine.max_model_len = {self.config.engine.max_model_len} tokens (prompt and completion): "
                f"{named}{more}; raise max_model_len, or leave them out of the task's files")  # fmt: skip

    def health(self) -> list[dict[str, Any]]:
        """Each serving worker's :meth:`RolloutWorker.health`."""
        import ray

        return ray.get([w.actor.health.remote() for w in self.fleet.serving()])

    def wait_for_workers(self, timeout_s: float | None = None) -> None:
        """Block until every worker serves :attr:`policy_version` and takes work."""
        self.fleet.wait_until_serving(timeout_s)

    @property
    def workers(self) -> list[Any]:
        """Actor handles of the current workers (for monitoring and fault-injection tests)."""
        return [w.actor for w in self.fleet.slots]

    def shutdown(self) -> None:
        """Kill every worker actor."""
        self.fleet.shutdown()


def _num_failed(pending: _Pending) -> int:
    """The failed episodes of the request's pieces back so far (each dropped within the request's budget)."""
    return sum(int(b.metrics.get("env/num_failed_episodes", 0.0)) for b in pending.results)


def _merge(pending: _Pending, seconds: float) -> RolloutBatch:
    """One batch of every piece's samples (ordered by group id), with the pieces' additive counters summed and the
    batch's :func:`rollout.metrics.sample_metrics`."""
    samples: list[Sample] = sorted((s for batch in pending.results for s in batch.samples), key=lambda s: s.group_id)
    metrics = summed_metrics(pending.results)
    if samples:  # none: a refill whose failed episodes left no group whole
        metrics.update(sample_metrics(samples))
    metrics.update({
        "rollout/seconds": seconds,
        "rollout/num_redispatched": float(pending.num_redispatched),
        "rollout/tokens_per_s": metrics.get("rollout/num_completion_tokens", 0.0) / max(seconds, 1e-9),
    })  # fmt: skip
    return RolloutBatch(samples=samples, metrics=metrics)
