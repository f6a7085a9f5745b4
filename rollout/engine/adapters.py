"""The LoRA adapter versions a :class:`rollout.engine.vllm_engine.VLLMEngine` serves, in one of two ways
(``EngineConfig.lora_serving``, resolved per platform by :func:`rollout.engine.platform.lora_serving`):

- ``adapter`` (:class:`ServedAdapters`): vLLM's LoRA path. Each version is a PEFT adapter directory
  (``weight_sync.peft``) in the engine's stage directory and a ``LoRARequest`` of its own id, loaded eagerly by
  ``add_lora`` when it becomes current; a request holds the adapter it was added with, so versions never mix within a
  completion and an update needs no drain. An adapter leaves vLLM (and its directory is deleted) once it is neither
  current nor used by a request in flight.
- ``merged`` (:class:`MergedAdapters`): the engine keeps the base weights of the adapted projections (with expert
  adapters, every expert weight) and serves each version as ``W + (alpha / rank) B A`` (per expert)
  loaded through the engine's ordinary weight update (drain per
  ``update_mode``, reload, prefix-cache reset). Generation then runs at the base model's speed, which matters where
  vLLM's LoRA kernels are slow (its CPU ops gather a copy of the adapter weights per token).

Either way the wire carries the adapters only, and :class:`AdapterVersions` merges a partial update over the served
adapter and refuses an incomplete one. vLLM is called on the engine thread only.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weight_sync.peft import (
    AdapterSpec,
    expert_factors,
    expert_peft_name,
    expert_tensor,
    peft_name,
    write_peft_adapter,
)
from weight_sync.spec import TensorSpec

if TYPE_CHECKING:
    import torch
    from vllm.lora.request import LoRARequest

__all__ = ["AdapterVersions", "MergedAdapters", "ServedAdapters"]

# Projections vLLM packs into one parameter per layer for the Llama and Qwen 3 families (qkv_proj, gate_up_proj): a
# merged update must carry every member of a group it touches (the transfer backend refuses a partial group).
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class AdapterVersions:
    """The tensors of the adapter being served; ``expected`` names every tensor a complete adapter has."""

    def __init__(self, expected: set[str]) -> None:
        self.expected = expected
        self.tensors: dict[str, torch.Tensor] = {}

    def merge(self, version: int, update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The complete adapter of ``version``: ``update`` (copied) over the served adapter's tensors. Raises
        ``ValueError`` when tensors are missing and no earlier version has them."""
        merged = {**self.tensors, **{name: t.detach().to("cpu", copy=True) for name, t in update.items()}}
        missing = sorted(self.expected - merged.keys())
        if missing:
            raise ValueError(f"adapter update to version {version} refused: {len(missing)} adapter tensor(s) missing "
                             f"and no earlier version to take them from, e.g. {missing[:3]}; push a complete "
                             "adapter first")  # fmt: skip
        return merged


class ServedAdapters:
    """vLLM LoRA requests, one per version (see the module docstring)."""

    def __init__(self, engine: Any, spec: AdapterSpec, base_model: str, stage_root: str) -> None:
        """``engine``: the vLLM ``LLMEngine`` (``add_lora`` / ``remove_lora``)."""
        self._engine, self._spec, self._base_model = engine, spec, base_model
        self._dir = Path(tempfile.mkdtemp(prefix="rl_align-adapters-", dir=stage_root))
        self._ids = itertools.count(1)  # vLLM's LoRA ids must be positive
        self._current: LoRARequest | None = None
        self._users: dict[int, int] = {}
        self._paths: dict[int, Path] = {}

    def stage(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write the complete adapter of ``version`` to disk (any thread); :meth:`swap` serves it."""
        path = self._dir / f"v{version}"
        write_peft_adapter(path, tensors, self._spec, self._base_model)
        return path

    def swap(self, version: int, path: Path) -> None:
        """Make the adapter at ``path`` current (vLLM loads it now). Raises ``ValueError`` when vLLM refuses it; the
        current adapter then stays."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-v{version}", next(self._ids), str(path),
                              is_3d_lora_weight=bool(self._spec.target_parameters))  # fmt: skip
        try:
            loaded, error = self._engine.add_lora(request), None
        except Exception as e:
            loaded, error = False, e
        if not loaded:
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"adapter update to version {version} refused by vLLM: {error!r}")
        old, self._current = self._current, request
        self._users[request.lora_int_id], self._paths[request.lora_int_id] = 0, path
        if old is not None:
            self._retire_if_unused(old.lora_int_id)

    def acquire(self) -> LoRARequest | None:
        """The adapter a request added now runs on (None before the first version: the base model), counted as in
        use until :meth:`release`."""
        if self._current is not None:
            self._users[self._current.lora_int_id] += 1
        return self._current

    def release(self, request: LoRARequest | None) -> None:
        """A request that ran on ``request`` has finished (or was aborted)."""
        if request is None:
            return
        self._users[request.lora_int_id] -= 1
        self._retire_if_unused(request.lora_int_id)

    def loaded(self) -> int:
        """Adapters vLLM holds now."""
        return len(self._engine.list_loras())

    def _retire_if_unused(self, lora_id: int) -> None:
        if self._users.get(lora_id) or (self._current is not None and self._current.lora_int_id == lora_id):
            return
        self._users.pop(lora_id, None)
        self._engine.remove_lora(lora_id)
        shutil.rmtree(self._paths.pop(lora_id), ignore_errors=True)

    def close(self) -> None:
        """Delete every staged directory (the engine is shutting down)."""
        shutil.rmtree(self._dir, ignore_errors=True)


class MergedAdapters:
    """Base weights of the adapted projections (and their fused siblings), to serve adapters merged into them."""

    def __init__(self, model_path: str, base: list[TensorSpec], spec: AdapterSpec) -> None:
        """``base``: the engine's tensors as it holds them (``VLLMEngine.manifest``); the weights of ``model_path``
        are kept in those dtypes, so a merge is served at the engine's precision, not the file's."""
        import torch
        from safetensors import safe_open

        self._spec = spec
        targets = set(spec.target_modules)
        loaded = targets | {m for group in _FUSED if targets & set(group) for m in group}
        # Expert adapters: every expert weight of the model, since an engine reloads an MoE layer whole
        # (``rollout.engine.transfer.check_whole_expert_layers``) and every layer has them.
        wanted = {
            t.name for t in base
            if (expert := expert_tensor(t.name)) is not None and spec.target_parameters
            or expert is None and len(t.shape) == 2 and t.name.rsplit(".", 2)[-2] in loaded
        }  # fmt: skip
        dtypes = {t.name: getattr(torch, t.dtype) for t in base}
        self._base: dict[str, torch.Tensor] = {}
        for file in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in wanted & set(f.keys()):
                    self._base[name] = f.get_tensor(name).to(dtypes[name])

    def weights(
        self, adapter: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The model tensors (HF names) of ``adapter`` merged into the base updated by ``base``: ``W + scaling * B @ A``
        for each adapted projection (in float32, cast to the engine's dtype), the base weight for each fused sibling
        without one, and every other tensor of ``base`` as it is. Nothing is kept: :meth:`commit_base` does."""
        weights = {**self._base, **{n: t for n, t in (base or {}).items() if n in self._base}}
        out = dict(base or {})
        for name, w in weights.items():
            factors = self._factors(name, w, adapter)
            if factors is None:
                out[name] = w
            else:
                a, b = factors
                out[name] = (w.float() + self._spec.scaling * (b.float() @ a.float())).to(w.dtype)
        return out

    def _factors(
        self, name: str, weight: torch.Tensor, adapter: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(A, B)`` of the update ``scaling * B A`` of base tensor ``name``, or None when nothing adapts it. An
        expert's are its slices of the layer's stacked expert adapter (gate: the first rows of the gate/up ``B_e``,
        up: the rest)."""
        expert = expert_tensor(name)
        if expert is None:
            module = name.removesuffix(".weight")
            a, b = adapter.get(peft_name(module, "lora_A")), adapter.get(peft_name(module, "lora_B"))
            return None if a is None or b is None else (a, b)
        a, b = (adapter.get(expert_peft_name(expert.experts, expert.target, part, self._spec))
                for part in ("lora_A", "lora_B"))  # fmt: skip
        if a is None or b is None:
            return None
        a_e, b_e = expert_factors(a, b, a.shape[0] // self._spec.rank)
        rows = {"gate": slice(None, weight.shape[0]), "up": slice(weight.shape[0], None), "down": slice(None)}
        return a_e[expert.expert], b_e[expert.expert][rows[expert.proj]]

    def commit_base(self, base: Mapping[str, torch.Tensor] | None) -> None:
        """Keep (copies of) the base tensors of ``base`` that adapters are merged into, once served."""
        for name, t in (base or {}).items():
            if name in self._base:
                self._base[name] = t.detach().to("cpu", copy=True)
