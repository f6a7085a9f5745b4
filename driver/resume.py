"""How an operator continues a run: the command that resumes it, the hint printed when it stops, the record of an
earlier run that a fresh start moved aside, pointed at where its outputs went so that it can still be resumed, and a
run record read from a run directory that was moved or copied, pointed at that directory."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from common.ray_job import ray_job_working_dir
from common.run_dir import (
    CHECKPOINTS,
    FINAL_MODEL,
    LOCK,
    METRICS,
    RESOLVED_RECIPE,
    WARM_START_MODEL,
    read_run_record,
)  # fmt: skip
from recipe import Recipe, load_recipe

__all__ = [
    "point_moved_adapters_at_their_base", "point_moved_run_at_itself", "record_in_its_directory", "resume_command",
    "resume_hint",
]  # fmt: skip

log = logging.getLogger("rl_align")
ENTRY_POINT = Path(__file__).resolve().parents[1] / "rl_align.py"
"""The script that runs a recipe (``python rl_align.py --recipe ...``)."""


def resume_command(record: Path) -> str:
    """The command that resumes the run whose resolved recipe is ``record``, with this interpreter (a venv's ``python``
    is not necessarily the one on ``PATH``). Relative paths in a recipe resolve against the directory the run started
    in, so the command starts there. A Ray job's entrypoint runs in Ray's private copy of the job's working directory,
    where a plain command would start a Ray of its own: there the command is a job submitted with the same working
    directory."""
    if ray_job_working_dir() is not None:
        return (f"ray job submit --working-dir <the directory this job was submitted with> -- python rl_align.py "
                f"--recipe {shlex.quote(str(record.resolve()))} --resume")  # fmt: skip
    # The script by its absolute path (a run started from a project directory of the user's names it by another), and
    # the PYTHONPATH that found the user's own modules (rewards, environments).
    path = os.environ.get("PYTHONPATH")
    env = f"PYTHONPATH={shlex.quote(path)} " if path else ""
    return (f"cd {shlex.quote(str(Path.cwd()))} && {env}{shlex.quote(sys.executable)} {shlex.quote(str(ENTRY_POINT))} "
            f"--recipe {shlex.quote(str(record.resolve()))} --resume")


def resume_hint(out_dir: Path, ckpt_dir: Path, failed: bool) -> str:
    """How to continue this run: the command that resumes it from its newest checkpoint (through its resolved recipe,
    which holds every setting), or that none was saved."""
    from trainer.checkpoint_dirs import latest_checkpoint

    saved = latest_checkpoint(ckpt_dir)
    if saved is None:
        return f"no checkpoint was saved{': fix the cause and' if failed else ' yet: to go on,'} start the run again"
    record = out_dir / RESOLVED_RECIPE
    hint = f"continue from its last checkpoint ({saved.name}) with: {resume_command(record)}"
    if failed:  # the record holds the flags the run started with, so a flag's mistake comes back with it
        hint += (
            "\n(that recipe holds every setting of this run, its flags included: change the one at fault there, "
            "or give its flag again, corrected, after --resume)"
        )
    return hint


def point_moved_run_at_itself(moved: dict[Path, Path], out_dir: Path) -> Path | None:
    """Edit the ``recipe.resolved.toml`` a fresh start moved aside (``moved``: old path -> new path) so that it names
    where that run's outputs now are: ``run.output_dir`` and, when its checkpoints moved too, ``trainer.checkpoint.dir``
    (its own, read from it; relative paths resolve against this process's directory, as every recipe path does).
    Nothing else in the record changes (the two keys are set in its TOML, not re-serialised through today's schema).
    Return the record's path when ``--recipe <it> --resume`` can continue that run (it loads with this code and its
    checkpoint directory holds a complete checkpoint), else None; a record that cannot be read or written is left as
    it is, with a warning."""
    import tomli_w

    from trainer.checkpoint_dirs import latest_checkpoint

    record = moved.get(out_dir.resolve() / RESOLVED_RECIPE)
    if record is None:
        return None
    try:
        data = read_run_record(record.parent) or {}
        run_table, trainer = data.setdefault("run", {}), data.setdefault("trainer", {})
        ckpt_table = trainer.setdefault("checkpoint", {})
        own = Path(ckpt_table.get("dir") or Path(run_table.get("output_dir") or out_dir) / CHECKPOINTS).resolve()
        ckpts = moved.get(own, own)
        run_table["output_dir"], ckpt_table["dir"] = str(record.parent), str(ckpts)
        record.write_text(tomli_w.dumps(data))
        if latest_checkpoint(ckpts) is None:
            return None
        load_recipe(record, check_paths=False, quiet=True)
    except (ValueError, OSError) as e:  # undecodable, unparsable, or a schema this code no longer reads
        log.warning("fresh start: the earlier run's %s cannot be resumed with this code (%s)", record,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)  # fmt: skip
        return None
    return record


def point_moved_adapters_at_their_base(moved: dict[Path, Path]) -> list[Path]:
    """Edit the ``adapter_config.json`` of every PEFT adapter a fresh start moved aside (``moved``: old path -> new
    path) whose ``base_model_name_or_path`` names a moved path (the earlier run's ``warm_start_model/``), so that it
    names the moved copy: left as it was, ``PeftModel.from_pretrained`` put the adapter over the new run's warm start,
    written in the old place, without a word. Returns the edited files; one that cannot be read or written is left as
    it is, with a warning."""
    from weight_sync.peft import ADAPTER_CONFIG_FILE

    places = {old.resolve(): new for old, new in moved.items()}
    edited = []
    for new in moved.values():
        for config in sorted(new.rglob(ADAPTER_CONFIG_FILE)) if new.is_dir() else []:
            try:
                data = json.loads(config.read_text())
                base = Path(data.get("base_model_name_or_path") or "").resolve()
                old = next((o for o in places if base.is_relative_to(o)), None)
                if old is None:
                    continue
                data["base_model_name_or_path"] = str(places[old] / base.relative_to(old))
                config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
                edited.append(config)
            except (OSError, ValueError, AttributeError) as e:
                log.warning("fresh start: %s still names its base where the new run writes (%s)", config, e)
    return edited


def record_in_its_directory(
    path: Path, recipe: Recipe, overrides: Mapping[str, object]
) -> tuple[Recipe, Path | None]:
    """``recipe``, loaded from ``path``, pointed at the run directory it was read from when ``path`` is a run record
    (``<dir>/recipe.resolved.toml`` beside a run's outputs) written for another directory: the run was moved or copied
    (to branch it), and its record still names the original's ``run.output_dir`` and checkpoints. Read as written, a
    copy's ``--resume`` continued the original run, pruning its checkpoints and rewriting its record, and a moved
    run's found no checkpoint. Its output directory becomes ``<dir>``, and checkpoints the record keeps inside the
    original's directory the same place inside ``<dir>``. Returns the recipe and the directory the record was written
    for (None: nothing changed), whose adapters' base :func:`point_moved_adapters_at_their_base` moves once the run
    holds ``<dir>``. Reads only. ``run.output_dir`` given as a flag is where the run goes instead of ``<dir>`` (for
    any recipe file: one that names checkpoints inside its own output directory has them follow the flag, or a copy
    of a record saved under another name would train and prune the original's), with a warning where the original
    has checkpoints and the new place none (nothing is copied). ``ValueError`` when the record
    names a checkpoint directory outside the original's (not copied with it, and the original run's to prune) and no
    ``--trainer.checkpoint.dir`` says which this run is to use."""
    is_record = path.name == RESOLVED_RECIPE and _holds_run_outputs(path.parent)
    flagged = "run.output_dir" in overrides
    checkpoints = recipe.trainer.checkpoint
    if not is_record and (not flagged or checkpoints.dir is None or "trainer.checkpoint.dir" in overrides):
        return recipe, None  # a recipe file: its default checkpoints follow the flag; a flag's are the flag's
    here = path.parent.resolve()
    # The file's own output directory, whatever a flag says.
    written_for = load_recipe(path, check_paths=False, quiet=True).run.resolved_output_dir.resolve()
    target = recipe.run.resolved_output_dir.resolve() if flagged else here
    job_dir = ray_job_working_dir()
    if target == written_for or (
        not flagged and job_dir is not None and here.is_relative_to(Path(job_dir).resolve())
    ):
        return recipe, None  # the same place, or a copy Ray uploaded with a job (outputs there would be lost with it)
    own = Path(checkpoints.dir).resolve() if checkpoints.dir is not None else written_for / CHECKPOINTS
    if not is_record and not own.is_relative_to(written_for):
        return recipe, None  # a recipe file naming checkpoints outside its output directory: its choice
    if "trainer.checkpoint.dir" not in overrides:
        if not own.is_relative_to(written_for):
            raise ValueError(
                f"{path} is the record of the run at {written_for} (this run goes to {target}), and it names that "
                f"run's checkpoint directory {checkpoints.dir}: continuing from it would train and prune that run's "
                "checkpoints. Give this run its own: --trainer.checkpoint.dir DIR (copy the checkpoints there first "
                "to continue from them), or run the original with its own record"
            )  # fmt: skip
        from trainer.checkpoint_dirs import latest_checkpoint

        new = target / own.relative_to(written_for)
        checkpoints = checkpoints.model_copy(update={"dir": str(new)})
        if latest_checkpoint(own) is not None and latest_checkpoint(new) is None:
            log.warning("%s names the run at %s; this run goes to %s, its checkpoints to %s, and none are there: the "
                        "checkpoints in %s stay that run's (copy them there first to continue from them)", path,
                        written_for, target, new, own)  # fmt: skip
    log.warning("%s was written for the run at %s: this run is %s", path, written_for, target)
    return recipe.model_copy(update={
        "run": recipe.run.model_copy(update={"output_dir": str(target)}),
        "trainer": recipe.trainer.model_copy(update={"checkpoint": checkpoints}),
    }), written_for  # fmt: skip


def _holds_run_outputs(directory: Path) -> bool:
    """Whether ``directory`` holds a run's outputs beside its record (a recipe saved under that name elsewhere, e.g.
    ``--check``'s output, names no run to continue)."""
    return any((directory / name).exists() for name in (LOCK, CHECKPOINTS, METRICS, WARM_START_MODEL, FINAL_MODEL))
