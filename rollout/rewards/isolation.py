"""Reward terms run in a process of their own, so that no call can stall the rollout worker: every term but reward
models (user functions, math-verify, regexes) is computed there, each call under ``reward.timeout_s``.

A user function that never returns (an HTTP call without a timeout, a regex that backtracks forever on a model's
output, a deadlock) would otherwise hold the rollout worker, and with it the run, for good, with nothing in any log;
Python cannot stop a thread, and math-verify's own SIGALRM timeouts work only on a process's main thread, which a Ray
actor's calls do not run on. Here the parent times every call from the process's last report
(:mod:`rollout.rewards.reward_process`); a call past the limit, or a process that dies (``os._exit`` in user code, the
kernel's out-of-memory killer), stops that process: the sample it was scoring fails (a plain term scores one sample at
a time, so that sample is known; an async function's calls in flight all fail), a new process starts, and the batch
goes on from the next sample. What a failure means is the term's: a user function's follows ``reward.on_error``, a
rule term's (math, exact match, format) scores 0, counted in ``reward/<term>/num_errors`` and logged once.

The process starts with the scorer and is ready by the first batch (its imports overlap the engine's start); its CPU
time is the worker's (``rollout/process_cpu_s``), read with :meth:`TermProcess.cpu_lap`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, Literal

import psutil

from rollout.rewards.config import FunctionRewardConfig, RewardTermConfig
from rollout.rewards.function import RewardFunctionError
from rollout.rewards.reward_process import SLOTS, ResultArea
from rollout.tasks.problem import Problem

__all__ = ["IsolatedTerm", "TermProcess"]

log = logging.getLogger("rl_align")

_SLACK_S = 2.0
"""Beyond ``timeout_s`` before a silent process counts as stalled: a busy machine's scheduling."""
_PROGRESS_EVERY_S = 0.25
"""How often the parent reads the shared progress count while it waits for a batch."""
_IDLE_RESTARTS = 2
"""Processes started again for a batch when one ends before it began any of its samples, before the batch fails."""
_START_TIMEOUT_S = 300.0
"""Most seconds the process may take to import the terms' modules (a user module importing torch on a slow disk)."""


class TermProcess:
    """The process that computes ``configs``' terms; thread-safe (one batch at a time)."""

    def __init__(
        self, configs: Sequence[RewardTermConfig], on_error: Literal["fail", "zero"], timeout_s: float
    ) -> None:
        self._configs = list(configs)
        self._on_error = on_error
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()  # (term, cause) of the stops logged: each once
        self._child: _Child | None = None
        self._current: list[_Child] = []  # the running process, for the finalizer (which must not hold self)
        weakref.finalize(self, _kill_all, self._current)
        self._cpu_done = 0.0  # CPU seconds of processes that ended
        self._cpu_read = 0.0  # what cpu_lap returned so far
        self._closed = False
        self._start()

    def score(
        self, index: int, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        """Term ``index``'s (scores, errors) of the samples, in order; raises what the term raises
        (:class:`RewardFunctionError`, ``ValueError`` for a reference the term cannot read)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward scorer was closed")
            results: dict[int, tuple[float, int]] = {}
            pending = list(range(len(completions)))
            while pending:
                run, pending = pending[:SLOTS], pending[SLOTS:]
                idle_restarts = 0  # processes that ended before they began a sample of this run
                while run:
                    stopped = self._running().run(index, run, completions, problems, labels, results, self._timeout_s)
                    if stopped is None:
                        break
                    why, blamed = stopped
                    self._stop(kill=True)
                    if not blamed:  # no sample to blame (ended between batches, or on reading this one): once more
                        idle_restarts += 1
                        if idle_restarts > _IDLE_RESTARTS:
                            name = self._configs[index].term_name
                            raise RuntimeError(f"reward term {name!r}: {why} (the reward process was started "
                                               f"{idle_restarts} times for this batch)")  # fmt: skip
                    for i in blamed:
                        results[i] = (self._failure(index, labels[i], why), 1)
                    run = [i for i in run if i not in results]
            return [results[i][0] for i in range(len(completions))], sum(results[i][1] for i in results)

    def cpu_lap(self) -> float:
        """CPU seconds the process (and those it replaced) used since the previous lap."""
        with self._lock:
            total = self._cpu_done + (self._child.cpu_s() if self._child is not None else 0.0)
            lap, self._cpu_read = max(0.0, total - self._cpu_read), max(total, self._cpu_read)
            return lap

    def close(self) -> None:
        """Stop the process (idempotent)."""
        with self._lock:
            self._closed = True
            self._stop()

    def _running(self) -> _Child:
        if self._child is None:
            self._start()
        assert self._child is not None
        self._child.ready()
        return self._child

    def _start(self) -> None:
        self._child = _Child(self._configs, self._on_error, self._timeout_s)
        self._current[:] = [self._child]

    def _stop(self, kill: bool = False) -> None:
        if self._child is not None:
            self._cpu_done += self._child.stop(kill)
            self._child = None

    def _failure(self, index: int, label: str, stopped: str) -> float:
        """The score of the sample a stopped process was computing (see the module docstring)."""
        config = self._configs[index]
        name = config.term_name
        if isinstance(config, FunctionRewardConfig):
            what = f"function {config.function!r}"
            if self._on_error == "fail":
                raise RewardFunctionError(f"reward term {name!r}: {what} failed on {label}: {stopped} (set "
                                          "reward.on_error = 'zero' to score such samples 0 instead)")  # fmt: skip
        else:
            what = f"the {config.type} check"
        if (name, stopped.partition(":")[0]) not in self._logged:
            self._logged.add((name, stopped.partition(":")[0]))
            log.warning("reward term %r: %s failed on %s, scored 0 (reward/%s/num_errors counts such samples; logged "
                        "once): %s", name, what, label, name, stopped)  # fmt: skip
        return 0.0


class _Child:
    """One reward process, its two pipes and the shared area it writes each sample's result into."""

    def __init__(self, configs: Sequence[RewardTermConfig], on_error: str, timeout_s: float) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        self._area = ResultArea.create()
        # The child sees the modules this process sees (a Ray job's working_dir is on sys.path, not on PYTHONPATH).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rollout.rewards.reward_process", str(to_child), str(from_child),
                 str(self._area.fd)],
                pass_fds=(to_child, from_child, self._area.fd), env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            os.close(to_child)
            os.close(from_child)
        self._outbox = Connection(from_parent, readable=False)
        self._inbox = Connection(to_parent, writable=False)
        self._outbox.send((list(configs), on_error, timeout_s))
        self._ready = False
        self._cpu_s = 0.0  # the process's CPU seconds when last read

    def ready(self) -> None:
        """Wait for the terms to be built; ``ValueError`` with the process's reason when it could not build them."""
        if self._ready:
            return
        message = self._receive(_START_TIMEOUT_S)
        if message is None or message[0] != "ready":
            why = message[1] if message is not None and message[0] == "failed" else self._ending(
                f"no answer within {_START_TIMEOUT_S:g} s" if message is None else f"unexpected {message[0]!r}")
            raise ValueError(f"the reward process could not build the reward terms: {why}")
        self._ready = True

    def run(
        self, index: int, positions: Sequence[int], completions: Sequence[str], problems: Sequence[Problem],
        labels: Sequence[str], results: dict[int, tuple[float, int]], timeout_s: float,
    ) -> tuple[str, list[int]] | None:
        """Score ``positions`` (at most :data:`SLOTS`) of the batch with term ``index`` into ``results``: None when
        all are done, else why the process stopped and the positions it was computing then (raises what the term
        raised)."""
        area = self._area
        area.clear(len(positions))
        try:
            self._outbox.send((index, [completions[i] for i in positions], [problems[i] for i in positions],
                               [labels[i] for i in positions]))  # fmt: skip
        except OSError:
            return self._ending("it had ended before the batch was sent"), []
        seen, deadline = area.progress, time.monotonic() + timeout_s + _SLACK_S
        while True:
            message = self._receive(min(_PROGRESS_EVERY_S, max(0.0, deadline - time.monotonic())))
            if message is None:
                if area.progress != seen:  # a sample finished: the next call's time starts
                    seen, deadline = area.progress, time.monotonic() + timeout_s + _SLACK_S
                    continue
                if time.monotonic() < deadline:
                    continue
                why = (f"TimeoutError: no result within reward.timeout_s = {timeout_s:g} s; the reward process "
                       "running it was stopped and replaced")  # fmt: skip
            elif message == ("eof",):
                why = self._ending("it died while computing it")
            elif message[0] == "end":
                results.update(area.finished(positions))
                return None
            else:
                assert message[0] == "raised", message
                _, is_function_error, text, trace = message
                error = RewardFunctionError(text) if is_function_error else ValueError(text)
                error.add_note(f"in the reward process:\n{trace}")
                raise error
            self.kill()  # before reading the area: nothing writes it after this
            results.update(area.finished(positions))
            return why, area.started(positions)

    def _receive(self, timeout_s: float) -> Any:
        """The next message other than a log line (logged here), ``("eof",)`` when the process closed its end, or
        None after ``timeout_s`` of silence."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not self._inbox.poll(left):
                    return None
                message = self._inbox.recv()
            except (EOFError, OSError):
                return ("eof",)
            if message[0] != "log":
                return message
            log.log(message[1], "%s", message[2])

    def _ending(self, what: str) -> str:
        """Why the process ended: ``what`` and how it exited."""
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return f"the reward process stopped answering: {what}"
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return f"the reward process ended ({how}): {what}"

    def cpu_s(self) -> float:
        """The process's CPU seconds so far (readable until it is reaped: :meth:`stop` reads them first)."""
        try:
            times = psutil.Process(self.process.pid).cpu_times()
            self._cpu_s = max(self._cpu_s, times.user + times.system)
        except psutil.Error:
            pass
        return self._cpu_s

    def stop(self, kill: bool = False) -> float:
        """End the process (``kill``: SIGKILL at once; else closing its input, then SIGKILL after a second); its CPU
        seconds in all."""
        cpu_s = self.cpu_s()
        self._outbox.close()
        try:
            self.process.wait(timeout=0.0 if kill else 1.0)
        except subprocess.TimeoutExpired:
            cpu_s = self.cpu_s()
            self.kill()
        self._inbox.close()
        self._area.close()
        return cpu_s

    def kill(self) -> None:
        if self.process.poll() is None:
            self._cpu_s = self.cpu_s()
            self.process.kill()
            self.process.wait()


def _kill_all(children: list[_Child]) -> None:
    for child in children:
        child.kill()


class IsolatedTerm:
    """A reward term computed by a :class:`TermProcess` (the scorer's view of it)."""

    def __init__(self, process: TermProcess, index: int, config: RewardTermConfig) -> None:
        self.name = config.term_name
        self.weight = config.weight
        self._process = process
        self._index = index

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        return self._process.score(self._index, completions, problems, labels)
