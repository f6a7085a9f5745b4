"""Hand the host memory a CPU rank has freed back to the system while it trains, when that is worth its cost.

glibc's allocator keeps freed memory for reuse: the activations each block recomputes and drops in backward, the
gradients dropped after the optimizer step. A CPU rank's resident set then sits well above what it holds, and since
that surplus does not shrink with the rank count, it is most of what keeps 2 FSDP ranks from halving 1 rank's memory.
:func:`release_freed_memory` returns the free pages (``malloc_trim``). :func:`release_before_backward_peak` does so as
the backward reaches the model's first block, where a step's memory peaks (every gradient is held by then): what
the backward freed so far leaves the resident set, and only that block's own activations are faulted in again.
Releasing at every block instead would cut the peak a little further for every block's activations faulted in again
(README "Measured"). Accelerator ranks keep their step's tensors in device memory and have nothing to gain.

A release costs in proportion to what it returns: the pages are handed back one by one and faulted in (zeroed) again
when the next micro-batch allocates. A small model's micro-batch is short next to that, and what it frees is small,
so the trainer releases only when the allocator holds at least :data:`RELEASE_MIN_FREE_BYTES` freed: at sizes where a
rank's memory matters, the freed memory at the backward's peak is well above it (README "Measured" has both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["RELEASE_MIN_FREE_BYTES", "free_held_bytes", "release_before_backward_peak", "release_freed_memory"]

RELEASE_MIN_FREE_BYTES = 1 << 30
"""The trainer releases only when the allocator holds at least this much freed memory: below it a release returns
little (some of what glibc holds is in pieces smaller than a page) and its cost weighs on a short step."""


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33): the allocator's totals over every arena, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    return getattr(_libc(), "malloc_trim", None)


@cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's ``mallinfo2``, or None where the C library has none (glibc < 2.33, musl, macOS)."""
    fn = getattr(_libc(), "mallinfo2", None)
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


def free_held_bytes() -> int | None:
    """Bytes of freed memory the allocator holds for reuse in its arenas (``mallinfo2().fordblks``), or None where the
    C library cannot say. Cheap next to a release: it sums the free lists without touching the pages."""
    info = _mallinfo2()
    return None if info is None else int(info().fordblks)


def release_freed_memory(min_free_bytes: int = 0) -> bool:
    """Return the free pages of every malloc arena of this process to the system, if the allocator holds at least
    ``min_free_bytes`` freed (:func:`free_held_bytes`; where it cannot say, the release goes ahead); returns whether
    it released. False also where the C library cannot release (the call is then a no-op). The memory still in use
    is untouched."""
    trim = _malloc_trim()
    if trim is None:
        return False
    if min_free_bytes > 0:
        held = free_held_bytes()
        if held is not None and held < min_free_bytes:
            return False
    trim(0)
    return True


def release_before_backward_peak(blocks: nn.ModuleList) -> RemovableHandle:
    """Release freed memory (at least :data:`RELEASE_MIN_FREE_BYTES` of it) whenever the backward pass enters the first
    of ``blocks`` (a model's transformer blocks, after sharding: the last the backward runs), that is when the gradient
    of its output is ready; returns the handle of the forward hook that asks for it."""
    # A hook on the output tensor rather than a module backward hook: the latter wraps the block's inputs and outputs
    # and warns on every backward whose block inputs need no gradient (a frozen embedding under LoRA).
    return blocks[0].register_forward_hook(_hook_output)


def _hook_output(module: nn.Module, args: object, output: object) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad:  # not in passes without gradients
        output.register_hook(_release_on_gradient)


def _release_on_gradient(grad: torch.Tensor) -> None:
    release_freed_memory(RELEASE_MIN_FREE_BYTES)  # returning nothing: a value would replace the gradient
