"""vLLM's own C++ RMSNorm kernels for its CPU platform, which vLLM 0.32 builds but does not dispatch to.

vLLM routes RMSNorm through its IR ops (``vllm.ir.ops.rms_norm``, ``fused_add_rms_norm``): each call runs the first
implementation of a priority list that supports it. The CPU build ships ``torch.ops._C.rms_norm`` and
``torch.ops._C.fused_add_rms_norm`` (one vectorised pass per row), but the implementation that calls them (provider
``vllm_c``) is marked supported on GPUs only and the CPU platform's default priority is ``native``: half a dozen
elementwise torch ops, each a pass over memory and an allocation. Per layer a Qwen 3 block runs four of them (input,
post-attention, and per-head query and key norms) on every token of every forward pass.

:func:`register_cpu_norms` registers the same kernels as provider :data:`PROVIDER` (supported on CPU only), and
:func:`cpu_norm_priority` is the ``ir_op_priority`` engine argument that selects them, falling back to ``native`` for
any call they do not support. The plugin (:mod:`rollout.engine.vllm_plugin`) registers them in every vLLM process, so
a served ``vllm serve --ir-op-priority`` can name them too.
"""

from __future__ import annotations

import torch

__all__ = ["PROVIDER", "cpu_norm_priority", "register_cpu_norms"]

PROVIDER = "rl_align_cpu"


def _plain_rms_args(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> bool:
    # The kernel normalises over the whole last dimension, with a weight of the input's dtype.
    return variance_size is None and (weight is None or weight.dtype == x.dtype)


def _plain_fused_args(
    x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
    variance_size: int | None = None,
) -> bool:  # fmt: skip
    # Updated in place: both must already be dense rows (a copy would not be written back).
    return _plain_rms_args(x, weight, epsilon, variance_size) and x.is_contiguous() and x_residual.is_contiguous()


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> torch.Tensor:
    # The kernel reads rows of the last dimension's size back to back: a strided view (a query split off the fused
    # QKV projection, viewed per head) must be made dense first, or it normalises the wrong elements.
    x = x.contiguous()
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _fused_add_rms_norm(
    x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)  # x <- norm(x + residual), residual <- x + residual
    return x, x_residual


def register_cpu_norms() -> bool:
    """Register the kernels as provider :data:`PROVIDER` of vLLM's RMSNorm IR ops (idempotent). Returns whether they
    are usable here: a CPU platform whose vLLM build has them."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:  # a vLLM build without the kernels or without IR ops: nothing to register
        from vllm import ir
    except ImportError:
        return False
    # vLLM's own loader picks the build this CPU can run (AVX-512 with BF16, AVX-512, AVX2); importing ``vllm._C``
    # directly loads the AVX-512 BF16 one, which dies of SIGILL on an AVX2-only CPU.
    current_platform.import_kernels()
    if not (hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")):
        return False
    if PROVIDER not in ir.ops.rms_norm.impls:
        ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_plain_rms_args)(_rms_norm)
    if PROVIDER not in ir.ops.fused_add_rms_norm.impls:
        ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supports_args=_plain_fused_args, inplace=True)(
            _fused_add_rms_norm
        )
    return True


def cpu_norm_priority() -> dict[str, list[str]]:
    """The ``ir_op_priority`` engine argument that runs both RMSNorm ops on the kernels (vLLM appends its platform
    default, ``native``, for the calls they do not take); ``{}`` where :func:`register_cpu_norms` finds none."""
    if not register_cpu_norms():
        return {}
    return {"rms_norm": [PROVIDER], "fused_add_rms_norm": [PROVIDER]}
