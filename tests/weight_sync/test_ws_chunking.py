"""Spreading shards over parallel streams covers every element once and balances bytes; deltas encode in parallel."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.chunking import (
    PIECE_BYTES,
    DeltaCoder,
    Piece,
    Shard,
    as_local,
    piece_chunks,
    plan_streams,
    stream_chunks,
)
from weight_sync.codec import sparse_decode
from weight_sync.feed import encoded


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


def test_threaded_delta_encoding_matches_sequential_and_updates_every_base():
    rng = np.random.default_rng(0)
    new = torch.from_numpy(rng.integers(0, 2**15, (64, 33), dtype=np.int16)).view(torch.bfloat16)
    local = as_local(Shard("w", new, (64, 33), (0, 0)))
    old = local.values.copy()
    old[rng.integers(0, old.size, 60)] ^= 1
    for encoding in ("sparse", "xor_zstd"):
        coder = DeltaCoder(encoding, 1)
        one_by_one = [coder.encode(c) for c in piece_chunks(Piece(local, 0, 64), old.copy(), 256)]
        base = old.copy()
        with ThreadPoolExecutor(4) as pool:
            ahead = list(encoded(piece_chunks(Piece(local, 0, 64), base, 256), coder, pool, depth=8))
        assert [c.header for c in ahead] == [c.header for c in one_by_one]
        assert [c.delta for c in ahead] == [c.delta for c in one_by_one]
        assert np.array_equal(base, local.values)  # every chunk's base slice brought up to date
        if encoding == "sparse":
            changed = sum(
                len(sparse_decode(memoryview(c.delta[1]), c.values.size, c.values.dtype)[0]) for c in ahead if c.delta
            )
            assert changed == np.count_nonzero(old != local.values)


def test_pieces_stay_under_the_piece_size_and_stream_chunks_carry_their_checksums():
    rows = (3 * PIECE_BYTES) // (256 * 4) + 5
    local = as_local(Shard("big", torch.randn(rows, 256), (rows, 256), (0, 0)))
    (group,) = plan_streams([local], 1)
    assert len(group) == 4 and all(p.nbytes <= PIECE_BYTES for p in group)
    with ThreadPoolExecutor(2) as pool:
        chunks = list(stream_chunks(group, {}, 1 << 20, pool))
    starts = [c for c in chunks if c.header.HasField("shard")]
    assert [c.header.shard.xxh3_64 for c in starts] == [xxhash.xxh3_64_intdigest(p.values.data) for p in group]
    assert sum(c.nbytes for c in chunks) == local.values.nbytes
