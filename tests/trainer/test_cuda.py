"""The trainer's CUDA paths (marked ``gpu``; skipped without a CUDA device): per-segment SDPA and the ``varlen`` Flash
Attention block against the masked reference, MoE grouped experts (``F.grouped_mm`` in bf16) against the loop, one
GRPO / PPO step on the GPU against the same step on the CPU, and a bf16 step with ``varlen`` against ``sdpa``."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from trainer_batches import random_batch, random_samples

from rollout.types import RolloutBatch
from trainer.config import TrainerConfig
from trainer.models.attention import masked_sdpa_attention, sdpa_attention
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig, PPOConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DENSE = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, tie_embeddings=True, output_chunk_size=16,
)  # fmt: skip
MOE = ModelConfig(
    **{**DENSE.model_dump(), "family": "qwen3_moe", "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_dim": 16}}
)


@pytest.fixture(scope="module")
def cuda_group() -> Iterator[None]:
    """A one-rank group with gloo for CPU tensors and NCCL for CUDA ones; TF32 off so CPU and GPU agree closely."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_per_segment_sdpa_matches_the_masked_reference(dtype: torch.dtype, tol: float) -> None:
    lengths = [5, 37, 1, 90, 17]
    segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].cuda()
    gen, total = torch.Generator(device="cuda").manual_seed(0), sum(lengths)
    q, k, v = (
        torch.randn(1, h, total, 64, device="cuda", generator=gen, dtype=dtype).requires_grad_() for h in (8, 2, 2)
    )
    upstream = torch.randn(1, 8, total, 64, device="cuda", generator=gen, dtype=dtype)
    results = []
    for kernel in (sdpa_attention, masked_sdpa_attention):
        out = kernel(q, k, v, segment_ids=segment_ids, scale=64**-0.5)
        results.append((out, *torch.autograd.grad(out, (q, k, v), upstream)))
    for got, want in zip(*results, strict=True):
        assert (got.float() - want.float()).abs().max().item() < tol


@pytest.mark.parametrize("shared_prompts", [False, True])
def test_varlen_flash_attention_matches_the_masked_reference(shared_prompts: bool) -> None:
    """Two packed rows (segments of 1-90 tokens, a padding tail); with shared prompts, completions read their prompt's
    keys first (one prompt shared by three segments, another by one, the rest unshared). bf16, GQA 8/2, values and
    q/k/v gradients."""
    from trainer.models.varlen_attention import varlen_attention

    rows = [[(20, -1), (7, 0), (33, 0), (1, 0), (12, -1), (40, 4), (14, -1)], [(90, -1), (5, -1), (28, 1), (4, -1)]]
    segment_ids = torch.tensor([[s for s, (n, _) in enumerate(row) for _ in range(n)] for row in rows]).cuda()
    prefix_ids = torch.tensor([[p for n, p in row for _ in range(n)] for row in rows]).cuda()
    gen, total = torch.Generator(device="cuda").manual_seed(0), segment_ids.shape[1]
    q, k, v = (
        torch.randn(2, h, total, 128, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        for h in (8, 2, 2)
    )
    upstream = torch.randn(2, 8, total, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    shared = {"prefix_ids": prefix_ids} if shared_prompts else {}
    results = []
    for kernel in (varlen_attention, masked_sdpa_attention):
        out = kernel(q, k, v, segment_ids=segment_ids, scale=128**-0.5, **shared)
        results.append((out, *torch.autograd.grad(out, (q, k, v), upstream)))
    for got, want in zip(*results, strict=True):
        assert (got.float() - want.float()).abs().max().item() < 5e-2 * max(1.0, want.float().abs().max().item())


def test_grouped_experts_match_the_loop_in_bf16() -> None:
    from trainer.models.moe import grouped_experts, loop_experts

    gen = torch.Generator(device="cuda").manual_seed(1)
    n, d, e, hidden, k = 96, 64, 8, 32, 2

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.2).bfloat16().requires_grad_()

    x, w1, w3, w2 = rand(n, d), rand(e, hidden, d), rand(e, hidden, d), rand(e, d, hidden)
    expert_idx = torch.randint(0, e, (n, k), device="cuda", generator=gen)
    expert_weight = torch.rand(n, k, device="cuda", generator=gen).bfloat16()
    upstream = torch.randn(n, d, device="cuda", generator=gen).bfloat16()
    results = []
    for experts in (grouped_experts, loop_experts):
        out = experts(x, expert_idx, expert_weight, w1, w3, w2)
        results.append((out, *torch.autograd.grad(out, (x, w1, w3, w2), upstream)))
    for got, want in zip(*results, strict=True):
        assert (got.float() - want.float()).abs().max().item() < 2e-2 * max(1.0, want.float().abs().max().item())


@pytest.mark.parametrize(
    "model_cfg,algo", [(DENSE, GRPOConfig(group_size=4)), (MOE, GRPOConfig(group_size=4)), (DENSE, PPOConfig())]
)
def test_one_step_on_the_gpu_equals_the_cpu_step(cuda_group, model_cfg: ModelConfig, algo) -> None:
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    runs = {}
    for device in ("cpu", "cuda"):
        cfg = TrainerConfig(optimizer={"lr": 1e-3}, micro_batch_tokens=64)
        state = build_train_state(cfg, model_cfg, algo, torch.device(device), build_mesh(cfg, device))
        metrics = rl_step(state, random_batch(3))
        runs[device] = (metrics, {n: p.detach().float().cpu() for n, p in state.policy.named_parameters()})
    (cpu_metrics, cpu_params), (gpu_metrics, gpu_params) = runs["cpu"], runs["cuda"]
    assert gpu_metrics["loss"] == pytest.approx(cpu_metrics["loss"], rel=1e-3, abs=1e-5)
    assert gpu_metrics["grad_norm"] == pytest.approx(cpu_metrics["grad_norm"], rel=1e-3)
    for name, p in cpu_params.items():
        assert (gpu_params[name] - p).abs().max().item() < 1e-4, name


def test_a_bf16_step_with_varlen_attention_equals_the_sdpa_step(cuda_group) -> None:
    """GRPO on shared prompts (a group's prompt packed once), bf16 compute, fp32 master weights: the two attention
    blocks give the same loss, gradient norm and every gradient to bf16 accuracy (gradients, not updated weights:
    AdamW's first step moves each weight by about +-lr whatever the gradient's size)."""
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    batch = RolloutBatch(random_samples(5, num_groups=4, group_size=4, prompt_len=(5, 40), completion_len=(1, 60),
                                       shared_prompts=True))  # fmt: skip
    runs = {}
    for attention in ("sdpa", "varlen"):
        torch.manual_seed(0)
        model_cfg = ModelConfig(**{**DENSE.model_dump(), "attention": attention, "head_dim": 64})
        cfg = TrainerConfig(device="cuda", optimizer={"lr": 1e-3}, micro_batch_tokens=256,
                            mixed_precision={"param_dtype": "bfloat16"})  # fmt: skip
        cfg.check_model(model_cfg)
        state = build_train_state(cfg, model_cfg, GRPOConfig(group_size=4), torch.device("cuda"),
                                  build_mesh(cfg, "cuda"))  # fmt: skip
        grads: dict[str, torch.Tensor] = {}

        def keep_grads(*_: object, state=state, grads: dict[str, torch.Tensor] = grads) -> None:
            for n, p in state.policy.named_parameters():
                grads[n] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float().cpu()

        state.optimizer.register_step_pre_hook(keep_grads)
        runs[attention] = (rl_step(state, batch), grads)
    (sdpa_metrics, sdpa_grads), (varlen_metrics, varlen_grads) = runs["sdpa"], runs["varlen"]
    assert varlen_metrics["loss"] == pytest.approx(sdpa_metrics["loss"], rel=2e-2, abs=1e-3)
    assert varlen_metrics["grad_norm"] == pytest.approx(sdpa_metrics["grad_norm"], rel=2e-2)
    assert sdpa_grads.keys() == varlen_grads.keys() and sdpa_grads
    for name, g in sdpa_grads.items():
        assert (varlen_grads[name] - g).abs().max().item() <= 5e-2 * g.abs().max().item() + 1e-6, name
