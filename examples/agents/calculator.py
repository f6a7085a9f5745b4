"""An agent written against the OpenAI API, not against rl-align: it asks the model, runs the calculator the model
calls, and hands the answer back. rl-align trains it as it runs (``recipes/agent_openai_tiny.toml``)::

    [environment]
    type = "agent"
    function = "examples.agents.calculator:solve"
    warm_start_tools = ["calculator"]     # warm-start on the prompts this agent sends

The same function runs unchanged against any OpenAI-compatible server (``vllm serve``, a hosted API): only
``base_url`` changes. It returns ``None``, so the recipe's ``exact_match`` term scores its final answer.
"""

from __future__ import annotations

import json
from typing import Any

import openai

from rollout.agents import AgentContext
from rollout.envs.tools import build_tool

_CALCULATOR = build_tool("calculator")
CALCULATOR = _CALCULATOR.schema()
"""The tool as the warm start described it (``warm_start_tools``): the same schema renders the same prompt."""


async def solve(ctx: AgentContext, max_calls: int = 3) -> None:
    """Ask the task's question with the calculator offered; answer each tool call; stop at a reply without calls."""
    messages: list[dict[str, Any]] = (
        [{"role": "user", "content": ctx.problem.prompt}] if isinstance(ctx.problem.prompt, str)
        else [dict(m) for m in ctx.problem.prompt]
    )  # fmt: skip
    async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        for _ in range(max_calls):
            response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALCULATOR])
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return None
            for call in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await _run(call.function)})
    return None


async def _run(function: Any) -> str:
    if function.name != "calculator":
        return f"error: there is no tool named {function.name!r}; call calculator"
    try:
        arguments = json.loads(function.arguments)
    except json.JSONDecodeError as e:
        return f"error: the arguments are not JSON ({e.msg})"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    return (await _CALCULATOR.run(arguments)).text
