"""A resumed run's metrics hold each step once: records past the checkpoint are dropped from the JSONL file, and the
TensorBoard events are rebuilt from the records kept (fast, no Ray)."""

from __future__ import annotations

from pathlib import Path

from driver.metrics import MetricsLogger, read_jsonl


def test_drop_from_keeps_sft_and_steps_before_checkpoint(tmp_path: Path) -> None:
    first = MetricsLogger(tmp_path, 6, tensorboard=False, progress=False)
    for step in range(3):
        first.log(step, {"loss": 1.0}, phase="sft")
    first.log(-1, {"eval/accuracy": 0.1}, phase="eval")
    for step in range(5):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "pha')  # the killed run's last line, cut short

    resumed = MetricsLogger(tmp_path, 6, tensorboard=False, progress=False, append=True)
    assert resumed.drop_from(2) == 4  # steps 2, 3, 4 and the cut line
    for step in range(2, 6):
        resumed.log(step, {"reward/mean": 10.0 + step})
    resumed.close()

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["phase"], r["step"]) for r in records] == [
        *[("sft", s) for s in range(3)], ("eval", -1), *[("rl", s) for s in range(6)]
    ]
    assert [r["reward/mean"] for r in records if r["phase"] == "rl"] == [0.0, 1.0, 12.0, 13.0, 14.0, 15.0]


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    first = MetricsLogger(tmp_path, 6, tensorboard=True, progress=False)
    for step in range(6):  # a warm start longer than the RL steps the resume trains again
        first.log(step, {"loss": float(step)}, phase="sft")
    for step in range(5):
        first.log(step, {"reward/mean": float(step)})
    first.close()

    resumed = MetricsLogger(tmp_path, 6, tensorboard=True, progress=False, append=True)
    resumed.drop_from(2)
    for step in range(2, 6):
        resumed.log(step, {"reward/mean": 10.0 + step})
    resumed.close()

    def scalars(run: Path, tag: str) -> list[tuple[int, float]]:
        """Every point of ``tag`` in the run's event files, as raw events (no loader's purge rules applied)."""
        points = []
        for path in sorted(run.glob("events.out.tfevents.*")):
            for event in LegacyEventFileLoader(str(path)).Load():
                points += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
        return sorted(points)

    board = tmp_path / "tensorboard"
    assert scalars(board, "reward/mean") == [(0, 0.0), (1, 1.0), *[(s, 10.0 + s) for s in range(2, 6)]]
    assert scalars(board / "sft", "sft/loss") == [(s, float(s)) for s in range(6)]  # the warm start stays whole

