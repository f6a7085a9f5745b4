"""The RL loop: generate -> score -> train -> push, synchronous or with generation running ahead (async).

Sync mode is strictly on-policy: step t trains on samples of policy version t. Async mode keeps ``max_staleness``
batches generating while the trainer trains, so generating batch t+1 overlaps training on batch t; samples then lag the
trainer by at most ``max_staleness`` versions and the trainer's truncated importance sampling corrects for it.

Each batch remembers the dataset cursor right after its prompts were drawn; the trainer checkpoints that cursor with
the weights, so ``--resume`` regenerates exactly the batches that were in flight when the job stopped.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from rollout.types import RolloutBatch

__all__ = ["RLLoop"]


@dataclass
class _InFlight:
    handle: Any
    cursor: dict
    """Dataset cursor right after this batch's prompts were drawn."""
    problems: list
    """The batch's prompts (generated again when a replacement worker served them with stale weights)."""


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

    def _submit(self) -> None:
        problems = self.dataset.next_batch(self.recipe.run.num_prompts_per_step)
        handle = self.pool.submit(problems, self.recipe.algorithm.group_size)
        self._queue.append(_InFlight(handle, self.dataset.state_dict(), list(problems)))

    def _collect(self) -> tuple[RolloutBatch, dict, dict[str, float]]:
        """The next step's batch (with DAPO dynamic sampling when on), its cursor, and rollout metrics."""
        run = self.recipe.run
        item = self._queue.popleft()
        batch, num_stale = self._fresh(self.pool.collect(item.handle), item.problems)
        metrics = dict(batch.metrics)  # the pool's own names: rollout/*, reward/*
        metrics["rollout/num_stale_regenerated"] = float(num_stale)
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

    def _fresh(self, batch: RolloutBatch, problems: list) -> tuple[RolloutBatch, int]:
        """``batch``, or when it holds samples older than the mode allows, the same prompts generated again after a
        weight push; also how many samples were too old.

        A rollout worker that died is replaced inside ``pool.collect``; when no live peer holds newer weights the
        replacement starts from the initial checkpoint and generates the lost groups with it. Pushing now re-syncs
        it, and the batch is generated again on the current policy (sync mode must stay on-policy).
        """
        if not batch.metrics.get("rollout/num_redispatched"):
            return batch, 0  # no worker was replaced while generating it
        run = self.recipe.run
        # Sync: on-policy. Async: a batch submitted before step k's update is trained at step k + max_staleness.
        allowed = run.max_staleness if run.mode == "async" else 0
        current = self.trainer.policy_version()
        num_stale = sum(current - s.policy_version > allowed for s in batch.samples)
        if not num_stale:
            return batch, 0
        self._sync_weights()
        return self.pool.collect(self.pool.submit(problems, self.recipe.algorithm.group_size)), num_stale

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

        top_up(1)
        for step in range(start_step, run.num_steps):
            t0 = time.perf_counter()
            batch, cursor, metrics = self._collect()
            t1 = time.perf_counter()
            top_up(ahead)  # async: later batches generate with the current weights while this one trains
            train = self.trainer.train_step(batch, data_cursor=cursor)
            t2 = time.perf_counter()
            metrics.update(self._sync_weights())
            t3 = time.perf_counter()
            top_up(1)  # sync: the next batch is generated by the weights just pushed
            metrics.update({f"train/{k}": v for k, v in train.items()})
            metrics.update(_batch_metrics(batch, policy_version=int(train.get("policy_version", step + 1)) - 1))
            metrics.update({
                "time/generate_s": t1 - t0, "time/train_s": t2 - t1, "time/push_s": t3 - t2,
                "time/step_s": time.perf_counter() - t0,
                "perf/tokens_per_s": batch.num_tokens / max(time.perf_counter() - t0, 1e-9),
            })  # fmt: skip
            every = run.eval.every_num_steps
            if every and (step + 1) % every == 0 and step + 1 < run.num_steps:
                metrics.update(self._evaluate())
            self._log(step, metrics)


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
