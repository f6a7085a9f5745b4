"""TrainerConfig validation and the optimizer / learning-rate schedule."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from common.config import ConfigError, validate_config
from trainer.config import ScheduleConfig, TrainerConfig
from trainer.optim import build_optimizer, build_scheduler, lr_multiplier


def test_config_module_imports_no_torch() -> None:
    code = "import sys, trainer.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_defaults_and_backend() -> None:
    cfg = TrainerConfig()
    assert cfg.device == "cpu" and cfg.backend == "gloo"
    assert TrainerConfig(device="cuda").backend == "nccl"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"mixed_precision": {"param_dtype": "float16"}}, "not supported on device 'cpu'"),
        ({"device": "tpu", "mixed_precision": {"reduce_dtype": "float16"}}, "not supported on device 'tpu'"),
        ({"schedule": {"kind": "cosine"}}, "needs schedule.num_total_steps"),
        ({"schedule": {"kind": "cosine", "num_warmup_steps": 5, "num_total_steps": 5}}, "must exceed"),
        ({"num_ranks": 3, "parallelism": {"tensor_parallel_degree": 2}}, "multiple of"),
        ({"num_ranks": 2, "parallelism": {"fsdp": False}}, "need parallelism.fsdp = true"),
        ({"num_ranks": 6, "parallelism": {"expert_parallel_degree": 4}}, "multiple of parallelism.expert_parallel"),
        ({"num_ranks": 4, "parallelism": {"expert_parallel_degree": 2, "tensor_parallel_degree": 2}}, "not built"),
        ({"num_ranks": 2, "parallelism": {"expert_parallel_degree": 2, "fsdp": False}}, "needs parallelism.fsdp"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "betas"),
        ({"optimizer": {"lr": "1e-3"}}, "optimizer.lr"),
        ({"micro_batch_tokns": 10}, "unknown key"),
    ],
)
def test_invalid_configs_name_the_problem(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(TrainerConfig, data)


def test_expert_parallel_needs_an_moe_model_whose_experts_it_divides() -> None:
    from trainer.models.config import ModelConfig, MoEConfig

    cfg = TrainerConfig(num_ranks=4, parallelism=dict(expert_parallel_degree=4))
    shape = dict(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64)
    dense = ModelConfig(family="llama3", **shape)
    with pytest.raises(ValueError, match=r"expert_parallel_degree = 4 .* has no experts: set it to 1"):
        cfg.check_model(dense)
    for num_experts in (6, 8):
        moe = ModelConfig(family="qwen3_moe", qk_norm=True, **shape,
                          moe=MoEConfig(num_experts=num_experts, top_k=2, expert_ffn_hidden_dim=16))  # fmt: skip
        if num_experts == 6:
            with pytest.raises(ValueError, match="does not divide the model's 6 experts per layer: use a divisor"):
                cfg.check_model(moe)
        else:
            cfg.check_model(moe)
    TrainerConfig().check_model(dense)


def test_vocab_parallel_needs_the_chunked_head() -> None:
    from trainer.models.config import ModelConfig

    shape = dict(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64)
    cfg = TrainerConfig(num_ranks=2, parallelism=dict(vocab_parallel=True))
    with pytest.raises(ValueError, match='output_head = "cached": set output_head = "chunked" or vocab_parallel'):
        cfg.check_model(ModelConfig(family="llama3", output_head="cached", **shape))
    cfg.check_model(ModelConfig(family="llama3", output_head="chunked", **shape))


def test_varlen_attention_with_float32_compute_is_refused_naming_the_fix() -> None:
    from trainer.models.config import ModelConfig

    shape = dict(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64)
    model = ModelConfig(family="llama3", attention="varlen", **shape)
    with pytest.raises(ValueError, match='param_dtype = "float32": set it to "bfloat16" or use attention = "sdpa"'):
        TrainerConfig(device="cuda").check_model(model)
    TrainerConfig(device="cuda", mixed_precision={"param_dtype": "bfloat16"}).check_model(model)


def test_bf16_is_accepted_on_cpu() -> None:
    cfg = validate_config(TrainerConfig, {"mixed_precision": {"param_dtype": "bfloat16"}})
    assert cfg.mixed_precision.param_dtype == "bfloat16"


def test_warmup_then_cosine() -> None:
    cfg = ScheduleConfig(kind="cosine", num_warmup_steps=3, num_total_steps=13, min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg) for s in range(16)]
    assert values[:3] == pytest.approx([0.25, 0.5, 0.75])
    assert values[3] == pytest.approx(1.0)
    assert values[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[13:] == pytest.approx([0.1] * 3)
    assert all(a >= b for a, b in zip(values[3:], values[4:]))
    assert lr_multiplier(100, ScheduleConfig()) == 1.0


def test_scheduler_follows_the_multiplier() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    cfg = TrainerConfig(
        optimizer={"lr": 0.1, "weight_decay": 0.5}, schedule={"num_warmup_steps": 1, "kind": "constant"}
    )
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_scheduler(opt, cfg.schedule)
    decays = sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups)
    assert decays == [(0.0, 3), (0.5, 1)]  # only the Linear weight decays; biases and the norm do not
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.1])


def test_toml_round_trip() -> None:
    import tomllib

    from common.config import to_toml

    cfg = validate_config(
        TrainerConfig,
        {"num_ranks": 2, "optimizer": {"betas": [0.9, 0.95]}, "schedule": {"kind": "cosine", "num_total_steps": 10}},
    )
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert validate_config(TrainerConfig, tomllib.loads(to_toml(cfg))) == cfg
