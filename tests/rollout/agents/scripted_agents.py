"""Agent functions for tests: real `openai` clients against the worker's endpoint, written as a user would, whose
conversations do not depend on what a random tiny model writes. Each records what it sent and got (keyed by problem id
and sample index) so a test can check the recorded ids against the served text."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from rollout.agents import AgentContext

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}  # fmt: skip

RECORDS: dict[tuple[str, int], list[dict[str, Any]]] = {}
"""(problem id, sample index) -> one entry per call: the messages sent and the reply."""


def _client(ctx: AgentContext) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)


def _first_messages(ctx: AgentContext) -> list[dict[str, Any]]:
    prompt = ctx.problem.prompt
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


async def tool_loop(ctx: AgentContext, turns: int = 3, max_tokens: int | None = None) -> float:
    """A tool-using agent loop: each reply's tool calls are answered by a local calculator, a reply without calls gets
    "check your answer" from the user; after ``turns`` calls, 1.0 if the last reply is the answer."""
    client = _client(ctx)
    messages = _first_messages(ctx)
    records = RECORDS.setdefault((ctx.problem.problem_id, ctx.sample_index), [])
    reply = None
    for turn in range(turns):
        sent = [dict(m) for m in messages]
        response = await client.chat.completions.create(
            model=ctx.model, messages=messages, tools=[CALCULATOR], temperature=0.7, max_tokens=max_tokens,
        )  # fmt: skip
        reply = response.choices[0].message
        records.append({"messages": sent, "tools": [CALCULATOR], "reply": reply,
                        "finish_reason": response.choices[0].finish_reason,
                        "policy_version": getattr(response, "policy_version", None)})  # fmt: skip
        messages.append(reply.model_dump(exclude_none=True))
        if turn == turns - 1:
            break
        if reply.tool_calls:
            for call in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"= {turn} (from {call.id})"})
        else:
            messages.append({"role": "user", "content": f"Check your answer ({turn})."})
    await client.close()
    return 1.0 if reply is not None and (reply.content or "").strip() == ctx.problem.answer else 0.0


async def rewriting(ctx: AgentContext) -> None:
    """Two calls whose second conversation drops the first reply (history rewritten): two samples."""
    client = _client(ctx)
    first = _first_messages(ctx)
    await client.chat.completions.create(model=ctx.model, messages=first)
    await client.chat.completions.create(model=ctx.model, messages=[*first, {"role": "user", "content": "Again."}])
    await client.close()
    return None


async def over_the_limit(ctx: AgentContext) -> float:
    """Calls until the endpoint refuses (openai.BadRequestError there, unhandled, as a careless agent would)."""
    client = _client(ctx)
    messages = _first_messages(ctx)
    while True:
        reply = (await client.chat.completions.create(model=ctx.model, messages=messages)).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "More."}]


async def _call_until_refused(ctx: AgentContext) -> None:
    """Short calls until the endpoint refuses one (``openai.BadRequestError``, raised)."""
    client = _client(ctx)
    while True:
        await client.chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)


async def bug_after_the_limit(ctx: AgentContext) -> float:
    """Calls until refused, catches the refusal, then fails in its own code (a bug the refusal must not hide)."""
    try:
        await _call_until_refused(ctx)
    except openai.BadRequestError:
        pass
    return {"score": 1.0}["reward"]


async def refused_then_wrapped(ctx: AgentContext) -> float:
    """Calls until refused and re-raises the refusal as its own error (``raise ... from``): a stop at the limit."""
    try:
        await _call_until_refused(ctx)
    except openai.BadRequestError as e:
        raise RuntimeError("the model ran out of turns") from e
    return 1.0


async def refused_then_raised(ctx: AgentContext) -> float:
    """Calls until refused and raises its own error while handling the refusal (implicit chaining)."""
    try:
        await _call_until_refused(ctx)
    except openai.BadRequestError:
        raise RuntimeError("the model ran out of turns")  # noqa: B904
    return 1.0


async def refused_in_a_task_group(ctx: AgentContext) -> float:
    """Calls from an ``asyncio.TaskGroup`` until refused: the refusal arrives inside an ExceptionGroup."""
    async with asyncio.TaskGroup() as group:
        group.create_task(_call_until_refused(ctx))
    return 1.0


async def swallows_the_timeout(ctx: AgentContext) -> float:
    """One call, then a wait that catches the cancellation the timeout sends and returns a reward anyway."""
    await _client(ctx).chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass
    return 1.0


async def blocks_past_the_timeout(ctx: AgentContext, seconds: float = 2.0) -> float:
    """One call, then synchronous work (the event loop blocked) longer than the episode's timeout."""
    import time

    await _client(ctx).chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)
    time.sleep(seconds)
    return 1.0


async def numpy_reward(ctx: AgentContext) -> Any:
    """A reward computed with numpy: ``np.float32``, a finite number though not a Python float."""
    import numpy as np

    await _client(ctx).chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)
    return np.float32(0.5)


async def one_call_then_hang(ctx: AgentContext) -> float:
    """One call, then an endless wait: the episode's timeout ends it."""
    client = _client(ctx)
    await client.chat.completions.create(model=ctx.model, messages=_first_messages(ctx))
    await asyncio.sleep(3600)
    return 1.0


async def hang_in_call(ctx: AgentContext) -> float:
    """A call that cannot finish before the timeout (the first is quick, the second asks for a long completion)."""
    client = _client(ctx)
    await client.chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)
    await client.chat.completions.create(model=ctx.model, messages=_first_messages(ctx))
    return 1.0


async def best_of_two(ctx: AgentContext) -> float:
    """Two choices, then a second call that continues the second one."""
    client = _client(ctx)
    messages = _first_messages(ctx)
    response = await client.chat.completions.create(model=ctx.model, messages=messages, n=2)
    chosen = response.choices[1].message
    messages += [chosen.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    await client.chat.completions.create(model=ctx.model, messages=messages)
    await client.close()
    return 0.5


LAST_REPLY: dict[int, str | None] = {}
"""The last reply each sample index's ``best_of_two_first`` got."""


async def best_of_two_first(ctx: AgentContext) -> float:
    """Two choices, then a second call that continues the first one (the usual pattern)."""
    client = _client(ctx)
    messages = _first_messages(ctx)
    response = await client.chat.completions.create(model=ctx.model, messages=messages, n=2)
    messages += [response.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    final = await client.chat.completions.create(model=ctx.model, messages=messages)
    await client.close()
    LAST_REPLY[ctx.sample_index] = final.choices[0].message.content
    return float(final.choices[0].message.content == "408")


async def fail_first_else_keep_calling(ctx: AgentContext) -> float:
    """Sample 0: one call, then an error; any other sample calls until stopped from outside (the failed batch)."""
    client = _client(ctx)
    await client.chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)
    if ctx.sample_index == 0:
        raise ValueError("the agent's own bug")
    while True:
        await client.chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)


async def fails_odd_samples(ctx: AgentContext) -> float:
    """One call; samples with an odd index then fail (a flaky tool server, say), the others return 1."""
    await _client(ctx).chat.completions.create(model=ctx.model, messages=_first_messages(ctx), max_tokens=2)
    if ctx.sample_index % 2:
        raise ConnectionError(f"tool server unreachable (sample {ctx.sample_index})")
    return 1.0


async def swallows_errors(ctx: AgentContext) -> float | None:
    """Catches the client's errors and returns no reward (an agent framework's usual handling)."""
    try:
        await _client(ctx).chat.completions.create(model=ctx.model, messages=_first_messages(ctx))
    except openai.APIError:
        return None
    return 1.0


async def no_call(ctx: AgentContext) -> float:
    return 1.0


async def too_long_first_call(ctx: AgentContext) -> float:
    """A first call whose prompt the engine's context cannot hold (refused 400, unhandled): no call is recorded."""
    client = _client(ctx)
    await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "word " * 2000}])
    return 1.0


async def sleeps_before_its_call(ctx: AgentContext) -> float:
    """Work that outlasts the episode's timeout before the first call."""
    await asyncio.sleep(3600)
    return 1.0


async def broken(ctx: AgentContext) -> float:
    raise KeyError("the agent's own bug")


async def exits(ctx: AgentContext) -> float:
    """Agent code built on a CLI parser exits on bad input: ``SystemExit`` ended the agents' loop, hanging the run."""
    raise SystemExit(3)


async def own_cancelled_error(ctx: AgentContext) -> float:
    """A CancelledError of the agent's own (leaked from a library), not a cancellation of its episode."""
    raise asyncio.CancelledError("a library's")


async def bad_return(ctx: AgentContext) -> Any:
    client = _client(ctx)
    await client.chat.completions.create(model=ctx.model, messages=_first_messages(ctx))
    return "1.0"


def not_async(ctx: AgentContext) -> float:
    return 0.0
