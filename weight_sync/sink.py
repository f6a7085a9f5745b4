"""Where a receiver puts a complete, verified update: the small interface engines implement, and three plain sinks
(a state dict, an HF checkpoint directory, a PEFT adapter directory).

A sink is told nothing until an update is whole: every element covered exactly once, every shard checksum good. It
then gets `apply(policy_version, tensors)`; returning accepts the update, raising rejects it (the receiver stays on its
old version; a ValueError is reported to the sender as INVALID_ARGUMENT, anything else as INTERNAL). The tensors are
CPU views of the receiver's staging buffers, valid only during the call: copy what you keep. `apply` may block (an
engine waiting for its current generation batch to end); the sender's Commit deadline is `commit_timeout_s`. The
receiver calls `apply` exactly once per update, one update at a time, with versions that only increase, starting above
`committed_version()`: what the sink holds when the receiver starts (so a restarted server refuses older versions).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from weight_sync.peft import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    AdapterSpec,
    adapter_manifest,
    read_adapter_version,
    stored_adapter_base,
    stored_adapter_fields,
    write_peft_adapter,
)  # fmt: skip
from weight_sync.safetensors_stream import SINGLE_FILE, write_streamed
from weight_sync.spec import TensorSpec, dtype_name

__all__ = [
    "POLICY_VERSION_FILE", "PeftAdapterDirSink", "SafetensorsDirSink", "StateDictSink", "TensorSpec", "WeightSink",
    "lora_alpha_of", "read_policy_version", "spec_of", "unavailable_reason", "write_policy_version",
]

log = logging.getLogger("weight_sync.sink")
POLICY_VERSION_FILE = "policy_version.json"
"""Where a directory of weights (a sink's, an HF export's) records the policy version it holds."""


@runtime_checkable
class WeightSink(Protocol):
    """What a receiver needs from the thing that holds the weights (a state dict, a directory, a vLLM engine)."""

    def manifest(self) -> list[TensorSpec]:
        """Every tensor this sink accepts, by HF-canonical name; updates may cover any subset (whole fused groups)."""
        ...

    def apply(self, policy_version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take a complete, verified update whole, or raise to reject it."""
        ...

    def committed_version(self) -> int:
        """The policy_version the sink holds now (0 for weights loaded from a model directory); read once when the
        receiver starts, which then accepts only newer versions. A sink that persists its weights reports the
        version it persisted."""
        ...


def unavailable_reason(sink: WeightSink) -> str | None:
    """Why ``sink`` takes no update now (its engine failed midway, the server is stopping), or None. A sink says so
    with an optional ``unavailable() -> str | None`` method; its receiver then refuses Begins with UNAVAILABLE, so a
    sender does not stream a whole model only to have the Commit refused."""
    report = getattr(sink, "unavailable", None)
    return None if report is None else report()


def lora_alpha_of(sink: WeightSink) -> float:
    """The LoRA alpha ``sink`` applies pushed adapters with, or 0.0 when it takes none: what its receiver declares
    (``DescribeReply.lora_alpha``) and holds Begins of adapters to.

    A sink whose manifest has adapter tensors reports it with a ``lora_alpha() -> float`` method (optional: a sink
    without one takes adapters of any alpha, as receivers before protocol 1.5 did).
    """
    report = getattr(sink, "lora_alpha", None)
    if report is None:
        return 0.0
    alpha = report()
    if not isinstance(alpha, (int, float)) or alpha < 0:
        raise ValueError(f"{type(sink).__name__}.lora_alpha() returned {alpha!r}; expected a number >= 0")
    return float(alpha)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The TensorSpec of a full tensor ("torch.bfloat16" -> "bfloat16")."""
    return TensorSpec(name, tuple(tensor.shape), dtype_name(tensor.dtype))


class StateDictSink:
    """Copies each update into the tensors of a state dict in place (e.g. `model.state_dict()` of a local model)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.state_dict = dict(state_dict)
        self.policy_version = 0
        self._manifest = [spec_of(name, t) for name, t in self.state_dict.items()]

    def manifest(self) -> list[TensorSpec]:
        return list(self._manifest)

    def committed_version(self) -> int:
        """The last version applied (0: the state dict as given)."""
        return self.policy_version

    def apply(self, policy_version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(set(tensors) - set(self.state_dict))
        if unknown:
            raise ValueError(f"tensors not in this state dict: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.state_dict[name].copy_(tensor)
        self.policy_version = policy_version


def read_policy_version(directory: str) -> int:
    """The policy_version of an HF checkpoint directory: ``model.safetensors``' own metadata (written atomically with
    the tensors), else ``policy_version.json``, else 0 (a checkpoint no sink wrote). Raises ``ValueError`` naming the
    file when the stored value is not an integer >= 0."""
    from safetensors import safe_open

    path = Path(directory) / SafetensorsDirSink.FILE
    if path.exists():
        with safe_open(str(path), framework="pt") as f:
            stored = (f.metadata() or {}).get("policy_version")
        if stored is not None:
            return _version(stored, path)
    version_file = Path(directory) / POLICY_VERSION_FILE
    if version_file.exists():
        return _version(json.loads(version_file.read_text()).get("policy_version"), version_file)
    return 0


def write_policy_version(directory: str, policy_version: int) -> None:
    """Record ``policy_version`` as ``directory/policy_version.json`` (what :func:`read_policy_version` reads when
    ``model.safetensors`` carries none), so a receiver started on the directory starts at that version."""
    text = json.dumps({"policy_version": policy_version}) + "\n"
    (Path(directory) / POLICY_VERSION_FILE).write_text(text)


def _version(stored: object, path: Path) -> int:
    try:
        version = int(str(stored))
    except ValueError:
        version = -1
    if version < 0:
        raise ValueError(f"{path}: policy_version {stored!r} is not an integer >= 0; fix or remove it")
    return version


class SafetensorsDirSink:
    """Keeps the latest version as `model.safetensors` + `policy_version.json` in a directory (an HF checkpoint dir).

    The manifest is read from the `*.safetensors` files already in the directory, or given. Each update is merged
    into the full set and written to a temporary file that replaces the old one atomically, so a reader never sees a
    mix of versions. The file is written a tensor at a time (``weight_sync.safetensors_stream``): the pushed tensors
    straight from the receiver's buffers, the ones an update leaves as they are read from the current file, so the
    sink makes no copy of the model. A given manifest may declare another float dtype than the files hold (a served
    model kept in the dtype its server computes in): the tensors an update leaves are cast to it as they are written.
    Other `*.safetensors` files are folded into `model.safetensors` on the first
    update, and their index (`model.safetensors.index.json`) goes with them, so that loaders (vLLM's included) read
    the one file.
    """

    FILE = SINGLE_FILE
    VERSION_FILE = POLICY_VERSION_FILE

    def __init__(self, directory: str, manifest: list[TensorSpec] | None = None) -> None:
        from weight_sync.checkpoint import read_checkpoint_manifest

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files = sorted(self.directory.glob("*.safetensors"))
        if manifest is None:
            manifest = read_checkpoint_manifest(self.directory) if self._files else []
        if not manifest:
            raise ValueError(f"{directory}: no *.safetensors files to read a manifest from, and none was given")
        self._manifest = manifest

    def manifest(self) -> list[TensorSpec]:
        return list(self._manifest)

    def committed_version(self) -> int:
        """The version in the directory (:func:`read_policy_version`)."""
        return read_policy_version(str(self.directory))

    def load(self) -> dict[str, torch.Tensor]:
        """Every tensor currently in the directory."""
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for path in sorted(self.directory.glob("*.safetensors")):
            out.update(load_file(str(path)))
        return out

    def apply(self, policy_version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the directory's tensors with ``tensors`` replacing theirs into a new file, one at a time (the others
        read from the current files as they are written), then swap it in. Raises ``ValueError`` (nothing written)
        for a tensor outside the manifest, one of another shape or dtype, or one neither the update nor the
        directory has."""
        from safetensors import safe_open

        known = {spec.name for spec in self._manifest}
        unknown = sorted(set(tensors) - known)
        if unknown:
            raise ValueError(f"tensors not in this directory's manifest: {unknown[:5]}")
        plan = [(spec.name, tuple(spec.shape), getattr(torch, spec.dtype)) for spec in self._manifest]
        with contextlib.ExitStack() as files:
            current = {}
            for path in self._files:
                f = files.enter_context(safe_open(str(path), framework="pt"))
                current.update({name: f for name in f.keys()})
            absent = sorted(known - set(tensors) - set(current))
            if absent:
                raise ValueError(f"the update leaves {absent[:5]} ({len(absent)} tensors) without a value: the "
                                 "directory holds none yet, so the first update must cover every tensor")  # fmt: skip
            merged = ((name, tensors[name] if name in tensors else current[name].get_tensor(name).to(dtype))
                      for name, _, dtype in plan)  # fmt: skip
            metadata = {"format": "pt", "policy_version": str(policy_version)}
            write_streamed(self.directory, plan, merged, max_file_bytes=sys.maxsize, metadata=metadata)
        for path in self._files:  # write_streamed replaced model*.safetensors; fold in any other file
            if path.name != self.FILE:
                path.unlink(missing_ok=True)
        self._files = [self.directory / self.FILE]
        write_policy_version(str(self.directory), policy_version)


class PeftAdapterDirSink:
    """Keeps the latest LoRA adapter version as a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``, the version in the weights' metadata) that a server hot-loads: vLLM's
    ``/v1/load_lora_adapter``, ``peft.PeftModel.from_pretrained(base, directory)``.

    The manifest is the adapters ``spec`` puts on the base model in ``base_dir`` (``weight_sync.peft.adapter_manifest``
    of its safetensors headers), so pushes for another base are refused by name or shape. An update may carry a subset
    once the directory holds a complete adapter; each version replaces the files atomically (weights first).

    Adapters are declared in the base file's dtype. PEFT holds bfloat16/float16 adapters in float32
    (``autocast_adapter_dtype``), so a float32 file would keep the trainer's float32 adapters exact for it; but a push
    sends each tensor in one dtype to every receiver, and the engines beside this sink (bfloat16 engines on a bfloat16
    base, as the GPU/TPU recipes serve) declare their adapters in bfloat16. vLLM casts a loaded adapter to its model's
    dtype either way.
    """

    def __init__(self, directory: str, base_dir: str, spec: AdapterSpec) -> None:
        from weight_sync.checkpoint import read_checkpoint_manifest

        self.directory, self.base_dir, self.spec = Path(directory), str(Path(base_dir).resolve()), spec
        self._manifest = adapter_manifest(read_checkpoint_manifest(base_dir), spec)
        if not self._manifest:
            raise ValueError(f"{base_dir}: no projection named by target_modules {list(spec.target_modules)} or "
                             f"target_parameters {list(spec.target_parameters)}")  # fmt: skip
        stored = stored_adapter_fields(self.directory)
        if stored is not None:
            held = tuple(stored.values())
            wanted = (spec.rank, spec.alpha, sorted(spec.target_modules), sorted(spec.target_parameters))
            if held != wanted:
                raise ValueError(f"{self.directory / ADAPTER_CONFIG_FILE} holds an adapter of rank/alpha/targets "
                                 f"{held}, not the {wanted} asked for: serve another directory or pass the matching "
                                 "--rank/--alpha/--target_modules/--target_parameters")  # fmt: skip
        written_over = stored_adapter_base(self.directory)
        other = written_over is not None and Path(written_over).is_dir()  # a hub id names no directory to compare
        if other and Path(str(written_over)).resolve() != Path(self.base_dir):
            # A copy of the base in another place is as good: only a warning (the shapes were checked above).
            log.warning(
                "%s holds an adapter (version %d) written over %s, served here over %s: unless that is a copy of the "
                "same weights, the adapter and the versions it continues belong to another base; serve an empty "
                "directory to start over", self.directory, read_adapter_version(self.directory), written_over,
                self.base_dir,
            )  # fmt: skip

    def manifest(self) -> list[TensorSpec]:
        return list(self._manifest)

    def lora_alpha(self) -> float:
        """The alpha written into ``adapter_config.json`` (``lora_alpha``): pushes of adapters trained with another
        are refused."""
        return self.spec.alpha

    def committed_version(self) -> int:
        """The version of the adapter in the directory (0 when it holds none)."""
        return read_adapter_version(self.directory)

    def apply(self, policy_version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import load_file

        known = {s.name for s in self._manifest}
        unknown = sorted(set(tensors) - known)
        if unknown:
            raise ValueError(f"tensors not in this adapter's manifest: {unknown[:5]}")
        weights = self.directory / ADAPTER_WEIGHTS_FILE
        merged = load_file(str(weights)) if set(tensors) != known and weights.is_file() else {}
        merged.update({name: t.clone() for name, t in tensors.items()})
        missing = sorted(known - set(merged))
        if missing:
            raise ValueError(f"adapter incomplete: {len(missing)} tensor(s) missing (e.g. {missing[:3]}) and the "
                             "directory holds no earlier version to take them from; push a complete adapter first")
        write_peft_adapter(self.directory, merged, self.spec, self.base_dir, policy_version=policy_version)
