"""Dependencies point one way: ``common`` at the bottom, ``protos <- weight_sync <- {trainer, rollout} <- driver <-
rl_align.py``, and the trainer takes only ``rollout/types.py`` from the rollout side.

Every import statement of the project's packages is read from the source (lazy imports inside functions and
``TYPE_CHECKING`` blocks included), so a wrong direction fails here even when it would only run on some code path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top-level project modules -> the project modules they may import. A module not listed may import nothing of ours.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "protos": set(),
    "tools": {"common"},
    "weight_sync": {"common", "protos"},
    "rollout": {"common", "protos", "weight_sync"},
    "trainer": {"common", "protos", "weight_sync", "rollout.types"},
    "recipe": {"common", "weight_sync", "rollout", "trainer"},
    "driver": {"common", "protos", "weight_sync", "rollout", "trainer", "recipe", "tools"},
    "rl_align": {"common", "recipe", "driver"},
}
PROJECT = set(ALLOWED) | {"tests", "benchmarks"}
# Third-party packages a layer must not reach for, whatever the import graph says.
FORBIDDEN_EXTERNAL: dict[str, set[str]] = {"trainer": {"vllm"}, "common": {"torch", "ray"}}


def _sources() -> list[Path]:
    files = [ROOT / "rl_align.py"]
    for package in ("common", "protos", "tools", "weight_sync", "rollout", "trainer", "recipe", "driver"):
        files += sorted(p for p in (ROOT / package).rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))
    return files


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports_of(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in ``source``, wherever it stands in the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # ``from rollout import types`` names the submodule in the alias
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations(layer: str, imports: list[tuple[int, str]]) -> list[str]:
    """The imports of a module of ``layer`` that point the wrong way."""
    allowed = ALLOWED[layer]
    out: list[str] = []
    reported: set[int] = set()
    for line, module in imports:
        if line in reported:
            continue  # one message per import statement
        top = module.split(".")[0]
        if top in FORBIDDEN_EXTERNAL.get(layer, set()):
            out.append(f"line {line}: {module} (a {layer} module must not use {top})")
            reported.add(line)
            continue
        if top not in PROJECT or top == layer:
            continue
        if not any(module == a or module.startswith(a + ".") for a in allowed):
            if top == "rollout" and "rollout.types" in allowed and module == "rollout":
                continue  # ``from rollout import types``: its alias entry is checked on its own
            out.append(f"line {line}: {module} (a {layer} module may import only {sorted(allowed) or 'nothing'})")
            reported.add(line)
    return out


def test_every_import_points_down_the_layers() -> None:
    problems = []
    for path in _sources():
        layer = _layer(path)
        assert layer in ALLOWED, f"{path}: a new top-level module needs a row in ALLOWED"
        for problem in violations(layer, imports_of(path.read_text())):
            problems.append(f"{path.relative_to(ROOT)} {problem}")
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("layer", "source", "bad"),
    [
        ("trainer", "from rollout.pool import RolloutPool", True),
        ("trainer", "from rollout.types import Sample", False),
        ("trainer", "def f():\n    import driver.loop\n", True),  # a lazy import counts
        ("trainer", "import vllm", True),
        ("weight_sync", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer import step\n", True),
        ("rollout", "from trainer.step import rl_step", True),
        ("common", "import torch", True),
        ("driver", "from rollout.pool import RolloutPool\nfrom trainer.group import TrainerGroup", False),
        ("recipe", "from driver.run import run", True),
    ],
)
def test_the_checker_catches_a_wrong_direction(layer: str, source: str, bad: bool) -> None:
    assert bool(violations(layer, imports_of(source))) == bad
