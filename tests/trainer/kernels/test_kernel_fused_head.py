"""Fused output head: parity with the full-logits torch reference (fp32: atol 2e-5, rtol 1e-5), opcheck, TPU lowering.

The op-level tests share one shape (N=70, D=64, V=1000); the kernel-level test uses small tiles so that several token
and vocabulary blocks (with a ragged last vocabulary block) are exercised.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from trainer.kernels.fused_head import fused_head_logprobs
from trainer.kernels.fused_head_kernel import HeadBlockSizes, fused_head_jax
from trainer.kernels.head_reference import head_logprobs_reference

ATOL, RTOL = 2e-5, 1e-5
NUM_TOKENS, DIM, VOCAB = 70, 64, 1000


def _inputs(num_tokens: int = NUM_TOKENS, dim: int = DIM, vocab: int = VOCAB, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=gen, requires_grad=True)
    weight = (0.2 * torch.randn(vocab, dim, generator=gen)).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    return hidden, weight, targets


def _loss(logprobs: torch.Tensor, entropy: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor) -> torch.Tensor:
    return (logprobs * g_lp).sum() + (entropy * g_ent).sum()


def test_forward_and_backward_match_reference() -> None:
    hidden, weight, targets = _inputs()
    g_lp, g_ent = torch.randn(NUM_TOKENS), torch.randn(NUM_TOKENS)
    logprobs, entropy = fused_head_logprobs(hidden, weight, targets)
    grads = torch.autograd.grad(_loss(logprobs, entropy, g_lp, g_ent), (hidden, weight))
    ref_lp, ref_ent = head_logprobs_reference(hidden, weight, targets)
    ref_grads = torch.autograd.grad(_loss(ref_lp, ref_ent, g_lp, g_ent), (hidden, weight))
    assert logprobs.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logprobs, ref_lp, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(entropy, ref_ent, atol=ATOL, rtol=RTOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_logsumexp_output_and_its_gradient() -> None:
    hidden, weight, targets = _inputs()
    *_, lse = torch.ops.rl_align.fused_head_logprobs(hidden, weight, targets.to(torch.int32))
    ref = torch.logsumexp(hidden @ weight.T, dim=-1)
    torch.testing.assert_close(lse, ref, atol=ATOL, rtol=RTOL)
    got = torch.autograd.grad(lse.sum(), (hidden, weight))
    want = torch.autograd.grad(ref.sum(), (hidden, weight))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def test_small_tiles_with_ragged_vocabulary_match_reference() -> None:
    hidden, weight, targets = _inputs(num_tokens=40, dim=32, vocab=1000)
    blocks = HeadBlockSizes(block_tokens=16, block_vocab=384)  # 3 token blocks (last padded), 3 vocab blocks (ragged)
    h, w, t = (jnp.asarray(x.detach().numpy()) for x in (hidden, weight, targets.to(torch.int32)))
    g_lp, g_ent = np.random.default_rng(1).standard_normal((2, 40)).astype(np.float32)

    def loss(h: jax.Array, w: jax.Array) -> jax.Array:
        logprobs, entropy = fused_head_jax(h, w, t, blocks, True)
        return jnp.sum(logprobs * g_lp) + jnp.sum(entropy * g_ent)

    value, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w)
    ref_lp, ref_ent = head_logprobs_reference(hidden, weight, targets)
    ref_value = _loss(ref_lp, ref_ent, torch.from_numpy(g_lp), torch.from_numpy(g_ent))
    ref_dh, ref_dw = torch.autograd.grad(ref_value, (hidden, weight))
    torch.testing.assert_close(torch.tensor(float(value)), ref_value.detach(), atol=1e-4, rtol=RTOL)
    torch.testing.assert_close(torch.tensor(np.asarray(dh)), ref_dh, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.tensor(np.asarray(dw)), ref_dw, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_bfloat16_is_close() -> None:
    hidden, weight, targets = (x.detach() for x in _inputs())
    logprobs, entropy = fused_head_logprobs(hidden.bfloat16(), weight.bfloat16(), targets)
    ref_lp, ref_ent = head_logprobs_reference(hidden.bfloat16(), weight.bfloat16(), targets)
    torch.testing.assert_close(logprobs, ref_lp, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(entropy, ref_ent, atol=2e-2, rtol=1e-2)


def test_opcheck() -> None:
    hidden, weight, targets = _inputs()
    torch.library.opcheck(torch.ops.rl_align.fused_head_logprobs.default, (hidden, weight, targets.to(torch.int32)))


def test_bad_shapes_are_refused() -> None:
    hidden, weight, targets = _inputs(num_tokens=4, dim=8, vocab=16)
    with pytest.raises(ValueError, match="targets"):
        fused_head_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="weight"):
        fused_head_logprobs(hidden, weight[:, :4], targets)


@pytest.mark.parametrize("vocab", [32_000, 151_936])
def test_lowers_for_tpu_forward_and_backward(vocab: int) -> None:
    num_tokens, dim = 2048, 1024
    h = jax.ShapeDtypeStruct((num_tokens, dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((vocab, dim), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
    blocks = HeadBlockSizes(block_tokens=256, block_vocab=512)

    def step(h, w, t):
        out, vjp = jax.vjp(lambda h, w: fused_head_jax(h, w, t, blocks, False), h, w)
        return out, vjp(out)

    lowered = jax.jit(step).trace(h, w, t).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") == 3  # forward, d hidden, d weight


def test_lowering_rejects_tiles_tpu_cannot_take() -> None:
    h = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((1024, 128), jnp.float32)
    t = jax.ShapeDtypeStruct((256,), jnp.int32)
    bad = HeadBlockSizes(block_tokens=100, block_vocab=100)
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        jax.jit(lambda h, w, t: fused_head_jax(h, w, t, bad, False)).trace(h, w, t).lower(lowering_platforms=("tpu",))


def test_compiles_as_one_graph() -> None:
    hidden, weight, targets = _inputs()
    compiled = torch.compile(fused_head_logprobs, fullgraph=True, backend="aot_eager")
    logprobs, entropy = compiled(hidden, weight, targets)
    grads = torch.autograd.grad(logprobs.sum() + entropy.sum(), (hidden, weight))
    ref_lp, ref_ent = head_logprobs_reference(hidden, weight, targets)
    ref_grads = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), (hidden, weight))
    torch.testing.assert_close(logprobs, ref_lp, atol=ATOL, rtol=RTOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
