"""The weight-sync sink of a vLLM engine: what the receiver hands a complete, verified version to.

``VLLMWeightSink`` implements the ``weight_sync`` sink protocol: ``manifest()`` lists the tensors of the engine's model
directory (HF-canonical names and shapes) in the dtypes the engine holds them in, not the file's (senders send each
tensor in the declared dtype: a float32 engine over a bfloat16 file takes float32), ``apply()`` checks an update
against it and swaps it into the engine at its next safe point (``EngineConfig.update_mode``: requests in flight
finish on the old version, or with "keep" go on with the new weights). Anything refused raises before the engine
changes, so the receiver stays on the old version. ``committed_version()`` is the engine's version (0 after loading).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rollout.engine.vllm_engine import VLLMEngine
from weight_sync.peft import adapter_manifest
from weight_sync.spec import TensorSpec, dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["VLLMWeightSink", "check_update"]

def check_update(specs: Mapping[str, TensorSpec], tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming every problem (at most 8) when ``tensors`` is not a subset of ``specs`` with the
    same shapes and dtypes, or is empty; whole fused groups are checked by the engine's worker."""
    problems = []
    for name, tensor in tensors.items():
        spec = specs.get(name)
        if spec is None:
            problems.append(f"{name}: not in the model's manifest")
            continue
        dtype = dtype_name(tensor.dtype)
        if tuple(tensor.shape) != spec.shape or dtype != spec.dtype:
            problems.append(f"{name}: got {tuple(tensor.shape)} {dtype}, expected {spec.shape} {spec.dtype}")
    if not tensors:
        problems.append("empty update")
    if problems:
        raise ValueError(f"weight update refused ({len(problems)} problem(s)): " + "; ".join(problems[:8]))


class VLLMWeightSink:
    """Applies verified weight versions to a :class:`VLLMEngine` (implements ``weight_sync``'s ``WeightSink``)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        lora = engine.config.lora
        self._adapter_specs = {} if lora is None else {s.name: s for s in adapter_manifest(engine.manifest, lora)}
        self._specs = {**{s.name: s for s in engine.manifest}, **self._adapter_specs}
        self._lora_alpha = 0.0 if lora is None else lora.alpha

    def lora_alpha(self) -> float:
        """The alpha the engine serves adapters with (``EngineConfig.lora``), 0.0 without LoRA."""
        return self._lora_alpha

    def manifest(self) -> list[TensorSpec]:
        """The tensors this engine accepts: its checkpoint's names and global shapes in the dtypes the engine holds
        them in (``VLLMEngine.manifest``); for an engine serving LoRA (``EngineConfig.lora``) also the adapters of that
        shape over its checkpoint (``weight_sync.peft``), in the dtype of the weight each adapts: a version is an
        adapter, with base tensors only where the base itself trained."""
        return list(self._specs.values())

    def committed_version(self) -> int:
        """The version the engine serves: 0 for the model directory it loaded, then the last one applied."""
        return self._engine.policy_version

    def apply(self, policy_version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Swap ``tensors`` in as ``policy_version`` at the engine's next safe point (blocks until it is in): in update
        mode "wait" once the requests in flight have finished, in "keep" between two steps, those requests going on
        with the new weights.

        An update may hold a subset of the manifest made of whole fused groups. Raises ``ValueError`` (engine unchanged)
        for unknown names, wrong shapes or dtypes, or a partial fused group. With LoRA the update is an adapter version
        (:meth:`VLLMEngine.load_adapter`: no drain; a subset updates the served adapter's tensors).
        """
        check_update(self._specs, tensors)
        if self._adapter_specs:
            adapter = {name: t for name, t in tensors.items() if name in self._adapter_specs}
            base = {name: t for name, t in tensors.items() if name not in self._adapter_specs}
            self._engine.load_adapter(policy_version, adapter, base=base or None)
            return
        full = len(tensors) == len(self._specs)
        self._engine.load_weights(policy_version, tensors, full=full)
