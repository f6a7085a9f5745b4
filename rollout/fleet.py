"""The rollout workers' lifecycle: start, replacement, and catching up on the committed weights before serving.

    fleet = WorkerFleet(actor_cls, worker_args, num_workers=2, num_restarts=3)
    fleet.serving()                      # the workers that take work now
    fleet.set_policy_version(v)          # the trainer committed v: only workers serving v (or newer) take work
    fleet.hold_back(failed_addresses)    # these missed that push: no work until they serve v again
    fleet.set_publisher(push_to)         # push_to(addresses) -> version pushed: the trainer pushing its weights
    fleet.poll()                         # advance finished start-up / catch-up calls (never blocks)
    fleet.receiver_addresses()           # where the next regular push must go (reads state, changes nothing)

Every worker slot is in one :class:`WorkerState`::

    STARTING ----(actor answers its receiver address)---> CATCHING_UP
    CATCHING_UP --(serves the committed version)--------> SERVING
    CATCHING_UP --(older, publisher set: it pushes now)--> CATCHING_UP (confirming the version it serves)
    CATCHING_UP --(older, no publisher)------------------> AWAITING_PUSH --(the next regular push lands)--> SERVING
    SERVING ------(hold_back: it missed a push)----------> CATCHING_UP
    any state ----(actor died, or the publisher could not reach it)--> STARTING, a new actor in the same slot

The only source of weights is the trainer: the publisher pushes its current weights to just the worker that needs
them, or else the worker waits for the next regular push (which reaches it because :meth:`receiver_addresses` lists
it). So no worker ever generates with weights older than the last committed version. Replacements are bounded by
``num_restarts`` over the fleet's life; one more raises ``RuntimeError``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerFleet", "WorkerSlot", "WorkerState", "WorkersExhausted"]

log = logging.getLogger(__name__)

Publisher = Callable[[list[str]], int]
"""``publish(addresses) -> policy_version``: push the trainer's current weights to just these receivers now and return
the version pushed; raises when the push failed."""


class WorkersExhausted(RuntimeError):
    """The pool's rollout workers died more often than ``rollout.num_worker_restarts`` allows."""


class WorkerState(enum.Enum):
    STARTING = "starting"
    """The actor is being created; ``ref`` answers its receiver address."""
    CATCHING_UP = "catching_up"
    """It may serve an older version than the committed one; ``ref`` answers the version it serves."""
    AWAITING_PUSH = "awaiting_push"
    """Nothing but the trainer's next regular push holds the version it needs; ``ref`` answers once that landed."""
    SERVING = "serving"
    """It serves the committed version and takes work; no lifecycle call is in flight."""


@dataclass(eq=False)
class WorkerSlot:
    """One place in the fleet; a replacement reuses the slot (new actor, new address)."""

    actor: Any
    state: WorkerState
    index: int = 0
    """The slot's place in the fleet (and in its placement, if any)."""
    ref: Any = None
    """The in-flight lifecycle call of a slot that does not serve (see :class:`WorkerState`)."""
    address: str | None = None
    num_inflight_groups: int = 0
    """Groups the scheduler has running on this worker."""


class WorkerFleet:
    """The worker slots of a :class:`rollout.pool.RolloutPool` and their lifecycle; see the module docstring."""

    def __init__(
        self,
        actor_cls: Any,
        worker_args: tuple,
        num_workers: int,
        num_restarts: int,
        on_replaced: Callable[[WorkerSlot], None] = lambda slot: None,
        startup_timeout_s: float = 600.0,
        options: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """Start ``num_workers`` actors of ``actor_cls`` (a ``ray.remote`` class) and wait until each answers.

        ``on_replaced(slot)`` runs after a slot got a new actor, so the scheduler can hand on what the old one ran.
        ``options``: the Ray actor options of each slot's actors (resources, placement-group bundle), one per worker.
        """
        import ray

        self._actor_cls, self._worker_args = actor_cls, worker_args
        self._num_restarts_left = num_restarts
        self._num_restarts = num_restarts
        self._on_replaced = on_replaced
        self._publisher: Publisher | None = None
        self._policy_version = 0
        if options is not None and len(options) != num_workers:
            raise ValueError(f"options has {len(options)} entries for {num_workers} worker(s)")
        self._options = list(options) if options is not None else [{} for _ in range(num_workers)]
        actors = [self._start(index) for index in range(num_workers)]
        addresses = ray.get([a.receiver_address.remote() for a in actors], timeout=startup_timeout_s)
        started = enumerate(zip(actors, addresses))
        self.slots = [WorkerSlot(actor, WorkerState.SERVING, i, address=address) for i, (actor, address) in started]

    # -- what the scheduler and the publisher read -----------------------------------------------------------------
    def serving(self) -> list[WorkerSlot]:
        """The slots that take work now."""
        return [s for s in self.slots if s.state is WorkerState.SERVING]

    def receiver_addresses(self) -> list[str]:
        """Receivers the next regular push must reach: the serving workers and those awaiting that push. Reads the
        current state only (call :meth:`poll` first to take in finished start-ups)."""
        wanted = (WorkerState.SERVING, WorkerState.AWAITING_PUSH)
        return [s.address for s in self.slots if s.state in wanted and s.address is not None]

    def pending_refs(self) -> list[Any]:
        """The in-flight lifecycle calls (to wait on together with generation calls)."""
        return [s.ref for s in self.slots if s.ref is not None]

    @property
    def policy_version(self) -> int:
        """Newest committed weights version the fleet knows of; workers take work only once they serve it."""
        return self._policy_version

    # -- what the driver says ---------------------------------------------------------------------------------------
    def set_policy_version(self, policy_version: int) -> None:
        """The trainer committed ``policy_version`` (it never moves back)."""
        self._policy_version = max(self._policy_version, policy_version)

    def set_publisher(self, publish: Publisher | None) -> None:
        """Register the trainer's catch-up push. Without one, a worker that needs weights waits for the next regular
        push, which never comes while a synchronous loop waits for a batch that only that worker could run."""
        self._publisher = publish

    def hold_back(self, addresses: Sequence[str]) -> None:
        """Workers at ``addresses`` missed the last push (failed or refused): no new work until they serve
        :attr:`policy_version` again. Addresses that are not this fleet's (external servers) and workers not serving
        are ignored; pieces already running on them finish as they are."""
        missed = set(addresses)
        for slot in self.serving():
            if slot.address in missed:
                self._set(slot, WorkerState.CATCHING_UP, slot.actor.policy_version.remote())

    # -- advancing the state machine --------------------------------------------------------------------------------
    def poll(self) -> None:
        """Advance every slot whose lifecycle call has finished, without blocking."""
        import ray

        refs = self.pending_refs()
        if refs:
            for ref in ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
                self.settle(ref)

    def settle(self, ref: Any) -> bool:
        """Advance the slot whose lifecycle call ``ref`` finished; whether ``ref`` was one."""
        import ray

        slot = next((s for s in self.slots if s.ref is not None and s.ref == ref), None)
        if slot is None:
            return False
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as e:
            self.replace(slot, f"failed while {slot.state.value} ({e})")
            return True
        if slot.state is WorkerState.STARTING:  # the version its model directory records (an export's, else 0)
            slot.address = result
            self._set(slot, WorkerState.CATCHING_UP, slot.actor.policy_version.remote())
            return True
        self._catch_up(slot, result)
        return True

    def wait_until_serving(self, timeout_s: float | None = None) -> None:
        """Block until every slot serves :attr:`policy_version`."""
        import time

        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.pending_refs():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(self.pending_refs(), num_returns=1, timeout=left)
            if not done:
                raise TimeoutError(f"rollout workers not serving after {timeout_s} s")
            self.settle(done[0])

    def check_progress(self, pieces_running: bool) -> None:
        """Fail instead of blocking forever when only the trainer's next push could let pending work run."""
        waiting = [s for s in self.slots if s.state is not WorkerState.SERVING]
        if not pieces_running and not self.serving() and all(s.state is WorkerState.AWAITING_PUSH for s in waiting):
            raise RuntimeError(
                f"no rollout worker can serve: the worker(s) need policy_version {self._policy_version}, which only "
                "the trainer holds, and its next push comes only after this batch; register the trainer's push with "
                "RolloutPool.set_weight_publisher"
            )

    def replace(self, slot: WorkerSlot, why: str) -> None:
        """Kill the slot's actor and start a new one there (it catches up before it takes work), logging ``why`` (what
        happened to the worker); raises :class:`WorkersExhausted` once the fleet has used up its restarts."""
        import ray

        if self._num_restarts_left <= 0:
            raise WorkersExhausted(
                f"rollout workers died {self._num_restarts + 1} times (rollout.num_worker_restarts = "
                f"{self._num_restarts}); see the Ray logs of the dead actors (the last: {why})"
            )
        self._num_restarts_left -= 1
        log.warning("rollout worker %s %s; replacing it (%d of rollout.num_worker_restarts = %d left)",
                    slot.address, why, self._num_restarts_left, self._num_restarts)  # fmt: skip
        ray.kill(slot.actor, no_restart=True)
        slot.actor = self._start(slot.index)
        slot.address, slot.num_inflight_groups = None, 0
        self._set(slot, WorkerState.STARTING, slot.actor.receiver_address.remote())
        self._on_replaced(slot)

    def shutdown(self) -> None:
        """Kill every worker actor."""
        import ray

        for slot in self.slots:
            ray.kill(slot.actor)
        self.slots = []

    # -- internals -------------------------------------------------------------------------------------------------
    def _start(self, index: int) -> Any:
        """A new actor for slot ``index``, with that slot's options."""
        return self._actor_cls.options(**self._options[index]).remote(*self._worker_args)

    @staticmethod
    def _set(slot: WorkerSlot, state: WorkerState, ref: Any = None) -> None:
        slot.state, slot.ref = state, ref

    def _catch_up(self, slot: WorkerSlot, version: int) -> None:
        """``slot`` serves ``version``: let it take work if that is the committed one, else get it there."""
        target = self._policy_version
        if version >= target:
            self._set(slot, WorkerState.SERVING)
            return
        if self._publisher is None:
            self._set(slot, WorkerState.AWAITING_PUSH, slot.actor.wait_for_version.remote(target))
            return
        assert slot.address is not None
        try:
            pushed = self._publisher([slot.address])
        except Exception as e:  # noqa: BLE001 (whatever broke the push, this worker cannot get the weights)
            self.replace(slot, f"could not be pushed to by the trainer ({e})")
            return
        if pushed < target:
            raise RuntimeError(
                f"the weight publisher pushed policy_version {pushed}, older than the {target} the pool was told was "
                "committed; call set_policy_version with the trainer's version"
            )
        self._set(slot, WorkerState.CATCHING_UP, slot.actor.policy_version.remote())
