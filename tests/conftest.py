"""Test-wide settings: small thread counts (2 shared cores), no torch-tpu autoload, no Ray token auth surprises."""

import gc
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """Collect the garbage the tests left while the interpreter is whole, not during its shutdown: stopped gRPC servers
    and channels caught in reference cycles are found there at the end of a full run, and native teardown at shutdown
    is the likeliest cause of the segmentation fault that ended one CI run whose tests had all passed."""
    gc.collect()
