"""A user's own tools, named in recipes by import path (``tests.rollout.envs.user_tools:convert``)."""

from __future__ import annotations

from rollout.envs.tools import Tool, ToolOutput

_FACTORS = {("km", "m"): 1000.0, ("m", "km"): 0.001}


async def _convert(arguments):
    factor = _FACTORS.get((arguments.get("from"), arguments.get("to")))
    if factor is None:
        return ToolOutput(f"cannot convert {arguments.get('from')} to {arguments.get('to')}", error=True)
    return ToolOutput(f"{float(arguments['value']) * factor:g}")


convert = Tool("convert", "Convert a length between units.", {
    "type": "object", "properties": {"value": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
    "required": ["value", "from", "to"],
}, _convert)  # fmt: skip


def make_convert() -> Tool:
    return convert


NOT_A_TOOL = 3
