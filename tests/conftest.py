"""Test-wide settings: small thread counts (2 shared cores), no torch-tpu autoload, no Ray token auth surprises."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
