"""Placement groups per role (``driver.reservation``): a layout the cluster can never hold is refused before any actor
starts, with what is missing; actors started in a reservation run in its group, on its bundles' nodes; groups are
removed after. The same on a cluster of several nodes, with a node lost: tests/integration/test_multi_node.py."""

from __future__ import annotations

import re
import time

import pytest

ray = pytest.importorskip("ray")

from driver.reservation import PlacementError, Role, release, reserve, why_unplaceable  # noqa: E402

FOUR_CPUS = {"CPU": 4.0}


@pytest.mark.parametrize(("bundles", "strategy", "nodes", "match"), [
    ([{"CPU": 8.0}], "PACK", [FOUR_CPUS, FOUR_CPUS], "no node has 8 CPU"),
    ([{"CPU": 1.0, "GPU": 1.0}], "PACK", [FOUR_CPUS], "no node has 1 CPU, 1 GPU"),
    ([{"CPU": 3.0}] * 2, "STRICT_PACK", [FOUR_CPUS, FOUR_CPUS], "STRICT_PACK needs one node with 6 CPU"),
    ([{"CPU": 1.0}] * 3, "STRICT_SPREAD", [FOUR_CPUS, FOUR_CPUS], "STRICT_SPREAD needs 3 nodes.*has 2"),
    ([{"CPU": 3.0}] * 3, "SPREAD", [FOUR_CPUS, FOUR_CPUS], "has 8 CPU in all and the actors need 9"),
])  # fmt: skip
def test_layouts_no_cluster_of_these_nodes_holds_are_named(bundles, strategy, nodes, match):
    problem = why_unplaceable(bundles, strategy, nodes)
    assert problem is not None and re.search(match, problem), problem


@pytest.mark.parametrize(("bundles", "strategy"), [
    ([{"CPU": 2.0}] * 2, "STRICT_PACK"), ([{"CPU": 1.0}] * 2, "STRICT_SPREAD"), ([{"CPU": 3.0}] * 2, "SPREAD"),
    ([{"CPU": 0.5, "GPU": 0.0}] * 4, "PACK"),
])  # fmt: skip
def test_layouts_the_nodes_hold_pass(bundles, strategy):
    assert why_unplaceable(bundles, strategy, [FOUR_CPUS, FOUR_CPUS]) is None


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    ray.init(address="local", _temp_dir=str(tmp_path_factory.mktemp("ray")), include_dashboard=False, num_cpus=2)
    yield
    ray.shutdown()


@ray.remote
class _Where:
    def where(self) -> tuple[str, str | None]:
        context = ray.get_runtime_context()
        return context.get_node_id(), context.get_placement_group_id()


def _groups_alive(prefix: str) -> list[str]:
    from ray.util.placement_group import placement_group_table

    groups = placement_group_table().values()
    return [g["name"] for g in groups if g["name"].startswith(prefix) and g["state"] != "REMOVED"]


@pytest.mark.parametrize("shared", [False, True])
def test_each_role_runs_in_its_bundles_and_the_groups_go_with_release(one_node, shared):
    name = f"roles-{int(shared)}"
    roles = [Role("trainer", {"CPU": 0.5}, 2, "STRICT_PACK" if shared else "PACK"),
             Role("rollout", {"CPU": 0.5}, 2, "STRICT_PACK" if shared else "SPREAD")]  # fmt: skip
    held = reserve(roles, shared=shared, name=name, timeout_s=30, can_grow=False)
    try:
        assert (held["trainer"].group is held["rollout"].group) == shared
        assert [held["trainer"].first, held["rollout"].first] == ([0, 2] if shared else [0, 0])
        for role in ("trainer", "rollout"):
            actors = [_Where.options(num_cpus=0.5, **opts).remote() for opts in held[role].actor_placement()]
            where = ray.get([a.where.remote() for a in actors])
            assert [node for node, _ in where] == held[role].bundle_nodes()
            assert {group for _, group in where} == {held[role].group.id.hex()}
            for a in actors:
                ray.kill(a)
        assert len(_groups_alive(name)) == (1 if shared else 2)
    finally:
        release(held)
    assert _groups_alive(name) == []


def test_a_layout_an_embedded_ray_cannot_hold_fails_at_once_and_leaves_no_group(one_node):
    roles = [Role("trainer", {"CPU": 1.0}, 1, "PACK"), Role("rollout", {"CPU": 1.0}, 2, "STRICT_SPREAD")]
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"cannot place 2 rollout \(STRICT_SPREAD\).*needs 2 nodes.*has 1.*1 node"):
        reserve(roles, shared=False, name="never", timeout_s=300, can_grow=False)
    with pytest.raises(PlacementError, match=r"cannot place 1 trainer \+ 2 rollout .*run.placement = 'separate'"):
        reserve(roles, shared=True, name="never", timeout_s=300, can_grow=False)  # a colocated run's one group
    assert time.monotonic() - started < 10
    assert _groups_alive("never") == []  # the trainer's group, placed first, was removed too


def test_a_joined_cluster_gets_timeout_s_to_make_room(one_node):
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"within 1 s.*timeout_s"):
        reserve([Role("rollout", {"CPU": 1.0}, 3, "PACK")], shared=False, name="wait", timeout_s=1, can_grow=True)
    assert 1 <= time.monotonic() - started < 10
    assert _groups_alive("wait") == []
    # What no node had is named at the end too (a GPU recipe on a CPU cluster ended naming only the free CPUs).
    with pytest.raises(PlacementError, match=r"within 1 s: no node has 1 CPU, 1 GPU for one actor, and no node that "
                                             r"could joined; the cluster has 1 node\(s\) with 2 CPU free"):
        reserve([Role("rollout", {"CPU": 1.0, "GPU": 1.0}, 1, "PACK")], shared=False, name="gpu", timeout_s=1,
                can_grow=True)  # fmt: skip
