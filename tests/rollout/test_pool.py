"""RolloutPool on real vLLM workers (Ray actors): pushes reach every worker, and a worker killed mid-batch loses no
group.

One Ray instance and one pool of 2 workers per module; the tiny model keeps each engine start to seconds.
"""

from __future__ import annotations

import collections
import time

import pytest

from tests.rollout.vllm_helpers import TINY_ARCH, make_model, perturbed_state

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from rollout.config import EngineConfig, RolloutConfig, SamplingConfig  # noqa: E402
from rollout.pool import FIRST_POOL_GROUP_ID, RolloutPool  # noqa: E402
from rollout.rewards.config import ExactMatchRewardConfig, RewardConfig  # noqa: E402
from rollout.tasks.problem import Problem  # noqa: E402
from weight_sync.config import WeightSyncConfig  # noqa: E402

assert TINY_ARCH
PROBLEMS = [Problem(prompt=f"What is {i} + {i}?", answer=str(2 * i), problem_id=f"p{i}") for i in range(8)]
LONG = SamplingConfig(temperature=1.0, max_tokens=64, ignore_eos=True, seed=11)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def pool(model_dir, tmp_path_factory):
    ray.init(address="local", _temp_dir=str(tmp_path_factory.mktemp("ray")), include_dashboard=False, num_cpus=4,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}})
    config = RolloutConfig(
        model_path=model_dir, num_workers=2, max_groups_per_dispatch=2, num_worker_restarts=2,
        engine=EngineConfig(max_model_len=256, max_num_seqs=16, cpu_threads_bind="nobind", kv_cache_gib=0.25,
                            enforce_eager=True),
    )
    pool = RolloutPool(config, reward=RewardConfig(terms=[ExactMatchRewardConfig()]), weight_sync=WeightSyncConfig())
    yield pool
    pool.shutdown()
    ray.shutdown()


def _push_all(addresses: list[str], policy_version: int, state) -> None:
    from weight_sync.sender import Shard, WeightSender

    with WeightSender(addresses, WeightSyncConfig()) as sender:
        report = sender.push(policy_version, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in state.items()])
        assert not report.failed, report.failed
        assert not any(sender.commit(policy_version).values())


@pytest.mark.slow
def test_killed_worker_mid_batch_still_returns_every_group(pool, model_dir):
    addresses = pool.receiver_addresses()
    assert len(addresses) == 2
    state = perturbed_state(model_dir)
    _push_all(addresses, 1, state)
    pool.set_policy_version(1)
    assert pool.policy_versions() == [1, 1]
    pushed_to = []

    def publish(to: list[str]) -> int:  # the trainer's catch-up push, as driver.publisher does it
        pushed_to.extend(to)
        _push_all(to, 1, state)
        return 1

    pool.set_weight_publisher(publish)

    handle = pool.submit(PROBLEMS, group_size=2, sampling=LONG, first_group_id=0)  # as the loop numbers training
    time.sleep(1.0)  # both workers are generating by now
    ray.kill(pool.workers[0])
    batch = pool.collect(handle, timeout_s=300)

    groups = collections.Counter(s.group_id for s in batch.samples)
    assert sorted(groups) == list(range(8)) and set(groups.values()) == {2}
    assert all(s.policy_version == 1 and len(s.completion_ids) == 64 for s in batch.samples)
    assert batch.metrics["rollout/num_redispatched"] >= 1
    assert "reward/exact_match/mean" in batch.metrics

    pool.wait_for_workers(timeout_s=300)
    assert pool.policy_versions() == [1, 1], "the replacement was pushed the committed version before serving"
    assert len(set(pool.receiver_addresses()) - set(addresses)) == 1
    assert pushed_to == [a for a in pool.receiver_addresses() if a not in addresses]
    again = pool.collect(pool.submit(PROBLEMS[:4], group_size=2, sampling=LONG), timeout_s=300)
    own = list(range(FIRST_POOL_GROUP_ID, FIRST_POOL_GROUP_ID + 4))  # the pool numbers what the caller did not
    assert sorted({s.group_id for s in again.samples}) == own
