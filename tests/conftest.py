"""Test-wide settings: small thread counts (2 shared cores), no torch-tpu autoload, no Ray token auth surprises; and
how the test process ends (below)."""

import gc
import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_session_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Collect the garbage the tests left while the interpreter is whole (stopped gRPC servers and channels caught in
    reference cycles are found here at the end of a full run) and keep the session's exit status for the last hook."""
    global _session_status
    gc.collect()
    _session_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with the session's exit status once pytest has reported everything, skipping the interpreter's
    finalization.

    This process hosts in-process vLLM engines, gRPC servers and channels, JAX's and Ray's client threads; their
    native teardown at interpreter shutdown runs in an order none of them controls, and one CI run whose 1,150 tests
    had all passed ended there in a segmentation fault (exit 2 from make). What the tests check is decided before this
    hook; the project's own processes (``rl_align.py``, the actors, ``vllm serve``) run and exit in subprocesses whose
    exit codes the integration tests check. ``-X faulthandler`` (Makefile) still prints the stacks of a crash during
    the tests."""
    if _session_status is None:  # the session never ran (e.g. a usage error): let pytest exit as it would
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_status)
