"""What the agent endpoint tests share: a tiny model's sampling, a problem, the scripted agents, and small helpers."""

from __future__ import annotations

import numpy as np

from rollout.agents import AgentRunner
from rollout.config import SamplingConfig
from rollout.envs.config import AgentEnvConfig
from rollout.tasks.problem import Problem

# A random tiny model rarely writes the end-of-turn token; stopping on 80 of its 512 ids ends turns after a few tokens.
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=24, stop_token_ids=list(range(100, 180)), seed=5)
PROBLEM = Problem(prompt="What is 12 * 34?", answer="408", problem_id="p0")
AGENTS = "tests.rollout.agents.scripted_agents"


def runner_of(worker, function: str, **limits) -> AgentRunner:
    """An agent runner of the scripted agent ``function`` on the worker's engine (shut it down after)."""
    return AgentRunner(AgentEnvConfig(function=f"{AGENTS}:{function}", **limits), worker.engine, worker.tokenizer)


def one_episode(worker, function: str, **limits):
    """The outcome of one episode of ``function`` on :data:`PROBLEM` (its runner shut down after)."""
    runner = runner_of(worker, function, **limits)
    try:
        [outcome] = runner.run([(PROBLEM, 0, 0)], SAMPLING)
    finally:
        runner.shutdown()
    return outcome


def episodes_of(samples):
    """Samples of one batch grouped into episodes (by sample index), segments in order."""
    out: dict[int, list] = {}
    for s in samples:
        out.setdefault(s.metadata["sample_index"], []).append(s)
    for segments in out.values():
        assert [s.metadata["segment"] for s in segments] == list(range(len(segments)))
        assert {s.metadata["num_segments"] for s in segments} == {len(segments)}
    return out


def model_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask.tolist(), 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


async def unfinished_requests(engine) -> int:
    """Requests the engine still holds (run on its loop: ``engine.run(unfinished_requests(engine))``)."""
    return engine._engine.get_num_unfinished_requests()
