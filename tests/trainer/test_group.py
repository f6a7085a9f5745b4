"""TrainerGroup on Ray: 2 ranks train, checkpoint, export, and push their own shards into a real gRPC receiver that
assembles exactly the single-rank weights (and into a bfloat16 receiver in the dtype it declares)."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
from trainer_batches import random_batch

from rollout.types import RolloutBatch
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.rl.config import GRPOConfig

MODEL = ModelConfig(
    family="llama3", vocab_size=96, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=48,
    tie_embeddings=False, output_chunk_size=32,
)  # fmt: skip


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="rt5", dir="/tmp")
    ray.init(
        address="local", _temp_dir=temp_dir, include_dashboard=False, num_cpus=2, log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}},
    )  # fmt: skip
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _batch() -> RolloutBatch:
    return random_batch(7, num_groups=2, prompt_len=(2, 8), completion_len=(1, 16), vocab_size=96, logprob=-4.5)


def _receiver(model: ModelConfig):
    """A started gRPC receiver into a state dict of ``model``'s HF tensors (zeros): (that dict, the receiver)."""
    from trainer.models.hf_io import hf_manifest
    from weight_sync.config import WeightSyncConfig
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import StateDictSink

    received = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in hf_manifest(model)}
    receiver = WeightReceiver(StateDictSink(received), WeightSyncConfig())
    receiver.start()
    return received, receiver


def _two_ranks(model: ModelConfig, tmp_path, receiver, **parallelism):
    """A 2-rank TrainerGroup of ``model`` pushing to ``receiver``: (its config, the group)."""
    from trainer.group import TrainerGroup
    from weight_sync.config import WeightSyncConfig

    cfg = TrainerConfig(
        num_ranks=2, parallelism=parallelism, micro_batch_tokens=64, optimizer=dict(lr=1e-3),
        checkpoint=dict(dir=str(tmp_path / "ck")),
    )  # fmt: skip
    group = TrainerGroup(
        cfg, model, GRPOConfig(group_size=4), weight_sync=WeightSyncConfig(endpoints=[receiver.address]),
        num_cpus_per_rank=0.5,
    )  # fmt: skip
    return cfg, group


def _first_push_is_the_one_rank_model(group, cfg: TrainerConfig, model: ModelConfig, received: dict) -> dict:
    """Push the seeded initial weights as the ranks' shards and check they equal the 1-rank model exactly (receivers
    start at version 0 and only take newer versions, so this goes out as version 1); returns that model's tensors."""
    from trainer.models.hf_io import hf_state_dict
    from trainer.models.transformer import build_model

    outcome = group.push_weights(policy_version=1)
    assert [o["push_errors"] for o in outcome] == [{}, {}] and outcome[0]["commit_errors"] == {}
    torch.manual_seed(cfg.seed)
    single = dict(hf_state_dict(build_model(model, device="cpu", dtype=torch.float32)))
    assert received.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(received[name], tensor), name
    return single


def test_two_rank_group_trains_checkpoints_and_pushes(ray_session, tmp_path) -> None:
    from trainer.models.hf_io import hf_manifest
    from weight_sync.config import WeightSyncConfig
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import StateDictSink

    received, receiver = _receiver(MODEL)
    cfg, group = _two_ranks(MODEL, tmp_path, receiver)
    try:
        single = _first_push_is_the_one_rank_model(group, cfg, MODEL, received)

        metrics = group.train_step(_batch())
        assert metrics["policy_version"] == 1.0 and np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        group.push_weights(policy_version=2)
        assert receiver.policy_version == 2
        # A late receiver (e.g. a replacement rollout worker) catches up with a one-off push of the same version; the
        # regular receiver, already at version 2, is not pushed to again (it would refuse and report an error).
        late = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in hf_manifest(MODEL)}
        late_receiver = WeightReceiver(StateDictSink(late), WeightSyncConfig())
        late_receiver.start()
        try:
            outcome = group.push_weights(policy_version=2, endpoints=[late_receiver.address])
            assert [o["push_errors"] for o in outcome] == [{}, {}] and outcome[0]["commit_errors"] == {}
            assert late_receiver.policy_version == 2
        finally:
            late_receiver.stop()
        # A receiver serving a bfloat16 checkpoint (as engines do) declares bfloat16: the float32 masters go out cast.
        served = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape, _ in hf_manifest(MODEL)}
        bf16_receiver = WeightReceiver(StateDictSink(served), WeightSyncConfig())
        bf16_receiver.start()
        try:
            outcome = group.push_weights(policy_version=2, endpoints=[bf16_receiver.address])
            assert [o["push_errors"] for o in outcome] == [{}, {}] and outcome[0]["commit_errors"] == {}
        finally:
            bf16_receiver.stop()
        group.export_hf(str(tmp_path / "hf"), None)
        from safetensors.torch import load_file

        exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
        for name, tensor in exported.items():
            assert torch.equal(received[name], tensor), name
            assert torch.equal(late[name], tensor), name
            assert torch.equal(served[name], tensor.to(torch.bfloat16)), name
        assert not torch.equal(received["model.embed_tokens.weight"], single["model.embed_tokens.weight"])

        path = group.save_checkpoint(data_cursor={"index": 8})
        assert os.path.exists(os.path.join(path, "COMPLETE"))
        group.train_step(_batch())
        state = group.load_checkpoint()
        assert state == {"step": 1, "policy_version": 1, "data_cursor": {"index": 8}}
    finally:
        group.shutdown()
        receiver.stop()


def test_expert_parallel_ranks_push_their_own_experts(ray_session, tmp_path) -> None:
    """2 ranks with EP = 2 on a Qwen3-MoE model: each pushes only its half of every layer's experts, the receiver's
    coverage check accepts the union, and it assembles exactly the one-rank model; the HF export agrees after a step."""
    from safetensors.torch import load_file

    from trainer.models.config import MoEConfig

    moe = ModelConfig(
        family="qwen3_moe", vocab_size=96, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        ffn_hidden_dim=48, qk_norm=True, tie_embeddings=False, output_chunk_size=32,
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=16),
    )  # fmt: skip
    received, receiver = _receiver(moe)
    cfg, group = _two_ranks(moe, tmp_path, receiver, expert_parallel_degree=2)
    try:
        single = _first_push_is_the_one_rank_model(group, cfg, moe, received)
        metrics = group.train_step(_batch())
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        outcome = group.push_weights(policy_version=2)
        assert [o["push_errors"] for o in outcome] == [{}, {}] and receiver.policy_version == 2
        group.export_hf(str(tmp_path / "hf"), None)
        exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
        assert exported.keys() == received.keys()
        for name, tensor in exported.items():
            assert torch.equal(received[name], tensor), name
        assert not torch.equal(received["model.layers.0.mlp.experts.3.up_proj.weight"],
                               single["model.layers.0.mlp.experts.3.up_proj.weight"])  # fmt: skip
    finally:
        group.shutdown()
        receiver.stop()
