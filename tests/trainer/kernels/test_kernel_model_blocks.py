"""The Pallas kernels as model blocks: registered by name without importing JAX up front, refused at build time on a
device they cannot run on, stock checkpoint layout, and a whole Qwen 3 MoE with all three kernels on vs all off
(fp32: token log-probs and entropy within 1e-4, every parameter gradient within atol 2e-5 + rtol 1e-4), and the
kernels under activation checkpointing (the same gradients as without it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.trainer.models.tiny_hf import save_hf_model
from trainer.kernels import gmm
from trainer.models.config import ModelConfig, MoEConfig
from trainer.models.hf_config import model_config_from_hf
from trainer.models.hf_io import hf_state_dict, load_hf_checkpoint
from trainer.models.moe import loop_experts, route_tokens
from trainer.models.registry import check_blocks_supported
from trainer.models.transformer import build_model

KERNELS = {"attention": "splash", "output_head": "fused_pallas", "moe_experts": "gmm_pallas"}
TORCH_BLOCKS = {"attention": "sdpa", "output_head": "chunked", "moe_experts": "grouped"}
GRAD_ATOL, GRAD_RTOL = 2e-5, 1e-4


def _tiny_moe(**blocks: str) -> ModelConfig:
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=32)
    return ModelConfig(
        family="qwen3_moe", vocab_size=160, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        ffn_hidden_dim=64, qk_norm=True, moe=moe, max_seq_len=64, **blocks,
    )  # fmt: skip


def test_models_import_no_jax_until_a_kernel_is_named() -> None:
    script = """
import sys
import trainer.models.config
assert "torch" not in sys.modules, "trainer.models.config must stay torch-free"
from trainer.models.config import ModelConfig
from trainer.models.registry import ATTENTION_BLOCKS
from trainer.models.transformer import build_model
build_model(ModelConfig(family="llama3", vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=8, ffn_hidden_dim=32))
assert "jax" not in sys.modules, "a model with torch blocks imported JAX"
assert "splash" in ATTENTION_BLOCKS.names()
ATTENTION_BLOCKS.get("splash")
assert "jax" in sys.modules and "trainer.kernels.splash_attention" in sys.modules
assert "trainer.kernels.gmm" not in sys.modules, "only the named kernel's module is imported"
"""
    repo = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("field", sorted(KERNELS))
@pytest.mark.parametrize("device", ["cuda", "tpu"])
def test_unsupported_device_is_refused_naming_flag_and_alternative(field: str, device: str) -> None:
    cfg = _tiny_moe(**{field: KERNELS[field]})
    check_blocks_supported(cfg, "cpu")
    check_blocks_supported(cfg, torch.device("meta"))
    expected = rf'{field} = "{KERNELS[field]}".*{device}.*(?i:set) {field} = "{TORCH_BLOCKS[field]}"'
    with pytest.raises(ValueError, match=expected):
        check_blocks_supported(cfg, device)
    check_blocks_supported(_tiny_moe(), device)  # the torch blocks run anywhere


def test_build_model_refuses_a_kernel_the_device_cannot_run() -> None:
    with pytest.raises(ValueError, match=r'moe_experts = "gmm_pallas".*\'cuda\'.*moe_experts = "grouped"'):
        build_model(_tiny_moe(moe_experts="gmm_pallas"), device="cuda")


def test_gmm_experts_match_loop_with_an_expert_left_empty() -> None:
    gen = torch.Generator().manual_seed(0)
    # The whole-model test's MoE shapes (48 tokens, dim 64, 4 experts of width 32, top-2): jit caches are shared.
    x = torch.randn(48, 64, generator=gen, requires_grad=True)
    logits = torch.randn(48, 4, generator=gen)
    logits[:, 3] = -1e4  # expert 3 gets no token
    idx, weight, _ = route_tokens(logits, 2, norm_topk_prob=True)
    weight.requires_grad_()
    ws = [(0.2 * torch.randn(4, *shape, generator=gen)).requires_grad_() for shape in ((32, 64), (32, 64), (64, 32))]
    outs = [fn(x, idx, weight, *ws) for fn in (gmm.gmm_experts, loop_experts)]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)
    cotangent = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(out, [x, weight, *ws], cotangent) for out in outs]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert torch.count_nonzero(grads[0][2][3]) == 0


def test_kernel_model_loads_and_saves_the_stock_hf_checkpoint(tmp_path: Path) -> None:
    save_hf_model("qwen3_moe", tmp_path)
    stock = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            stock.update({name: f.get_tensor(name) for name in f.keys()})
    models = {}
    for name, blocks in (("torch", TORCH_BLOCKS), ("kernels", KERNELS)):
        model = build_model(model_config_from_hf(str(tmp_path), **blocks), dtype=torch.float32)
        assert load_hf_checkpoint(model, str(tmp_path)) == stock.keys()
        models[name] = model.eval()
    torch_sd, kernel_sd = models["torch"].state_dict(), models["kernels"].state_dict()
    assert list(kernel_sd) == list(torch_sd)
    assert all(kernel_sd[k].shape == v.shape and torch.equal(kernel_sd[k], v) for k, v in torch_sd.items())
    # Numerics of the kernel blocks are the whole-model test's job; here: same tensors in, same tensors out.
    saved = dict(hf_state_dict(models["kernels"]))
    assert saved.keys() == stock.keys() and all(torch.equal(t, stock[k]) for k, t in saved.items())


def _logprobs_and_grads(model) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(token log-probs, entropy, every parameter gradient) of an RL-shaped loss over two packed rows."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 160, (2, 24), generator=gen)
    targets = tokens.roll(-1, dims=1)
    segment_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 7 + [1] * 9 + [2] * 8])
    advantages = torch.randn(2, 24, generator=gen)
    logprobs, entropy = model.token_logprobs(model(tokens, segment_ids=segment_ids), targets)
    loss = -(advantages * logprobs).mean() - 0.01 * entropy.mean() + 0.01 * model.moe_aux_loss()
    loss.backward()
    return logprobs.detach(), entropy.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_qwen3_moe_with_all_kernels_matches_torch_blocks() -> None:
    torch.manual_seed(0)
    reference = build_model(_tiny_moe(**TORCH_BLOCKS), dtype=torch.float32)
    kernels = build_model(_tiny_moe(**KERNELS), dtype=torch.float32)
    kernels.load_state_dict(reference.state_dict())
    (ref_lp, ref_ent, ref_grads), (lp, ent, grads) = map(_logprobs_and_grads, (reference, kernels))
    assert lp.shape == ent.shape == (2, 24) and lp.dtype == ent.dtype == torch.float32
    assert not lp._is_view() and not ent._is_view()  # FSDP root methods must not return views
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)
    assert ref_grads.keys() == grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad.abs().max() > 0, f"{name}: no gradient reached it (the test would prove nothing)"
        torch.testing.assert_close(
            grads[name], ref_grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_kernel_blocks_under_activation_checkpointing_give_the_same_gradients() -> None:
    """The Pallas kernels run again in backward's recompute: the same log-probs and gradients as without it."""
    torch.manual_seed(0)
    plain = build_model(_tiny_moe(**KERNELS), dtype=torch.float32)
    checkpointed = build_model(_tiny_moe(**KERNELS), dtype=torch.float32)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.checkpoint_blocks(range(len(checkpointed.layers)))
    (lp, ent, grads), (lp_ac, ent_ac, grads_ac) = map(_logprobs_and_grads, (plain, checkpointed))
    torch.testing.assert_close(lp_ac, lp, rtol=1e-6, atol=0)
    torch.testing.assert_close(ent_ac, ent, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-6, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
