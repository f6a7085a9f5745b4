"""Sequence packing: rollout samples -> token-budgeted micro-batches of packed rows, balanced across ranks.

Sequences (``prompt + completion``) are packed back to back into rows of at most ``row_tokens`` tokens
(first-fit-decreasing; balanced longest-first when each row is a whole micro-batch), and rows are grouped into
micro-batches ``[R, L]`` of at most ``token_budget`` tokens including the padding of shorter rows. Positions restart
at 0 per sequence and ``segment_ids`` keep attention inside a sequence, so packing changes nothing numerically.

Row length is the caller's choice. With a segment-local attention block (``sdpa``) the cost does not depend on it,
and one row per micro-batch (``row_tokens = token_budget``) needs no padding at all. With a dense-mask block
(``eager``) attention costs ``L^2`` per row however many sequences share it, so rows are kept short (by default the
longest sequence of the batch) and many rows per micro-batch keep the matmuls large.

Alignment: position ``t`` of a row predicts ``tokens[t + 1]`` (``targets[t]``). The loss side is per sequence:
``gather_index[s, j]`` is the flat position (``row * L + t``) predicting completion token ``j`` of sequence ``s``, and
``loss_mask``, ``rollout_logprobs`` and ``advantages`` are ``[S, C]`` in that layout, which is what ``trainer.rl``
expects. A multi-turn trajectory's observation tokens sit in the completion but are masked out (``Sample.loss_mask``):
they condition the model tokens after them and carry no loss.

Shared prompts (``share_prompts``): the samples of one prompt (a GRPO group) are laid out as the prompt once, then
each completion after it (``[P | c1 | c2 | ...]``). A completion's tokens attend to the prompt and to their own
earlier tokens (``prefix_ids`` names the prompt's segment; attention blocks registered ``shared_prefix=True`` honour
it), continue its positions, and its first token is predicted by the prompt's last position, which all of them share
(``gather_index`` repeats it). The model then computes a prompt once per group instead of once per sample: the same
log-probs, and the same gradients (the shared positions receive the sum of what each sample sends back), for a
fraction of the tokens when prompts are long next to completions. A group too long for one row is split into several
units, each with its own copy of the prompt.

Every rank computes the same plan from the same full batch (no communication) and pads its list of micro-batches to
the longest rank's count with empty ones, so FSDP collectives line up on every rank.

Static shapes (``static_shapes``, for devices that compile a graph per tensor shape, such as torch_xla's): all the
micro-batches of one call share one shape, each dimension (rows, row width, sequences, completion width) being the
largest any of them needs rounded up to a power of two; padding rows and sequences carry no loss, and the output head
runs at every ``[S, C]`` slot instead of only the real completion tokens. A step's graphs then come in one shape,
which changes only when the batch's longest completion or fullest micro-batch crosses a power of two, so a run
compiles a handful of times instead of once per micro-batch shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout.types import Sample, episode_members

__all__ = [
    "MicroBatch", "assign_to_ranks", "bucket_size", "episode_tokens", "plan_micro_batches",
    "split_minibatches",
]  # fmt: skip

_TENSOR_FIELDS = (
    "tokens", "positions", "segment_ids", "completion_ids", "gather_index", "loss_mask", "rollout_logprobs",
    "advantages", "loss_positions", "loss_targets", "loss_slots", "sample_rows", "sequence_tokens",
)  # fmt: skip
_MIN_STATIC_WIDTH = 16  # the smallest row / completion width under static shapes: tiny widths would each compile


@dataclass
class MicroBatch:
    """Packed rows for the model, plus their loss inputs in per-sequence layout.

    Model inputs are ``[R, L]`` (each row holds several sequences back to back). Loss inputs are ``[S, C]``: one row
    per packed sequence, one column per completion token (``C`` = longest completion here), the layout the RL losses
    and GAE expect. :meth:`unpack` moves any per-position model output (log-probs, entropy, values) into that layout.
    """

    tokens: torch.Tensor
    """int64 [R, L] token ids."""
    positions: torch.Tensor
    """int64 [R, L] position of each token inside its own sequence (restarts at 0)."""
    segment_ids: torch.Tensor
    """int64 [R, L] sequence number inside the row (0, 1, ...); padding gets its own id after the row's last one."""
    completion_ids: torch.Tensor
    """int64 [S, C] each sequence's completion tokens (0 past its end): the targets of the positions in
    ``gather_index``."""
    gather_index: torch.Tensor
    """int64 [S, C] flat position (``row * L + t``) that predicts each completion token (0 past a completion's end).
    With shared prompts the first tokens of a prompt's completions share one predicting position."""
    loss_mask: torch.Tensor
    """float32 [S, C] 1 for completion tokens the model generated, 0 for the tokens it was given inside a multi-turn
    trajectory (``Sample.loss_mask``) and for the padding of shorter completions."""
    rollout_logprobs: torch.Tensor
    """float32 [S, C] engine log-prob of each completion token (0 off-mask)."""
    advantages: torch.Tensor
    """float32 [S, C] advantage of each completion token (0 off-mask); PPO fills it after packing (GAE)."""
    loss_positions: torch.Tensor
    """int64 [N] flat row positions (``row * L + t``) where the output head runs: those predicting the real
    completion tokens, in the row-major order of ``loss_mask``, then (static shapes only) position 0 for every other
    ``[S, C]`` slot, so that ``N = S * C`` there. :meth:`scatter` puts per-token values computed there into
    ``[S, C]``."""
    loss_targets: torch.Tensor
    """int64 [N] what each of :attr:`loss_positions` predicts (0 at the padding ones)."""
    loss_slots: torch.Tensor
    """int64 [N] the flat ``[S, C]`` slot of each of :attr:`loss_positions`; the padding ones point at ``S * C``, one
    past the end, which :meth:`scatter` drops."""
    sample_rows: torch.Tensor
    """int64 [S] :attr:`sample_indices` as a tensor, with the batch size (one past the last sample) for each padding
    row: per-sample values of the whole batch with a 0 appended, indexed by it, give each row its sample's value."""
    sequence_tokens: torch.Tensor
    """float32 [S] the model tokens of the episode each row is part of, among the samples packed together in this
    call: the row's own count, or for an agent episode that gave several samples (``Sample.episode``) the sum over
    those of its samples; 0 for padding rows. A per-sequence loss counts such an episode once
    (``trainer.rl.aggregation``)."""
    sample_indices: list[int]
    """Index (into the full batch) of each packed sequence, in ``[S, C]`` row order; rows past ``len`` are padding
    (static shapes), with no loss."""
    num_tokens: int = 0
    """Non-padding tokens in the rows."""
    num_loss_tokens: int = 0
    """Completion tokens that carry loss (``loss_mask`` set)."""
    token_temperatures: torch.Tensor | None = None
    """float32 [N] sampling temperature at each of :attr:`loss_positions` (the sample's ``temperature``, 1 at the
    padding ones); ``None`` when every sample was drawn at temperature 1."""
    prefix_ids: torch.Tensor | None = None
    """int64 [R, L] with shared prompts: the segment id of the prompt each token's sequence continues (-1 for a
    prompt's own tokens, a whole sequence and padding); ``None`` when nothing in the micro-batch is shared."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token tensors computed later (``old_logprobs``, ``ref_logprobs``, ``values``, ``returns``), [S, C]."""

    def scatter(self, per_token: torch.Tensor) -> torch.Tensor:
        """[N] values at :attr:`loss_positions` -> [S, C] (0 off-mask); differentiable."""
        rows, width = self.loss_mask.shape
        flat = per_token.new_zeros(rows * width + 1).index_copy(0, self.loss_slots, per_token)
        return flat[:-1].view(rows, width)

    def unpack(self, per_position: torch.Tensor) -> torch.Tensor:
        """[R, L] per-position values -> [S, C] per completion token (0 off-mask); differentiable."""
        gathered = per_position.reshape(-1)[self.gather_index]
        return torch.where(self.loss_mask > 0, gathered, torch.zeros_like(gathered))

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on ``device``."""
        moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        extra = {k: v.to(device) for k, v in self.extra.items()}
        temps = None if self.token_temperatures is None else self.token_temperatures.to(device)
        prefix_ids = None if self.prefix_ids is None else self.prefix_ids.to(device)
        return MicroBatch(
            **moved, sample_indices=list(self.sample_indices), num_tokens=self.num_tokens,
            num_loss_tokens=self.num_loss_tokens, token_temperatures=temps, prefix_ids=prefix_ids, extra=extra,
        )  # fmt: skip


def _first_fit_decreasing(lengths: Sequence[int], indices: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to <= capacity; a sequence longer than that gets a bin of its own.

    Bins come out in order of their first (longest) member, i.e. roughly longest first.
    """
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
            room.append(capacity - n)
    return bins


def _balanced_bins(lengths: Sequence[int], indices: Sequence[int], capacity: int) -> list[list[int]]:
    """As many bins as first-fit-decreasing needs, filled longest-first onto the least-loaded bin instead.

    For one row per micro-batch: no near-empty last micro-batch (a tail of a few tokens runs every matmul at a poor
    shape and pays a whole round of FSDP gathers). Falls back to the first-fit bins when balancing would overflow one
    (a sequence longer than ``capacity``, or an unlucky mix).
    """
    first_fit = _first_fit_decreasing(lengths, indices, capacity)
    load = [0] * len(first_fit)
    bins: list[list[int]] = [[] for _ in first_fit]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        b = min(range(len(bins)), key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += lengths[i]
    return bins if max(load, default=0) <= capacity else first_fit


def _group_rows(
    lengths: Sequence[int], indices: Sequence[int], token_budget: int, row_tokens: int
) -> list[list[list[int]]]:
    """Micro-batches as lists of rows (lists of sample indices); padded size ``rows x longest row`` <= budget."""
    if row_tokens >= token_budget:  # one row per micro-batch: balance the micro-batches
        rows = _balanced_bins(lengths, indices, token_budget)
    else:  # several rows share a micro-batch's width: tight rows pad least
        rows = _first_fit_decreasing(lengths, indices, row_tokens)
    row_len = {id(r): sum(lengths[i] for i in r) for r in rows}
    rows.sort(key=lambda r: -row_len[id(r)])  # longest first: a micro-batch's width is its first row's length
    groups: list[list[list[int]]] = []
    for row in rows:
        if groups and (len(groups[-1]) + 1) * row_len[id(groups[-1][0])] <= token_budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _advantage_row(adv: float | np.ndarray | None, completion_len: int) -> np.ndarray:
    if adv is None:
        return np.zeros(completion_len, dtype=np.float32)
    arr = np.asarray(adv, dtype=np.float32)
    if arr.ndim == 0:
        return np.full(completion_len, float(arr), dtype=np.float32)
    if arr.shape != (completion_len,):
        raise ValueError(f"per-token advantages of shape {arr.shape} for a completion of {completion_len} tokens")
    return arr


Unit = list[int]
"""Sample indices laid out together: one whole sequence, or a shared prompt followed by each sample's completion."""


def _units(samples: Sequence[Sample], indices: Sequence[int], share_prompts: bool, cap: int) -> list[Unit]:
    """``indices`` as units: with ``share_prompts`` the samples of one prompt (equal ``prompt_ids``, in their order)
    go into units of at most ``cap`` tokens (prompt once plus the completions); otherwise one unit per sample."""
    if not share_prompts:
        return [[i] for i in indices]
    by_prompt: dict[bytes, list[int]] = {}
    for i in indices:
        prompt = np.asarray(samples[i].prompt_ids, dtype=np.int64)
        by_prompt.setdefault(prompt.tobytes(), []).append(i)
    units: list[Unit] = []
    for members in by_prompt.values():
        unit: Unit = []
        size = len(samples[members[0]].prompt_ids)
        for i in members:
            c = len(samples[i].completion_ids)
            if unit and size + c > cap:
                units.append(unit)
                unit, size = [], len(samples[i].prompt_ids)
            unit.append(i)
            size += c
        units.append(unit)
    return units


def _unit_length(samples: Sequence[Sample], unit: Unit) -> int:
    return len(samples[unit[0]].prompt_ids) + sum(len(samples[i].completion_ids) for i in unit)


def bucket_size(n: int, minimum: int = 1) -> int:
    """The static-shape size of a dimension of ``n``: the smallest power of two >= ``max(n, minimum)``."""
    return 1 << (max(n, minimum, 1) - 1).bit_length()


Dims = tuple[int, int, int, int]
"""The sizes of a micro-batch: (rows R, row width L, sequences S, completion width C)."""


def _dims(samples: Sequence[Sample], rows: list[list[Unit]], pad_to_multiple_of: int) -> Dims:
    seqs = [i for row in rows for unit in row for i in unit]
    row_len = max((sum(_unit_length(samples, u) for u in row) for row in rows), default=1)
    width_t = max(1, -(-row_len // pad_to_multiple_of) * pad_to_multiple_of)
    width_c = max((len(samples[i].completion_ids) for i in seqs), default=0)
    return max(1, len(rows)), width_t, len(seqs), width_c


def _static_dims(
    samples: Sequence[Sample], plans: Sequence[list[list[Unit]]], pad_to_multiple_of: int, min_rows: int
) -> Dims:
    """One shape for all of ``plans``' micro-batches: each dimension's largest need, rounded up to a power of two (at
    least ``min_rows`` rows)."""
    needs = [_dims(samples, rows, pad_to_multiple_of) for rows in plans] or [_dims(samples, [], 1)]
    r, t, s, c = (max(d) for d in zip(*needs))
    width, cols = bucket_size(t, _MIN_STATIC_WIDTH), bucket_size(c, _MIN_STATIC_WIDTH)
    return bucket_size(r, min_rows), width, bucket_size(s), cols


def episode_tokens(samples: Sequence[Sample], indices: Sequence[int]) -> dict[int, float]:
    """For each of ``indices``, the model tokens of its episode among ``indices`` (``MicroBatch.sequence_tokens``)."""
    members = episode_members([samples[i].group_id for i in indices], [samples[i].episode for i in indices])
    out: dict[int, float] = {}
    for episode in members:
        total = float(sum(samples[indices[j]].num_model_tokens for j in episode))
        out.update((indices[j], total) for j in episode)
    return out


def _build(
    samples: Sequence[Sample],
    rows: list[list[Unit]],
    advantages: Sequence[float | np.ndarray] | None,
    pad_to_multiple_of: int,
    static_dims: Dims | None = None,
    seq_tokens: dict[int, float] | None = None,
) -> MicroBatch:
    """One micro-batch of ``rows``; ``static_dims``: its shape (at least what ``rows`` need), for static shapes;
    ``seq_tokens``: :func:`episode_tokens` of the samples packed in the same call."""
    seqs = [i for row in rows for unit in row for i in unit]
    row_len = [sum(_unit_length(samples, u) for u in row) for row in rows]
    num_rows, width_t, num_seqs, width_c = static_dims or _dims(samples, rows, pad_to_multiple_of)
    static_shapes = static_dims is not None
    shape = (num_rows, width_t)
    tokens, positions, segment_ids = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    prefix_ids = np.full(shape, -1, np.int64)
    completion_ids, gather_index = np.zeros((num_seqs, width_c), np.int64), np.zeros((num_seqs, width_c), np.int64)
    loss_mask, rollout_lp, adv = (np.zeros((num_seqs, width_c), np.float32) for _ in range(3))
    s_row = 0
    for r, row in enumerate(rows):
        start, seg = 0, 0
        for unit in row:
            prompt = samples[unit[0]].prompt_ids
            p, shared = len(prompt), len(unit) > 1
            if shared:  # the prompt once, a segment of its own that every completion of the unit reads
                tokens[r, start : start + p], positions[r, start : start + p] = prompt, np.arange(p)
                segment_ids[r, start : start + p] = seg
                prompt_seg, prompt_last = seg, r * width_t + start + p - 1
                start, seg = start + p, seg + 1
            for i in unit:
                s = samples[i]
                c = len(s.completion_ids)
                # Position t predicts token t+1; a shared prompt's last position predicts every first token.
                if shared:
                    end = start + c
                    tokens[r, start:end], positions[r, start:end] = s.completion_ids, np.arange(p, p + c)
                    prefix_ids[r, start:end] = prompt_seg
                    predictors = np.concatenate([[prompt_last], r * width_t + np.arange(start, end - 1)])[:c]
                else:
                    end = start + p + c
                    tokens[r, start : start + p], tokens[r, start + p : end] = prompt, s.completion_ids
                    positions[r, start:end] = np.arange(p + c)
                    predictors = r * width_t + np.arange(start + p - 1, end - 1)
                segment_ids[r, start:end] = seg
                completion_ids[s_row, :c], gather_index[s_row, :c] = s.completion_ids, predictors
                mask = 1.0 if s.loss_mask is None else s.loss_mask.astype(np.float32)
                loss_mask[s_row, :c] = mask
                rollout_lp[s_row, :c] = s.rollout_logprobs * mask
                adv[s_row, :c] = _advantage_row(None if advantages is None else advantages[i], c) * mask
                start, seg, s_row = end, seg + 1, s_row + 1
        segment_ids[r, start:] = seg  # padding: an id of its own after the row's last one
    t = torch.from_numpy
    slots = np.flatnonzero(loss_mask > 0)
    if static_shapes:  # the head runs at every slot: real ones first (as elsewhere), then the rest at position 0
        padding = np.flatnonzero(loss_mask == 0)
        slots = np.concatenate([slots, np.full(len(padding), loss_mask.size, np.int64)])
        loss_positions = np.concatenate([gather_index.reshape(-1)[slots[: len(slots) - len(padding)]],
                                         np.zeros(len(padding), np.int64)])
    else:
        loss_positions = gather_index.reshape(-1)[slots]
    num_loss = int((loss_mask > 0).sum())
    loss_targets = np.zeros(len(slots), np.int64)
    loss_targets[:num_loss] = completion_ids.reshape(-1)[slots[:num_loss]]
    temps = None
    if any(samples[i].temperature != 1.0 for i in seqs):
        per_row = np.array([samples[i].temperature for i in seqs] + [1.0] * (num_seqs - len(seqs)), np.float32)
        per_slot = np.ones(len(slots), np.float32)
        per_slot[:num_loss] = np.broadcast_to(per_row[:, None], loss_mask.shape).reshape(-1)[slots[:num_loss]]
        temps = t(per_slot)
    return MicroBatch(
        tokens=t(tokens), positions=t(positions), segment_ids=t(segment_ids), completion_ids=t(completion_ids),
        gather_index=t(gather_index), loss_mask=t(loss_mask), rollout_logprobs=t(rollout_lp), advantages=t(adv),
        loss_positions=t(loss_positions.astype(np.int64)), loss_targets=t(loss_targets), loss_slots=t(slots),
        sample_rows=t(np.array(seqs + [len(samples)] * (num_seqs - len(seqs)), np.int64)), sample_indices=seqs,
        sequence_tokens=t(np.array([(seq_tokens or {}).get(i, float(samples[i].num_model_tokens)) for i in seqs]
                                   + [0.0] * (num_seqs - len(seqs)), np.float32)),
        num_tokens=sum(row_len), num_loss_tokens=num_loss, token_temperatures=temps,
        prefix_ids=t(prefix_ids) if any(len(u) > 1 for row in rows for u in row) else None,
    )  # fmt: skip


def _check_prompts(samples: Sequence[Sample], indices: Sequence[int]) -> None:
    for i in indices:
        if len(samples[i].prompt_ids) == 0:
            raise ValueError(f"sample {i} has an empty prompt: nothing predicts its first completion token")


def _lengths(samples: Sequence[Sample]) -> list[int]:
    return [len(s.prompt_ids) + len(s.completion_ids) for s in samples]


def _packed_units(
    samples: Sequence[Sample], units: list[Unit], token_budget: int, row_tokens: int
) -> list[list[list[Unit]]]:
    """Micro-batches as lists of rows of units."""
    lengths = [_unit_length(samples, u) for u in units]
    groups = _group_rows(lengths, range(len(units)), token_budget, row_tokens)
    return [[[units[j] for j in row] for row in rows] for rows in groups]


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


def split_minibatches(num_units: int, num_minibatches: int, seed: int | None = None) -> list[list[int]]:
    """Split the indices ``0 .. num_units - 1`` (samples, or episodes of several samples) into ``num_minibatches``
    near-equal mini-batches (shuffled with ``seed`` if given)."""
    if num_minibatches > num_units:
        raise ValueError(f"{num_minibatches} mini-batches requested for a batch of only {num_units} units")
    order = np.arange(num_units)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(num_units)
    return [sorted(int(i) for i in part) for part in np.array_split(order, num_minibatches)]


def plan_micro_batches(
    samples: Sequence[Sample],
    indices: Sequence[int],
    rank: int,
    num_ranks: int,
    token_budget: int,
    advantages: Sequence[float | np.ndarray] | None = None,
    pad_to_multiple_of: int = 1,
    row_tokens: int | None = None,
    share_prompts: bool = False,
    static_shapes: bool = False,
    min_rows: int = 1,
) -> list[MicroBatch]:
    """This rank's micro-batches for the samples ``indices``: balanced rank split, packing into micro-batches of at
    most ``token_budget`` tokens (padding included), equal counts everywhere.

    Every rank calls this with the same arguments except ``rank`` and gets the same number of micro-batches (the
    shorter lists end with empty ones: a one-token row, no sequence). ``row_tokens`` caps a packed row (None: as long
    as the longest sequence among ``indices``, the same on every rank); a sequence longer than the row cap or the
    budget gets a row / micro-batch of its own. ``advantages[i]`` (indexed like ``samples``) is a scalar broadcast over
    the completion or an array with one value per completion token. Rows are padded to a multiple of
    ``pad_to_multiple_of``. ``share_prompts``: samples with equal ``prompt_ids`` share one copy of the prompt (module
    docstring; the model must then get ``prefix_ids``), and a prompt and the completions packed with it (one unit)
    stay on one rank. ``static_shapes``: every dimension rounded up to a power of two (module docstring), which may
    pass the budget, with at least ``min_rows`` rows (a power of two: the devices SPMD splits the rows over).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    _check_prompts(samples, indices)
    lengths = _lengths(samples)
    if row_tokens is None:
        row_tokens = max((lengths[i] for i in indices), default=1)
    units = _units(samples, indices, share_prompts, min(row_tokens, token_budget))
    unit_lengths = [_unit_length(samples, u) for u in units]
    per_rank = assign_to_ranks(unit_lengths, range(len(units)), num_ranks)
    groups = [_group_rows(unit_lengths, part, token_budget, row_tokens) for part in per_rank]
    plans = [[[[units[j] for j in row] for row in rows] for rows in part] for part in groups]
    flat = [p for part in plans for p in part]
    dims = _static_dims(samples, flat, pad_to_multiple_of, min_rows) if static_shapes else None
    seq_tokens = episode_tokens(samples, indices)
    mine = [_build(samples, rows, advantages, pad_to_multiple_of, dims, seq_tokens) for rows in plans[rank]]
    mine.extend(_build(samples, [], None, 1, dims) for _ in range(max(map(len, groups)) - len(mine)))
    return mine
