"""Rollout engines: the vLLM adapter, its worker extension for weight updates, and its weight-sync sink."""

from rollout.engine.vllm_engine import Completion, EngineBrokenError, VLLMEngine

__all__ = ["Completion", "EngineBrokenError", "VLLMEngine"]
