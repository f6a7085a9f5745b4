"""Sequence packing: rollout samples -> token-budgeted micro-batches of packed rows, balanced across ranks.

Each micro-batch is one row ``[1, T]`` holding several ``prompt + completion`` sequences back to back. Positions
restart at 0 per sequence and ``segment_ids`` tell attention which tokens may see each other, so packing changes
nothing numerically while padding (only up to ``pad_to_multiple_of``) stays negligible. Sequences are placed
first-fit-decreasing by length under the token budget.

Alignment: position ``t`` of a row predicts ``tokens[t + 1]`` (``targets[t]``). The loss side is per sequence:
``gather_index[s, j]`` is the row position predicting completion token ``j`` of sequence ``s``, and ``loss_mask``,
``rollout_logprobs`` and ``advantages`` are ``[S, C]`` in that layout, which is what ``trainer.rl`` expects.

Every rank computes the same plan from the same full batch (no communication) and pads its list of micro-batches to
the longest rank's count with empty ones, so FSDP collectives line up on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from rollout.types import Sample

__all__ = ["MicroBatch", "assign_to_ranks", "pack_samples", "plan_micro_batches", "split_minibatches"]


@dataclass
class MicroBatch:
    """One packed row of sequences for the model, plus its loss inputs in per-sequence layout.

    Model inputs are ``[1, T]`` (several sequences back to back). Loss inputs are ``[S, C]``: one row per packed
    sequence, one column per completion token (``C`` = longest completion in the row), the layout the RL losses and GAE
    expect. :meth:`unpack` moves any per-position model output (log-probs, entropy, values) into that layout.
    """

    tokens: torch.Tensor
    """int64 [1, T] token ids."""
    positions: torch.Tensor
    """int64 [1, T] position of each token inside its own sequence (restarts at 0)."""
    segment_ids: torch.Tensor
    """int64 [1, T] sequence number inside the row (0, 1, ...); padding gets its own id after the last sequence."""
    targets: torch.Tensor
    """int64 [1, T] next token of the same sequence (0 where there is none)."""
    gather_index: torch.Tensor
    """int64 [S, C] position in the row that predicts each completion token (0 off-mask)."""
    loss_mask: torch.Tensor
    """float32 [S, C] 1 for real completion tokens, 0 for the padding of shorter completions."""
    rollout_logprobs: torch.Tensor
    """float32 [S, C] engine log-prob of each completion token (0 off-mask)."""
    advantages: torch.Tensor
    """float32 [S, C] advantage of each completion token (0 off-mask); PPO fills it after packing (GAE)."""
    sample_indices: list[int]
    """Index (into the full batch) of each packed sequence, in row order; ``len == S``."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token tensors computed later (``old_logprobs``, ``ref_logprobs``, ``values``, ``returns``), [S, C]."""

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens in the packed row."""
        return int((self.segment_ids < len(self.sample_indices)).sum())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def unpack(self, per_position: torch.Tensor) -> torch.Tensor:
        """[1, T] per-position values -> [S, C] per completion token (0 off-mask); differentiable."""
        gathered = per_position[0][self.gather_index]
        return torch.where(self.loss_mask > 0, gathered, torch.zeros_like(gathered))

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on ``device``."""
        moved = {
            name: getattr(self, name).to(device)
            for name in (
                "tokens", "positions", "segment_ids", "targets", "gather_index", "loss_mask", "rollout_logprobs",
                "advantages",
            )
        }
        extra = {k: v.to(device) for k, v in self.extra.items()}
        return MicroBatch(**moved, sample_indices=list(self.sample_indices), extra=extra)


def _first_fit_decreasing(lengths: Sequence[int], indices: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to <= budget; a sequence longer than the budget gets a bin of its own."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def _advantage_row(adv: float | np.ndarray | None, completion_len: int) -> np.ndarray:
    if adv is None:
        return np.zeros(completion_len, dtype=np.float32)
    arr = np.asarray(adv, dtype=np.float32)
    if arr.ndim == 0:
        return np.full(completion_len, float(arr), dtype=np.float32)
    if arr.shape != (completion_len,):
        raise ValueError(f"per-token advantages of shape {arr.shape} for a completion of {completion_len} tokens")
    return arr


def _build_row(
    samples: Sequence[Sample],
    indices: Sequence[int],
    advantages: Sequence[float | np.ndarray] | None,
    pad_to_multiple_of: int,
) -> MicroBatch:
    lengths = [len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in indices]
    used = sum(lengths)
    total = max(1, -(-used // pad_to_multiple_of) * pad_to_multiple_of)
    num_seqs = len(indices)
    width = max((len(samples[i].completion_ids) for i in indices), default=0)
    tokens = np.zeros(total, dtype=np.int64)
    positions = np.zeros(total, dtype=np.int64)
    segment_ids = np.full(total, num_seqs, dtype=np.int64)
    targets = np.zeros(total, dtype=np.int64)
    gather_index = np.zeros((num_seqs, width), dtype=np.int64)
    loss_mask = np.zeros((num_seqs, width), dtype=np.float32)
    rollout_lp = np.zeros((num_seqs, width), dtype=np.float32)
    adv = np.zeros((num_seqs, width), dtype=np.float32)
    start = 0
    for seg, (i, n) in enumerate(zip(indices, lengths)):
        s = samples[i]
        p, c = len(s.prompt_ids), len(s.completion_ids)
        end = start + n
        tokens[start : start + p] = s.prompt_ids
        tokens[start + p : end] = s.completion_ids
        positions[start:end] = np.arange(n)
        segment_ids[start:end] = seg
        targets[start : end - 1] = tokens[start + 1 : end]
        # Position t predicts token t+1: completion token j is predicted at row position start + p - 1 + j.
        gather_index[seg, :c] = np.arange(start + p - 1, end - 1)
        loss_mask[seg, :c] = 1.0
        rollout_lp[seg, :c] = s.rollout_logprobs
        adv[seg, :c] = _advantage_row(None if advantages is None else advantages[i], c)
        start = end
    row = lambda a: torch.from_numpy(a).unsqueeze(0)  # noqa: E731
    return MicroBatch(
        tokens=row(tokens), positions=row(positions), segment_ids=row(segment_ids), targets=row(targets),
        gather_index=torch.from_numpy(gather_index), loss_mask=torch.from_numpy(loss_mask),
        rollout_logprobs=torch.from_numpy(rollout_lp), advantages=torch.from_numpy(adv), sample_indices=list(indices),
    )


def pack_samples(
    samples: Sequence[Sample],
    indices: Sequence[int],
    token_budget: int,
    advantages: Sequence[float | np.ndarray] | None = None,
    pad_to_multiple_of: int = 1,
) -> list[MicroBatch]:
    """Pack ``samples[i] for i in indices`` into micro-batches of at most ``token_budget`` tokens each.

    ``advantages[i]`` (indexed like ``samples``) is a scalar broadcast over the completion or an array with one value
    per completion token. Rows are padded to a multiple of ``pad_to_multiple_of`` (static shapes on accelerators).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    for i in indices:
        if len(samples[i].prompt_ids) == 0:
            raise ValueError(f"sample {i} has an empty prompt: nothing predicts its first completion token")
    lengths = {i: len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in indices}
    bins = _first_fit_decreasing(lengths, list(indices), token_budget)
    return [_build_row(samples, b, advantages, pad_to_multiple_of) for b in bins]


def assign_to_ranks(lengths: Sequence[int], indices: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Split ``indices`` over ranks so token counts are balanced (longest first onto the least-loaded rank).

    Deterministic: ties go to the lower rank; each rank's list is in ascending index order.
    """
    load = [0] * num_ranks
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        r = min(range(num_ranks), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(o) for o in out]


def split_minibatches(num_samples: int, num_minibatches: int, seed: int | None = None) -> list[list[int]]:
    """Split sample indices into ``num_minibatches`` near-equal mini-batches (shuffled with ``seed`` if given)."""
    if num_minibatches > num_samples:
        raise ValueError(f"{num_minibatches} mini-batches requested for a batch of only {num_samples} samples")
    order = np.arange(num_samples)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(num_samples)
    return [sorted(int(i) for i in part) for part in np.array_split(order, num_minibatches)]


def _empty_micro_batch() -> MicroBatch:
    """A one-token row with no sequence: keeps this rank's forward/backward count equal to the other ranks'."""
    z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    return MicroBatch(
        tokens=z(1, 1), positions=z(1, 1), segment_ids=z(1, 1), targets=z(1, 1), gather_index=z(0, 0),
        loss_mask=z(0, 0, dtype=torch.float32), rollout_logprobs=z(0, 0, dtype=torch.float32),
        advantages=z(0, 0, dtype=torch.float32), sample_indices=[],
    )


def plan_micro_batches(
    samples: Sequence[Sample],
    indices: Sequence[int],
    rank: int,
    num_ranks: int,
    token_budget: int,
    advantages: Sequence[float | np.ndarray] | None = None,
    pad_to_multiple_of: int = 1,
) -> list[MicroBatch]:
    """This rank's micro-batches for the samples ``indices``: balanced rank split, FFD packing, equal counts.

    Every rank calls this with the same arguments except ``rank``, and gets the same number of micro-batches.
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    per_rank = assign_to_ranks(lengths, indices, num_ranks)
    counts = [len(_first_fit_decreasing(lengths, part, token_budget)) for part in per_rank]
    mine = pack_samples(samples, per_rank[rank], token_budget, advantages, pad_to_multiple_of)
    assert len(mine) == counts[rank]
    mine.extend(_empty_micro_batch() for _ in range(max(counts) - len(mine)))
    return mine
