"""The built-in arithmetic task: ``a OP b`` with exact integer answers, generated deterministically from a seed.

The ideal completion is the bare result (``"579"``): short, one digit per token with the project's tokenizer, and
checkable both by ``math`` (math-verify) and by ``exact_match``. Held-out problems are drawn first from the same
stream and excluded from the training set, so the two never share a problem.
"""

from __future__ import annotations

import random

from rollout.tasks.config import ArithmeticTaskConfig
from rollout.tasks.problem import Problem, chat_messages

__all__ = ["generate_arithmetic"]


def generate_arithmetic(config: ArithmeticTaskConfig) -> tuple[list[Problem], list[Problem]]:
    """Return ``(train, eval)`` problem lists of the configured sizes; same config, same problems, same order."""
    rng = random.Random(f"arithmetic:{config.seed}")
    wanted = config.num_eval_problems + config.num_train_problems
    seen: set[tuple[int, str, int]] = set()
    keys: list[tuple[int, str, int]] = []
    # The config validator guarantees the space holds at least twice `wanted`, so rejection ends quickly.
    max_attempts = 100 * wanted + 10_000
    for _ in range(max_attempts):
        if len(keys) == wanted:
            break
        key = _draw(rng, config)
        if key not in seen:
            seen.add(key)
            keys.append(key)
    assert len(keys) == wanted, f"drew only {len(keys)} of {wanted} distinct problems"
    eval_keys, train_keys = keys[: config.num_eval_problems], keys[config.num_eval_problems :]
    return (
        [_problem(config, key, f"arith-train-{i}") for i, key in enumerate(train_keys)],
        [_problem(config, key, f"arith-eval-{i}") for i, key in enumerate(eval_keys)],
    )


def _draw(rng: random.Random, config: ArithmeticTaskConfig) -> tuple[int, str, int]:
    op = rng.choice(config.operators)
    a = _operand(rng, rng.randint(config.min_digits, config.max_digits))
    b = _operand(rng, rng.randint(config.min_digits, config.max_digits))
    if op == "-" and not config.allow_negative and a < b:
        a, b = b, a
    return a, op, b


def _operand(rng: random.Random, digits: int) -> int:
    if digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _problem(config: ArithmeticTaskConfig, key: tuple[int, str, int], problem_id: str) -> Problem:
    a, op, b = key
    result = a + b if op == "+" else a - b if op == "-" else a * b
    text = config.prompt_template.format(a=a, op=op, b=b)
    messages = chat_messages(text, config.system_prompt)
    solution: str | list[dict[str, str]] = str(result)
    if config.solution_format == "calculator":
        solution = calculator_transcript(f"{a} {op} {b}")
    return Problem(
        prompt=messages,
        answer=str(result),
        problem_id=problem_id,
        solution=solution,
        metadata={"a": a, "op": op, "b": b},
    )


def calculator_transcript(expression: str) -> list[dict[str, str]]:
    """An ideal tool-use transcript: call the calculator on ``expression``, then answer with what it returned."""
    from rollout.envs.tools import calculate, format_tool_call

    result = calculate(expression)
    call = format_tool_call("calculator", {"expression": expression})
    return [{"role": "assistant", "content": call}, {"role": "tool", "content": result},
            {"role": "assistant", "content": result}]  # fmt: skip
