"""``TrainerGroup``: N ``TrainerWorker`` Ray actors forming one torch.distributed group, driven as one trainer.

    group = TrainerGroup(trainer_cfg, model_cfg, algorithm_cfg, init_path="ckpt/hf", weight_sync=ws_cfg)
    metrics = group.train_step(batch)      # the same RolloutBatch to every rank; one metrics dict back
    group.push_weights()                   # every rank streams its own shards; rank 0 commits
    group.save_checkpoint(data_cursor={"epoch": 0, "index": 128})
    group.shutdown()

Every method fans the call out to all ranks (they are collective) and gathers the results; metrics are identical on
all ranks, so rank 0's are returned. Needs an initialised Ray (``ray.init``) in the calling process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from common.resources import actor_options
from rollout.types import RolloutBatch, Sample
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig, PPOConfig
from trainer.worker import TrainerWorker

__all__ = ["TrainerGroup", "rank_resources"]


def rank_resources(cfg: TrainerConfig, num_cpus: float) -> dict[str, float]:
    """What one rank reserves: ``num_cpus`` CPUs, plus one GPU on 'cuda' or one 'TPU' resource on 'tpu'."""
    resources = {"CPU": float(num_cpus)}
    if cfg.device == "cuda":
        resources["GPU"] = 1.0
    elif cfg.device == "tpu":
        resources["TPU"] = 1.0
    return resources


class TrainerGroup:
    """Creates the rank actors, sets up their process group, and fans calls out to them."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model_cfg: ModelConfig,
        algorithm: GRPOConfig | PPOConfig,
        init_path: str | None = None,
        weight_sync: Any = None,
        session_id: str = "trainer",
        num_cpus_per_rank: float = 1,
        runtime_env: dict | None = None,
        placement: Sequence[dict[str, Any]] | None = None,
        resume: bool = False,
    ) -> None:
        """``weight_sync``: a ``WeightSyncConfig`` with the receiver endpoints (None: no pushes). Each rank asks Ray
        for :func:`rank_resources`; ``placement``: more Ray actor options per rank (its placement-group bundle, see
        ``driver.reservation``), None: wherever Ray finds room. ``resume``: the ranks restore the latest checkpoint
        under ``trainer.checkpoint.dir`` as they build their state (without reading ``init_path`` for what it holds
        in full); :attr:`restored` is then what :meth:`load_checkpoint` returns."""
        self.cfg = cfg
        options = actor_options(rank_resources(cfg, num_cpus_per_rank))
        if runtime_env is not None:
            options["runtime_env"] = runtime_env
        if placement is not None and len(placement) != cfg.num_ranks:
            raise ValueError(f"placement has {len(placement)} entries for {cfg.num_ranks} rank(s)")
        actor = ray.remote(TrainerWorker)
        self.workers: list[Any] = [
            actor.options(**options, **(placement[rank] if placement else {})).remote(
                rank, cfg, model_cfg, algorithm, init_path, weight_sync, session_id
            )
            for rank in range(cfg.num_ranks)
        ]
        node_ids = ray.get([w.node_id.remote() for w in self.workers])
        host, port = ray.get(self.workers[0].master_endpoint.remote(len(set(node_ids)) == 1))
        self.restored: dict[str, Any] | None = ray.get([w.setup.remote(host, port, resume) for w in self.workers])[0]
        """Step, policy_version and data_cursor of the checkpoint restored at start (``resume``), else None."""
        self._endpoints: list[str] | None = None  # what the ranks were last told to push to

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL update on ``batch``; returns the step's metrics (see ``trainer.step.rl_step``), rank 0's except
        ``process_cpu_s``, the CPU seconds of all ranks."""
        per_rank = self._all("train_step", ray.put(batch))
        return {**per_rank[0], "process_cpu_s": sum(m["process_cpu_s"] for m in per_rank)}

    def sft_step(self, samples: Sequence[Sample], lr: float | None = None) -> dict[str, float]:
        """One supervised warm-start step on the completions of ``samples``."""
        return self._all("sft_step", ray.put(list(samples)), lr)[0]

    def begin_warm_start(self, all_parameters: bool) -> None:
        """Before the warm start: with LoRA and ``all_parameters`` the base weights train in it (not the adapters)."""
        self._all("begin_warm_start", all_parameters)

    def finish_warm_start(self) -> None:
        """The reference becomes the warm-started policy; RL starts with fresh optimizer and schedule state."""
        self._all("finish_warm_start")

    def set_weight_endpoints(self, endpoints: Sequence[str]) -> None:
        """Push to exactly these receivers from now on (e.g. after the rollout pool replaced a worker); the ranks are
        only called when the list changed."""
        if list(endpoints) != self._endpoints:
            self._all("set_weight_endpoints", list(endpoints))
            self._endpoints = list(endpoints)

    def save_checkpoint(self, data_cursor: dict | None = None) -> str:
        """Full-state checkpoint under ``trainer.checkpoint.dir``; returns its path."""
        return self._all("save_checkpoint", data_cursor)[0]

    def load_checkpoint(self, path: str | None = None) -> dict[str, Any]:
        """Restore every rank (default: the latest checkpoint); returns step, policy_version and data_cursor."""
        return self._all("load_checkpoint", path)[0]

    def export_hf(
        self, path: str, source_dir: str | None, dtype: str | None = None, adapter: bool = True,
        use_chat_template: bool | None = None,
    ) -> list[str]:
        """Write the policy as a complete HF model directory at ``path`` (tokenizer and generation config from
        ``source_dir``, a LoRA policy's adapter base; ``adapter`` False: no adapter directory); returns the file
        names."""
        return self._all("export_hf", path, source_dir, dtype, adapter, use_chat_template)[0]

    def push_weights(
        self, policy_version: int | None = None, dtype: str | None = None, endpoints: Sequence[str] | None = None,
        with_base: bool = False,
    ) -> list[dict[str, Any]]:
        """Every rank pushes its own shards to every receiver (or, in full, to just ``endpoints``; a LoRA policy's
        base too ``with_base``), then rank 0 commits; returns each rank's outcome (``TrainerWorker.push_weights``)."""
        return self._all("push_weights", policy_version, dtype, list(endpoints) if endpoints is not None else None,
                         with_base)  # fmt: skip

    def policy_version(self) -> int:
        return self._all("policy_version")[0]

    def shutdown(self) -> None:
        """Leave the process group and stop the rank actors."""
        try:
            self._all("shutdown")
        finally:
            for w in self.workers:
                ray.kill(w)
            self.workers = []
