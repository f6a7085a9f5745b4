"""Advantage estimators on hand-computed cases; GAE also against a plain-Python loop and the Monte-Carlo identity."""

import math
import random

import pytest
import torch

from trainer.rl.advantages import (
    compute_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    rloo_advantages,
    whiten,
)
from trainer.rl.config import GRPOConfig, KLConfig, PPOConfig


def test_grpo_with_std_scaling():
    # mean 0.5, centred +-0.5, unbiased std sqrt(1/3): advantages +-sqrt(3)/2.
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), scale_by_std=True, eps=0.0)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv, torch.tensor([[h, -h, -h, h]]))


def test_grpo_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([[3.0, 3.0, 3.0, 3.0]]), scale_by_std=True, eps=1e-6)
    assert torch.equal(adv, torch.zeros(1, 4))


def test_grpo_without_std_scaling_is_mean_centred_per_group():
    adv = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0], [10.0, 10.0, 13.0]]), scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]]))


def test_rloo_subtracts_the_mean_of_the_others():
    adv = rloo_advantages(torch.tensor([[1.0, 2.0, 3.0, 6.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0]]))


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        grpo_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.ones(3, 1))


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


def test_whiten():
    out = whiten(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0, 0.0]))


def test_compute_advantages_grpo_spreads_group_advantages_and_folds_kl_into_the_reward():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    scores = torch.tensor([1.0, 0.0, 2.0, 4.0])
    cfg = GRPOConfig(group_size=2, scale_advantages_by_std=False)
    adv, returns = compute_advantages(scores, mask, cfg)
    assert returns is None
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [-1.0, -1.0], [1.0, 1.0]]))

    kl = torch.tensor([[1.0, 1.0], [0.0, 7.0], [0.0, 0.0], [0.0, 2.0]])  # 7.0 is off-mask
    cfg = GRPOConfig(group_size=2, scale_advantages_by_std=False, kl=KLConfig(coef=0.5, where="reward"))
    adv, _ = compute_advantages(scores, mask, cfg, kl=kl)  # penalised scores: 0, 0, 2, 3
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0], [0.0, 0.0], [-0.5, -0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="per-token KL"):
        compute_advantages(scores, mask, cfg)
    with pytest.raises(ValueError, match="groups of group_size = 3"):
        compute_advantages(scores, mask, GRPOConfig(group_size=3))


def test_compute_advantages_ppo_runs_gae_on_the_final_score():
    mask = torch.tensor([[1, 1, 1]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    cfg = PPOConfig(gamma=0.9, lam=0.8, whiten_advantages=False)
    adv, ret = compute_advantages(torch.tensor([1.0]), mask, cfg, values=values)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]))
    with pytest.raises(ValueError, match="values"):
        compute_advantages(torch.tensor([1.0]), mask, cfg)


def test_compute_advantages_ppo_with_kl_in_the_reward():
    # gamma = lam = 1 and zero values: advantages are rewards-to-go of [-0.1, -0.2 + 1].
    cfg = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False, kl=KLConfig(coef=0.5, where="reward"))
    adv, ret = compute_advantages(torch.tensor([1.0]), torch.ones(1, 2), cfg, kl=torch.tensor([[0.2, 0.4]]),
                                  values=torch.zeros(1, 2))  # fmt: skip
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.8]]))
    torch.testing.assert_close(ret, adv)
