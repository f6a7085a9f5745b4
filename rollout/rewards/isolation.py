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

import contextlib
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
from rollout.rewards.function import RewardFunctionError, failure_message
from rollout.rewards.reward_process import SLOTS, ResultArea
from rollout.tasks.problem import Problem

__all__ = ["IsolatedTerm", "TermProcess"]

log = logging.getLogger("rl_align")

_SLACK_S = 2.0
"""Beyond ``timeout_s`` before a silent process counts as stalled: a busy machine's scheduling."""
_PROGRESS_EVERY_S = 0.25
"""How often the parent reads the shared progress count while it waits for a batch."""
MAX_STALLS_PER_BATCH = 4
"""Calls of one term past ``reward.timeout_s`` in one batch after which its samples left fail untried: a policy that
learnt to write what hangs a check would otherwise cost a step ``timeout_s`` a sample."""
_IDLE_RESTARTS = 2
"""Processes started again for a batch when one ends before it began any of its samples, before the batch fails."""
_START_TIMEOUT_S = 300.0
"""Most seconds the process may take to import the terms' modules (a user module importing torch on a slow disk)."""


class TermProcess:
    """The process that computes ``configs``' terms; thread-safe (one batch at a time)."""

    def __init__(
        self, configs: Sequence[RewardTermConfig], on_error: Literal["fail", "zero"], timeout_s: float
    ) -> None:
        """Start the process and wait until it has built the terms: ``ValueError`` with its reason when it cannot
        (a user function's module that does not import, a missing library)."""
        self._configs = list(configs)
        self._on_error = on_error
        self._timeout_s = timeout_s
        self._batch = threading.Lock()  # one batch at a time
        self._state = threading.Lock()  # the process and its CPU bookkeeping: never held while waiting on it
        self._logged: set[tuple[str, str]] = set()  # (term, cause) of the stops logged: each once
        self._logged_once: set[str] = set()  # keys of the processes' own once-only lines, over replacements
        self._child: _Child | None = None
        self._current: list[_Child] = []  # the running process, for the finalizer (which must not hold self)
        weakref.finalize(self, _kill_all, self._current)
        self._cpu_done = 0.0  # CPU seconds of processes that ended
        self._cpu_read = 0.0  # what cpu_lap returned so far
        self._closed = False
        self._running()

    def score(
        self, index: int, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        """Term ``index``'s (scores, errors) of the samples, in order; raises what the term raises
        (:class:`RewardFunctionError`, ``ValueError`` for a reference the term cannot read). After
        :data:`MAX_STALLS_PER_BATCH` calls of the term past the limit in one batch, its samples left fail too."""
        with self._batch:
            results: dict[int, tuple[float, int]] = {}
            pending = list(range(len(completions)))
            stalls = 0
            while pending:
                run, pending = pending[:SLOTS], pending[SLOTS:]
                idle_restarts = 0  # processes that ended before they began a sample of this run
                while run:
                    stopped = self._running().run(index, run, completions, problems, labels, results, self._timeout_s)
                    if stopped is None:
                        break
                    why, blamed = stopped
                    self._stop(kill=True)
                    if not blamed and all(i in results for i in run):  # every sample done, the process hung after
                        break
                    if not blamed:  # no sample to blame (ended between batches, or on reading this one): once more
                        idle_restarts += 1
                        if idle_restarts > _IDLE_RESTARTS:
                            name = self._configs[index].term_name
                            raise RuntimeError(f"reward term {name!r}: {why} (the reward process was started "
                                               f"{idle_restarts} times for this batch)")  # fmt: skip
                    if len(blamed) > 1:  # an async function's calls in flight: its event loop stopped answering
                        why += (f"; {len(blamed)} calls were in flight: a call that blocks the event loop (time.sleep, "
                                "a blocking HTTP client) inside the async function stops them all")  # fmt: skip
                    for i in blamed:
                        results[i] = (self._failure(index, labels[i], why), 1)
                    stalls += 1
                    run = [i for i in run if i not in results]
                    if stalls >= MAX_STALLS_PER_BATCH and run + pending:
                        left = run + pending
                        why = (f"not scored: {stalls} calls of this term in this batch took longer than "
                               f"reward.timeout_s = {self._timeout_s:g} s, so its {len(left)} samples left were "
                               "not tried")  # fmt: skip
                        for i in left:
                            results[i] = (self._failure(index, labels[i], why), 1)
                        run, pending = [], []
            return [results[i][0] for i in range(len(completions))], sum(results[i][1] for i in results)

    def cpu_lap(self) -> float:
        """CPU seconds the process (and those it replaced) used since the previous lap."""
        with self._state:
            total = self._cpu_done + (self._child.cpu_s() if self._child is not None else 0.0)
            lap, self._cpu_read = max(0.0, total - self._cpu_read), max(total, self._cpu_read)
            return lap

    def close(self) -> None:
        """Stop the process (idempotent); a batch in progress then fails with ``RuntimeError``."""
        with self._state:
            self._closed = True
            child = self._child
        if child is None:
            return
        if self._batch.acquire(blocking=False):
            try:
                with contextlib.suppress(RuntimeError):  # "closed": what close asked for
                    self._stop()
            finally:
                self._batch.release()
        else:  # the batch sees its process end, stops it and raises
            child.kill()

    def _running(self) -> _Child:
        """The process, started (again) if none runs, and ready."""
        with self._state:
            if self._closed:
                raise RuntimeError("the reward scorer was closed")
            if self._child is None:
                self._child = _Child(self._configs, self._on_error, self._timeout_s, self._logged_once)
                self._current[:] = [self._child]
            child = self._child
        try:
            child.ready()
        except ValueError:
            self._stop(kill=True)
            raise
        return child

    def _stop(self, kill: bool = False) -> None:
        with self._state:
            child, self._child = self._child, None
            if child is not None:
                self._cpu_done += child.stop(kill)
            if self._closed:
                raise RuntimeError("the reward scorer was closed")

    def _failure(self, index: int, label: str, why: str) -> float:
        """The score of a sample the process could not score (see the module docstring)."""
        config = self._configs[index]
        name = config.term_name
        if isinstance(config, FunctionRewardConfig):
            what = f"function {config.function!r}"
            if self._on_error == "fail":
                raise RewardFunctionError(failure_message(name, config.function, label, why))
        else:
            what = f"the {config.type} check"
        if (name, why.partition(":")[0]) not in self._logged:
            self._logged.add((name, why.partition(":")[0]))
            log.warning("reward term %r: %s failed on %s, scored 0 (reward/%s/num_errors counts such samples; logged "
                        "once): %s", name, what, label, name, why)  # fmt: skip
        return 0.0


class _Child:
    """One reward process, its two pipes and the shared area it writes each sample's result into."""

    def __init__(
        self, configs: Sequence[RewardTermConfig], on_error: str, timeout_s: float, logged_once: set[str]
    ) -> None:
        """``logged_once``: the keys of the log lines given once, shared with the processes this one replaces."""
        self._logged_once = logged_once
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        self._area = ResultArea.create()
        # The child sees the modules this process sees (a Ray job's working_dir is on sys.path, not on PYTHONPATH).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rollout.rewards.reward_process", str(to_child), str(from_child),
                 str(self._area.fd), str(os.getpid())],
                pass_fds=(to_child, from_child, self._area.fd), env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except BaseException:
            for fd in (from_parent, to_parent):
                os.close(fd)
            self._area.close()
            raise
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
            _, level, text, once = message
            if once is None or once not in self._logged_once:
                self._logged_once.add(once)
                log.log(level, "%s", text)

    def _ending(self, what: str) -> str:
        """Why the process ended: ``what`` and how it exited."""
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return f"the reward process stopped answering: {what}"
        how = f"exit status {code}" if code >= 0 else f"killed by {_signal_name(-code)}"
        return f"the reward process ended ({how}): {what}"

    def cpu_s(self) -> float:
        """The process's CPU seconds so far (readable until it is reaped: :meth:`stop` reads them first)."""
        if self.process.returncode is not None:  # reaped: its pid may be another process's now
            return self._cpu_s
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


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return f"signal {number}"


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
