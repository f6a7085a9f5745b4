"""``varlen``: the CUDA attention block for packed rows, one Flash Attention call per layer over every segment.

``sdpa`` on a packed row runs one SDPA call per distinct segment length (or per segment, when few lengths repeat):
on a GPU a GRPO micro-batch of hundreds of completions becomes hundreds of small kernel launches per layer. Flash
Attention's variable-length kernel (``torch.nn.attention.varlen.varlen_attn``) takes the packed tokens as they lie
(``[total, heads, Dh]``) with the cumulative segment boundaries and runs every segment in one launch, forward and
backward. It computes in bfloat16 or float16 only (``trainer.mixed_precision.param_dtype``; checked at recipe load by
``TrainerConfig.check_model``) and runs on CUDA only (declared in ``trainer.models.registry``).

Shared prompts (``prefix_ids``): a completion's keys are its prompt's keys followed by its own (one gather of k and v,
whose backward sums each prompt's gradient over its completions); queries stay where they are. Flash's causal mask
aligns the last query with the last key (bottom-right), which is exactly "every prompt key, then the completion's own
keys up to the query".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainer.models.attention import packed_segments, per_forward
from trainer.models.registry import ATTENTION_BLOCKS

__all__ = ["check_supported", "varlen_attention"]

_MIN_TORCH = "2.11"


def _varlen_keywords() -> dict[str, Any] | None:
    """The keywords that make ``varlen_attn`` causal with grouped-query heads in the installed torch (its keyword set
    changed between releases: ``is_causal`` or ``window_size = (-1, 0)`` for causality, ``enable_gqa`` since 2.13),
    or None when this torch has no ``varlen_attn`` that takes a scale."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params or not {"window_size", "is_causal"} & params.keys():
        return None
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return {**causal, **({"enable_gqa": True} if "enable_gqa" in params else {})}


_KEYWORDS = _varlen_keywords()


def check_supported(device: torch.device | str) -> None:
    """Raise ``ValueError`` unless this host's torch has a causal ``varlen_attn`` that takes a scale (the device,
    CUDA, is checked by the registry's declaration before this runs)."""
    del device
    if _KEYWORDS is None:
        raise ValueError(
            f'model.attention = "varlen" needs torch >= {_MIN_TORCH} (torch.nn.attention.varlen.varlen_attn, causal, '
            f'with a scale); this torch is {torch.__version__}: upgrade it or use "sdpa"'
        )


@dataclass(frozen=True)
class _Segments:
    """The packed segments of one ``segment_ids`` (and ``prefix_ids``) tensor in flat ``[B * T]`` order."""

    cu_q: torch.Tensor
    """int32 ``[segments + 1]``: where each segment's queries start in the flat tokens, then the total."""
    max_q: int
    cu_k: torch.Tensor
    """int32 ``[segments + 1]``: the same over the keys (equal to ``cu_q`` without shared prompts)."""
    max_k: int
    key_order: torch.Tensor | None
    """With shared prompts: the flat key positions, segment by segment (its prompt's, then its own)."""


@per_forward
def _segments(segment_ids: torch.Tensor, prefix_ids: torch.Tensor | None = None) -> _Segments:
    segments = packed_segments(segment_ids, prefix_ids)
    device = segment_ids.device
    cu_q = torch.tensor([*(seg.start for seg in segments), segment_ids.numel()], dtype=torch.int32, device=device)
    max_q = max(seg.end - seg.start for seg in segments)
    if prefix_ids is None:
        return _Segments(cu_q, max_q, cu_q, max_q, None)
    keys = [
        torch.arange(a, b) for seg in segments for a, b in ((seg.prompt_start, seg.prompt_end), (seg.start, seg.end))
    ]
    key_lengths = [seg.prompt_end - seg.prompt_start + seg.end - seg.start for seg in segments]
    cu_k = torch.tensor([0, *key_lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    return _Segments(cu_q, max_q, cu_k.to(device), max(key_lengths), torch.cat(keys).to(device))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segment_ids: torch.Tensor | None,
    scale: float,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each packed segment (and into its shared prompt), equal to
    :func:`trainer.models.attention.masked_sdpa_attention`, as one Flash Attention varlen call. ``q [B, H, T, Dh]``,
    ``k``/``v [B, KVH, T, Dh]`` in bfloat16 or float16; returns ``[B, H, T, Dh]`` (a transposed view of token-major
    memory, so the caller's transpose back is free). Segments must be contiguous runs (see
    ``trainer.models.attention.segment_spans``)."""
    if segment_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f'model.attention = "varlen" computes in bfloat16 or float16, got {q.dtype}: set '
            'trainer.mixed_precision.param_dtype = "bfloat16" or use "sdpa"'
        )
    assert _KEYWORDS is not None, "check_supported ran at build time"
    from torch.nn.attention.varlen import varlen_attn

    b, h, t, d = q.shape
    layout = _segments(segment_ids, prefix_ids)

    def token_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)

    qs, ks, vs = token_major(q), token_major(k), token_major(v)
    if layout.key_order is not None:
        ks, vs = ks.index_select(0, layout.key_order), vs.index_select(0, layout.key_order)
    out = varlen_attn(
        qs, ks, vs, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, scale=scale, **_KEYWORDS
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs asked for
    return out.view(b, t, h, d).transpose(1, 2)


ATTENTION_BLOCKS.register(
    "varlen", varlen_attention, segment_local=True, shared_prefix=True, check_supported=check_supported
)
