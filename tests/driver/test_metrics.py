"""The run's metric sinks: JSONL always, TensorBoard, Prometheus on loopback, and the curves PNG at the end."""

import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from common.net import free_port
from driver.metrics import MetricsLogger, plot_curves, read_jsonl


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_metrics_go_to_jsonl_tensorboard_prometheus_and_png(tmp_path, capsys):
    port = free_port()
    logger = MetricsLogger(tmp_path, num_steps=3, tensorboard=True, progress=True, prometheus_port=port)
    logger.log(0, {"sft_loss": 1.5}, phase="sft")
    for step in range(3):
        logger.log(step, {"reward/mean": 0.1 * step, "train/kl": 0.01, "perf/tokens_per_s": 100.0, "bad": float("nan")})
    scraped = _scrape(port)
    logger.close()

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["phase"] for r in records] == ["sft", "rl", "rl", "rl"]
    assert records[-1]["reward/mean"] == 0.2 and records[-1]["bad"] is None
    assert any((tmp_path / "tensorboard").iterdir())
    assert "rl_align_reward_mean 0.2" in scraped
    assert "step 3/3" in capsys.readouterr().err
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_close_stops_the_prometheus_endpoint_and_frees_its_port(tmp_path):
    port = free_port()
    logger = MetricsLogger(tmp_path, num_steps=1, tensorboard=False, progress=False, prometheus_port=port)
    logger.log(0, {"reward/mean": 1.0})
    assert "rl_align_reward_mean 1.0" in _scrape(port)
    logger.close()
    with pytest.raises(urllib.error.URLError):
        _scrape(port)
    nxt = MetricsLogger(tmp_path / "next", num_steps=1, tensorboard=False, progress=False, prometheus_port=port)
    nxt.log(0, {"reward/mean": 2.0})  # the next run in this process takes the port
    assert "rl_align_reward_mean 2.0" in _scrape(port)
    nxt.close()


def test_a_prometheus_port_another_process_holds_fails_before_ray_naming_the_setting(tmp_path, capsys, no_ray):
    """Two jobs on one cluster with the same port: the second died in a raw `Address already in use` traceback from
    the metrics logger, after Ray had started and its files were written."""
    import socket

    from driver.run import run
    from recipe import load_recipe

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        recipe = load_recipe("recipes/grpo_tiny.toml", {
            "run.output_dir": str(tmp_path / "out"), "run.logging.prometheus_port": port})  # fmt: skip
        assert run(recipe) == 2
        err = capsys.readouterr().err
        assert f"run.logging.prometheus_port = {port}: cannot serve metrics on 127.0.0.1:{port}" in err, err
        with pytest.raises(OSError, match=f"run.logging.prometheus_port = {port}: cannot serve metrics on 127.0.0.1"):
            MetricsLogger(tmp_path / "direct", num_steps=1, tensorboard=False, progress=False, prometheus_port=port)
        assert not (tmp_path / "direct" / "metrics.jsonl").exists()


def test_resumed_logger_appends(tmp_path):
    first = MetricsLogger(tmp_path, 2, tensorboard=False, progress=False)
    first.log(0, {"reward/mean": 1.0})
    first.close()
    second = MetricsLogger(tmp_path, 2, tensorboard=False, progress=False, append=True)
    second.log(1, {"reward/mean": 2.0})
    second.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_the_progress_line_s_time_per_step_and_eta_follow_the_steps(tmp_path, capsys, monkeypatch):
    # The first line read "0.0s/step ETA 0s" after a 451 s step, the second half the true time per step.
    clock = iter([1000.0, 1450.0, 1950.0])
    monkeypatch.setattr("driver.metrics.time.monotonic", lambda: next(clock))
    logger = MetricsLogger(tmp_path, num_steps=4, tensorboard=False)
    logger.log(0, {"time/step_s": 451.5})
    logger.log(1, {"time/step_s": 490.0})  # 450 s of wall clock since the first line
    logger.log(2, {})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("451.5s/step ETA 1354s")  # three steps left
    assert lines[1].endswith("450.8s/step ETA 902s")
    assert lines[2].endswith("467.2s/step ETA 467s")
    logger.close()


def test_a_full_volume_is_an_error_naming_the_free_space_and_leaves_no_half_record(tmp_path):
    """A full output volume ended the run in a traceback, and closing the logger raised the same error again over
    it; the half-written last line broke every reader of metrics.jsonl. A file-size limit lets the record's first
    bytes through and refuses the rest (a real partial write); /dev/full answers every write with ENOSPC."""
    script = textwrap.dedent(f"""
        import os, resource, signal
        from pathlib import Path
        from driver.metrics import MetricsLogger, MetricsWriteError

        logger = MetricsLogger(Path({str(tmp_path)!r}), num_steps=3, tensorboard=False, progress=False)
        logger.log(0, {{"reward/mean": 0.5}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        size = (Path({str(tmp_path)!r}) / "metrics.jsonl").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, resource.RLIM_INFINITY))
        try:
            logger.log(1, {{"reward/mean": 0.6}})
        except MetricsWriteError as e:
            print("refused:", e)
        logger.close()
        logger._fd = os.open("/dev/full", os.O_WRONLY)
        try:
            logger.log(2, {{"reward/mean": 0.7}})
        except MetricsWriteError as e:
            print("refused:", e)
        logger.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert "the metrics could not be written under" in refused[0] and "File too large" in refused[0], refused
    assert re.search(r"No space left on device\); [0-9,.]+ MB are free under ", refused[1]), refused
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0]  # no half of record 1


def test_an_evaluation_is_one_tensorboard_curve_whether_logged_in_a_step_or_on_its_own(tmp_path):
    """Evaluations at the start, the end and a resume (records of their own) went to eval/eval/accuracy, those
    between them (in an RL step's record) to eval/accuracy: no chart showed the whole curve."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, num_steps=3, tensorboard=True, progress=False)
    logger.log(-1, {"eval/accuracy": 0.2}, phase="eval")
    logger.log(1, {"reward/mean": 0.5, "eval/accuracy": 0.4})
    logger.log(2, {"eval/accuracy": 0.6, "kl": 0.1}, phase="eval")
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("eval/accuracy")] == [(-1, 0.2), (1, 0.4), (2, 0.6)]
    assert "eval/kl" in events.Tags()["scalars"]
