"""Shared pieces of the vLLM tests: engine environment, a tiny model, and an HF transformers reference."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

TINY_ARCH = dict(hidden_size=64, num_layers=2, num_heads=2)
"""head_dim 32: vLLM's CPU attention rejects head_dim 16."""


def make_model(out: Path, seed: int = 0, dtype: str = "float32") -> str:
    from tools.make_tiny_model import make_tiny_model

    return str(make_tiny_model(out, family="qwen3", seed=seed, dtype=dtype, **TINY_ARCH))


def tiny_rollout_config(tmp_path_factory, sampling, max_model_len: int = 512):
    """A rollout config serving a fresh tiny model: small KV cache, eager, unpinned threads (tests share cores)."""
    from rollout.config import EngineConfig, RolloutConfig

    return RolloutConfig(
        model_path=make_model(tmp_path_factory.mktemp("tiny")),
        engine=EngineConfig(max_model_len=max_model_len, max_num_seqs=16, cpu_threads_bind="nobind",
                            kv_cache_gib=0.25, enforce_eager=True),
        sampling=sampling,
    )  # fmt: skip


def hf_model(model_dir: str, state: Mapping[str, torch.Tensor] | None = None):
    """The HF transformers model of ``model_dir`` in fp32, optionally with ``state`` loaded on top."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(dict(state), strict=False)
        model.tie_weights()
    return model


@torch.no_grad()
def hf_logprobs(model, prompt: Sequence[int], completion: Sequence[int]) -> np.ndarray:
    """Teacher-forced log-probs of ``completion`` after ``prompt``."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1).numpy()


@torch.no_grad()
def hf_greedy(model, prompt: Sequence[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False, min_new_tokens=num_tokens)
    return out[0, len(prompt):].tolist()


def perturbed_state(model_dir: str, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with seeded noise added: a new 'policy version'."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(file).items():
            state[name] = t + scale * t.std().clamp_min(0.02) * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    return state


def trainer_logprobs(model_dir: str, samples: Sequence) -> list[np.ndarray]:
    """The trainer's own teacher-forced log-probs of each sample's completion (at its ``temperature``; 0 where its
    loss mask is 0), by the production packing and forward pass on the checkpoint of ``model_dir`` in float32."""
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import load_hf_checkpoint
    from trainer.models.transformer import build_model
    from trainer.packing import plan_micro_batches
    from trainer.step import forward_logprobs

    model = build_model(model_config_from_hf(model_dir), device=torch.device("cpu"), dtype=torch.float32)
    load_hf_checkpoint(model, model_dir)
    out: list[np.ndarray] = [np.zeros(0)] * len(samples)
    with torch.no_grad():
        for mb in plan_micro_batches(samples, range(len(samples)), 0, 1, 8192, row_tokens=8192):
            logprobs = forward_logprobs(model, mb)[0]
            for row, i in enumerate(mb.sample_indices):
                out[i] = logprobs[row, : len(samples[i].completion_ids)].numpy()
    return out


def as_declared(sink, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` each cast to the dtype ``sink``'s manifest declares for it, as the trainer sends a push
    (``trainer.worker.TrainerWorker.push_weights``: float32 masters go out in the receivers' dtypes)."""
    declared = {spec.name: getattr(torch, spec.dtype) for spec in sink.manifest()}
    return {name: t.to(declared[name]) for name, t in tensors.items()}


def push_through_receiver(sink, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Push ``tensors`` whole into ``sink`` through a real gRPC receiver on loopback and commit ``version``."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sender import Shard, WeightSender

    receiver = WeightReceiver(sink, WeightSyncConfig())
    receiver.start()
    try:
        with WeightSender([receiver.address], WeightSyncConfig()) as sender:
            report = sender.push(version, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in tensors.items()])
            assert not report.failed and not any(sender.commit(version).values())
    finally:
        receiver.stop()
