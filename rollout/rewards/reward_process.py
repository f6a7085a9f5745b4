"""The reward process's own side: build the reward terms, then score one term's batch at a time.

:class:`rollout.rewards.isolation.TermProcess` starts it as ``python -m rollout.rewards.reward_process IN_FD OUT_FD
AREA_FD PARENT_PID`` (pipes of its own, so a user function printing to stdout cannot break the protocol) and owns the
deadlines; this side only computes. Messages, pickled over :class:`multiprocessing.connection.Connection`:

- in: ``(term configs, on_error, timeout_s)`` once, then ``(term index, completions, problems, labels)`` per batch;
- out: ``("ready",)`` or ``("failed", message)`` once; per batch ``("end",)`` or ``("raised", is a RewardFunctionError,
  message, traceback)``; ``("log", level, text, key)`` whenever a term logs (the parent logs it in the rollout worker's
  log; a line with a ``key`` once over every process it starts). Each sample's result goes into the shared
  :class:`ResultArea`, not into a message.

Plain terms run one sample at a time on the main thread (math-verify's SIGALRM timeouts work only there); an async
user function's calls run together on one event loop, the same for every batch (a client it keeps stays usable). The
process exits when its input closes or its parent dies.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

SLOTS = 1 << 16
"""Samples a batch sent to the process holds at most (the parent splits larger ones)."""


class ResultArea:
    """Each sample's result, in memory both processes map: the process writes, the parent reads once the process
    ended the batch or was stopped (so no sample's result is lost with a stopped process, and none costs a message).

    Layout: a progress count (int64, samples finished in all: the parent times calls by it), then per slot a score
    (float64), an error count (int32) and a state (int8: 0 waiting, 1 started, 2 done)."""

    _SIZE = 8 + SLOTS * (8 + 4 + 1)

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, self._SIZE)
        self._whole = memoryview(self._map)
        self._progress = self._whole[:8].cast("q")
        self._scores = self._whole[8 : 8 + 8 * SLOTS].cast("d")
        self._errors = self._whole[8 + 8 * SLOTS : 8 + 12 * SLOTS].cast("i")
        self._states = self._whole[8 + 12 * SLOTS :].cast("b")

    @classmethod
    def create(cls) -> ResultArea:
        """A new area in an anonymous file (its descriptor, ``fd``, is passed to the process)."""
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("rl_align-reward-results")
        else:  # not Linux: an unlinked temporary file
            with tempfile.TemporaryFile() as file:
                fd = os.dup(file.fileno())
        os.ftruncate(fd, cls._SIZE)
        return cls(fd)

    @property
    def progress(self) -> int:
        return self._progress[0]

    def clear(self, count: int) -> None:
        self._states[:count] = memoryview(bytes(count)).cast("b")

    def start(self, slot: int) -> None:
        self._states[slot] = 1

    def finish(self, slot: int, score: float, errors: int) -> None:
        self._scores[slot] = score
        self._errors[slot] = errors
        self._states[slot] = 2
        self._progress[0] += 1

    def finished(self, positions: Sequence[int]) -> dict[int, tuple[float, int]]:
        """``{positions[slot]: (score, errors)}`` of the slots done."""
        return {p: (self._scores[k], self._errors[k]) for k, p in enumerate(positions) if self._states[k] == 2}

    def started(self, positions: Sequence[int]) -> list[int]:
        """``positions[slot]`` of the slots started and not done."""
        return [p for k, p in enumerate(positions) if self._states[k] == 1]

    def close(self) -> None:
        for view in (self._progress, self._scores, self._errors, self._states, self._whole):
            view.release()
        self._map.close()
        os.close(self.fd)


class _ForwardedLogs(logging.Handler):
    """Sends each record of the ``rl_align`` logger, formatted with its traceback, to the parent."""

    def __init__(self, send: Callable[[tuple], None]) -> None:
        super().__init__()
        self._send = send
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(("log", record.levelno, self.format(record), getattr(record, "once", None)))
        except Exception:  # noqa: BLE001  (a closed pipe: the parent is gone or stopping this process)
            self.handleError(record)


async def _score_async(term: Any, completions: Sequence[str], problems: Sequence[Any], labels: Sequence[str],
                       area: ResultArea, max_concurrency: int) -> None:  # fmt: skip
    """Every sample's call at once, ``max_concurrency`` in flight; the first error cancels the rest (none may write
    into the next batch's slots) and is raised."""
    slots = asyncio.Semaphore(max_concurrency)

    async def one(slot: int, completion: str, problem: Any, label: str) -> None:
        async with slots:
            area.start(slot)
            score, errors = await term.call_async(completion, problem, label)
        area.finish(slot, score, errors)

    try:
        async with asyncio.TaskGroup() as group:
            for slot, sample in enumerate(zip(completions, problems, labels, strict=True)):
                group.create_task(one(slot, *sample))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None


def _die_with_parent(parent: int) -> None:
    """Be killed when the parent dies, even while a call holds the interpreter's lock (a regex backtracking): the
    kernel's parent-death signal where there is one, and a thread that watches the parent otherwise."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(0)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main(argv: Sequence[str]) -> int:
    inbox, outbox = Connection(int(argv[1]), writable=False), Connection(int(argv[2]), readable=False)
    area = ResultArea(int(argv[3]))
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            outbox.send(message)

    _die_with_parent(int(argv[4]))
    logger = logging.getLogger("rl_align")
    logger.addHandler(_ForwardedLogs(send))
    logger.setLevel(logging.INFO)
    logger.propagate = False

    from rollout.rewards.function import RewardFunctionError
    from rollout.rewards.scorer import build_term

    configs, on_error, timeout_s = inbox.recv()
    try:
        terms = [build_term(config, on_error, timeout_s) for config in configs]
    except Exception as e:  # noqa: BLE001  (reported to the parent, which raises it where the scorer is used)
        send(("failed", str(e)))
        return 1
    send(("ready",))
    loop: asyncio.AbstractEventLoop | None = None  # one for the process's life: a function may keep a client on it
    while True:
        try:
            index, completions, problems, labels = inbox.recv()
        except EOFError:
            return 0
        term = terms[index]
        try:
            if getattr(term, "is_async", False):
                loop = loop or asyncio.new_event_loop()
                loop.run_until_complete(_score_async(term, completions, problems, labels, area,
                                                     configs[index].max_concurrency))  # fmt: skip
            else:
                for slot, (completion, problem, label) in enumerate(zip(completions, problems, labels, strict=True)):
                    area.start(slot)
                    scores, errors = term.score([completion], [problem], [label])
                    area.finish(slot, scores[0], errors)
        except Exception as e:  # noqa: BLE001  (a term's own error about the batch: raised again by the parent)
            send(("raised", isinstance(e, RewardFunctionError), str(e), traceback.format_exc()))
            continue
        send(("end",))


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not waiting for threads a user function left (a call to_thread that never returns)
