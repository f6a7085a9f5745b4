"""Importance weights (token / sequence / geometric, truncated or masked) and the fidelity metrics, on hand-computed
cases; long synthetic completions show the product weights collapse with length and the geometric ones do not."""

import math

import pytest
import torch

from trainer.rl.importance import importance_weights, rollout_fidelity_metrics

LN = math.log


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def test_token_level_weights_and_metrics():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    old = rollout.detach() + torch.tensor([[LN(3), LN(0.5), 0.0, 9.0]])  # the last token is off-mask
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m = importance_weights(old, rollout, mask, "token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert not w.requires_grad
    assert m["is_ratio_mean"] == pytest.approx((3 + 0.5 + 1) / 3)
    assert m["is_ratio_min"] == pytest.approx(0.5) and m["is_ratio_max"] == pytest.approx(3.0)
    assert m["is_weight_mean"] == pytest.approx((2 + 0.5 + 1) / 3)
    assert m["is_frac_capped"] == pytest.approx(1 / 3) and "is_frac_masked" not in m


def test_sequence_level_uses_the_product_of_token_ratios():
    rollout = torch.zeros(2, 2)
    old = torch.tensor([[LN(2), LN(3)], [LN(0.5), LN(5)]])
    mask = torch.tensor([[1, 1], [1, 0]])
    w, m = importance_weights(old, rollout, mask, "sequence", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.5, 0.0]]))
    assert m["is_ratio_mean"] == pytest.approx((6 + 0.5) / 2)
    assert m["is_ratio_max"] == pytest.approx(6.0) and m["is_ratio_min"] == pytest.approx(0.5)
    assert m["is_weight_mean"] == pytest.approx((2 + 0.5) / 2)
    assert m["is_frac_capped"] == pytest.approx(0.5)


def test_geometric_level_uses_the_geometric_mean_of_token_ratios():
    rollout = torch.zeros(2, 3)
    old = torch.tensor([[LN(2), LN(4), LN(0.5)], [LN(9), 0.0, LN(7)]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w, m = importance_weights(old, rollout, mask, "geometric", cap=2.0)
    # (2 * 4 * 0.5) ** (1/3) = 2 ** (2/3); the second completion has one token: 9, capped at 2.
    g = 2 ** (2 / 3)
    torch.testing.assert_close(w, torch.tensor([[g, g, g], [2.0, 0.0, 0.0]]))
    assert m["is_ratio_mean"] == pytest.approx((g + 9) / 2) and m["is_weight_mean"] == pytest.approx((g + 2) / 2)
    assert m["is_frac_capped"] == pytest.approx(0.5)


def test_truncate_with_a_lower_bound_raises_small_weights():
    rollout = torch.zeros(1, 3)
    old = torch.tensor([[LN(0.1), LN(0.8), LN(3)]])
    w, m = importance_weights(old, rollout, torch.ones(1, 3), "token", cap=2.0, lower_bound=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.8, 2.0]]))
    assert m["is_frac_capped"] == pytest.approx(2 / 3) and m["is_ratio_min"] == pytest.approx(0.1)


def test_mask_mode_zeroes_tokens_beyond_either_bound_and_keeps_the_others_exact():
    rollout = torch.zeros(1, 5)
    old = torch.tensor([[LN(0.1), LN(0.8), LN(1.9), LN(3), 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w, m = importance_weights(old, rollout, mask, "token", cap=2.0, mode="mask", lower_bound=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.8, 1.9, 0.0, 0.0]]))
    assert m["is_frac_masked"] == pytest.approx(0.5) and "is_frac_capped" not in m
    assert m["is_weight_mean"] == pytest.approx((0.8 + 1.9) / 4)
    # Without a lower bound only the upper one masks.
    w, m = importance_weights(old, rollout, mask, "token", cap=2.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[0.1, 0.8, 1.9, 0.0, 0.0]]))
    assert m["is_frac_masked"] == pytest.approx(0.25)


def test_mask_mode_at_sequence_level_drops_whole_completions():
    rollout = torch.zeros(3, 2)
    old = torch.tensor([[LN(2), LN(3)], [LN(0.5), LN(1.5)], [LN(0.2), LN(0.5)]])
    mask = torch.ones(3, 2)
    w, m = importance_weights(old, rollout, mask, "sequence", cap=2.0, mode="mask", lower_bound=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [0.75, 0.75], [0.0, 0.0]]))
    assert m["is_frac_masked"] == pytest.approx(2 / 3)


def test_the_t_mismatch_example_of_issue_13():
    """Logits [2, 1, 0]: the trainer at T = 1 against an engine sampling at T = 0.6 gives weights 0.81, 1.59, 3.09."""
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    old, rollout = torch.log_softmax(logits, -1), torch.log_softmax(logits / 0.6, -1)
    p, q = old.exp()[0], rollout.exp()[0]
    torch.testing.assert_close(p, torch.tensor([0.665, 0.245, 0.090]), atol=1e-3, rtol=0)
    torch.testing.assert_close(q, torch.tensor([0.817, 0.154, 0.029]), atol=1e-3, rtol=0)
    ratios = p / q
    torch.testing.assert_close(ratios, torch.tensor([0.81, 1.59, 3.09]), atol=0.01, rtol=0)
    mask = torch.ones(1, 3)
    truncated, m = importance_weights(old, rollout, mask, "token", cap=2.0)
    torch.testing.assert_close(truncated[0], torch.stack([ratios[0], ratios[1], torch.tensor(2.0)]))
    assert m["is_frac_capped"] == pytest.approx(1 / 3)
    masked, m = importance_weights(old, rollout, mask, "token", cap=2.0, mode="mask")
    torch.testing.assert_close(masked[0], torch.stack([ratios[0], ratios[1], torch.tensor(0.0)]))
    assert m["is_frac_masked"] == pytest.approx(1 / 3)
    f = rollout_fidelity_metrics(old, rollout, mask)
    assert f["logprob_gap_max"] == pytest.approx(LN(3.09), abs=0.01)
    # KL(rollout || trainer) per token, from three tokens only, is not the exact KL; the exact k3 values are:
    r = (old - rollout)[0]
    assert f["rollout_kl"] == pytest.approx((r.exp() - 1 - r).mean().item())


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_equal_log_probs_give_weight_exactly_one(level, mode):
    logp = torch.randn(3, 4)
    w, m = importance_weights(logp, logp.clone(), torch.ones(3, 4), level, cap=1.0, mode=mode, lower_bound=None)
    assert torch.equal(w, torch.ones(3, 4))
    frac = "is_frac_capped" if mode == "truncate" else "is_frac_masked"
    assert m == {"is_ratio_mean": 1.0, "is_ratio_min": 1.0, "is_ratio_max": 1.0, "is_weight_mean": 1.0, frac: 0.0}
    assert rollout_fidelity_metrics(logp, logp.clone(), torch.ones(3, 4)) == {
        "logprob_gap": 0.0,
        "logprob_gap_max": 0.0,
        "rollout_kl": 0.0,
    }


def test_huge_sequence_ratio_stays_finite():
    old = torch.full((1, 200), 5.0)  # e^1000 uncapped
    for mode, expected in (("truncate", 2.0), ("mask", 0.0)):
        w, m = importance_weights(old, torch.zeros(1, 200), torch.ones(1, 200), "sequence", cap=2.0, mode=mode)
        assert torch.equal(w, torch.full((1, 200), expected))
        assert math.isfinite(m["is_ratio_mean"]) and math.isfinite(m["is_ratio_max"])
    f = rollout_fidelity_metrics(torch.full((1, 2), 100.0), torch.zeros(1, 2), torch.ones(1, 2))
    assert all(math.isfinite(v) for v in f.values())


def test_fidelity_metrics_hand_computed_and_independent_of_padding():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    old = rollout + torch.tensor([[LN(3), LN(0.5), 0.0, 50.0]])  # the last token is padding
    f = rollout_fidelity_metrics(old, rollout, torch.tensor([[1, 1, 1, 0]]))
    assert f["logprob_gap"] == pytest.approx((LN(3) + LN(2)) / 3)
    assert f["logprob_gap_max"] == pytest.approx(LN(3))
    assert f["rollout_kl"] == pytest.approx(((3 - 1 - LN(3)) + (0.5 - 1 - LN(0.5))) / 3)
    empty = rollout_fidelity_metrics(old, rollout, torch.zeros(1, 4))
    assert empty == {"logprob_gap": 0.0, "logprob_gap_max": 0.0, "rollout_kl": 0.0}


def test_rollout_kl_is_exact_in_expectation_over_the_rollout_distribution():
    """Ten tokens drawn in exactly the rollout's proportions: the k3 mean is KL(rollout || trainer) exactly."""
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # rollout
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)  # trainer
    tokens = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    f = rollout_fidelity_metrics(p.log()[tokens][None], q.log()[tokens][None], torch.ones(1, 10))
    assert f["rollout_kl"] == pytest.approx((q * (q.log() - p.log())).sum().item(), rel=1e-12)


def test_long_completions_collapse_product_weights_but_not_geometric_ones():
    """Issue 13: a per-token gap of sd 0.05 between trainer and engine (mean -sd^2/2, so that the engine's sampling
    keeps E[ratio] = 1). The capped product weight of a completion of n tokens is E[min(e^X, 2)] with
    X ~ N(-n sd^2 / 2, n sd^2): about 0.97 at 100 tokens, 0.24 at 3,000 (median e^-3.75 = 0.024). The log of the
    geometric weight is the mean gap, of sd 0.05 / sqrt(n): its weights stay near 1 at every length."""
    sd, cap, num_seqs = 0.05, 2.0, 2000
    g = torch.Generator().manual_seed(0)

    def capped_product_mean(n: int) -> float:  # E[min(e^X, cap)] in closed form
        mu, s = -n * sd**2 / 2, sd * math.sqrt(n)
        return math.exp(mu + s**2 / 2) * _normal_cdf((LN(cap) - mu - s**2) / s) + cap * (
            1 - _normal_cdf((LN(cap) - mu) / s)
        )

    assert capped_product_mean(100) == pytest.approx(0.974, abs=1e-3)
    assert capped_product_mean(3000) == pytest.approx(0.237, abs=1e-3)
    for n in (100, 3000):
        rollout = -torch.rand(num_seqs, n, generator=g) * 3
        old = rollout + (-(sd**2) / 2 + sd * torch.randn(num_seqs, n, generator=g))
        mask = torch.ones(num_seqs, n)
        product, m_prod = importance_weights(old, rollout, mask, "sequence", cap=cap)
        geometric, m_geo = importance_weights(old, rollout, mask, "geometric", cap=cap)
        seq_product, seq_geometric = product[:, 0], geometric[:, 0]
        assert m_prod["is_weight_mean"] == pytest.approx(seq_product.mean().item(), rel=1e-5)
        # Standard error of a capped weight's mean over 2,000 completions is below 0.02.
        assert m_prod["is_weight_mean"] == pytest.approx(capped_product_mean(n), abs=0.04)
        # The log of a geometric weight is the mean gap: sd 0.05 / sqrt(n), so every completion is within 5 sd.
        assert (seq_geometric.log() + sd**2 / 2).abs().max().item() < 5 * sd / math.sqrt(n)
        assert m_geo["is_weight_mean"] == pytest.approx(math.exp(-(sd**2) / 2), abs=1e-3)
        assert m_geo["is_frac_capped"] == 0.0
    assert m_prod["is_weight_mean"] < 0.3 and seq_product.median().item() < 0.05  # n = 3,000: collapsed
    assert m_prod["is_frac_capped"] == pytest.approx(1 - _normal_cdf((LN(cap) + 3.75) / (sd * math.sqrt(3000))),
                                                     abs=0.02)  # fmt: skip


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cap"):
        importance_weights(x, x, x, "token", cap=0.5)
    with pytest.raises(ValueError, match="level"):
        importance_weights(x, x, x, "chunk", cap=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        importance_weights(x, x, x, "token", cap=2.0, mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lower_bound"):
        importance_weights(x, x, x, "token", cap=2.0, lower_bound=2.0)
