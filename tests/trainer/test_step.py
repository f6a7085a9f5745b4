"""The policy update on one rank (a 1-rank gloo group, which runs the plain module: ``parallelize.uses_fsdp``):
on-policy exactness, micro-batching invariance, PPO with a critic, SFT warm start, HF export."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from spawn_helpers import full_weights
from trainer_batches import random_samples

from rollout.types import RolloutBatch, Sample
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig, ImportanceSamplingConfig, KLConfig, PPOConfig

MODEL = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, tie_embeddings=False, output_chunk_size=16,
)  # fmt: skip


pytestmark = pytest.mark.usefixtures("single_rank_group")


def _engine(algo, **overrides):
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state

    cfg = TrainerConfig(**{"optimizer": {"lr": 1e-3}, "micro_batch_tokens": 10_000, **overrides})
    return build_train_state(cfg, MODEL, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))


def _samples(seed: int = 0, num_groups: int = 3, group_size: int = 4) -> list[Sample]:
    return random_samples(seed, num_groups=num_groups, group_size=group_size)


def _set_rollout_logprobs_to_trainer(state, samples: list[Sample]) -> None:
    from trainer.step import forward_logprobs, plan_rank_micro_batches

    with torch.no_grad():
        for mb in plan_rank_micro_batches(state, samples, range(len(samples))):
            lp = forward_logprobs(state.policy, mb)[0]
            for seg, i in enumerate(mb.sample_indices):
                samples[i].rollout_logprobs = lp[seg, : len(samples[i].completion_ids)].numpy().copy()



def test_first_grpo_step_is_exactly_on_policy() -> None:
    from trainer.step import rl_step

    algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.1), importance_sampling=ImportanceSamplingConfig(cap=2.0))
    state = _engine(algo, micro_batch_tokens=40)
    samples = _samples()
    _set_rollout_logprobs_to_trainer(state, samples)  # packed exactly as the step packs them
    m = rl_step(state, RolloutBatch(samples))
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
    assert m["kl"] == 0.0 and m["kl_loss"] == 0.0
    assert m["is_ratio_mean"] == 1.0 and m["is_ratio_max"] == 1.0 and m["logprob_gap"] == 0.0
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
    assert m["num_tokens"] == sum(len(s.completion_ids) for s in samples)
    assert m["grad_norm"] > 0 and m["policy_version"] == 1.0
    # The advantages' statistics over completion tokens, against GRPO's formula in numpy.
    rewards = np.array([s.reward for s in samples]).reshape(3, 4)
    adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    tokens = np.repeat(adv, [len(s.completion_ids) for s in samples])
    assert m["advantage_mean"] == pytest.approx(tokens.mean(), abs=1e-6)
    assert m["advantage_std"] == pytest.approx(tokens.std(), rel=1e-5)
    assert m["advantage_min"] == pytest.approx(tokens.min(), rel=1e-5)
    assert m["advantage_max"] == pytest.approx(tokens.max(), rel=1e-5)


def test_lora_dropout_leaves_the_importance_weights_to_a_pass_without_it() -> None:
    """With adapter dropout the gradient pass's log-probs are noisy: taken as the old log-probs they made the
    importance weights (trainer / engine) measure dropout noise, not the engines' gap."""
    from trainer.models.config import LoRAConfig
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    model = MODEL.model_copy(update={"lora": LoRAConfig(rank=4, alpha=8, dropout=0.5, init="gaussian")})
    cfg = TrainerConfig(optimizer={"lr": 1e-3}, micro_batch_tokens=40)
    algo = GRPOConfig(group_size=4, importance_sampling=ImportanceSamplingConfig(cap=2.0))
    state = build_train_state(cfg, model, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
    torch.manual_seed(0)
    with torch.no_grad():  # trained adapters (B starts at 0, where dropout on their input changes nothing)
        for name, p in state.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    samples = _samples(seed=3)
    _set_rollout_logprobs_to_trainer(state, samples)  # the engine's: the adapters without dropout
    m = rl_step(state, RolloutBatch(samples))
    assert m["logprob_gap"] == 0.0 and m["is_ratio_min"] == m["is_ratio_max"] == 1.0
    assert m["ratio_min"] < 1.0 < m["ratio_max"]  # the policy ratio carries the dropout noise, as documented


def test_old_logprob_pass_matches_the_gradient_pass() -> None:
    """Batches reused for several optimizer steps take old log-probs from a no-grad pass: bitwise the same values."""
    from trainer.packing import plan_micro_batches
    from trainer.step import _no_grad_pass, forward_logprobs

    state = _engine(GRPOConfig(group_size=4), micro_batch_tokens=40)
    samples = _samples(seed=5)
    mbs = plan_micro_batches(samples, range(len(samples)), 0, 1, 40)
    _no_grad_pass(state, [mbs], need_old=True)
    for mb in mbs:
        logprobs = forward_logprobs(state.policy, mb)[0]
        assert logprobs.requires_grad
        assert torch.equal(logprobs.detach(), mb.extra["old_logprobs"])


def test_head_at_completion_positions_equals_full_head() -> None:
    """forward_logprobs runs the last block's projection/feed-forward and the output head only where a completion
    token is predicted: same values as the full [R, L] forward and head unpacked, and the same weight gradients."""
    from trainer.step import forward_logprobs, plan_rank_micro_batches

    state = _engine(GRPOConfig(group_size=4), micro_batch_tokens=60)
    samples = _samples(seed=6)
    params = list(state.policy.parameters())
    for mb in plan_rank_micro_batches(state, samples, range(len(samples))):
        logprobs, entropy, hidden = forward_logprobs(state.policy, mb)
        assert hidden.shape == (mb.num_loss_tokens, state.model_cfg.dim)
        full_hidden = state.policy(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids)
        assert mb.prefix_ids is None  # every sample its own prompt: each position predicts the row's next token
        full_lp, full_ent = state.policy.token_logprobs(full_hidden, torch.roll(mb.tokens, -1, dims=1))
        torch.testing.assert_close(logprobs, mb.unpack(full_lp), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(entropy, mb.unpack(full_ent), rtol=1e-6, atol=1e-6)
        grads = [torch.autograd.grad((lp * mb.loss_mask).sum() + ent.sum(), params)
                 for lp, ent in ((logprobs, entropy), (mb.unpack(full_lp), mb.unpack(full_ent)))]  # fmt: skip
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_segment_local_attention_packs_one_row_per_micro_batch() -> None:
    from trainer.step import plan_rank_micro_batches

    samples = _samples(seed=7)
    total = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    mbs = plan_rank_micro_batches(_engine(GRPOConfig(group_size=4), micro_batch_tokens=64), samples, range(12))
    assert all(mb.tokens.shape == (1, mb.num_tokens) for mb in mbs)  # no padding
    assert sum(mb.num_tokens for mb in mbs) == total
    # An explicit row cap still wins.
    capped = _engine(GRPOConfig(group_size=4), micro_batch_tokens=64, pack_row_tokens=30)
    assert max(mb.tokens.shape[1] for mb in plan_rank_micro_batches(capped, samples, range(12))) <= max(
        30, max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    )


def test_micro_batching_does_not_change_the_update() -> None:
    from trainer.step import rl_step

    algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.05), entropy_coef=0.01)
    samples = _samples(seed=1)
    results = []
    for budget in (10_000, 24):  # one packed row vs many small micro-batches (gradient accumulation)
        state = _engine(algo, micro_batch_tokens=budget)
        metrics = [rl_step(state, RolloutBatch(samples)) for _ in range(2)]
        results.append((metrics, full_weights(state.policy)))
    (m_one, w_one), (m_many, w_many) = results
    for a, b in zip(m_one, m_many):
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    for name in w_one:
        torch.testing.assert_close(w_many[name], w_one[name], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "algo, moe, temperatures",
    [(GRPOConfig(group_size=4, kl=KLConfig(coef=0.05)), False, False),
     (GRPOConfig(group_size=4, kl=KLConfig(coef=0.05, where="reward")), True, True),
     (PPOConfig(), False, True)],
    ids=["grpo", "grpo-moe-kl-reward-tempered", "ppo-tempered"],
)  # fmt: skip
def test_static_shapes_do_not_change_the_update(monkeypatch, algo, moe, temperatures) -> None:
    """The padded layout of a device that compiles per shape (``xla``: padding rows, sequences and head slots,
    masked attention) gives the CPU's update, run here on the CPU by making it take that path."""
    import trainer.models.attention
    import trainer.step
    from trainer.models.config import MoEConfig
    from trainer.step import rl_step

    model = MODEL.model_copy(update={
        "family": "qwen3_moe", "moe": MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=32, aux_loss_coef=0.01),
    }) if moe else MODEL  # fmt: skip
    samples = _samples(seed=2, num_groups=4)
    for i, s in enumerate(samples):
        s.temperature = (0.7, 1.0, 1.3)[i % 3] if temperatures else 1.0
    results = []
    for static in (False, True):
        for module in (trainer.step, trainer.models.attention):
            monkeypatch.setattr(module, "needs_static_shapes", lambda device, static=static: static)
        from trainer.parallelize import build_mesh
        from trainer.state import build_train_state

        # Rows of the whole budget both ways: the same micro-batches (the MoE load-balancing term depends on them).
        cfg = TrainerConfig(optimizer={"lr": 1e-3}, micro_batch_tokens=48, pack_row_tokens=48)
        state = build_train_state(cfg, model, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
        metrics = [rl_step(state, RolloutBatch(samples)) for _ in range(2)]
        results.append((metrics, full_weights(state.policy)))
    (m_plain, w_plain), (m_static, w_static) = results
    for a, b in zip(m_plain, m_static):
        for key in ("loss", "policy_loss", "grad_norm", "entropy", "logprob_gap", "num_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    for name in w_plain:
        torch.testing.assert_close(w_static[name], w_plain[name], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_sum_norm"])
def test_an_episode_of_several_samples_is_one_sequence_of_the_loss(aggregation) -> None:
    """Episode 0 gave two samples (reward 1), episode 1 one (reward 3): advantages -1 and +1, each token's loss -A on
    the first pass. As one sequence, episode 0's token mean is 1 and the per-sequence loss (1 - 1) / 2 = 0; counted
    as two sequences it would be (1 + 1 - 1) / 3. Dr. GRPO divides the token sum by 2 episodes, not 3 samples."""
    from trainer.step import rl_step

    samples = _samples(seed=7, num_groups=1, group_size=3)
    for s, episode, reward in zip(samples, (0, 0, 1), (1.0, 1.0, 3.0), strict=True):
        s.episode, s.reward = episode, reward
    norm = {"loss_norm_length": 8} if aggregation == "token_sum_norm" else {}
    algo = GRPOConfig(group_size=2, scale_advantages_by_std=False, loss_aggregation=aggregation, **norm)
    state = _engine(algo, micro_batch_tokens=24)  # several micro-batches: the episode's parts may be apart
    _set_rollout_logprobs_to_trainer(state, samples)
    m = rl_step(state, RolloutBatch(samples))
    if aggregation == "seq_mean_token_mean":
        assert m["policy_loss"] == pytest.approx(0.0, abs=1e-6)
    else:
        c = [len(s.completion_ids) for s in samples]
        assert m["policy_loss"] == pytest.approx((c[0] + c[1] - c[2]) / (2 * 8), rel=1e-5)


def test_mini_batches_keep_an_episode_of_several_samples_whole() -> None:
    """Episode 0 (reward 3) gave one sample, episode 1 (reward 1) two: advantages +1 and -1, each token's loss -A
    while the ratio is 1 (a learning rate of 1e-30). Two mini-batches of one episode each lose -1 and +1: mean 0.
    Split by sample, the first mini-batch held sample 0 and half of episode 1, each counted as a sequence (loss 0),
    the second the other half (loss 1): episode 1 counted twice, its tokens weighed by its parts' lengths."""
    from trainer.step import rl_step

    samples = _samples(seed=7, num_groups=1, group_size=3)
    for s, episode, reward in zip(samples, (0, 1, 1), (3.0, 1.0, 1.0), strict=True):
        s.episode, s.reward = episode, reward
    algo = GRPOConfig(group_size=2, scale_advantages_by_std=False, loss_aggregation="seq_mean_token_mean")
    state = _engine(algo, optimizer={"lr": 1e-30}, num_minibatches=2, num_epochs=2)
    _set_rollout_logprobs_to_trainer(state, samples)
    m = rl_step(state, RolloutBatch(samples))
    assert m["policy_loss"] == pytest.approx(0.0, abs=1e-6)


def test_ppo_step_trains_the_critic() -> None:
    from trainer.step import rl_step

    state = _engine(PPOConfig(kl=KLConfig(coef=0.05, where="reward")), critic_lr=1e-2)
    samples = _samples(seed=2)
    _set_rollout_logprobs_to_trainer(state, samples)
    first = rl_step(state, RolloutBatch(samples))
    assert first["loss"] == pytest.approx(0.0, abs=1e-6)  # whitened advantages, ratio 1: zero surrogate
    assert first["critic/value_mean"] == 0.0  # zero-initialised value head
    errors = [first["critic/value_error"]]
    errors += [rl_step(state, RolloutBatch(samples))["critic/value_error"] for _ in range(4)]
    assert errors[-1] < errors[0]
    assert all(np.isfinite(v) for v in first.values())


def test_ppo_step_with_a_micro_batch_without_completion_tokens() -> None:
    """Regression: GAE crashed on a micro-batch without completion tokens ([S, 0]: the empty fillers that even out
    micro-batch counts on several ranks, or here an empty completion packed alone)."""
    from trainer.step import rl_step

    samples = _samples(seed=8)
    samples[5] = replace(samples[5], completion_ids=samples[5].completion_ids[:0],
                         rollout_logprobs=samples[5].rollout_logprobs[:0])  # fmt: skip
    state = _engine(PPOConfig(kl=KLConfig(coef=0.05, where="reward")), micro_batch_tokens=1)  # one sample each
    metrics = rl_step(state, RolloutBatch(samples))
    assert metrics["num_tokens"] == sum(len(s.completion_ids) for s in samples)
    assert all(np.isfinite(v) for v in metrics.values())


def test_sft_step_lowers_nll() -> None:
    from trainer.step import sft_step

    state = _engine(GRPOConfig(group_size=4), optimizer={"lr": 1e-2})
    samples = _samples(seed=3)
    losses = [sft_step(state, samples)["sft_loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1
    assert state.policy_version == 5


def test_hf_export_round_trips(tmp_path) -> None:
    from trainer.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
    from trainer.models.transformer import build_model
    from trainer.step import rl_step

    state = _engine(GRPOConfig(group_size=4))
    rl_step(state, RolloutBatch(_samples(seed=4)))
    save_hf_checkpoint(state.policy, str(tmp_path / "hf"))
    plain = build_model(MODEL, device="cpu", dtype=torch.float32)
    load_hf_checkpoint(plain, str(tmp_path / "hf"))
    trained = full_weights(state.policy)
    for name, p in plain.named_parameters():
        assert torch.equal(p, trained[name]), name


def test_log_probs_are_those_of_each_samples_temperature() -> None:
    from trainer.step import forward_logprobs, plan_rank_micro_batches

    state = _engine(GRPOConfig(group_size=4), micro_batch_tokens=10_000)
    samples = _samples(seed=5)
    temperatures = [0.6, 1.0, 1.7]
    for i, s in enumerate(samples):
        s.temperature = temperatures[i % 3]
    (mb,) = plan_rank_micro_batches(state, samples, range(len(samples)))
    with torch.no_grad():
        logprobs, entropy, _ = forward_logprobs(state.policy, mb)
        # Reference: dense logits of every sequence alone, divided by its temperature, then log_softmax.
        for row, i in enumerate(mb.sample_indices):
            s = samples[i]
            ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None]
            hidden = state.policy(ids, positions=torch.arange(ids.shape[1])[None])
            logits = state.policy.logits(hidden)[0, len(s.prompt_ids) - 1 : -1] / s.temperature
            ref = torch.log_softmax(logits, dim=-1)
            want = ref.gather(1, torch.from_numpy(s.completion_ids)[:, None])[:, 0]
            want_entropy = -(ref.exp() * ref).sum(-1)
            n = len(s.completion_ids)
            torch.testing.assert_close(logprobs[row, :n], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[row, :n], want_entropy, atol=1e-5, rtol=0)


def test_temperature_one_samples_take_the_untempered_path() -> None:
    from trainer.step import plan_rank_micro_batches

    state = _engine(GRPOConfig(group_size=4))
    (mb,) = plan_rank_micro_batches(state, _samples(seed=6), range(12))
    assert mb.token_temperatures is None  # bit-identical to the code before temperatures existed


def test_a_sample_cannot_claim_temperature_zero() -> None:
    with pytest.raises(ValueError, match="temperature 0"):
        replace(_samples(seed=7)[0], temperature=0.0)


def test_minibatches_are_reshuffled_each_epoch_and_carry_their_tensors() -> None:
    from trainer.step import _minibatches, _no_grad_pass, _reshuffled, plan_rank_micro_batches

    state = _engine(GRPOConfig(group_size=4), num_minibatches=3, num_epochs=3)
    samples = _samples(seed=8)
    trained = list(range(len(samples)))
    first = _minibatches(state, samples, trained, epoch=0)
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # epoch 0 as before: contiguous
    second, third = (_minibatches(state, samples, trained, epoch=e) for e in (1, 2))
    assert second != first and third != second and sorted(sum(second, [])) == trained
    assert _minibatches(state, samples, trained, epoch=1) == second  # seeded: every rank draws the same split
    plans = [plan_rank_micro_batches(state, samples, idx) for idx in first]
    _no_grad_pass(state, plans, need_old=True)
    old = {i: mb.extra["old_logprobs"][row] for mbs in plans for mb in mbs for row, i in enumerate(mb.sample_indices)}
    minis, new_plans = _reshuffled(state, samples, trained, plans, epoch=1)
    assert minis == second
    for mbs in new_plans:
        for mb in mbs:
            for row, i in enumerate(mb.sample_indices):
                n = len(samples[i].completion_ids)
                assert torch.equal(mb.extra["old_logprobs"][row, :n], old[i][:n])


def test_overlong_filter_takes_truncated_completions_out_of_the_loss() -> None:
    from trainer.step import rl_step

    def update(filter_on: bool, scramble: bool) -> dict[str, torch.Tensor]:
        state = _engine(GRPOConfig(group_size=4, overlong_filter=filter_on))
        samples = _samples(seed=9)
        for i in (1, 6):  # truncated at max_tokens; their content must not matter once filtered
            samples[i].finish_reason = "length"
            if scramble:
                samples[i].completion_ids = (samples[i].completion_ids % 60) + 2
        metrics = rl_step(state, RolloutBatch(samples))
        assert metrics["overlong_filtered_frac"] == (2 / 12 if filter_on else 0.0)
        return full_weights(state.policy)

    for name, w in update(True, False).items():
        assert torch.equal(w, update(True, True)[name]), name
    assert any(not torch.equal(a, b) for a, b in zip(update(False, False).values(), update(False, True).values()))


def test_a_step_reports_the_rates_it_trained_with_and_fewer_mini_batches_than_asked_for_when_few_samples(caplog):
    """The metrics' learning rates are those the step's updates used, not the next step's (the schedulers step after
    each update); a batch smaller than trainer.num_minibatches (dynamic sampling kept few groups) trains in one
    mini-batch per sample instead of failing."""
    from trainer.optim import lr_multiplier
    from trainer.step import rl_step

    schedule = {"num_warmup_steps": 10, "kind": "constant"}
    state = _engine(PPOConfig(), schedule=schedule, critic_lr=1e-2, num_minibatches=16)
    first = rl_step(state, RolloutBatch(_samples(seed=12, num_groups=2, group_size=4)))  # 8 samples
    assert first["lr"] == pytest.approx(1e-3 * lr_multiplier(0, state.cfg.schedule))
    assert first["critic/lr"] == pytest.approx(1e-2 * lr_multiplier(0, state.cfg.schedule))
    assert "8 episode(s) to train on, fewer than trainer.num_minibatches = 16: 8 mini-batch(es)" in caplog.text
    second = rl_step(state, RolloutBatch(_samples(seed=13)))  # 12 samples: 12 updates, the scheduler 8 steps on
    assert second["lr"] == pytest.approx(1e-3 * lr_multiplier(8, state.cfg.schedule))


def test_a_filtered_completion_counts_in_its_group_with_its_kl_penalty() -> None:
    """With the KL penalty in the reward, the overlong filter takes truncated completions out of the loss only: the
    other samples' advantages are those of the unfiltered batch (the truncated ones once counted unpenalised)."""
    from trainer.step import _compute_advantages, _minibatches, _no_grad_pass, _trained_indices, plan_rank_micro_batches

    samples = _samples(seed=11)
    for i in (1, 6):
        samples[i].finish_reason = "length"

    def advantages(filter_on: bool) -> dict[int, float]:
        algo = GRPOConfig(group_size=4, overlong_filter=filter_on, kl=KLConfig(coef=0.5, where="reward"))
        state = _engine(algo, micro_batch_tokens=40)
        torch.manual_seed(0)
        with torch.no_grad():  # the policy away from its reference, so that every sample has a KL penalty
            for p in state.policy.parameters():
                p.add_(0.2 * torch.randn_like(p))
        trained = _trained_indices(state, samples)
        plans = [plan_rank_micro_batches(state, samples, idx) for idx in _minibatches(state, samples, trained, 0)]
        _no_grad_pass(state, plans, need_old=False)
        _compute_advantages(state, samples, trained, plans)
        out = {}
        for mb in (mb for mbs in plans for mb in mbs):
            for row, i in enumerate(mb.sample_indices):
                out[i] = float(mb.advantages[row][mb.loss_mask[row] > 0][0])
        return out

    filtered, whole = advantages(True), advantages(False)
    assert sorted(filtered) == [i for i in range(12) if i not in (1, 6)]
    for i, a in filtered.items():
        assert a == pytest.approx(whole[i], abs=1e-6), (i, a, whole[i])
    assert len({round(a, 4) for a in whole.values()}) > 3  # the penalties differ: the check above can fail


def test_a_batch_of_only_truncated_completions_makes_no_update_under_the_overlong_filter() -> None:
    from trainer.step import rl_step

    state = _engine(GRPOConfig(group_size=4, overlong_filter=True))
    samples = _samples(seed=10)
    for s in samples:
        s.finish_reason = "length"
    before = full_weights(state.policy)
    metrics = rl_step(state, RolloutBatch(samples))
    assert metrics["overlong_filtered_frac"] == 1.0 and metrics["grad_norm"] == 0.0 and metrics["policy_version"] == 1
    assert all(torch.equal(w, full_weights(state.policy)[n]) for n, w in before.items())


@pytest.mark.parametrize("algo", [GRPOConfig(group_size=4, kl=KLConfig(coef=0.1)), PPOConfig()], ids=["grpo", "ppo"])
def test_the_step_reports_the_seconds_of_each_phase(algo) -> None:
    from trainer.step import rl_step

    state = _engine(algo, micro_batch_tokens=40, num_minibatches=2)
    metrics = rl_step(state, RolloutBatch(_samples()))
    phases = ["logprobs_s", "forward_backward_s", "optimizer_s"] + (["critic_s"] if isinstance(algo, PPOConfig) else [])
    assert all(metrics[p] > 0 for p in phases), {p: metrics.get(p) for p in phases}
    assert sum(metrics[p] for p in phases) <= metrics["step_s"]
    assert ("critic_s" in metrics) == isinstance(algo, PPOConfig)


def test_an_update_whose_gradient_is_not_finite_is_skipped_and_the_next_one_trains(caplog) -> None:
    """One NaN gradient through AdamW would make every weight NaN, and every engine would then serve them."""
    from trainer.step import rl_step

    state = _engine(GRPOConfig(group_size=4), num_minibatches=2)
    weights = {k: v.clone() for k, v in state.policy.state_dict().items()}
    param = next(state.policy.parameters())
    hook = param.register_hook(lambda g: g * float("nan"))
    m = rl_step(state, RolloutBatch(_samples()))
    assert m["skipped_updates"] == 2.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(v, weights[k]) for k, v in state.policy.state_dict().items())
    assert not state.optimizer.state, "a skipped update leaves AdamW's moments as they were (none yet)"
    assert "2 of 2 policy updates skipped" in caplog.text
    assert state.scheduler.last_epoch == 2, "the schedule counts the skipped updates"
    hook.remove()
    m = rl_step(state, RolloutBatch(_samples(seed=1)))
    assert m["skipped_updates"] == 0.0 and m["grad_norm"] > 0
    after = state.policy.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(v, weights[k]) for k, v in after.items())


def test_a_run_whose_every_update_is_skipped_fails_after_a_few_steps() -> None:
    """A loss that is never finite trained nothing, for ever, pushing the same weights as new versions."""
    from trainer.step import MAX_STEPS_WITHOUT_UPDATE, rl_step

    state = _engine(GRPOConfig(group_size=4))
    next(state.policy.parameters()).register_hook(lambda g: g * float("nan"))
    for seed in range(MAX_STEPS_WITHOUT_UPDATE - 1):
        assert rl_step(state, RolloutBatch(_samples(seed=seed)))["skipped_updates"] == 1.0
    with pytest.raises(RuntimeError, match=r"steps 1-3: every optimizer update skipped, the gradient norm not finite"):
        rl_step(state, RolloutBatch(_samples(seed=9)))
