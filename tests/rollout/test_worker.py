"""RolloutWorker in-process (no Ray): prompts rendered with the chat template, groups sampled, rewards scored."""

from __future__ import annotations

import numpy as np
import pytest

from tests.rollout.vllm_helpers import tiny_rollout_config

pytest.importorskip("vllm")

from rollout.config import SamplingConfig  # noqa: E402
from rollout.rewards.config import ExactMatchRewardConfig, RewardConfig  # noqa: E402
from rollout.tasks.problem import Problem  # noqa: E402
from rollout.tokenizer import render_prompt  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    config = tiny_rollout_config(tmp_path_factory, SamplingConfig(max_tokens=8, seed=5), max_model_len=256)
    worker = RolloutWorker(config, reward=RewardConfig(terms=[ExactMatchRewardConfig()]))
    yield worker
    worker.shutdown()


def test_generate_groups_renders_samples_and_scores(worker):
    problems = [Problem(prompt="What is 1 + 1?", answer="2", problem_id="a"),
                Problem(prompt=[{"role": "user", "content": "7 - 3?"}], answer="4", problem_id="b")]
    batch = worker.generate_groups(problems, group_ids=[10, 11], group_size=3)
    assert [s.group_id for s in batch.samples] == [10] * 3 + [11] * 3
    for s in batch.samples:
        problem = problems[s.group_id - 10]
        assert s.prompt_ids.tolist() == render_prompt(worker.tokenizer, problem.prompt)
        assert 1 <= len(s.completion_ids) <= 8 and s.rollout_logprobs.dtype == np.float32
        assert np.all(s.rollout_logprobs <= 0) and s.policy_version == 0
        assert s.reward in (0.0, 1.0) and set(s.reward_terms) == {"exact_match"}
        assert s.metadata["problem_id"] == problem.problem_id
    assert batch.metrics["reward/num_errors"] == 0
    assert batch.metrics["rollout/num_completion_tokens"] == sum(len(s.completion_ids) for s in batch.samples)
    # Seeds follow the group id, not the worker or the batch: the same group alone gives the same samples.
    alone = worker.generate_groups(problems[1:], group_ids=[11], group_size=3)
    assert [s.completion_ids.tolist() for s in alone.samples] == [s.completion_ids.tolist() for s in batch.samples[3:]]


def test_health_and_version(worker):
    health = worker.health()
    assert health["ok"] and health["policy_version"] == worker.policy_version() == 0
    assert health["receiver_address"] == worker.receiver_address()
    assert worker.receiver_address().startswith("127.0.0.1:")


def test_pushed_weights_reach_generation_through_the_receiver(worker):
    from tests.rollout.vllm_helpers import perturbed_state
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import Shard, WeightSender

    state = perturbed_state(worker.config.model_path, seed=4)
    problem = [Problem(prompt="2 + 2?", answer="4", problem_id="c")]
    before = worker.generate_groups(problem, group_ids=[0], group_size=2)
    with WeightSender([worker.receiver_address()], WeightSyncConfig(), session_id="test") as sender:
        assert not sender.push(3, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in state.items()]).failed
        assert not any(sender.commit(3).values())
    assert worker.policy_version() == 3 and worker.health()["last_update_s"] > 0
    after = worker.generate_groups(problem, group_ids=[0], group_size=2)
    assert all(s.policy_version == 3 for s in after.samples)
    assert after.metrics["rollout/weight_update_s"] == pytest.approx(worker.health()["last_update_s"])
    assert worker.generate_groups(problem, group_ids=[0], group_size=2).metrics["rollout/weight_update_s"] == 0.0
    # A near-uniform tiny model may sample the same seeded tokens under both versions; their log-probs differ.
    assert not np.allclose(np.concatenate([s.rollout_logprobs for s in after.samples]),
                           np.concatenate([s.rollout_logprobs for s in before.samples]), atol=1e-3)
