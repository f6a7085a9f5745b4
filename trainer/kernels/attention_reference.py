"""Torch reference for causal grouped-query attention over packed sequences (the parity target of splash attention)."""

from __future__ import annotations

import torch

__all__ = ["attention_reference"]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention with grouped-query heads and packed segments, in plain torch (materializes ``[T, T]`` scores).

    Shapes: ``q [B, Hq, T, D]``, ``k`` and ``v [B, Hkv, T, D]`` with ``Hq % Hkv == 0`` (query head ``h`` reads kv head
    ``h // (Hq // Hkv)``), ``segment_ids [B, T]`` or ``None``. Position ``i`` attends to ``j <= i`` with the same
    segment id. Returns ``[B, Hq, T, D]`` in ``q``'s dtype.
    """
    num_q_heads, num_kv_heads, seq_len = q.shape[1], k.shape[1], q.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
