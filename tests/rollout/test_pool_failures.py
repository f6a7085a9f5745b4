"""A rollout request's failed-episode budget (``environment.max_failed_fraction``) is the request's, however the pool
shares it over workers: small shares once let fewer episodes go than the fraction said, none at all for a share
smaller than ``1 / max_failed_fraction``. Real vLLM workers (Ray actors) running a custom environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rollout.vllm_helpers import make_model

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from rollout.config import EngineConfig, RolloutConfig, SamplingConfig  # noqa: E402
from rollout.envs import EpisodeFailed  # noqa: E402
from rollout.envs.config import CustomEnvConfig  # noqa: E402
from rollout.pool import RolloutPool  # noqa: E402
from rollout.tasks.problem import Problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHORT = SamplingConfig(temperature=1.0, max_tokens=4, ignore_eos=True, seed=3)


def _problems(*ids: str) -> list[Problem]:
    return [Problem(prompt=f"What is {i} + 1?", answer=str(i + 1), problem_id=pid) for i, pid in enumerate(ids)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp("tiny"))
    ray.init(address="local", _temp_dir=str(tmp_path_factory.mktemp("ray")), include_dashboard=False, num_cpus=4,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
                                       "PYTHONPATH": str(ROOT)}})  # fmt: skip
    environment = CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:FailsWhereTold", max_turns=2,
                                  max_failed_fraction=0.5)  # fmt: skip
    config = RolloutConfig(
        model_path=model_dir, num_workers=2, max_groups_per_dispatch=1,  # a share is one group of 2 episodes
        engine=EngineConfig(max_model_len=256, max_num_seqs=8, cpu_threads_bind="nobind", kv_cache_gib=0.125,
                            enforce_eager=True),
    )  # fmt: skip
    pool = RolloutPool(config, environment=environment)
    yield pool
    pool.shutdown()
    ray.shutdown()


def test_the_pool_lets_the_requests_fraction_go_over_shares_and_fails_it_one_past(pool):
    # 8 episodes at 0.5: 4 may fail. Each share is one group, both of whose episodes fail: floor(0.5 x 2) = 1 per share
    # failed the first failing share before.
    batch = pool.collect(pool.submit(_problems("ok0", "fail1", "ok2", "fail3"), 2, SHORT), timeout_s=300)
    assert sorted({s.metadata["problem_id"] for s in batch.samples}) == ["ok0", "ok2"]
    assert len(batch.samples) == 4 and batch.metrics["env/num_failed_episodes"] == 4

    handle = pool.submit(_problems("ok0", "fail1", "fail2", "fail3"), 2, SHORT)
    with pytest.raises(EpisodeFailed, match=r"6 of this rollout request's 8 episodes failed, and environment\."
                                            r"max_failed_fraction = 0.5 lets floor\(0.5 x 8\) = 4 go"):  # fmt: skip
        pool.collect(handle, timeout_s=300)
    with pytest.raises(ValueError, match="unknown or already collected"):
        pool.collect(handle)  # a failed request is gone
    again = pool.collect(pool.submit(_problems("ok0", "ok1"), 2, SHORT), timeout_s=300)
    assert len(again.samples) == 4 and "env/num_failed_episodes" in again.metrics


def test_a_request_whose_every_share_kept_nothing_fails_once_they_all_came_back(pool):
    # One episode of each group fails, within the budget (2 of 4), and each group keeps one where it needs two: each
    # share keeps nothing, which is the request's failure only once all came back.
    with pytest.raises(EpisodeFailed, match=r"^2 of this rollout request's 4 episodes failed, and no group kept the 2 "
                                            r"episodes it needs \(each failure's traceback"):  # fmt: skip
        pool.collect(pool.submit(_problems("half0", "half1"), 2, SHORT, min_group_size=2), timeout_s=300)


def test_a_refill_may_drop_as_many_failed_episodes_as_its_steps_batch(pool):
    """A dynamic-sampling refill of a few problems let floor(fraction x its few episodes) go, often none: one flaky
    episode failed the step."""
    with pytest.raises(EpisodeFailed, match=r"4 of this rollout request's 6 episodes failed"):  # floor(0.5 x 6) = 3
        pool.collect(pool.submit(_problems("ok0", "fail1", "fail2"), 2, SHORT), timeout_s=300)
    batch = pool.collect(pool.submit(_problems("ok0", "fail1", "fail2"), 2, SHORT, budget_of=8), timeout_s=300)
    assert batch.metrics["env/num_failed_episodes"] == 4 and len(batch.samples) == 2
    # A refill whose one group lost its episodes comes back empty (the loop draws another round), not failed.
    empty = pool.collect(pool.submit(_problems("fail3"), 2, SHORT, budget_of=8), timeout_s=300)
    assert empty.samples == [] and empty.metrics["env/num_failed_episodes"] == 2
