"""LoRA adapters in PEFT's format: the one owner of their tensor names, their ``adapter_config.json`` and the
directory layout that ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load.

An adapter of rank ``r`` on the projection whose HF weight is ``<module>.weight`` ``[out, in]`` is two tensors:
``base_model.model.<module>.lora_A.weight [r, in]`` and ``base_model.model.<module>.lora_B.weight [out, r]``; the
projection computes ``W x + (alpha / r) B A x``. The trainer pushes and exports adapters under these names, and a
receiver serving a base model derives the adapters it accepts from that model's own tensors
(:func:`adapter_manifest`), so a push of adapters for another base is refused by name or shape.

Mixture-of-experts layers are adapted per expert, as PEFT's ``target_parameters`` adapts the stacked expert weights
of transformers' Qwen3-MoE (``mlp.experts.gate_up_proj [E, 2I, D]``, ``mlp.experts.down_proj [E, D, I]``): one
adapter per expert and weight, ``W_e + (alpha / r) B_e A_e``, stored as two tensors per layer and weight,
``lora_A [E r, in]`` (expert-major rows) and ``lora_B [out, r E]`` (column ``j E + e`` is expert ``e``'s ``j``-th),
under the name of the experts module (:func:`expert_peft_name`). A gate/up adapter is one adapter of the fused
projection: its ``A_e`` is shared by gate and up, its ``B_e`` rows ``[:I]`` are the gate's, ``[I:]`` the up's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NamedTuple, get_args

import pydantic

from common.config import Config
from weight_sync.spec import TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "EXPERT_TARGETS", "LORA_TARGETS", "AdapterSpec", "ExpertTarget",
    "ExpertTensor", "expert_tensor",
    "LoRATarget", "adapter_config", "adapter_manifest", "expert_factors", "expert_peft_name", "expert_target_dims",
    "holds_base", "is_peft_name", "peft_name",
    "read_adapter_version", "stored_adapter_base", "stored_adapter_fields", "write_peft_adapter",
]  # fmt: skip

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""A projection LoRA can adapt, named as HF modules (and PEFT's ``target_modules``) name it."""
LORA_TARGETS: tuple[LoRATarget, ...] = get_args(LoRATarget)
ExpertTarget = Literal["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""A stacked MoE expert weight LoRA can adapt per expert, named as PEFT's ``target_parameters`` names it."""
EXPERT_TARGETS: tuple[ExpertTarget, ...] = get_args(ExpertTarget)
AdapterPart = Literal["lora_A", "lora_B"]
_PREFIX = "base_model.model."
# A checkpoint's tensors of one expert (``model.layers.3.mlp.experts.7.gate_proj.weight``): HF keeps experts apart on
# disk, and vLLM loads them so.
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class AdapterSpec(Config):
    """The shape of a LoRA adapter: what a trainer trains and a receiver accepts."""

    KEY_ALIASES: ClassVar[dict[str, str]] = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}
    """PEFT's names of these fields, which a recipe's unknown-key error translates (``common.config``)."""

    rank: Annotated[int, pydantic.Field(gt=0)] = 16
    """Rank ``r`` of each adapter (PEFT ``r``)."""
    alpha: Annotated[float, pydantic.Field(gt=0)] = 32.0
    """Scale numerator: the update is multiplied by ``alpha / rank`` (PEFT ``lora_alpha``)."""
    target_modules: tuple[LoRATarget, ...] = LORA_TARGETS
    """Which projections get adapters (HF / PEFT module names)."""
    target_parameters: tuple[ExpertTarget, ...] = ()
    """Which stacked MoE expert weights get an adapter per expert (PEFT ``target_parameters``; MoE models only)."""

    @pydantic.field_validator("target_modules", "target_parameters")
    @classmethod
    def _check_targets(cls, targets: tuple[str, ...], info: pydantic.ValidationInfo) -> tuple[str, ...]:
        if len(set(targets)) != len(targets):
            raise ValueError(f"{info.field_name} lists a target twice: {list(targets)}")
        return targets

    @pydantic.model_validator(mode="after")
    def _check_some_target(self) -> AdapterSpec:
        if not self.target_modules and not self.target_parameters:
            raise ValueError(f"name at least one projection to adapt: target_modules of {list(LORA_TARGETS)} or "
                             f"(MoE models) target_parameters of {list(EXPERT_TARGETS)}")  # fmt: skip
        return self

    @property
    def scaling(self) -> float:
        """The factor ``alpha / rank`` applied to ``B A x``."""
        return self.alpha / self.rank


def peft_name(hf_module: str, part: AdapterPart) -> str:
    """PEFT's name of one adapter tensor of the HF module ``hf_module`` (``model.layers.0.self_attn.q_proj``)."""
    return f"{_PREFIX}{hf_module}.{part}.weight"


def is_peft_name(name: str) -> bool:
    """Whether ``name`` is an adapter tensor's PEFT name (:func:`peft_name`, :func:`expert_peft_name`)."""
    return name.startswith(_PREFIX) and name.endswith((".lora_A.weight", ".lora_B.weight"))


def holds_base(names: Iterable[str]) -> bool:
    """Whether a receiver whose manifest has the tensors ``names`` holds a base model (a server that merges or serves
    adapters over it), not adapters alone (an adapter sink)."""
    return any(not is_peft_name(name) for name in names)


def expert_peft_name(experts_module: str, target: ExpertTarget, part: AdapterPart, spec: AdapterSpec) -> str:
    """PEFT's name of one expert adapter tensor of the HF experts module ``experts_module``
    (``model.layers.0.mlp.experts``). PEFT wraps the module once per targeted weight, gate/up innermost, so with both
    weights targeted the gate/up adapter is ``<experts_module>.base_layer.lora_A.weight``."""
    inner = target == "mlp.experts.gate_up_proj" and "mlp.experts.down_proj" in spec.target_parameters
    return f"{_PREFIX}{experts_module}{'.base_layer' if inner else ''}.{part}.weight"


class ExpertTensor(NamedTuple):
    """Where one expert's weight sits: ``model.layers.3.mlp.experts.7.up_proj.weight`` -> experts module
    ``model.layers.3.mlp.experts``, expert 7, projection ``up``; ``target`` is the expert weight PEFT adapts it in."""

    experts: str
    expert: int
    proj: Literal["gate", "up", "down"]

    @property
    def target(self) -> ExpertTarget:
        return "mlp.experts.down_proj" if self.proj == "down" else "mlp.experts.gate_up_proj"


def expert_tensor(name: str) -> ExpertTensor | None:
    """The expert weight an HF checkpoint tensor name is, or None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    return None if match is None else ExpertTensor(match["experts"], int(match["expert"]), match["proj"])  # type: ignore[arg-type]


def expert_target_dims(target: ExpertTarget, dim: int, width: int) -> tuple[int, int]:
    """``(in, out)`` of one expert's ``target`` weight in a layer of hidden size ``dim`` and expert width ``width``:
    the fused gate/up projection maps ``dim -> 2 width``, the down projection ``width -> dim``."""
    return (dim, 2 * width) if target == "mlp.experts.gate_up_proj" else (width, dim)


def expert_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert views ``A_e [E, r, in]`` and ``B_e [E, out, r]`` of a stacked expert adapter in PEFT's layout
    (``lora_A [E r, in]``, ``lora_B [out, r E]``); the update of expert ``e`` is ``scaling * B_e[e] @ A_e[e]``."""
    a = lora_a.view(num_experts, -1, lora_a.shape[-1])
    b = lora_b.view(lora_b.shape[0], -1, num_experts).permute(2, 0, 1)
    return a, b


def adapter_manifest(base: Iterable[TensorSpec], spec: AdapterSpec) -> list[TensorSpec]:
    """The adapter tensors ``spec`` puts on a base model whose tensors are ``base`` (its HF checkpoint manifest, in the
    dtypes the receiver holds them in: an engine's own, not its file's), each in the dtype of the weight it adapts:
    for every 2-D ``<module>.<target>.weight`` outside the experts, ``lora_A [rank, in]`` and
    ``lora_B [out, rank]``; for every MoE layer's ``E`` experts of width ``I`` on ``D``, with ``target_parameters``,
    the gate/up adapter ``lora_A [E rank, D]``, ``lora_B [2I, rank E]`` and the down adapter ``lora_A [E rank, I]``,
    ``lora_B [D, rank E]``. Sorted by name."""
    out = []
    experts: dict[str, list[TensorSpec]] = {}
    for t in base:
        if (where := expert_tensor(t.name)) is not None:
            experts.setdefault(where.experts, []).append(t)
            continue
        module, _, leaf = t.name.rpartition(".")
        target = module.rpartition(".")[2]
        if leaf != "weight" or len(t.shape) != 2 or target not in spec.target_modules:
            continue
        rows, cols = t.shape
        out.append(TensorSpec(peft_name(module, "lora_A"), (spec.rank, cols), t.dtype))
        out.append(TensorSpec(peft_name(module, "lora_B"), (rows, spec.rank), t.dtype))
    for module, tensors in experts.items() if spec.target_parameters else ():
        down = [t for t in tensors if t.name.endswith(".down_proj.weight")]
        (dim, width), n = down[0].shape, len(down) * spec.rank
        for target in spec.target_parameters:
            fan_in, fan_out = expert_target_dims(target, dim, width)
            out.append(TensorSpec(expert_peft_name(module, target, "lora_A", spec), (n, fan_in), down[0].dtype))
            out.append(TensorSpec(expert_peft_name(module, target, "lora_B", spec), (fan_out, n), down[0].dtype))
    return sorted(out, key=lambda s: s.name)


def adapter_config(spec: AdapterSpec, base_model: str | None, dropout: float = 0.0) -> dict[str, object]:
    """The ``adapter_config.json`` of an adapter of shape ``spec`` over ``base_model`` (what PEFT and vLLM read)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": dropout, "target_modules": sorted(spec.target_modules),
        "target_parameters": [t for t in EXPERT_TARGETS if t in spec.target_parameters] or None, "bias": "none",
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
        tmp = str(out / f".{file}.{secrets.token_hex(6)}.tmp")
        try:
            write(tmp)
            # safetensors writes its files for the owner alone (0600): a server of another user must read these.
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, out / file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return [ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE]


def _umask() -> int:
    """This process's file-creation mask (read, not set: setting it to read it races other threads' file creation)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def stored_adapter_fields(directory: str | Path) -> dict[str, Any] | None:
    """The :class:`AdapterSpec` fields (rank, alpha, targets) of the adapter whose ``adapter_config.json`` is in
    ``directory``, or None when there is none."""
    path = Path(directory) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    return {"rank": stored.get("r"), "alpha": stored.get("lora_alpha"),
            "target_modules": sorted(stored.get("target_modules") or []),
            "target_parameters": sorted(stored.get("target_parameters") or [])}  # fmt: skip


def stored_adapter_base(directory: str | Path) -> str | None:
    """The base model the adapter in ``directory`` was written over (``adapter_config.json``'s
    ``base_model_name_or_path``), or None when there is no adapter or it names none."""
    path = Path(directory) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        return None
    base = json.loads(path.read_text()).get("base_model_name_or_path")
    return base if isinstance(base, str) and base else None


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
