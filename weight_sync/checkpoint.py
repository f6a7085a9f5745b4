"""Read an HF checkpoint directory (`*.safetensors`): its manifest from the file headers, or its tensors as
whole-tensor shards for `WeightSender.push`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from weight_sync.chunking import Shard
from weight_sync.safetensors_stream import DTYPE_CODES
from weight_sync.spec import TensorSpec

__all__ = ["checkpoint_shards", "read_checkpoint_manifest"]

_SAFETENSORS_DTYPES = {code: name for name, code in DTYPE_CODES.items()}


def read_checkpoint_manifest(directory: str | Path) -> list[TensorSpec]:
    """Every tensor in the ``*.safetensors`` files of ``directory`` (headers only: nothing is loaded), sorted by name.
    Raises ``ValueError`` when there are none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files; the model directory must hold safetensors")
    specs = []
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                specs.append(TensorSpec(name, tuple(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]]))
    return sorted(specs, key=lambda s: s.name)


def checkpoint_shards(directory: str) -> Iterator[Shard]:
    """Every tensor of every `*.safetensors` file in `directory`, as a shard covering the whole tensor."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (expected an HF checkpoint directory)")
    for path in files:
        for name, tensor in load_file(str(path)).items():
            yield Shard(name, tensor, tuple(tensor.shape), (0,) * tensor.dim())
