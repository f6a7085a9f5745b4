"""The ``cached`` and ``chunked`` output heads against the dense reference: values and gradients, every grad path."""

from __future__ import annotations

import pytest
import torch

from trainer.models.output_head import cached_token_logprobs, chunked_token_logprobs, dense_token_logprobs
from trainer.models.registry import OUTPUT_HEADS


def _inputs(dtype: torch.dtype, n: int = 41, v: int = 300, d: int = 16):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 2).to(dtype).requires_grad_()  # peaked distributions, some p ~ 0
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _values_and_grads(head, dtype, chunk_size, use_logprobs, use_entropy):
    hidden, weight, targets = _inputs(dtype)
    lp, ent = head(hidden, weight, targets, chunk_size=chunk_size)
    g = torch.Generator().manual_seed(1)
    loss = torch.zeros(())
    if use_logprobs:
        loss = loss + (lp * torch.randn(lp.shape, generator=g)).sum()
    if use_entropy:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    return [lp.detach(), ent.detach(), hidden.grad, weight.grad]


def _assert_close_to_max(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Max abs error within ``tol`` of the reference's largest magnitude (float32 math, float64 reference)."""
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= tol * max(ref.double().abs().max().item(), 1.0), err


@pytest.mark.parametrize("head", [cached_token_logprobs, chunked_token_logprobs])
@pytest.mark.parametrize("outputs", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("chunk_size", [1, 8, 41, 1000])
def test_head_matches_float64_dense_reference(head, outputs, chunk_size) -> None:
    ref = _values_and_grads(dense_token_logprobs, torch.float64, chunk_size, *outputs)
    got = _values_and_grads(head, torch.float32, chunk_size, *outputs)
    for r, x in zip(ref, got, strict=True):
        _assert_close_to_max(x, r, 1e-5)  # dense itself in float32: up to 3e-6
    assert ref[3].abs().max() > 1e-3


@pytest.mark.parametrize("head", [cached_token_logprobs, chunked_token_logprobs])
def test_head_bfloat16_matches_dense(head) -> None:
    ref = _values_and_grads(dense_token_logprobs, torch.bfloat16, 8, True, True)
    got = _values_and_grads(head, torch.bfloat16, 8, True, True)
    for r, x in zip(ref, got, strict=True):
        _assert_close_to_max(x, r, 2e-2)


def test_cached_head_is_registered_and_rejects_bad_chunks() -> None:
    assert OUTPUT_HEADS.get("cached") is cached_token_logprobs
    hidden, weight, targets = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        cached_token_logprobs(hidden, weight, targets, chunk_size=0)
    # An empty batch (an empty micro-batch on some rank) still yields a graph and zero gradients.
    lp, _ = cached_token_logprobs(hidden[:0], weight, targets[:0], chunk_size=4)
    lp.sum().backward()
    assert weight.grad is not None and weight.grad.abs().max() == 0
