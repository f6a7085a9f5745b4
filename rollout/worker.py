"""A rollout worker: one vLLM engine, the weight-sync receiver that feeds it, the environment episodes run in, and the
reward scorer next to it.

Run as a Ray actor by :class:`rollout.pool.RolloutPool` (``ray.remote(RolloutWorker)``); it is a plain class so that a
test or a single-process script can also use it directly. Every sample is one episode (:mod:`rollout.envs`; a
single-turn task is the one-turn case), all episodes of a batch in flight at once on the engine's loop; a user's agent
(:mod:`rollout.agents`) instead calls the OpenAI-compatible endpoint the worker serves on the engine. Every sample
records the ``policy_version`` of the weights it was generated with; pushes arriving over gRPC are applied at the
engine's safe point (requests in flight finish on the old version).

Weights only ever arrive through the receiver, pushed by the trainer: a replacement worker starts on the model
directory (at the version it records: an export's, else 0) and is caught up by the trainer before it takes work
(:mod:`rollout.fleet`).
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from common.cpu import CpuClock
from rollout.config import RolloutConfig, SamplingConfig
from rollout.envs.base import EpisodeFailed
from rollout.envs.config import ENVIRONMENT_TERM
from rollout.envs.episode import run_episode
from rollout.envs.failures import FailureBudget, drop_failed, run_all
from rollout.metrics import episode_metrics
from rollout.sampling import is_greedy, turn_seed
from rollout.types import RolloutBatch, Sample

if TYPE_CHECKING:
    from rollout.agents import AgentOutcome
    from rollout.envs import Episode
    from rollout.envs.config import EnvironmentConfig
    from rollout.rewards.config import RewardConfig
    from rollout.tasks.problem import Problem
    from weight_sync.config import WeightSyncConfig

__all__ = ["RolloutWorker"]


_EDGE_TOKENS = 4
"""Tokens a message's content may add past its bytes where the template's text meets it (a cut merge, a prefix
space)."""
_PROBE = 'He said "a\\b"\n\t\x01 ﷺ ㍿ ½ ﬁ Ⅻ ' * 4
"""Contents a template escapes (quotes, backslashes, control characters) and a tokenizer may normalise to longer text
(NFKC: one character to several), at 4 copies so that a template writing a content twice shows too."""


class RolloutWorker:
    """One engine + one weight receiver (sink = the engine) + the environment + the reward scorer; see the module
    docstring."""

    def __init__(
        self,
        config: RolloutConfig,
        reward: RewardConfig | None = None,
        weight_sync: WeightSyncConfig | None = None,
        environment: EnvironmentConfig | None = None,
        trainer_session: str | None = None,
    ) -> None:
        """``trainer_session``: the weight-sync session of the trainer whose base model the engine starts from (its
        receiver reports it until the first commit, so that trainer's adapters alone are taken); None: unknown."""
        from common.chat_turns import turn_end_id
        from rollout.agents import AgentRunner, load_agent_function
        from rollout.engine.sink import VLLMWeightSink
        from rollout.engine.vllm_engine import VLLMEngine
        from rollout.envs import build_environment, episode_limits
        from rollout.envs.config import AgentEnvConfig, SingleTurnEnvConfig
        from rollout.rewards.scorer import RewardScorer
        from rollout.tokenizer import PromptRenderer, load_tokenizer
        from weight_sync.config import WeightSyncConfig
        from weight_sync.receiver import WeightReceiver

        self.config = config
        self._sync_config = weight_sync or WeightSyncConfig()
        self.tokenizer = load_tokenizer(config.tokenizer_dir)
        self._render = PromptRenderer(self.tokenizer, config.use_chat_template)
        end = turn_end_id(self.tokenizer, config.use_chat_template)
        # A model turn ends at the template's end-of-turn, which a base model's end-of-sequence ids may not include.
        self._turn_end = None if end == self.tokenizer.eos_token_id else end
        self._info_names: set[str] = set()  # the environment's info figures seen so far
        self.scorer = RewardScorer.from_config(reward) if reward is not None else None
        self._env_config = environment or SingleTurnEnvConfig()
        self._limits = episode_limits(self._env_config)
        agent = self._env_config if isinstance(self._env_config, AgentEnvConfig) else None
        self._new_env = None if agent else build_environment(self._env_config)
        if agent:
            load_agent_function(agent.function, agent.options)  # fails before the engine starts
        self.engine = VLLMEngine(config.served_model_path, config.engine, config.tokenizer_dir)
        # vLLM seeds the process's `random` and `numpy.random` with the engine's seed: every worker, and every
        # replacement after a restart, handed environments, tools and agents the same "random" streams. (torch's stays
        # as vLLM seeded it: the engine's own sampling draws from it.)
        random.seed()
        np.random.seed()
        self._agents = AgentRunner(agent, self.engine, self.tokenizer) if agent else None
        self.sink = VLLMWeightSink(self.engine)
        self.receiver = WeightReceiver(self.sink, self._sync_config, sink_session=trainer_session)
        self.receiver.start()
        self._cpu = CpuClock()
        self._update_seen = 0.0

    def _stopping_at_turn_end(self, sampling: SamplingConfig) -> SamplingConfig:
        """``sampling`` with the end-of-turn token among its stop ids (unless it ignores the end of sequence)."""
        end = self._turn_end
        if end is None or end in sampling.stop_token_ids or sampling.ignore_eos:
            return sampling
        return sampling.model_copy(update={"stop_token_ids": [*sampling.stop_token_ids, end]})

    def generate_groups(
        self,
        problems: Sequence[Problem],
        group_ids: Sequence[int],
        group_size: int,
        sampling: SamplingConfig | None = None,
        min_group_size: int = 1,
        request_episodes: int | None = None,
    ) -> RolloutBatch:
        """Run ``group_size`` episodes of each problem (group ``group_ids[i]`` for ``problems[i]``), all at once on the
        engine, and score them. Episodes whose own code failed are dropped within ``environment.max_failed_fraction``
        of ``request_episodes`` (the whole rollout request's episodes when this call is one share of it, whose caller
        checks the shares' sum; default: this call's) (one more fails the call), and with them a group left with fewer
        than ``min_group_size`` episodes (2 for group-relative advantages), so a group may come back smaller or not at
        all.

        Returns the samples grouped by problem, in input order, and additive metrics: ``rollout/generate_s``,
        ``rollout/score_s`` (the reward functions), ``rollout/num_completion_tokens`` (model tokens),
        ``rollout/process_cpu_s`` (this worker's CPU seconds since its previous batch, weight loads and its reward
        process's included), ``rollout/weight_update_s`` (seconds weight updates held the engine since its previous
        batch), ``reward/num_errors`` and ``reward/<term>/num_errors``; for multi-turn
        environments also ``env/num_episodes``, ``env/num_turns``, ``env/num_observation_tokens``,
        ``env/num_timeouts``, ``env/num_failed_episodes`` (dropped within ``environment.max_failed_fraction``),
        ``env/num_dropped_episodes`` (those and the rest of the groups dropped whole) and the environment's own
        ``env/<name>`` sums (``env/tool_calls``, ``env/tool_s``, ...); for an agent the ``agent/*`` figures of
        :func:`rollout.agents.agent_metrics`. An agent episode whose calls do not extend each other gives one sample
        per segment (:mod:`rollout.agents.trajectory`), each with the episode's reward and ``Sample.episode`` set, so
        the episode counts once in its group's advantages.
        """
        from rollout.agents import agent_metrics

        if len(problems) != len(group_ids):
            raise ValueError(f"{len(problems)} problems but {len(group_ids)} group ids; pass one id per problem")
        sampling = self._stopping_at_turn_end(sampling or self.config.sampling)
        start = time.perf_counter()
        jobs, runs, outcomes, num_failed = self._run_jobs(problems, group_ids, group_size, sampling, min_group_size,
                                                          request_episodes)  # fmt: skip
        generate_s = time.perf_counter() - start
        finals = [segments[-1] for segments, _ in runs]
        rewards, terms, errors = self._score(
            [e.final_text for e in finals], [e.final_turn_tokens for e in finals], [problems[i] for i, _ in jobs],
            sampling.max_tokens,
        )  # fmt: skip
        score_s = time.perf_counter() - start - generate_s
        multi_turn = self._env_config.type != "single_turn"
        samples = [
            Sample(
                prompt_ids=np.asarray(e.prompt_ids, dtype=np.int64),
                completion_ids=e.completion_ids,
                rollout_logprobs=e.logprobs,
                reward=rewards[j] + env_reward,
                group_id=int(group_ids[i]),
                policy_version=min(e.policy_versions, default=self.engine.policy_version),
                finish_reason=e.finish_reason,
                # Greedy decoding's log-probs are vLLM's untempered ones (T = 1); recipes never train on them.
                temperature=1.0 if is_greedy(sampling) else sampling.temperature,
                reward_terms={name: scores[j] for name, scores in terms.items()}
                | ({ENVIRONMENT_TERM: env_reward} if multi_turn else {}),
                metadata={"problem_id": problems[i].problem_id, "answer": problems[i].answer}
                | ({"num_turns": e.num_turns, "final_text": finals[j].final_text} if multi_turn else {})
                | ({"sample_index": k, "segment": s, "num_segments": len(segments)} if self._agents else {}),
                loss_mask=e.loss_mask if multi_turn and not e.loss_mask.all() else None,
                episode=k if len(segments) > 1 else None,
            )
            for j, ((i, k), (segments, env_reward)) in enumerate(zip(jobs, runs, strict=True))
            for s, e in enumerate(segments)
        ]
        metrics = {"rollout/generate_s": generate_s, "rollout/score_s": score_s,
                   "rollout/num_completion_tokens": float(sum(int(s.num_model_tokens) for s in samples)),
                   "rollout/process_cpu_s": self._cpu.lap() + (self.scorer.cpu_lap() if self.scorer else 0.0),
                   "rollout/weight_update_s": self._update_lap(), **errors}
        if multi_turn:
            metrics["env/num_failed_episodes"] = float(num_failed)
            metrics["env/num_dropped_episodes"] = float(len(problems) * group_size - len(jobs))
        if outcomes is not None:
            metrics |= agent_metrics(outcomes)
        elif multi_turn:
            episodes = [segments[0] for segments, _ in runs]
            metrics |= episode_metrics(
                [e.num_turns for e in episodes], [int((e.loss_mask == 0).sum()) for e in episodes],
                [e.timed_out for e in episodes], [e.info for e in episodes],
            )  # fmt: skip
            # A figure the environment reported before is 0 in a batch where none of its episodes did, not missing
            # (a gap in its curve).
            self._info_names.update(name for e in episodes for name in e.info)
            metrics |= {f"env/{name}": 0.0 for name in self._info_names if f"env/{name}" not in metrics}
        return RolloutBatch(samples=samples, metrics=metrics)

    def _run_jobs(
        self, problems: Sequence[Problem], group_ids: Sequence[int], group_size: int, sampling: SamplingConfig,
        min_group_size: int, request_episodes: int | None,
    ) -> tuple[list[tuple[int, int]], list[tuple[list[Episode], float]], list[AgentOutcome] | None, int]:
        """Every episode ``(problem index, sample index)`` at once; those whose own code failed are dropped within
        ``environment.max_failed_fraction`` of ``request_episodes`` (:mod:`rollout.envs.failures`), and a group left
        with fewer than ``min_group_size`` whole. Returns the kept jobs, their (segments, environment reward), the
        agent outcomes (None without an agent) and how many episodes failed."""
        jobs = [(i, k) for i in range(len(problems)) for k in range(group_size)]
        budget = FailureBudget(len(jobs), self._env_config.max_failed_fraction, request_episodes)
        ran: Sequence[AgentOutcome | Episode | EpisodeFailed]
        if self._agents is not None:
            ran = self._agents.run([(problems[i], int(group_ids[i]), k) for i, k in jobs], sampling, budget)
        else:
            new_env, render, limits = self._new_env, self._render, self._limits
            assert new_env is not None

            name = getattr(self._env_config, "class_path", self._env_config.type)

            async def episode(i: int, k: int) -> Episode:
                try:
                    env = new_env()
                except Exception as e:  # the user's constructor: one episode's failure, within the budget
                    raise EpisodeFailed(f"environment {name}: constructing it for problem {problems[i].problem_id!r} "
                                        f"raised {type(e).__name__}: {e}") from e  # fmt: skip
                return await run_episode(self.engine, render, env, problems[i], sampling, limits,
                                         functools.partial(turn_seed, sampling, group_ids[i], k))  # fmt: skip

            async def episodes() -> list[Episode | EpisodeFailed]:
                return await run_all([episode(i, k) for i, k in jobs], budget)

            ran = self.engine.run(episodes())
        whole = request_episodes is None or request_episodes == len(jobs)
        keep = drop_failed([i for i, _ in jobs], ran, min_group_size, whole_request=whole)
        kept = [ran[j] for j in keep]
        if self._agents is not None:
            outcomes = cast("list[AgentOutcome]", kept)
            return [jobs[j] for j in keep], [(o.episodes, o.reward) for o in outcomes], outcomes, len(budget.failures)
        runs = [([e], e.env_reward) for e in cast("list[Episode]", kept)]
        return [jobs[j] for j in keep], runs, None, len(budget.failures)

    def _update_lap(self) -> float:
        total = self.engine.total_update_s
        lap, self._update_seen = total - self._update_seen, total
        return lap

    def _score(
        self, texts: list[str], lengths: list[int], problems: list[Problem], max_tokens: int
    ) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
        if self.scorer is None or not texts:  # no texts: a share of a request whose every episode failed
            return [0.0] * len(texts), {}, {}
        return self.scorer.score(texts, problems, num_tokens=lengths, max_tokens=max_tokens)

    def prompts_too_long(self, prompts: Sequence[tuple[str, Any]], most: int = 5) -> tuple[int, list[tuple[str, int]]]:
        """How many of ``prompts`` (problem id, prompt), rendered as the single-turn environment renders them, leave
        the engine no room for a completion (``rollout.engine.max_model_len`` tokens or more), and (id, tokens) of the
        first ``most`` of them (a check of the whole task before anything trains).

        Only a prompt that could reach the limit is rendered: where a token holds at least one byte of the contents
        and the template writes each content once as it is, a prompt takes at most its contents' UTF-8 bytes plus
        what the template adds around messages of its roles (measured once per sequence of roles, with one-character
        contents) plus a few tokens a message cut at the contents' edges. A probe per sequence of roles (contents
        that a template escaping or repeating them, or a tokenizer normalising them, would make longer than that
        bound) decides whether the bound holds; where it does not, every prompt of those roles is rendered."""
        from rollout.tokenizer import render_prompt

        limit, count = self.config.engine.max_model_len, 0
        first: list[tuple[str, int]] = []
        bounds: dict[tuple[str, ...], int | None] = {}  # roles -> template tokens around them, None: no bound holds
        for problem_id, prompt in prompts:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            roles = tuple(str(m.get("role")) for m in messages)
            if roles not in bounds:
                bounds[roles] = _template_tokens(self.tokenizer, self.config.use_chat_template, prompt, messages)
            around = bounds[roles]
            content_bytes = sum(len((m.get("content") or "").encode()) for m in messages)
            if around is not None and around + content_bytes + _EDGE_TOKENS * len(messages) < limit:
                continue  # cannot reach the limit
            num_tokens = len(render_prompt(self.tokenizer, prompt, self.config.use_chat_template))
            if num_tokens >= limit:
                count += 1
                if len(first) < most:
                    first.append((problem_id, num_tokens))
        return count, first

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
        """Stop the receiver, the agent endpoint and the reward process, then release the engine."""
        self.receiver.stop()
        if self._agents is not None:
            self._agents.shutdown()
        if self.scorer is not None:
            self.scorer.close()
        self.engine.shutdown()


def _template_tokens(
    tokenizer: Any, use_chat_template: bool | None, prompt: Any, messages: list[dict[str, Any]]
) -> int | None:
    """Tokens the template adds around messages of ``messages``' roles (rendered with one-character contents), or None
    when a probe shows contents may take more tokens than their bytes (escaped, repeated, normalised)."""
    from rollout.tokenizer import render_prompt

    def render(content: str) -> int:
        stand_in = content if isinstance(prompt, str) else [{**m, "content": content} for m in messages]
        return len(render_prompt(tokenizer, stand_in, use_chat_template))

    around = render("x")
    probed = render(_PROBE)
    return around if probed <= around + len(messages) * (len(_PROBE.encode()) + _EDGE_TOKENS) else None
