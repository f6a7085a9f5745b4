"""One prompt of a task together with what the rewards need to check a completion of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem", "chat_messages"]


def chat_messages(prompt: str | list[dict[str, str]], system_prompt: str | None = None) -> list[dict[str, str]]:
    """A prompt as chat messages: text becomes one user message; a list of messages is copied. ``system_prompt``
    goes first unless the messages already start with a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


@dataclass(frozen=True)
class Problem:
    """A prompt, its reference answer and a stable id; data only, safe to send through Ray."""

    prompt: str | list[dict[str, str]]
    """Plain text, or chat messages ``[{"role": ..., "content": ...}]``; ``rollout.tokenizer.render_prompt`` turns
    either into token ids."""
    answer: str
    """Reference answer the rewards compare against (``"579"``, ``"1/2"``, ...)."""
    problem_id: str
    """Stable id, unique within its task and split (used in logs and in reward error messages)."""
    solution: str | list[dict[str, str]] | None = None
    """For a supervised warm start, if the task has one: the ideal completion text (without the end-of-sequence
    token), or an ideal multi-turn transcript of the turns after the prompt (``assistant`` messages and the ``tool`` /
    ``user`` messages between them, ending with an ``assistant`` one), trained on its assistant turns only."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Task-specific data carried to rewards and logs (e.g. the operands of an arithmetic problem)."""
