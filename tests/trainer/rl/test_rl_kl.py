"""KL estimators: hand values, exact zeros, exact expectations and gradients on a small categorical, reward folding."""

import math

import pytest
import torch

from trainer.rl.kl import kl_estimate, kl_penalized_token_rewards


def test_hand_values_for_policy_half_reference_quarter():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + ln2)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_equal_log_probs_give_exactly_zero_kl_and_zero_gradient(estimator):
    logp = torch.randn(3, 5, requires_grad=True)
    kl = kl_estimate(logp, logp.detach().clone(), estimator)
    assert torch.equal(kl, torch.zeros(3, 5))
    kl.sum().backward()
    if estimator != "k1":  # k1's gradient is 1 everywhere (its expectation over samples is 0)
        assert torch.equal(logp.grad, torch.zeros(3, 5))


P = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
Q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)


def _kl(a, b):
    return (a * (a.log() - b.log())).sum()


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_in_expectation_over_the_policy(estimator):
    per_token = kl_estimate(P.log()[None], Q.log()[None], estimator)[0]
    torch.testing.assert_close((P * per_token).sum(), _kl(P, Q))


def test_k2_loss_gradient_is_reverse_kl_gradient_and_k3_is_forward():
    logits = torch.randn(4, dtype=torch.float64, requires_grad=True)
    q_log = Q.log()

    def expected_loss_grad(estimator):
        logp = torch.log_softmax(logits, dim=-1)
        # E_{y ~ pi}[k(y)] with the sampling distribution held fixed, as a sampled loss would be.
        (g,) = torch.autograd.grad((logp.exp().detach() * kl_estimate(logp[None], q_log[None], estimator)[0]).sum(),
                                   logits)  # fmt: skip
        return g

    p = torch.softmax(logits, dim=-1)
    (reverse,) = torch.autograd.grad(_kl(p, Q), logits)
    p = torch.softmax(logits, dim=-1)
    (forward,) = torch.autograd.grad(_kl(Q, p), logits)
    torch.testing.assert_close(expected_loss_grad("k2"), reverse)
    torch.testing.assert_close(expected_loss_grad("k3"), forward)


def test_kl_penalized_token_rewards_put_the_score_on_the_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    out = kl_penalized_token_rewards(torch.tensor([1.0, 2.0, 3.0]), kl, mask, coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0], [0.0, 0.0, 0.0]]))


def test_kl_penalized_token_rewards_of_a_micro_batch_without_completion_tokens_are_empty():
    """Regression: the empty filler micro-batches of a multi-rank PPO step ([S, 0]) crashed the argmax."""
    out = kl_penalized_token_rewards(torch.tensor([1.0]), torch.zeros(1, 0), torch.zeros(1, 0), coef=0.5)
    assert out.shape == (1, 0)


def test_k3_bounds_the_log_ratio_before_exp():
    """r = 100 would give exp(r) = inf and a NaN gradient; bounded at 20 the value is e^20 - 21 and its gradient 0.
    Within the bound nothing changes."""
    logp = torch.tensor([[-101.0, 99.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    kl = kl_estimate(logp, ref, "k3")
    torch.testing.assert_close(kl, torch.tensor([[math.exp(20) - 21, math.exp(-20) - 1 + 20, math.exp(2) - 3]]))
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 1 - math.exp(2)]]))


def test_only_k1_as_a_detached_reward_has_the_kl_policy_gradient():
    """E_pi[grad log pi * k(y)] (the score-function gradient of a detached per-token reward) equals grad KL(pi || ref)
    for k1; for k3 it does not, which is why kl.where = 'reward' defaults to k1."""
    logits = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    p = torch.softmax(logits, dim=-1)
    (true,) = torch.autograd.grad(_kl(p, Q), logits)

    def reward_grad(estimator):
        logp = torch.log_softmax(logits, dim=-1)
        k = kl_estimate(logp.detach()[None], Q.log()[None], estimator)[0]  # detached, as in the reward
        (g,) = torch.autograd.grad((logp.exp().detach() * logp * k).sum(), logits)
        return g

    torch.testing.assert_close(reward_grad("k1"), true)
    assert not torch.allclose(reward_grad("k3"), true, atol=1e-3)
