"""Rotary position embedding (RoPE) in the HF "rotate half" layout, with optional Llama 3.1 frequency scaling.

HF Llama/Qwen checkpoints store q/k projections for this layout, so weights load and sync unpermuted. Frequencies
are recomputed from the config each call (a few dozen floats): there is no buffer to initialise after a meta-device
build or to keep out of checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from trainer.models.config import ModelConfig, RopeScalingConfig

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_freq"]


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), Llama 3.1-scaled when ``cfg.rope_scaling`` is set."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, cfg.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScalingConfig) -> torch.Tensor:
    """Stretch long wavelengths by ``s.factor``, keep short ones, interpolate smoothly in between (Llama 3.1)."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[B, 1, T, head_dim]`` in ``dtype`` for integer ``positions [B, T]`` (computed in fp32)."""
    inv_freq = rope_inv_freq(cfg, positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, Dh]`` by the tables of :func:`rope_cos_sin`: ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x[..., Dh/2:], x[..., :Dh/2])``. Differentiable in ``x``; the tables are constants (a
    table that requires a gradient is refused)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rope: the cos/sin tables are constants; compute them without autograd history")
    return _Rotate.apply(x, cos, sin)


class _Rotate(torch.autograd.Function):
    """:func:`apply_rope` in three passes each way (the op-by-op graph makes about twice as many: a negated half, a
    concatenation, slice gradients), writing each half's sine term into the cosine product in place. The backward is
    the transposed rotation and needs only the tables."""

    @staticmethod
    def forward(ctx, x, cos, sin):  # noqa: ANN001 (autograd signature)
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    @once_differentiable  # the backward is not itself differentiable: a double backward gets a clear error
    def backward(ctx, grad_out):  # noqa: ANN001
        cos, sin = ctx.saved_tensors
        half = grad_out.shape[-1] // 2
        grad = grad_out * cos
        grad[..., :half].addcmul_(grad_out[..., half:], sin[..., half:])
        grad[..., half:].addcmul_(grad_out[..., :half], sin[..., :half], value=-1)
        return grad, None, None
