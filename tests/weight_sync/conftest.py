"""Fixtures for weight-sync tests: real receivers on loopback ports (stopped after each test)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from ws_helpers import tiny_state_dict, zeros_like_dict

from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.sink import StateDictSink


@pytest.fixture
def receivers() -> Iterator[Callable[..., list[tuple[WeightReceiver, StateDictSink]]]]:
    started: list[WeightReceiver] = []

    def make(n: int, config: WeightSyncConfig | None = None, sd: dict[str, torch.Tensor] | None = None):
        out = []
        for _ in range(n):
            sink = StateDictSink(zeros_like_dict(sd if sd is not None else tiny_state_dict()))
            receiver = WeightReceiver(sink, config or WeightSyncConfig(chunk_bytes=4096))
            receiver.start()
            started.append(receiver)
            out.append((receiver, sink))
        return out

    yield make
    for receiver in started:
        receiver.stop(grace_s=0)
