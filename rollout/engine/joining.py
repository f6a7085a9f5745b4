"""Requests of one prompt, joined into one vLLM request.

The episodes of a GRPO group start from the same prompt with the same sampling, and each asks the engine for one
completion. vLLM validates and prepares a request's prompt on the engine thread, which on a tiny model costs as much as
a third of the forward passes of a batch. So the engine gathers the requests added between two of its steps by
(prompt ids, sampling, adapter) and adds each gathering as one request with ``n`` = its total: vLLM prepares the
prompt once and samples the ``n`` completions as independent sequences (children), the same draw as ``n`` requests.

Seeds: an unseeded request joins any other unseeded one. vLLM seeds child ``i`` of a request seeded ``s`` with
``s + i``, so seeded requests join only where their seeds run on consecutively (``s``, ``s + n``, ...): every
completion is sampled with exactly the seed it asked for, and a seeded batch is reproducible however its requests
were joined. :func:`rollout.sampling.turn_seed` numbers the samples of a group that way.

Greedy requests (temperature 0, :func:`rollout.sampling.is_greedy`) of one prompt all join, seeded or not, and
vLLM is asked for one completion: the argmax path is the same for every caller (and vLLM refuses ``n`` > 1 when
greedy), so each caller gets a copy of it, as many as it asked for. A held-out set with two problems of the same text
evaluates them this way.

A caller that follows its completions token by token (``on_tokens``: a streamed reply) never joins: its request is
its own, asked of vLLM with cumulative outputs after every step, and the request keeps each child's latest output,
since vLLM then reports children one by one rather than all ``n`` together at the end.

This module is the bookkeeping alone (no vLLM): who waits for which completions, and which requests join.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Joined", "Joiner", "Waiter"]


@dataclass(eq=False)
class Waiter:
    """A caller waiting for ``n`` completions of a prompt (its future gets the list of them, or an error)."""

    future: asyncio.Future[list[Any]]
    n: int
    seed: int | None
    joined: Joined | None = None
    """The request it was added to the engine with; ``None`` while it still waits for the next step."""
    on_tokens: Callable[[int, Sequence[int]], None] | None = None
    """Called on the engine loop after each step with (choice index, that choice's token ids so far); it must not
    raise. ``None``: the caller wants the finished completions only."""


@dataclass(eq=False)
class Joined:
    """One engine request made of ``waiters`` (in order: the first gets the first completions)."""

    prompt: list[int]
    sampling: Any
    adapter: Any
    waiters: list[Waiter]
    greedy: bool = False
    """Decoded greedily: vLLM samples one completion, and every one asked for is a copy of it."""
    request_id: str = ""
    version: int = 0
    """The weights version when it was added."""
    latest: dict[int, Any] = field(default_factory=dict)
    """A streamed request's latest output of each child, by index."""

    @property
    def streamed(self) -> bool:
        """Whether its (only) caller follows the tokens as they come."""
        return self.waiters[0].on_tokens is not None

    def observe(self, children: Sequence[Any]) -> None:
        """A streamed request's children that made progress in a step (vLLM ``CompletionOutput``s, cumulative)."""
        on_tokens = self.waiters[0].on_tokens
        assert on_tokens is not None
        for child in children:
            self.latest[child.index] = child
            for index in range(self.n) if self.greedy else (child.index,):
                on_tokens(index, child.token_ids)

    @property
    def n(self) -> int:
        """Completions asked for in all."""
        return sum(w.n for w in self.waiters)

    @property
    def num_sampled(self) -> int:
        """Completions to ask vLLM for: ``n``, or 1 for a greedy request."""
        return 1 if self.greedy else self.n

    @property
    def seed(self) -> int | None:
        """The request's seed: the first waiter's (the others continue it)."""
        return self.waiters[0].seed

    def wanted(self) -> bool:
        """Whether any waiter still waits (the others were cancelled)."""
        return any(not w.future.done() for w in self.waiters)

    def deliver(self, completions: Sequence[Any]) -> None:
        """Hand ``completions`` (``num_sampled`` of them, in child order) out: each waiter its own slice (of copies of
        the one completion, for a greedy request)."""
        if len(completions) != self.num_sampled:
            self.fail(RuntimeError(f"vLLM returned {len(completions)} completions for a request of {self.num_sampled}"))
            return
        if self.greedy:
            completions = [completions[0], *(copy.deepcopy(completions[0]) for _ in range(self.n - 1))]
        start = 0
        for w in self.waiters:
            if not w.future.done():
                w.future.set_result(list(completions[start : start + w.n]))
            start += w.n

    def fail(self, error: BaseException) -> None:
        """Fail every waiter still waiting with ``error``."""
        for w in self.waiters:
            if not w.future.done():
                w.future.set_exception(error)


class Joiner:
    """Waiters gathered until the engine's next step, by (prompt ids, sampling key, adapter key)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[Hashable, ...], Joined] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(
        self, prompt: Sequence[int], sampling: Any, sampling_key: Hashable, adapter: Any, waiter: Waiter,
        greedy: bool = False,
    ) -> None:
        """Let ``waiter`` join the requests of the same prompt, sampling and adapter that wait for the next step;
        ``greedy``: vLLM decodes ``sampling`` greedily (``sampling_key`` tells, so a gathering is greedy or not)."""
        ids = tuple(map(int, prompt))
        key: tuple[Hashable, ...] = (ids, sampling_key, None if adapter is None else adapter.lora_int_id)
        if waiter.on_tokens is not None:
            key += (waiter,)  # a streamed request is its own
        gathering = self._pending.get(key)
        if gathering is None:
            self._pending[key] = Joined(list(ids), sampling, adapter, [waiter], greedy=greedy)
        else:
            gathering.waiters.append(waiter)

    def remove(self, waiter: Waiter) -> None:
        """Take ``waiter`` out of its gathering (cancelled before its request was added); no-op once added."""
        for key, gathering in self._pending.items():
            if waiter in gathering.waiters:
                gathering.waiters.remove(waiter)
                if not gathering.waiters:
                    del self._pending[key]
                return

    def take(self) -> list[Joined]:
        """Everything gathered, as the requests to add: per gathering, the unseeded waiters as one request and the
        seeded ones as one request per run of consecutive seeds (a greedy gathering: all of them as one request)."""
        gatherings, self._pending = list(self._pending.values()), {}
        requests = []
        for g in gatherings:
            if g.greedy:
                requests.append(g)
                continue
            unseeded = [w for w in g.waiters if w.seed is None]
            if unseeded:
                requests.append(Joined(g.prompt, g.sampling, g.adapter, unseeded))
            seeded = sorted(((w.seed, w) for w in g.waiters if w.seed is not None), key=lambda sw: sw[0])
            run: list[Waiter] = []
            next_seed = None
            for seed, w in seeded:
                if run and seed != next_seed:
                    requests.append(Joined(g.prompt, g.sampling, g.adapter, run))
                    run = []
                run.append(w)
                next_seed = seed + w.n
            if run:
                requests.append(Joined(g.prompt, g.sampling, g.adapter, run))
        return requests

    def fail(self, error: BaseException) -> None:
        """Fail every gathered waiter with ``error`` and forget them."""
        for g in self.take():
            g.fail(error)
