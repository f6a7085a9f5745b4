"""Tensor specs and dtypes as they travel on the wire (no torch: numpy views of raw bytes)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_ITEMSIZE", "TensorSpec", "dtype_name", "element_dtype", "itemsize"]

# torch dtype names accepted on the wire -> bytes per element.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
_UINT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype as the wire, recipes and HF configs spell it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name; ValueError for names the wire does not carry."""
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPE_ITEMSIZE)}") from None


def element_dtype(dtype: str) -> np.dtype:
    """Unsigned numpy dtype with the same item size: bit patterns are moved and XORed, never interpreted."""
    return np.dtype(_UINT_BY_SIZE[itemsize(dtype)])


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor a sink accepts: HF-canonical `name`, global `shape`, torch dtype name (e.g. "bfloat16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.name:
            raise ValueError("TensorSpec.name must be a non-empty string")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"TensorSpec {self.name}: negative dimension in shape {self.shape}")
        itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)
