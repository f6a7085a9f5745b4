"""The agent endpoint tests' worker: a real rollout worker (vLLM on a tiny Qwen 3) with the scripted agents."""

from __future__ import annotations

import pytest

from tests.rollout.agents.endpoint_helpers import AGENTS, SAMPLING


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    pytest.importorskip("vllm")
    from rollout.envs.config import AgentEnvConfig
    from rollout.rewards.config import ExactMatchRewardConfig, RewardConfig
    from rollout.worker import RolloutWorker
    from tests.rollout.vllm_helpers import tiny_rollout_config

    config = tiny_rollout_config(tmp_path_factory, SAMPLING, max_model_len=512)
    env = AgentEnvConfig(function=f"{AGENTS}:tool_loop", max_turns=4, options={"turns": 3})
    worker = RolloutWorker(config, reward=RewardConfig(terms=[ExactMatchRewardConfig()]), environment=env)
    worker.engine.generate([[5, 6, 7]], SAMPLING, 1)  # warm: a cold engine's first call outlasted 1 s timeouts alone
    yield worker
    worker.shutdown()
