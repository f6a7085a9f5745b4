"""Low-rank adapters on the projections of the trainer's models, in PEFT's layout.

A model built from a :class:`ModelConfig` with ``lora`` set has each targeted ``nn.Linear`` replaced by a
:class:`LoRALinear`: the same frozen ``weight`` (same parameter name, so HF loading, sharding and the name tables are
unchanged) plus trainable ``lora_A [rank, in]`` and ``lora_B [out, rank]``. With ``lora.target_parameters`` each MoE
layer's stacked experts get an :class:`ExpertLoRA` per targeted weight (``experts.gate_up_lora``,
``experts.down_lora``): one adapter per expert, held in PEFT's stacked layout (``weight_sync.peft``), the fused gate/up
adapter feeding both ``w1`` and ``w3``. Every other parameter is frozen, so the optimizer holds state for the adapters
alone.

- :func:`adapters_disabled` runs the base model (the KL reference: no second copy of the model is built).
- :func:`peft_name` maps an adapter parameter to PEFT's name (``base_model.model.model.layers.0.self_attn.q_proj.
  lora_A.weight``): what pushes, adapter exports and adapter manifests use.
- :func:`merged_parameters` yields the base parameters with each adapter's update folded in (a plain HF checkpoint).
- :func:`adapter_state_dict` yields the adapters under their PEFT names, for ``weight_sync.peft.write_peft_adapter``.

Sharding: FSDP2 shards the adapters like any parameter (dim 0, inside their block's unit). Under tensor parallelism
(:func:`split_adapters_like_their_weights`) each adapter is split along the dimension its projection is split on and
its other factor replicated: a column-split projection (output rows over ranks) shards ``lora_B``'s rows, a row-split
one (input columns over ranks) shards ``lora_A``'s columns. The low-rank path then needs no communication of its own:
a column split's output is sharded like the base's, a row split's is a partial sum that the base's all-reduce adds up
with it; the replicated factor is ``rank`` wide, so holding it whole costs little. Under expert parallelism the expert
adapters stay whole factors (PEFT's ``lora_B`` keeps the expert as its minor index, so a rank's experts are no
contiguous slice of it): an FSDP unit of their own over all ranks, each rank computing with its experts' slice.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.config import Family, LoRAConfig, ModelConfig
from trainer.models.hf_names import name_map
from trainer.models.moe import Experts
from weight_sync import peft

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ExpertLoRA", "LoRALinear", "adapter_state_dict", "adapters_disabled", "apply_lora", "initial_adapters",
    "is_adapter",
    "merged_parameters", "peft_name", "set_adapters_enabled", "split_adapters_like_their_weights", "train_adapters",
]  # fmt: skip

_ADAPTER_PARAMS = ("lora_A", "lora_B")
_EXPERT_ADAPTERS: dict[peft.ExpertTarget, str] = {
    "mlp.experts.gate_up_proj": "gate_up_lora", "mlp.experts.down_proj": "down_lora",
}  # fmt: skip
"""Each expert target's :class:`ExpertLoRA` attribute on :class:`trainer.models.moe.Experts`."""


class LoRALinear(nn.Linear):
    """``y = x W^T + scaling * dropout(x) A^T B^T`` over a frozen ``W``; ``adapter_enabled = False`` gives the base.

    Holds the base ``weight`` it was given (no copy) and no bias (the families here have none).
    """

    def __init__(self, weight: nn.Parameter, cfg: LoRAConfig) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a second weight
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", None)
        self.scaling = cfg.scaling
        self.dropout = cfg.dropout
        self.init = cfg.init
        self.adapter_enabled = True
        device, dtype = weight.device, weight.dtype
        self.lora_A = nn.Parameter(torch.empty(cfg.rank, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, cfg.rank, device=device, dtype=dtype))
        if weight.device.type != "meta":
            self.reset_adapter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if not self.adapter_enabled:
            return out
        if self.dropout and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout, training=True)
        return out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """A fresh adapter: ``B = 0`` (the model is unchanged) and ``A`` as ``LoRAConfig.init`` says."""
        _init_a(self.lora_A, self.init, self.lora_A.shape[0])
        nn.init.zeros_(self.lora_B)

    def delta_weight(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        """``scaling * B @ A`` (``[out, in]``) of the given full adapter tensors (default: this module's)."""
        a = self.lora_A if a is None else a
        b = self.lora_B if b is None else b
        return (b.float() @ a.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling}"


class ExpertLoRA(nn.Module):
    """A LoRA adapter per expert on one stacked expert weight ``[E, out, in]``, in PEFT's stacked layout:
    ``lora_A [E rank, in]``, ``lora_B [out, rank E]`` (``weight_sync.peft``). No dropout (PEFT has none for these)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, cfg: LoRAConfig, like: torch.Tensor):
        super().__init__()
        self.num_experts, self.scaling, self.init = num_experts, cfg.scaling, cfg.init
        self.adapter_enabled = True
        device, dtype = like.device, like.dtype
        self.lora_A = nn.Parameter(torch.empty(num_experts * cfg.rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, cfg.rank * num_experts, device=device, dtype=dtype))
        if like.device.type != "meta":
            self.reset_adapter()

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``A_e [E, rank, in]`` and ``B_e [E, out, rank]`` (contiguous: the grouped matmuls take them as weights).

        A forward (called as ``module()``), so that under expert parallelism, where the adapters are an FSDP unit of
        their own over every rank (``trainer.parallelize``), FSDP gathers them first; the factors are views of the
        gathered parameters, which that unit keeps until backward."""
        a, b = peft.expert_factors(self.lora_A, self.lora_B, self.num_experts)
        return a, b.contiguous()

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """A fresh adapter: ``B = 0`` and ``A`` as ``LoRAConfig.init`` says (over the stacked tensor, as PEFT does)."""
        _init_a(self.lora_A, self.init, self.lora_A.shape[0] // self.num_experts)
        nn.init.zeros_(self.lora_B)

    def delta_weight(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        """``scaling * B_e @ A_e`` for every expert, ``[E, out, in]`` in float32, of the given full adapter tensors
        (default: this module's)."""
        a_e, b_e = peft.expert_factors(self.lora_A if a is None else a, self.lora_B if b is None else b,
                                       self.num_experts)  # fmt: skip
        return torch.bmm(b_e.float(), a_e.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, lora_A={tuple(self.lora_A.shape)}, lora_B={tuple(self.lora_B.shape)}"


def initial_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Fresh whole values of every adapter parameter of ``model`` (on any device, meta included), on the CPU by
    parameter name: what :meth:`LoRALinear.reset_adapter` / :meth:`ExpertLoRA.reset_adapter` give, drawn from
    torch's RNG in module order."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear | ExpertLoRA):
            a = torch.empty(m.lora_A.shape, dtype=m.lora_A.dtype)
            rank = a.shape[0] // (m.num_experts if isinstance(m, ExpertLoRA) else 1)
            _init_a(a, m.init, rank)
            out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a, torch.zeros(m.lora_B.shape, dtype=m.lora_B.dtype)
    return out


def _init_a(lora_a: torch.Tensor, init: str, rank: int) -> None:
    if init == "gaussian":
        nn.init.normal_(lora_a, std=1 / rank)
    else:
        nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))


def _hf_module(family: Family, module_name: str) -> str | None:
    """The HF module name (``model.layers.0.self_attn.q_proj``) of one of our linear modules, or None if the name
    table has no ``<module>.weight`` for it."""
    try:
        hf_name, stacked = name_map(family).to_hf(f"{module_name}.weight")
    except KeyError:
        return None
    return None if stacked else hf_name.removesuffix(".weight")


def apply_lora(model: nn.Module, model_cfg: ModelConfig) -> list[str]:
    """Replace every targeted ``nn.Linear`` of ``model`` (a freshly built, unwrapped ``Transformer``) by a
    :class:`LoRALinear` over its weight, give every MoE layer's experts an :class:`ExpertLoRA` per target parameter,
    and freeze all other parameters; returns the adapted module names.

    Targets are matched by HF module name (``q_proj`` ...), so one name table decides for every family.
    """
    cfg = model_cfg.lora
    if cfg is None:
        raise ValueError("apply_lora needs a ModelConfig with lora set")
    adapted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, Experts):
            num_experts, hidden, dim = module.w1.shape
            for target in cfg.target_parameters:
                dims = peft.expert_target_dims(target, dim, hidden)
                setattr(module, _EXPERT_ADAPTERS[target], ExpertLoRA(num_experts, *dims, cfg, module.w1))
                adapted.append(f"{name}.{_EXPERT_ADAPTERS[target]}")
            continue
        hf = _hf_module(model_cfg.family, name) if type(module) is nn.Linear else None
        if hf is None or hf.rsplit(".", 1)[-1] not in cfg.target_modules:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoRALinear(module.weight, cfg))
        adapted.append(name)
    if not adapted:
        raise ValueError(f"lora targets {list(cfg.target_modules) + list(cfg.target_parameters)} matched no "
                         "projection of this model")  # fmt: skip
    train_adapters(model)
    return adapted


def split_adapters_like_their_weights(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Give every :class:`LoRALinear` of ``module`` whose weight ``parallelize_module`` split over ``tp_mesh`` the
    matching adapter placements (module docstring): weight ``Shard(0)`` -> ``lora_A`` replicated, ``lora_B``
    ``Shard(0)``; weight ``Shard(1)`` -> ``lora_A`` ``Shard(1)``, ``lora_B`` replicated. Call right after
    ``parallelize_module``, before FSDP (``trainer.parallelize`` does)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for m in module.modules():
        if not isinstance(m, LoRALinear) or not isinstance(m.weight, DTensor):
            continue
        column = m.weight.placements[0] == Shard(0)
        placements = {"lora_A": Replicate() if column else Shard(1), "lora_B": Shard(0) if column else Replicate()}
        for name, placement in placements.items():
            p = getattr(m, name)
            whole = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            split = distribute_tensor(whole, tp_mesh, [placement])
            m.register_parameter(name, nn.Parameter(split, requires_grad=p.requires_grad))


def train_adapters(model: nn.Module, base: bool = False) -> None:
    """Make the adapters (default) or, with ``base``, every other parameter the trainable ones; the rest frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) != base)


def is_adapter(param_name: str) -> bool:
    """Whether a parameter name (ours, possibly with wrapper parts) is a LoRA adapter tensor."""
    return param_name.rsplit(".", 1)[-1] in _ADAPTER_PARAMS


def peft_name(model_cfg: ModelConfig, param_name: str) -> str:
    """PEFT's name of one of our adapter parameters: ``layers.0.attention.wq.lora_A`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, ``layers.0.moe.experts.down_lora.lora_A`` ->
    ``base_model.model.model.layers.0.mlp.experts.lora_A.weight`` (``weight_sync.peft.expert_peft_name``). Raises
    ``ValueError`` for other names."""
    from trainer.models.hf_io import canonical_name

    family, lora = model_cfg.family, model_cfg.lora
    module_name, _, leaf = canonical_name(param_name).rpartition(".")
    parent, _, adapter = module_name.rpartition(".")
    target = next((t for t, attr in _EXPERT_ADAPTERS.items() if attr == adapter), None)
    if leaf in _ADAPTER_PARAMS and target is not None and lora is not None:
        try:  # the experts' HF module: their stacked weight's name up to the expert index
            stacked_name, _ = name_map(family).to_hf(f"{parent}.w1")
        except KeyError:
            stacked_name = ""
        if ".{}." in stacked_name:
            return peft.expert_peft_name(stacked_name.partition(".{}.")[0], target, leaf, lora)  # type: ignore[arg-type]
    hf = _hf_module(family, module_name) if leaf in _ADAPTER_PARAMS else None
    if hf is None:
        raise ValueError(f"{param_name!r} is not a LoRA adapter parameter of a {family} model")
    return peft.peft_name(hf, leaf)  # type: ignore[arg-type]  # leaf is one of _ADAPTER_PARAMS


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every adapter of ``model`` (:class:`LoRALinear`, :class:`ExpertLoRA`) on or off (off: the base model,
    and no adapter compute)."""
    for m in model.modules():
        if isinstance(m, LoRALinear | ExpertLoRA):
            m.adapter_enabled = enabled


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model`` computes with its base weights only (every :class:`LoRALinear` off)."""
    set_adapters_enabled(model, False)
    try:
        yield
    finally:
        set_adapters_enabled(model, True)


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly DTensor) parameter, detached; a collective for DTensors."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


Adapters = Mapping[str, torch.Tensor]
"""Whole adapter tensors by our parameter name (``layers.0.attention.wq.lora_A``), e.g. read from a checkpoint."""


def _update(
    adapter: LoRALinear | ExpertLoRA, prefix: str, adapters: Adapters | None, rows: slice = slice(None)
) -> torch.Tensor:
    """The update of ``adapter``'s weight (expert adapters: its ``rows`` of every expert's) from its factors in
    ``adapters`` under ``prefix`` (default: the module's own, gathered in full)."""
    if adapters is None:
        a, b = _full(adapter.lora_A), _full(adapter.lora_B)
    else:
        a, b = adapters[f"{prefix}.lora_A"], adapters[f"{prefix}.lora_B"]
    delta = adapter.delta_weight(a, b)
    return delta if isinstance(adapter, LoRALinear) else delta[:, rows]


def _updates(model: nn.Module, adapters: Adapters | None) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """``(our name of an adapted weight, its update)``, each update computed (collectively) when called."""
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield f"{name}.weight", functools.partial(_update, m, name, adapters)
        elif isinstance(m, Experts):
            if m.gate_up_lora is not None:  # rows [:I] of the fused update are the gate's, [I:] the up's
                hidden, prefix = m.w1.shape[1], f"{name}.gate_up_lora"
                yield f"{name}.w1", functools.partial(_update, m.gate_up_lora, prefix, adapters, slice(None, hidden))
                yield f"{name}.w3", functools.partial(_update, m.gate_up_lora, prefix, adapters, slice(hidden, None))
            if m.down_lora is not None:
                yield f"{name}.w2", functools.partial(_update, m.down_lora, f"{name}.down_lora", adapters)


def merged_parameters(
    model: nn.Module,
    base: Iterable[tuple[str, torch.Tensor]] | None = None,
    adapters: Adapters | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(our name, full tensor)`` of every non-adapter parameter, an adapted weight with its update
    ``scaling * B A`` (per expert for expert weights) added in float32 and cast back.

    By default the tensors are ``model``'s own, gathered (collective for sharded models: every rank iterates).
    ``base`` yields ``(our name, whole tensor)`` of every non-adapter parameter in ``model``'s order and ``adapters``
    holds every adapter tensor: with both, ``model`` gives only the structure and may live on the meta device (a
    checkpoint's adapters merged into base weights read from disk, no model built)."""
    updates = dict(_updates(model, adapters))
    if base is None:
        base = ((name, _full(p)) for name, p in model.named_parameters() if not is_adapter(name))
    for name, full in base:
        update = updates.get(name)
        if update is not None:
            full = (full.float() + update()).to(full.dtype)
        yield name, full


def adapter_state_dict(model: nn.Module, model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT name, full tensor)`` of every adapter parameter; collective for sharded models."""
    for name, p in model.named_parameters():
        if is_adapter(name):
            yield peft_name(model_cfg, name), _full(p)
