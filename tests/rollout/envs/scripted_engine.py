"""A stand-in for the rollout engine that :func:`rollout.envs.run_episode` drives: every model turn is the same
scripted text, so tests of the environment's side of an episode (its calls, checks and limits) run in milliseconds on
the tiny tokenizer, without vLLM."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from common.chat_turns import end_of_turn_id
from rollout.config import SamplingConfig
from rollout.envs import Environment, Episode, EpisodeLimits, run_episode
from rollout.tasks.problem import Problem
from rollout.tokenizer import PromptRenderer
from tools.tiny_tokenizer import build_tokenizer

PROBLEM = Problem(prompt="What is 12 * 34?", answer="408", problem_id="p0")
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=32)


@dataclass
class ScriptedCompletion:
    """What the episode reads of :class:`rollout.engine.vllm_engine.Completion`."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str = "stop"
    policy_version: int = 0


class ScriptedEngine:
    """Every turn generates ``text`` and the end-of-turn token, after ``step_s`` seconds awaited on the loop (as the
    engine's own steps are); ``prompts`` records each turn's prompt ids."""

    def __init__(self, text: str = "The answer is 408.", step_s: float = 0.0, max_model_len: int = 512) -> None:
        self.config = SimpleNamespace(max_model_len=max_model_len)
        tokenizer = tiny_tokenizer()
        self._ids = [*tokenizer.encode(text, add_special_tokens=False), end_of_turn_id(tokenizer)]
        self._step_s = step_s
        self.prompts: list[list[int]] = []

    async def generate_async(
        self, prompt: list[int], sampling: SamplingConfig, n: int = 1, seed: int | None = None
    ) -> list[ScriptedCompletion]:
        self.prompts.append(list(prompt))
        await asyncio.sleep(self._step_s)
        ids = np.asarray(self._ids[: sampling.max_tokens], np.int64)
        return [ScriptedCompletion(ids, np.full(len(ids), -0.5, np.float32))]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    return build_tokenizer()


def play(
    env: Environment,
    limits: EpisodeLimits | None = None,
    engine: ScriptedEngine | None = None,
) -> Episode:
    """``env``'s episode of :data:`PROBLEM` on ``engine`` (default: a fresh :class:`ScriptedEngine`), three turns at
    most unless ``limits`` say otherwise."""
    render = PromptRenderer(tiny_tokenizer())
    limits = limits or EpisodeLimits(max_turns=3)
    return asyncio.run(run_episode(engine or ScriptedEngine(), render, env, PROBLEM, SAMPLING, limits, lambda t: None))
