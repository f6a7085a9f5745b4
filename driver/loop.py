"""The RL loop: generate -> score -> train -> push, synchronous or with generation running ahead (async).

Sync mode is strictly on-policy: step t trains on samples of policy version t. Async mode keeps ``max_staleness``
batches generating while the trainer trains, so generating batch t+1 overlaps training on batch t; samples then lag the
trainer by at most ``max_staleness`` versions and the trainer's truncated importance sampling corrects for it.

Each batch remembers the dataset cursor right after its prompts were drawn; the trainer checkpoints that cursor with
the weights, so ``--resume`` regenerates exactly the batches that were in flight when the job stopped.

After every push the loop tells the pool the committed ``policy_version``, and it lends the pool a weight publisher
(the trainer pushing its current weights to named receivers): a rollout worker that dies is replaced by the pool with
one that serves that version before it takes work, so a death never makes a batch older than the mode allows.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from rollout.types import RolloutBatch

__all__ = ["RLLoop", "push_failures"]

log = logging.getLogger("rl_align")


@dataclass
class _InFlight:
    handle: Any
    cursor: dict
    """Dataset cursor right after this batch's prompts were drawn."""


class RLLoop:
    """Drives a RolloutPool and a TrainerGroup through ``run.num_steps`` steps; see the module docstring."""

    def __init__(
        self,
        recipe: Any,
        pool: Any,
        trainer: Any,
        dataset: Any,
        sync_weights: Callable[[], dict[str, float]],
        log: Callable[[int, dict[str, float]], None],
        evaluate: Callable[[], dict[str, float]],
    ) -> None:
        self.recipe, self.pool, self.trainer, self.dataset = recipe, pool, trainer, dataset
        self._sync_weights, self._log, self._evaluate = sync_weights, log, evaluate
        self._queue: collections.deque[_InFlight] = collections.deque()
        pool.set_weight_publisher(self._publish)

    def _submit(self) -> None:
        problems = self.dataset.next_batch(self.recipe.run.num_prompts_per_step)
        handle = self.pool.submit(problems, self.recipe.algorithm.group_size)
        self._queue.append(_InFlight(handle, self.dataset.state_dict()))

    def _collect(self) -> tuple[RolloutBatch, dict, dict[str, float]]:
        """The next step's batch (with DAPO dynamic sampling when on), its cursor, and rollout metrics."""
        run = self.recipe.run
        item = self._queue.popleft()
        batch = self.pool.collect(item.handle)
        metrics = dict(batch.metrics)  # the pool's own names: rollout/*, reward/*
        if not run.dynamic_sampling.enabled:
            return batch, item.cursor, metrics
        kept = _informative_groups(batch)
        num_rounds = 1
        while len(kept) < run.num_prompts_per_step and num_rounds < run.dynamic_sampling.max_num_rounds:
            problems = self.dataset.next_batch(run.num_prompts_per_step - len(kept))
            extra = self.pool.collect(self.pool.submit(problems, self.recipe.algorithm.group_size))
            kept += _informative_groups(extra)
            num_rounds += 1
        # A cursor taken now also covers the extra prompts; the prompts of batches still in flight are redrawn on
        # resume, which is harmless (they were never trained on).
        cursor = self.dataset.state_dict() if num_rounds > 1 else item.cursor
        metrics["rollout/dynamic_sampling_rounds"] = float(num_rounds)
        metrics["rollout/informative_groups"] = float(len(kept))
        if not kept:
            kept = list(batch.groups().values())  # nothing informative: train anyway (zero advantages, KL only)
        samples = [s for group in kept[: run.num_prompts_per_step] for s in group]
        return RolloutBatch(samples, batch.metrics), cursor, metrics

    def _publish(self, addresses: list[str]) -> int:
        """The pool's weight publisher: push the trainer's current weights to ``addresses`` only (replacement workers);
        return the version pushed."""
        outcomes = self.trainer.push_weights(endpoints=addresses)
        failed = push_failures(outcomes)
        if failed:
            raise RuntimeError(f"pushing the current policy to replacement rollout worker(s) failed: {failed}")
        version = int(outcomes[0]["policy_version"])
        log.info("pushed policy_version %d to replacement rollout worker(s) %s before they serve", version, addresses)
        return version

    def run(self, start_step: int) -> None:
        """Steps ``start_step`` .. ``num_steps - 1``; the pool must already serve the trainer's current weights."""
        run = self.recipe.run
        ahead = run.max_staleness if run.mode == "async" else 0  # batches generating while the trainer trains
        remaining = run.num_steps - start_step
        num_submitted = 0

        def top_up(depth: int) -> None:
            nonlocal num_submitted
            while len(self._queue) < depth and num_submitted < remaining:
                self._submit()
                num_submitted += 1

        self.pool.set_policy_version(self.trainer.policy_version())
        top_up(1)
        for step in range(start_step, run.num_steps):
            t0 = time.perf_counter()
            batch, cursor, metrics = self._collect()
            t1 = time.perf_counter()
            top_up(ahead)  # async: later batches generate with the current weights while this one trains
            train = self.trainer.train_step(batch, data_cursor=cursor)
            t2 = time.perf_counter()
            version = int(train["policy_version"])
            metrics.update(self._sync_weights())
            self.pool.set_policy_version(version)
            t3 = time.perf_counter()
            top_up(1)  # sync: the next batch is generated by the weights just pushed
            metrics.update({f"train/{k}": v for k, v in train.items()})
            metrics.update(_batch_metrics(batch, policy_version=version - 1))
            metrics.update({
                "time/generate_s": t1 - t0, "time/train_s": t2 - t1, "time/push_s": t3 - t2,
                "time/step_s": time.perf_counter() - t0,
                "perf/tokens_per_s": batch.num_tokens / max(time.perf_counter() - t0, 1e-9),
            })  # fmt: skip
            every = run.eval.every_num_steps
            if every and (step + 1) % every == 0 and step + 1 < run.num_steps:
                metrics.update(self._evaluate())
            self._log(step, metrics)


def push_failures(outcomes: list[dict[str, Any]]) -> dict[str, str]:
    """Receiver address -> error for every receiver whose push (on any rank) or commit failed, from the per-rank
    outcomes of ``TrainerGroup.push_weights``."""
    return {a: e for o in outcomes for a, e in {**o["push_errors"], **o.get("commit_errors", {})}.items() if e}


def _informative_groups(batch: RolloutBatch) -> list[list[Any]]:
    """Groups whose rewards are not all equal (the others give zero GRPO advantage)."""
    return [g for g in batch.groups().values() if len({s.reward for s in g}) > 1]


def _batch_metrics(batch: RolloutBatch, policy_version: int) -> dict[str, float]:
    rewards = np.array([s.reward for s in batch.samples])
    lengths = np.array([len(s.completion_ids) for s in batch.samples])
    staleness = np.array([policy_version - s.policy_version for s in batch.samples])
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "rollout/completion_len_mean": float(lengths.mean()),
        "rollout/completion_len_max": float(lengths.max()),
        "rollout/truncated_frac": float(np.mean([s.finish_reason == "length" for s in batch.samples])),
        "rollout/staleness_max": float(staleness.max()),
    }
    terms = {name for s in batch.samples for name in s.reward_terms}
    for name in sorted(terms):
        out[f"reward/{name}"] = float(np.mean([s.reward_terms.get(name, 0.0) for s in batch.samples]))
    return out
