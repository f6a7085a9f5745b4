"""Which receivers get delta pushes: `delta = true` (all that hold the base), `false` (none) or `"auto"` (measured).

A delta push compares every element with the previous version, so it can never go faster than the sender compares,
however few bytes it sends; a full push goes at the link's rate. With `"auto"` a receiver gets deltas only while its
link is measured slower than that: each full push measures each receiver's link (bytes over the time its streams spent
handing them to the transport) and each delta push its effective rate (model bytes over its streams' time), and the
next push to that receiver is a delta only when the expected delta rate beats the link by `MARGIN`. Before any delta
was measured the expected rate is the compare rate of this sender, timed once on its own shards. On loopback and fast
links that keeps full pushes (and no base copies on either side of them); on a 1-10 Gb/s link deltas take over.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Literal

import numpy as np

from weight_sync.codec import sparse_encode

__all__ = ["DeltaPolicy", "LinkSample"]

MARGIN = 1.25  # a delta must be expected this much faster than a full push: it doubles base memory on both ends
CALIBRATION_BYTES = 8 << 20  # bytes of the sender's own shards compared once to estimate its compare rate


@dataclasses.dataclass(frozen=True)
class LinkSample:
    """What one push measured of one receiver's streams: payload (model) bytes, bytes that went on the wire, seconds
    spent handing them to the transport (the link's pace), seconds from opening to the answer, and whether it was a
    delta push."""

    payload_bytes: int
    wire_bytes: int
    send_s: float
    stream_s: float
    delta: bool


@dataclasses.dataclass
class _Receiver:
    link_bps: float | None = None  # wire bytes per second the link took
    delta_bps: float | None = None  # model bytes per second of the last delta push


class DeltaPolicy:
    """Per-receiver choice between delta and full pushes for one sender (see the module docstring)."""

    def __init__(self, mode: bool | Literal["auto"], compare_bps: float | None = None) -> None:
        self.mode = mode
        self._compare_bps = compare_bps
        self._receivers: dict[str, _Receiver] = {}

    @property
    def enabled(self) -> bool:
        """Whether any push may be a delta (so bases are worth keeping, subject to `keeps_base`)."""
        return self.mode is not False

    def use_delta(self, address: str) -> bool:
        """Whether the next push to `address` should be a delta (where the receiver holds the base)."""
        if self.mode != "auto":
            return bool(self.mode)
        state = self._receivers.get(address)
        if state is None or state.link_bps is None:
            return False  # not measured yet: the first push is full anyway (no base on either side)
        expected = state.delta_bps if state.delta_bps is not None else self._compare_bps
        return expected is not None and expected > MARGIN * state.link_bps

    def wants_base(self, address: str) -> bool:
        """Whether `address` should keep the version being pushed as a delta base (`BeginRequest.drop_base` is its
        negation): with "auto", when its next push may be a delta or its link is not measured yet."""
        if self.mode != "auto":
            return bool(self.mode)
        state = self._receivers.get(address)
        return state is None or state.link_bps is None or self.use_delta(address)

    def keeps_base(self, addresses: list[str]) -> bool:
        """Whether the sender should keep this version as a delta base for pushes to `addresses`."""
        return any(self.use_delta(a) for a in addresses)

    def record(self, address: str, sample: LinkSample) -> None:
        """Account one push to `address`."""
        state = self._receivers.setdefault(address, _Receiver())
        if sample.delta:  # its few bytes fit in socket buffers without waiting for the link: only the effective rate
            if sample.stream_s > 0:
                state.delta_bps = sample.payload_bytes / sample.stream_s
        elif sample.send_s > 0 and sample.wire_bytes > 0:
            state.link_bps = sample.wire_bytes / sample.send_s

    def calibrate(self, values: list[np.ndarray]) -> None:
        """Time the delta compare once on up to `CALIBRATION_BYTES` of `values` (flat element arrays), unless a rate
        was given or measured before."""
        if self._compare_bps is not None or self.mode != "auto":
            return
        sample, nbytes = [], 0
        for v in values:
            take = v[: max(1, (CALIBRATION_BYTES - nbytes) // max(v.itemsize, 1))]
            sample.append(take)
            nbytes += take.nbytes
            if nbytes >= CALIBRATION_BYTES:
                break
        if nbytes == 0:
            return
        bases = [v.copy() for v in sample]
        start = time.perf_counter()
        for new, old in zip(sample, bases, strict=True):
            sparse_encode(new, old)
        self._compare_bps = nbytes / max(time.perf_counter() - start, 1e-9)

    def describe(self, address: str) -> str:
        """One line on what was measured of `address` and what the next push will be."""
        state = self._receivers.get(address, _Receiver())
        link = f"{state.link_bps / 1e9:.2f} GB/s" if state.link_bps else "unmeasured"
        expected = state.delta_bps or self._compare_bps
        delta = f"{expected / 1e9:.2f} GB/s" if expected else "unmeasured"
        return f"link {link}, delta {delta}: next push {'delta' if self.use_delta(address) else 'full'}"
