"""Packing invariants: every completion token is placed once, aligned with its predictor, under the token budget."""

import numpy as np
import pytest
import torch

from rollout.types import Sample
from trainer.packing import assign_to_ranks, pack_samples, plan_micro_batches, split_minibatches


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


@pytest.mark.parametrize("budget", [16, 64, 200])
def test_pack_places_every_token_once_under_budget(budget: int) -> None:
    samples = _samples(30)
    advantages = [float(i) for i in range(len(samples))]
    mbs = pack_samples(samples, range(len(samples)), budget, advantages)
    seen = sorted(i for mb in mbs for i in mb.sample_indices)
    assert seen == list(range(len(samples)))
    for mb in mbs:
        n = sum(len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in mb.sample_indices)
        assert mb.tokens.shape == (1, n)
        assert n <= budget or len(mb.sample_indices) == 1
        for seg, i in enumerate(mb.sample_indices):
            s = samples[i]
            c = len(s.completion_ids)
            seg_pos = (mb.segment_ids[0] == seg).nonzero().flatten()
            full = np.concatenate([s.prompt_ids, s.completion_ids])
            assert torch.equal(mb.tokens[0, seg_pos], torch.from_numpy(full))
            assert torch.equal(mb.positions[0, seg_pos], torch.arange(len(full)))
            # The predicting positions' targets are exactly the completion tokens.
            idx = mb.gather_index[seg, :c]
            assert torch.equal(mb.targets[0, idx], torch.from_numpy(s.completion_ids))
            assert mb.loss_mask[seg].sum() == c
            assert torch.equal(mb.rollout_logprobs[seg, :c], torch.from_numpy(s.rollout_logprobs))
            assert torch.all(mb.advantages[seg, :c] == float(i))
            assert torch.all(mb.advantages[seg, c:] == 0)


def test_ffd_packs_tightly() -> None:
    samples = _samples(40, seed=1)
    budget = 128
    mbs = pack_samples(samples, range(len(samples)), budget)
    total = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    assert len(mbs) <= -(-total // budget) + 1  # FFD is within one bin of optimal for these sizes
    assert sum(mb.num_tokens for mb in mbs) == total


def test_unpack_is_differentiable_and_masked() -> None:
    samples = _samples(5, seed=2)
    (mb,) = pack_samples(samples, range(5), 10_000)
    x = torch.arange(mb.tokens.shape[1], dtype=torch.float32, requires_grad=True)
    y = mb.unpack(x[None])
    assert y.shape == mb.loss_mask.shape
    assert torch.all(y[mb.loss_mask == 0] == 0)
    y.sum().backward()
    assert x.grad.sum() == mb.loss_mask.sum()


def test_per_token_advantages_and_padding() -> None:
    samples = _samples(3, seed=3)
    adv = [np.arange(len(s.completion_ids), dtype=np.float32) for s in samples]
    (mb,) = pack_samples(samples, range(3), 10_000, adv, pad_to_multiple_of=64)
    assert mb.tokens.shape[1] % 64 == 0
    assert mb.num_tokens == sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    for seg, i in enumerate(mb.sample_indices):
        c = len(samples[i].completion_ids)
        assert torch.equal(mb.advantages[seg, :c], torch.from_numpy(adv[i]))
    with pytest.raises(ValueError, match="per-token advantages"):
        pack_samples(samples, range(3), 100, [np.zeros(1)] * 3)


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
