"""The ``varlen`` block's packing layout, checked on the CPU: its boundaries and key gather, fed to a reference of
Flash Attention's variable-length contract (each segment's queries against its keys, causal aligned bottom-right),
give the masked reference's attention. The real kernel runs on CUDA only: ``tests/trainer/test_cuda.py`` checks it
against the same reference on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import trainer.models.varlen_attention as varlen
from trainer.models.attention import masked_sdpa_attention


def reference_varlen_attn(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor,
    max_q: int, max_k: int, *, scale: float, window_size: tuple[int, int], **_: object,
) -> torch.Tensor:  # fmt: skip
    """``varlen_attn``'s contract: tokens ``[total, heads, Dh]``, segment ``i`` is queries ``cu_seq_q[i]:[i+1]`` against
    keys ``cu_seq_k[i]:[i+1]``; ``window_size = (-1, 0)`` is causal with the last query on the last key."""
    assert window_size == (-1, 0)
    outs = []
    for i in range(cu_seq_q.numel() - 1):
        qa, qb, ka, kb = int(cu_seq_q[i]), int(cu_seq_q[i + 1]), int(cu_seq_k[i]), int(cu_seq_k[i + 1])
        assert qb - qa <= max_q and kb - ka <= max_k
        q, k, v = (x.transpose(0, 1)[None] for x in (query[qa:qb], key[ka:kb], value[ka:kb]))
        mask = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril((kb - ka) - (qb - qa))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("shared_prompts", [False, True])
def test_the_layout_gives_the_masked_reference(monkeypatch: pytest.MonkeyPatch, shared_prompts: bool) -> None:
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", reference_varlen_attn)
    monkeypatch.setattr(varlen, "_KEYWORDS", {"window_size": (-1, 0)})
    rows = [[(20, -1), (7, 0), (33, 0), (1, 0), (12, -1), (40, 4), (14, -1)], [(90, -1), (5, -1), (28, 1), (4, -1)]]
    segment_ids = torch.tensor([[s for s, (n, _) in enumerate(row) for _ in range(n)] for row in rows])
    prefix_ids = torch.tensor([[p for n, p in row for _ in range(n)] for row in rows])
    gen, total = torch.Generator().manual_seed(0), segment_ids.shape[1]
    q, k, v = (torch.randn(2, h, total, 16, generator=gen).bfloat16().requires_grad_() for h in (4, 2, 2))
    upstream = torch.randn(2, 4, total, 16, generator=gen).bfloat16()
    shared = {"prefix_ids": prefix_ids} if shared_prompts else {}
    results = []
    for kernel in (varlen.varlen_attention, masked_sdpa_attention):
        out = kernel(q, k, v, segment_ids=segment_ids, scale=0.25, **shared)
        results.append((out, *torch.autograd.grad(out, (q, k, v), upstream)))
    for got, want in zip(*results, strict=True):
        assert (got.float() - want.float()).abs().max().item() < 3e-2 * max(1.0, want.float().abs().max().item())


def test_float32_is_refused_naming_the_fix() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="computes in bfloat16 or float16, got torch.float32: set trainer.mixed_pre"):
        varlen.varlen_attention(q, q, q, segment_ids=torch.zeros(1, 4, dtype=torch.long), scale=1.0)
