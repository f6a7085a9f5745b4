"""Registries of swappable compute blocks, keyed by the strings a :class:`ModelConfig` names.

Three registries, one per swappable block, each mapping a name to a plain function:

- ``ATTENTION_BLOCKS[name](q, k, v, *, segment_ids, scale) -> out``: q ``[B, H, T, Dh]``, k/v ``[B, KVH, T, Dh]``
  (grouped-query: ``H % KVH == 0``, the function handles the grouping), segment_ids ``[B, T]`` or ``None``; attention
  is causal and, with segment ids, restricted to equal ids. Returns ``[B, H, T, Dh]``. A block registered with
  ``segment_local=True`` costs the sum over segments of their squared lengths, not the packed row's squared length:
  the trainer then packs rows up to the whole micro-batch token budget (no padding) unless told otherwise.
- ``OUTPUT_HEADS[name](hidden, weight, targets, *, chunk_size) -> (logprobs, entropy)``: hidden ``[..., D]``, weight
  ``[V, D]``, targets ``[...]`` int64; returns float32 ``[...]`` each (fresh tensors, not views), both
  differentiable w.r.t. hidden and weight.
- ``MOE_EXPERTS[name](x, expert_idx, expert_weight, w1, w3, w2) -> out``: x ``[N, D]``, expert_idx ``[N, K]`` int64,
  expert_weight ``[N, K]``, stacked SwiGLU weights w1/w3 ``[E, I, D]`` and w2 ``[E, D, I]``; returns ``[N, D]`` =
  sum over k of ``expert_weight[:, k] * expert_{idx[:, k]}(x)``.

A kernel module registers its implementation at import (``ATTENTION_BLOCKS.register("splash", fn)``) and a recipe
selects it by name; model code never changes. Looking up an unknown name raises ``ValueError`` listing what exists.

The Pallas kernels of :mod:`trainer.kernels` (``splash``, ``fused_pallas``, ``gmm_pallas``) are known here by name and
module only: the first lookup of one imports its module (and with it JAX), so importing the models never does.
A block may come with a ``check_supported(device)``; :func:`check_blocks_supported` runs those of a config's blocks
for the device a model is built on, so a kernel the platform cannot run fails at build time with the flag to change.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, TypeVar

if TYPE_CHECKING:
    from trainer.models.config import ModelConfig

__all__ = ["ATTENTION_BLOCKS", "MOE_EXPERTS", "OUTPUT_HEADS", "BlockRegistry", "check_blocks_supported"]

FnT = TypeVar("FnT", bound=Callable)
DeviceCheck = Callable[[Any], None]


class BlockRegistry(Generic[FnT]):
    """A name -> implementation table for one kind of block (see the module docstring for each kind's contract).

    ``lazy_modules`` maps names registered by a module that is imported only when the name is first looked up.
    """

    def __init__(self, kind: str, config_field: str, lazy_modules: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.config_field = config_field
        self._impls: dict[str, FnT] = {}
        self._checks: dict[str, DeviceCheck] = {}
        self._segment_local: set[str] = set()
        self._lazy_modules = dict(lazy_modules or {})

    def register(
        self,
        name: str,
        fn: FnT | None = None,
        *,
        replace: bool = False,
        check_supported: DeviceCheck | None = None,
        segment_local: bool = False,
    ) -> Callable[[FnT], FnT] | FnT:
        """Register ``fn`` under ``name`` (or use as a decorator: ``@REGISTRY.register("name")``).

        ``check_supported(device)``, if given, raises ``ValueError`` when the block cannot run on ``device`` (a
        ``torch.device`` or its string). ``segment_local``: attention blocks whose cost does not grow with the packed
        row's length (see the module docstring). Registering a taken name raises ``ValueError`` unless ``replace=True``.
        """

        def add(f: FnT) -> FnT:
            if name in self._impls and not replace and self._impls[name] is not f:
                raise ValueError(f"{self.kind} block {name!r} is already registered; pass replace=True to override")
            self._impls[name] = f
            if check_supported is not None:
                self._checks[name] = check_supported
            else:
                self._checks.pop(name, None)
            if segment_local:
                self._segment_local.add(name)
            else:
                self._segment_local.discard(name)
            return f

        return add if fn is None else add(fn)

    def get(self, name: str) -> FnT:
        """The implementation registered as ``name`` (importing its kernel module on first use); ``ValueError``
        naming the available ones otherwise."""
        if name not in self._impls and name in self._lazy_modules:
            importlib.import_module(self._lazy_modules[name])
            assert name in self._impls, f"{self._lazy_modules[name]} did not register {self.kind} block {name!r}"
        try:
            return self._impls[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} block {name!r} (config field '{self.config_field}'); available: "
                f"{self.names()}. A module outside trainer.kernels must be imported to register its name."
            ) from None

    def check_supported(self, name: str, device: Any) -> None:
        """Raise ``ValueError`` if block ``name`` cannot run on ``device`` (unknown names raise as in :meth:`get`)."""
        self.get(name)
        check = self._checks.get(name)
        if check is not None:
            check(device)

    def is_segment_local(self, name: str) -> bool:
        """Whether block ``name`` was registered ``segment_local`` (unknown names raise as in :meth:`get`)."""
        self.get(name)
        return name in self._segment_local

    def __getitem__(self, name: str) -> FnT:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._impls or name in self._lazy_modules

    def names(self) -> list[str]:
        """Available names (registered, plus the kernel names imported on first use), sorted."""
        return sorted(set(self._impls) | set(self._lazy_modules))


ATTENTION_BLOCKS: BlockRegistry[Callable] = BlockRegistry(
    "attention", "attention", {"splash": "trainer.kernels.splash_attention"}
)
OUTPUT_HEADS: BlockRegistry[Callable] = BlockRegistry(
    "output head", "output_head", {"fused_pallas": "trainer.kernels.fused_head"}
)
MOE_EXPERTS: BlockRegistry[Callable] = BlockRegistry(
    "MoE experts", "moe_experts", {"gmm_pallas": "trainer.kernels.gmm"}
)


def check_blocks_supported(cfg: ModelConfig, device: Any = None) -> None:
    """Resolve every block ``cfg`` names and raise ``ValueError`` if one cannot run on ``device``.

    ``device``: where the model's parameters will live (``torch.device`` or string); ``None`` means torch's default
    device. Call before building the model, so a kernel the platform cannot honour fails before any allocation.
    """
    if device is None:
        import torch

        device = torch.get_default_device()
    ATTENTION_BLOCKS.check_supported(cfg.attention, device)
    OUTPUT_HEADS.check_supported(cfg.output_head, device)
    MOE_EXPERTS.check_supported(cfg.moe_experts, device)
