"""Built-in tools and the Qwen / Hermes tool-call format.

A model turn calls tools by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per call);
:func:`parse_tool_calls` reads them, reporting a malformed block as an error for the model instead of raising. A tool
is an async callable ``arguments -> ToolOutput`` with a JSON-schema description for the chat template.

- ``calculator``: arithmetic on numbers (``+ - * / // % **``, parentheses), evaluated from the syntax tree without
  ``eval``; bounded (exponents, magnitudes and expression length), so it is a pure function and runs in process.
- ``python``: a program run by :func:`rollout.envs.sandbox.run_python` out of process, with CPU, memory, output,
  process and wall-clock limits, no network and none of the host's files; its stdout is the result. At most
  ``max_concurrent`` programs run at once in a process; more calls wait for a slot.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from common.imports import resolve_object
from rollout.envs.config import BUILTIN_TOOLS, PythonToolConfig, ToolName
from rollout.tokenizer import check_tools, tool_description_problem

__all__ = [
    "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "Tool", "ToolCall", "ToolOutput", "build_tool", "calculate",
    "check_tool_descriptions", "format_tool_call", "parse_tool_calls", "strip_tool_calls",
]  # fmt: skip

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The tags around one call in the Qwen / Hermes format (the one place they are spelled)."""
_MAX_EXPRESSION_CHARS = 200
_MAX_EXPONENT = 64
_MAX_DIGITS = 60


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block of a model turn: a name and arguments, or why it could not be read."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    """Why the block is malformed (bad JSON, no name, arguments not an object); the call is then not run."""


@dataclass(frozen=True)
class ToolOutput:
    """A tool's answer: the text the model sees, and whether it is an error."""

    text: str
    error: bool = False


@dataclass(frozen=True)
class Tool:
    """A callable tool and its description (the JSON-schema form chat templates take)."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[Mapping[str, Any]], Awaitable[ToolOutput]]

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters,
        }}  # fmt: skip


def check_tool_descriptions(tools: object) -> None:
    """:func:`rollout.tokenizer.check_tools` for an environment's ``tools`` (``ValueError`` saying what is wrong and
    what to give), which also says how to describe a :class:`Tool` given in place of its description."""
    try:
        check_tools(tools)
    except ValueError as e:
        if isinstance(tools, Tool) or (isinstance(tools, Sequence) and any(isinstance(t, Tool) for t in tools)):
            raise ValueError(f"{e} (a Tool's description is Tool.schema(): tools = [tool.schema() for tool in ...])"
                             ) from None  # fmt: skip
        raise


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The block a model writes to call ``name`` with ``arguments`` (what :func:`parse_tool_calls` reads back, even
    when an argument holds ``</tool_call>``: JSON's ``<\\/`` escape keeps the closing tag out of the body)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}).replace("</", "<\\/")
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text``, in order (each from its opening tag to the next closing one); an
    unclosed ``<tool_call>`` is one malformed call. Never raises, and takes time linear in ``text``."""
    spans = _blocks(text)
    calls = [_parse_one(text[start + len(TOOL_CALL_OPEN) : end - len(TOOL_CALL_CLOSE)]) for start, end in spans]
    if text.count(TOOL_CALL_OPEN) > len(calls):
        calls.append(ToolCall("", {}, f"a {TOOL_CALL_OPEN} is not closed by {TOOL_CALL_CLOSE}"))
    return calls


def strip_tool_calls(text: str) -> str:
    """``text`` without its closed ``<tool_call>`` blocks (the blocks :func:`parse_tool_calls` reads): what the model
    wrote outside its calls."""
    kept, pos = [], 0
    for start, end in _blocks(text):
        kept.append(text[pos:start])
        pos = end
    return "".join(kept) + text[pos:]


def _blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of each closed block, tags included, scanning once from left to right."""
    spans, pos = [], 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            break
        pos = end + len(TOOL_CALL_CLOSE)
        spans.append((start, pos))
    return spans


def _parse_one(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    except (ValueError, RecursionError) as e:  # valid JSON beyond what Python reads: a 5,000-digit number, deep nesting
        return ToolCall("", {}, f"the tool call cannot be read ({str(e)[:100] or type(e).__name__})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, 'a tool call must be a JSON object with a string "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], {}, '"arguments" must be a JSON object')
    return ToolCall(value["name"], arguments)


# -- calculator ------------------------------------------------------------------------------------------------------
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text (integers exactly, fractions as decimals); ``ValueError``
    with a reason the model can read when it is not one or is out of bounds. Every intermediate value (numerator and
    denominator) is bounded, so no expression takes long."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None
    value = _evaluate(tree.body)
    if isinstance(value, Fraction) and value.denominator == 1:
        value = value.numerator
    if isinstance(value, Fraction):
        return f"{float(value):.10g}"
    return str(value)


def _evaluate(node: ast.AST) -> int | Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        if isinstance(node.value, float) and not math.isfinite(node.value):  # 1e999
            raise ValueError(f"a value has more than {_MAX_DIGITS} digits")
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else node.value  # 1e-50 is 10 ** -50
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        inner = _evaluate(node.operand)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (not isinstance(right, int) or abs(right) > _MAX_EXPONENT):
            raise ValueError(f"exponents must be whole numbers of at most {_MAX_EXPONENT}")
        if (isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0) or (
            isinstance(node.op, ast.Pow) and left == 0 and right < 0
        ):
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Div) or isinstance(node.op, ast.Pow) and right < 0:
            left = Fraction(left)  # exact, never a float
        value = _BINARY[type(node.op)](left, right)
    else:
        raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")
    # Denominators too: a tiny fraction raised to powers grows without bound while its numerator stays 1.
    parts = (value.numerator, value.denominator) if isinstance(value, Fraction) else (value,)
    if max(abs(p).bit_length() for p in parts) > _MAX_DIGITS * 3.33:
        raise ValueError(f"a value has more than {_MAX_DIGITS} digits")
    return value


async def _run_calculator(arguments: Mapping[str, Any]) -> ToolOutput:
    expression = arguments.get("expression")
    if not isinstance(expression, str | int | float) or isinstance(expression, bool):
        return ToolOutput('calculator needs "expression": a string such as "123 * 456"', error=True)
    try:
        return ToolOutput(calculate(str(expression)))
    except ValueError as e:
        return ToolOutput(f"calculator error: {e}", error=True)


# -- python ----------------------------------------------------------------------------------------------------------
def _python_tool(config: PythonToolConfig) -> Callable[[Mapping[str, Any]], Awaitable[ToolOutput]]:
    from rollout.envs.sandbox import SandboxLimits, run_python

    limits = SandboxLimits(
        wall_s=config.wall_s, cpu_s=config.cpu_s, memory_bytes=config.memory_mib << 20,
        max_output_bytes=config.max_output_bytes, max_processes=config.max_processes,
    )  # fmt: skip

    async def run(arguments: Mapping[str, Any]) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutput('python needs "code": the program to run (print what you want to see)', error=True)
        async with _slots(config.max_concurrent):
            result = await run_python(code, limits)
        out, err = result.stdout, result.stderr[-500:]
        sep = "\n" if out and err and not out.endswith("\n") else ""
        if result.outcome == "ok":  # what it wrote to stderr (warnings, logging) follows its output, labelled
            return ToolOutput(out + (f"{sep}[stderr]\n{err}" if err else ""))
        # How it ended comes first: a long output may be cut to fit the observation.
        return ToolOutput(f"[the program {result.describe()}]\n{out}{sep}{err}", error=True)

    return run


_SLOTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def _slots(size: int) -> asyncio.Semaphore:
    """The running loop's semaphore of ``size`` slots, shared by every environment of the process (one recipe, so one
    ``max_concurrent``: a second size is refused rather than run beside the first)."""
    held, slots = _SLOTS.setdefault(asyncio.get_running_loop(), (size, asyncio.Semaphore(size)))
    if held != size:
        raise ValueError(f"environment.python.max_concurrent = {size}, but this worker's tools already run {held} at "
                         "a time: one worker runs one python tool configuration")  # fmt: skip
    return slots


def build_tool(name: ToolName, python: PythonToolConfig | None = None) -> Tool:
    """The tool ``name``: a built-in one (``python`` with ``python``'s limits), or the user's ``Tool`` (or function of
    no arguments returning one) at ``"package.module:name"``. ``ValueError`` names what is wrong."""
    if ":" in name:
        return _user_tool(name)
    if name == "calculator":
        return Tool(
            "calculator", "Evaluate an arithmetic expression exactly.",
            {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
            _run_calculator,
        )  # fmt: skip
    if name == "python":
        return Tool(
            "python", "Run a Python program (standard library only, no network, no files) and return what it prints.",
            {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
            _python_tool(python or PythonToolConfig()),
        )  # fmt: skip
    raise ValueError(f"unknown tool {name!r}; built-in tools: {', '.join(BUILTIN_TOOLS)}, or your own as "
                     "'package.module:name'")


def _user_tool(spec: str) -> Tool:
    """The user's tool at ``spec``: a :class:`Tool`, or a function of no arguments returning one."""
    found = resolve_object(spec, "tool")
    tool = found() if callable(found) and not isinstance(found, Tool) else found
    if not isinstance(tool, Tool):
        raise ValueError(f"tool {spec!r} is a {type(tool).__name__}; it must be a rollout.envs.tools.Tool(name, "
                         "description, parameters, run), or a function of no arguments returning one")  # fmt: skip
    problem = tool_description_problem(tool.schema())
    if problem:
        raise ValueError(f"tool {spec!r}: {problem}")
    return tool
