"""Activation checkpointing (``trainer.activation_checkpoint``): the same loss and gradients as without it for every
model family, attention and expert block, LoRA with dropout, the PPO critic and a full RL step; it really keeps less
(bytes autograd saves for backward); passes without gradients never recompute; recipes name it and bad settings fail
with the field."""

from __future__ import annotations

import copy

import pytest
import torch
from trainer_batches import random_samples

from rollout.types import RolloutBatch
from trainer.config import ActivationCheckpointConfig, TrainerConfig
from trainer.metrics import is_timing
from trainer.models.config import LoRAConfig, ModelConfig, MoEConfig
from trainer.models.moe import router_aux_loss
from trainer.models.transformer import Transformer, build_model
from trainer.rl.config import GRPOConfig, KLConfig, PPOConfig


def _config(family: str, **overrides) -> ModelConfig:
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=32) if family == "qwen3_moe" else None
    fields = dict(
        family=family, vocab_size=96, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
        ffn_hidden_dim=64, qk_norm=family != "llama3", tie_embeddings=family == "qwen3", moe=moe,
        output_chunk_size=16,
    )  # fmt: skip
    return ModelConfig(**(fields | overrides))


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two packed rows of 3 sequences each: tokens, segment ids and the next-token targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 96, (2, 24), generator=g)
    segment_ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 8, [0] * 12 + [1] * 5 + [2] * 7])
    return tokens, segment_ids, torch.roll(tokens, -1, dims=1)


def _loss_and_grads(model: Transformer, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens, segment_ids, targets = _batch(seed)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the LoRA dropout masks of this pass
    hidden = model(tokens, segment_ids=segment_ids)
    logprobs, entropy = model.token_logprobs(hidden, targets)
    loss = -logprobs.mean() - 0.01 * entropy.mean()
    aux = router_aux_loss(model)
    if aux is not None:
        loss = loss + 0.1 * aux
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model: Transformer) -> int:
    """Bytes autograd holds for backward after one forward with gradients (each storage once)."""
    tokens, segment_ids, targets = _batch()
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, segment_ids=segment_ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


CASES = {
    "llama3-sdpa": _config("llama3"),
    "qwen3-eager": _config("qwen3", attention="eager"),
    "qwen3_moe-loop": _config("qwen3_moe", moe_experts="loop"),
    "qwen3_moe-grouped": _config("qwen3_moe", moe_experts="grouped", output_head="cached"),
    "qwen3-lora-dropout": _config("qwen3", output_head="dense", lora=LoRAConfig(rank=4, alpha=8, dropout=0.3)),
}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_blocks_give_the_same_loss_and_gradients(case: str, mode: str) -> None:
    cfg = CASES[case]
    torch.manual_seed(0)
    plain = build_model(cfg)
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpoint_blocks(ActivationCheckpointConfig(mode=mode).checkpointed_blocks(cfg.num_layers))
    loss, grads = _loss_and_grads(plain)
    loss_ac, grads_ac = _loss_and_grads(checkpointed)
    # The recomputation runs the same ops on the same inputs: equal to float rounding (float32; in practice exact).
    torch.testing.assert_close(loss_ac, loss, rtol=1e-6, atol=0)
    assert grads_ac.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    if cfg.moe is not None:  # the routing recorded for router statistics is the forward's, as without checkpointing
        for block, block_ac in zip(plain.layers, checkpointed.layers):
            torch.testing.assert_close(block_ac.moe.routing.probs, block.moe.routing.probs, rtol=0, atol=0)
            assert torch.equal(block_ac.moe.routing.expert_idx, block.moe.routing.expert_idx)


def test_checkpointing_keeps_less_for_backward() -> None:
    cfg = _config("qwen3", num_layers=6, dim=64, ffn_hidden_dim=256)
    model = build_model(cfg)
    saved = {}
    for mode in ("none", "selective", "full"):
        model.checkpoint_blocks(ActivationCheckpointConfig(mode=mode, every=3).checkpointed_blocks(cfg.num_layers))
        saved[mode] = _saved_bytes(model)
    # 'full' keeps each block's input; 'selective' every 3 also keeps all of 4 blocks' intermediates.
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["full"] * 3 < saved["none"]


def test_passes_without_gradients_run_once() -> None:
    cfg = _config("llama3")
    model = build_model(cfg)
    model.checkpoint_blocks(range(cfg.num_layers))
    calls = []
    hook = model.layers[0].attention.register_forward_hook(lambda *_: calls.append(1))
    tokens, segment_ids, _ = _batch()
    with torch.no_grad():
        model(tokens, segment_ids=segment_ids)
    assert len(calls) == 1
    model(tokens, segment_ids=segment_ids).sum().backward()
    assert len(calls) == 3  # with gradients: the forward, then the recompute in backward
    hook.remove()


def test_checkpoint_blocks_names_a_missing_block() -> None:
    with pytest.raises(IndexError, match=r"blocks \[4\] do not exist: the model has 4 blocks"):
        build_model(_config("llama3")).checkpoint_blocks([0, 4])


def test_config_selects_blocks_and_refuses_a_selective_every_of_one() -> None:
    assert ActivationCheckpointConfig().checkpointed_blocks(4) == []
    assert ActivationCheckpointConfig(mode="full").checkpointed_blocks(4) == [0, 1, 2, 3]
    assert ActivationCheckpointConfig(mode="selective", every=3).checkpointed_blocks(7) == [0, 3, 6]
    with pytest.raises(ValueError, match="every"):
        TrainerConfig(activation_checkpoint={"mode": "selective", "every": 1})
    with pytest.raises(ValueError, match="mode"):
        TrainerConfig(activation_checkpoint={"mode": "op"})


def test_every_outside_selective_mode_is_warned_unused(caplog) -> None:
    with caplog.at_level("WARNING", logger="rl_align"):
        ActivationCheckpointConfig(mode="selective", every=3)
        ActivationCheckpointConfig(mode="full")
        assert not caplog.records
        ActivationCheckpointConfig(mode="full", every=3)
    [record] = caplog.records
    assert "activation_checkpoint.every = 3: unused with mode = 'full'" in record.getMessage()


def test_a_recipe_names_it_and_a_bad_setting_names_the_field() -> None:
    from common.config import ConfigError
    from recipe import load_recipe

    section = "trainer.activation_checkpoint"
    recipe = load_recipe("recipes/grpo_tiny.toml", {f"{section}.mode": "selective", f"{section}.every": 3}, False)
    assert recipe.trainer.activation_checkpoint.checkpointed_blocks(6) == [0, 3]
    with pytest.raises(ConfigError, match=r"trainer\.activation_checkpoint\.every"):
        load_recipe("recipes/grpo_tiny.toml", {f"{section}.mode": "selective", f"{section}.every": 1}, False)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    "algo", [GRPOConfig(group_size=4, kl=KLConfig(coef=0.05)), PPOConfig(kl=KLConfig(coef=0.05, where="reward"))],
    ids=["grpo", "ppo"],
)  # fmt: skip
def test_rl_steps_are_unchanged_with_the_policy_and_critic_checkpointed(algo) -> None:
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    model_cfg = _config("qwen3")
    runs = {}
    for mode in ("none", "full"):
        cfg = TrainerConfig(optimizer={"lr": 1e-3}, micro_batch_tokens=64, activation_checkpoint={"mode": mode})
        state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"))
        modules = [state.policy] + ([state.critic.body] if state.critic is not None else [])
        assert all(block.checkpointed == (mode == "full") for m in modules for block in m.layers)
        samples = random_samples(3, num_groups=2, group_size=4, vocab_size=96)
        metrics = [rl_step(state, RolloutBatch(samples)) for _ in range(2)]
        weights = {n: p.detach().clone() for n, p in state.policy.named_parameters()}
        if state.critic is not None:
            weights.update({f"critic.{n}": p.detach().clone() for n, p in state.critic.named_parameters()})
        runs[mode] = metrics, weights
    (metrics, weights), (metrics_ac, weights_ac) = runs["none"], runs["full"]
    for m, m_ac in zip(metrics, metrics_ac):
        for key in m:
            if not is_timing(key):
                assert m_ac[key] == pytest.approx(m[key], rel=1e-6, abs=1e-9), key
    for name, w in weights.items():
        torch.testing.assert_close(weights_ac[name], w, rtol=1e-6, atol=1e-8, msg=name)
