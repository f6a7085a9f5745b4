"""Grouped-query self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3), plus the built-in kernels.

The projection weights keep the HF layout (``wq`` = ``q_proj`` etc.), so checkpoints and weight pushes need no
permutation. The attention product itself is a registered function picked by ``ModelConfig.attention`` (see
``trainer.models.registry`` for the contract); ``sdpa`` and ``eager`` are built in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.config import ModelConfig
from trainer.models.layers import RMSNorm
from trainer.models.registry import ATTENTION_BLOCKS
from trainer.models.rope import apply_rope

__all__ = ["Attention", "attention_mask", "eager_attention", "sdpa_attention"]


def attention_mask(seq_len: int, segment_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Boolean keep-mask ``[B or 1, 1, T, T]``: causal, and within equal segment ids when they are given."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if segment_ids is None:
        return causal[None, None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same)[:, None]


@ATTENTION_BLOCKS.register("sdpa")
def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_ids: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` (its fused CPU/GPU kernels), native GQA."""
    gqa = q.shape[1] != k.shape[1]
    if segment_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = attention_mask(q.shape[2], segment_ids, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


@ATTENTION_BLOCKS.register("eager")
def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_ids: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Plain matmul-softmax-matmul reference (softmax in float32); materialises the [T, T] scores."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~attention_mask(q.shape[2], segment_ids, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    """Self-attention block: q/k/v projections, optional q/k RMSNorm, RoPE, a registered kernel, output projection."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.kernel = ATTENTION_BLOCKS.get(cfg.attention)
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, **kw)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, **kw)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, **kw)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, **kw)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device, dtype) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segment_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; ``rope`` = (cos, sin) from :func:`rope_cos_sin`."""
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.kernel(q, k, v, segment_ids=segment_ids, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            nn.init.normal_(lin.weight, std=std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
