"""The engine's errors that other processes catch, importable without vLLM (the driver never imports it)."""

from __future__ import annotations

__all__ = ["EngineBrokenError"]


class EngineBrokenError(RuntimeError):
    """An update failed after loading had begun; the engine may hold a mix of versions and must be replaced."""
