"""``TrainerWorker``: one trainer rank as a Ray actor; N of them form one torch.distributed group.

Lifecycle (driven by ``trainer.group.TrainerGroup``; every call below is collective: all ranks get it together)::

    workers = [TrainerWorker.remote(rank, ...) for rank in range(N)]
    addr, port = ray.get(workers[0].master_endpoint.remote(same_node))   # rank 0 picks a free port
    ray.get([w.setup.remote(addr, port) for w in workers])               # process group, mesh, sharded models
    metrics = ray.get([w.train_step.remote(batch) for w in workers])[0]  # same batch to every rank
    ray.get([w.push_weights.remote() for w in workers])                  # each rank streams its own shards

The class is plain Python (``ray.remote`` is applied in ``trainer.group``), so a test can also drive it in-process.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from common.cpu import CpuClock
from common.net import free_port
from rollout.types import RolloutBatch, Sample
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig, PPOConfig

if TYPE_CHECKING:
    from trainer.checkpoint import CheckpointManager
    from trainer.state import TrainState
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender

__all__ = ["TrainerWorker"]

_PG_TIMEOUT = datetime.timedelta(minutes=30)


class TrainerWorker:
    """One rank: owns its shard of the policy (and reference/critic), its optimizer state and its weight sender."""

    def __init__(
        self,
        rank: int,
        cfg: TrainerConfig,
        model_cfg: ModelConfig,
        algorithm: GRPOConfig | PPOConfig,
        init_path: str | None = None,
        weight_sync: WeightSyncConfig | None = None,
        session_id: str = "trainer",
    ) -> None:
        """``weight_sync``: a ``weight_sync.config.WeightSyncConfig`` (receiver endpoints, TLS, token) or None when
        this run pushes no weights. ``init_path``: local HF checkpoint with the initial weights (None: seeded init)."""
        if not 0 <= rank < cfg.num_ranks:
            raise ValueError(f"rank {rank} is outside [0, num_ranks={cfg.num_ranks})")
        self.rank, self.cfg, self.model_cfg, self.algorithm = rank, cfg, model_cfg, algorithm
        self.init_path, self.weight_sync, self.session_id = init_path, weight_sync, session_id
        self.state: TrainState | None = None
        self._sender: WeightSender | None = None
        self._checkpoints: CheckpointManager | None = None
        self._cpu = CpuClock()
        # LoRA runs: pushes carry the adapters alone, over a base each receiver must hold (checked at Begin).
        self._base_version = 0
        """A LoRA policy's base is that of this policy version: ``init_path``'s recorded version (a resumed run's
        warm-started base included), or the warm start's when it trains the base. A receiver holding an older version
        lacks it (a server restarted on its directory): an adapter-only push refuses it (``behind``)."""
        self._base_unpushed = False
        """The base has changed since the last regular push: the next one carries it."""
        self._base_trains = False
        """A LoRA policy's base weights are what the warm start trains (``begin_warm_start(all_parameters=True)``)."""

    # -- setup -----------------------------------------------------------------------------------------------------
    def node_id(self) -> str:
        """The Ray node this rank runs on (the group picks loopback rendezvous when all ranks share a node)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def master_endpoint(self, same_node: bool) -> tuple[str, int]:
        """Rank 0 only: (address, free port) for the process-group rendezvous."""
        assert self.rank == 0, "only rank 0 hosts the rendezvous"
        if same_node:
            host = "127.0.0.1"
        else:
            import ray

            host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(self, master_addr: str, master_port: int, resume: bool = False) -> dict[str, Any] | None:
        """Join the process group, pick the device, build and shard the models (collective).

        ``resume``: restore the latest complete checkpoint under ``checkpoint.dir`` as part of the setup and return
        what :meth:`load_checkpoint` returns (None otherwise). The parts the checkpoint holds in full are not read
        from ``init_path`` first (a LoRA checkpoint holds the adapters only: the base still is); a part it lacks (the
        KL reference of a checkpoint written before references were saved) keeps its ``init_path`` weights."""
        import torch
        import torch.distributed as dist

        from trainer.checkpoint import CheckpointManager, saved_parts
        from trainer.devices import mesh_device_type
        from trainer.parallelize import build_mesh
        from trainer.state import build_train_state

        if self.cfg.checkpoint.dir is not None:
            self._checkpoints = CheckpointManager(self.cfg.checkpoint.dir, self.cfg.checkpoint.num_keep)
        restore_from, restored = None, set()
        if resume:
            restore_from = self._checkpoints.latest() if self._checkpoints is not None else None
            if restore_from is None:
                raise FileNotFoundError(f"resume: no complete checkpoint under trainer.checkpoint.dir = "
                                        f"{self.cfg.checkpoint.dir}")  # fmt: skip
            if self.model_cfg.lora is None:
                restored = saved_parts(restore_from)

        device = self._device(torch)
        backend: str | None = self.cfg.backend
        if self.cfg.device == "tpu":
            backend = dist.Backend.default_device_backend_map.get("tpu")
            if backend is None:
                raise ValueError("device 'tpu' needs the torch-tpu package (no 'tpu' distributed backend registered)")
        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.cfg.num_ranks, timeout=_PG_TIMEOUT,
        )  # fmt: skip
        mesh = build_mesh(self.cfg, mesh_device_type(device))
        self.state = build_train_state(self.cfg, self.model_cfg, self.algorithm, device, mesh, self.init_path,
                                       restored=restored)  # fmt: skip
        if self.model_cfg.lora is not None and self.init_path is not None:
            from weight_sync.sink import read_policy_version

            self._base_version = read_policy_version(self.init_path)
        return None if restore_from is None else self.load_checkpoint(str(restore_from))

    def _device(self, torch):  # noqa: ANN001, ANN202 (torch is imported lazily by the caller)
        if self.cfg.device == "cpu":
            return torch.device("cpu")
        if self.cfg.device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    "device 'cuda' requested but no GPU is visible to this rank (give the actor num_gpus=1)"
                )
            # Ray sets CUDA_VISIBLE_DEVICES per actor: the rank's GPU is always index 0 here.
            torch.cuda.set_device(0)
            return torch.device("cuda", 0)
        if self.cfg.device == "xla":
            try:
                import torch_xla
            except ImportError:
                raise ValueError(
                    "device 'xla' needs torch_xla on the trainer hosts (its own environment: `make xla-env`, torch 2.9)"
                ) from None
            from trainer.devices import enable_spmd

            enable_spmd(self.cfg.parallelism.spmd_data_parallel)
            return torch_xla.device()
        try:
            import torch_tpu  # noqa: F401  (registers the 'tpu' device)
        except ImportError:
            raise ValueError("device 'tpu' needs the torch-tpu package installed on the trainer hosts") from None
        return torch.device("tpu")

    def _require_state(self) -> TrainState:
        if self.state is None:
            raise RuntimeError("TrainerWorker.setup() must run before training calls")
        return self.state

    # -- training --------------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL update on ``batch`` (the same on every rank); returns the step's metrics. Nothing else: the driver
        decides when to checkpoint (:meth:`save_checkpoint`). ``process_cpu_s`` is this rank's CPU seconds since its
        previous ``train_step`` returned (its last push included); ``num_threads`` its torch intra-op threads."""
        import torch

        from trainer.step import rl_step

        metrics = rl_step(self._require_state(), batch)
        metrics["process_cpu_s"] = self._cpu.lap()
        metrics["num_threads"] = float(torch.get_num_threads())
        return metrics

    def sft_step(self, samples: Sequence[Sample], lr: float | None = None) -> dict[str, float]:
        """One supervised warm-start step on the completions of ``samples``."""
        from trainer.step import sft_step

        metrics = sft_step(self._require_state(), samples, lr)
        if self._base_trains:
            self._base_version, self._base_unpushed = self._require_state().policy_version, True
        return metrics

    def begin_warm_start(self, all_parameters: bool) -> None:
        """Before the supervised warm start: with LoRA and ``all_parameters``, the base weights train and the adapters
        stay fresh and switched off (``B = 0``: the same model, without their compute); the optimizer is rebuilt over
        what now trains. Otherwise nothing changes."""
        from trainer.models.lora import set_adapters_enabled, train_adapters
        from trainer.optim import build_optimizer

        state = self._require_state()
        if self.model_cfg.lora is None or not all_parameters:
            return
        train_adapters(state.policy, base=True)
        set_adapters_enabled(state.policy, False)
        state.optimizer = build_optimizer(state.policy, self.cfg.optimizer)
        self._base_trains = True

    def finish_warm_start(self) -> None:
        """End the supervised warm start: the reference (when KL needs one) and PPO's critic body become the current
        policy (a critic starts from the SFT model, and a LoRA critic's frozen base is then the policy's, the one a
        resume builds it on: ``Recipe.lora_base``), and the RL phase starts with fresh optimizer and schedule state
        (SFT's Adam moments would skew the first RL steps). With LoRA the adapters are what trains again (the base
        freezes where it is)."""
        import torch

        from trainer.models.lora import set_adapters_enabled, train_adapters

        state = self._require_state()
        if self.model_cfg.lora is not None:
            train_adapters(state.policy)
            set_adapters_enabled(state.policy, True)
            self._base_trains = False
        copies = [state.reference] if state.reference is not None else []
        if state.critic is not None:
            copies.append(state.critic.body)  # a deep copy of the policy, sharded the same way, less an untied head
        policy = dict(state.policy.named_parameters())
        with torch.no_grad():
            for model in copies:
                for name, copy in model.named_parameters():
                    copy.copy_(policy[name])
        state.reset_optimizers()

    # -- state -----------------------------------------------------------------------------------------------------
    def save_checkpoint(self, data_cursor: dict | None = None) -> str:
        """Full-state checkpoint under ``checkpoint.dir`` (``step_<n>``), the KL reference included; returns its
        path."""
        from trainer.checkpoint import TrainProgress

        state = self._require_state()
        if data_cursor is not None:
            state.data_cursor = dict(data_cursor)
        if self._checkpoints is None:
            raise ValueError("no checkpoint directory: set trainer.checkpoint.dir")
        progress = TrainProgress(state.step, state.policy_version, state.data_cursor)
        return str(self._checkpoints.save(state.checkpointables(), progress))

    def load_checkpoint(self, path: str | None = None) -> dict[str, Any]:
        """Restore from the checkpoint directory ``path`` (default: the latest complete one under ``checkpoint.dir``);
        returns step, policy_version and data_cursor."""
        from trainer.checkpoint import CheckpointManager

        state = self._require_state()
        if self._checkpoints is None and path is None:
            raise ValueError("no checkpoint to load: set trainer.checkpoint.dir or pass a checkpoint path")
        manager = self._checkpoints or CheckpointManager(os.path.dirname(os.path.abspath(str(path))))
        # Checkpoints written before the reference was saved: keep the one rebuilt from init_path (with a warning).
        progress = manager.load(state.checkpointables(), path, missing_ok=("reference",))
        state.step, state.policy_version = progress.step, progress.policy_version
        state.data_cursor = progress.data_cursor
        return {"step": progress.step, "policy_version": progress.policy_version, "data_cursor": progress.data_cursor}

    def export_hf(
        self, path: str, source_dir: str | None, dtype: str | None = None, adapter: bool = True,
        use_chat_template: bool | None = None,
    ) -> list[str]:
        """Write the policy as a complete HF model directory (weights, config, tokenizer files and generation config
        of ``source_dir``, the model directory the run started from (a LoRA policy's adapter base), and the policy
        version; ``adapter`` False: no adapter directory; ``use_chat_template``: the run's, for the token that ends a
        turn); rank 0 writes (``trainer.export.export_policy``)."""
        from trainer.export import export_policy

        state = self._require_state()
        return export_policy(state.policy, path, source_dir, dtype, policy_version=state.policy_version,
                             adapter=adapter, use_chat_template=use_chat_template)  # fmt: skip

    def policy_version(self) -> int:
        return self._require_state().policy_version

    # -- weight push -----------------------------------------------------------------------------------------------
    def set_weight_endpoints(self, endpoints: Sequence[str]) -> None:
        """Push to exactly ``endpoints`` from now on (receivers that joined get a full push on the next version)."""
        if self._sender is None:
            self._sender = self._new_sender(endpoints, self._sync_config())
            return
        for address in [a for a in self._sender.endpoints if a not in endpoints]:
            self._sender.remove_endpoint(address)
        for address in endpoints:
            self._sender.add_endpoint(address)

    def _get_sender(self) -> WeightSender:
        if self._sender is None:
            self._sender = self._new_sender([], self._sync_config())  # the config's endpoints, if any
        return self._sender

    def _sync_config(self) -> WeightSyncConfig:
        if self.weight_sync is None:
            raise ValueError("no weight_sync config given to the trainer: nothing to push to")
        return self.weight_sync

    def _new_sender(self, endpoints: Sequence[str], config: WeightSyncConfig) -> WeightSender:
        """The one way this rank builds a sender: its rank, the group's size, the run's session id, its LoRA alpha."""
        from weight_sync.sender import WeightSender

        lora = self.model_cfg.lora
        return WeightSender(list(endpoints), config, rank=self.rank, num_ranks=self.cfg.num_ranks,
                            session_id=self.session_id, lora_alpha=0.0 if lora is None else lora.alpha)  # fmt: skip

    def push_weights(
        self, policy_version: int | None = None, dtype: str | None = None, endpoints: Sequence[str] | None = None,
        with_base: bool = False,
    ) -> dict[str, Any]:
        """Stream this rank's own shards, under HF names, to every receiver; rank 0 commits after all ranks pushed.
        With LoRA only the adapters are pushed, under PEFT names, and the base too when it trained since the last
        regular push, or with ``with_base``. A receiver holding the base model at a version older than the base's
        (``_base_version``) takes no adapters alone: the outcome's ``behind`` names it, to be pushed ``with_base``
        (``driver.publisher``).

        ``policy_version`` defaults to the state's; ``dtype`` casts the pieces (e.g. 'bfloat16'); None sends each
        tensor in the dtype the receivers declare for it (an engine computing in bfloat16 gets bfloat16).
        ``endpoints`` pushes (in full) to just those receivers instead, e.g. a replacement rollout worker catching up
        with the version the others already serve; the regular receivers and their delta bases are left alone.
        Returns this rank's outcome: per-receiver push errors, and on rank 0 the per-receiver commit errors.
        """
        import torch
        import torch.distributed as dist

        from trainer.devices import host_copies
        from trainer.models.hf_io import hf_shards
        from trainer.models.lora import is_adapter
        from trainer.parallelize import local_shards
        from weight_sync.chunking import as_dtype
        from weight_sync.sender import Shard

        state = self._require_state()
        if endpoints is None:
            sender = self._get_sender()
        else:  # a full push that leaves the regular receivers' delta bases alone
            one_off = self._sync_config().model_copy(update={"endpoints": [], "delta": False})
            sender = self._new_sender(endpoints, one_off)
        version = state.policy_version if policy_version is None else policy_version
        declared = {} if dtype is not None else sender.declared_dtypes()

        def cast(hf_name: str, piece: torch.Tensor) -> torch.Tensor:
            return as_dtype(piece, dtype or declared.get(hf_name))

        # With LoRA the receivers hold the frozen base: only the adapters change, unless the base trained since.
        adapters_only = self.model_cfg.lora is not None and not (
            with_base or (endpoints is None and self._base_unpushed)
        )
        places = [
            (hf_name, cast(hf_name, piece), hf_shape, hf_offsets)
            for name, local, shape, offsets in local_shards(state.policy, state.mesh)
            if not adapters_only or is_adapter(name)
            for hf_name, piece, hf_shape, hf_offsets in hf_shards(self.model_cfg, name, local, shape, offsets)
        ]
        pieces = host_copies([piece for _, piece, _, _ in places])
        shards = [Shard(n, piece, s, o) for (n, _, s, o), piece in zip(places, pieces, strict=True)]
        try:
            report = sender.push(version, shards, min_version=self._base_version if adapters_only else -1)
            dist.barrier()  # every rank's streams have been answered
            out: dict[str, Any] = {
                "policy_version": version, "push_errors": report.failed, "seconds": report.seconds,
                "payload_bytes": report.payload_bytes, "behind": report.behind,
            }  # fmt: skip
            if self.rank == 0:
                # A receiver that missed a shard from any rank fails its own coverage check and keeps its old version.
                out["commit_errors"] = {a: e for a, e in sender.commit(version).items() if e}
            dist.barrier()
            if endpoints is None:
                self._base_unpushed = False  # receivers that missed it are behind the base: pushed it with_base
        finally:
            if endpoints is not None:
                sender.close()
        return out

    def shutdown(self) -> None:
        """Close the weight sender and leave the process group."""
        import torch.distributed as dist

        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if dist.is_initialized():
            dist.destroy_process_group()
