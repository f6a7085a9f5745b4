"""A streamed reply's text, sent as it is generated without ever sending what the finished reply would contradict.

The endpoint decodes each choice's new ids after every engine step (:class:`IncrementalText`: a short window, not the
whole completion again) and sends the text that is new since the last chunk (:class:`ChoiceStream`). The finished
reply is the same as an unstreamed one (:func:`protocol.assistant_reply` of the decoded ids), so what a client
accumulates must be a prefix of it at every moment:

- a trailing U+FFFD (the ids so far end inside a multi-byte character) is held back until the character is whole;
- a stop string is never sent (the reply ends before it, :func:`protocol.cut_at_stop`), nor a tail of the text that
  may become one, until the next step shows it does not;
- when the request offers tools, text from the first ``<tool_call>`` on (or from a tail that may become one) is held
  back until the choice ends: only then is it known whether the calls parse (they go out as ``tool_calls`` deltas and
  the text outside them as content) or not (the whole text is the content). Content is also held back while it is
  only whitespace, since a reply of calls alone has no content at all.

If the final text does not extend what was sent (a tokenizer whose decoding of a prefix is not a prefix of the
decoding, not seen with byte-level BPE), the remainder is sent anyway: the client's history then differs from the
recorded ids, and the next call starts a new sample (:mod:`rollout.agents.trajectory`), as for any rewritten history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollout.agents.protocol import cut_at_stop
from rollout.envs.tools import TOOL_CALL_OPEN

__all__ = ["ChoiceStream", "IncrementalText"]


class IncrementalText:
    """A choice's text as its ids grow, at a cost per step of the new ids only.

    Each step decodes the window from the last settled point twice, without and with the new ids, and appends the
    difference once the new text does not end inside a character (a trailing U+FFFD); both decodes start at the same id,
    so a tokenizer that drops a leading space there drops it from both. ``decode(ids) -> str`` is the tokenizer's,
    with the same options as the final reply's text.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.text = ""
        self._start = 0  # the window: ids[_start:_settled] decode to the end of ``text``
        self._settled = 0

    def update(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (which extend the ids of the last call), up to its last whole character."""
        before = self._decode(ids[self._start : self._settled])
        after = self._decode(ids[self._start :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._start, self._settled = self._settled, len(ids)
        return self.text


class ChoiceStream:
    """What has been sent of one choice; :meth:`update` while it grows, :meth:`finish` once, with the final reply."""

    def __init__(self, parse_tool_calls: bool, stop: Sequence[str] = ()) -> None:
        self._parse = parse_tool_calls
        self._stop = [s for s in stop if s]
        self.sent = ""
        """The content sent so far."""

    def update(self, text: str) -> str:
        """The content to send now that the choice decodes to ``text`` ('' for nothing)."""
        visible = text.rstrip("\ufffd")
        if self._stop:  # never send a stop string, nor a tail that may become one
            cut = cut_at_stop(visible, self._stop)
            visible = cut if len(cut) < len(visible) else visible[: len(visible) - _held_tail(visible, self._stop)]
        if self._parse:
            start = visible.find(TOOL_CALL_OPEN)
            if start >= 0:
                visible = visible[:start]
            else:
                visible = visible[: len(visible) - _held_tail(visible, (TOOL_CALL_OPEN,))]
            if not visible.strip():
                return ""
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""
        delta, self.sent = visible[len(self.sent) :], visible
        return delta

    def finish(self, message: dict[str, Any]) -> dict[str, Any]:
        """The last delta of the choice whose reply is ``message`` (``protocol.assistant_reply``): the content not
        sent yet and the tool calls (``{}`` when nothing is left)."""
        delta: dict[str, Any] = {}
        content = message.get("content") or ""
        rest = content[len(self.sent) :] if content.startswith(self.sent) else content
        if rest:
            delta["content"] = rest
            self.sent += rest
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        return delta


def _held_tail(text: str, prefixes_of: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that one of ``prefixes_of`` starts with (it may become that string)."""
    longest = max((len(s) for s in prefixes_of), default=1) - 1
    for length in range(min(len(text), longest), 0, -1):
        if any(s.startswith(text[-length:]) for s in prefixes_of):
            return length
    return 0
