"""The supervised warm start: a few SFT steps on the task's ideal completions before RL, so a tiny model has signal."""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout.tokenizer import render_prompt
from rollout.types import Sample

__all__ = ["sft_samples", "warm_start"]


def sft_samples(tokenizer: Any, examples: list[tuple[Any, str]], use_chat_template: bool | None) -> list[Sample]:
    """Turn ``(problem, ideal completion text)`` pairs into trainer samples (the completion carries the loss)."""
    samples = []
    for i, (problem, completion) in enumerate(examples):
        prompt_ids = render_prompt(tokenizer, problem.prompt, use_chat_template)
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        samples.append(
            Sample(
                prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
                completion_ids=np.asarray(completion_ids, dtype=np.int64),
                rollout_logprobs=np.zeros(len(completion_ids), dtype=np.float32),
                reward=0.0,
                group_id=i,
                policy_version=0,
            )
        )
    return samples


def warm_start(trainer: Any, dataset: Any, tokenizer: Any, cfg: Any, use_chat_template: bool | None, log: Any) -> None:
    """Run ``cfg.num_steps`` SFT steps of ``cfg.num_examples_per_step`` examples at ``cfg.lr``; log each step."""
    per_step = cfg.num_examples_per_step
    examples = dataset.sft_examples(cfg.num_steps * per_step, tokenizer.eos_token)
    for step in range(cfg.num_steps):
        samples = sft_samples(tokenizer, examples[step * per_step : (step + 1) * per_step], use_chat_template)
        metrics = trainer.sft_step(samples, lr=cfg.lr)
        log(step, metrics)
