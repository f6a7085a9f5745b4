"""Spreading shards over parallel streams covers every element once and balances bytes."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.chunking import Shard, as_local, plan_streams


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=6), st.integers(1, 5))
def test_plan_covers_each_local_element_exactly_once(shapes, num_streams):
    locals_ = [as_local(Shard(f"t{i}", torch.zeros(s), tuple(s), (0,) * len(s))) for i, s in enumerate(shapes)]
    groups = plan_streams(locals_, num_streams)
    assert len(groups) == num_streams
    for local in locals_:
        hits = np.zeros(local.values.shape[0], dtype=int)
        for group in groups:
            for piece in group:
                if piece.local is local:
                    a, b = piece.span
                    hits[a:b] += 1
        assert (hits == 1).all()


def test_one_big_tensor_is_cut_into_row_blocks_of_equal_size():
    big = as_local(Shard("embed", torch.zeros(100, 8), (300, 8), (200, 0)))
    small = as_local(Shard("norm", torch.zeros(8), (8,), (0,)))
    groups = plan_streams([big, small], 2)
    loads = [sum(p.nbytes for p in g) for g in groups]
    assert max(loads) - min(loads) <= 8 * 4 * 2  # within a couple of rows
