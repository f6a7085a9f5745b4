"""Shared prompts: a group's prompt packed once, each completion attending to it, gives every sample the log-probs and
the gradients it gets alone, for fewer tokens through the model (``trainer.packing``, ``sdpa``/``eager`` attention)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from trainer_batches import random_samples

from rollout.types import RolloutBatch
from trainer.config import TrainerConfig
from trainer.models.attention import eager_attention, masked_sdpa_attention, sdpa_attention
from trainer.models.config import ModelConfig, MoEConfig
from trainer.models.transformer import build_model
from trainer.packing import plan_micro_batches
from trainer.rl.config import GRPOConfig, PPOConfig

MODEL = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, tie_embeddings=False, output_chunk_size=16,
)  # fmt: skip


def _groups(seed: int = 0, **kw):
    kw = {"num_groups": 3, "group_size": 4, "prompt_len": (6, 14), "completion_len": (0, 9), **kw}
    return random_samples(seed, logprob=(-3.0, -0.1), shared_prompts=True, **kw)


def test_a_group_is_laid_out_as_its_prompt_once_then_each_completion():
    samples = _groups()
    (mb,) = plan_micro_batches(samples, range(len(samples)), 0, 1, 10_000, share_prompts=True, row_tokens=10_000)
    prompts = sum(len(samples[g * 4].prompt_ids) for g in range(3))
    assert mb.num_tokens == prompts + sum(len(s.completion_ids) for s in samples)
    assert mb.prefix_ids is not None
    flat_tokens, flat_positions = mb.tokens.reshape(-1), mb.positions.reshape(-1)
    for row, i in enumerate(mb.sample_indices):
        s, c = samples[i], len(samples[i].completion_ids)
        if c == 0:
            continue
        idx = mb.gather_index[row, :c]
        # Token 0 is predicted by the prompt's last token, token j by token j - 1; positions continue the prompt's.
        assert flat_tokens[idx[0]] == int(s.prompt_ids[-1]) and flat_positions[idx[0]] == len(s.prompt_ids) - 1
        assert torch.equal(flat_tokens[idx[1:]], torch.from_numpy(s.completion_ids[:-1]))
        assert torch.equal(flat_positions[idx[1:]], torch.arange(len(s.prompt_ids), len(s.prompt_ids) + c - 1))
        assert torch.equal(mb.completion_ids[row, :c], torch.from_numpy(s.completion_ids))
    # Every completion of a group predicts its first token from the same position.
    firsts = {int(mb.gather_index[row, 0]) for row, i in enumerate(mb.sample_indices)
              if samples[i].group_id == 0 and len(samples[i].completion_ids)}  # fmt: skip
    assert len(firsts) == 1


def test_a_group_longer_than_a_row_is_split_with_a_prompt_copy_per_part():
    samples = _groups(completion_len=(6, 9))
    cap = len(samples[0].prompt_ids) + 2 * 8  # at most two completions of group 0 per part
    mbs = plan_micro_batches(samples, range(4), 0, 1, 10_000, row_tokens=cap, share_prompts=True)
    rows = [mb.tokens.shape[0] for mb in mbs]
    assert sum(rows) == 2  # four completions of 6-8 tokens: two parts, each row with its own prompt
    assert sorted(i for mb in mbs for i in mb.sample_indices) == [0, 1, 2, 3]
    for mb in mbs:
        for r in range(mb.tokens.shape[0]):
            assert mb.tokens[r, : len(samples[0].prompt_ids)].tolist() == samples[0].prompt_ids.tolist()


def test_ranks_keep_a_group_together_and_count_alike():
    samples = _groups(num_groups=5)  # every group fits a row of 60 tokens: one unit, so one rank
    plans = [plan_micro_batches(samples, range(20), rank, 2, 60, row_tokens=60, share_prompts=True)
             for rank in range(2)]  # fmt: skip
    assert len(plans[0]) == len(plans[1])
    groups = [{samples[i].group_id for mb in plan for i in mb.sample_indices} for plan in plans]
    assert not groups[0] & groups[1] and groups[0] | groups[1] == set(range(5))
    for plan in plans:
        seen = [samples[i].group_id for mb in plan for i in mb.sample_indices]
        assert all(seen.count(g) == 4 for g in set(seen))


@pytest.mark.parametrize(("kernel", "atol"), [(sdpa_attention, 1e-12), (eager_attention, 1e-6)])  # eager: fp32 softmax
def test_attention_over_shared_prompts_equals_the_dense_mask(kernel, atol):
    """Against SDPA over the dense mask (``attention_mask`` with ``prefix_ids``), forward and gradients."""
    samples = _groups(seed=3, num_groups=4)
    (mb,) = plan_micro_batches(samples, range(len(samples)), 0, 1, 10_000, row_tokens=60, share_prompts=True)
    b, t = mb.tokens.shape
    torch.manual_seed(0)
    q = torch.randn(b, 4, t, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, t, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 2, t, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(b, 4, t, 8, dtype=torch.float64)
    outs, grads = [], []
    for fn in (kernel, masked_sdpa_attention):
        out = fn(q, k, v, segment_ids=mb.segment_ids, scale=0.35, prefix_ids=mb.prefix_ids)
        (out * grad).sum().backward()
        outs.append(out.detach())
        grads.append([x.grad.clone() for x in (q, k, v)])
        for x in (q, k, v):
            x.grad = None
    real = mb.segment_ids < mb.segment_ids.amax(dim=1, keepdim=True)  # padding rows of the output are arbitrary
    torch.testing.assert_close(outs[0].transpose(1, 2)[real], outs[1].transpose(1, 2)[real], rtol=0, atol=atol)
    for mine, ref in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=atol)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_log_probs_and_gradients_equal_each_sequence_alone(attention):
    """The independent reference: every sample's whole sequence through the model by itself (no packing at all)."""
    from trainer.step import forward_logprobs

    torch.manual_seed(0)
    model = build_model(MODEL.model_copy(update={"attention": attention}), torch.device("cpu")).double()
    samples = _groups(seed=5)
    (mb,) = plan_micro_batches(samples, range(len(samples)), 0, 1, 10_000, row_tokens=10_000, share_prompts=True)
    logprobs, _, _ = forward_logprobs(model, mb)
    weights = torch.randn_like(logprobs)
    (logprobs * weights).sum().backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for row, i in enumerate(mb.sample_indices):
        s, c = samples[i], len(samples[i].completion_ids)
        if c == 0:
            continue
        full = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None]
        hidden = model(full)[0, len(s.prompt_ids) - 1 : -1]
        alone, _ = model.token_logprobs(hidden, torch.from_numpy(s.completion_ids))
        torch.testing.assert_close(logprobs[row, :c].detach(), alone.detach(), rtol=0, atol=2e-6)
        total = total + (alone * weights[row, :c]).sum()
    total.backward()
    for name, p in model.named_parameters():  # the output head computes in float32 (its contract)
        torch.testing.assert_close(shared_grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("algo", [GRPOConfig(), PPOConfig()], ids=["grpo", "ppo"])
def test_an_rl_step_updates_the_weights_as_whole_sequences_do(algo):
    """One step (PPO: a critic and GAE too) on groups that share prompts: the same metrics and weights with and
    without sharing, within float32 noise; with it the model sees fewer tokens."""
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import plan_rank_micro_batches, rl_step

    samples = _groups(seed=7, num_groups=4, completion_len=(1, 9))
    results = []
    for share in (False, True):
        torch.manual_seed(0)
        # Adam's eps well above float32 noise: its first step moves a weight by ~lr whatever the gradient's size, so
        # a near-zero gradient's rounding would otherwise decide a whole step's direction.
        cfg = TrainerConfig(optimizer={"lr": 1e-2, "eps": 1e-3}, micro_batch_tokens=10_000, seed=0,
                            share_prompts=share)  # fmt: skip
        state = build_train_state(cfg, MODEL, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
        (mb,) = plan_rank_micro_batches(state, samples, range(len(samples)))
        assert (mb.prefix_ids is not None) == share
        metrics = rl_step(state, RolloutBatch(copy.deepcopy(samples)))
        results.append((metrics, {n: p.detach().clone() for n, p in state.policy.named_parameters()}))
    (whole_m, whole_w), (shared_m, shared_w) = results
    for key in ("loss", "grad_norm", "entropy"):
        if key in whole_m:
            assert shared_m[key] == pytest.approx(whole_m[key], rel=1e-4, abs=1e-6), key
    for name, w in whole_w.items():
        torch.testing.assert_close(shared_w[name], w, rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize(("model", "cfg", "shared"), [
    (MODEL, TrainerConfig(), True),
    (MODEL, TrainerConfig(share_prompts=False), False),
    (MODEL.model_copy(update={"attention": "splash"}), TrainerConfig(), False),  # takes no prefix_ids
    (MODEL.model_copy(update={"moe": MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=16)}), TrainerConfig(),
     False),  # the router's load-balancing term counts every sample's prompt
])  # fmt: skip
def test_where_prompts_are_shared(model, cfg, shared):
    from types import SimpleNamespace

    from trainer.step import shares_prompts

    assert shares_prompts(SimpleNamespace(cfg=cfg, model_cfg=model)) == shared
