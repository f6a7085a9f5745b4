"""Rollout engines: the vLLM adapter (``vllm_engine``), its weight-transfer backend (``transfer``), the vLLM plugin
entry points, and the errors other processes catch (``errors``, importable without vLLM).

Nothing is imported here: a process that only catches an engine error (the driver) must not pay vLLM's import."""
