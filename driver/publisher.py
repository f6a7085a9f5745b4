"""The weight publisher: the one place the policy is pushed from the trainer to the servers that generate with it.

    publisher = WeightPublisher(trainer, pool, external=recipe.weight_sync.endpoints)
    metrics = publisher.publish()        # after every optimizer step (and after a warm start or resume)
    # the pool calls publisher.push_to([address]) itself to catch up a replaced or held-back worker

``publish`` pushes the trainer's current version to every receiver: the pool's serving workers, pool workers waiting
for this push, and every external server of the recipe (``weight_sync.endpoints``). Each trainer rank streams its own
shards and rank 0 commits (``TrainerGroup.push_weights``). Then the pool learns the committed version, and what a
failed push means is decided here: a pool worker that missed it is held back (no work until it serves the version:
the pool catches it up with :meth:`push_to`, and replaces it when even that fails); an external server that missed it
is reported and gets a full push at the next version, without stopping training. With LoRA a push carries the
adapters alone, and a receiver holding a version older than their base's (``TrainerWorker.push_weights``' ``behind``)
is pushed the base with them at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["WeightPublisher", "push_failures"]

log = logging.getLogger("rl_align")

REMIND_EVERY_S = 600.0
"""While a receiver's pushes keep failing, how often the log says so again."""


class WeightPublisher:
    """Pushes the trainer's weights to the rollout pool and the external servers; see the module docstring."""

    def __init__(self, trainer: Any, pool: Any, external: Sequence[str] = ()) -> None:
        """``trainer``: a ``TrainerGroup`` (``set_weight_endpoints``, ``push_weights``); ``pool``: a ``RolloutPool``;
        ``external``: host:port of receivers outside the pool. Registers :meth:`push_to` as the pool's catch-up push."""
        self.trainer, self.pool, self.external = trainer, pool, list(external)
        self.published_version: int | None = None
        """The version the last :meth:`publish` got to every receiver (``None`` before one did)."""
        self.external_unserved: dict[str, str] = {address: "no push reached it yet" for address in self.external}
        """External receivers that have taken no version in this run, with the last reason (for the final report)."""
        self._failing: dict[str, tuple[int, float | None]] = {}
        """Receivers whose pushes fail: how many in a row, and when that was last logged."""
        pool.set_weight_publisher(self.push_to)

    def endpoints(self) -> list[str]:
        """Every receiver the next regular push goes to (pool workers first, then the external servers)."""
        self.pool.poll()
        return self.pool.receiver_addresses() + self.external

    def publish(self) -> dict[str, float]:
        """Push the trainer's current version everywhere; return ``push/*`` metrics (seconds of the slowest rank,
        payload bytes of all ranks, failed receivers, GB/s)."""
        endpoints = self.endpoints()
        if not endpoints:  # e.g. a pool of one whose worker is being replaced: it is caught up when it starts
            self.pool.set_policy_version(self.trainer.policy_version())
            return {"push/seconds": 0.0, "push/bytes": 0.0, "push/num_failed_receivers": 0.0, "push/gb_per_s": 0.0}
        self.trainer.set_weight_endpoints(endpoints)
        outcomes = self._push()
        failed = push_failures(outcomes)
        self._report(failed, [a for a in endpoints if a not in failed], int(outcomes[0]["policy_version"]))
        self.pool.set_policy_version(int(outcomes[0]["policy_version"]))
        self.published_version = None if failed else int(outcomes[0]["policy_version"])
        for address in list(self.external_unserved):
            if address in failed:
                self.external_unserved[address] = failed[address]
            elif address in endpoints:
                del self.external_unserved[address]
        self.pool.hold_back(list(failed))  # external addresses are not the pool's: it ignores them
        seconds = max(o["seconds"] for o in outcomes)
        payload = sum(o["payload_bytes"] for o in outcomes)
        return {
            "push/seconds": seconds, "push/bytes": float(payload), "push/num_failed_receivers": float(len(failed)),
            "push/gb_per_s": payload / max(seconds, 1e-9) / 1e9,
        }  # fmt: skip

    def _report(self, failed: dict[str, str], reached: Sequence[str], version: int) -> None:
        """Log each receiver's failing pushes once when they start, again every :data:`REMIND_EVERY_S` while they go
        on, and once when it takes a version again (one line a step for a receiver down an hour was 3,600 lines)."""
        now = time.monotonic()
        for address, error in failed.items():
            count, warned_at = self._failing.get(address, (0, None))
            self._failing[address] = (count + 1, warned_at)
            if warned_at is not None and now - warned_at < REMIND_EVERY_S:
                continue
            self._failing[address] = (count + 1, now)
            what = ("an external server: it keeps serving its old version and gets the next version in full" if
                    address in self.external else "a pool worker: it gets no work until it is caught up or replaced")
            again = f" ({count + 1} pushes in a row; push/num_failed_receivers counts them)" if count else ""
            log.warning("weight push to %s failed%s (%s): %s", address, again, what, error)
        for address in reached:
            if address in self._failing:
                count, _ = self._failing.pop(address)
                log.info("weight push to %s succeeded again after %d failed push(es): it serves version %d", address,
                         count, version)  # fmt: skip

    def push_to(self, addresses: list[str]) -> int:
        """Push the trainer's current weights to just ``addresses`` now (with LoRA the adapters, and the base to those
        holding an older one); return the version pushed. Raises ``RuntimeError`` when any of them did not take it."""
        outcomes = self._push(addresses)
        failed = push_failures(outcomes)
        if failed:
            raise RuntimeError(f"pushing the current policy to {addresses} failed: {failed}")
        version = int(outcomes[0]["policy_version"])
        log.info("pushed policy_version %d to rollout worker(s) %s to catch them up", version, addresses)
        return version

    def _push(self, endpoints: list[str] | None = None) -> list[dict[str, Any]]:
        """``trainer.push_weights`` to every receiver (or in full to ``endpoints``), then, with LoRA, the base with the
        adapters to the receivers that may not hold the base the adapters apply to (a server restarted on its
        directory, a replaced engine whose directory predates a warm start of the base, a server started on another
        run's model at a version as high): they took nothing from the first push. Returns each rank's outcome, theirs
        being the second push's."""
        outcomes = self.trainer.push_weights(endpoints=endpoints)
        behind = sorted({address for outcome in outcomes for address in outcome.get("behind", {})})
        if not behind:
            return outcomes
        versions = {a: v for outcome in outcomes for a, v in outcome["behind"].items()}
        log.info("receivers %s (at policy versions %s) may lack the base the adapters apply to (an older version, or "
                 "one this run did not push them): pushing them the base with the adapters", behind,
                 [versions[a] for a in behind])  # fmt: skip
        again = self.trainer.push_weights(endpoints=behind, with_base=True)
        for first, second in zip(outcomes, again, strict=True):
            for key in ("push_errors", "commit_errors"):  # commit errors: rank 0's only
                if key in first:
                    first[key] = {a: e for a, e in first[key].items() if a not in behind} | second.get(key, {})
            first["seconds"] += second["seconds"]
            first["payload_bytes"] += second["payload_bytes"]
            first["behind"] = {}
        return outcomes


def engines_behind(engine_versions: Sequence[int], trainer_version: int) -> bool:
    """Whether some engine serves an older policy version than the trainer holds (it must be pushed the trainer's
    weights before it generates); engines at the trainer's version hold its weights already (each version is one set
    of weights within a run's lineage) and would refuse them as not newer. ``RuntimeError`` when an engine is ahead
    of the trainer (it would refuse every push up to its version: ``driver.preflight`` refuses the runs where the
    directories show it before Ray starts)."""
    if any(v > trainer_version for v in engine_versions):
        raise RuntimeError(f"rollout engines serve policy versions {sorted(set(engine_versions))}, ahead of the "
                           f"trainer's {trainer_version}: they would refuse its pushes as not newer")  # fmt: skip
    return any(v < trainer_version for v in engine_versions)


def push_failures(outcomes: list[dict[str, Any]]) -> dict[str, str]:
    """Receiver address -> error for every receiver whose push (on any rank) or commit failed, from the per-rank
    outcomes of ``TrainerGroup.push_weights``: each distinct message once, in rank order, joined by "; ". A receiver
    that refuses one rank's stream fails the update, and the other ranks' streams then read as cut: the refusal that
    says why must not be lost among them."""
    errors: dict[str, list[str]] = {}
    for outcome in outcomes:
        for address, error in (*outcome["push_errors"].items(), *outcome.get("commit_errors", {}).items()):
            if error and error not in errors.setdefault(address, []):
                errors[address].append(error)
    return {address: "; ".join(messages) for address, messages in errors.items() if messages}
