"""Strict, typed configuration shared by every component.

Each component owns a nested ``Config`` (a subclass of :class:`Config`) with a docstring under every field. Recipes are
TOML files; :func:`load_toml_config` parses one into a config class, applies dotted CLI overrides
(``--trainer.optimizer.lr 1e-6``) and turns every validation problem into one :class:`ConfigError` whose message names
the file, the dotted field and the reason. Nothing here imports torch, so a bad recipe fails in well under a second,
before any actor starts.

Contract for subclasses:
- unknown keys are errors (``extra="forbid"``), types are strict (no ``"3"`` for ``3``), configs are frozen;
- user mistakes found in cross-field validators raise ``ValueError`` with a message that says what to do;
- paths are plain ``str`` (TOML has no path type) and counts are named ``num_*``.
"""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import pydantic
import tomli_w

__all__ = [
    "Config",
    "ConfigError",
    "apply_overrides",
    "load_toml_config",
    "parse_overrides",
    "read_toml",
    "to_toml",
    "validate_config",
]


class Config(pydantic.BaseModel):
    """Base of every component config: strict, frozen, unknown keys rejected, field docstrings kept as descriptions."""

    model_config = pydantic.ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        validate_default=True,
        use_attribute_docstrings=True,
    )


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message lists every problem with its dotted field name."""


ConfigT = TypeVar("ConfigT", bound=Config)


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """Parse ``["--a.b", "1", "--c=x"]`` into ``{"a.b": 1, "c": "x"}``.

    Values are read as TOML values (``1e-6``, ``true``, ``[1, 2]``, ``"s"``); anything that is not valid TOML is kept as
    a bare string, so ``--model.path runs/x`` works without quotes.
    """
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r}: expected '--dotted.field VALUE' or '--dotted.field=VALUE'")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key}: missing value")
            raw = args[i + 1]
            i += 1
        overrides[key] = _parse_value(raw)
        i += 1
    return overrides


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``data`` with each dotted override set, creating tables as needed."""
    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if not all(parts):
            raise ConfigError(f"override --{dotted}: empty component in dotted name")
        node = out
        for j, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: j + 1])
                raise ConfigError(f"override --{dotted}: {where} is a value ({child!r}), not a table")
            node = child
        node[parts[-1]] = value
    return out


def read_toml(path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Parse a TOML file into plain data and apply dotted ``overrides``; raise :class:`ConfigError` naming the file.

    A top-level ``base = "other.toml"`` (relative to this file) starts from that file's data: tables merge key by key,
    and everything else written here replaces the base's value. Variants of a recipe stay a few lines long.
    """
    return apply_overrides(_read_with_base(Path(path), ()), overrides or {})


def _read_with_base(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a file name string, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in seen:
        raise ConfigError(f"{path}: base files form a cycle through {base_path}")
    return _merge(_read_with_base(base_path, (*seen, path.resolve())), data)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_toml_config(cls: type[ConfigT], path: str | Path, overrides: Mapping[str, Any] | None = None) -> ConfigT:
    """Load ``path`` into ``cls``, applying dotted ``overrides``; raise :class:`ConfigError` naming file and fields."""
    return validate_config(cls, read_toml(path, overrides), source=str(path))


def validate_config(cls: type[ConfigT], data: Mapping[str, Any], source: str = "<config>") -> ConfigT:
    """Validate a plain mapping into ``cls``; raise :class:`ConfigError` with one line per problem."""
    try:
        # JSON-mode validation: TOML arrays validate as tuples, strings as paths, while "0.1" stays no float.
        return cls.model_validate_json(json.dumps(data, default=str))
    except pydantic.ValidationError as e:
        lines = [f"  - {_field_name(err['loc'], data)}: {_reason(err)}" for err in e.errors()]
        raise ConfigError(f"{source}: invalid recipe ({len(lines)} problem(s)):\n" + "\n".join(lines)) from None


def _field_name(loc: tuple[Any, ...], data: Any) -> str:
    """Dotted name of an error location, dropping the tags pydantic inserts for tagged unions."""
    parts: list[str] = []
    node = data
    for j, item in enumerate(loc):
        last = j == len(loc) - 1
        if isinstance(node, list) and isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
            node = node[item] if item < len(node) else None
        elif isinstance(node, dict) and item in node:
            parts.append(str(item))
            node = node[item]
        elif isinstance(node, dict) and item == node.get("type"):
            continue  # the tag pydantic inserts for a tagged union (e.g. 'grpo'): not a key the user wrote
        elif last or not isinstance(node, dict):
            parts.append(str(item))
        # else: a union tag such as 'grpo' that is not a key of the input: skip it.
    return ".".join(parts) or "(whole file)"


def _reason(err: Mapping[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown key (check the spelling; see the documented fields of this section)"
    if kind == "missing":
        return "required field is missing"
    msg = str(err.get("msg", "invalid"))
    msg = msg.removeprefix("Value error, ")
    if kind not in ("value_error", "assertion_error") and "input" in err and not isinstance(err["input"], dict):
        msg += f" (got {err['input']!r})"
    return msg


def to_toml(config: Config) -> str:
    """Render a config as TOML (``None`` fields omitted, since TOML has no null); loading it back gives ``config``."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))
