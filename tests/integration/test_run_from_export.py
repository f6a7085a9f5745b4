"""A run started from an exported model continues that model's policy versions: a receiver started on a copy of the
export (which records the version its run reached) takes every push of the new run (it refused them all as "not
newer" when each run numbered its versions from 1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from it_helpers import ONE_ENGINE, RECIPE, REPO, clean_env, read_metrics, run_to_end, small_run_args, tail

from common.config import parse_overrides
from driver.preflight import ensure_model
from recipe import load_recipe
from weight_sync.sink import read_policy_version, write_policy_version

EXPORTED_VERSION = 40


def test_a_run_from_an_exported_model_numbers_on_from_its_version_and_a_copy_takes_its_pushes(tmp_path: Path) -> None:
    model = tmp_path / "model"
    ensure_model(load_recipe(RECIPE, parse_overrides(["--model.path", str(model)]), check_paths=False))
    write_policy_version(str(model), EXPORTED_VERSION)  # what an export records (trainer.export)
    served = tmp_path / "served"
    shutil.copytree(model, served)
    receiver_log = tmp_path / "receiver.log"
    with receiver_log.open("w") as err:
        receiver = subprocess.Popen(
            [sys.executable, "-m", "weight_sync", "serve", "--dir", str(served), "--port", "0"],
            cwd=REPO, env=clean_env(RL_ALIGN_WEIGHT_SYNC_TOKEN="t", PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
            stderr=err, text=True,
        )  # fmt: skip
    try:
        line = receiver.stdout.readline()  # the address, once it serves; EOF if it exits
        assert line.startswith("serving"), line + tail(receiver_log)
        address = line.split()[-1]
        log = tmp_path / "run.log"
        args = small_run_args(tmp_path, 2, *ONE_ENGINE, "--run.warm_start.num_steps", "0",
                              "--weight_sync.endpoints", json.dumps([address]))  # fmt: skip
        assert run_to_end(args, log, RECIPE, 420, RL_ALIGN_WEIGHT_SYNC_TOKEN="t") == 0, tail(log)
        versions = [r["train/policy_version"] for r in read_metrics(tmp_path / "out") if r.get("phase") == "rl"]
        assert versions == [EXPORTED_VERSION + 1, EXPORTED_VERSION + 2], versions
        assert read_policy_version(str(served)) == EXPORTED_VERSION + 2, tail(log)
        final = tmp_path / "out" / "final_model"
        assert read_policy_version(str(final)) == EXPORTED_VERSION + 2
    finally:
        receiver.terminate()
        receiver.wait(timeout=30)
