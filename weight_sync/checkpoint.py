"""Read an HF checkpoint directory (`*.safetensors`) as whole-tensor shards for `WeightSender.push`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from weight_sync.sender import Shard

__all__ = ["checkpoint_shards"]


def checkpoint_shards(directory: str) -> Iterator[Shard]:
    """Every tensor of every `*.safetensors` file in `directory`, as a shard covering the whole tensor."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (expected an HF checkpoint directory)")
    for path in files:
        for name, tensor in load_file(str(path)).items():
            yield Shard(name, tensor, tuple(tensor.shape), (0,) * tensor.dim())
