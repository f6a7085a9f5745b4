"""The per-rank training state: the algorithm, sharded policy, frozen reference, critic, optimizers and LR schedules.

:func:`build_train_state` builds every model the algorithm needs (``Algorithm.needs_reference`` / ``needs_critic``) from
one :class:`ModelConfig` with the same seed on every rank (so the unsharded init is identical everywhere), loads the
initial HF weights when given, then shards each model the same way (``trainer.parallelize``). The update itself lives
in ``trainer.step``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from trainer.checkpoint import Checkpointable
from trainer.config import TrainerConfig
from trainer.critic import Critic
from trainer.models.config import ModelConfig
from trainer.models.transformer import Transformer, build_model
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallelize import ModelT, data_parallel_mesh, parallelize_model
from trainer.rl.algorithms import Algorithm, build_algorithm
from trainer.rl.config import AlgorithmConfig

__all__ = ["TrainState", "build_train_state"]


@dataclass
class TrainState:
    """Everything one trainer rank updates. ``step`` counts train steps (rollout batches), not optimizer steps."""

    cfg: TrainerConfig
    model_cfg: ModelConfig
    algorithm: Algorithm
    """The RL algorithm (``algorithm.config`` is its recipe section)."""
    device: torch.device
    mesh: DeviceMesh
    policy: Transformer
    """The (sharded) policy: still a :class:`Transformer` after ``fully_shard``, which only swaps its class."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: Transformer | None = None
    """The frozen KL reference model; None without KL, and with LoRA, whose reference is the policy with its adapters
    off (``trainer.step`` runs it that way)."""
    critic: Critic | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    step: int = 0
    policy_version: int = 0
    data_cursor: dict = field(default_factory=dict)

    @property
    def dp_rank(self) -> int:
        return self._dp_mesh().get_local_rank()

    @property
    def dp_size(self) -> int:
        return self._dp_mesh().size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel process group (ranks holding different samples)."""
        return self._dp_mesh().get_group()

    def _dp_mesh(self) -> DeviceMesh:
        return data_parallel_mesh(self.mesh)

    def checkpointables(self) -> dict[str, Checkpointable]:
        """The parts a checkpoint holds: the policy and critic with their optimizers, and the frozen KL reference (it
        may be the warm-start policy, which no file outside the checkpoint is guaranteed to hold on resume)."""
        # With LoRA the frozen base is the run's initial checkpoint, rebuilt at start: only trained tensors are saved.
        lora = self.model_cfg.lora is not None
        parts = {"policy": Checkpointable(self.policy, self.optimizer, self.scheduler, trainable_only=lora)}
        if self.critic is not None:
            assert self.critic_optimizer is not None
            parts["critic"] = Checkpointable(
                self.critic, self.critic_optimizer, self.critic_scheduler, trainable_only=lora
            )
        if self.reference is not None:
            parts["reference"] = Checkpointable(self.reference)
        return parts


def _shard(model: ModelT, mesh: DeviceMesh, cfg: TrainerConfig) -> ModelT:
    model = parallelize_model(model, mesh, cfg)
    if isinstance(model, FSDPModule) and hasattr(model, "token_logprobs"):
        # token_logprobs uses root-unit parameters (the output head) outside forward: let FSDP unshard for it too.
        register_fsdp_forward_method(model, "token_logprobs")
    return model


def build_train_state(
    cfg: TrainerConfig,
    model_cfg: ModelConfig,
    algorithm: AlgorithmConfig,
    device: torch.device,
    mesh: DeviceMesh,
    init_path: str | None = None,
) -> TrainState:
    """Build, load and shard the policy (and the reference / critic when the algorithm needs them) on this rank.

    ``init_path``: a local HF checkpoint directory with the initial weights; None keeps the seeded random init (tests).
    Collective when FSDP is on: every rank calls it with the same arguments.
    """
    algo = build_algorithm(algorithm)
    torch.manual_seed(cfg.seed)
    policy = build_model(model_cfg, device=torch.device("cpu"), dtype=torch.float32, runs_on=device)
    if cfg.compile:
        policy.compile_elementwise()  # before the copies below, so the reference and critic run compiled too
    if init_path is not None:
        from trainer.models.hf_io import load_hf_checkpoint

        load_hf_checkpoint(policy, init_path)
    reference = None
    if algo.needs_reference and model_cfg.lora is None:  # with LoRA the reference is the base: adapters off
        reference = copy.deepcopy(policy).requires_grad_(False).eval()
    critic = None
    if algo.needs_critic:
        critic = Critic(copy.deepcopy(policy), model_cfg.dim)

    policy = _shard(policy.to(device), mesh, cfg)
    optimizer = build_optimizer(policy, cfg.optimizer)
    state = TrainState(
        cfg=cfg, model_cfg=model_cfg, algorithm=algo, device=device, mesh=mesh, policy=policy,
        optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg.schedule),
    )  # fmt: skip
    if reference is not None:
        state.reference = _shard(reference.to(device), mesh, cfg)
    if critic is not None:
        state.critic = _shard(critic.to(device), mesh, cfg)
        state.critic_optimizer = build_optimizer(state.critic, cfg.optimizer, lr=cfg.critic_lr)
        state.critic_scheduler = build_scheduler(state.critic_optimizer, cfg.schedule)
    return state
