"""Clipped policy loss: asymmetric clip bounds, GSPO's sequence ratio, weights, aggregation; hand-computed cases."""

import math

import pytest
import torch

from trainer.rl.policy_loss import clipped_policy_loss, policy_ratio

LN = math.log


def _logprobs(log_ratios):
    """Policy log-probs (a leaf with grad) and old log-probs whose difference is ``log_ratios``."""
    old = torch.full((len(log_ratios), len(log_ratios[0])), -1.0)
    logp = (old + torch.tensor(log_ratios)).requires_grad_()
    return logp, old


def test_token_ratio_clipping_with_separate_low_and_high_bounds():
    # ratios 1.5 (A=1, upper bound active), 0.5 (A=-1, lower bound active), 1.1 (A=2), 0.9 (A=1).
    logp, old = _logprobs([[LN(1.5), LN(0.5), LN(1.1), LN(0.9)]])
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    loss, m = clipped_policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2 - 0.9) / 4)
    loss.backward()
    # Clipped tokens get no gradient; the others get -A * ratio / num_tokens.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -2 * 1.1 / 4, -0.9 / 4]]))
    assert m["clip_frac_low"] == pytest.approx(0.25) and m["clip_frac_high"] == pytest.approx(0.25)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["ratio_min"] == pytest.approx(0.5) and m["ratio_max"] == pytest.approx(1.5)


def test_pessimistic_side_is_never_clipped():
    # ratio 1.5 with A < 0 (and 0.5 with A > 0): the unclipped term is the larger loss, so the gradient flows.
    logp, old = _logprobs([[LN(1.5), LN(0.5)]])
    loss, m = clipped_policy_loss(logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((1.5 - 0.5) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.5 / 2, -0.5 / 2]]))
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0


def test_clip_higher_lets_a_ratio_through_that_symmetric_clipping_stops():
    logp, old = _logprobs([[LN(1.25)]])
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    symmetric, m_sym = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    higher, m_high = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert symmetric.item() == pytest.approx(-1.2) and m_sym["clip_frac_high"] == 1.0
    assert higher.item() == pytest.approx(-1.25) and m_high["clip_frac_high"] == 0.0


def test_masked_tokens_do_not_count():
    logp, old = _logprobs([[LN(1.1), LN(7.0)], [LN(0.9), 0.0]])
    adv = torch.tensor([[1.0, 100.0], [1.0, 100.0]])
    mask = torch.tensor([[1, 0], [1, 0]])
    loss, m = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-(1.1 + 0.9) / 2)
    assert m["ratio_max"] == pytest.approx(1.1)
    loss.backward()
    assert logp.grad[:, 1].abs().sum() == 0


def test_weights_multiply_each_token_loss():
    logp, old = _logprobs([[0.0, 0.0]])
    loss, _ = clipped_policy_loss(logp, old, torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), clip_low=0.2,
                                  clip_high=0.2, weights=torch.tensor([[2.0, 0.5]]))  # fmt: skip
    assert loss.item() == pytest.approx((-2.0 - 1.5) / 2)


def test_aggregation_modes_reach_the_loss():
    logp, old = _logprobs([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    kw = dict(clip_low=0.2, clip_high=0.2)
    token_mean, _ = clipped_policy_loss(logp, old, adv, mask, aggregation="token_mean", **kw)
    seq_mean, _ = clipped_policy_loss(logp, old, adv, mask, aggregation="seq_mean_token_mean", **kw)
    sum_norm, _ = clipped_policy_loss(logp, old, adv, mask, aggregation="token_sum_norm", norm_length=8, **kw)
    assert token_mean.item() == pytest.approx(-(3 + 4) / 4)
    assert seq_mean.item() == pytest.approx(-(1 + 4) / 2)
    assert sum_norm.item() == pytest.approx(-(3 + 4) / (2 * 8))


def test_gspo_sequence_ratio_is_the_length_normalised_geometric_mean():
    # row 0: log-ratios ln2, 0, ln(1/2) -> mean 0 -> s = 1; row 1: ln4, 0 over 2 tokens -> s = 2.
    logp, old = _logprobs([[LN(2), 0.0, LN(0.5), 5.0], [LN(4), 0.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ratio = policy_ratio(logp, old, mask.float(), "sequence")
    torch.testing.assert_close(ratio * mask, torch.tensor([[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]))

    adv = torch.ones(2, 4)
    loss, m = clipped_policy_loss(logp, old, adv, mask, clip_low=0.5, clip_high=10.0, ratio_level="sequence",
                                  aggregation="seq_mean_token_mean")  # fmt: skip
    assert loss.item() == pytest.approx((-1.0 - 2.0) / 2)
    loss.backward()
    # GSPO: d(-A_i s_i)/d logp_t = -A_i s_i / |y_i|, then the mean over the 2 sequences.
    expected = torch.tensor([[-1 / 3 / 2] * 3 + [0.0], [-2 / 2 / 2] * 2 + [0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    assert m["ratio_max"] == pytest.approx(2.0)


def test_gspo_clips_whole_sequences():
    logp, old = _logprobs([[LN(4), 0.0]])
    loss, m = clipped_policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), clip_low=3e-4, clip_high=4e-4,
                                  ratio_level="sequence", aggregation="seq_mean_token_mean")  # fmt: skip
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2)) and m["clip_frac_high"] == 1.0


def test_unknown_ratio_level():
    with pytest.raises(ValueError, match="ratio level"):
        policy_ratio(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "chunk")


def test_dual_clip_bounds_the_loss_of_negative_advantages_with_huge_ratios():
    # ratio 4 with A = -1: loss max(4, 1.2) = 4, bounded at c = 3 (no gradient); ratio 2 with A = -1 stays 2; ratio 4
    # with A = +1 is clipped at 1.2 as usual; ratio 0.5 with A = -1 is clipped at 0.8 as usual.
    logp, old = _logprobs([[LN(4), LN(2), LN(4), LN(0.5)]])
    adv, mask = torch.tensor([[-1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4)
    plain, m_plain = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert plain.item() == pytest.approx((4 + 2 - 1.2 + 0.8) / 4) and "clip_frac_dual" not in m_plain
    loss, m = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3 + 2 - 1.2 + 0.8) / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2 / 4, 0.0, 0.0]]))
    assert m["clip_frac_dual"] == pytest.approx(0.25)


def test_dual_clip_changes_nothing_below_its_bound():
    logp, old = _logprobs([[LN(1.5), LN(0.7), LN(2.9)]])
    adv, mask = torch.tensor([[-1.0, 2.0, -0.5]]), torch.ones(1, 3)
    plain, _ = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    (g_plain,) = torch.autograd.grad(plain, logp)
    dual, m = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    (g_dual,) = torch.autograd.grad(dual, logp)
    assert torch.equal(plain, dual) and torch.equal(g_plain, g_dual) and m["clip_frac_dual"] == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_ratio_c=1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_huge_log_ratios_are_bounded_before_exp(level):
    """A token moved by 100 nats would overflow exp (e^100 = inf in float32) and make the loss inf and its gradient
    NaN; bounded at 20 nats, the ratio is e^20 and the gradient past the bound is 0."""
    logp, old = _logprobs([[100.0, -100.0]])
    ratio = policy_ratio(logp, old, torch.ones(1, 2), level)
    if level == "token":
        torch.testing.assert_close(ratio, torch.tensor([[math.exp(20), math.exp(-20)]]))
    else:
        torch.testing.assert_close(ratio, torch.ones(1, 2))  # mean log-ratio 0
    logp, old = _logprobs([[100.0, 100.0]])
    loss, m = clipped_policy_loss(logp, old, -torch.ones(1, 2), torch.ones(1, 2), clip_low=0.2, clip_high=0.2,
                                  ratio_level=level, aggregation="seq_mean_token_mean")  # fmt: skip
    assert math.isfinite(loss.item()) and m["ratio_max"] == pytest.approx(math.exp(20))
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2)), "past the bound no gradient (a sequence's too: its value alone "\
                                                      "was bounded, the gradient scaled by e^20)"
