"""Chunk framing interoperates with stock protobuf, and XOR+zstd deltas round-trip or fail loudly."""

import numpy as np
import pytest
import zstandard

from protos import weight_sync_pb2 as pb
from weight_sync.codec import (
    DeltaError,
    decode_chunk,
    encode_chunk,
    sparse_decode,
    sparse_encode,
    sparse_payload,
    xor_decode,
    xor_encode,
)


def test_hand_framing_equals_protobuf_encoding_and_parses_back():
    header = pb.ChunkHeader(element_offset=5, num_elements=3, encoding=pb.ENCODING_RAW)
    header.shard.name = "w"
    header.shard.offsets.extend([1, 0])
    payload = bytes(range(6)) * 1000
    ours = encode_chunk(header, payload)
    assert pb.PushChunk.FromString(ours) == pb.PushChunk(header=header, payload=payload)
    assert ours == pb.PushChunk(header=header, payload=payload).SerializeToString()
    parsed, view = decode_chunk(ours)
    assert parsed == header and bytes(view) == payload


def test_other_field_orders_fall_back_to_a_full_parse():
    header = pb.ChunkHeader(element_offset=1, num_elements=2)
    reordered = pb.PushChunk(payload=b"abcd").SerializeToString() + pb.PushChunk(header=header).SerializeToString()
    parsed, view = decode_chunk(reordered)
    assert parsed == header and bytes(view) == b"abcd"
    with pytest.raises(ValueError, match="malformed"):
        decode_chunk(b"\x0a\xff\xff\xff")


def test_xor_delta_round_trips_and_skips_incompressible_chunks():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    new = base.copy()
    new[rng.choice(10_000, 300, replace=False)] ^= 0x0101
    scratch = np.empty(10_000, dtype=np.uint16)
    packed = xor_encode(new, base, zstandard.ZstdCompressor(level=1), scratch)
    assert packed is not None and len(packed) < new.nbytes / 5
    np.testing.assert_array_equal(xor_decode(memoryview(packed), base, zstandard.ZstdDecompressor()), new)
    noise = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    assert xor_encode(noise, base, zstandard.ZstdCompressor(level=1), scratch) is None


def test_delta_with_a_wrong_size_is_refused_before_decompressing():
    base = np.zeros(100, dtype=np.uint16)
    bomb = zstandard.ZstdCompressor().compress(bytes(10_000_000))
    with pytest.raises(DeltaError, match="announces"):
        xor_decode(memoryview(bomb), base, zstandard.ZstdDecompressor())
    with pytest.raises(DeltaError, match="zstd"):
        xor_decode(memoryview(b"not zstd at all"), base, zstandard.ZstdDecompressor())


def test_sparse_delta_round_trips_and_rejects_bad_indices():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2**16, 1000, dtype=np.uint16)
    new = base.copy()
    new[[3, 500, 999]] += 1
    idx, values = sparse_encode(new, base)
    assert idx.tolist() == [3, 500, 999]
    got_idx, got_values = sparse_decode(memoryview(sparse_payload(idx, values)), 1000, np.dtype(np.uint16))
    rebuilt = base.copy()
    rebuilt[got_idx] = got_values
    np.testing.assert_array_equal(rebuilt, new)
    assert sparse_encode(rng.integers(0, 2**16, 1000, dtype=np.uint16), base) is None  # dense change: send raw
    for bad in (
        sparse_payload(np.array([5, 5], np.uint32), values[:2]),
        sparse_payload(np.array([1000], np.uint32), values[:1]),
    ):
        with pytest.raises(DeltaError, match="strictly increasing"):
            sparse_decode(memoryview(bad), 1000, np.dtype(np.uint16))
    with pytest.raises(DeltaError, match="whole number"):
        sparse_decode(memoryview(b"12345"), 1000, np.dtype(np.uint16))
