"""The algorithm objects on packed micro-batches, as the step calls them: registry, advantages, value loss.

The step hands an algorithm its micro-batches, a per-token KL callback and an all-reduce; here the "all-reduce" is the
identity (one rank) and the KL a hand-written tensor, so the expected advantages are computed by hand.
"""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch

from rollout.types import Sample
from trainer.packing import MicroBatch, plan_micro_batches
from trainer.rl.algorithms import ALGORITHMS, GRPO, PPO, AdvantageInputs, build_algorithm
from trainer.rl.config import AlgorithmConfig, GRPOConfig, KLConfig, PPOConfig


def _sample(completion_len: int, reward: float, group_id: int) -> Sample:
    return Sample(prompt_ids=np.array([1, 2]), completion_ids=np.arange(1, completion_len + 1),
                  rollout_logprobs=np.zeros(completion_len, np.float32), reward=reward, group_id=group_id,
                  policy_version=0)  # fmt: skip


def _inputs(samples: list[Sample], budget: int, kl_per_token: float = 0.0) -> AdvantageInputs:
    """One rank's micro-batches of ``samples`` (``budget`` tokens each) and a KL of ``kl_per_token`` on every token."""
    mbs = plan_micro_batches(samples, range(len(samples)), 0, 1, budget, row_tokens=budget)

    def token_kl(mb: MicroBatch) -> torch.Tensor:
        return torch.full_like(mb.loss_mask, kl_per_token) * mb.loss_mask

    return AdvantageInputs(samples=samples, micro_batches=mbs, token_kl=token_kl, all_reduce_sum=lambda x: x,
                           device=torch.device("cpu"))  # fmt: skip


def _per_sample(inputs: AdvantageInputs, key: str = "advantages") -> dict[int, list[float]]:
    out = {}
    for mb in inputs.micro_batches:
        values = mb.advantages if key == "advantages" else mb.extra[key]
        for row, i in enumerate(mb.sample_indices):
            out[i] = values[row, : len(inputs.samples[i].completion_ids)].tolist()
    return out


def test_every_algorithm_type_has_an_object_and_it_says_what_the_engine_builds():
    types = {typing.get_args(c.model_fields["type"].annotation)[0] for c in typing.get_args(typing.get_args(
        AlgorithmConfig)[0])}  # fmt: skip
    assert types == set(ALGORITHMS)
    grpo, ppo = build_algorithm(GRPOConfig(kl=KLConfig(coef=0.1))), build_algorithm(PPOConfig())
    assert isinstance(grpo, GRPO) and not grpo.needs_critic and grpo.needs_reference
    assert isinstance(ppo, PPO) and ppo.needs_critic and not ppo.needs_reference
    assert GRPOConfig.group_relative and not PPOConfig.group_relative
    with pytest.raises(NotImplementedError, match="GRPO trains no critic"):
        grpo.value_loss(None, torch.zeros(1, 1), 1.0, 1.0)


def test_grpo_gives_every_token_its_group_advantage_across_micro_batches():
    # Two groups interleaved over micro-batches of one or two samples; Dr. GRPO: reward minus the group mean.
    samples = [_sample(2, 1.0, 0), _sample(3, 10.0, 1), _sample(1, 3.0, 0), _sample(2, 14.0, 1)]
    inputs = _inputs(samples, budget=8)
    assert len(inputs.micro_batches) > 1
    GRPO(GRPOConfig(group_size=2, scale_advantages_by_std=False)).compute_advantages(inputs)
    assert _per_sample(inputs) == {0: [-1.0, -1.0], 1: [-2.0] * 3, 2: [1.0], 3: [2.0, 2.0]}
    for mb in inputs.micro_batches:
        assert mb.advantages.dtype == torch.float32 and torch.equal(mb.advantages * (1 - mb.loss_mask),
                                                                    torch.zeros_like(mb.advantages))  # fmt: skip


def test_grpo_folds_the_summed_kl_into_the_reward():
    # KL 0.5 per token, coef 2: each completion loses its length in reward. Penalised: -1, 8 | 2, 12.
    samples = [_sample(2, 1.0, 0), _sample(2, 10.0, 1), _sample(1, 3.0, 0), _sample(2, 14.0, 1)]
    inputs = _inputs(samples, budget=100, kl_per_token=0.5)
    cfg = GRPOConfig(group_size=2, scale_advantages_by_std=False, kl=KLConfig(coef=2.0, where="reward"))
    GRPO(cfg).compute_advantages(inputs)
    assert _per_sample(inputs) == {0: [-1.5, -1.5], 1: [-2.0, -2.0], 2: [1.5], 3: [2.0, 2.0]}
    # KL in the loss leaves the reward alone.
    GRPO(GRPOConfig(group_size=2, scale_advantages_by_std=False, kl=KLConfig(coef=2.0))).compute_advantages(inputs)
    assert _per_sample(inputs)[0] == [-1.0, -1.0]


def test_an_episode_of_several_samples_counts_once_in_its_group():
    """Group 0: episode 0 gave three samples (reward 1), episodes 1 and 2 one each (rewards 4, 7). Counted once, the
    group mean is 4, so the episode's parts get -3 (counted three times the mean would be 2.8 and the std shrink);
    with the KL in the reward (0.5 a token, coef 2) the episode loses the length of all of its parts."""
    samples = [_sample(2, 1.0, 0), _sample(1, 4.0, 0), _sample(3, 1.0, 0), _sample(2, 7.0, 0), _sample(1, 1.0, 0),
               _sample(1, 5.0, 1), _sample(1, 5.0, 1)]  # fmt: skip
    for i, episode in zip((0, 2, 4), (0, 0, 0), strict=True):
        samples[i].episode = episode
    samples[1].episode, samples[3].episode = 1, 2
    samples[5].episode, samples[6].episode = 0, 1  # group 1: two single-sample episodes with the same numbers
    inputs = _inputs(samples, budget=4)
    GRPO(GRPOConfig(group_size=3, scale_advantages_by_std=False)).compute_advantages(inputs)
    assert _per_sample(inputs) == {0: [-3.0] * 2, 1: [0.0], 2: [-3.0] * 3, 3: [3.0] * 2, 4: [-3.0], 5: [0.0],
                                   6: [0.0]}  # fmt: skip
    # Penalised: episode 0: 1 - 2 * 0.5 * (2 + 3 + 1) = -5; episode 1: 4 - 1 = 3; episode 2: 7 - 2 = 5; mean 1.
    inputs = _inputs(samples, budget=100, kl_per_token=0.5)
    cfg = GRPOConfig(group_size=3, scale_advantages_by_std=False, kl=KLConfig(coef=2.0, where="reward"))
    GRPO(cfg).compute_advantages(inputs)
    assert [_per_sample(inputs)[i][0] for i in range(5)] == [-6.0, 2.0, -6.0, 4.0, -6.0]
    with_std = GRPOConfig(group_size=3)
    GRPO(with_std).compute_advantages(_inputs(samples, budget=100))  # 3 episodes of group 0: a std over 3
    samples[2].reward = 2.0
    with pytest.raises(ValueError, match="episode 0 of group 0 carry different rewards"):
        GRPO(with_std).compute_advantages(_inputs(samples, budget=100))


def _with_values(inputs: AdvantageInputs, value: float) -> AdvantageInputs:
    for mb in inputs.micro_batches:
        mb.extra["values"] = torch.full_like(mb.loss_mask, value) * mb.loss_mask
    return inputs


def test_ppo_runs_gae_back_from_the_final_score_and_subtracts_the_kl_per_token():
    # gamma = lam = 1, values 0.5: advantages are rewards-to-go minus 0.5; returns are the rewards-to-go.
    samples = [_sample(3, 1.0, 0), _sample(1, 2.0, 1)]
    cfg = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False, kl=KLConfig(coef=0.5, where="reward"))
    inputs = _with_values(_inputs(samples, budget=100, kl_per_token=0.2), 0.5)
    PPO(cfg).compute_advantages(inputs)
    expected_returns = {0: [0.7, 0.8, 0.9], 1: [1.9]}  # score - 0.1 per remaining token
    for i, row in _per_sample(inputs, "returns").items():
        assert row == pytest.approx(expected_returns[i])
    for i, row in _per_sample(inputs).items():
        assert row == pytest.approx([r - 0.5 for r in expected_returns[i]])


def test_ppo_whitens_over_every_micro_batch_and_handles_one_without_completion_tokens():
    samples = [_sample(3, 1.0, 0), _sample(2, 0.0, 1), _sample(0, 5.0, 2), _sample(4, 2.0, 3)]
    inputs = _with_values(_inputs(samples, budget=2), 0.0)  # one sample per micro-batch
    assert any(mb.loss_mask.shape[1] == 0 for mb in inputs.micro_batches)  # the empty completion packs alone
    PPO(PPOConfig(gamma=1.0, lam=1.0)).compute_advantages(inputs)
    tokens = torch.tensor([a for row in _per_sample(inputs).values() for a in row], dtype=torch.float64)
    assert len(tokens) == 9
    assert tokens.mean().item() == pytest.approx(0.0, abs=1e-6) and tokens.std().item() == pytest.approx(1.0, abs=1e-6)


def test_ppo_value_loss_clips_unless_told_not_to():
    inputs = _inputs([_sample(2, 0.0, 0)], budget=100)
    (mb,) = inputs.micro_batches
    mb.loss_mask[0, 1] = 0.0
    mb.extra.update(values=torch.ones(1, 2), returns=torch.full((1, 2), 2.0))
    new = torch.tensor([[2.5, 0.0]])  # moved 1.5 from the old value 1.0, past the return 2.0
    loss, m = PPO(PPOConfig(value_clip=0.2)).value_loss(mb, new, num_tokens=1.0, num_seqs=1.0)
    assert loss.item() == pytest.approx(0.5 * 0.8**2) and m["value_clip_frac"] == 1.0  # the clipped 1.2 is worse
    loss, m = PPO(PPOConfig(value_clip=None)).value_loss(mb, new, num_tokens=1.0, num_seqs=1.0)
    assert loss.item() == pytest.approx(0.5 * 0.5**2) and m["value_clip_frac"] == 0.0
    assert m["value_loss"] == pytest.approx(loss.item())


def test_vf_coef_is_ignored_saying_what_sets_the_critics_step(caplog):
    """The critic's own AdamW undoes any weight on its loss: 400x vf_coef changed its update by 3%. Earlier runs'
    records hold it, so it is read (and ignored) for their resumes."""
    with caplog.at_level("WARNING", logger="trainer.rl.config"):
        assert PPOConfig(vf_coef=0.5) == PPOConfig()
    assert "trainer.critic_lr" in caplog.text


def test_explained_variance_of_the_step_matches_numpy():
    from trainer.rl.value_loss import clipped_value_loss, explained_variance

    rng = np.random.default_rng(0)
    returns, old = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    mask = (rng.random((3, 7)) < 0.7).astype(np.float64)
    _, m = clipped_value_loss(torch.tensor(old), torch.tensor(old), torch.tensor(returns), torch.tensor(mask), 0.2)
    got = explained_variance({k: float(v) for k, v in m.items()})
    keep = mask.astype(bool)
    expected = 1.0 - np.var(returns[keep] - old[keep]) / np.var(returns[keep])
    assert got["explained_variance"] == pytest.approx(expected) and "residual_sq_mean" not in got
    _, m = clipped_value_loss(torch.tensor(old), torch.tensor(old), torch.ones(3, 7), torch.tensor(mask), 0.2)
    assert "explained_variance" not in explained_variance({k: float(v) for k, v in m.items()})  # equal returns
