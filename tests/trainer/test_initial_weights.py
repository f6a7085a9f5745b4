"""The trainer's models start from the HF checkpoint with every rank reading only its own pieces.

On 2 spawned gloo ranks, for each sharding (FSDP with the vocabulary split and PPO's critic and KL reference, tensor
parallel with LoRA, expert parallel with expert adapters), the state built from a local HF directory (bfloat16,
several files) holds, gathered, exactly what ``load_hf_checkpoint`` puts into an unsharded float32 model: every base
weight, the reference and the critic's body equal to the policy, the critic's value head zero, and fresh adapters
(B = 0, A drawn once and shared by the policy and the critic). A directory that does not hold the model is refused
before anything is allocated."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawn_helpers import end_rank, full_weights

from common.net import free_port
from tools.make_tiny_model import make_tiny_model

ADAPTERS = {"rank": 4, "alpha": 8.0, "target_modules": ("q_proj", "v_proj")}
CASES = {
    # name: (family, trainer parallelism, algorithm, lora)
    "fsdp-vocab-split-ppo": ("qwen3", {"vocab_parallel": True}, "ppo", None),
    "tensor-parallel-lora": ("qwen3", {"tensor_parallel_degree": 2}, "grpo", ADAPTERS),
    "tensor-parallel-vocab-split-ppo": ("qwen3", {"tensor_parallel_degree": 2, "vocab_parallel": True}, "ppo", None),
    "expert-parallel-expert-lora": ("qwen3_moe", {"expert_parallel_degree": 2}, "grpo",
                                    {**ADAPTERS, "target_parameters": ("mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj")}),
}  # fmt: skip


def _hf_dir(root: Path, family: str) -> Path:
    """A tiny HF directory of ``family`` in bfloat16, saved in several files (an index), untied head."""
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
    from trainer.models.transformer import build_model

    moe = {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32} if family == "qwen3_moe" else {}
    single = make_tiny_model(root / "single", family=family, seed=5, hidden_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, tie_word_embeddings=False, dtype="bfloat16", **moe)  # fmt: skip
    model = build_model(model_config_from_hf(str(single)), dtype=torch.bfloat16)
    load_hf_checkpoint(model, str(single))
    out = root / "sharded"
    save_hf_checkpoint(model, str(out), max_shard_bytes=40_000)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((single / name).read_bytes())
    return out


def _configs(case: str, path: Path):
    from trainer.config import TrainerConfig
    from trainer.models.hf_config import model_config_from_hf
    from trainer.rl.config import GRPOConfig, KLConfig, PPOConfig

    family, parallelism, algo, lora = CASES[case]
    cfg = TrainerConfig(num_ranks=2, parallelism=parallelism, micro_batch_tokens=64)
    algorithm = PPOConfig(kl=KLConfig(coef=0.05)) if algo == "ppo" else GRPOConfig(group_size=4, kl=KLConfig(coef=0.05))
    return cfg, model_config_from_hf(str(path), lora=lora), algorithm


def _worker(rank: int, paths: dict[str, str], port: int, out_dir: str) -> None:
    """Every case in one process group (a spawn of two ranks costs more than a case): ``<case>.pt`` each."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state

    for case, (family, *_) in CASES.items():
        path = paths[family]
        cfg, model_cfg, algo = _configs(case, Path(path))
        state = build_train_state(cfg, model_cfg, algo, torch.device("cpu"), build_mesh(cfg, "cpu"), init_path=path)
        result = {"policy": full_weights(state.policy)}
        for part in ("reference", "critic"):
            if getattr(state, part) is not None:
                result[part] = full_weights(getattr(state, part))
        if rank == 0:
            torch.save(result, os.path.join(out_dir, f"{case}.pt"))
    end_rank()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("initial")
    return {family: _hf_dir(root / family, family) for family in ("qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def started(hf_dirs, tmp_path_factory) -> Path:
    """Where the ranks' weights of every case are, as :func:`_worker` wrote them."""
    out = tmp_path_factory.mktemp("started")
    paths = {family: str(path) for family, path in hf_dirs.items()}
    mp.spawn(_worker, args=(paths, free_port(), str(out)), nprocs=2, join=True)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_models_start_from_the_checkpoint_a_piece_a_rank(hf_dirs, started, case):
    from trainer.models.hf_io import load_hf_checkpoint
    from trainer.models.lora import is_adapter
    from trainer.models.transformer import build_model

    path = hf_dirs[CASES[case][0]]
    got = torch.load(started / f"{case}.pt")
    _, model_cfg, _ = _configs(case, path)
    expected = build_model(model_cfg, dtype=torch.float32)
    load_hf_checkpoint(expected, str(path))
    want = {n: p.detach() for n, p in expected.named_parameters()}
    policy = got["policy"]
    assert set(policy) == set(want)
    for name, tensor in policy.items():
        if not is_adapter(name):
            assert torch.equal(tensor, want[name]), name
        elif name.endswith("lora_B"):
            assert not tensor.any(), name  # a fresh adapter leaves the model the base
        else:
            assert tensor.std() > 0, name  # A drawn, as reset_adapter draws it
    adapters = [n for n in policy if is_adapter(n)]
    assert bool(adapters) == (model_cfg.lora is not None)
    if "reference" in got:
        assert all(torch.equal(got["reference"][n], policy[n]) for n in policy)
    if "critic" in got:
        critic = got["critic"]  # less an untied output head, which the critic never uses
        body = {n for n in policy if n != "output.weight"}
        assert {n for n in critic if n.startswith("body.")} == {f"body.{n}" for n in body}
        assert all(torch.equal(critic[f"body.{n}"], policy[n]) for n in body)
        assert not critic["value_head.weight"].any() and not critic["value_head.bias"].any()


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_built(hf_dirs):
    from trainer.initial_weights import InitialWeights
    from trainer.models.hf_config import model_config_from_hf

    cfg = model_config_from_hf(str(hf_dirs["qwen3"]))
    with pytest.raises(ValueError, match="has shape"):
        InitialWeights(cfg.model_copy(update={"vocab_size": cfg.vocab_size + 64}), hf_dirs["qwen3"])
    with pytest.raises(ValueError, match="does not cover"):
        InitialWeights(cfg.model_copy(update={"num_layers": 3}), hf_dirs["qwen3"])
