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
        ({"optimizer": {"betas": [0.9, 1.0]}}, "betas"),
        ({"optimizer": {"lr": "1e-3"}}, "optimizer.lr"),
        ({"micro_batch_tokns": 10}, "unknown key"),
    ],
)
def test_invalid_configs_name_the_problem(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(TrainerConfig, data)


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
