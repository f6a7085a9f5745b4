"""Hand the host memory a CPU rank has freed back to the system while it trains.

glibc's allocator keeps freed memory for reuse: the activations each block recomputes and drops in backward, the
gradients dropped after the optimizer step. A CPU rank's resident set then sits well above what it holds, and since
that surplus does not shrink with the rank count, it is most of what keeps 2 FSDP ranks from halving 1 rank's memory.
:func:`release_freed_memory` returns the free pages (``malloc_trim``). :func:`release_before_backward_peak` does so as
the backward reaches the model's first block, where a step's memory peaks (every gradient is held by then): what
the backward freed so far leaves the resident set, and only that block's own activations are faulted in again.
Releasing at every block instead would cut the peak a little further for every block's activations faulted in again
(README "Measured"). Accelerator ranks keep their step's tensors in device memory and have nothing to gain.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["release_before_backward_peak", "release_freed_memory"]


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    return getattr(ctypes.CDLL(name), "malloc_trim", None)


def release_freed_memory() -> bool:
    """Return the free pages of every malloc arena of this process to the system; False where the C library cannot
    (the call is then a no-op). The memory still in use is untouched."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def release_before_backward_peak(blocks: nn.ModuleList) -> RemovableHandle:
    """Release freed memory whenever the backward pass enters the first of ``blocks`` (a model's transformer blocks,
    after sharding: the last the backward runs), that is when the gradient of its output is ready; returns the
    handle of the forward hook that asks for it."""
    # A hook on the output tensor rather than a module backward hook: the latter wraps the block's inputs and outputs
    # and warns on every backward whose block inputs need no gradient (a frozen embedding under LoRA).
    return blocks[0].register_forward_hook(_hook_output)


def _hook_output(module: nn.Module, args: object, output: object) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad:  # not in passes without gradients
        output.register_hook(_release_on_gradient)


def _release_on_gradient(grad: torch.Tensor) -> None:
    release_freed_memory()  # returning nothing: a value would replace the gradient
