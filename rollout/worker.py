"""A rollout worker: one vLLM engine, the weight-sync receiver that feeds it, and the reward scorer next to it.

Run as a Ray actor by :class:`rollout.pool.RolloutPool` (``ray.remote(RolloutWorker)``); it is a plain class so that a
test or a single-process script can also use it directly. Every sample it returns records the ``policy_version`` of
the weights it was generated with; pushes arriving over gRPC are applied between generation batches (the engine lock).

Weights only ever arrive through the receiver, pushed by the trainer: a replacement worker starts on the model
directory (version 0) and is caught up by the trainer before it takes work (:mod:`rollout.fleet`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from common.cpu import CpuClock
from rollout.config import RolloutConfig, SamplingConfig
from rollout.sampling import group_seed
from rollout.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from rollout.rewards.config import RewardConfig
    from rollout.tasks.problem import Problem
    from weight_sync.config import WeightSyncConfig

__all__ = ["RolloutWorker"]


class RolloutWorker:
    """One engine + one weight receiver (sink = the engine) + the reward scorer; see the module docstring."""

    def __init__(
        self,
        config: RolloutConfig,
        reward: RewardConfig | None = None,
        weight_sync: WeightSyncConfig | None = None,
    ) -> None:
        from rollout.engine.sink import VLLMWeightSink
        from rollout.engine.vllm_engine import VLLMEngine
        from rollout.rewards.scorer import RewardScorer
        from rollout.tokenizer import load_tokenizer
        from weight_sync.config import WeightSyncConfig
        from weight_sync.receiver import WeightReceiver

        self.config = config
        self._sync_config = weight_sync or WeightSyncConfig()
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.served_model_path)
        self.scorer = RewardScorer.from_config(reward) if reward is not None else None
        self.engine = VLLMEngine(config.served_model_path, config.engine, config.tokenizer_path)
        self.sink = VLLMWeightSink(self.engine)
        self.receiver = WeightReceiver(self.sink, self._sync_config)
        self.receiver.start()
        self._cpu = CpuClock()
        self._update_seen = 0.0

    def generate_groups(
        self,
        problems: Sequence[Problem],
        group_ids: Sequence[int],
        group_size: int,
        sampling: SamplingConfig | None = None,
    ) -> RolloutBatch:
        """Sample ``group_size`` completions of each problem (group ``group_ids[i]`` for ``problems[i]``) and score
        them.

        Returns the samples grouped by problem, in input order, and additive metrics: ``rollout/generate_s``,
        ``rollout/num_completion_tokens``, ``rollout/process_cpu_s`` (this worker's CPU seconds since its previous
        batch, weight loads included), ``rollout/weight_update_s`` (seconds weight updates held the engine since its
        previous batch), ``reward/num_errors`` and ``reward/<term>/num_errors``.
        """
        from rollout.tokenizer import render_prompt

        if len(problems) != len(group_ids):
            raise ValueError(f"{len(problems)} problems but {len(group_ids)} group ids; pass one id per problem")
        sampling = sampling or self.config.sampling
        prompts = [render_prompt(self.tokenizer, p.prompt, self.config.use_chat_template) for p in problems]
        start = time.perf_counter()
        groups = self.engine.generate(prompts, sampling, group_size, [group_seed(sampling, g) for g in group_ids])
        generate_s = time.perf_counter() - start
        flat = [(i, c) for i, group in enumerate(groups) for c in group]
        rewards, terms, errors = self._score([c.token_ids for _, c in flat], [problems[i] for i, _ in flat],
                                             [group_ids[i] for i, _ in flat], sampling.max_tokens)
        samples = [
            Sample(
                prompt_ids=np.asarray(prompts[i], dtype=np.int64),
                completion_ids=c.token_ids,
                rollout_logprobs=c.logprobs,
                reward=rewards[k],
                group_id=int(group_ids[i]),
                policy_version=c.policy_version,
                finish_reason=c.finish_reason,
                # Greedy decoding's log-probs are vLLM's untempered ones (T = 1); recipes never train on them.
                temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
                reward_terms={name: scores[k] for name, scores in terms.items()},
                metadata={"problem_id": problems[i].problem_id, "answer": problems[i].answer},
            )
            for k, (i, c) in enumerate(flat)
        ]
        metrics = {"rollout/generate_s": generate_s,
                   "rollout/num_completion_tokens": float(sum(len(c.token_ids) for _, c in flat)),
                   "rollout/process_cpu_s": self._cpu.lap(), "rollout/weight_update_s": self._update_lap(), **errors}
        return RolloutBatch(samples=samples, metrics=metrics)

    def _update_lap(self) -> float:
        total = self.engine.total_update_s
        lap, self._update_seen = total - self._update_seen, total
        return lap

    def _score(
        self, completions: list[np.ndarray], problems: list[Problem], group_ids: list[int], max_tokens: int
    ) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
        if self.scorer is None:
            return [0.0] * len(completions), {}, {}
        texts = self.tokenizer.batch_decode([ids.tolist() for ids in completions], skip_special_tokens=True)
        lengths = [len(ids) for ids in completions]
        return self.scorer.score(texts, problems, group_ids, num_tokens=lengths, max_tokens=max_tokens)

    def receiver_address(self) -> str:
        """host:port of this worker's weight receiver, reachable from other nodes when it binds a wildcard address."""
        if self._sync_config.bind_host in ("0.0.0.0", "::"):
            import ray

            return f"{ray.util.get_node_ip_address()}:{self.receiver.address.rpartition(':')[2]}"
        return self.receiver.address

    def policy_version(self) -> int:
        """Version of the weights the engine serves now."""
        return self.engine.policy_version

    def wait_for_version(self, policy_version: int, timeout_s: float | None = None) -> int:
        """Block until the engine serves ``policy_version`` or newer (a push through the receiver), or ``timeout_s``
        passed; return the version served then. Answers while other calls run (the pool's actors are threaded)."""
        changed = self.receiver.area.version_changed
        with changed:
            changed.wait_for(lambda: self.engine.policy_version >= policy_version, timeout=timeout_s)
        return self.engine.policy_version

    def health(self) -> dict[str, Any]:
        """Liveness facts for the pool and for monitoring; ``ok`` is false once the engine must be replaced;
        ``num_threads``: the engine's torch threads."""
        import torch

        return {
            "ok": self.engine.broken is None,
            "error": self.engine.broken,
            "policy_version": self.engine.policy_version,
            "last_update_s": self.engine.last_update_s,
            "receiver_address": self.receiver_address(),
            "pid": os.getpid(),
            "num_threads": torch.get_num_threads(),
        }

    def shutdown(self) -> None:
        """Stop the receiver, then release the engine."""
        self.receiver.stop()
        self.engine.shutdown()
