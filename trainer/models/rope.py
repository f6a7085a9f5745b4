"""Rotary position embedding (RoPE) in the HF "rotate half" layout, with optional Llama 3.1 frequency scaling.

HF Llama/Qwen checkpoints store q/k projections for this layout, so weights load and sync unpermuted. Frequencies
are recomputed from the config each call (a few dozen floats): there is no buffer to initialise after a meta-device
build or to keep out of checkpoints.
"""

from __future__ import annotations

import math

import torch

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
    """Rotate ``x [B, H, T, Dh]`` by the tables of :func:`rope_cos_sin`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
