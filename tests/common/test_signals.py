"""A process blocked in :func:`common.signals.wait_for_stop` stops on a SIGTERM whichever thread the kernel hands it
to (a `weight_sync serve` ignored two SIGTERMs delivered to its gRPC threads, its main thread blocked for good)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import signal, threading, time
from common.signals import wait_for_stop

def elsewhere():
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # delivered to this thread, not the main one
    time.sleep(60)

threading.Thread(target=elsewhere, daemon=True).start()
wait_for_stop()
print("stopped", flush=True)
"""


def test_a_sigterm_delivered_to_another_thread_stops_the_wait():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout == "stopped\n", (out.returncode, out.stdout, out.stderr[-2000:])
