"""Reduce per-token losses ``[B, T]`` to one scalar, under a completion mask.

Three modes, as named in ``trainer.rl.config.LossAggregation``:

- ``token_mean``: ``sum(x * mask) / num_tokens``: every completion token weighs the same (DAPO).
- ``seq_mean_token_mean``: mean over sequences of each sequence's token mean: every completion weighs the same, so
  tokens of short completions weigh more (original GRPO, GSPO).
- ``token_sum_norm``: ``sum(x * mask) / (num_seqs * norm_length)`` with a constant ``norm_length`` (Dr. GRPO): no
  length bias, and the scale does not move with the batch's lengths.

Under gradient accumulation or data parallelism, pass the *global* ``num_tokens`` / ``num_seqs`` of the whole
optimizer batch: then the micro-batch losses sum (over micro-batches and ranks) to exactly the full-batch loss.

A "sequence" is an episode: an agent episode that gave several samples (rows) is one sequence, so ``num_seqs`` counts
it once and ``seq_tokens`` gives each of its rows the episode's token count, so that its rows' sums add up to one
token mean.
Left as None, they are counted on this micro-batch.

Values off the mask are multiplied by 0, so they must be finite (pad log-probs with 0, not -inf): ``inf * 0`` is NaN.
"""

from __future__ import annotations

from typing import Literal, TypedDict

import torch

from trainer.rl.config import LossAggregation

__all__ = ["AggregateKwargs", "aggregate", "masked_extreme", "masked_mean", "when_any"]


class AggregateKwargs(TypedDict, total=False):
    """The normalisers of :func:`aggregate`, as the loss functions pass them through (``**kwargs``)."""

    norm_length: int | None
    num_tokens: float | None
    num_seqs: float | None
    seq_tokens: torch.Tensor | None


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is set (any shape, same for both); 0 when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def when_any(valid: torch.Tensor, value: torch.Tensor, empty: float) -> torch.Tensor | float:
    """``value`` where ``valid`` has any set element, else ``empty``; decided on the device (no host read), except that
    an empty ``valid`` (a micro-batch without completion tokens) gives ``empty`` directly."""
    if valid.numel() == 0:
        return empty
    return torch.where(valid.any(), value, value.new_tensor(empty))


def masked_extreme(
    x: torch.Tensor, valid: torch.Tensor, kind: Literal["max", "min"], empty: float
) -> torch.Tensor | float:
    """The largest / smallest element of ``x`` where ``valid`` (bool, same shape) is set; ``empty`` when none is."""
    if valid.numel() == 0:
        return empty
    fill = float("-inf") if kind == "max" else float("inf")
    picked = torch.where(valid, x, x.new_tensor(fill))
    return when_any(valid, picked.max() if kind == "max" else picked.min(), empty)


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    *,
    norm_length: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    seq_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    Args:
        x: [B, T] per-token values (loss terms).
        mask: [B, T] 1 (or True) for completion tokens that count, 0 elsewhere.
        mode: one of 'token_mean', 'seq_mean_token_mean', 'token_sum_norm'.
        norm_length: constant per-sequence divisor, required by 'token_sum_norm'.
        num_tokens: divisor of 'token_mean'; defaults to the tokens in ``mask``.
        num_seqs: divisor of the per-sequence modes; defaults to the rows of ``mask`` with at least one token
            (all-padding rows do not count).
        seq_tokens: [B] the token count of the sequence (episode) each row is part of, the divisor of the row's sum
            in 'seq_mean_token_mean'; defaults to the row's own count (every row a whole sequence).

    Returns:
        A 0-dim tensor.
    """
    assert x.shape == mask.shape and x.dim() == 2, f"x {tuple(x.shape)} and mask {tuple(mask.shape)} must be [B, T]"
    mask = mask.to(x.dtype)
    masked = x * mask
    if mode == "token_mean":
        # A mini-batch of samples without model tokens (agent episodes that made no call) counts 0: its loss is 0.
        token_denom = mask.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1.0)
        return masked.sum() / token_denom
    row_tokens = mask.sum(dim=-1)  # [B]
    seq_denom = (row_tokens > 0).sum().clamp(min=1) if num_seqs is None else max(num_seqs, 1.0)
    if mode == "seq_mean_token_mean":
        per_row = row_tokens if seq_tokens is None else seq_tokens.to(x.dtype)
        return (masked.sum(dim=-1) / per_row.clamp(min=1)).sum() / seq_denom
    if mode == "token_sum_norm":
        if norm_length is None:
            raise ValueError("aggregation 'token_sum_norm' needs norm_length (the constant per-sequence divisor)")
        return masked.sum() / (seq_denom * norm_length)
    raise ValueError(f"unknown loss aggregation {mode!r}; use 'token_mean', 'seq_mean_token_mean' or 'token_sum_norm'")
