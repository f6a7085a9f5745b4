"""How the run hands out cores: the recipe resolves the placement, and each placement gives each role its threads
and Ray reservation (the threads reaching the actors is checked end to end in tests/integration/test_faults.py)."""

import pytest

from common.config import ConfigError
from driver.placement import cluster_node_cores, host_cores, plan_placement
from recipe import load_recipe


def _recipe(**overrides):
    return load_recipe("recipes/grpo_tiny.toml", overrides, check_paths=False)


def test_auto_colocates_sync_cpu_runs_and_separates_async_ones():
    assert _recipe().run.placement == "colocated"
    assert _recipe(**{"run.mode": "async"}).run.placement == "separate"
    assert _recipe(**{"run.placement": "separate"}).run.placement == "separate"


@pytest.mark.parametrize(("overrides", "match"), [
    ({"run.mode": "async", "run.placement": "colocated"}, "run.placement.*async"),
    ({"trainer.device": "cuda", "run.placement": "colocated"}, "run.placement.*cuda.*separate"),
])  # fmt: skip
def test_colocation_where_phases_do_not_take_turns_on_cpu_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _recipe(**overrides)


def test_colocated_phases_get_every_core():
    plan = plan_placement(_recipe(**{"rollout.num_workers": 1}), num_cores=8)
    assert plan.trainer_env == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert plan.rollout_env["OMP_NUM_THREADS"] == plan.rollout_env["MKL_NUM_THREADS"] == "8"
    assert plan.trainer_cpus + plan.rollout.num_cpus_per_worker == 8 and plan.num_cores == 8
    assert plan.rollout.engine.cpu_threads_bind == "auto"  # one engine: vLLM pins a thread to every core
    assert plan.receiver_sync.offers_shm  # the handover stays on the host
    assert not plan.receiver_sync.delta  # raw tensors over shared memory: no base copy of the model in each engine


@pytest.mark.parametrize(("overrides", "num_cores", "workers"), [
    ({}, 2, 2),  # colocated on two cores: the second engine runs its share of vLLM's Python beside the first
    ({}, 8, 2),
    ({}, 1, 1),  # one core: a second engine would only take turns with the first
    ({"run.mode": "async"}, 8, 1),  # separate: each engine reserves its CPUs
    ({"rollout.num_workers": 3}, 2, 3),  # a number is kept
])  # fmt: skip
def test_auto_rollout_workers_follow_the_placement(overrides, num_cores, workers):
    recipe = _recipe(**overrides)
    plan = plan_placement(recipe, num_cores)
    assert plan.num_rollout_workers == plan.rollout.num_workers == workers
    if plan.shared_group:  # every colocated actor fits on the host, whatever the count
        assert recipe.trainer.num_ranks * plan.trainer_cpus + workers * plan.rollout.num_cpus_per_worker == (
            pytest.approx(num_cores))


def test_a_pool_refuses_an_unresolved_worker_count():
    from rollout.config import RolloutConfig
    from rollout.pool import RolloutPool

    with pytest.raises(ValueError, match="num_workers = 'auto'.*plan_placement"):
        RolloutPool(RolloutConfig(model_path="unused", num_workers="auto"))


def test_colocated_actors_of_one_role_split_the_cores():
    plan = plan_placement(_recipe(**{"trainer.num_ranks": 2, "rollout.num_workers": 4}), num_cores=8)
    assert plan.trainer_env == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    assert plan.rollout_env["OMP_NUM_THREADS"] == plan.rollout_env["MKL_NUM_THREADS"] == "2"
    assert plan.rollout.engine.cpu_threads_bind == "nobind"  # 'auto' would pin all four engines to the same cores
    assert 2 * plan.trainer_cpus + 4 * plan.rollout.num_cpus_per_worker == pytest.approx(8)
    pinned = plan_placement(_recipe(**{"rollout.num_workers": 2, "rollout.engine.cpu_threads_bind": "0-1"}), 4)
    assert pinned.rollout.engine.cpu_threads_bind == "0-1"  # what the recipe says explicitly stays


def test_separate_actors_run_on_their_reservation():
    plan = plan_placement(_recipe(**{"run.placement": "separate", "rollout.num_workers": 2}), num_cores=8)
    assert plan.trainer_env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} and plan.trainer_cpus == 1.0
    assert plan.rollout.num_cpus_per_worker == 1.0 and plan.num_cores == 3
    assert not plan.receiver_sync.offers_shm and plan.receiver_sync.delta


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_eager_engines_start_with_nothing_to_compile(placement):
    """An eager engine's process starts with TorchDynamo off (vLLM's sampler would otherwise compile a helper on the
    first batch that asks for log-probs); a compiling engine keeps it."""
    eager = plan_placement(_recipe(**{"run.placement": placement}), num_cores=4)
    assert eager.rollout_env["TORCHDYNAMO_DISABLE"] == "1"
    compiling = plan_placement(_recipe(**{"run.placement": placement, "rollout.engine.enforce_eager": False}), 4)
    assert "TORCHDYNAMO_DISABLE" not in compiling.rollout_env
    assert "TORCHDYNAMO_DISABLE" not in eager.trainer_env  # the trainer's own compile (trainer.compile) is untouched


def test_separate_roles_spread_over_nodes_as_the_recipe_says():
    plan = plan_placement(_recipe(**{"run.placement": "separate"}), num_cores=8)
    assert (plan.trainer_strategy, plan.rollout_strategy, plan.shared_group) == ("PACK", "SPREAD", False)
    plan = plan_placement(_recipe(**{"run.placement": "separate", "run.placement_groups.trainer": "STRICT_PACK",
                                     "run.placement_groups.rollout": "STRICT_SPREAD"}), num_cores=8)  # fmt: skip
    assert (plan.trainer_strategy, plan.rollout_strategy) == ("STRICT_PACK", "STRICT_SPREAD")


def test_colocated_roles_share_one_host():
    plan = plan_placement(_recipe(), num_cores=8)
    assert (plan.trainer_strategy, plan.rollout_strategy, plan.shared_group) == ("STRICT_PACK", "STRICT_PACK", True)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"run.placement_groups.rollout": "STRICT_SPREAD"}, r"run\.placement_groups\.rollout.*colocated.*'separate'"),
    ({"run.placement": "separate", "rollout.num_cpus_per_worker": 0.0}, r"rollout\.num_cpus_per_worker.*empty bundle"),
    ({"run.placement_groups.trainer": "SIDEWAYS"}, r"run\.placement_groups\.trainer"),
])  # fmt: skip
def test_placement_groups_the_run_cannot_make_are_refused_by_the_recipe(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _recipe(**overrides)


def test_a_joined_cluster_sizes_a_colocated_run_from_its_largest_node():
    """The driver's affinity sized a job's colocated run: a head of 0 CPUs beside 8-CPU nodes, or a pod whose affinity
    shows the whole VM, got a STRICT_PACK group no node could hold."""
    node = lambda node_id, cpus, alive=True: {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus}}  # noqa: E731
    head, cores = "head", host_cores()
    assert cluster_node_cores([node(head, 0), node("a", 8), node("b", 6)], head) == 8
    assert cluster_node_cores([node(head, 0), node("a", 8, alive=False), node("b", 6)], head) == 6
    assert cluster_node_cores([node(head, cores + 2)], head) == cores  # the driver's node: no more threads than cores
    assert cluster_node_cores([node(head, 1)], head) == 1  # a pod limited to 1 CPU
    assert cluster_node_cores([node(head, 0)], head) == 0
