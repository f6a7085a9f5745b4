"""Helpers of the recipe tests: a changed default recipe, a recipe's load error, ``rl_align.py --check`` in a
subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError
from recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def broken_recipe(tmp_path, edit):
    """``recipes/grpo_tiny.toml`` changed by ``edit`` (text -> text), written as ``tmp_path/broken.toml``."""
    path = tmp_path / "broken.toml"
    path.write_text(edit((ROOT / "recipes" / "grpo_tiny.toml").read_text()))
    return path


def run_check(args, timeout=60):
    """``rl_align.py --check`` in a subprocess: (exit code, stderr)."""
    out = subprocess.run(
        [sys.executable, "rl_align.py", "--check", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    return out.returncode, out.stderr


def load_error(path, overrides=None, **kw):
    with pytest.raises(ConfigError) as e:
        load_recipe(path, overrides, **kw)
    return str(e.value)
