"""Configuration of the policy trainer: devices, sharding, precision, optimizer, schedule, micro-batching, checkpoints.

No torch import here (recipes validate in well under a second). The model and the RL algorithm own their own configs
(``trainer.models.config`` and ``trainer.rl.config``); this one covers how the update is run, not what it computes.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Literal

import pydantic

from common.config import MAX_ACTORS, Config, DType, FieldError, Seed, changed_settings, setting_warning

if TYPE_CHECKING:
    from trainer.models.config import ModelConfig

__all__ = [
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "DType",
    "Device",
    "MixedPrecisionConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ScheduleConfig",
    "TrainerConfig",
]

Device = Literal["cpu", "cuda", "tpu", "xla"]
"""Where the trainer computes."""

# Which parameter/reduction dtypes each device runs well; the rest are rejected at recipe load, not deep in a step.
_SUPPORTED_DTYPES: dict[str, tuple[str, ...]] = {
    "cpu": ("float32", "bfloat16"),
    "cuda": ("float32", "bfloat16", "float16"),
    "tpu": ("float32", "bfloat16"),
    "xla": ("float32",),  # mixed precision casts through FSDP2, which does not run on XLA tensors
}
# On 'xla' the group only coordinates the (single) rank on the host; its tensors live on the XLA device.
_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu", "xla": "gloo"}


class ParallelismConfig(Config):
    """How the policy is sharded across the trainer ranks."""

    fsdp: bool = True
    """Shard parameters, gradients and optimizer state with FSDP2 (``fully_shard`` per block and the root). A
    single-rank trainer (``num_ranks = 1``) with float32 mixed precision has nothing to shard or cast and runs the plain
    module (FSDP there only copies parameters in and out); checkpoints load across both layouts."""
    reshard_after_forward: bool = True
    """Free the gathered parameters of a block after its forward (less memory, one more all-gather in backward)."""
    vocab_parallel: bool = False
    """Split the token embedding and output head by vocabulary rows (``trainer.vocab_parallel``; needs the ``chunked``
    output head). Without tensor parallelism: over the data-parallel ranks instead of letting FSDP gather them; each
    rank keeps only its rows, and the ranks exchange activations (``ranks x tokens x dim`` per micro-batch) instead of
    the ``vocab x dim`` matrix and its gradient. Pays for large vocabularies on few ranks; with one data-parallel rank
    it changes nothing. With tensor parallelism: over each TP group, whose ranks then compute the head on their own
    rows only instead of each computing all of it (Megatron's vocabulary-parallel embedding and loss); FSDP shards
    each rank's rows over the data-parallel ranks."""
    tensor_parallel_degree: int = pydantic.Field(default=1, ge=1)
    """Ranks per tensor-parallel group (DTensor Colwise/Rowwise); 1 turns tensor parallelism off."""
    expert_parallel_degree: int = pydantic.Field(default=1, ge=1)
    """Ranks that split each MoE layer's experts between them (``trainer.expert_parallel``: tokens reach their experts
    by all-to-all); ``num_ranks`` must be a multiple of it and the model's expert count too. 1 turns it off."""
    spmd_data_parallel: int = pydantic.Field(default=1, ge=1)
    """Device 'xla' only: the XLA devices the one rank drives through torch_xla's SPMD (GSPMD) partitioner, data
    parallel: each micro-batch's rows are split over them, parameters and optimizer state are replicated, and the
    compiler inserts the gradient reduction. A power of two equal to the runtime's device count (the host's chips on a
    TPU; ``CPU_NUM_DEVICES`` on PJRT's CPU device). 1 turns SPMD off."""


class ActivationCheckpointConfig(Config):
    """Activation checkpointing of the transformer blocks (policy and PPO critic): a checkpointed block keeps only its
    input from forward and recomputes everything else inside it during backward, so a micro-batch's activation memory
    falls from every block's intermediates to one block input per block plus one block's intermediates, for about one
    more forward of compute. Passes without gradients (old and reference log-probs) never recompute. Loss and
    gradients are unchanged: the recomputation runs the same ops on the same inputs (and the same dropout masks)."""

    mode: Literal["none", "full", "selective"] = "none"
    """'none' keeps every activation; 'full' checkpoints every block; 'selective' every ``every``-th block (the first,
    then each ``every`` blocks), trading memory against recompute."""
    every: int = pydantic.Field(default=2, ge=2)
    """With 'selective': checkpoint blocks ``0, every, 2 * every, ...`` (every block is 'full')."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> ActivationCheckpointConfig:
        if self.mode != "selective" and (every := changed_settings(self, ["every"])):
            setting_warning(logging.getLogger("rl_align"), "trainer.activation_checkpoint.%s: unused with mode = %r "
                            "(it picks the blocks of mode = 'selective')", every[0], self.mode)  # fmt: skip
        return self

    def checkpointed_blocks(self, num_blocks: int) -> list[int]:
        """Indices of the blocks (of ``num_blocks``) this setting checkpoints."""
        step = {"none": 0, "full": 1, "selective": self.every}[self.mode]
        return list(range(0, num_blocks, step)) if step else []


class MixedPrecisionConfig(Config):
    """FSDP2 mixed precision: parameters are stored in float32 and cast for compute."""

    param_dtype: DType = "float32"
    """Dtype of the gathered parameters used in forward/backward."""
    reduce_dtype: DType = "float32"
    """Dtype of gradient reduce-scatter across ranks (float32 keeps the sum exact enough for small batches)."""


class OptimizerConfig(Config):
    """AdamW (decoupled weight decay)."""

    lr: float = pydantic.Field(default=1e-6, gt=0)
    """Peak learning rate (reached at the end of warmup)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1, beta2."""
    weight_decay: float = pydantic.Field(default=0.0, ge=0)
    """Decoupled weight decay; applied to matrices only, never to norms or biases."""
    eps: float = pydantic.Field(default=1e-8, gt=0)
    """Adam epsilon."""

    @pydantic.field_validator("betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        return betas


class ScheduleConfig(Config):
    """Learning-rate schedule, stepped once per optimizer step."""

    kind: Literal["constant", "cosine"] = "constant"
    """'constant' after warmup, or 'cosine' decay from the peak to ``min_lr_ratio * lr`` at ``num_total_steps``."""
    num_warmup_steps: int = pydantic.Field(default=0, ge=0)
    """Optimizer steps of linear warmup from ``lr / (num_warmup_steps + 1)`` to ``lr``."""
    num_total_steps: int | None = pydantic.Field(default=None, ge=1)
    """Optimizer steps over which cosine decays (required for 'cosine'); the lr stays at the floor afterwards. In a
    recipe, unset means the run's optimizer steps (``run.num_steps`` x ``num_minibatches`` x ``num_epochs``), written
    into the resolved recipe."""
    min_lr_ratio: float = pydantic.Field(default=0.0, ge=0, le=1)
    """Floor of the cosine schedule as a fraction of the peak lr."""

    @pydantic.model_validator(mode="after")
    def _check_cosine(self) -> ScheduleConfig:
        if self.kind == "cosine":
            if self.num_total_steps is None:
                raise ValueError("schedule.kind = 'cosine' needs schedule.num_total_steps (the step where decay ends)")
            if self.num_total_steps <= self.num_warmup_steps:
                raise ValueError(
                    f"schedule.num_total_steps ({self.num_total_steps}) must exceed num_warmup_steps "
                    f"({self.num_warmup_steps}) for a cosine decay"
                )
        return self


class CheckpointConfig(Config):
    """Full-state checkpoints (torch.distributed.checkpoint): model, optimizer, scheduler, RNG, step, data cursor, and
    the frozen KL reference when the algorithm uses one (a resume needs no other file)."""

    dir: str | None = None
    """Directory holding ``step_<n>`` checkpoints. In a recipe, unset means ``<run.output_dir>/checkpoints``; a
    trainer built by hand without one cannot save (``every_num_steps`` then must stay 0)."""
    every_num_steps: int = pydantic.Field(default=0, ge=0)
    """Save after every k-th optimizer step; 0 saves only when asked explicitly."""
    num_keep: int = pydantic.Field(default=2, ge=1)
    """Keep the newest n checkpoints and delete older ones."""


class TrainerConfig(Config):
    """How the policy (and PPO critic) update runs on the trainer ranks."""

    device: Device = "cpu"
    """Where the trainer computes: 'cpu' (gloo), 'cuda' (nccl, one GPU per rank), 'tpu' (torch-tpu) or 'xla'
    (torch_xla's device, for hosts on that stack; one rank; its own environment: ``make xla-env``)."""
    num_ranks: int = pydantic.Field(default=1, ge=1, le=MAX_ACTORS)
    """Trainer ranks (Ray actors) forming one torch.distributed group."""
    parallelism: ParallelismConfig = ParallelismConfig()
    """Sharding of the model across ranks."""
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    """Compute and reduction dtypes."""
    activation_checkpoint: ActivationCheckpointConfig = ActivationCheckpointConfig()
    """Which blocks recompute their activations in backward instead of keeping them (memory for compute)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW settings (the critic uses the same, with ``critic_lr`` if set)."""
    critic_lr: float | None = pydantic.Field(default=None, gt=0)
    """PPO critic learning rate; None reuses ``optimizer.lr``."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Learning-rate warmup and decay."""
    max_grad_norm: float = pydantic.Field(default=1.0, gt=0, allow_inf_nan=True)
    """Clip the global gradient norm to this value; ``inf`` (TOML ``inf``, Python ``math.inf``) disables clipping (the
    norm is still reported). Read it through :attr:`grad_clip_norm`."""
    micro_batch_tokens: int = pydantic.Field(default=4096, ge=1)
    """Token budget of one micro-batch per rank: rows x row length, padding included."""
    pack_row_tokens: int | None = pydantic.Field(default=None, ge=1)
    """Longest packed row (several sequences back to back). None: with a segment-local attention block (``sdpa``,
    ``splash``: attention runs per sequence, so row length costs nothing) one row of ``micro_batch_tokens`` per
    micro-batch, no padding; with masked attention (``eager``: row length squared however many sequences share a
    row) the longest sequence of the mini-batch."""
    share_prompts: bool = True
    """Pack a prompt once for all the samples drawn from it (a GRPO group: the prompt, then each completion, which
    attends to it) instead of once per sample: the same log-probs and gradients for fewer tokens through the model.
    Applies where the attention block takes shared prefixes (``sdpa``, ``eager``; not ``splash``) and the model is
    dense (an MoE router's load-balancing term counts every sample's prompt tokens); elsewhere sequences are packed
    whole."""
    num_epochs: int = pydantic.Field(default=1, ge=1)
    """Optimizer passes over each rollout batch (PPO-style reuse; 1 = strictly on-policy after the first step)."""
    num_minibatches: int = pydantic.Field(default=1, ge=1)
    """Optimizer steps per epoch: the batch's episodes are split into this many mini-batches (an agent episode of
    several samples stays in one), each one optimizer step."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Periodic full-state checkpoints."""
    seed: Seed = 0
    """Seed of the trainer's torch RNG, set before the model is built (its random initialisation when no checkpoint is
    loaded); the same on every rank. In a recipe, unset means ``run.seed``."""
    compile: bool = False
    """Fuse each block's elementwise ops (RMSNorm, SwiGLU, RoPE) with ``torch.compile`` (inductor, any sequence
    length; a C++ compiler on CPU). Compiles once per op on the first step. Off by default: on CPU it was a wash (see
    README "Measured", ``benchmarks/trainer.py --compile``). Parameters, checkpoints and weight pushes are unchanged.
    CPU and CUDA only, not with tensor parallelism."""
    release_freed_memory: bool | None = None
    """Return the host memory a rank has freed to the system as the backward reaches the first block (where a step
    peaks) and after each optimizer step (``trainer.host_memory``), so a rank's resident set stays near what it holds
    instead of carrying what the C library keeps for reuse. Each release happens only when the allocator holds at
    least ``host_memory.RELEASE_MIN_FREE_BYTES`` freed (a small model's step is not slowed by pages faulted in
    again). None: on when the trainer runs on the CPU, off on an accelerator (whose step's tensors are in device
    memory). Numerics are unchanged. Read it through :attr:`releases_freed_memory`."""

    @property
    def releases_freed_memory(self) -> bool:
        """Whether the trainer returns freed host memory as it trains (``release_freed_memory``, None resolved)."""
        return self.device == "cpu" if self.release_freed_memory is None else self.release_freed_memory

    @property
    def grad_clip_norm(self) -> float | None:
        """The norm to clip gradients to, or None when clipping is off (``max_grad_norm = inf``)."""
        return None if math.isinf(self.max_grad_norm) else self.max_grad_norm

    @property
    def backend(self) -> str:
        """torch.distributed backend for ``device`` ('gloo', 'nccl', or torch-tpu's registered backend)."""
        return _BACKENDS[self.device]

    @pydantic.model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        supported = _SUPPORTED_DTYPES[self.device]
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self.mixed_precision, name)
            if dtype not in supported:
                raise ValueError(
                    f"mixed_precision.{name} = {dtype!r} is not supported on device {self.device!r}; "
                    f"use one of {list(supported)}"
                )
        tp = self.parallelism.tensor_parallel_degree
        if self.num_ranks % tp != 0:
            raise ValueError(
                f"num_ranks ({self.num_ranks}) must be a multiple of parallelism.tensor_parallel_degree ({tp})"
            )
        ep = self.parallelism.expert_parallel_degree
        if ep > 1:
            if self.num_ranks % ep:
                raise ValueError(
                    f"num_ranks ({self.num_ranks}) must be a multiple of parallelism.expert_parallel_degree ({ep})"
                )
            if tp > 1:
                raise ValueError(
                    "expert parallelism with tensor parallelism is not built: set "
                    "parallelism.tensor_parallel_degree = 1 or expert_parallel_degree = 1"
                )
            if not self.parallelism.fsdp:
                raise ValueError(
                    "parallelism.expert_parallel_degree > 1 needs parallelism.fsdp = true (the weights other than the "
                    "experts are FSDP-sharded over all ranks)"
                )
        if not self.parallelism.fsdp and self.num_ranks // tp > 1:
            raise ValueError(
                f"{self.num_ranks // tp} data-parallel ranks need parallelism.fsdp = true (the only data-parallel "
                "mode); set fsdp = true or num_ranks = tensor_parallel_degree"
            )
        if self.device == "xla" and self.num_ranks > 1:
            raise ValueError(
                f"device 'xla' runs one trainer rank (num_ranks = {self.num_ranks}), which drives the host's XLA "
                "devices through SPMD: set num_ranks = 1 and parallelism.spmd_data_parallel to the device count, or "
                "use device 'tpu' (torch-tpu) with FSDP over ranks"
            )
        spmd = self.parallelism.spmd_data_parallel
        if spmd > 1 and (self.device != "xla" or spmd & (spmd - 1)):
            raise ValueError(
                f"parallelism.spmd_data_parallel = {spmd} needs device 'xla' (got {self.device!r}) and a power of two "
                "(the static row counts it splits are powers of two); set it to 1, or to the XLA device count"
            )
        if self.compile and (tp > 1 or self.device in ("tpu", "xla")):
            raise ValueError(
                "compile = true is supported on 'cpu' and 'cuda' without tensor parallelism (inductor kernels; the q/k "
                "norms would see DTensor inputs; XLA compiles its graphs itself); set compile = false, or device "
                "'cpu'/'cuda' with "
                "parallelism.tensor_parallel_degree = 1"
            )
        if self.mixed_precision.param_dtype != "float32" and not self.parallelism.fsdp:
            raise ValueError(
                "mixed_precision needs parallelism.fsdp = true (FSDP2 does the casting); "
                "set fsdp = true or param_dtype = 'float32'"
            )
        return self

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``FieldError`` (a ``ValueError``) on the field to change when this trainer cannot run ``model``: the
        ``varlen`` attention block computes in bfloat16/float16 only; the vocabulary-parallel head stands in for
        ``chunked`` only; tensor parallelism needs dense blocks whose head counts the degree divides; expert parallelism
        needs an MoE model whose expert count the degree divides. Run before any rank starts (the recipe's load does for
        a model that exists or a published one it creates, the driver for a tiny one once created)."""
        if model.attention == "varlen" and self.mixed_precision.param_dtype == "float32":
            raise FieldError("model.attention", (
                'model.attention = "varlen" runs Flash Attention, which computes in bfloat16 or float16, but '
                'trainer.mixed_precision.param_dtype = "float32": set it to "bfloat16" or use attention = "sdpa"'
            ))  # fmt: skip
        if self.parallelism.vocab_parallel and model.output_head != "chunked":
            raise FieldError("trainer.parallelism.vocab_parallel", (
                f"trainer.parallelism.vocab_parallel computes the output head itself, in chunks of "
                f'model.output_chunk_size tokens, but model.output_head = "{model.output_head}": set output_head = '
                f'"chunked" or vocab_parallel = false'
            ))  # fmt: skip
        tp_problem = model.tensor_parallel_problem(self.parallelism.tensor_parallel_degree)
        if tp_problem is not None:
            raise FieldError("trainer.parallelism.tensor_parallel_degree", tp_problem)
        ep = self.parallelism.expert_parallel_degree
        if ep == 1:
            return
        where = "trainer.parallelism.expert_parallel_degree"
        if model.moe is None:
            raise FieldError(where, f"{where} = {ep} splits MoE experts over ranks, but the model ({model.family}) has "
                                    "no experts: set it to 1")  # fmt: skip
        if model.moe.num_experts % ep:
            raise FieldError(where, f"{where} = {ep} does not divide the model's {model.moe.num_experts} experts per "
                                    f"layer: use a divisor of {model.moe.num_experts}")  # fmt: skip
