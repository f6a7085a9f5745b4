"""PPO's critic starts from the policy the warm start produced, as PPO setups start the critic from the SFT model: its
body was left at the model before the warm start (random in ``ppo_tiny``). A LoRA critic's frozen base is then the
policy's, the one a resume builds it on (``Recipe.lora_base``: ``warm_start_model`` when the warm start trained every
weight), so a resumed run continues with the critic it checkpointed; it resumed over another base before."""

from __future__ import annotations

import pytest
import torch
from spawn_helpers import full_weights
from trainer_batches import random_batch

from common.net import free_port
from trainer.config import TrainerConfig
from trainer.models.config import LoRAConfig, ModelConfig
from trainer.rl.config import PPOConfig

MODEL = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, output_chunk_size=16, tie_embeddings=True,
)  # fmt: skip
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))


@pytest.mark.parametrize(("lora", "tied"), [(False, True), (True, True), (False, False)],
                         ids=["full", "lora", "full_untied"])  # fmt: skip
def test_the_critic_starts_from_the_warm_started_policy_and_resumes_over_it(tmp_path, lora: bool, tied: bool) -> None:
    """An untied model's critic holds no output head (it never uses one: it was loaded, gathered and saved)."""
    from trainer.models.hf_io import save_hf_checkpoint
    from trainer.models.transformer import build_model
    from trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    torch.manual_seed(3)
    model_cfg = MODEL.model_copy(update={"lora": LORA if lora else None, "tie_embeddings": tied})
    save_hf_checkpoint(build_model(model_cfg.model_copy(update={"lora": None})), str(tmp_path / "base"))
    cfg = TrainerConfig(optimizer=dict(lr=3e-3), critic_lr=1e-2, micro_batch_tokens=64,
                        checkpoint=dict(dir=str(tmp_path / "ckpt"), num_keep=1))  # fmt: skip
    algo = PPOConfig(group_size=4)
    batch = random_batch(11, prompt_len=(2, 8), completion_len=(2, 14), logprob=(-4.0, -3.0))
    warm = tmp_path / "warm_start_model"

    first = TrainerWorker(0, cfg, model_cfg, algo, init_path=str(tmp_path / "base"))
    first.setup("127.0.0.1", free_port())
    try:
        first.begin_warm_start(all_parameters=True)
        for step in range(2):
            first.sft_step(random_batch(20 + step).samples, lr=1e-2)
        first.finish_warm_start()
        assert first.state is not None and first.state.critic is not None
        policy, body = full_weights(first.state.policy), full_weights(first.state.critic.body)
        assert policy.keys() - body.keys() == (set() if tied else {"output.weight"}) and body.keys() <= policy.keys()
        for name, tensor in body.items():
            assert torch.equal(policy[name], tensor), name
        first.export_hf(str(warm), None)  # the driver's warm_start_model, which a LoRA resume builds on
        first.train_step(batch)
        first.save_checkpoint(data_cursor={"next": 1})
        critic = full_weights(first.state.critic)
        expected = first.train_step(random_batch(12, prompt_len=(2, 8), completion_len=(2, 14)))
    finally:
        first.shutdown()

    resumed = TrainerWorker(0, cfg, model_cfg, algo, init_path=str(warm if lora else tmp_path / "base"))
    resumed.setup("127.0.0.1", free_port(), resume=True)
    try:
        assert resumed.state is not None and resumed.state.critic is not None
        for name, tensor in full_weights(resumed.state.critic).items():
            assert torch.equal(tensor, critic[name]), name
        got = resumed.train_step(random_batch(12, prompt_len=(2, 8), completion_len=(2, 14)))
        assert got["critic/value_loss"] == expected["critic/value_loss"]
    finally:
        resumed.shutdown()
