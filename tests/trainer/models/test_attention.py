"""The per-segment ``sdpa`` attention block against the dense-mask references: values and gradients, many layouts
(mostly distinct segment lengths: one call per segment; repeated lengths: one batched call per length)."""

from __future__ import annotations

import pytest
import torch

from trainer.models.attention import eager_attention, masked_sdpa_attention, sdpa_attention, segment_spans
from trainer.models.registry import ATTENTION_BLOCKS

# Rows of segment lengths, one list per row (all rows of a layout have the same total length).
LAYOUTS = {
    "single_segment": [[37]],
    "many_short": [[1, 2, 1, 3, 1, 1, 5, 2, 1, 4]],
    "two_rows_with_padding_segment": [[9, 6, 2], [12, 5]],
    "mixed_rows": [[1, 16], [17], [4, 4, 4, 5]],
    # GRPO-like: few lengths, repeated within and across rows (one batched call per length).
    "repeated_lengths": [[5, 5, 6, 5, 6, 7], [6, 6, 5, 7, 7, 3]],
}


def _segment_ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in rows])


def _qkv(batch: int, seq: int, heads: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, seq, 8), (batch, kv_heads, seq, 8), (batch, kv_heads, seq, 8)]
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _run(fn, q, k, v, segment_ids, upstream):
    out = fn(q, k, v, segment_ids=segment_ids, scale=0.3)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    return out.detach(), grads


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_segment_sdpa_matches_dense_mask_values_and_grads(layout: str, heads: int, kv_heads: int) -> None:
    rows = LAYOUTS[layout]
    segment_ids = _segment_ids(rows)
    b, t = segment_ids.shape
    upstream = torch.randn(b, heads, t, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got_out, got_grads = _run(sdpa_attention, *_qkv(b, t, heads, kv_heads, 0), segment_ids, upstream)
    # float64 throughout, except eager's softmax, which runs in float32 by design.
    for reference, tol in ((masked_sdpa_attention, 1e-10), (eager_attention, 1e-5)):
        ref_out, ref_grads = _run(reference, *_qkv(b, t, heads, kv_heads, 0), segment_ids, upstream)
        torch.testing.assert_close(got_out, ref_out, rtol=tol, atol=tol)
        for got, ref in zip(got_grads, ref_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_per_segment_sdpa_float32_and_no_segments() -> None:
    segment_ids = _segment_ids(LAYOUTS["mixed_rows"])
    q, k, v = (x.detach().float().requires_grad_() for x in _qkv(3, 17, 4, 2, 1))
    torch.testing.assert_close(
        sdpa_attention(q, k, v, segment_ids=segment_ids, scale=0.3),
        masked_sdpa_attention(q, k, v, segment_ids=segment_ids, scale=0.3), rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    # Without segment ids both are plain causal attention over the whole row.
    torch.testing.assert_close(
        sdpa_attention(q, k, v, segment_ids=None, scale=0.3), eager_attention(q, k, v, segment_ids=None, scale=0.3),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def test_segments_really_are_isolated() -> None:
    """Changing one segment's keys/values changes that segment's outputs only."""
    segment_ids = _segment_ids([[5, 7, 4]])
    q, k, v = (x.detach() for x in _qkv(1, 16, 2, 2, 3))
    base = sdpa_attention(q, k, v, segment_ids=segment_ids, scale=0.3)
    v2 = v.clone()
    v2[:, :, 5:12] += 1.0
    changed = sdpa_attention(q, k, v2, segment_ids=segment_ids, scale=0.3)
    diff = (changed - base).abs().amax(dim=(0, 1, 3))
    assert diff[:5].max() == 0 and diff[12:].max() == 0 and diff[5:12].min() > 1e-3


def test_segment_spans_and_non_contiguous_ids() -> None:
    assert segment_spans(torch.tensor([[0, 0, 1, 2, 2], [3, 3, 3, 3, 3]])) == [[(0, 2), (2, 3), (3, 5)], [(0, 5)]]
    with pytest.raises(ValueError, match="contiguous run"):
        segment_spans(torch.tensor([[0, 0, 1, 0]]))


def test_registry_marks_sdpa_segment_local() -> None:
    assert ATTENTION_BLOCKS.get("sdpa") is sdpa_attention
    assert ATTENTION_BLOCKS.is_segment_local("sdpa")
    assert not ATTENTION_BLOCKS.is_segment_local("eager")
    with pytest.raises(ValueError, match="unknown attention block"):
        ATTENTION_BLOCKS.is_segment_local("flash")
