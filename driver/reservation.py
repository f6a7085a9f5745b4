"""Ray placement groups for the run's roles: which node each trainer rank and rollout worker runs on.

    roles = [Role("trainer", {"CPU": 1.0}, 2, "PACK"), Role("rollout", {"CPU": 1.0}, 2, "SPREAD")]
    held = reserve(roles, shared=False, name="grpo_tiny", timeout_s=300, can_grow=False)
    TrainerGroup(..., placement=held["trainer"].actor_placement())   # rank r in bundle r of the trainer's group
    held["rollout"].bundle_nodes()                                   # Ray's node id of each bundle
    release(held)

Each role's actors are the bundles of one placement group with the role's strategy; ``shared`` puts every role's
bundles in one group (a colocated run: one STRICT_PACK group, so one host). Ray keeps a group's bundles when an actor
dies, and moves the bundles of a node that died to nodes with room, so a replacement rollout worker started in its
slot's bundle lands on a live node without the pool knowing about nodes. Nothing is started before every group is
placed: a group the cluster cannot hold fails the run first (at once on an embedded Ray, which cannot grow; after
``timeout_s`` on a joined cluster, whose autoscaler may add nodes meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PlacementError", "Reservation", "Role", "release", "reserve", "why_unplaceable"]

log = logging.getLogger(__name__)

_LOG_EVERY_S = 30.0


class PlacementError(RuntimeError):
    """The cluster cannot hold a role's actors as its strategy asks; the message says what is missing."""


@dataclass(frozen=True)
class Role:
    """``count`` actors that each reserve ``bundle`` (Ray resource name -> amount), placed by ``strategy``."""

    name: str
    bundle: Mapping[str, float]
    count: int
    strategy: str


@dataclass(frozen=True)
class Reservation:
    """The bundles of one role: ``count`` consecutive bundles of ``group`` from ``first``."""

    role: Role
    group: Any
    """The ``ray.util.placement_group.PlacementGroup`` that holds them."""
    first: int

    def actor_placement(self) -> list[dict[str, Any]]:
        """Ray actor options that put the role's i-th actor in its bundle (``TrainerGroup``/``RolloutPool``
        ``placement=``)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return [
            {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)}
            for i in range(self.first, self.first + self.role.count)
        ]

    def bundle_nodes(self) -> list[str]:
        """Ray's node id of each of the role's bundles now (a bundle of a lost node moves once Ray placed it again;
        an empty string while it has no node)."""
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        return [nodes.get(i, "") for i in range(self.first, self.first + self.role.count)]


def why_unplaceable(
    bundles: Sequence[Mapping[str, float]], strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why no placement of ``bundles`` by ``strategy`` can exist on nodes of total resources ``nodes`` (what they
    hold when idle), or None when one may. A necessary check only: fragmentation can still leave a group waiting."""

    def fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
        return all(have.get(name, 0.0) >= amount for name, amount in need.items() if amount > 0)

    for bundle in bundles:
        if not any(fits(bundle, node) for node in nodes):
            return f"no node has {_fmt(bundle)} for one actor"
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    if strategy == "STRICT_PACK" and not any(fits(total, node) for node in nodes):
        return f"STRICT_PACK needs one node with {_fmt(total)} for all {len(bundles)} actor(s)"
    if strategy == "STRICT_SPREAD":
        roomy = sum(1 for node in nodes if all(fits(bundle, node) for bundle in bundles))
        if roomy < len(bundles):
            return f"STRICT_SPREAD needs {len(bundles)} nodes with room for one actor each; the cluster has {roomy}"
    for name, amount in total.items():
        have = sum(node.get(name, 0.0) for node in nodes)
        if have < amount:
            return f"the cluster has {have:g} {name} in all and the actors need {amount:g}"
    return None


def reserve(roles: Sequence[Role], shared: bool, name: str, timeout_s: float, can_grow: bool) -> dict[str, Reservation]:
    """Create and wait for the placement groups of ``roles`` (one group for all when ``shared``, with the first
    role's strategy); returns each role's reservation by name. Raises :class:`PlacementError` when a group cannot be
    placed (``can_grow`` False: at once; else after ``timeout_s``), having removed the groups it made."""
    import ray
    from ray.util.placement_group import placement_group

    plans = [list(roles)] if shared else [[role] for role in roles]
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    held: dict[str, Reservation] = {}
    try:
        for plan in plans:
            bundles = [dict(role.bundle) for role in plan for _ in range(role.count)]
            strategy, what = plan[0].strategy, " + ".join(f"{role.count} {role.name}" for role in plan)
            problem = why_unplaceable(bundles, strategy, nodes)
            if problem is not None and not can_grow:
                raise PlacementError(f"cannot place {what} ({strategy}): {problem}; {_cluster_hint(shared)}")
            if problem is not None:
                log.warning("the cluster cannot place %s (%s) yet: %s; waiting up to %.0f s for more nodes", what,
                            strategy, problem, timeout_s)  # fmt: skip
            group = placement_group(bundles, strategy=strategy, name=f"{name}-{plan[0].name}")
            first = 0
            for role in plan:
                held[role.name] = Reservation(role, group, first)
                first += role.count
            _wait_placed(group, what, strategy, timeout_s, problem, shared)
            for role in plan:
                log.info("%d %s placed (%s) on node(s) %s", role.count, role.name, strategy,
                         ", ".join(node[:8] for node in held[role.name].bundle_nodes()))  # fmt: skip
    except BaseException:
        release(held)
        raise
    return held


def release(held: Mapping[str, Reservation]) -> None:
    """Remove the placement groups of ``held`` (their actors should be gone: Ray kills what still runs in them)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for group in {id(r.group): r.group for r in held.values()}.values():
        try:
            remove_placement_group(group)
        except ray.exceptions.RayError as e:  # closing: report and go on
            log.warning("while removing placement group %s: %s", group.id, e)


def _wait_placed(group: Any, what: str, strategy: str, timeout_s: float, problem: str | None, shared: bool) -> None:
    """Wait for ``group``; past ``timeout_s`` raise :class:`PlacementError` naming ``problem`` (why the nodes there
    were at the start could not hold it, when known: no node with a GPU, say) and what the cluster has free."""
    import ray

    deadline = time.monotonic() + timeout_s
    ready = group.ready()
    while True:
        left = deadline - time.monotonic()
        done, _ = ray.wait([ready], timeout=max(0.0, min(_LOG_EVERY_S, left)))
        if done:
            return
        if left <= _LOG_EVERY_S:
            why = f": {problem}, and no node that could joined" if problem is not None else ""
            raise PlacementError(f"could not place {what} ({strategy}) within {timeout_s:g} s{why}; "
                                 f"{_cluster_hint(shared)} (raise run.placement_groups.timeout_s if nodes are still "
                                 "joining)")  # fmt: skip
        log.info("waiting for the cluster to place %s (%s)", what, strategy)


def _cluster_hint(shared: bool) -> str:
    """What the cluster has free and what to change; ``shared``: the group of a colocated run (every actor on one
    node), which run.placement = 'separate' spreads."""
    import ray

    free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "TPU")}
    nodes = [n for n in ray.nodes() if n["Alive"]]
    choice = ("run.placement = 'separate' (a colocated run keeps every actor on one node)" if shared
              else "a looser run.placement_groups strategy")  # fmt: skip
    return (f"the cluster has {len(nodes)} node(s) with {_fmt(free) or 'nothing'} free: add nodes, lower the "
            f"actors' reservations, or choose {choice}")  # fmt: skip


def _fmt(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items()) if amount > 0)
