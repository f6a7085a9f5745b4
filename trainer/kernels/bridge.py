"""Torch <-> JAX plumbing shared by every kernel: zero-copy DLPack, platform checks, and the torch-tpu route.

Each kernel is a JAX function (Pallas inside) exposed to PyTorch as a ``torch.library.custom_op``. Where it runs:

- CPU tensors: the op converts its inputs to JAX arrays with DLPack (no copy), runs the Pallas kernels in interpret
  mode on the host, and hands the results back through DLPack.
- TPU tensors (``torch.device("tpu")`` from the ``torch-tpu`` package): the op's ``tpu`` kernel calls an op made by
  ``torch.tpu.pallas.jax_op``, which compiles the same JAX function with Mosaic for the chip.
- anything else (CUDA, MPS, ...): there is no Pallas path for it here, so the op raises a ``ValueError`` naming the
  config flag and what to use instead (:func:`check_kernel_device`, from the block's declaration in
  ``trainer.models.registry``). Never a silent fallback to another implementation.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import torch

from trainer.models.registry import BlockRegistry

__all__ = [
    "check_kernel_device",
    "float_tag",
    "int32_tensor",
    "jax_to_torch",
    "register_tpu_kernel",
    "torch_to_jax",
    "tpu_backend_available",
    "tpu_jax_op",
]


def torch_to_jax(tensor: torch.Tensor) -> jax.Array:
    """View ``tensor`` (detached, made contiguous if it is not) as a JAX array without copying.

    JAX copies only a buffer it cannot alias (e.g. a view starting at an unaligned offset). 64-bit tensors must be
    narrowed by the caller first: JAX runs with 32-bit types by default.
    """
    if tensor.dtype in (torch.int64, torch.float64):
        raise TypeError(f"{tensor.dtype} does not cross into JAX (x64 is off); cast to a 32-bit dtype first")
    return jax.dlpack.from_dlpack(tensor.detach().contiguous())


def jax_to_torch(array: jax.Array) -> torch.Tensor:
    """View a JAX array as a torch tensor without copying (the tensor keeps the JAX buffer alive)."""
    return torch.from_dlpack(array)


def _device_type(device: torch.device | str) -> str:
    # A string, not torch.device(...): "tpu" is not a device type torch knows until torch-tpu registers it.
    return device.type if isinstance(device, torch.device) else device.split(":", 1)[0]


@functools.cache
def tpu_backend_available() -> bool:
    """True when ``torch-tpu`` is installed and a ``torch.device("tpu")`` can hold a tensor on this host.

    torch-tpu imports on CPU-only hosts too but registers no device there; this probes for a real one.
    """
    if importlib.util.find_spec("torch_tpu") is None:
        return False
    importlib.import_module("torch_tpu")
    try:
        torch.empty(0, device="tpu")
    except RuntimeError:
        return False
    return True


def check_kernel_device(device: torch.device | str, registry: BlockRegistry[Any], name: str) -> None:
    """Raise ``ValueError`` unless the Pallas kernel registered as block ``name`` of ``registry`` can run on
    ``device``: a device its declaration lists (``trainer.models.registry``, the one owner of where each block runs),
    or ``meta`` (shape propagation only), and on ``tpu`` only with the torch-tpu backend present. The message names the
    config field and the declared alternative."""
    device_type = _device_type(device)
    problem = registry.device_problem(name, device_type)
    if problem is not None:
        raise ValueError(f"{problem}. The block runs Pallas kernels: Mosaic-compiled on TPU, interpret mode on CPU.")
    if device_type == "tpu" and not tpu_backend_available():
        alternative = registry.declared[name].alternative
        field = registry.config_field
        raise ValueError(
            f"{field} = \"{name}\" on device 'tpu' needs the torch-tpu backend (pip install 'rl-align[tpu]') on a TPU "
            f'host; none is available here. Run on a TPU host or set {field} = "{alternative}".'
        )


_TPU_OPS: dict[str, Any] = {}


def tpu_jax_op(name: str, make_fn: Callable[[], Callable[..., Any]]) -> Any:
    """The torch op that ``torch.tpu.pallas.jax_op`` makes from the JAX function ``make_fn()``, made once per name.

    The JAX function must take and return JAX arrays only: bind every non-tensor parameter into it and encode that
    binding in ``name`` (e.g. ``rl_align_tpu::splash_attention_s0p125``).
    """
    op = _TPU_OPS.get(name)
    if op is None:
        if not tpu_backend_available():
            raise RuntimeError(f"{name}: torch.tpu.pallas.jax_op needs the torch-tpu backend on a TPU host")
        op = _TPU_OPS[name] = torch.tpu.pallas.jax_op(name, make_fn())  # type: ignore[attr-defined]
    return op


def float_tag(value: float) -> str:
    """``value`` spelled with characters allowed in an op name (``0.125`` -> ``0p125``, ``-1e-05`` -> ``m1em05``)."""
    return repr(float(value)).replace(".", "p").replace("-", "m").replace("+", "")


def register_tpu_kernel(op: Any, kernel: Callable[..., Any]) -> bool:
    """Register ``kernel`` as ``op``'s implementation for ``tpu`` tensors when the torch-tpu backend is present.

    Returns whether it was registered. On other hosts the op keeps only its default kernel (CPU interpret mode).
    """
    if not tpu_backend_available():
        return False
    op.register_kernel("tpu")(kernel)
    return True


def int32_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as int32 (index tensors arrive as int64 from torch; JAX kernels take int32)."""
    return tensor if tensor.dtype == torch.int32 else tensor.to(torch.int32)
