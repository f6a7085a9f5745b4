"""Shard geometry as pure functions: a shard is an N-d box (`offsets`, `shape`) inside a tensor's global shape.

The receiver keeps one flat buffer per tensor; a shard is a strided N-d view of it, and a chunk is a run of elements
of that view in C order. `write_range` / `read_range` move such a run with one vectorized copy per contiguous piece, so
FSDP dim-0 shards are a single memcpy and tensor-parallel column shards a single strided copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from types import EllipsisType

import numpy as np

__all__ = [
    "add_box_corners", "box_error", "contiguous_range", "read_range", "shard_view", "tiles_exactly",
    "write_range",
]

Corners = dict[tuple[int, ...], int]


def box_error(global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]) -> str | None:
    """Why the box does not fit inside `global_shape` (a message), or None when it fits and is non-empty."""
    if len(offsets) != len(global_shape) or len(shape) != len(global_shape):
        return (
            f"shard has {len(offsets)} offsets and {len(shape)} dims but the tensor has {len(global_shape)} dims "
            f"(global shape {tuple(global_shape)})"
        )
    for dim, (off, size, full) in enumerate(zip(offsets, shape, global_shape)):
        if off < 0 or size < 0 or off + size > full:
            return f"dim {dim}: offset {off} + size {size} is outside [0, {full}]"
    if math.prod(shape) == 0 and math.prod(global_shape) != 0:
        return "empty shard of a non-empty tensor"
    return None


def add_box_corners(corners: Corners, offsets: Sequence[int], shape: Sequence[int]) -> None:
    """Add the signed corners of one box to `corners` (2^ndim entries; zero weights are removed).

    A box [o, o + s) is, as a function on the integer grid, the signed sum over its 2^d corners c of the orthant
    indicator 1[x >= c], with sign (-1)^(number of coordinates taken from o + s). Orthant indicators of distinct corners
    are linearly independent, so boxes cover every element of a tensor exactly once if and only if the summed corner
    weights equal those of the whole tensor's box (`tiles_exactly`): an exact tiling check in O(shards * 2^ndim),
    whatever the order in which shards arrive and however many there are.
    """
    for upper in itertools.product((False, True), repeat=len(shape)):
        corner = tuple(o + s if u else o for o, s, u in zip(offsets, shape, upper))
        weight = corners.get(corner, 0) + (-1 if sum(upper) % 2 else 1)
        if weight:
            corners[corner] = weight
        else:
            del corners[corner]


def tiles_exactly(corners: Corners, global_shape: Sequence[int]) -> bool:
    """True when the boxes summed into `corners` (see `add_box_corners`) cover `global_shape` exactly once."""
    whole: Corners = {}
    add_box_corners(whole, (0,) * len(global_shape), global_shape)
    return corners == whole


def shard_view(
    flat: np.ndarray, global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]
) -> np.ndarray:
    """The N-d view of `flat` (a 1-D array holding the global tensor) covered by the box; no copy."""
    full = flat.reshape(tuple(global_shape))
    box: tuple[EllipsisType | slice, ...] = (Ellipsis, *(slice(o, o + s) for o, s in zip(offsets, shape)))
    return full[box]  # Ellipsis: a view even for 0-d


def write_range(view: np.ndarray, start: int, values: np.ndarray) -> None:
    """Write the 1-D `values` into elements [start, start + len(values)) of `view` in C order."""
    n = values.shape[0]
    if n == 0:
        return
    if view.ndim <= 1 or view.flags.c_contiguous:
        view.reshape(-1)[start : start + n] = values
        return
    inner = math.prod(view.shape[1:])
    row, rem = divmod(start, inner)
    pos = 0
    if rem:
        take = min(inner - rem, n)
        write_range(view[row], rem, values[:take])
        pos, row = take, row + 1
    num_full = (n - pos) // inner
    if num_full:
        block = view[row : row + num_full]
        block[...] = values[pos : pos + num_full * inner].reshape(block.shape)
        pos, row = pos + num_full * inner, row + num_full
    if pos < n:
        write_range(view[row], 0, values[pos:])


def read_range(view: np.ndarray, start: int, count: int) -> np.ndarray:
    """Elements [start, start + count) of `view` in C order as a 1-D array (a view when contiguous, else a copy)."""
    if count == 0:
        return np.empty(0, dtype=view.dtype)
    if view.ndim <= 1 or view.flags.c_contiguous:
        return view.reshape(-1)[start : start + count]
    inner = math.prod(view.shape[1:])
    row, rem = divmod(start, inner)
    pieces: list[np.ndarray] = []
    got = 0
    if rem:
        take = min(inner - rem, count)
        pieces.append(read_range(view[row], rem, take))
        got, row = take, row + 1
    num_full = (count - got) // inner
    if num_full:
        pieces.append(view[row : row + num_full].reshape(-1))  # strided block: reshape copies
        got, row = got + num_full * inner, row + num_full
    if got < count:
        pieces.append(read_range(view[row], 0, count - got))
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def contiguous_range(view: np.ndarray, start: int, count: int) -> np.ndarray | None:
    """Elements [start, start + count) of `view` as a writable 1-D view when the box is contiguous, else None."""
    if view.ndim <= 1 or view.flags.c_contiguous:
        return view.reshape(-1)[start : start + count]
    return None
