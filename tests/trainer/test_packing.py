"""Packing invariants: every completion token is placed once, aligned with its predictor, under the token budget."""

import numpy as np
import pytest
import torch

from rollout.types import Sample
from trainer.packing import assign_to_ranks, plan_micro_batches, split_minibatches


def _samples(num: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        p, c = int(rng.integers(1, 12)), int(rng.integers(0, 40))
        out.append(
            Sample(
                prompt_ids=rng.integers(1, 100, p),
                completion_ids=rng.integers(1, 100, c),
                rollout_logprobs=-rng.random(c).astype(np.float32),
                reward=float(rng.random()),
                group_id=i // 4,
                policy_version=0,
            )
        )
    return out


@pytest.mark.parametrize("budget, row_tokens", [(16, None), (64, None), (200, None), (200, 48), (128, 60)])
def test_pack_places_every_token_once_under_budget(budget: int, row_tokens: int | None) -> None:
    samples = _samples(30)
    advantages = [float(i) for i in range(len(samples))]
    mbs = plan_micro_batches(samples, range(len(samples)), 0, 1, budget, advantages, row_tokens=row_tokens)
    seen = sorted(i for mb in mbs for i in mb.sample_indices)
    assert seen == list(range(len(samples)))
    cap = min(budget, row_tokens or budget)
    for mb in mbs:
        rows, width = mb.tokens.shape
        assert rows * width <= budget or rows == 1
        lengths = [len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in mb.sample_indices]
        assert mb.num_tokens == sum(lengths)
        row_of = [int(mb.gather_index[k, 0]) // width if len(samples[i].completion_ids) else None
                  for k, i in enumerate(mb.sample_indices)]
        for r in set(row_of) - {None}:
            members = [n for n, row in zip(lengths, row_of) if row == r]
            assert sum(members) <= cap or len(members) == 1
        for seg_row, i in enumerate(mb.sample_indices):
            s = samples[i]
            c = len(s.completion_ids)
            full = np.concatenate([s.prompt_ids, s.completion_ids])
            # The row holding this sequence, and its span inside the row.
            first = int(mb.gather_index[seg_row, 0]) - len(s.prompt_ids) + 1 if c else None
            if first is not None:
                r, t0 = divmod(first, width)
                span = slice(t0, t0 + len(full))
                assert torch.equal(mb.tokens[r, span], torch.from_numpy(full))
                assert torch.equal(mb.positions[r, span], torch.arange(len(full)))
                assert len(set(mb.segment_ids[r, span].tolist())) == 1
            # Each completion token is predicted by the position holding the token before it.
            idx = mb.gather_index[seg_row, :c]
            assert torch.equal(mb.tokens.reshape(-1)[idx], torch.from_numpy(full[len(s.prompt_ids) - 1 : -1]))
            assert torch.equal(mb.completion_ids[seg_row, :c], torch.from_numpy(s.completion_ids))
            assert mb.loss_mask[seg_row].sum() == c
            assert torch.equal(mb.rollout_logprobs[seg_row, :c], torch.from_numpy(s.rollout_logprobs))
            assert torch.all(mb.advantages[seg_row, :c] == float(i))
            assert torch.all(mb.advantages[seg_row, c:] == 0)


def test_rows_keep_sequences_apart() -> None:
    samples = _samples(12, seed=5)
    (mb,) = plan_micro_batches(samples, range(12), 0, 1, 10_000, row_tokens=60)
    longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    assert mb.tokens.shape[0] > 1 and mb.tokens.shape[1] <= max(60, longest)
    width = mb.tokens.shape[1]
    row_of = (mb.gather_index[:, 0] // width).tolist()
    for r in range(mb.tokens.shape[0]):
        used = sum(len(samples[i].prompt_ids) + len(samples[i].completion_ids)
                   for i, row in zip(mb.sample_indices, row_of) if row == r)
        seg, pos = mb.segment_ids[r, :used], mb.positions[r, :used]
        # The segment id changes exactly where positions restart at 0; padding after `used` has an id of its own.
        assert torch.equal(seg[1:] != seg[:-1], pos[1:] == 0)
        assert torch.all(mb.segment_ids[r, used:] > seg.max())


def test_ffd_packs_tightly() -> None:
    samples = _samples(40, seed=1)
    budget = 128
    mbs = plan_micro_batches(samples, range(len(samples)), 0, 1, budget, row_tokens=budget)
    total = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    assert len(mbs) <= -(-total // budget) + 1  # FFD is within one bin of optimal for these sizes
    assert sum(mb.num_tokens for mb in mbs) == total


def test_unpack_is_differentiable_and_masked() -> None:
    samples = _samples(5, seed=2)
    (mb,) = plan_micro_batches(samples, range(5), 0, 1, 10_000, row_tokens=40)
    x = torch.arange(mb.tokens.numel(), dtype=torch.float32, requires_grad=True)
    y = mb.unpack(x.view(mb.tokens.shape))
    assert y.shape == mb.loss_mask.shape
    assert torch.all(y[mb.loss_mask == 0] == 0)
    y.sum().backward()
    assert x.grad.sum() == mb.loss_mask.sum()


def test_per_token_advantages_and_padding() -> None:
    samples = _samples(3, seed=3)
    adv = [np.arange(len(s.completion_ids), dtype=np.float32) for s in samples]
    (mb,) = plan_micro_batches(samples, range(3), 0, 1, 10_000, adv, pad_to_multiple_of=64, row_tokens=10_000)
    assert mb.tokens.shape[1] % 64 == 0
    assert mb.num_tokens == sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    for seg, i in enumerate(mb.sample_indices):
        c = len(samples[i].completion_ids)
        assert torch.equal(mb.advantages[seg, :c], torch.from_numpy(adv[i]))
    with pytest.raises(ValueError, match="per-token advantages"):
        plan_micro_batches(samples, range(3), 0, 1, 100, [np.zeros(1)] * 3, row_tokens=100)


def test_rank_split_is_balanced_and_counts_match() -> None:
    samples = _samples(33, seed=4)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    parts = assign_to_ranks(lengths, range(33), 3)
    assert sorted(i for p in parts for i in p) == list(range(33))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)
    plans = [plan_micro_batches(samples, range(33), r, 3, 64) for r in range(3)]
    assert len({len(p) for p in plans}) == 1
    assert sorted(i for p in plans for mb in p for i in mb.sample_indices) == list(range(33))


def test_split_minibatches() -> None:
    parts = split_minibatches(10, 3, seed=0)
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert [len(p) for p in parts] == [4, 3, 3]
    with pytest.raises(ValueError):
        split_minibatches(2, 3)


def test_scatter_of_loss_positions_equals_unpack() -> None:
    """The step runs the output head only at ``loss_positions``; scattering back must equal unpacking a full map."""
    samples = _samples(9, seed=6)
    for mb in plan_micro_batches(samples, range(9), 0, 1, 120, row_tokens=60):
        full = torch.randn(mb.tokens.shape, requires_grad=True)
        picked = full.reshape(-1)[mb.loss_positions]
        assert picked.shape == (mb.num_loss_tokens,)
        assert torch.equal(mb.scatter(picked), mb.unpack(full))
        mb.scatter(picked).sum().backward()
        assert full.grad.sum() == mb.num_loss_tokens


def test_one_row_per_micro_batch_has_no_padding() -> None:
    """Rows as long as the budget (segment-local attention): each micro-batch is one row, no padding at all."""
    samples = _samples(30, seed=7)
    mbs = plan_micro_batches(samples, range(30), 0, 1, 128, row_tokens=128)
    assert all(mb.tokens.shape[0] == 1 and mb.tokens.shape[1] == mb.num_tokens for mb in mbs)
    assert sum(mb.num_tokens for mb in mbs) == sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)


def test_static_shapes_give_every_micro_batch_one_power_of_two_shape() -> None:
    """Under ``static_shapes`` the micro-batches of a call share one shape of powers of two, the padding carries no
    loss, and the real completion tokens sit where the unpadded layout has them."""
    samples = _samples(40, seed=3)
    plain = plan_micro_batches(samples, range(40), 0, 1, 96, row_tokens=48)
    static = plan_micro_batches(samples, range(40), 0, 1, 96, row_tokens=48, static_shapes=True)
    assert [mb.sample_indices for mb in static] == [mb.sample_indices for mb in plain]
    shapes = {(*mb.tokens.shape, *mb.loss_mask.shape, *mb.loss_positions.shape) for mb in static}
    assert len(shapes) == 1
    ((rows, width, seqs, cols, heads),) = shapes
    assert all(n & (n - 1) == 0 for n in (rows, width, seqs, cols)) and heads == seqs * cols
    assert rows >= max(mb.tokens.shape[0] for mb in plain) and cols >= max(mb.loss_mask.shape[1] for mb in plain)
    for p, s in zip(plain, static):
        n, (num_seqs, c) = p.num_loss_tokens, p.loss_mask.shape
        assert s.num_loss_tokens == n and int(s.loss_mask.sum()) == n
        assert s.sample_rows.tolist() == p.sample_indices + [len(samples)] * (seqs - num_seqs)
        # The head's first n slots are the real tokens, in the plain order; the rest point at position 0.
        t_plain, t_static = p.tokens.shape[1], s.tokens.shape[1]
        row, col = p.loss_positions // t_plain, p.loss_positions % t_plain
        assert torch.equal(s.loss_positions[:n], row * t_static + col)
        assert torch.equal(s.loss_targets[:n], p.loss_targets) and not s.loss_positions[n:].any()
        values = torch.randn(heads)
        scattered = s.scatter(values)
        assert torch.equal(scattered[:num_seqs, :c], p.scatter(values[:n]))
        assert not scattered[num_seqs:].any() and not scattered[:, c:].any()
