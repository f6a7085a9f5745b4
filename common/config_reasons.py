"""Why a config value was refused, in the words of the recipe's author: the dotted field a pydantic error location
names, an unknown key's likely meaning (close names, the same field elsewhere, another type's field, another
framework's name for it), a tagged table without its ``type`` or with an unknown one. ``common.config`` turns these
into one ``ConfigError``. No torch here.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any, Literal

import pydantic

__all__ = ["Blamed", "Loc", "field_name", "refusal_reason", "value_at"]

Loc = tuple[str | int, ...]
"""A pydantic error location: keys, list indices and the tags it inserts for tagged unions."""


class Blamed(str):
    """A dotted field named by a :class:`FieldError`: reported as written, whether or not the data has it."""


def field_name(loc: Loc, data: Any) -> tuple[str, tuple[str, ...]]:
    """Dotted name of an error location, dropping the tags pydantic inserts for tagged unions; plus the key path of
    the data that location is in (keys only, up to the first list)."""
    parts: list[str] = []
    keys: list[str] = []
    in_list = False
    node = data
    tagged: Any = None  # the table whose tagged-union tag was passed: the next item is one of its keys
    for j, item in enumerate(loc):
        last = j == len(loc) - 1
        if isinstance(item, Blamed):
            parts += item.split(".")
            keys += [] if in_list else item.split(".")
        elif isinstance(node, list) and isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
            node = node[item] if item < len(node) else None
            in_list = True
        elif isinstance(node, dict) and item == node.get("type") and tagged is not node and not (
            item in node and (last or _addresses(node[item], loc[j + 1]))
        ):
            # The tag pydantic inserts for a tagged union (e.g. 'grpo'), once per table, before its keys, even one of
            # the same name (the 'function' reward term's field 'function'); a location of keys alone (a check of
            # this machine's) has none.
            tagged = node
        elif isinstance(node, dict) and item in node:
            parts.append(str(item))
            keys += [] if in_list else [str(item)]
            node = node[item]
        elif node is not None and not isinstance(node, dict | list):
            continue  # a member tag of a plain union ('constrained-int', "literal['auto']"): the value is this field's
        elif last or not isinstance(node, dict):
            parts.append(str(item))
            keys += [] if in_list else [str(item)]
        # else: a union tag such as 'grpo' that is not a key of the input: skip it.
    return ".".join(parts) or "(whole file)", tuple(keys)


def _addresses(value: Any, item: str | int) -> bool:
    """Whether ``item`` is a key or an index of ``value``."""
    if isinstance(value, dict):
        return item in value
    return isinstance(value, list) and isinstance(item, int) and item < len(value)


def refusal_reason(err: Mapping[str, Any], cls: type[pydantic.BaseModel], data: Any) -> str:
    """The reason to print for one of pydantic's errors (``ValidationError.errors()``) validating ``data`` into
    ``cls``."""
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return _unknown_key(tuple(err["loc"]), cls, data)
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_not_found":
        return _untagged(tuple(err["loc"]), cls, data)
    if kind == "union_tag_invalid":
        return _unknown_type(tuple(err["loc"]), cls, str(err.get("ctx", {}).get("tag", "")))
    msg = str(err.get("msg", "invalid"))
    msg = msg.removeprefix("Value error, ")
    if kind not in ("value_error", "assertion_error") and "input" in err and not isinstance(err["input"], dict):
        msg += f" (got {err['input']!r})"
    return msg


# -- unknown keys: what the user probably meant --------------------------------------------------------------------


def _unknown_key(loc: Loc, cls: type[pydantic.BaseModel], data: Any) -> str:
    """Why ``loc`` is no key: the close field names of its section, fields of that name elsewhere, or the list."""
    key = str(loc[-1])
    section = field_name(loc[:-1], data)[0] if loc[:-1] else ""
    fields = list(dict.fromkeys(f for c in _section_classes(cls, loc[:-1]) for f in c.model_fields))
    prefix = f"{section}." if section else ""
    close = [prefix + f for f in difflib.get_close_matches(key, fields, n=3, cutoff=0.6)]
    elsewhere = [p for p in _paths_of_field(cls, key) if p != prefix + key][:3]
    other_types = [
        _tag(c) for c in _section_classes(cls, loc[:-1], resolve_tags=False) if key in c.model_fields and _tag(c)
    ]
    aliased = [a for c in _section_classes(cls, loc[:-1]) if (a := getattr(c, "KEY_ALIASES", {}).get(key))]
    if aliased and aliased[0] in fields:  # another framework's name for a field (PEFT's ``r`` for ``rank``)
        return f"unknown key {key!r}; this field is {prefix}{aliased[0]} here"
    if not section:
        is_table = isinstance(value_at(loc, data), dict)
        what = f"unknown section {key!r}: there is no [{key}]" if is_table else f"unknown key {key!r}"
        listing = f"the top-level sections and keys are: {', '.join(fields)}"
    else:
        what = f"unknown key (no field {key!r} in [{section}])"
        listing = f"the fields of [{section}] are: {', '.join(fields)}"
    if other_types:
        return f"{what}; {key!r} is a field of type = {' or '.join(repr(t) for t in other_types)}, not of this type"
    if close or elsewhere:
        return f"{what}; did you mean {' or '.join(close + elsewhere)}?"
    return f"{what} (check the spelling); {listing}"


def _untagged(loc: Loc, cls: type[pydantic.BaseModel], data: Any) -> str:
    """Why a table of a tagged union without its ``type`` is refused: the types it may be, and those whose fields
    hold every key it has."""
    members = [c for c in _section_classes(cls, loc, resolve_tags=False) if _tag(c) is not None]
    types = ", ".join(repr(_tag(c)) for c in members)
    table = value_at(loc, data)
    keys = set(table) if isinstance(table, dict) else set()
    fits = [repr(_tag(c)) for c in members if keys and keys <= set(c.model_fields)]
    hint = f" (its keys fit type = {' or '.join(fits)})" if fits and len(fits) < len(members) else ""
    return f"no type: set type = one of {types}{hint}"


def _unknown_type(loc: Loc, cls: type[pydantic.BaseModel], tag: str) -> str:
    """Why ``type = tag`` is refused: the types the table may be, the closest, or a member's own word on that name
    (its ``TYPE_ALIASES``: a method that is a setting of it, such as DAPO of GRPO)."""
    members = [c for c in _section_classes(cls, loc, resolve_tags=False) if _tag(c) is not None]
    for member in members:
        said = getattr(member, "TYPE_ALIASES", {}).get(tag.lower())
        if said is not None:
            return f"no type {tag!r}: {said}"
    types = [str(_tag(c)) for c in members]
    close = difflib.get_close_matches(tag.lower(), types, n=1, cutoff=0.6)
    return f"no type {tag!r}: set type = one of {', '.join(map(repr, types))}" + (
        f"; did you mean {close[0]!r}?" if close else ""
    )


def value_at(loc: Loc, data: Any) -> Any:
    node = data
    for item in loc:
        if isinstance(node, dict) and item in node:
            node = node[item]
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            node = node[item]
        elif not (isinstance(node, dict) and item == node.get("type")):
            return None
    return node


def _model_classes(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The config classes a field annotation can hold (through Optional, unions, Annotated and containers)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [c for arg in typing.get_args(annotation) for c in _model_classes(arg)]


def _is_sequence(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return True
    return origin is not Literal and any(_is_sequence(a) for a in typing.get_args(annotation))


def _tag(cls: type[pydantic.BaseModel]) -> Any:
    field = cls.model_fields.get("type")
    return None if field is None else field.default


def _section_classes(
    cls: type[pydantic.BaseModel], loc: Loc, resolve_tags: bool = True
) -> list[type[pydantic.BaseModel]]:
    """The config classes the table at error location ``loc`` may be: the union member its tag picked, or (with
    ``resolve_tags=False``) every member of the union."""
    classes = [cls]
    for item in loc:
        if isinstance(item, int):
            continue
        fields = [c.model_fields[item] for c in classes if item in c.model_fields]
        if fields:
            classes = list(dict.fromkeys(m for f in fields for m in _model_classes(f.annotation)))
        elif resolve_tags:  # a union tag pydantic put into the location
            classes = [c for c in classes if _tag(c) == item] or classes
    return classes


def _paths_of_field(cls: type[pydantic.BaseModel], name: str) -> list[str]:
    """Dotted paths (``reward.terms[].weight`` for list items) of every field called ``name`` in ``cls``'s tree."""
    found: list[str] = []

    def walk(c: type[pydantic.BaseModel], prefix: str, seen: tuple[type, ...]) -> None:
        for field_name, field in c.model_fields.items():
            path = f"{prefix}{field_name}"
            if field_name == name and path not in found:
                found.append(path)
            suffix = "[]" if _is_sequence(field.annotation) else ""
            for child in _model_classes(field.annotation):
                if child not in seen:
                    walk(child, f"{path}{suffix}.", (*seen, child))

    walk(cls, "", (cls,))
    return found
