"""Property-based fuzzing of manifests, shard tilings, chunking and corruptions against a real receiver.

Property: the receiver never crashes (it answers Describe afterwards), a clean update always applies exactly, and
whatever a mutated update does, the sink either holds exactly the pushed values (the mutation was harmless, e.g. a
reordering of whole shards) or is untouched with the old policy_version.
"""

import itertools
import math

import grpc
import numpy as np
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.codec import encode_chunk
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.relay import stream_metadata
from weight_sync.sink import StateDictSink
from weight_sync.spec import element_dtype

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int8": torch.int8,
}
MUTATIONS = ["none", "drop_shard", "duplicate_shard", "shift_offset", "flip_byte", "bad_checksum", "truncate",
             "swap_chunks", "garbage", "wrong_count", "bad_shape"]


@st.composite
def updates(draw):
    tensors = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
        tensors[f"t{i}"] = (shape, draw(st.sampled_from(sorted(DTYPES))))
    num_ranks = draw(st.integers(1, 2))
    shards = []  # (rank, name, offsets, shape)
    for name, (shape, _) in tensors.items():
        cuts = [sorted({0, size, *draw(st.lists(st.integers(1, size), max_size=2))}) for size in shape]
        for box in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
            offsets = tuple(a for a, _ in box)
            sizes = tuple(b - a for a, b in box)
            shards.append((draw(st.integers(0, num_ranks - 1)), name, offsets, sizes))
    chunk_elems = draw(st.integers(1, 6))
    mutation = draw(st.sampled_from(MUTATIONS))
    return tensors, num_ranks, shards, chunk_elems, mutation, draw(st.integers(0, 2**31)), draw(st.integers(0, 10**6))


def build_streams(tensors, num_ranks, shards, chunk_elems, values):
    streams = {r: [] for r in range(num_ranks)}
    for rank, name, offsets, sizes in shards:
        shape = tensors[name][0]
        local = values[name].reshape(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
        local = np.ascontiguousarray(local)
        header = pb.ShardHeader(name=name, offsets=offsets, shape=sizes, xxh3_64=xxhash.xxh3_64_intdigest(local))
        for begin in range(0, local.shape[0], chunk_elems):
            piece = local[begin : begin + chunk_elems]
            chunk = pb.ChunkHeader(element_offset=begin, num_elements=piece.shape[0])
            if begin == 0:
                chunk.shard.CopyFrom(header)
            streams[rank].append([chunk, piece.tobytes()])
    return streams


def mutate(streams, mutation, pick):
    flat = [(r, i) for r, msgs in streams.items() for i in range(len(msgs))]
    firsts = [(r, i) for r, i in flat if streams[r][i][0].HasField("shard")]
    if mutation == "none" or not flat:
        return
    r, i = flat[pick % len(flat)]
    fr, fi = firsts[pick % len(firsts)]
    chunk, payload = streams[r][i]
    if mutation == "drop_shard":
        msgs = streams[fr]
        end = next((j for j in range(fi + 1, len(msgs)) if msgs[j][0].HasField("shard")), len(msgs))
        del msgs[fi:end]
    elif mutation == "duplicate_shard":
        streams[fr].append(list(streams[fr][fi]))
    elif mutation == "shift_offset":
        shard = streams[fr][fi][0].shard
        if len(shard.offsets):
            shard.offsets[pick % len(shard.offsets)] += 1 if pick % 2 else -1
        else:
            shard.offsets.append(0)
    elif mutation == "flip_byte":
        data = bytearray(payload)
        data[pick % len(data)] ^= 1 << (pick % 8)
        streams[r][i][1] = bytes(data)
    elif mutation == "bad_checksum":
        streams[fr][fi][0].shard.xxh3_64 ^= 1 << (pick % 64)
    elif mutation == "truncate":
        streams[r][:] = streams[r][:i]
    elif mutation == "swap_chunks":
        r2, j = flat[(pick // 7) % len(flat)]
        streams[r][i], streams[r2][j] = streams[r2][j], streams[r][i]
    elif mutation == "garbage":
        streams[r][i] = [None, bytes([pick % 256]) * (pick % 17)]
    elif mutation == "wrong_count":
        chunk.num_elements += 1 if pick % 2 else -1
    elif mutation == "bad_shape":
        shard = streams[fr][fi][0].shard
        shard.shape.append(1)


def to_bits(t: torch.Tensor) -> np.ndarray:
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(as_int).numpy().reshape(-1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(updates())
def test_receiver_never_crashes_and_never_applies_bad_data(case):
    tensors, num_ranks, shards, chunk_elems, mutation, seed, pick = case
    rng = np.random.default_rng(seed)
    values = {
        name: rng.integers(0, 2**63, math.prod(shape), dtype=np.uint64).astype(element_dtype(dtype))
        for name, (shape, dtype) in tensors.items()
    }
    old = {name: torch.zeros(shape, dtype=DTYPES[dtype]) for name, (shape, dtype) in tensors.items()}
    sink = StateDictSink({k: v.clone() for k, v in old.items()})
    receiver = WeightReceiver(sink, WeightSyncConfig(chunk_bytes=64))
    receiver.start()
    client = WeightSyncClient(receiver.address, WeightSyncConfig(num_retries=0))
    try:
        streams = build_streams(tensors, num_ranks, shards, chunk_elems, values)
        mutate(streams, mutation, pick)
        ok = True
        try:
            for rank in range(num_ranks):
                specs = [pb.TensorSpec(name=n, shape=s, dtype=d) for n, (s, d) in tensors.items()]
                client.begin(pb.BeginRequest(session_id="f", policy_version=1, rank=rank, num_ranks=num_ranks,
                                             tensors=specs, base_version=-1))
            for rank, msgs in streams.items():
                raw = [m[1] if m[0] is None else encode_chunk(m[0], m[1]) for m in msgs]
                client.push(iter(raw), timeout=10, metadata=client.metadata + stream_metadata("f", 1, rank, [], 0))
            client.commit(pb.CommitRequest(session_id="f", policy_version=1))
        except grpc.RpcError as e:
            assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE), e.details()
            ok = False
        if mutation == "none":
            assert ok, "a clean update must apply"
        elif mutation != "swap_chunks":
            assert not ok, f"mutation {mutation} must be refused"
        assert client.describe().policy_version == (1 if ok else 0)  # still serving
        for name in tensors:
            expected = values[name] if ok else to_bits(old[name]).view(values[name].dtype)
            np.testing.assert_array_equal(to_bits(sink.state_dict[name]).view(values[name].dtype), expected)
    finally:
        client.close()
        receiver.stop(0)
