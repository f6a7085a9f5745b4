"""The TPU's vector layout as the Pallas kernels tile for it."""

from __future__ import annotations

__all__ = ["LANES"]

LANES = 128
"""Lanes of a TPU vector register: a block's last dimension is a multiple of it (or the whole dimension), and kernels
keep per-row statistics broadcast over one lane row."""
