"""Blocking until the process is asked to stop, in a process whose other threads (gRPC's, a server's) may be the
ones a signal is delivered to."""

from __future__ import annotations

import signal
import threading

__all__ = ["wait_for_stop"]

_SLICE_S = 0.5


def wait_for_stop() -> None:
    """Return once SIGTERM or SIGINT arrives (call from the main thread). Python runs a signal's handler in the main
    thread only when that thread comes back to the interpreter; a signal the kernel hands to another thread does not
    wake a main thread blocked in one endless wait (a `weight_sync serve` ignored two SIGTERMs so), hence the slices."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(_SLICE_S):
        pass
