"""Advantage estimators on hand-computed cases; GAE also against a plain-Python loop and the Monte-Carlo identity.

These are the functions the step runs (through ``trainer.rl.algorithms``; ``test_rl_algorithms`` tests that wiring).
"""

import math
import random

import pytest
import torch

from trainer.rl.advantages import (
    compute_group_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    whiten,
    whitening_moments,
)
from trainer.rl.config import GRPOConfig


def test_grpo_with_std_scaling():
    # mean 0.5, centred +-0.5, unbiased std sqrt(1/3): advantages +-sqrt(3)/2.
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), scale_by_std=True, eps=0.0)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv, torch.tensor([[h, -h, -h, h]]))


def test_grpo_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([[3.0, 3.0, 3.0, 3.0]]), scale_by_std=True, eps=1e-6)
    assert torch.equal(adv, torch.zeros(1, 4))


def test_grpo_without_std_scaling_is_mean_centred_per_group():
    adv = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0], [10.0, 10.0, 13.0]]), scale_by_std=False, eps=1e-6)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]]))


def test_rloo_subtracts_the_mean_of_the_others():
    adv = rloo_advantages(torch.tensor([[1.0, 2.0, 3.0, 6.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0]]))


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        grpo_advantages(torch.ones(3, 1), scale_by_std=True, eps=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.ones(3, 1))


def test_group_advantages_of_a_batch_compare_each_sample_with_its_own_group():
    # Groups 7 and 3 interleaved and of different sizes: each is normalised on its own.
    rewards = torch.tensor([1.0, 10.0, 2.0, 13.0, 3.0, 10.0], dtype=torch.float64)
    group_ids = [7, 3, 7, 3, 7, 3]
    dr_grpo = GRPOConfig(group_size=3, scale_advantages_by_std=False)
    adv = compute_group_advantages(rewards, group_ids, dr_grpo)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, torch.tensor([-1.0, -1.0, 0.0, 2.0, 1.0, -1.0], dtype=torch.float64))
    rloo = GRPOConfig(group_size=3, advantage_estimator="rloo", scale_advantages_by_std=False)
    torch.testing.assert_close(compute_group_advantages(rewards, group_ids, rloo), 1.5 * adv)
    grpo = compute_group_advantages(rewards[[0, 2, 4]], [7, 7, 7], GRPOConfig(group_size=3))
    torch.testing.assert_close(grpo, torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) / (1 + 1e-6))  # std 1
    with pytest.raises(ValueError, match="at least 2"):
        compute_group_advantages(rewards[:3], [0, 0, 1], dr_grpo)


def test_expand_to_tokens():
    out = expand_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_gae_hand_computed_with_variable_lengths_and_a_hole():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0], [0.5, 9.0, 0.7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: deltas 0.04, 0.03, 0.3; A2 = 0.3, A1 = 0.03 + 0.72 * 0.3, A0 = 0.04 + 0.72 * A1.
    # row 1: the episode ends at t=1: A1 = 2 - 1 = 1, A0 = (0.9 * 1 - 1) + 0.72 * 1.
    # row 2: t=1 is masked out, so t=0 links straight to t=2: A0 = (0.9 * 0.7 - 0.5) + 0.72 * 0.3.
    expected = torch.tensor([[0.21712, 0.246, 0.3], [0.62, 1.0, 0.0], [0.346, 0.0, 0.3]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain-Python GAE over the masked-in tokens of each row."""
    out = []
    for r, v, m in zip(rewards, values, mask):
        idx = [t for t in range(len(m)) if m[t]]
        row = [0.0] * len(m)
        running = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            next_v = v[idx[j + 1]] if j + 1 < len(idx) else 0.0
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            row[t] = running
        out.append(row)
    return out


def test_gae_matches_plain_python_on_random_batches():
    rng = random.Random(0)
    b, t = 5, 9
    rewards = [[rng.uniform(-1, 1) for _ in range(t)] for _ in range(b)]
    values = [[rng.uniform(-1, 1) for _ in range(t)] for _ in range(b)]
    mask = [[1] * n + [0] * (t - n) for n in (9, 4, 1, 7, 0)]
    adv, _ = gae_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64),
                            torch.tensor(mask), gamma=0.97, lam=0.9)  # fmt: skip
    torch.testing.assert_close(adv, torch.tensor(_gae_reference(rewards, values, mask, 0.97, 0.9), dtype=torch.float64))


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    values = torch.tensor([[0.3, 0.1, -0.2, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.2, 0.9, 2.2, 0.0]]))


def test_gae_of_a_micro_batch_without_completion_tokens_is_empty():
    """Regression: the empty filler micro-batches of a multi-rank PPO step ([S, 0]) crashed GAE."""
    adv, ret = gae_advantages(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), gamma=1.0, lam=0.95)
    assert adv.shape == ret.shape == (2, 0)


def test_whiten():
    out = whiten(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    # One value has no spread: no signal, where it failed the run (a PPO batch of one generated token)
    assert torch.equal(whiten(torch.tensor([1.0, 2.0]), torch.tensor([1, 0])), torch.zeros(2))


def test_whiten_with_moments_summed_over_parts_equals_whitening_the_whole():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    parts = [slice(0, 2), slice(2, 5)]  # e.g. two micro-batches (or ranks) of one batch
    moments = sum((whitening_moments(x[p], mask[p]) for p in parts), start=torch.zeros(3, dtype=torch.float64))
    whole = whiten(x, mask)
    for p in parts:
        torch.testing.assert_close(whiten(x[p], mask[p], moments), whole[p])
    n = int(mask.sum())
    on = whole[mask > 0].double()
    assert on.mean().item() == pytest.approx(0.0, abs=1e-6) and on.std().item() == pytest.approx(1.0, abs=1e-6)
    assert whitening_moments(x, mask)[0].item() == n and torch.equal(whole[mask == 0], torch.zeros(5 * 7 - n))
