"""Hand the host memory a CPU rank has freed back to the system while it trains.

glibc's allocator keeps freed memory for reuse: the activations a block recomputes and drops in backward, the
gradients dropped after the optimizer step. A CPU rank's resident set then sits well above what it holds, and since
that surplus does not shrink with the rank count, it is most of what keeps 2 FSDP ranks from halving 1 rank's memory.
:func:`release_freed_memory` returns the free pages (``malloc_trim``); :func:`release_in_backward` does so as each
block's backward starts, so the peak at the end of backward holds little beyond what is live. It costs the pages being
faulted in again when reused (README "Measured"). Accelerator ranks keep their step's tensors in device memory and
have nothing to gain.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["release_freed_memory", "release_in_backward"]


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


def release_in_backward(blocks: nn.ModuleList) -> list[RemovableHandle]:
    """Release freed memory as the backward pass enters each of ``blocks`` (a model's transformer blocks, after
    sharding); returns the hooks' handles."""
    return [block.register_full_backward_pre_hook(_release_hook) for block in blocks]


def _release_hook(module: nn.Module, grad_output: object) -> None:
    release_freed_memory()  # returning nothing: a value would replace the block's output gradients
