"""Where the run's actors go and how many threads each runs: the one place CPU cores are handed out.

    plan = plan_placement(recipe, num_cores=host_cores())   # embedded; a joined cluster: cluster_node_cores(...)
    TrainerGroup(..., num_cpus_per_rank=plan.trainer_cpus, runtime_env={"env_vars": plan.trainer_env})
    RolloutPool(plan.rollout, ..., runtime_env={"env_vars": plan.rollout_env})

'colocated' (sync runs on CPU): generation and training take turns, so each phase gets every core of the host. The
trainer ranks split the cores among themselves (they run at once), and so do the rollout workers; Ray's CPU
reservations are fractions that add up to the host, so every actor fits on it. One engine binds one thread per
physical core (vLLM's ``auto``), several run unpinned threads that split the cores. The pool's receivers offer the
shared-memory data plane, so weights reach the engines without a socket, and keep no delta base (raw tensors travel
over shared memory; a base would hold one more copy of the model in every engine).

'separate': each actor runs on the CPUs Ray reserves for it: a trainer rank on one, an engine on
``rollout.num_cpus_per_worker`` (and its own ``cpu_threads_bind``); each role's actors spread over the cluster's nodes
as ``run.placement_groups`` says (``driver.reservation`` turns the plan into Ray placement groups). A colocated run
keeps every actor in one STRICT_PACK group: on one host whatever the cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rollout.config import RolloutConfig
from rollout.engine.platform import engine_process_env
from weight_sync.config import WeightSyncConfig

__all__ = ["Placement", "cluster_node_cores", "host_cores", "num_rollout_workers", "plan_placement", "threads_env"]


@dataclass(frozen=True)
class Placement:
    """What each role asks of Ray and the environment its processes start with."""

    num_cores: int
    """CPU cores the run's actors share (colocated) or reserve in all (separate): the denominator of
    ``perf/cores_busy``."""
    trainer_cpus: float
    """Ray CPUs each trainer rank reserves."""
    trainer_env: dict[str, str]
    """Environment of every trainer rank (``OMP_NUM_THREADS``: its torch intra-op threads)."""
    rollout: RolloutConfig
    """The pool's config with the worker count, the reservation and the engine's threads of this placement."""
    rollout_env: dict[str, str]
    """Environment of every rollout worker (``OMP_NUM_THREADS``: the engine's threads when unpinned; what the engine's
    process needs from the start, ``rollout.engine.platform.engine_process_env``)."""
    receiver_sync: WeightSyncConfig
    """The weight-sync config of the pool's receivers: colocated ones also offer the shared-memory data plane, which
    a trainer rank on the same host then pushes through (``data_plane = "auto"``)."""
    trainer_strategy: str
    """Ray placement-group strategy of the trainer ranks' bundles (``driver.reservation``)."""
    rollout_strategy: str
    """Ray placement-group strategy of the rollout workers' bundles."""
    shared_group: bool
    """Both roles' bundles in one group (colocated: one STRICT_PACK group, so one host)."""

    @property
    def num_rollout_workers(self) -> int:
        """Rollout workers (engines): the pool config's ``num_workers``, resolved by :func:`num_rollout_workers`."""
        workers = self.rollout.num_workers
        assert isinstance(workers, int), "plan_placement resolves 'auto'"
        return workers


def threads_env(num_threads: int) -> dict[str, str]:
    """Environment that gives a process ``num_threads`` threads in every pool torch sizes from the environment.

    ``MKL_NUM_THREADS`` too: torch built with MKL sizes its OpenMP pool from MKL's count at import, so a value
    inherited from the user's shell overrode ``OMP_NUM_THREADS`` (two 1-thread engines ran 2 threads each on 2 cores
    and generated ~8x slower)."""
    return {"OMP_NUM_THREADS": str(num_threads), "MKL_NUM_THREADS": str(num_threads)}


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    return len(os.sched_getaffinity(0))


def cluster_node_cores(nodes: list[dict[str, Any]], driver_node: str) -> int:
    """The cores of the largest live node of a joined Ray cluster (``ray.nodes()``), where a colocated run's one group
    of actors goes: its Ray CPUs (what the operator gave the node; a KubeRay pod's, though the driver's affinity may
    show the whole VM), capped on the driver's own node at this host's cores (threads beyond them only take turns).
    0 when no live node has CPUs."""
    best = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        cpus = int(node.get("Resources", {}).get("CPU", 0))
        best = max(best, min(cpus, host_cores()) if node.get("NodeID") == driver_node else cpus)
    return best


def num_rollout_workers(recipe: Any, num_cores: int) -> int:
    """``rollout.num_workers`` of a resolved recipe on a host of ``num_cores`` cores: its number, or for 'auto' two
    engines in a colocated run on a host of two cores or more and one otherwise.

    Why two: about half of a short batch is the engine's own Python (vLLM's scheduler, input preparation, sampling,
    output processing), which runs on one thread, so with one engine the other cores idle through it; a second engine
    runs its half of the batch's Python at the same time. The cost is a second process, KV cache and vLLM import.
    Measured on 2-core hosts (README, "end to end vs TRL"); more engines on bigger hosts are not measured, so 'auto'
    stays at two. A separate run reserves each engine's CPUs, so more engines are the cluster's call: one."""
    workers = recipe.rollout.num_workers
    if workers != "auto":
        return int(workers)
    return 2 if recipe.run.placement == "colocated" and num_cores >= 2 else 1


def plan_placement(recipe: Any, num_cores: int) -> Placement:
    """The placement ``recipe.run.placement`` asks for on a host of ``num_cores`` cores (a resolved recipe:
    'colocated' or 'separate')."""
    ranks, workers = recipe.trainer.num_ranks, num_rollout_workers(recipe, num_cores)
    rollout = recipe.rollout.model_copy(update={"num_workers": workers})
    if recipe.run.placement == "separate":
        return Placement(
            num_cores=max(1, ranks + int(round(workers * rollout.num_cpus_per_worker))),
            trainer_cpus=1.0, trainer_env=threads_env(1), rollout=rollout,
            rollout_env=engine_process_env(rollout.engine),
            receiver_sync=recipe.weight_sync, trainer_strategy=recipe.run.placement_groups.trainer,
            rollout_strategy=recipe.run.placement_groups.rollout, shared_group=False,
        )  # fmt: skip
    if recipe.run.placement != "colocated":
        raise ValueError(f"run.placement {recipe.run.placement!r} is not resolved: validate the recipe first")
    share = num_cores / (ranks + workers)  # reservations only; the threads below are what each phase runs
    engine_threads = max(1, num_cores // workers)
    engine = rollout.engine
    if workers > 1 and "cpu_threads_bind" not in engine.model_fields_set:
        engine = engine.model_copy(update={"cpu_threads_bind": "nobind"})  # 'auto' would pin every engine alike
    return Placement(
        num_cores=num_cores,
        trainer_cpus=share,
        trainer_env=threads_env(max(1, num_cores // ranks)),
        rollout=rollout.model_copy(update={"num_cpus_per_worker": share, "engine": engine}),
        rollout_env={**engine_process_env(engine), **threads_env(engine_threads)},
        # Same-host pushes carry raw tensors over shared memory: a delta base would be one more model copy per engine.
        receiver_sync=recipe.weight_sync.model_copy(update={"offer_shm": True, "delta": False}),
        trainer_strategy="STRICT_PACK", rollout_strategy="STRICT_PACK", shared_group=True,
    )
