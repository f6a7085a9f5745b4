"""A sharded model's initial weights, written into each rank's shards: no rank ever holds the whole model.

The trainer builds its models on the meta device, shards them (``trainer.parallelize``), allocates each rank's pieces
(``to_empty``) and then fills them from :class:`InitialWeights`:

- from a local HF checkpoint directory, each piece read as a slice of its tensor in the safetensors files
  (``trainer.models.hf_io.load_hf_checkpoint``: only those bytes are read); LoRA adapters, which no HF checkpoint
  holds, start fresh as ``LoRALinear.reset_adapter`` starts them, drawn once, so the policy and the critic's body
  start equal;
- without one (tests, random models), from the seeded initialisation of the whole model, built once on the CPU.

A rank's memory at start is then its shards plus one open file mapping, where building the whole model first took the
whole model in float32 on every rank (and a copy each for the KL reference and the critic): 32 GB a rank for an 8B
model, 120 GB for Qwen3-30B-A3B.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer.models.config import ModelConfig
from trainer.models.hf_io import canonical_name, hf_sources, load_hf_checkpoint
from trainer.models.lora import initial_adapters, is_adapter
from trainer.models.transformer import build_model
from trainer.parallelize import local_shards, piece_slices

__all__ = ["InitialWeights"]


class InitialWeights:
    """The initial value of every parameter of a ``model_cfg`` model.

    ``init_path``: a local HF checkpoint directory, or None for the seeded random initialisation. Seed torch's RNG
    first: the fresh values (every one without ``init_path``, the adapters with it) are drawn here, once. Raises
    ``ValueError`` when ``init_path`` does not hold this model (``load_hf_checkpoint``'s errors), before any rank
    allocates anything.
    """

    def __init__(self, model_cfg: ModelConfig, init_path: str | Path | None) -> None:
        self.init_path = init_path
        if init_path is None:
            model = build_model(model_cfg, device=torch.device("cpu"), dtype=torch.float32)
            self._fresh = {name: p.detach() for name, p in model.named_parameters()}
            return
        template = build_model(model_cfg, device="meta")
        base = {name: tuple(p.shape) for name, p in template.named_parameters() if not is_adapter(name)}
        hf_sources(model_cfg, Path(init_path), base)  # every rank loads it later: refuse a wrong one now
        self._fresh = initial_adapters(template)

    @torch.no_grad()
    def fill(self, model: nn.Module) -> None:
        """Write the initial values into every piece of ``model``'s parameters this rank holds: ``model`` is a
        ``model_cfg`` :class:`Transformer` (a critic's body), any sharding, any device, after ``to_empty``."""
        if self.init_path is not None:
            load_hf_checkpoint(model, self.init_path)
        for name, local, _, offsets in local_shards(model):
            fresh = self._fresh.get(canonical_name(name))
            if fresh is not None:
                local.copy_(fresh[piece_slices(offsets, tuple(local.shape))])
