"""The per-rank training state: the algorithm, sharded policy, frozen reference, critic, optimizers and LR schedules.

:func:`build_train_state` builds every model the algorithm needs (``Algorithm.needs_reference`` / ``needs_critic``) from
one :class:`ModelConfig` on the meta device, shards each the same way (``trainer.parallelize``) and writes the initial
weights into this rank's pieces only (``trainer.initial_weights``: the HF checkpoint's, or the seeded random
initialisation, equal on every rank). The update itself lives in ``trainer.step``.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from trainer.checkpoint import Checkpointable
from trainer.config import TrainerConfig
from trainer.critic import Critic
from trainer.host_memory import release_before_backward_peak
from trainer.initial_weights import InitialWeights
from trainer.models.config import ModelConfig
from trainer.models.transformer import Transformer, build_model
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallelize import ModelT, data_parallel_mesh, parallelize_model
from trainer.rl.algorithms import Algorithm, build_algorithm
from trainer.rl.config import AlgorithmConfig
from weight_sync.sink import read_policy_version

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
    steps_without_update: int = 0
    """RL steps in a row whose every optimizer update was skipped for a gradient norm that was not finite."""

    def reset_optimizers(self) -> None:
        """Fresh AdamW state and learning-rate schedules over what trains now, for the policy and the critic (a new
        phase of training starts: RL after the warm start)."""
        self.optimizer, self.scheduler = _optimizer_and_schedule(self.policy, self.cfg)
        if self.critic is not None:
            self.critic_optimizer, self.critic_scheduler = _optimizer_and_schedule(
                self.critic, self.cfg, self.cfg.critic_lr
            )

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


def _materialize(
    model: ModelT, mesh: DeviceMesh, cfg: TrainerConfig, device: torch.device, initial: InitialWeights | None
) -> ModelT:
    """Shard the meta-built ``model``, allocate this rank's pieces on ``device`` and write their initial values (left
    unwritten when ``initial`` is None: a checkpoint load writes every one)."""
    model = parallelize_model(model, mesh, cfg)
    if isinstance(model, FSDPModule) and hasattr(model, "token_logprobs"):
        # token_logprobs uses root-unit parameters (the output head) outside forward: let FSDP unshard for it too.
        register_fsdp_forward_method(model, "token_logprobs")
    model.to_empty(device=device)
    if initial is None:
        return model
    if isinstance(model, Critic):
        model.reset_value_head()
        initial.fill(model.body)
    else:
        initial.fill(model)
    return model


def _optimizer_and_schedule(
    model: torch.nn.Module, cfg: TrainerConfig, lr: float | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = build_optimizer(model, cfg.optimizer, lr=lr)
    return optimizer, build_scheduler(optimizer, cfg.schedule)


def build_train_state(
    cfg: TrainerConfig,
    model_cfg: ModelConfig,
    algorithm: AlgorithmConfig,
    device: torch.device,
    mesh: DeviceMesh,
    init_path: str | None = None,
    restored: Collection[str] = (),
) -> TrainState:
    """Build the policy (and the reference / critic when the algorithm needs them) on the meta device, shard each the
    same way and fill this rank's pieces with the initial weights (:class:`InitialWeights`): no rank holds a whole
    model.

    ``init_path``: a local HF checkpoint directory with the initial weights; None keeps the seeded random init (tests).
    The state starts at the policy version ``init_path`` records (an exported model's, else 0), so that a run from an
    export numbers its versions on from it and receivers started on a copy of that model take them.
    ``restored``: names of the parts (as :meth:`TrainState.checkpointables` names them) whose every weight a
    checkpoint holds that the caller loads next: their pieces are allocated but not filled (reading ``init_path``
    for them would be wasted); until that load they hold garbage. Collective when FSDP is on: every rank calls it
    with the same arguments.
    """
    algo = build_algorithm(algorithm)
    torch.manual_seed(cfg.seed)
    initial = InitialWeights(model_cfg, init_path)  # checks init_path against the model before anything is allocated
    policy = build_model(model_cfg, device="meta", dtype=torch.float32, runs_on=device)
    if cfg.compile:
        policy.compile_elementwise()  # before the copies below, so the reference and critic run compiled too
    reference = None
    if algo.needs_reference and model_cfg.lora is None:  # with LoRA the reference is the base: adapters off
        reference = copy.deepcopy(policy).requires_grad_(False).eval()
    critic = Critic(copy.deepcopy(policy), model_cfg.dim) if algo.needs_critic else None

    def initial_for(part: str) -> InitialWeights | None:
        return None if part in restored else initial

    policy = _materialize(policy, mesh, cfg, device, initial_for("policy"))
    optimizer, scheduler = _optimizer_and_schedule(policy, cfg)
    state = TrainState(
        cfg=cfg, model_cfg=model_cfg, algorithm=algo, device=device, mesh=mesh, policy=policy,
        optimizer=optimizer, scheduler=scheduler,
        policy_version=0 if init_path is None else read_policy_version(init_path),
    )  # fmt: skip
    if reference is not None:
        state.reference = _materialize(reference, mesh, cfg, device, initial_for("reference"))
    if critic is not None:
        state.critic = _materialize(critic, mesh, cfg, device, initial_for("critic"))
        state.critic_optimizer, state.critic_scheduler = _optimizer_and_schedule(state.critic, cfg, cfg.critic_lr)
    if cfg.releases_freed_memory:
        for trained in (state.policy, state.critic):
            if trained is not None:
                release_before_backward_peak(trained.layers)
    return state
