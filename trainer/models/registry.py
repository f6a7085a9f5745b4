"""Registries of swappable compute blocks, keyed by the strings a :class:`ModelConfig` names.

Three registries, one per swappable block, each mapping a name to a plain function:

- ``ATTENTION_BLOCKS[name](q, k, v, *, segment_ids, scale) -> out``: q ``[B, H, T, Dh]``, k/v ``[B, KVH, T, Dh]``
  (grouped-query: ``H % KVH == 0``, the function handles the grouping), segment_ids ``[B, T]`` or ``None``; attention
  is causal and, with segment ids, restricted to equal ids. Returns ``[B, H, T, Dh]``. A block registered with
  ``segment_local=True`` costs the sum over segments of their squared lengths, not the packed row's squared length:
  the trainer then packs rows up to the whole micro-batch token budget (no padding) unless told otherwise. A block
  registered with ``shared_prefix=True`` also takes ``prefix_ids`` ``[B, T]`` (for each token the segment id of a
  shared prompt it may attend to as well, or -1; see ``trainer.packing``): the trainer then packs a group's prompt once.
- ``OUTPUT_HEADS[name](hidden, weight, targets, *, chunk_size) -> (logprobs, entropy)``: hidden ``[..., D]``, weight
  ``[V, D]``, targets ``[...]`` int64; returns float32 ``[...]`` each (fresh tensors, not views), both
  differentiable w.r.t. hidden and weight.
- ``MOE_EXPERTS[name](x, expert_idx, expert_weight, w1, w3, w2) -> out``: x ``[N, D]``, expert_idx ``[N, K]`` int64,
  expert_weight ``[N, K]``, stacked SwiGLU weights w1/w3 ``[E, I, D]`` and w2 ``[E, D, I]``; returns ``[N, D]`` =
  sum over k of ``expert_weight[:, k] * expert_{idx[:, k]}(x)``.

A kernel module registers its implementation at import (``ATTENTION_BLOCKS.register("splash", fn)``) and a recipe
selects it by name; model code never changes. Looking up an unknown name raises ``ValueError`` listing what exists.

Every built-in block is *declared* here (:data:`ATTENTION_DECLARED`, :data:`OUTPUT_HEAD_DECLARED`,
:data:`MOE_EXPERTS_DECLARED`): its name, the module whose import registers it, and the trainer devices it runs on. The
declaration imports nothing, so configs check names and devices without torch (a recipe fails at load, not in
``build_model``); the first lookup of a name imports its module (the Pallas kernels' modules import JAX, so importing
the models never does). A name is valid when it is declared or was registered in this process before the config naming
it is validated: a recipe is validated before any user code runs, so a block a recipe can name is one declaration line.
At build time :func:`check_blocks_supported` checks the model's device against the declaration, then runs the block's
own ``check_supported(device)`` (host facts, such as whether the torch-tpu backend is present).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from trainer.models.config import ModelConfig

__all__ = [
    "ATTENTION_BLOCKS",
    "ATTENTION_DECLARED",
    "BLOCK_REGISTRIES",
    "MOE_EXPERTS",
    "MOE_EXPERTS_DECLARED",
    "OUTPUT_HEADS",
    "OUTPUT_HEAD_DECLARED",
    "PALLAS_DEVICES",
    "BlockRegistry",
    "BlockSpec",
    "check_blocks_supported",
]

FnT = TypeVar("FnT", bound=Callable)
DeviceCheck = Callable[[Any], None]

PALLAS_DEVICES: tuple[str, ...] = ("cpu", "tpu")
"""Trainer devices the Pallas kernels of :mod:`trainer.kernels` run on: 'cpu' in interpret mode (exact, slow: tests and
parity checks) and 'tpu' Mosaic-compiled through torch-tpu. There is no CUDA path."""


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """A declared block: where it is registered and where it runs (no import needed to know either)."""

    module: str
    """The module whose import registers the block under its name."""
    devices: tuple[str, ...] | None = None
    """Trainer devices (``trainer.device``) the block runs on; None: every device."""
    alternative: str | None = None
    """The block to name instead where it cannot run (set whenever ``devices`` is)."""


ATTENTION_DECLARED: Mapping[str, BlockSpec] = {
    "sdpa": BlockSpec("trainer.models.attention"),
    "eager": BlockSpec("trainer.models.attention"),
    "splash": BlockSpec("trainer.kernels.splash_attention", PALLAS_DEVICES, alternative="sdpa"),
    "varlen": BlockSpec("trainer.models.varlen_attention", ("cuda",), alternative="sdpa"),
}
OUTPUT_HEAD_DECLARED: Mapping[str, BlockSpec] = {
    "dense": BlockSpec("trainer.models.output_head"),
    "chunked": BlockSpec("trainer.models.output_head"),
    "cached": BlockSpec("trainer.models.output_head"),
    "fused_pallas": BlockSpec("trainer.kernels.fused_head", PALLAS_DEVICES, alternative="chunked"),
}
MOE_EXPERTS_DECLARED: Mapping[str, BlockSpec] = {
    "loop": BlockSpec("trainer.models.moe"),
    "grouped": BlockSpec("trainer.models.moe"),
    "gmm_pallas": BlockSpec("trainer.kernels.gmm", PALLAS_DEVICES, alternative="grouped"),
}


class BlockRegistry(Generic[FnT]):
    """A name -> implementation table for one kind of block (see the module docstring for each kind's contract).

    ``declared`` maps the names known without importing anything to their :class:`BlockSpec`; a declared block's
    module is imported when the name is first looked up.
    """

    def __init__(self, kind: str, config_field: str, declared: Mapping[str, BlockSpec] | None = None) -> None:
        self.kind = kind
        self.config_field = config_field
        self.declared: Mapping[str, BlockSpec] = dict(declared or {})
        self._impls: dict[str, FnT] = {}
        self._checks: dict[str, DeviceCheck] = {}
        self._segment_local: set[str] = set()
        self._shared_prefix: set[str] = set()

    def register(
        self,
        name: str,
        fn: FnT | None = None,
        *,
        replace: bool = False,
        check_supported: DeviceCheck | None = None,
        segment_local: bool = False,
        shared_prefix: bool = False,
    ) -> Callable[[FnT], FnT] | FnT:
        """Register ``fn`` under ``name`` (or use as a decorator: ``@REGISTRY.register("name")``).

        ``check_supported(device)``, if given, raises ``ValueError`` when the block cannot run on ``device`` (a
        ``torch.device`` or its string). ``segment_local``: attention blocks whose cost does not grow with the packed
        row's length; ``shared_prefix``: attention blocks that take ``prefix_ids`` (both in the module docstring).
        Registering a taken name raises ``ValueError`` unless ``replace=True``.
        """

        def add(f: FnT) -> FnT:
            if name in self._impls and not replace and self._impls[name] is not f:
                raise ValueError(f"{self.kind} block {name!r} is already registered; pass replace=True to override")
            self._impls[name] = f
            if check_supported is not None:
                self._checks[name] = check_supported
            else:
                self._checks.pop(name, None)
            for flag, names in ((segment_local, self._segment_local), (shared_prefix, self._shared_prefix)):
                if flag:
                    names.add(name)
                else:
                    names.discard(name)
            return f

        return add if fn is None else add(fn)

    def get(self, name: str) -> FnT:
        """The implementation registered as ``name`` (importing its declared module on first use); ``ValueError``
        naming the available ones otherwise."""
        if name not in self._impls and name in self.declared:
            module = self.declared[name].module
            importlib.import_module(module)
            assert name in self._impls, f"{module} did not register {self.kind} block {name!r}"
        try:
            return self._impls[name]
        except KeyError:
            raise ValueError(self.unknown_message(name)) from None

    def check_name(self, name: str) -> None:
        """Raise ``ValueError`` unless ``name`` is declared or registered; imports nothing."""
        if name not in self:
            raise ValueError(self.unknown_message(name))

    def unknown_message(self, name: str) -> str:
        """What to say about a name that is neither declared nor registered."""
        close = difflib.get_close_matches(name, self.names(), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return (
            f"unknown {self.kind} block {name!r} (config field '{self.config_field}'); available: {self.names()}"
            f"{hint}. A block outside this list must be declared in trainer.models.registry (or registered by code "
            "that runs before the config is validated)."
        )

    def device_problem(self, name: str, device_type: str, field: str | None = None) -> str | None:
        """Why the declaration says block ``name`` cannot run on device type ``device_type``; None if it can (or is
        not declared). ``field`` names the setting in the message (default: the config field). Imports nothing."""
        spec = self.declared.get(name)
        if spec is None or spec.devices is None or device_type in spec.devices or device_type == "meta":
            return None
        field = field or self.config_field
        devices = " or ".join(repr(d) for d in spec.devices)
        return (
            f'{field} = "{name}" has no path for device {device_type!r} (it runs on {devices}); set '
            f'{field} = "{spec.alternative}" on this platform'
        )

    def check_supported(self, name: str, device: Any) -> None:
        """Raise ``ValueError`` if block ``name`` cannot run on ``device`` (a ``torch.device`` or its string): first
        the declared devices, then the block's own ``check_supported`` hook. Unknown names raise as in :meth:`get`."""
        self.get(name)
        device_type = device.type if hasattr(device, "type") else str(device).split(":", 1)[0]
        problem = self.device_problem(name, device_type)
        if problem is not None:
            raise ValueError(problem)
        check = self._checks.get(name)
        if check is not None:
            check(device)

    def is_segment_local(self, name: str) -> bool:
        """Whether block ``name`` was registered ``segment_local`` (unknown names raise as in :meth:`get`)."""
        self.get(name)
        return name in self._segment_local

    def takes_shared_prefix(self, name: str) -> bool:
        """Whether block ``name`` was registered ``shared_prefix`` (unknown names raise as in :meth:`get`)."""
        self.get(name)
        return name in self._shared_prefix

    def __getitem__(self, name: str) -> FnT:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._impls or name in self.declared

    def names(self) -> list[str]:
        """Available names (declared, plus any registered in this process), sorted."""
        return sorted(set(self._impls) | set(self.declared))


ATTENTION_BLOCKS: BlockRegistry[Callable] = BlockRegistry("attention", "attention", ATTENTION_DECLARED)
OUTPUT_HEADS: BlockRegistry[Callable] = BlockRegistry("output head", "output_head", OUTPUT_HEAD_DECLARED)
MOE_EXPERTS: BlockRegistry[Callable] = BlockRegistry("MoE experts", "moe_experts", MOE_EXPERTS_DECLARED)
BLOCK_REGISTRIES: Mapping[str, BlockRegistry[Callable]] = {
    "attention": ATTENTION_BLOCKS,
    "output_head": OUTPUT_HEADS,
    "moe_experts": MOE_EXPERTS,
}
"""The registry of each block field of :class:`trainer.models.config.BlockChoices`."""


def check_blocks_supported(cfg: ModelConfig, device: Any = None) -> None:
    """Resolve every block ``cfg`` names and raise ``ValueError`` if one cannot run on ``device``.

    ``device``: where the model's parameters will live (``torch.device`` or string); ``None`` means torch's default
    device. Call before building the model, so a kernel the platform cannot honour fails before any allocation.
    """
    if device is None:
        import torch

        device = torch.get_default_device()
    for field, registry in BLOCK_REGISTRIES.items():
        registry.check_supported(getattr(cfg, field), device)
