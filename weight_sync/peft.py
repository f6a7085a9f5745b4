"""LoRA adapters in PEFT's format: the one owner of their tensor names, their ``adapter_config.json`` and the
directory layout that ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load.

An adapter of rank ``r`` on the projection whose HF weight is ``<module>.weight`` ``[out, in]`` is two tensors:
``base_model.model.<module>.lora_A.weight [r, in]`` and ``base_model.model.<module>.lora_B.weight [out, r]``; the
projection computes ``W x + (alpha / r) B A x``. The trainer pushes and exports adapters under these names, and a
receiver serving a base model derives the adapters it accepts from that model's own tensors
(:func:`adapter_manifest`), so a push of adapters for another base is refused by name or shape.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, get_args

import pydantic

from common.config import Config
from weight_sync.spec import TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "LORA_TARGETS", "AdapterSpec", "LoRATarget", "adapter_config",
    "adapter_manifest", "peft_name", "read_adapter_version", "write_peft_adapter",
]  # fmt: skip

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""A projection LoRA can adapt, named as HF modules (and PEFT's ``target_modules``) name it."""
LORA_TARGETS: tuple[LoRATarget, ...] = get_args(LoRATarget)
AdapterPart = Literal["lora_A", "lora_B"]
_PREFIX = "base_model.model."


class AdapterSpec(Config):
    """The shape of a LoRA adapter: what a trainer trains and a receiver accepts."""

    rank: Annotated[int, pydantic.Field(gt=0)] = 16
    """Rank ``r`` of each adapter (PEFT ``r``)."""
    alpha: Annotated[float, pydantic.Field(gt=0)] = 32.0
    """Scale numerator: the update is multiplied by ``alpha / rank`` (PEFT ``lora_alpha``)."""
    target_modules: tuple[LoRATarget, ...] = LORA_TARGETS
    """Which projections get adapters (HF / PEFT module names)."""

    @pydantic.field_validator("target_modules")
    @classmethod
    def _check_targets(cls, targets: tuple[LoRATarget, ...]) -> tuple[LoRATarget, ...]:
        if not targets:
            raise ValueError(f"name at least one projection to adapt, of {list(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"target_modules lists a projection twice: {list(targets)}")
        return targets

    @property
    def scaling(self) -> float:
        """The factor ``alpha / rank`` applied to ``B A x``."""
        return self.alpha / self.rank


def peft_name(hf_module: str, part: AdapterPart) -> str:
    """PEFT's name of one adapter tensor of the HF module ``hf_module`` (``model.layers.0.self_attn.q_proj``)."""
    return f"{_PREFIX}{hf_module}.{part}.weight"


def adapter_manifest(base: Iterable[TensorSpec], spec: AdapterSpec) -> list[TensorSpec]:
    """The adapter tensors ``spec`` puts on a base model whose tensors are ``base`` (its HF checkpoint manifest):
    for every 2-D ``<module>.<target>.weight``, ``lora_A [rank, in]`` and ``lora_B [out, rank]`` in its dtype.

    Stacked MoE experts (``...mlp.experts.<e>...``) get none: adapters on experts are not built. Sorted by name.
    """
    out = []
    for t in base:
        module, _, leaf = t.name.rpartition(".")
        target = module.rpartition(".")[2]
        if leaf != "weight" or len(t.shape) != 2 or target not in spec.target_modules or ".experts." in module:
            continue
        rows, cols = t.shape
        out.append(TensorSpec(peft_name(module, "lora_A"), (spec.rank, cols), t.dtype))
        out.append(TensorSpec(peft_name(module, "lora_B"), (rows, spec.rank), t.dtype))
    return sorted(out, key=lambda s: s.name)


def adapter_config(spec: AdapterSpec, base_model: str | None, dropout: float = 0.0) -> dict[str, object]:
    """The ``adapter_config.json`` of an adapter of shape ``spec`` over ``base_model`` (what PEFT and vLLM read)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": dropout, "target_modules": sorted(spec.target_modules), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base_model,
    }  # fmt: skip


def write_peft_adapter(
    out_dir: str | Path, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    spec: AdapterSpec, base_model: str | None = None, dropout: float = 0.0, policy_version: int | None = None,
) -> list[str]:  # fmt: skip
    """Write a PEFT adapter directory at ``out_dir`` (created if needed). Each file is written under a temporary name
    and renamed, so a reader never sees half a file; the weights go first, so a directory with a config is complete.
    ``policy_version`` is recorded in the weights file's metadata (atomically with them; :func:`read_adapter_version`).
    Returns the file names."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    state = {name: t.detach().contiguous().cpu() for name, t in items}
    metadata = {"format": "pt"} if policy_version is None else {"format": "pt", "policy_version": str(policy_version)}
    config = json.dumps(adapter_config(spec, base_model, dropout), indent=2, sort_keys=True) + "\n"
    for file, write in (
        (ADAPTER_WEIGHTS_FILE, lambda path: save_file(state, path, metadata=metadata)),
        (ADAPTER_CONFIG_FILE, lambda path: Path(path).write_text(config)),
    ):
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{file}.")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, out / file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return [ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE]


def read_adapter_version(directory: str | Path) -> int:
    """The policy_version recorded in ``directory``'s adapter weights (0 when there are none or none is recorded)."""
    from safetensors import safe_open

    path = Path(directory) / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as f:
        stored = (f.metadata() or {}).get("policy_version", "0")
    if not stored.isdigit():
        raise ValueError(f"{path}: policy_version {stored!r} is not an integer >= 0; fix or remove the file")
    return int(stored)
