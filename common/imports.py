"""Objects a recipe names by import path (``"package.module:name"``): user reward functions, user environments."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["check_import_path", "resolve_object"]


def check_import_path(spec: str, what: str, example: str = "my_module:my_name") -> str:
    """``spec`` if it has the form ``"package.module:name"``, else ``ValueError`` naming ``what`` and the form (a file
    path such as ``"my_pkg/envs.py:Env"`` is told its dotted name). Imports nothing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: expected 'package.module:name', e.g. {example!r}")
    if "/" in module_name or "\\" in module_name or module_name.endswith(".py"):
        dotted = module_name.removesuffix(".py").replace("\\", "/").strip("/").replace("/", ".")
        raise ValueError(f"{what} {spec!r}: name the module with dots, as Python imports it ('{dotted}:{attr}', its "
                         "top directory on PYTHONPATH), not by its file path")  # fmt: skip
    if not all(part.isidentifier() for part in [*module_name.split("."), attr]):
        raise ValueError(f"{what} {spec!r}: {module_name!r} and {attr!r} must be Python names (letters, digits, _; "
                         f"modules joined by dots), e.g. {example!r}")  # fmt: skip
    return spec


def resolve_object(spec: str, what: str) -> Any:
    """Import ``"package.module:name"`` and return the object; ``ValueError`` names ``what`` (e.g. "reward function")
    and which part is missing.

    An ``ImportError`` raised *inside* the user's module (a missing dependency of it) is reported as such, not as a
    missing module; any other error its import raises (a syntax error, a name error) is a ``ValueError`` naming it.
    """
    check_import_path(spec, what)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"{what} {spec!r}: module {module_name!r} not found (no module named {e.name!r}); install it "
                "or put its directory on PYTHONPATH for the driver and the rollout workers"
            ) from None
        raise ValueError(f"{what} {spec!r}: importing module {module_name!r} failed: {e}") from e
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: importing module {module_name!r} failed: {e}") from e
    except Exception as e:  # noqa: BLE001  (user code run at import: a SyntaxError, a NameError, a raise)
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise ValueError(
            f"{what} {spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e}{where}"
        ) from e
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(
            f"{what} {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no attribute "
            f"{attr!r}; callables there: {public[:20]}"
        ) from None
