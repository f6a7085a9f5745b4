"""Truncated importance weights at token and sequence level, on hand-computed cases."""

import math

import pytest
import torch

from trainer.rl.importance import truncated_importance_weights

LN = math.log


def test_token_level_weights_and_metrics():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    old = rollout.detach() + torch.tensor([[LN(3), LN(0.5), 0.0, 9.0]])  # the last token is off-mask
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m = truncated_importance_weights(old, rollout, mask, "token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert not w.requires_grad
    assert m["is_ratio_mean"] == pytest.approx((3 + 0.5 + 1) / 3)
    assert m["is_ratio_max"] == pytest.approx(3.0)
    assert m["is_frac_capped"] == pytest.approx(1 / 3)
    assert m["logprob_gap"] == pytest.approx((LN(3) + LN(2) + 0) / 3)


def test_sequence_level_uses_the_product_of_token_ratios():
    rollout = torch.zeros(2, 2)
    old = torch.tensor([[LN(2), LN(3)], [LN(0.5), LN(5)]])
    mask = torch.tensor([[1, 1], [1, 0]])
    w, m = truncated_importance_weights(old, rollout, mask, "sequence", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.5, 0.0]]))
    assert m["is_ratio_mean"] == pytest.approx((6 + 0.5) / 2)
    assert m["is_ratio_max"] == pytest.approx(6.0)
    assert m["is_frac_capped"] == pytest.approx(0.5)
    assert m["logprob_gap"] == pytest.approx((LN(2) + LN(3) + LN(2)) / 3)


def test_equal_log_probs_give_weight_exactly_one():
    logp = torch.randn(3, 4)
    w, m = truncated_importance_weights(logp, logp.clone(), torch.ones(3, 4), "sequence", cap=1.0)
    assert torch.equal(w, torch.ones(3, 4))
    assert m == {"is_ratio_mean": 1.0, "is_ratio_max": 1.0, "is_frac_capped": 0.0, "logprob_gap": 0.0}


def test_huge_sequence_ratio_stays_finite():
    old = torch.full((1, 200), 5.0)  # e^1000 uncapped
    w, m = truncated_importance_weights(old, torch.zeros(1, 200), torch.ones(1, 200), "sequence", cap=2.0)
    assert torch.equal(w, torch.full((1, 200), 2.0))
    assert math.isfinite(m["is_ratio_mean"]) and m["is_frac_capped"] == 1.0


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(x, x, x, "token", cap=0.5)
    with pytest.raises(ValueError, match="level"):
        truncated_importance_weights(x, x, x, "chunk", cap=2.0)
