"""The supervised warm start: SFT steps on the task's ideal completions before RL, so a tiny model has signal.

It runs ``num_steps`` steps at most and stops earlier when a target of the recipe is met: the mean loss of the last
steps (``stop_at_loss``) or the held-out accuracy of the policy's own samples (``stop_at_accuracy``, checked every
``check_every_num_steps`` steps through the rollout pool after a weight push).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from common.chat_turns import turn_end_id
from rollout.envs.base import environment_name
from rollout.envs.tools import check_tool_descriptions
from rollout.tokenizer import render_prompt
from rollout.types import Sample

if TYPE_CHECKING:
    from rollout.envs.config import EnvironmentConfig

__all__ = ["WarmStartError", "sft_samples", "warm_start"]

_LOSS_WINDOW = 10
_PROGRESS_EVERY_S = 15.0
"""Seconds between the warm start's progress lines (each accuracy check prints one too): it runs minutes."""

logger = logging.getLogger("rl_align")


class WarmStartError(RuntimeError):
    """The environment's own code failed while the warm start rendered its prompts (the message names it)."""


async def _episode_start(new_env: Callable[[], Any], problem: Any) -> tuple[Any, Any]:
    """The first messages and the tool descriptions of an episode of ``problem``, as an episode starts, its
    environment closed after; ``WarmStartError`` naming the environment when its own code fails."""
    try:
        env = new_env()
    except Exception as e:
        raise WarmStartError(f"warm start: constructing the environment for problem {problem.problem_id!r} raised "
                             f"{type(e).__name__}: {e}") from e  # fmt: skip
    try:
        try:
            messages = await env.reset(problem)
        except Exception as e:
            raise WarmStartError(f"warm start: {environment_name(env)}: reset of problem {problem.problem_id!r} raised "
                                 f"{type(e).__name__}: {e}; fix the environment's reset") from e  # fmt: skip
        tools = getattr(env, "tools", None)
        if tools is not None:
            try:
                check_tool_descriptions(tools)
            except ValueError as e:
                raise WarmStartError(f"warm start: {environment_name(env)}: {e}") from None
        return messages, tools
    finally:  # what an episode holds (a sandbox, a process) is released, as after an episode
        try:
            await env.close()
        except Exception as e:  # noqa: BLE001  (user code; its prompt is read already)
            logger.warning("warm start: %s: close raised %s: %s", environment_name(env), type(e).__name__, e)


def sft_samples(
    tokenizer: Any,
    examples: list[tuple[Any, str | list[dict[str, str]]]],
    use_chat_template: bool | None,
    environment: EnvironmentConfig | None = None,
    max_model_len: int | None = None,
) -> list[Sample]:
    """Turn ``(problem, ideal completion)`` pairs into trainer samples: a completion text carries the loss whole; a
    transcript (a list of messages, :func:`rollout.envs.episode.render_transcript`) on its assistant turns only. The
    prompt is the one an episode of ``environment`` starts from (its system prompt and tools included).

    ``max_model_len``: the engines' (``rollout.engine.max_model_len``); a prompt that leaves them no room for a
    completion raises :class:`WarmStartError` here, before any step trains on it, rather than at the first RL batch."""
    from rollout.envs import PromptTooLong, build_environment
    from rollout.envs.config import AgentEnvConfig, SingleTurnEnvConfig, ToolEnvConfig
    from rollout.envs.episode import render_transcript

    if isinstance(environment, AgentEnvConfig):  # an agent's own prompts are not known before it runs
        tools = environment.warm_start_tools
        environment = ToolEnvConfig(tools=tools) if tools else None
    environment = environment or SingleTurnEnvConfig()
    new_env = build_environment(environment)

    async def episode_starts() -> list[tuple[Any, Any]]:  # one event loop for all: a loop each was most of the time
        return [await _episode_start(new_env, problem) for problem, _ in examples]

    samples = []
    for i, ((_, completion), (messages, tools)) in enumerate(zip(examples, asyncio.run(episode_starts()), strict=True)):
        prompt_ids = render_prompt(tokenizer, messages, use_chat_template, tools=tools)
        if max_model_len is not None and len(prompt_ids) >= max_model_len:
            too_long = PromptTooLong.of(examples[i][0].problem_id, len(prompt_ids), max_model_len)
            raise WarmStartError(f"warm start: {too_long}")
        if isinstance(completion, str):
            completion_ids = np.asarray(tokenizer(completion, add_special_tokens=False)["input_ids"], np.int64)
            mask = None
        else:
            completion_ids, mask = render_transcript(tokenizer, completion, tools)
        samples.append(
            Sample(
                prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
                completion_ids=completion_ids,
                rollout_logprobs=np.zeros(len(completion_ids), dtype=np.float32),
                reward=0.0,
                group_id=i,
                policy_version=0,
                loss_mask=mask,
            )
        )
    return samples


def warm_start(
    trainer: Any,
    dataset: Any,
    tokenizer: Any,
    cfg: Any,
    use_chat_template: bool | None,
    log: Callable[[int, dict[str, float]], None],
    evaluate: Callable[[], dict[str, float]] | None = None,
    environment: EnvironmentConfig | None = None,
    max_model_len: int | None = None,
) -> int:
    """Run SFT steps of ``cfg.num_examples_per_step`` examples at ``cfg.lr`` until ``cfg.num_steps`` or a target of
    ``cfg`` (a ``WarmStartConfig``) is met; log each step (and each accuracy check, as ``warm_start/*``). Returns the
    steps run.

    ``evaluate()`` must push the current weights to the pool and return ``eval/*`` metrics; it is required by
    ``stop_at_accuracy``. ``environment``: what the RL episodes run in (their first prompt is the SFT prompt).
    ``max_model_len``: the engines'; a longer prompt stops the warm start (:func:`sft_samples`).
    """
    if cfg.stop_at_accuracy is not None and evaluate is None:
        raise ValueError("warm_start.stop_at_accuracy needs an evaluation of the policy (pass evaluate)")
    per_step = cfg.num_examples_per_step
    end = turn_end_id(tokenizer, use_chat_template)  # where the engines stop a turn
    end_text = tokenizer.eos_token if end is None else tokenizer.decode([end])
    examples = dataset.sft_examples(cfg.num_steps * per_step, end_text)
    losses: list[float] = []
    start = last_line = time.monotonic()
    for step in range(cfg.num_steps):
        samples = sft_samples(
            tokenizer, examples[step * per_step : (step + 1) * per_step], use_chat_template, environment, max_model_len
        )
        metrics = trainer.sft_step(samples, lr=cfg.lr)
        losses.append(metrics["sft_loss"])
        done = cfg.stop_at_loss is not None and len(losses) >= _LOSS_WINDOW and (
            float(np.mean(losses[-_LOSS_WINDOW:])) <= cfg.stop_at_loss
        )
        if cfg.stop_at_accuracy is not None and evaluate is not None and (step + 1) % cfg.check_every_num_steps == 0:
            accuracy = evaluate().get("eval/accuracy", 0.0)
            metrics["warm_start/eval_accuracy"] = accuracy
            done = done or accuracy >= cfg.stop_at_accuracy
        log(step, metrics)
        now = time.monotonic()
        if done or now - last_line >= _PROGRESS_EVERY_S or "warm_start/eval_accuracy" in metrics:
            last_line = now
            check = metrics.get("warm_start/eval_accuracy")
            target = "" if check is None else f" | held-out accuracy {check:.3f} (target {cfg.stop_at_accuracy:g})"
            per_step_s = (now - start) / (step + 1)
            left = per_step_s * (cfg.num_steps - step - 1)
            # A target may end it sooner: then the steps left are at most these.
            eta = f"at most {left:.0f}s left" if cfg.stop_at_accuracy or cfg.stop_at_loss else f"ETA {left:.0f}s"
            logger.info("warm start step %d/%d | loss %.3g (mean of the last %d)%s | %.2fs/step %s", step + 1,
                      cfg.num_steps, float(np.mean(losses[-_LOSS_WINDOW:])), min(len(losses), _LOSS_WINDOW), target,
                      per_step_s, eta)  # fmt: skip
        if done:
            return step + 1
    return cfg.num_steps
