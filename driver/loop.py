"""The RL loop: generate -> score -> train -> push, synchronous or with generation running ahead (async).

Sync mode is strictly on-policy: step t trains on samples of policy version t. Async mode keeps ``max_staleness``
batches generating while the trainer trains, so generating batch t+1 overlaps training on batch t; samples then lag the
trainer by at most ``max_staleness`` versions and the trainer's truncated importance sampling corrects for it.

Each batch remembers the dataset cursor right after its prompts were drawn; the trainer checkpoints that cursor with
the weights, so ``--resume`` regenerates exactly the batches that were in flight when the job stopped.

Every push goes through the :class:`driver.publisher.WeightPublisher`, which also tells the pool the committed
``policy_version`` and catches up replaced workers, so a death never makes a batch older than the mode allows. The
loop decides when to checkpoint (``trainer.checkpoint.every_num_steps``); training itself has no side effects. A step's
HF export and checkpoint are written after the step's metrics record, at the start of the next step while the engines
generate its batch: a job killed at any moment resumes from a checkpoint whose steps all have their records and exports.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.cpu import CpuClock
from common.run_dir import HF_EXPORTS
from rollout.metrics import combined_metrics
from rollout.types import RolloutBatch, Sample, episode_members

if TYPE_CHECKING:
    from rollout.pool import RolloutHandle

__all__ = ["RLLoop", "checkpoint_due"]

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
        publisher: Any,
        log: Callable[[int, dict[str, float]], None],
        evaluate: Callable[[], dict[str, float]],
        num_cores: int = 1,
        log_samples: Callable[[int, Sequence[Sample]], None] | None = None,
    ) -> None:
        """``publisher``: the run's :class:`driver.publisher.WeightPublisher` (``publish() -> push metrics``);
        ``num_cores``: the cores the run's actors hold (``driver.placement.Placement.num_cores``); ``log_samples``:
        given each step and the samples it trained on (``driver.sample_log.SampleLog.write``)."""
        self.recipe, self.pool, self.trainer, self.dataset = recipe, pool, trainer, dataset
        self.publisher, self._log, self._evaluate = publisher, log, evaluate
        self._log_samples = log_samples
        self.num_cores = num_cores
        self._queue: collections.deque[_InFlight] = collections.deque()
        self._cpu = CpuClock()
        self._warned_terms: set[str] = set()

    def _submit(self) -> None:
        handle = self._submit_next(self.recipe.run.num_prompts_per_step)
        self._queue.append(_InFlight(handle, self.dataset.state_dict()))

    def _submit_next(self, num_prompts: int) -> RolloutHandle:
        """Submit the next ``num_prompts`` training problems; their group ids are their stream positions, so that a
        seeded run resumed from a checkpoint (its cursor restored) samples what the run would have sampled. A
        dynamic-sampling refill (fewer problems) may drop as many failed episodes as the step's batch."""
        first = self.dataset.stream_position
        problems = self.dataset.next_batch(num_prompts)
        algorithm = self.recipe.algorithm
        least = 2 if algorithm.group_relative else 1  # a group-relative advantage compares two episodes at least
        batch = self.recipe.run.num_prompts_per_step * algorithm.group_size
        return self.pool.submit(problems, algorithm.group_size, first_group_id=first, min_group_size=least,
                                budget_of=batch)  # fmt: skip

    def _collect(self) -> tuple[RolloutBatch, dict, dict[str, float]]:
        """The next step's batch (with DAPO dynamic sampling when on), its cursor, and rollout metrics.

        Reward and rollout figures describe everything the step sampled (every dynamic-sampling round); the filtered
        batch that training gets has its mean reward under ``reward/filtered_mean``.
        """
        run = self.recipe.run
        item = self._queue.popleft()
        batch = self.pool.collect(item.handle)
        metrics = dict(batch.metrics)  # the pool's own names: rollout/*, reward/*
        if not run.dynamic_sampling.enabled:
            return batch, item.cursor, metrics
        rounds = [batch]
        term = run.dynamic_sampling.filter_term
        kept = _informative_groups(batch, term)
        while len(kept) < run.num_prompts_per_step and len(rounds) < run.dynamic_sampling.max_num_rounds:
            rounds.append(self.pool.collect(self._submit_next(run.num_prompts_per_step - len(kept))))
            kept += _informative_groups(rounds[-1], term)
        # A cursor taken now also covers the extra prompts. No later batch is in flight yet (sync mode, or async with
        # max_staleness = 1: the next batch is drawn after this collect; RunConfig refuses more), so it is exact.
        cursor = self.dataset.state_dict() if len(rounds) > 1 else item.cursor
        metrics = combined_metrics(rounds)
        metrics["rollout/dynamic_sampling_rounds"] = float(len(rounds))
        metrics["rollout/informative_groups"] = float(len(kept))
        if not kept:
            kept = list(batch.groups().values())  # nothing informative: train anyway (zero advantages, KL only)
        samples = [s for group in kept[: run.num_prompts_per_step] for s in group]
        episodes = episode_members([s.group_id for s in samples], [s.episode for s in samples])
        metrics["reward/filtered_mean"] = sum(samples[m[0]].reward for m in episodes) / len(episodes)
        return RolloutBatch(samples, batch.metrics), cursor, metrics

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
        owed: tuple[int, dict] | None = None  # the last step and its cursor, whose checkpoint/export may be due
        evaluated = False  # an evaluation ran after the previous step: this step's CPU laps hold its work
        for step in range(start_step, run.num_steps):
            t0 = time.perf_counter()
            if owed is not None:
                self._save(*owed)
            t1 = time.perf_counter()
            batch, cursor, metrics = self._collect()
            self._warn_failing_terms(step, metrics)
            t2 = time.perf_counter()
            top_up(ahead)  # async: later batches generate with the current weights while this one trains
            train = self.trainer.train_step(batch)
            t3 = time.perf_counter()
            version = int(train["policy_version"])
            metrics.update(self.publisher.publish())
            t4 = time.perf_counter()
            top_up(1)  # sync: the next batch is generated by the weights just pushed
            metrics.update({f"train/{k}": v for k, v in train.items()})
            metrics["rollout/staleness_max"] = float(max(version - 1 - s.policy_version for s in batch.samples))
            metrics.update(_phase_metrics(metrics, (t0, t1, t2, t3, t4, time.perf_counter()), batch.num_tokens))
            cpu_s = self._cpu.lap() + metrics["train/process_cpu_s"] + metrics.get("rollout/process_cpu_s", 0.0)
            if step > start_step and not evaluated:  # the first laps also hold the start-up and warm start
                metrics["perf/cores_busy"] = cpu_s / max(metrics["time/step_s"] * self.num_cores, 1e-9)
            every = run.eval.every_num_steps
            evaluated = bool(every) and (step + 1) % every == 0 and step + 1 < run.num_steps
            if evaluated:  # after the step's timers: its seconds are time/eval_s alone
                t5 = time.perf_counter()
                metrics.update(self._evaluate())
                metrics["time/eval_s"] = time.perf_counter() - t5
            self._log(step, metrics)
            if self._log_samples is not None:
                self._log_samples(step, batch.samples)
            owed = (step, cursor)
        if owed is not None:
            self._save(*owed)

    def _warn_failing_terms(self, step: int, metrics: dict[str, float]) -> None:
        """Warn once per term whose reward function failed on most of a step's samples (``reward.on_error = 'zero'``
        scores them 0: the run trains on zeros, and only a counter said so)."""
        num_scored = metrics.get("rollout/num_episodes", 0.0)  # the rewards score an episode once
        for key, num_errors in metrics.items():
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "reward" or parts[2] != "num_errors":  # reward/<term>/num_errors
                continue
            term = parts[1]
            if term not in self._warned_terms and num_scored and num_errors > num_scored / 2:
                self._warned_terms.add(term)
                log.warning("step %d: reward term %r failed on %d of %d episodes, each scored 0 (reward.on_error = "
                            "'zero'): the run learns from zeros; the rollout workers' log has the first error of each "
                            "type with its traceback (this warning is given once per term)", step, term,
                            int(num_errors), int(num_scored))  # fmt: skip

    def _save(self, step: int, cursor: dict) -> None:
        """The HF export and checkpoint due after ``step`` (0-based), of the trainer's state after that step; the
        checkpoint last, so that a committed checkpoint implies every output of the steps it covers is written."""
        run = self.recipe.run
        if run.export.every_num_steps and (step + 1) % run.export.every_num_steps == 0:
            out = run.resolved_output_dir / HF_EXPORTS / f"step_{step + 1}"
            self.trainer.export_hf(str(out), self.recipe.export_source_dir, run.export.dtype,
                                   use_chat_template=self.recipe.rollout.use_chat_template)  # fmt: skip
        if checkpoint_due(self.recipe, step):
            self.trainer.save_checkpoint(data_cursor=cursor)


def _phase_metrics(metrics: dict[str, float], marks: tuple[float, ...], num_tokens: int) -> dict[str, float]:
    """Where a step's wall time went: ``time/*`` per phase as the driver saw it, and the part of training spent
    outside the trainer's step (actor round trips, batch serialisation; the engines' own share of generation is
    ``rollout/generate_s``). ``time/checkpoint_s`` is the previous step's checkpoint and export, which this step's
    generation overlaps (its wait for the batch is ``time/generate_s``)."""
    t0, t1, t2, t3, t4, end = marks
    return {
        "time/checkpoint_s": t1 - t0, "time/generate_s": t2 - t1, "time/train_s": t3 - t2, "time/push_s": t4 - t3,
        "time/step_s": end - t0,
        "time/train_overhead_s": max(0.0, t3 - t2 - metrics["train/step_s"]),
        "perf/tokens_per_s": num_tokens / max(end - t0, 1e-9),
    }  # fmt: skip


def checkpoint_due(recipe: Any, step: int) -> bool:
    """Whether the state after ``step`` (0-based) is checkpointed: every ``trainer.checkpoint.every_num_steps``."""
    every = recipe.trainer.checkpoint.every_num_steps
    return every > 0 and (step + 1) % every == 0


def _informative_groups(batch: RolloutBatch, term: str | None) -> list[list[Any]]:
    """Groups whose rewards (or whose reward ``term``, when named) are not all equal: the others give zero (or only
    bonus-driven) GRPO advantage."""
    def score(s: Any) -> float:
        return s.reward if term is None else s.reward_terms[term]

    return [g for g in batch.groups().values() if len({score(s) for s in g}) > 1]
