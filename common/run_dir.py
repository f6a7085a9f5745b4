"""A run's output directory (``run.output_dir``): the names of what a run writes there, spelt in this one place, and
what a fresh start does with an earlier run's outputs.

Layout: ``recipe.resolved.toml`` (every setting used), ``metrics.jsonl``, ``tensorboard/`` (with ``sft/``: the warm
start), ``curves.png``, ``checkpoints/step_<n>/`` (unless ``trainer.checkpoint.dir`` says elsewhere),
``warm_start_model/``, ``hf/step_<n>/`` (``run.export.every_num_steps``), ``final_model/``; and
``previous-<time>/``, each holding an earlier run's outputs in the same layout (the driver points its resolved recipe
at it, so that run can be resumed there).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINTS", "CURVES", "FINAL_MODEL", "HF_EXPORTS", "METRICS", "OUTPUTS", "RESOLVED_RECIPE", "TENSORBOARD",
    "WARM_START_MODEL", "lora_base_dir", "set_aside_earlier_run",
]  # fmt: skip

RESOLVED_RECIPE = "recipe.resolved.toml"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
WARM_START_MODEL = "warm_start_model"
HF_EXPORTS = "hf"
FINAL_MODEL = "final_model"
OUTPUTS = (RESOLVED_RECIPE, METRICS, TENSORBOARD, CURVES, CHECKPOINTS, WARM_START_MODEL, HF_EXPORTS, FINAL_MODEL)
"""Everything a run writes in its output directory."""


def lora_base_dir(resolved: Mapping[str, Any], run_dir: str | Path) -> Path | None:
    """The HF model directory whose weights a LoRA run's adapters apply to, from the run's resolved recipe (its
    ``recipe.resolved.toml`` record, or ``Recipe.model_dump()``) and its output directory ``run_dir``: the run's
    warm-start export when a warm start fine-tuned the base first (``run.warm_start.parameters = "all"`` with
    warm-start steps), else ``[model] path``. None for a run without ``[model.lora]``, whose checkpoints and exports
    hold every weight. A LoRA run's checkpoints hold the adapters alone, so a resume, an export and a served adapter
    all build on this directory."""
    model, warm_start = resolved["model"], resolved.get("run", {}).get("warm_start", {})
    if not model.get("lora"):
        return None
    if warm_start.get("num_steps", 0) > 0 and warm_start.get("parameters") == "all":
        return Path(run_dir) / WARM_START_MODEL
    return Path(model["path"])


def set_aside_earlier_run(
    out_dir: Path, checkpoint_dir: Path, keep: Sequence[str | Path] = ()
) -> dict[Path, Path]:
    """Move what an earlier run left in ``out_dir`` into ``out_dir/previous-<time>/`` (nothing is deleted), so a fresh
    start neither mixes it into its own outputs nor takes it for its own on a later resume; return each moved path
    (absolute) with its new one.

    The moved outputs keep their layout (a moved checkpoint still finds its run's ``recipe.resolved.toml`` two levels
    up). ``checkpoint_dir`` outside ``out_dir`` moves beside itself, to ``<name>.previous-<time>``. An output that
    holds one of ``keep`` (the recipe's model or tokenizer directory) stays where it is; empty directories stay.
    """
    out, ckpt = out_dir.resolve(), checkpoint_dir.resolve()
    kept = [Path(p).resolve() for p in keep]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = out / f"previous-{stamp}"
    for n in range(1, 1000):  # two fresh starts within a second
        if not aside.exists():
            break
        aside = out / f"previous-{stamp}-{n}"
    inside = ckpt.is_relative_to(out)
    moved: dict[Path, Path] = {}
    for path in [out / name for name in OUTPUTS if name != CHECKPOINTS] + [ckpt]:
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            continue
        if any(p.is_relative_to(path) for p in kept):
            continue
        if path == ckpt and not inside:
            target = ckpt.with_name(f"{ckpt.name}.previous-{stamp}")
        else:
            target = aside / path.relative_to(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)
        moved[path] = target
    return moved
