"""Registries of swappable compute blocks, keyed by the strings a :class:`ModelConfig` names.

Three registries, one per swappable block, each mapping a name to a plain function:

- ``ATTENTION_BLOCKS[name](q, k, v, *, segment_ids, scale) -> out``: q ``[B, H, T, Dh]``, k/v ``[B, KVH, T, Dh]``
  (grouped-query: ``H % KVH == 0``, the function handles the grouping), segment_ids ``[B, T]`` or ``None``; attention
  is causal and, with segment ids, restricted to equal ids. Returns ``[B, H, T, Dh]``.
- ``OUTPUT_HEADS[name](hidden, weight, targets, *, chunk_size) -> (logprobs, entropy)``: hidden ``[..., D]``, weight
  ``[V, D]``, targets ``[...]`` int64; returns float32 ``[...]`` each (fresh tensors, not views), both
  differentiable w.r.t. hidden and weight.
- ``MOE_EXPERTS[name](x, expert_idx, expert_weight, w1, w3, w2) -> out``: x ``[N, D]``, expert_idx ``[N, K]`` int64,
  expert_weight ``[N, K]``, stacked SwiGLU weights w1/w3 ``[E, I, D]`` and w2 ``[E, D, I]``; returns ``[N, D]`` =
  sum over k of ``expert_weight[:, k] * expert_{idx[:, k]}(x)``.

A kernel module registers its implementation at import (``ATTENTION_BLOCKS.register("splash", fn)``) and a recipe
selects it by name; model code never changes. Looking up an unknown name raises ``ValueError`` listing what exists.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

__all__ = ["ATTENTION_BLOCKS", "MOE_EXPERTS", "OUTPUT_HEADS", "BlockRegistry"]

FnT = TypeVar("FnT", bound=Callable)


class BlockRegistry(Generic[FnT]):
    """A name -> implementation table for one kind of block (see the module docstring for each kind's contract)."""

    def __init__(self, kind: str, config_field: str) -> None:
        self.kind = kind
        self.config_field = config_field
        self._impls: dict[str, FnT] = {}

    def register(self, name: str, fn: FnT | None = None, *, replace: bool = False) -> Callable[[FnT], FnT] | FnT:
        """Register ``fn`` under ``name`` (or use as a decorator: ``@REGISTRY.register("name")``).

        Registering a taken name raises ``ValueError`` unless ``replace=True``.
        """

        def add(f: FnT) -> FnT:
            if name in self._impls and not replace and self._impls[name] is not f:
                raise ValueError(f"{self.kind} block {name!r} is already registered; pass replace=True to override")
            self._impls[name] = f
            return f

        return add if fn is None else add(fn)

    def get(self, name: str) -> FnT:
        """The implementation registered as ``name``; ``ValueError`` naming the registered ones otherwise."""
        try:
            return self._impls[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} block {name!r} (config field '{self.config_field}'); registered: "
                f"{sorted(self._impls)}. A kernel module must be imported to register its name."
            ) from None

    def __getitem__(self, name: str) -> FnT:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._impls

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._impls)


ATTENTION_BLOCKS: BlockRegistry[Callable] = BlockRegistry("attention", "attention")
OUTPUT_HEADS: BlockRegistry[Callable] = BlockRegistry("output head", "output_head")
MOE_EXPERTS: BlockRegistry[Callable] = BlockRegistry("MoE experts", "moe_experts")
