"""Shard geometry: chunks of any N-d box land exactly where torch slicing says, for any offsets and chunking."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.layout import (
    add_box_corners,
    box_error,
    read_range,
    shard_view,
    tiles_exactly,
    write_range,
)


@st.composite
def box_and_chunks(draw):
    ndim = draw(st.integers(0, 4))
    global_shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    offsets, shape = [], []
    for full in global_shape:
        off = draw(st.integers(0, full - 1))
        offsets.append(off)
        shape.append(draw(st.integers(1, full - off)))
    numel = int(np.prod(shape)) if shape else 1
    cuts = sorted(set(draw(st.lists(st.integers(1, max(numel - 1, 1)), max_size=6))) - {numel})
    return global_shape, tuple(offsets), tuple(shape), [0, *cuts, numel]


@settings(max_examples=300, deadline=None)
@given(box_and_chunks())
def test_write_and_read_ranges_match_numpy_slicing(case):
    global_shape, offsets, shape, cuts = case
    numel = int(np.prod(shape)) if shape else 1
    values = np.arange(1, numel + 1, dtype=np.uint16)
    flat = np.zeros(int(np.prod(global_shape)) if global_shape else 1, dtype=np.uint16)
    view = shard_view(flat, global_shape, offsets, shape)
    for start, stop in zip(cuts, cuts[1:]):
        write_range(view, start, values[start:stop])
    expected = np.zeros(global_shape, dtype=np.uint16)
    expected[tuple(slice(o, o + s) for o, s in zip(offsets, shape))] = values.reshape(shape)
    np.testing.assert_array_equal(flat.reshape(global_shape), expected)
    for start, stop in zip(cuts, cuts[1:]):
        np.testing.assert_array_equal(read_range(view, start, stop - start), values[start:stop])


def test_box_errors_name_the_problem():
    assert box_error((4, 4), (0, 0), (4, 4)) is None
    assert "dim 1" in box_error((4, 4), (0, 2), (4, 3))
    assert "dims" in box_error((4, 4), (0,), (4,))
    assert "outside" in box_error((4,), (-1,), (2,))
    assert "empty" in box_error((4,), (1,), (0,))
    assert box_error((), (), ()) is None


@st.composite
def boxes_in_a_tensor(draw):
    ndim = draw(st.integers(0, 3))
    global_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        offsets = tuple(draw(st.integers(0, full - 1)) for full in global_shape)
        shape = tuple(draw(st.integers(1, full - off)) for off, full in zip(offsets, global_shape))
        boxes.append((offsets, shape))
    if draw(st.booleans()):  # an exact grid tiling, the common case
        cuts = [sorted({0, full, *draw(st.lists(st.integers(1, full), max_size=2))}) for full in global_shape]
        boxes = [(tuple(a for a, _ in box), tuple(b - a for a, b in box))
                 for box in itertools.product(*[list(zip(c, c[1:])) for c in cuts])]
    return global_shape, boxes


@settings(max_examples=400, deadline=None)
@given(boxes_in_a_tensor())
def test_corner_sums_say_exactly_when_boxes_tile_the_tensor(case):
    global_shape, boxes = case
    count = np.zeros(global_shape, dtype=np.int64)
    corners: dict = {}
    for offsets, shape in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(offsets, shape))] += 1
        add_box_corners(corners, offsets, shape)
    assert tiles_exactly(corners, global_shape) == bool((count == 1).all())
