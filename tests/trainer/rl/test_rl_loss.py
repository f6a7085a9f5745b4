"""compute_policy_loss: the on-policy identity, a hand-computed composition, exact accumulation."""

import math

import pytest
import torch

from trainer.rl.aggregation import aggregate
from trainer.rl.config import GRPOConfig, ImportanceSamplingConfig, KLConfig, PPOConfig
from trainer.rl.loss import compute_policy_loss

LN = math.log


def _batch(seed=0, b=4, t=6, v=13):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, requires_grad=True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    advantages = torch.randn(b, 1, generator=g).expand(b, t) * mask
    return logits, tokens, mask, advantages


def _logprobs(logits, tokens):
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]


CONFIGS = {
    "grpo_token_mean": GRPOConfig(clip_high=0.28, kl=KLConfig(coef=0.1, estimator="k3")),
    "grpo_k2_sequence_is": GRPOConfig(
        kl=KLConfig(coef=0.05, estimator="k2"), importance_sampling=ImportanceSamplingConfig(level="sequence", cap=1.0)
    ),
    "dual_clip_geometric_is": GRPOConfig(
        clip_ratio_c=3.0,
        kl=KLConfig(coef=0.1),
        importance_sampling=ImportanceSamplingConfig(level="geometric", cap=1.001, lower_bound=0.999),
    ),
    "dr_grpo": GRPOConfig(loss_aggregation="token_sum_norm", loss_norm_length=8, scale_advantages_by_std=False),
    "gspo": GRPOConfig(ratio_level="sequence", loss_aggregation="seq_mean_token_mean", clip_low=3e-4, clip_high=4e-4),
    "ppo": PPOConfig(kl=KLConfig(coef=0.1, where="reward")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_policy_equal_to_old_reference_and_rollout_gives_ratio_one_kl_zero_and_the_pg_gradient(name):
    config = CONFIGS[name]
    logits, tokens, mask, advantages = _batch()
    logp = _logprobs(logits, tokens)
    same = logp.detach().clone()
    loss, m = compute_policy_loss(logp, advantages, mask, config, old_logprobs=same, ref_logprobs=same.clone(),
                                  rollout_logprobs=same.clone())  # fmt: skip
    assert m["ratio_mean"] == m["ratio_min"] == m["ratio_max"] == 1.0
    assert m["kl"] == 0.0 and m.get("kl_loss", 0.0) == 0.0
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    assert m["is_ratio_mean"] == m["is_ratio_max"] == 1.0 and m["is_frac_capped"] == 0.0 and m["logprob_gap"] == 0.0
    assert m["is_ratio_min"] == m["is_weight_mean"] == 1.0 and m["logprob_gap_max"] == m["rollout_kl"] == 0.0
    (grad,) = torch.autograd.grad(loss, logits)

    reference = -aggregate(advantages * _logprobs(logits, tokens), mask, config.loss_aggregation,
                           norm_length=config.loss_norm_length)  # fmt: skip
    (expected,) = torch.autograd.grad(reference, logits)
    assert torch.equal(grad, expected)  # bit for bit: ratio, IS weight are exactly 1 and the KL gradient exactly 0
    # With ratio 1 the loss value is the negated aggregated advantage.
    value = -aggregate(advantages, mask, config.loss_aggregation, norm_length=config.loss_norm_length)
    assert loss.item() == pytest.approx(value.item(), abs=1e-6)


def test_old_logprobs_default_to_the_detached_policy():
    logits, tokens, mask, advantages = _batch(seed=1)
    config = GRPOConfig(importance_sampling=ImportanceSamplingConfig(enabled=False))
    loss, m = compute_policy_loss(_logprobs(logits, tokens), advantages, mask, config)
    assert m["ratio_max"] == 1.0 and "kl" not in m and "is_ratio_mean" not in m and "logprob_gap" not in m
    (grad,) = torch.autograd.grad(loss, logits)
    (expected,) = torch.autograd.grad(-aggregate(advantages * _logprobs(logits, tokens), mask, "token_mean"), logits)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9)


def test_composition_hand_computed():
    # Policy == old (ratio 1), A = 1: policy term -1, times IS weight min(3, 2) = 2 -> -2.
    # KL k1 to a reference of half the probability: ln 2 per token, coef 0.1. Entropy mean 2, coef 0.01.
    logp = torch.full((1, 2), LN(0.5), requires_grad=True)
    ref = torch.full((1, 2), LN(0.25))
    rollout = torch.full((1, 2), LN(0.5 / 3))
    config = GRPOConfig(kl=KLConfig(coef=0.1, estimator="k1"), entropy_coef=0.01)
    loss, m = compute_policy_loss(logp, torch.ones(1, 2), torch.ones(1, 2), config, ref_logprobs=ref,
                                  rollout_logprobs=rollout, entropies=torch.tensor([[1.0, 3.0]]))  # fmt: skip
    assert loss.item() == pytest.approx(-2.0 + 0.1 * LN(2) - 0.01 * 2.0)
    assert m["loss"] == pytest.approx(loss.item())
    assert m["policy_loss"] == pytest.approx(-2.0)
    assert m["kl"] == pytest.approx(LN(2)) and m["kl_loss"] == pytest.approx(LN(2))
    assert m["entropy"] == pytest.approx(2.0)
    assert m["is_ratio_mean"] == pytest.approx(3.0) and m["is_frac_capped"] == 1.0
    assert m["logprob_gap"] == pytest.approx(LN(3)) and m["num_tokens"] == 2.0
    # Metrics stay on the device, detached from the graph: the step reads them once (``trainer.metrics``).
    assert all(isinstance(v, float) or (v.dim() == 0 and not v.requires_grad) for v in m.values())


def test_kl_in_the_reward_is_reported_but_not_added_to_the_loss():
    logp = torch.full((1, 2), LN(0.5))
    config = GRPOConfig(kl=KLConfig(coef=0.1, estimator="k1", where="reward"),
                        importance_sampling=ImportanceSamplingConfig(enabled=False))  # fmt: skip
    loss, m = compute_policy_loss(logp, torch.ones(1, 2), torch.ones(1, 2), config,
                                  ref_logprobs=torch.full((1, 2), LN(0.25)))  # fmt: skip
    assert loss.item() == pytest.approx(-1.0) and m["kl"] == pytest.approx(LN(2)) and "kl_loss" not in m


def test_kl_loss_aggregates_over_the_mask():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.125]]))
    config = GRPOConfig(kl=KLConfig(coef=0.1, estimator="k1"),
                        importance_sampling=ImportanceSamplingConfig(enabled=False))  # fmt: skip
    _, m = compute_policy_loss(logp, torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), config, ref_logprobs=ref)
    assert m["kl_loss"] == pytest.approx((LN(2) + 0.0) / 2)


def test_missing_inputs_are_named():
    x, ones = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(x, ones, ones, GRPOConfig())
    no_is = ImportanceSamplingConfig(enabled=False)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(x, ones, ones, GRPOConfig(kl=KLConfig(coef=0.1), importance_sampling=no_is))
    with pytest.raises(ValueError, match="entropies"):
        compute_policy_loss(x, ones, ones, GRPOConfig(entropy_coef=0.1, importance_sampling=no_is))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_micro_batches_with_global_counts_accumulate_the_full_batch_gradient(aggregation):
    norm = 8 if aggregation == "token_sum_norm" else None
    config = GRPOConfig(loss_aggregation=aggregation, loss_norm_length=norm, kl=KLConfig(coef=0.1),
                        entropy_coef=0.01)  # fmt: skip
    logits, tokens, mask, advantages = _batch(seed=2)
    g = torch.Generator().manual_seed(3)
    old = _logprobs(logits, tokens).detach() + 0.1 * torch.randn(mask.shape, generator=g)
    ref = old + 0.2 * torch.randn(mask.shape, generator=g)
    rollout = old + 0.05 * torch.randn(mask.shape, generator=g)
    ent = torch.rand(mask.shape, generator=g)

    def loss_of(rows, **counts):
        logp = _logprobs(logits[rows], tokens[rows])
        loss, _ = compute_policy_loss(logp, advantages[rows], mask[rows], config, old_logprobs=old[rows],
                                      ref_logprobs=ref[rows], rollout_logprobs=rollout[rows], entropies=ent[rows],
                                      **counts)  # fmt: skip
        return loss

    (full,) = torch.autograd.grad(loss_of(slice(0, 4)), logits)
    counts = dict(num_tokens=float(mask.sum()), num_seqs=4.0)
    (accumulated,) = torch.autograd.grad(loss_of(slice(0, 2), **counts) + loss_of(slice(2, 4), **counts), logits)
    torch.testing.assert_close(accumulated, full)


def test_fidelity_metrics_are_reported_with_importance_sampling_off():
    logp = torch.full((1, 3), LN(0.5))
    rollout = logp + torch.tensor([[-LN(3), -LN(0.5), 0.0]])  # trainer / rollout ratios 3, 0.5, 1
    config = GRPOConfig(importance_sampling=ImportanceSamplingConfig(enabled=False))
    loss, m = compute_policy_loss(logp, torch.ones(1, 3), torch.ones(1, 3), config, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-1.0) and "is_weight_mean" not in m  # no weights applied
    assert m["logprob_gap"] == pytest.approx((LN(3) + LN(2)) / 3) and m["logprob_gap_max"] == pytest.approx(LN(3))
    assert m["rollout_kl"] == pytest.approx(((3 - 1 - LN(3)) + (0.5 - 1 - LN(0.5))) / 3)


def test_masked_importance_weights_reach_the_loss():
    # Policy == old, A = 1: each token's loss is -w; trainer / rollout ratios 3 (masked: above cap 2), 0.4 (masked:
    # below 0.5) and 1.5 (kept, exactly) -> (0 + 0 - 1.5) / 3.
    logp = torch.full((1, 3), LN(0.5))
    rollout = logp - torch.tensor([[LN(3), LN(0.4), LN(1.5)]])
    config = GRPOConfig(importance_sampling=ImportanceSamplingConfig(mode="mask", cap=2.0, lower_bound=0.5))
    loss, m = compute_policy_loss(logp, torch.ones(1, 3), torch.ones(1, 3), config, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-1.5 / 3)
    assert m["is_frac_masked"] == pytest.approx(2 / 3) and m["is_weight_mean"] == pytest.approx(1.5 / 3)


def test_dual_clip_reaches_the_loss_through_the_config():
    logp = torch.tensor([[LN(4), 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    config = GRPOConfig(clip_ratio_c=3.0, importance_sampling=ImportanceSamplingConfig(enabled=False))
    loss, m = compute_policy_loss(logp, -torch.ones(1, 2), torch.ones(1, 2), config, old_logprobs=old)
    assert loss.item() == pytest.approx((3 + 1) / 2) and m["clip_frac_dual"] == pytest.approx(0.5)


def test_new_metric_names_reduce_as_what_they_are():
    """Maxima stay maxima and minima minima across micro-batches and ranks (``trainer.metrics.reduction_of``)."""
    from trainer.metrics import MetricsAccumulator, reduction_of

    assert reduction_of("logprob_gap_max") == reduction_of("is_ratio_max") == "max"
    assert reduction_of("is_ratio_min") == "min"
    for name in ("logprob_gap", "rollout_kl", "is_weight_mean", "is_frac_capped", "is_frac_masked", "clip_frac_dual"):
        assert reduction_of(name) == "mean"
    acc = MetricsAccumulator()
    acc.add({"logprob_gap_max": 0.5, "is_ratio_min": 0.9, "rollout_kl": 0.25}, weight=3)
    acc.add({"logprob_gap_max": 0.2, "is_ratio_min": 0.7, "rollout_kl": 1.0}, weight=1)
    assert acc.reduce() == {"logprob_gap_max": 0.5, "is_ratio_min": 0.7, "rollout_kl": pytest.approx(0.4375)}
