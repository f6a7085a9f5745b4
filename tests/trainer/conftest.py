"""Trainer tests: this folder holds `trainer_batches.py` (random rollout batches) and `spawn_helpers.py` (the
weights and shards of spawned process groups, and how their ranks end), imported by the tests below it, and the
one-rank process group that in-process engines need."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from common.net import free_port


@pytest.fixture(scope="module")
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo process group on a free loopback port for the module's tests (use with `usefixtures`)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
