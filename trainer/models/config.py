"""Configuration of the model family (Llama 3, Qwen 3 dense, Qwen 3 MoE): one :class:`ModelConfig` tree.

No torch import here, so recipes validate instantly. The swappable compute blocks (attention, output head, MoE experts)
are the four fields of :class:`BlockChoices`, which both :class:`ModelConfig` and the recipe's ``[model]`` section
inherit. Each name is checked on validation against the torch-free block declarations of ``trainer.models.registry``
(which also say on which devices each block runs) and resolved to its implementation at build time.

:func:`trainer.models.hf_config.model_config_from_hf` builds a :class:`ModelConfig` from a local HF ``config.json``.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import pydantic

from common.config import Config, Family, setting_warning
from trainer.models.registry import BLOCK_REGISTRIES
from weight_sync.peft import EXPERT_TARGETS, AdapterSpec, expert_target_dims

log = logging.getLogger("rl_align")

__all__ = ["BlockChoices", "Family", "LoRAConfig", "ModelConfig", "MoEConfig", "RopeScalingConfig"]

_PositiveInt = Annotated[int, pydantic.Field(gt=0)]
_PositiveFloat = Annotated[float, pydantic.Field(gt=0)]


class RopeScalingConfig(Config):
    """Llama 3.1 RoPE frequency scaling ("llama3" rope type): long wavelengths are stretched by ``factor``."""

    factor: _PositiveFloat = 8.0
    """Divisor applied to the low-frequency (long-wavelength) rotary frequencies."""
    low_freq_factor: _PositiveFloat = 1.0
    """Wavelengths above ``original_max_seq_len / low_freq_factor`` are fully scaled."""
    high_freq_factor: _PositiveFloat = 4.0
    """Wavelengths below ``original_max_seq_len / high_freq_factor`` are kept; in between they are interpolated."""
    original_max_seq_len: _PositiveInt = 8192
    """Context length the model was pre-trained with before scaling (HF ``original_max_position_embeddings``)."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> RopeScalingConfig:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must be greater than low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self


class MoEConfig(Config):
    """Sparse mixture-of-experts feed-forward (Qwen3-MoE): a softmax router picks ``top_k`` of ``num_experts``."""

    num_experts: _PositiveInt
    """Routed experts per MoE layer."""
    top_k: _PositiveInt
    """Experts each token is sent to (HF ``num_experts_per_tok``)."""
    expert_ffn_hidden_dim: _PositiveInt
    """Hidden width of each expert's SwiGLU (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE does); otherwise use the raw softmax ones."""
    aux_loss_coef: float = pydantic.Field(default=0.001, ge=0)
    """Weight of the router load-balancing loss in training (HF ``router_aux_loss_coef``; 0.001 is Qwen3-MoE's
    default); 0 turns the term off. The RL algorithm may override it (``algorithm.moe_aux_loss_coef``)."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k ({self.top_k}) must be <= moe.num_experts ({self.num_experts})")
        return self


_LORA_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class LoRAConfig(AdapterSpec):
    """Low-rank adapters (LoRA) on the projections of every block: ``W x + (alpha / rank) * B A x`` with ``A [rank,
    in]``, ``B [out, rank]`` (the rank, alpha and targets of :class:`weight_sync.peft.AdapterSpec`); the base weights
    are frozen (no gradients, no optimizer state).

    The adapters use PEFT's layout and names (``weight_sync.peft``), so pushes, exports and checkpoints of them load
    into PEFT and vLLM's LoRA path as they are. On MoE models ``target_modules`` names attention projections only (the
    feed-forward is stacked experts, not linear modules); ``target_parameters`` adapts the experts, one adapter per
    expert on the fused gate/up and on the down projection, as PEFT's ``target_parameters`` does.
    """

    dropout: float = pydantic.Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input in gradient passes only (PEFT ``lora_dropout``); passes without gradients (old
    and reference log-probs) are deterministic. In RL the gradient pass then scores another policy than the one that
    sampled (ratios differ from 1 by the dropout noise), so 0, the default, is the choice there; it is for SFT."""
    init: Literal["default", "gaussian"] = "default"
    """``A``'s initialisation (``B`` starts at zero, so a fresh adapter leaves the model unchanged): 'default' is
    PEFT's (Kaiming-uniform, ``a = sqrt(5)``), 'gaussian' normal with std ``1 / rank``."""


class BlockChoices(Config):
    """Which implementation runs each swappable block: the one declaration of these fields, inherited by
    :class:`ModelConfig` and by the recipe's ``[model]`` section.

    A name must be declared in ``trainer.models.registry`` or registered there by code that ran before this config is
    validated (a recipe is validated before any user code runs, so it names declared blocks only).
    :meth:`device_problems` says which chosen blocks the declaration rules out on a trainer device.
    """

    attention: str = "sdpa"
    """Attention implementation, a name of ``ATTENTION_BLOCKS`` (built in: ``sdpa``, causal SDPA run per
    packed sequence with no mask; ``eager``, the masked reference; ``varlen``, CUDA only, every packed sequence in one
    Flash Attention call, bfloat16/float16; Pallas kernel: ``splash``)."""
    output_head: str = "chunked"
    """Output head for ``token_logprobs``, a name of ``OUTPUT_HEADS`` (built in: ``dense``, which holds
    the full [tokens, vocab] logits; ``chunked``, which never does; ``cached``, chunked forward that keeps the fp32
    probabilities for a cheaper backward (tokens x vocab x 4 bytes, like ``dense``); Pallas kernel:
    ``fused_pallas``)."""
    output_chunk_size: _PositiveInt = 1024
    """Tokens per chunk of the ``chunked`` output head: its extra memory is about 3 x chunk x vocab x 4 bytes."""
    moe_experts: str = "grouped"
    """MoE expert implementation (MoE models only), a name of ``MOE_EXPERTS`` (built in: ``loop``, one
    matmul set per expert, and ``grouped``, tokens sorted by expert and one grouped matmul per projection; Pallas
    kernel: ``gmm_pallas``)."""

    @pydantic.field_validator(*BLOCK_REGISTRIES)
    @classmethod
    def _check_block_name(cls, name: str, info: pydantic.ValidationInfo) -> str:
        BLOCK_REGISTRIES[str(info.field_name)].check_name(name)
        return name

    def block_overrides(self) -> dict[str, Any]:
        """The four block fields as ``ModelConfig`` field overrides (``model_config_from_hf(path, **overrides)``)."""
        return {field: getattr(self, field) for field in BlockChoices.model_fields}

    def device_problems(self, device: str, prefix: str = "") -> dict[str, str]:
        """Block field -> why its declared block cannot run on trainer device ``device`` (empty when all can); the
        messages name each field as ``prefix + field`` (e.g. ``model.attention``)."""
        problems = {}
        for field, registry in BLOCK_REGISTRIES.items():
            problem = registry.device_problem(getattr(self, field), device, field=prefix + field)
            if problem is not None:
                problems[field] = problem
        return problems


class ModelConfig(BlockChoices):
    """A decoder-only transformer of one supported family, plus which implementation runs each swappable block."""

    family: Family
    """Architecture family. Decides the HF name table and config.json layout."""
    vocab_size: _PositiveInt
    """Rows of the token embedding and of the output head."""
    dim: _PositiveInt
    """Residual stream width (HF ``hidden_size``)."""
    num_layers: _PositiveInt
    """Transformer blocks."""
    num_heads: _PositiveInt
    """Query heads per attention layer."""
    num_kv_heads: _PositiveInt
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: _PositiveInt
    """Width of one attention head; even (RoPE rotates pairs). Need not equal ``dim // num_heads`` (Qwen3 does not)."""
    ffn_hidden_dim: _PositiveInt
    """Hidden width of the dense SwiGLU feed-forward (HF ``intermediate_size``); kept but unused in MoE layers."""
    norm_eps: _PositiveFloat = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: _PositiveFloat = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScalingConfig | None = None
    """Llama 3.1 frequency scaling; ``None`` for plain RoPE."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3: true; Llama 3: false)."""
    tie_embeddings: bool = False
    """The output head reuses the token embedding matrix (no separate ``lm_head`` weight)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts settings; required for ``qwen3_moe`` (every layer is sparse) and absent otherwise."""
    max_seq_len: _PositiveInt = 4096
    """Longest sequence (packed row) the model is used with; exported as HF ``max_position_embeddings``."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on a frozen base (``trainer.models.lora``); None trains every parameter."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of dimensions")
        if (self.family == "qwen3_moe") != (self.moe is not None):
            raise ValueError(
                f"family {self.family!r}: a [moe] section is required for 'qwen3_moe' and not allowed otherwise "
                f"(got moe={'set' if self.moe is not None else 'None'})"
            )
        wants_qk_norm = self.family != "llama3"
        if self.qk_norm != wants_qk_norm:
            raise ValueError(f"family {self.family!r} has qk_norm={wants_qk_norm}; set qk_norm = {wants_qk_norm}")
        if self.rope_scaling is not None and self.family != "llama3":
            raise ValueError(f"rope_scaling (Llama 3.1 style) is only supported for 'llama3', not {self.family!r}")
        if self.lora is not None:
            self._check_lora(self.lora)
        return self

    def _check_lora(self, lora: LoRAConfig) -> None:
        too_narrow = {t: w for t, w in self._adapted_widths(lora).items() if lora.rank > w}
        if too_narrow:
            setting_warning(
                log, "lora.rank = %d exceeds the narrower side of %s: a projection's update has rank at most "
                "min(in, out), so the extra rank adds adapter parameters and optimizer state but no capacity (and "
                "alpha / rank scales the update down); a rank of at most %d fits every target",
                lora.rank, ", ".join(f"{t} ({w})" for t, w in too_narrow.items()), min(too_narrow.values()),
            )  # fmt: skip
        mlp = [t for t in lora.target_modules if t in _LORA_MLP_TARGETS]
        if self.moe is not None and mlp:
            raise ValueError(
                f"lora.target_modules {mlp}: a qwen3_moe model's feed-forward is stacked experts, not these "
                "projections; target the experts with lora.target_parameters = "
                '["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] and keep target_modules to attention '
                "(q_proj, k_proj, v_proj, o_proj)"
            )
        if not lora.target_parameters:
            return
        if self.moe is None:
            raise ValueError(f"lora.target_parameters {list(lora.target_parameters)} adapt MoE experts, and this "
                             f"{self.family} model has none: use target_modules")  # fmt: skip
        if lora.dropout:
            raise ValueError("lora.dropout must be 0 with target_parameters: an expert adapter has no input of its "
                             "own to drop (nor has PEFT's)")  # fmt: skip
        if self.moe_experts not in ("loop", "grouped"):
            raise ValueError(f"lora.target_parameters with moe_experts = {self.moe_experts!r}: expert adapters run "
                             "in the 'grouped' and 'loop' kernels only (not built for the Pallas one)")  # fmt: skip

    def tensor_parallel_problem(self, degree: int) -> str | None:
        """Why the blocks of this model cannot be split over ``degree`` tensor-parallel ranks, or None when they can:
        MoE experts are not split, and the degree must divide both head counts."""
        if degree == 1:
            return None
        if self.moe is not None:
            return ("tensor parallelism supports dense blocks only (MoE experts are not split: use "
                    "parallelism.expert_parallel_degree); set parallelism.tensor_parallel_degree = 1")  # fmt: skip
        heads = (self.num_heads, self.num_kv_heads)
        if any(n % degree for n in heads):
            divisors = [d for d in range(1, min(heads) + 1) if not heads[0] % d and not heads[1] % d]
            return (f"tensor_parallel_degree {degree} must divide num_heads and num_kv_heads {heads}: use one of "
                    f"{divisors}")  # fmt: skip
        return None

    def lora_target_sides(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of each projection a LoRA target names (``q_proj`` ... ``down_proj``; on MoE models one
        expert's ``mlp.experts.*`` weight): an adapter on it is ``A [rank, in]``, ``B [out, rank]``."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        sides = {"q_proj": (self.dim, q), "k_proj": (self.dim, kv), "v_proj": (self.dim, kv), "o_proj": (q, self.dim),
                 "gate_proj": (self.dim, self.ffn_hidden_dim), "up_proj": (self.dim, self.ffn_hidden_dim),
                 "down_proj": (self.ffn_hidden_dim, self.dim)}  # fmt: skip
        if self.moe is not None:
            sides.update({t: expert_target_dims(t, self.dim, self.moe.expert_ffn_hidden_dim) for t in EXPERT_TARGETS})
        return sides

    def _adapted_widths(self, lora: LoRAConfig) -> dict[str, int]:
        """min(in, out) of each projection ``lora`` adapts (the highest rank its update can have)."""
        sides = self.lora_target_sides()
        return {t: min(sides[t]) for t in (*lora.target_modules, *lora.target_parameters) if t in sides}

    @property
    def num_params(self) -> int:
        """Total parameter count (tied embeddings counted once)."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.num_layers * self.block_params() + self.dim + head

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: all of a dense model's; an MoE model's minus the experts its router
        does not pick (``num_experts - top_k`` per layer). ``6 x active_params x tokens`` is a training step's FLOPs."""
        if self.moe is None:
            return self.num_params
        return self.num_params - self.num_layers * (self.moe.num_experts - self.moe.top_k) * self._expert_params

    def block_params(self, expert_shards: int = 1) -> int:
        """Parameters of one transformer block; with ``expert_shards`` > 1 the part one expert-parallel rank holds
        (``num_experts / expert_shards`` of the experts, everything else whole)."""
        attn = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += 2 * self.head_dim if self.qk_norm else 0
        if self.moe is None:
            ffn = 3 * self.dim * self.ffn_hidden_dim
        else:
            experts = self.moe.num_experts // expert_shards
            ffn = self._expert_params * experts + self.dim * self.moe.num_experts  # experts + router
        return attn + ffn + 2 * self.dim

    @property
    def _expert_params(self) -> int:
        """Parameters of one MoE expert (its SwiGLU: gate, up, down); 0 for a dense model."""
        return 0 if self.moe is None else 3 * self.dim * self.moe.expert_ffn_hidden_dim
