"""Trajectories from an agent's recorded chat completions: calls whose prompts extend each other become one sample.

Every call the endpoint served is recorded as the exact prompt ids the engine saw and the ids and log-probs it
generated. Calls are taken in the order they arrived. A call whose prompt starts with everything of an earlier
segment (its first prompt, then its model and observation tokens) extends that segment: the prompt's remaining ids are
observation tokens (loss mask 0), the completion model tokens (mask 1). Otherwise (a chat template that rewrites
history, a re-tokenisation that differs from what was generated, a reply cut before the stop string that ended it,
an agent that edits or branches its conversation)
the call starts a new segment, and each segment is one training sample. A call that sampled several choices
(``n`` > 1) is taken choice by choice: the first extends the segment its prompt extends; each other one no longer
finds that segment a prefix (it now holds the first choice), so it starts a segment whose prompt is the whole
conversation so far (the earlier turns are trained once, in the first); a later call extends whichever choice the
agent went on with. Nothing is ever re-tokenised to make calls fit: the trainer sees exactly the ids the engine was
conditioned on and sampled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from rollout.envs.base import said_once, warn_once
from rollout.envs.episode import Episode

__all__ = ["AgentCall", "Assembled", "assemble"]

log = logging.getLogger(__name__)
_SPLIT = "agent episode split"  # warn_once's key


@dataclass(frozen=True)
class AgentCall:
    """One chat completion the endpoint served for an episode."""

    index: int
    """Arrival order within the episode (0, 1, ...)."""
    prompt_ids: list[int]
    """The prompt as the engine saw it (chat template applied)."""
    completion_ids: np.ndarray
    """int64: the generated ids (stop token included when generation stopped on one)."""
    logprobs: np.ndarray
    """float32, like ``completion_ids``: the engine's log-prob of each generated token."""
    policy_version: int
    """Weights version that sampled the completion."""
    finish_reason: str
    """'stop' or 'length' (the engine's)."""
    text: str
    """The completion decoded (special tokens dropped), a stop string that ended it included: what rewards score, as
    for an environment's turn. The reply's content ends before that stop string."""
    choice: int = 0
    """Which of the call's choices (``n`` > 1) this completion is."""


@dataclass
class _Segment:
    prompt: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    calls: list[AgentCall]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.ids)

    def is_prefix_of(self, ids: list[int]) -> bool:
        head = len(self.prompt)
        return len(self) <= len(ids) and ids[:head] == self.prompt and ids[head : len(self)] == self.ids

    def add(self, observation: list[int], call: AgentCall) -> None:
        self.ids += observation + call.completion_ids.tolist()
        self.mask += [0] * len(observation) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(observation) + call.logprobs.tolist()
        self.calls.append(call)


class Assembled(NamedTuple):
    """An episode's training samples and how often a call's prompt did not extend the conversation so far."""

    episodes: list[Episode]
    num_splits: int
    """Calls (first choices) that began a new segment after the first: a prompt that did not extend any earlier
    segment (rewritten history, a different re-tokenisation, an edited conversation). A call's other choices
    (``n`` > 1) begin segments of their own too, and are not splits."""


def assemble(calls: Sequence[AgentCall]) -> Assembled:
    """The episode's segments, each as an :class:`~rollout.envs.episode.Episode` (``env_reward`` 0, finish reason of
    its last call), and the number of splits; no segment without calls. A call extends the longest open segment its
    prompt starts with. The first split of the process is named in a warning, with where the prompt departed from the
    conversation so far.

    The last segment is the one holding the agent's last call (its first choice when that call sampled several): the
    episode's final answer, which rewards score. The others follow in the order they began. So an agent that sampled
    two choices and went on with the first, or made a side call (a summary) before its last turn, is scored on the
    conversation it finished, not on the segment begun last. "Last" is arrival order: of two calls made at once, either
    may arrive last, so an agent that scores on reward terms awaits its side calls before its final one."""
    segments: list[_Segment] = []
    final: _Segment | None = None
    num_splits = 0
    for call in sorted(calls, key=lambda c: (c.index, c.choice)):
        extended = [s for s in segments if s.is_prefix_of(call.prompt_ids)]
        segment = max(extended, key=len) if extended else None
        if segment is None:
            if segments and call.choice == 0:
                num_splits += 1
                _say_split(segments, call)
            segment = _Segment(list(call.prompt_ids), [], [], [], [])
            segments.append(segment)
        segment.add(call.prompt_ids[len(segment):], call)
        if call.choice == 0:
            final = segment
    ordered = [s for s in segments if s is not final] + ([final] if final is not None else [])
    return Assembled([_episode(s) for s in ordered], num_splits)


def _say_split(segments: Sequence[_Segment], call: AgentCall) -> None:
    """Warn, once per process, where ``call``'s prompt left the conversation it came closest to extending."""
    if said_once(_SPLIT):  # the scan is Python over every segment's ids: with a template that rewrites every turn
        return  # each call splits, and it would run at every one
    best, at = None, -1
    for segment in segments:
        held = segment.prompt + segment.ids
        common = next((i for i, (a, b) in enumerate(zip(held, call.prompt_ids, strict=False)) if a != b),
                      min(len(held), len(call.prompt_ids)))  # fmt: skip
        if common > at:
            best, at = held, common
    assert best is not None
    got = call.prompt_ids[at : at + 4]
    warn_once(log, _SPLIT, "an agent's call %d does not extend its conversation so far: its prompt "
              "departs at token %d (the conversation holds %s there, the prompt %s); the episode is split into "
              "separate samples there (agent/num_split_episodes). Usual causes: a chat template that rewrites earlier "
              "turns, tool-call arguments the agent sends back otherwise than the model wrote them, an edited "
              "conversation (said once)", call.index, at, best[at : at + 4], got)  # fmt: skip


def _episode(segment: _Segment) -> Episode:
    last = segment.calls[-1]
    return Episode(
        prompt_ids=segment.prompt, completion_ids=np.asarray(segment.ids, np.int64),
        loss_mask=np.asarray(segment.mask, np.uint8), logprobs=np.asarray(segment.logprobs, np.float32),
        final_text=last.text, final_turn_tokens=len(last.completion_ids), env_reward=0.0,
        finish_reason=last.finish_reason, num_turns=len(segment.calls),
        policy_versions=[c.policy_version for c in segment.calls],
    )  # fmt: skip
