"""The data of ``benchmarks/e2e_vs_trl.py``'s timed runs and the report it prints from them (see that script's docstring
for what is measured and how)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.machine import med_range

__all__ = ["TARGET", "RunResult", "Setting", "report_long", "report_short"]

TARGET = 1.5
"""Ours must reach the accuracy threshold this many times faster than TRL."""


@dataclass(frozen=True)
class Setting:
    """One completion-length setting: how many steps, how long the completions, how often to checkpoint."""

    name: str
    num_steps: int
    max_tokens: int
    save_every: int
    long: bool


@dataclass
class RunResult:
    """One timed run of one side: its per-step phases, checkpoints and the load around it."""

    side: str
    rep: int
    setting: Setting
    start: float
    """``time.time()`` just before the process was started."""
    end: float
    load_before: str
    load_after: str
    first_step_begin: float
    last_step_end: float
    steps: list[dict[str, float]]
    """Per step: phase seconds (``step_s`` the whole step), ``cpu_s``, ``cores_busy`` (CPU seconds per second and
    core), ``tokens``, ``completion_tokens``."""
    checkpoints: dict[int, tuple[Path, float]] = field(default_factory=dict)
    """step -> (HF directory, seconds from process start to its weights file)."""
    accuracy: dict[int, tuple[float, float]] = field(default_factory=dict)
    """step -> (sampled, greedy) held-out accuracy; step 0 is the warm start."""
    versions: str = ""
    """TRL's side: the library versions it ran."""
    layout: str = ""
    """TRL's side: its micro-batch layout."""


def phase_medians(run: RunResult) -> dict[str, float]:
    """Median seconds per phase over the run's steps after the first (its warm-up), all steps if there is one."""
    steps = run.steps[1:] or run.steps
    return {k: statistics.median(s[k] for s in steps) for k in steps[0] if k not in ("reward",)}


def time_to_threshold(run: RunResult, threshold: float) -> tuple[float, int] | None:
    for step in sorted(run.checkpoints):
        if run.accuracy[step][0] >= threshold:
            return run.checkpoints[step][1], step
    return None


def accuracy_at(run: RunResult, seconds: float) -> tuple[int, float]:
    """(step, sampled accuracy) of the newest checkpoint written by ``seconds`` after process start (0: warm start)."""
    written = [s for s, (_, t) in run.checkpoints.items() if t <= seconds]
    step = max(written, default=0)
    return step, run.accuracy[step][0]


def print_runs(runs: list[RunResult]) -> None:
    print(f"{'run':12s} {'load before -> after':>30s} {'start-up s':>11s} {'RL s':>8s} {'total s':>8s} "
          f"{'mean reward':>12s}")  # fmt: skip
    for r in runs:
        rewards = [s["reward"] for s in r.steps]
        print(f"{r.side + ' rep ' + str(r.rep):12s} {r.load_before + ' -> ' + r.load_after:>30s} "
              f"{r.first_step_begin - r.start:11.1f} {r.last_step_end - r.first_step_begin:8.1f} "
              f"{r.end - r.start:8.1f} {statistics.mean(rewards):12.3f}")  # fmt: skip


def print_phases(runs: list[RunResult]) -> dict[str, dict[str, list[float]]]:
    """Print s/step by phase per side (median [range] over reps); return side -> phase -> per-rep medians."""
    by_side: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for k, v in phase_medians(r).items():
            by_side.setdefault(r.side, {}).setdefault(k, []).append(v)
    print("s/step by phase (median over steps 2.., then median [range] over reps):")
    for side, phases in by_side.items():
        parts = [f"{k.strip()} {med_range(v)}" if not k.startswith(" ") else f"(of it {k.strip()} {med_range(v)})"
                 for k, v in phases.items()
                 if k not in ("tokens", "completion_tokens", "step_s", "cpu_s", "cores_busy")]  # fmt: skip
        print(f"  {side:5s} " + "  ".join(parts))
        print(f"  {'':5s} step {med_range(phases['step_s'])} s, CPU {med_range(phases['cpu_s'])} CPU-s, cores busy "
              f"{med_range(phases['cores_busy'])}")
    return by_side


def report_short(runs: list[RunResult], threshold: float, warm: tuple[float, float]) -> None:
    setting = runs[0].setting
    print(f"\n== short completions (at most {setting.max_tokens} tokens): {setting.num_steps} steps, checkpoints every "
          f"{setting.save_every} ==")  # fmt: skip
    print_runs(runs)
    reached: dict[str, list[float]] = {}
    for r in runs:
        hit = time_to_threshold(r, threshold)
        reached.setdefault(r.side, []).append(hit[0] if hit else float("inf"))
        where = f"step {hit[1]} at {hit[0]:.1f} s" if hit else "not reached"
        print(f"  {r.side} rep {r.rep}: sampled held-out accuracy >= {threshold}: {where}")
    ours, trl = (statistics.median(reached.get(s, [float("inf")])) for s in ("ours", "TRL"))
    if ours == float("inf"):
        verdict = "no ratio: ours did not reach it (target: NOT met)"
    elif trl == float("inf"):
        verdict = "no ratio: TRL did not reach it, ours did"
    else:
        verdict = f"{trl / ours:.2f}x (target >= {TARGET}x: {'met' if trl / ours >= TARGET else 'NOT met'})"
    print(f"time from process start to sampled held-out accuracy >= {threshold}: ours "
          f"{med_range(reached['ours'], '{:.1f}')} s, TRL {med_range(reached['TRL'], '{:.1f}')} s; TRL / ours = "
          f"{verdict}")  # fmt: skip
    if warm[0] >= threshold:
        print(f"  note: the warm start itself is at {warm[0]:.3f} >= {threshold} (the first RL steps dip below it); "
              "a higher --threshold measures the climb")  # fmt: skip
    levels = sorted({0.5, 0.6, 0.7, 0.8, threshold})
    cells = []
    for level in levels:
        medians = [statistics.median(t[0] if (t := time_to_threshold(r, level)) else float("inf")
                                     for r in runs if r.side == side) for side in ("ours", "TRL")]  # fmt: skip
        cells.append(f"{level}: {medians[0]:.0f} / {medians[1]:.0f} s")
    print("  other levels, ours / TRL (median s from process start; inf: not reached): " + ", ".join(cells))
    by_side = print_phases(runs)
    step_ratio = statistics.median(by_side["TRL"]["step_s"]) / statistics.median(by_side["ours"]["step_s"])
    print(f"  s/step TRL / ours = {step_ratio:.2f}x")

    print("held-out accuracy at equal steps, sampled / greedy (median over reps):")
    steps = sorted({s for r in runs for s in r.checkpoints})
    print(f"  {'step':>5s} {'ours':>13s} {'TRL':>13s}")
    print(f"  {0:5d} {warm[0]:6.3f}/{warm[1]:.3f} {warm[0]:6.3f}/{warm[1]:.3f}   (the warm start)")
    for step in steps:
        cells = []
        for side in ("ours", "TRL"):
            accs = [r.accuracy[step] for r in runs if r.side == side and step in r.accuracy]
            cells.append(f"{statistics.median(a[0] for a in accs):6.3f}/{statistics.median(a[1] for a in accs):.3f}"
                         if accs else f"{'-':>13s}")  # fmt: skip
        print(f"  {step:5d} {cells[0]:>13s} {cells[1]:>13s}")

    ends = [max((t for _, t in r.checkpoints.values()), default=0.0) for r in runs]
    horizon = min(ends)
    print("held-out sampled accuracy at equal seconds from process start (the newest checkpoint by then; median over "
          "reps):")
    print(f"  {'s':>7s} {'ours (step)':>14s} {'TRL (step)':>14s}")
    for k in range(1, 6):
        seconds = horizon * k / 5
        cells = []
        for side in ("ours", "TRL"):
            got = [accuracy_at(r, seconds) for r in runs if r.side == side]
            cells.append(f"{statistics.median(a for _, a in got):.3f} ({int(statistics.median(s for s, _ in got))})")
        print(f"  {seconds:7.1f} {cells[0]:>14s} {cells[1]:>14s}")


def report_long(runs: list[RunResult]) -> None:
    setting = runs[0].setting
    print(f"\n== long completions ({setting.max_tokens} tokens each, EOS ignored / banned): {setting.num_steps} "
          "steps ==")
    print_runs(runs)
    by_side = print_phases(runs)
    rates: dict[str, tuple[list[float], list[float]]] = {}
    for r in runs:
        steps = r.steps[1:] or r.steps
        step_s = sum(s["step_s"] for s in steps)
        generate_s = sum(s["generate"] for s in steps)
        rate = rates.setdefault(r.side, ([], []))
        rate[0].append(sum(s["tokens"] for s in steps) / step_s)
        rate[1].append(sum(s["completion_tokens"] for s in steps) / generate_s)
    for side, (all_rates, gen_rates) in rates.items():
        print(f"  {side:5s} tokens/s (prompt + completion per step second) {med_range(all_rates, '{:.0f}')}, "
              f"generated tokens/s in the generation phase {med_range(gen_rates, '{:.0f}')}")
    step_ratio = statistics.median(by_side["TRL"]["step_s"]) / statistics.median(by_side["ours"]["step_s"])
    print(f"  s/step TRL / ours = {step_ratio:.2f}x (target >= {TARGET}x)")
