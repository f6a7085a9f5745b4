"""Multi-turn trajectories: tokens the model was given (observations) sit in the completion with a 0 loss mask.
They condition the model tokens after them and carry no loss, no gradient and no weight in any normaliser."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from trainer_batches import random_samples

from rollout.types import RolloutBatch, Sample
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig, KLConfig, PPOConfig

MODEL = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, tie_embeddings=False, output_chunk_size=16,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("single_rank_group")


def _state(algo, **overrides):
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state

    torch.manual_seed(0)
    cfg = TrainerConfig(**{"optimizer": {"lr": 1e-2}, "micro_batch_tokens": 10_000, "seed": 0, **overrides})
    return build_train_state(cfg, MODEL, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))


def _trajectories(seed: int = 0) -> list[Sample]:
    """Samples whose completions hold two model turns around an observation of 3-6 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for s in random_samples(seed, num_groups=3, group_size=4, completion_len=(12, 24), logprob=(-3.0, -0.1)):
        n = len(s.completion_ids)
        start = int(rng.integers(2, n - 8))
        mask = np.ones(n, np.uint8)
        mask[start : start + int(rng.integers(3, 7))] = 0
        s.loss_mask = mask
        s.rollout_logprobs = s.rollout_logprobs * mask
        out.append(s)
    return out


def _step(algo, samples: list[Sample], **overrides) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    from trainer.step import rl_step

    state = _state(algo, **overrides)
    metrics = rl_step(state, RolloutBatch(copy.deepcopy(samples)))
    return metrics, {n: p.detach().clone() for n, p in state.policy.named_parameters()}


def _garbage_off_mask(samples: list[Sample]) -> list[Sample]:
    """The same samples with arbitrary rollout log-probs where the mask is 0."""
    out = copy.deepcopy(samples)
    rng = np.random.default_rng(123)
    for s in out:
        off = s.loss_mask == 0
        s.rollout_logprobs = np.where(off, rng.uniform(-50, 5, len(off)), s.rollout_logprobs).astype(np.float32)
    return out


@pytest.mark.parametrize("algo", [
    GRPOConfig(group_size=4, kl=KLConfig(coef=0.1)),
    PPOConfig(kl=KLConfig(coef=0.05, where="reward")),
], ids=["grpo-kl", "ppo"])  # fmt: skip
def test_masked_tokens_carry_no_gradient(algo) -> None:
    samples = _trajectories()
    metrics, weights = _step(algo, samples)
    metrics_g, weights_g = _step(algo, _garbage_off_mask(samples))
    for name, w in weights.items():
        torch.testing.assert_close(weights_g[name], w, rtol=0, atol=0, msg=name)
    model_tokens = sum(int(s.loss_mask.sum()) for s in samples)
    assert metrics["num_tokens"] == metrics_g["num_tokens"] == model_tokens
    for key in ("loss", "logprob_gap", "is_ratio_mean", "entropy", "kl"):
        assert metrics_g[key] == metrics[key], key


def test_the_mask_changes_the_update() -> None:
    """Control: the same tokens trained as all-model completions move the weights differently."""
    algo = GRPOConfig(group_size=4)
    samples = _trajectories(seed=1)
    unmasked = copy.deepcopy(samples)
    for s in unmasked:
        s.loss_mask = None
    _, masked_w = _step(algo, samples)
    _, unmasked_w = _step(algo, unmasked)
    assert any(not torch.equal(masked_w[n], unmasked_w[n]) for n in masked_w)


def test_trajectory_logprobs_match_the_same_tokens_scored_unpacked() -> None:
    """The log-probs the step computes for a trajectory's model tokens equal a plain forward over the whole
    sequence (prompt + every turn), read at those tokens only."""
    from trainer.step import forward_logprobs, plan_rank_micro_batches

    state = _state(GRPOConfig(group_size=4), micro_batch_tokens=64)
    samples = _trajectories(seed=2)
    with torch.no_grad():
        for mb in plan_rank_micro_batches(state, samples, range(len(samples))):
            packed = forward_logprobs(state.policy, mb)[0]
            for row, i in enumerate(mb.sample_indices):
                s = samples[i]
                ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None]
                hidden = state.policy(ids)[0, len(s.prompt_ids) - 1 : -1]
                ref = state.policy.token_logprobs(hidden, torch.from_numpy(s.completion_ids))[0]
                on = torch.from_numpy(s.loss_mask.astype(bool))
                n = len(s.completion_ids)
                torch.testing.assert_close(packed[row, :n][on], ref[on], rtol=0, atol=2e-5)
                assert torch.all(packed[row, :n][~on] == 0)


def test_a_trajectory_must_end_with_a_model_token() -> None:
    s = random_samples(0, num_groups=1, group_size=1, completion_len=(5, 6))[0]
    with pytest.raises(ValueError, match="last completion token is masked out"):
        Sample(**{**s.__dict__, "loss_mask": np.array([1, 1, 0, 1, 0], np.uint8)})
    with pytest.raises(ValueError, match="loss mask of shape"):
        Sample(**{**s.__dict__, "loss_mask": np.ones(4, np.uint8)})
