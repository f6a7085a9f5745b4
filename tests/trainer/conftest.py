"""Trainer tests: this folder holds `trainer_batches.py` (random rollout batches), imported by the tests below it, and
the one-rank process group that in-process engines need."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo process group on a free loopback port for the module's tests (use with `usefixtures`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
