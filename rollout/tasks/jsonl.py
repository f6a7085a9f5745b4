"""Problems read from JSON-lines files: one object per line with configurable prompt, answer, id and solution keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from rollout.tasks.config import JsonlTaskConfig
from rollout.tasks.problem import Problem, chat_messages

__all__ = ["load_jsonl", "read_jsonl_problems"]

log = logging.getLogger("rl_align")


def load_jsonl(config: JsonlTaskConfig) -> tuple[list[Problem], list[Problem]]:
    """Return ``(train, eval)``: from ``path`` and ``eval_path``, or ``path`` split by a seeded shuffle. Held-out rows
    need no ``solution_field`` (evaluation samples, it trains on nothing). A problem id that occurs twice is an error
    naming both lines."""
    if config.eval_path is not None and Path(config.eval_path).resolve() == Path(config.path).resolve():
        raise ValueError(f"task.eval_path is task.path ({config.path}): every held-out problem would be one the run "
                         "trains on; give a file of its own, or split path with task.num_eval_problems")  # fmt: skip
    train = _read(config.path, config, need_solution=True)
    if config.eval_path is not None:  # default ids say "held-out": train/data.jsonl and eval/data.jsonl share names
        held_out = _read(config.eval_path, config, need_solution=False, id_prefix="held-out:")
    elif config.num_eval_problems > 0:
        if config.num_eval_problems >= len(train):
            raise ValueError(
                f"task.num_eval_problems = {config.num_eval_problems} but {config.path} has only {len(train)} "
                "problems; leave some for training"
            )
        order = np.random.default_rng([config.seed, 1]).permutation(len(train))
        eval_idx = set(order[: config.num_eval_problems].tolist())
        held_out = [p for i, p in enumerate(train) if i in eval_idx]
        train = [p for i, p in enumerate(train) if i not in eval_idx]
    else:
        held_out = []
    seen: dict[str, str] = {}
    for problem, where in train + held_out:
        first = seen.setdefault(problem.problem_id, where)
        if first != where:
            raise ValueError(f"{where}: problem id {problem.problem_id!r} is also the id of {first}; ids must be "
                             "unique across the task's files")  # fmt: skip
    trained = {json.dumps(p.prompt, sort_keys=True) for p, _ in train}
    seen_in_training = [where for p, where in held_out if json.dumps(p.prompt, sort_keys=True) in trained]
    if seen_in_training:
        log.warning("%d of the %d held-out problems have the prompt of a training problem (the first at %s): held-out "
                    "accuracy then counts answers the run trained on", len(seen_in_training), len(held_out),
                    seen_in_training[0])  # fmt: skip
    return [p for p, _ in train], [p for p, _ in held_out]


def read_jsonl_problems(path: str, config: JsonlTaskConfig) -> list[Problem]:
    """Read every non-blank line of ``path`` into a :class:`Problem`; errors name the file, line and key."""
    return [problem for problem, _ in _read(path, config, need_solution=True)]


def _read(
    path: str, config: JsonlTaskConfig, need_solution: bool, id_prefix: str = ""
) -> list[tuple[Problem, str]]:
    """Every problem of ``path`` with its ``file:line``; ``need_solution``: rows must hold ``solution_field``; a row
    without ``id_field`` is ``<id_prefix><file name>:<line>``."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"task file {path!r} does not exist")
    problems = []
    with file.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except RecursionError:
                raise ValueError(f"{where}: JSON nested too deeply to read") from None
            except ValueError as e:  # malformed, or a number of more digits than Python converts
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            broken = _lone_surrogate(record)
            if broken is not None:
                raise ValueError(
                    f"{where}: {broken} holds a lone UTF-16 surrogate escape (e.g. \\ud83d without its pair): a "
                    "character cut in half by the tool that wrote the file, which no tokenizer encodes; fix or drop "
                    "the row"
                )
            default_id = f"{id_prefix}{file.name}:{line_no}"
            problems.append((_problem(record, where, default_id, config, need_solution), where))
    if not problems:
        raise ValueError(f"task file {path!r} holds no problems")
    return problems


def _problem(
    record: dict[str, Any], where: str, default_id: str, config: JsonlTaskConfig, need_solution: bool
) -> Problem:
    prompt = _field(record, config.prompt_field, where)
    if isinstance(prompt, str) and prompt.strip():
        messages = chat_messages(prompt, config.system_prompt)
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError(
            f"{where}: {config.prompt_field!r} must be non-empty text or a non-empty list of "
            f'{{"role": str, "content": str}} messages (roles: {", ".join(_ROLES)}), got {str(prompt)[:100]!r}'
        )
    answer = _field(record, config.answer_field, where)
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):  # "" for tasks no answer scores
        raise ValueError(f"{where}: {config.answer_field!r} must be a string or a number, got {answer!r}")
    problem_id = default_id
    if config.id_field:
        value = _field(record, config.id_field, where)
        if not isinstance(value, (str, int)) or isinstance(value, bool) or not str(value):
            raise ValueError(f"{where}: {config.id_field!r} must be a non-empty string or an integer, got {value!r}")
        problem_id = str(value)
    solution: str | list[dict[str, str]] | None = None
    if config.solution_field is not None and (need_solution or config.solution_field in record):
        value = _field(record, config.solution_field, where)
        if isinstance(value, str):
            solution = value
        elif isinstance(value, list) and value and all(_is_message(m) for m in value) and (
            value[0]["role"] == value[-1]["role"] == "assistant"
        ):
            solution = [{"role": m["role"], "content": m["content"]} for m in value]  # a transcript (tool turns)
        else:
            raise ValueError(
                f"{where}: {config.solution_field!r} must be a string (the ideal completion) or a transcript: a list "
                'of {"role", "content"} messages that starts and ends with an assistant turn'
            )
    own = {config.prompt_field, config.answer_field, config.id_field, config.solution_field}
    metadata = {key: value for key, value in record.items() if key not in own}  # for the user's reward functions
    return Problem(prompt=messages, answer=str(answer), problem_id=problem_id, solution=solution, metadata=metadata)


def _lone_surrogate(value: Any, where: str = "") -> str | None:
    """The key path of the first string in ``value`` (a JSON value) that UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"key {where!r}" if where else "a string"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        if isinstance(key, str) and (found := _lone_surrogate(key, where)) is not None:
            return found
        found = _lone_surrogate(child, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def _field(record: dict[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise ValueError(f"{where}: missing key {key!r} (keys present: {sorted(record)}); check the task's *_field")
    return record[key]


_ROLES = ("system", "user", "assistant", "tool")


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict) and message.get("role") in _ROLES and isinstance(message.get("content"), str)
    )
