"""Low-rank adapters on the projections of the trainer's models, in PEFT's layout.

A model built from a :class:`ModelConfig` with ``lora`` set has each targeted ``nn.Linear`` replaced by a
:class:`LoRALinear`: the same frozen ``weight`` (same parameter name, so HF loading, sharding and the name tables are
unchanged) plus trainable ``lora_A [rank, in]`` and ``lora_B [out, rank]``. Every other parameter is frozen, so the
optimizer holds state for the adapters alone.

- :func:`adapters_disabled` runs the base model (the KL reference: no second copy of the model is built).
- :func:`peft_name` maps an adapter parameter to PEFT's name (``base_model.model.model.layers.0.self_attn.q_proj.
  lora_A.weight``): what pushes, adapter exports and adapter manifests use.
- :func:`merged_parameters` yields the base parameters with each adapter's update folded in (a plain HF checkpoint).
- :func:`adapter_state_dict` yields the adapters under their PEFT names, for ``weight_sync.peft.write_peft_adapter``.

Sharding: FSDP2 shards the adapters like any parameter (dim 0, inside their block's unit). Tensor parallelism is not
built for adapters (the recipe check refuses it).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.config import Family, LoRAConfig, ModelConfig
from trainer.models.hf_names import name_map
from weight_sync import peft

__all__ = [
    "LoRALinear", "adapter_state_dict", "adapters_disabled", "apply_lora", "is_adapter", "merged_parameters",
    "peft_name", "set_adapters_enabled", "train_adapters",
]  # fmt: skip

_ADAPTER_PARAMS = ("lora_A", "lora_B")


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
        if self.init == "gaussian":
            nn.init.normal_(self.lora_A, std=1 / self.lora_A.shape[0])
        else:
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def delta_weight(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        """``scaling * B @ A`` (``[out, in]``) of the given full adapter tensors (default: this module's)."""
        a = self.lora_A if a is None else a
        b = self.lora_B if b is None else b
        return (b.float() @ a.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling}"


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
    :class:`LoRALinear` over its weight and freeze all other parameters; returns the adapted module names.

    Targets are matched by HF module name (``q_proj`` ...), so one name table decides for every family.
    """
    cfg = model_cfg.lora
    if cfg is None:
        raise ValueError("apply_lora needs a ModelConfig with lora set")
    adapted = []
    for name, module in list(model.named_modules()):
        hf = _hf_module(model_cfg.family, name) if type(module) is nn.Linear else None
        if hf is None or hf.rsplit(".", 1)[-1] not in cfg.target_modules:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoRALinear(module.weight, cfg))
        adapted.append(name)
    if not adapted:
        raise ValueError(f"lora.target_modules {list(cfg.target_modules)} matched no projection of this model")
    train_adapters(model)
    return adapted


def train_adapters(model: nn.Module, base: bool = False) -> None:
    """Make the adapters (default) or, with ``base``, every other parameter the trainable ones; the rest frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) != base)


def is_adapter(param_name: str) -> bool:
    """Whether a parameter name (ours, possibly with wrapper parts) is a LoRA adapter tensor."""
    return param_name.rsplit(".", 1)[-1] in _ADAPTER_PARAMS


def peft_name(family: Family, param_name: str) -> str:
    """PEFT's name of one of our adapter parameters: ``layers.0.attention.wq.lora_A`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. Raises ``ValueError`` for other names."""
    from trainer.models.hf_io import canonical_name

    module_name, _, leaf = canonical_name(param_name).rpartition(".")
    hf = _hf_module(family, module_name) if leaf in _ADAPTER_PARAMS else None
    if hf is None:
        raise ValueError(f"{param_name!r} is not a LoRA adapter parameter of a {family} model")
    return peft.peft_name(hf, leaf)  # type: ignore[arg-type]  # leaf is one of _ADAPTER_PARAMS


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every :class:`LoRALinear` of ``model`` on or off (off: the base model, and no adapter compute)."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
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


def merged_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(our name, full tensor)`` of every non-adapter parameter, a :class:`LoRALinear`'s weight with its update
    ``scaling * B A`` added (in float32, cast back); collective for sharded models (every rank iterates)."""
    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue
        full = _full(p)
        module = adapters.get(name.removesuffix(".weight"))
        if module is not None:
            delta = module.delta_weight(_full(module.lora_A), _full(module.lora_B))
            full = (full.float() + delta).to(full.dtype)
        yield name, full


def adapter_state_dict(model: nn.Module, family: Family) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT name, full tensor)`` of every adapter parameter; collective for sharded models."""
    for name, p in model.named_parameters():
        if is_adapter(name):
            yield peft_name(family, name), _full(p)
