"""Strict, typed configuration shared by every component.

Each component owns a nested ``Config`` (a subclass of :class:`Config`) with a docstring under every field. Recipes are
TOML files; :func:`load_toml_config` parses one into a config class, applies dotted CLI overrides
(``--trainer.optimizer.lr 1e-6``) and turns every validation problem into one :class:`ConfigError` whose message names
where the value was written (the file, a ``base =`` file, or the command-line flag), the dotted field and the reason;
an unknown key names the field the user probably meant. Nothing here imports torch, so a bad recipe fails in well under
a second, before any actor starts.

Contract for subclasses:
- unknown keys are errors (``extra="forbid"``), types are strict (no ``"3"`` for ``3``), configs are frozen;
- user mistakes found in cross-field validators raise ``ValueError`` with a message that says what to do, or
  :class:`FieldError` to name the field at fault when it is not the section the validator belongs to;
- paths are plain ``str`` (TOML has no path type) and counts are named ``num_*``;
- dtypes are :data:`DType` (the one declaration every component shares).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import datetime
import json
import logging
import tomllib
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import pydantic
import tomli_w

from common.config_reasons import Blamed, Loc, field_name, refusal_reason, value_at

__all__ = [
    "Config",
    "ConfigError",
    "DType",
    "Family",
    "FieldError",
    "MAX_ACTORS",
    "Seed",
    "Sources",
    "apply_overrides",
    "changed_settings",
    "config_error",
    "load_toml_config",
    "parse_overrides",
    "quiet_settings",
    "read_toml",
    "read_toml_with_sources",
    "to_toml",
    "validate_config",
]

DType = Literal["float32", "bfloat16", "float16"]
"""Floating-point dtype names a config may ask for (trainer precision, serving engines, reward models)."""
Family = Literal["llama3", "qwen3", "qwen3_moe"]
"""The supported architecture families: ``llama3`` (LlamaForCausalLM), ``qwen3`` (Qwen3ForCausalLM) and ``qwen3_moe``
(Qwen3MoeForCausalLM). Declared here so the model config, the recipe and ``tools/make_tiny_model`` share it."""
Seed = Annotated[int, pydantic.Field(ge=0, le=2**32 - 1)]
"""A seed: 0 to 2**32 - 1, the range vLLM's sampler and numpy take."""
MAX_ACTORS = 65536
"""Most actors of one role (trainer ranks, rollout workers) a recipe may ask for: a bound far above any cluster's, so
that a mistyped count is refused at load instead of filling the driver's memory with placement bundles."""

Sources = dict[tuple[str, ...], str]
"""Where each key of a recipe's data was written: key path -> a file name or ``command-line flag --a.b``."""


class Config(pydantic.BaseModel):
    """Base of every component config: strict, frozen, unknown keys rejected, field docstrings kept as descriptions."""

    model_config = pydantic.ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        validate_default=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,  # a field that means something by inf says so: pydantic.Field(allow_inf_nan=True)
    )

    @pydantic.field_validator("*", mode="after")
    @classmethod
    def _fits_64_bits(cls, value: Any) -> Any:
        # torch, numpy and vLLM take 64-bit integers: 2**70 workers or tokens would fail (or fill the memory) there.
        for number in _integers(value):
            if not -(2**63) <= number < 2**63:
                raise ValueError(f"{number} is out of range: a recipe's integers fit in 64 bits")
        return value



def _integers(value: Any) -> Iterator[int]:
    """The integers in ``value`` and in the lists, tuples and tables it holds (not in nested configs: they check
    their own)."""
    if type(value) is int:  # noqa: E721  (not bool)
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _integers(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _integers(item)


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message lists every problem with its source and dotted field."""


class FieldError(ValueError):
    """Raised by a cross-field validator to blame ``field`` (dotted, relative to the validated model) for ``message``.

    ``raise FieldError("model.attention", "...")`` in a validator of the recipe reports ``model.attention`` (and the
    file or flag that set it) instead of the whole recipe.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


ConfigT = TypeVar("ConfigT", bound=Config)


def _false_as_unset(cls: type[pydantic.BaseModel], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with ``false`` given to an optional field (one that may be None and is no boolean) read as None (TOML
    has no null): ``create_tiny = false`` or ``lora = false`` drops a table a base recipe set, ``stop_at_accuracy =
    false`` a value. Tables of a section's own model are followed; free-form tables (``dict`` fields) are left as
    they are."""
    out = dict(data)
    for name, field in cls.model_fields.items():
        value = out.get(name)
        args = typing.get_args(field.annotation)
        if value is False and type(None) in args and bool not in args:
            out[name] = None
        elif isinstance(value, dict):
            models = [a for a in (*args, field.annotation) if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
            if len(models) > 1:  # a tagged union: the variant the table's `type` names
                models = [m for m in models if "type" in m.model_fields and value.get("type") in typing.get_args(
                    m.model_fields["type"].annotation)]  # fmt: skip
            if len(models) == 1:
                out[name] = _false_as_unset(models[0], value)
    return out


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
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    value = parsed["v"]
    # Text that reads as more than one value ("3\nfoo = 1"), or as a TOML date or time (no field takes one; TOML
    # would rewrite "1979-05-27T07:32:00" as "1979-05-27 07:32:00"), is the text itself.
    if len(parsed) > 1 or isinstance(value, datetime.date | datetime.time):
        return raw
    if type(value) is int:  # noqa: E721  (not bool)
        return _IntFlag(value, raw)
    if type(value) is float:  # noqa: E721
        return _FloatFlag(value, raw)
    return value


class _IntFlag(int):
    """An integer read from a command-line flag, keeping the flag's text: a text field gets the text back
    (``--run.name 123`` names the run "123"; :func:`validate_config`)."""

    text: str

    def __new__(cls, value: int, text: str) -> _IntFlag:
        self = super().__new__(cls, value)
        self.text = text
        return self

    def __getnewargs__(self) -> tuple[int, str]:  # type: ignore[override]  # copies and pickles keep the text
        return int(self), self.text


class _FloatFlag(float):
    """A float read from a command-line flag, keeping the flag's text (``1e3`` stays "1e3" in a text field)."""

    text: str

    def __new__(cls, value: float, text: str) -> _FloatFlag:
        self = super().__new__(cls, value)
        self.text = text
        return self

    def __getnewargs__(self) -> tuple[float, str]:  # type: ignore[override]
        return float(self), self.text


_FLAG_SOURCE = "command-line flag --"


def _override_source(dotted: str) -> str:
    """How an error names the command-line flag ``--<dotted>`` as the source of a value."""
    return f"{_FLAG_SOURCE}{dotted}"


def apply_overrides(
    data: dict[str, Any], overrides: Mapping[str, Any], sources: Sources | None = None
) -> dict[str, Any]:
    """Return a copy of ``data`` with each dotted override set, creating tables as needed. An override of a table's
    ``type`` to another type than the table has (``--algorithm.type ppo`` over a GRPO table) empties that table first,
    as a file naming another type does (:func:`read_toml`): the other type's keys would not belong to it; the table's
    other overrides, in any order, apply to the emptied table.

    ``sources``, if given, is updated in place: every key an override sets or creates is attributed to its flag.
    """
    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        *table_path, last = dotted.split(".")
        table = value_at(tuple(table_path), out) if table_path else None
        if last == "type" and isinstance(table, dict) and table.get("type", value) != value:
            table.clear()
            under = tuple(table_path)
            known = sources if sources is not None else {}
            for key in [k for k in known if len(k) > len(under) and k[: len(under)] == under]:
                del known[key]
            if under:  # the table is the flag's now: what it lacks is the flag's to give
                known[under] = _override_source(dotted)
    for dotted, value in overrides.items():
        parts = tuple(dotted.split("."))
        if not all(parts):
            raise ConfigError(f"override --{dotted}: empty component in dotted name")
        source = _override_source(dotted)
        node = out
        for j, part in enumerate(parts[:-1]):
            if part not in node and sources is not None:
                sources[parts[: j + 1]] = source
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: j + 1])
                raise ConfigError(f"override --{dotted}: {where} is a value ({child!r}), not a table")
            node = child
        below = node.get(parts[-1])
        # A table merges into the table there key by key, as a recipe file's does (unless it names another type).
        merged = isinstance(value, dict) and isinstance(below, dict) and _same_type(below, value)
        node[parts[-1]] = _merge(below, value) if merged and isinstance(below, dict) else value
        if sources is not None:
            for key in [k for k in sources if k[: len(parts)] == parts and not merged]:
                del sources[key]
            sources.update(_key_sources(value, source, parts))
    return out


def read_toml(path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Parse a TOML file into plain data and apply dotted ``overrides``; raise :class:`ConfigError` naming the file.

    A top-level ``base = "other.toml"`` (relative to this file) starts from that file's data: tables merge key by key,
    and everything else written here replaces the base's value. A table that names another ``type`` than the base's
    (a tagged union: ``[task] type = "jsonl"`` over an arithmetic task, ``[algorithm] type = "ppo"`` over GRPO)
    replaces the base's table whole instead: the other type's keys would not belong to it. Variants of a recipe stay a
    few lines long.
    """
    return read_toml_with_sources(path, overrides)[0]


def read_toml_with_sources(
    path: str | Path, overrides: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], Sources]:
    """:func:`read_toml`, plus where each key was written (this file, a base file, or a flag) for error messages."""
    data, sources = _read_with_base(Path(path), ())
    return apply_overrides(data, overrides or {}, sources), sources


def _read_with_base(path: Path, seen: tuple[Path, ...]) -> tuple[dict[str, Any], Sources]:
    if path.exists() and not path.is_file():  # a directory; a FIFO would block the read for good
        raise ConfigError(f"{path}: not a recipe file (a {'directory' if path.is_dir() else 'special file'}); name "
                          "a .toml file")  # fmt: skip
    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the recipe file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); TOML files are UTF-8") from None
    try:
        data = tomllib.loads(text.removeprefix("\ufeff"))  # a byte-order mark, as some editors write
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    base = data.pop("base", None)
    sources = _key_sources(data, str(path), ())
    if base is None:
        return data, sources
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a file name string, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in seen:
        raise ConfigError(f"{path}: base files form a cycle through {base_path}")
    if not base_path.is_file():
        raise ConfigError(
            f"{path}: base = {base!r}: no file {base_path} (a base is found relative to the file that names it)"
        )
    base_data, base_sources = _read_with_base(base_path, (*seen, path.resolve()))
    return _merge(base_data, data), {**base_sources, **sources}


def _key_sources(value: Any, source: str, prefix: tuple[str, ...]) -> Sources:
    """``source`` for ``prefix`` and, when ``value`` is a table, every key path under it."""
    out: Sources = {prefix: source} if prefix else {}
    if isinstance(value, dict):
        for key, child in value.items():
            out.update(_key_sources(child, source, (*prefix, str(key))))
    return out


def _same_type(below: Mapping[str, Any], top: Mapping[str, Any]) -> bool:
    """Whether table ``top`` written over ``below`` keeps its tagged-union ``type`` (or neither has one)."""
    return top.get("type", below.get("type")) == below.get("type")


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        if isinstance(value, dict) and isinstance(below, dict) and _same_type(below, value):
            out[key] = _merge(below, value)
        else:  # a value, or a table of another tagged-union type: replaces the base's
            out[key] = value
    return out


def load_toml_config(cls: type[ConfigT], path: str | Path, overrides: Mapping[str, Any] | None = None) -> ConfigT:
    """Load ``path`` into ``cls``, applying dotted ``overrides``; raise :class:`ConfigError` naming source and field."""
    data, sources = read_toml_with_sources(path, overrides)
    return validate_config(cls, data, source=str(path), sources=sources)


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("rl_align_quiet_validation", default=False)


def changed_settings(config: pydantic.BaseModel, names: Sequence[str] | None = None) -> list[str]:
    """``"name = value"`` for each field of ``config`` (of ``names``, default all) set to other than its default: what a
    warning about settings a mode or feature leaves unused names."""
    fields = type(config).model_fields
    return [f"{name} = {getattr(config, name)!r}" for name in (names or list(fields))
            if getattr(config, name) != fields[name].default]  # fmt: skip


def setting_warning(logger: logging.Logger, message: str, *args: object) -> None:
    """Warn about a setting from a validator, unless the config is being validated quietly (``validate_config(...,
    quiet=True)``: a record of an earlier run read for comparison, whose warnings are not about this run)."""
    if not _QUIET.get():
        logger.warning(message, *args)


@contextlib.contextmanager
def quiet_settings(quiet: bool = True) -> Iterator[None]:
    """Within it (when ``quiet``), :func:`setting_warning` says nothing: a config validated again whose warnings were
    given already (a model config built at recipe load and again before the run starts)."""
    token = _QUIET.set(quiet or _QUIET.get())
    try:
        yield
    finally:
        _QUIET.reset(token)


def validate_config(
    cls: type[ConfigT], data: Mapping[str, Any], source: str = "<config>", sources: Sources | None = None,
    what: str = "recipe", quiet: bool = False,
) -> ConfigT:
    """Validate a plain mapping into ``cls``; raise :class:`ConfigError` with one line per problem.

    ``source`` names where ``data`` came from; ``sources`` (from :func:`read_toml_with_sources`) names, per key, the
    file or flag that wrote it, so each problem is reported against the source that can fix it; ``what`` names the
    kind of input in the message ("invalid recipe", "invalid settings"); ``quiet``: no :func:`setting_warning`.
    """
    with quiet_settings(quiet):
        return _validate(cls, data, source, sources, what)


def _validate(
    cls: type[ConfigT], data: Mapping[str, Any], source: str, sources: Sources | None, what: str
) -> ConfigT:
    try:
        # JSON-mode validation: TOML arrays validate as tuples, strings as paths, while "0.1" stays no float.
        return cls.model_validate_json(json.dumps(_false_as_unset(cls, data), default=str))
    except pydantic.ValidationError as e:
        as_text = _flag_values_as_text(e, data, sources or {})
        if as_text is not None:  # a number or boolean typed on the command line for a text field: the flag's text
            return _validate(cls, as_text, source, sources, what)
        problems = []
        for err in e.errors():
            loc, reason = tuple(err["loc"]), refusal_reason(err, cls, data)
            blamed = err.get("ctx", {}).get("error")
            if isinstance(blamed, FieldError):
                loc = (*loc, Blamed(blamed.field))
            problems.append((loc, reason))
        raise config_error(problems, data, source, sources, what) from None


def _flag_values_as_text(
    error: pydantic.ValidationError, data: Mapping[str, Any], sources: Sources
) -> dict[str, Any] | None:
    """A copy of ``data`` with each command-line number or boolean that a text field refused replaced by the flag's
    text, or ``None`` when there is none (values from a TOML file stay refused: there the quotes say what is text)."""
    fixed: dict[str, Any] | None = None
    for err in error.errors():
        loc = tuple(err["loc"])
        value = value_at(loc, data) if err["type"] == "string_type" and loc else None
        if isinstance(value, _IntFlag | _FloatFlag):
            text = value.text
        elif isinstance(value, bool) and _source_of(field_name(loc, data)[1], sources, "").startswith(_FLAG_SOURCE):
            text = "true" if value else "false"  # TOML's only spellings of a boolean: what was typed
        else:
            continue  # another error, or a file's value: reported as it is
        fixed = fixed if fixed is not None else copy.deepcopy(dict(data))
        value_at(loc[:-1], fixed)[loc[-1]] = text
    return fixed


def config_error(
    problems: Sequence[tuple[Loc, str]], data: Any, source: str = "<config>", sources: Sources | None = None,
    what: str = "recipe",
) -> ConfigError:
    """One :class:`ConfigError` for ``(location, reason)`` problems, grouped by the source of each location.

    A location is a pydantic error location in ``data`` (keys, list indices, union tags). Problems whose location was
    written by another file or a flag (per ``sources``) are listed under that source; the rest under ``source``.
    """
    reasons: dict[tuple[str, str], list[str]] = {}  # (source, field) -> why; a plain union's members refuse each
    for loc, reason in problems:
        name, keys = field_name(loc, data)
        reasons.setdefault((_source_of(keys, sources or {}, source), name), []).append(reason)
    grouped: dict[str, list[str]] = {}
    for (where, name), why in reasons.items():
        grouped.setdefault(where, []).append(f"- {name}: {'; or '.join(why)}")
    num = sum(len(lines) for lines in grouped.values())
    if len(grouped) == 1:
        [(where, lines)] = grouped.items()
        return ConfigError(f"{where}: invalid {what} ({num} problem(s)):\n" + "\n".join(f"  {x}" for x in lines))
    parts = [f"invalid {what} ({num} problem(s)):"]
    for where, lines in grouped.items():
        parts += [f"  {where}:", *(f"    {x}" for x in lines)]
    return ConfigError("\n".join(parts))


def _source_of(keys: tuple[str, ...], sources: Sources, default: str) -> str:
    for n in range(len(keys), 0, -1):
        if keys[:n] in sources:
            return sources[keys[:n]]
    return default


def to_toml(config: Config) -> str:
    """Render a config as TOML; loading it back gives ``config``. TOML has no null: a ``None`` field is left out
    where that is its default, and written ``false`` where the default is a value (``value_clip = false``), which
    :func:`validate_config` reads back as None."""
    return tomli_w.dumps(_toml_table(config))


def _toml_table(model: pydantic.BaseModel) -> dict[str, Any]:
    dumped = model.model_dump(mode="json")
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if value is None:
            if field.get_default(call_default_factory=True) is not None:
                out[name] = False
        elif isinstance(value, pydantic.BaseModel):
            out[name] = _toml_table(value)
        elif isinstance(value, list | tuple) and value and all(isinstance(v, pydantic.BaseModel) for v in value):
            out[name] = [_toml_table(v) for v in value]
        else:
            out[name] = _without_none(dumped[name])
    return out


def _without_none(value: Any) -> Any:
    """A JSON value with the nulls inside its tables and arrays dropped (TOML has none)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value if v is not None]
    return value
