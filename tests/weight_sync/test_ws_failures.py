"""Every refusal has a precise gRPC status, nothing of a refused update is applied, and the next update succeeds."""

import os
import subprocess
import sys
import threading
import time
from functools import partial

import grpc
import pytest
import torch
import xxhash
from ws_helpers import begin, commit, raw_push, receiver_with_client, shard_messages, status_of

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.codec import decode_chunk, encode_chunk
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.sink import StateDictSink

C = grpc.StatusCode
SD = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": torch.arange(5, dtype=torch.int64)}


def wait_until(done, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.01)


def zeros():
    return {k: torch.zeros_like(v) for k, v in SD.items()}


def full_update(client, version, session="s", sd=SD):
    begin(client, sd, version, session)
    messages = [m for name, t in sd.items() for m in shard_messages(name, t, (0,) * t.dim(), chunk_elems=7)]
    raw_push(client, session, version, 0, messages)  # one stream per rank
    return commit(client, version, session)


@pytest.fixture
def one(receivers):
    with receiver_with_client(receivers, SD) as started:
        yield started


def assert_untouched(receiver, sink, version=0):
    assert receiver.policy_version == version
    if version == 0:
        assert all(torch.equal(sink.state_dict[k], torch.zeros_like(v)) for k, v in SD.items())


def test_corrupted_chunk_is_data_loss_and_nothing_applies(one, caplog):
    receiver, sink, client = one
    begin(client, SD, 1)
    messages = shard_messages("w", SD["w"], (0, 0), chunk_elems=7)
    header, payload = decode_chunk(messages[3])
    flipped = bytearray(payload)
    flipped[5] ^= 0x10
    messages[3] = encode_chunk(header, bytes(flipped))
    assert status_of(lambda: raw_push(client, "s", 1, 0, messages)) == C.DATA_LOSS
    # Said and counted where it happens (only a Commit after it told the operator before: a flaky link corrupting a
    # trainer's pushes was invisible).
    assert receiver.num_refused == 1
    assert any("dropped update s@1: rank 0's stream failed: DATA_LOSS" in r.getMessage() for r in caplog.records)
    assert status_of(lambda: commit(client, 1)) == C.NOT_FOUND  # the failed update was dropped
    assert receiver.num_refused == 1  # one update, counted once
    assert_untouched(receiver, sink)
    full_update(client, 2)
    assert receiver.policy_version == 2 and torch.equal(sink.state_dict["w"], SD["w"])


def test_precise_statuses_for_bad_begins(one):
    receiver, sink, client = one
    assert status_of(lambda: begin(client, {"nope": torch.zeros(2)}, 1)) == C.NOT_FOUND
    assert status_of(lambda: begin(client, {"w": torch.zeros(6, 9)}, 1)) == C.INVALID_ARGUMENT
    assert status_of(lambda: begin(client, {"w": torch.zeros(6, 8, dtype=torch.float16)}, 1)) == C.INVALID_ARGUMENT
    assert status_of(lambda: begin(client, SD, 1, rank=2, num_ranks=2)) == C.INVALID_ARGUMENT
    assert status_of(lambda: begin(client, SD, 0)) == C.FAILED_PRECONDITION  # not newer than 0
    assert status_of(lambda: raw_push(client, "s", 9, 0, [])) == C.NOT_FOUND  # no Begin
    assert_untouched(receiver, sink)


def test_precise_statuses_for_bad_shards(one):
    receiver, sink, client = one
    w = SD["w"]
    cases = [
        (shard_messages("w", w[:, :5], (0, 4)), C.OUT_OF_RANGE),  # 4 + 5 > 8
        (shard_messages("w", w, (0, 0), chunk_elems=7)[:-1], C.INVALID_ARGUMENT),  # stream ends inside a shard
        (shard_messages("w", w, (0, 0)) + shard_messages("w", w[:1], (0, 0)), C.INVALID_ARGUMENT),  # overlap
        (shard_messages("x", w, (0, 0)), C.NOT_FOUND),  # not in the manifest
        (shard_messages("w", w, (0, 0), chunk_elems=7)[1:], C.INVALID_ARGUMENT),  # no shard header first
        ([encode_chunk(pb.ChunkHeader(num_elements=1), b"\0" * 4)], C.INVALID_ARGUMENT),
        ([b"\x0a\x05garbage"], C.INVALID_ARGUMENT),
    ]
    version = 0
    for messages, code in cases:
        version += 1
        begin(client, SD, version)
        assert status_of(partial(raw_push, client, "s", version, 0, messages)) == code, messages[:1]
        assert_untouched(receiver, sink)
    version += 1
    begin(client, SD, version)
    big = WeightSyncConfig(chunk_bytes=4096).chunk_bytes  # the fixture receiver accepts 4096-byte chunks
    payload = b"\0" * (big + 4)
    header = pb.ChunkHeader(num_elements=(big + 4) // 4, shard=pb.ShardHeader(name="w", offsets=(0, 0), shape=(6, 8)))
    assert status_of(lambda: raw_push(client, "s", version, 0, [encode_chunk(header, payload)])) in (
        C.RESOURCE_EXHAUSTED, C.OUT_OF_RANGE)


def test_a_rank_may_not_open_more_streams_than_it_announced(one):
    receiver, sink, client = one
    begin(client, SD, 1)
    raw_push(client, "s", 1, 0, shard_messages("w", SD["w"], (0, 0)))
    assert status_of(lambda: raw_push(client, "s", 1, 0, shard_messages("b", SD["b"], (0,)))) == C.ALREADY_EXISTS
    assert status_of(lambda: commit(client, 1)) == C.FAILED_PRECONDITION  # b was never covered
    assert_untouched(receiver, sink)


def test_missing_coverage_fails_commit_and_keeps_the_old_version(one):
    receiver, sink, client = one
    full_update(client, 1)
    begin(client, SD, 2)
    raw_push(client, "s", 2, 0, shard_messages("w", SD["w"][:3] + 1, (0, 0)))  # half of w, none of b
    status = status_of(lambda: commit(client, 2))
    assert status == C.FAILED_PRECONDITION
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], SD["w"])
    full_update(client, 3)
    assert receiver.policy_version == 3


def test_wrong_or_missing_token_is_unauthenticated(receivers, caplog):
    config = WeightSyncConfig(auth_token="s3cret", chunk_bytes=4096)
    (receiver, sink), = receivers(1, config=config, sd=SD)
    for token in (None, "wrong", "s3cret-but-longer"):
        client = WeightSyncClient(receiver.address, WeightSyncConfig(auth_token=token, auth_token_env=None))
        assert status_of(client.describe) == C.UNAUTHENTICATED
        assert status_of(partial(begin, client, SD, 1)) == C.UNAUTHENTICATED
        assert status_of(partial(raw_push, client, "s", 1, 0, [])) == C.UNAUTHENTICATED
        client.close()
    good = WeightSyncClient(receiver.address, config)
    full_update(good, 1)
    assert receiver.policy_version == 1
    assert status_of(partial(begin, good, SD, 1)) == C.FAILED_PRECONDITION  # not newer
    # Refusals leave a line in the receiver's log, naming the peer (an operator saw no trace of them).
    refused = [r.getMessage() for r in caplog.records if r.name == "weight_sync.receiver"]
    assert sum("refused a call from" in m for m in refused) >= 9, refused
    assert any("refused Begin of version 1" in m and "not newer" in m for m in refused), refused


def test_refused_updates_are_counted_once_each(one):
    """`num_refused` counts updates, not calls: both ranks of a stale update refused at Begin count once; a refusal at
    Commit counts; a Commit turned away for now (a retry will be answered) and an applied update do not."""
    receiver, sink, client = one
    full_update(client, 2)
    assert receiver.num_refused == 0
    for rank in (0, 1):  # a trainer restarted from an older checkpoint: every rank's Begin is not newer
        assert status_of(partial(begin, client, SD, 1, rank=rank, num_ranks=2)) == C.FAILED_PRECONDITION
    assert receiver.num_refused == 1
    assert receiver.last_refusal == "s@1: FAILED_PRECONDITION: policy_version 1 is not newer than the current 2"
    begin(client, SD, 3)
    raw_push(client, "s", 3, 0, shard_messages("w", SD["w"], (0, 0)))  # b never covered
    assert status_of(lambda: commit(client, 3)) == C.FAILED_PRECONDITION
    assert status_of(lambda: commit(client, 3)) == C.FAILED_PRECONDITION  # the retry gets the same answer
    assert receiver.num_refused == 2 and receiver.last_refusal.startswith("s@3: FAILED_PRECONDITION: ")
    full_update(client, 4)
    assert receiver.num_refused == 2 and receiver.policy_version == 4
    begin(client, SD, 5, session="a")
    assert status_of(lambda: begin(client, SD, 6, session="b")) == C.ABORTED  # turned away for now: retried later
    client.abort(pb.AbortRequest(session_id="a", policy_version=5, reason="test"))
    full_update(client, 6, session="b")
    assert receiver.num_refused == 2 and receiver.policy_version == 6


def test_concurrent_update_is_refused_until_the_first_ends(one):
    receiver, sink, client = one
    begin(client, SD, 1, session="a")
    assert status_of(lambda: begin(client, SD, 2, session="b")) == C.ABORTED
    assert begin(client, SD, 1, session="a").update_id == "a@1"  # Begin is idempotent per (session, version)
    client.abort(pb.AbortRequest(session_id="a", policy_version=1, reason="test"))
    full_update(client, 2, session="b")
    assert receiver.policy_version == 2


def test_stale_update_is_replaced_after_the_idle_timeout(receivers):
    (receiver, sink), = receivers(1, config=WeightSyncConfig(update_idle_timeout_s=0.2), sd=SD)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    begin(client, SD, 1, session="dead")
    time.sleep(0.3)
    full_update(client, 2, session="alive")
    assert receiver.policy_version == 2


def test_an_update_open_past_any_push_deadline_gives_way_though_never_idle(receivers):
    """A token holder that keeps its update alive (here: idle never reached, as with a chunk now and then) held the
    receiver's one update slot for good against every session but the trainer's."""
    config = WeightSyncConfig(stream_idle_timeout_s=30, push_timeout_s=0.5, rpc_timeout_s=0.1)
    (receiver, sink), = receivers(1, config=config, sd=SD)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    begin(client, SD, 1, session="holder", num_ranks=2)  # waits for rank 1, which never comes
    try:
        begin(client, SD, 2, session="other")
        raise AssertionError("a young update was replaced")
    except grpc.RpcError as e:
        assert e.code() == C.ABORTED and "once it has been open 1 s" in (e.details() or "")
    time.sleep(0.7)
    full_update(client, 2, session="other")
    assert receiver.policy_version == 2


def test_sender_killed_mid_stream_leaves_the_old_version_and_the_next_update_succeeds(one):
    receiver, sink, client = one
    full_update(client, 1)
    big = {"w": SD["w"] + 100, "b": SD["b"]}
    # No torch in the child (importing it takes seconds here): numpy bytes of the same tensor.
    script = f"""
import os, time, numpy as np, xxhash
from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.codec import encode_chunk
from weight_sync.config import WeightSyncConfig
from weight_sync.relay import stream_metadata
client = WeightSyncClient({receiver.address!r}, WeightSyncConfig())
w = np.arange(48, dtype=np.float32) + 100
spec = pb.TensorSpec(name="w", shape=(6, 8), dtype="float32")
client.begin(pb.BeginRequest(session_id="s", policy_version=2, rank=0, num_ranks=1, tensors=[spec], base_version=-1))
shard = pb.ShardHeader(name="w", offsets=(0, 0), shape=(6, 8), xxh3_64=xxhash.xxh3_64_intdigest(w))
def chunks():
    for i in range(12):
        if i == 3:
            time.sleep(0.5)
            os._exit(17)  # killed mid-stream
        header = pb.ChunkHeader(element_offset=4 * i, num_elements=4, shard=shard if i == 0 else None)
        yield encode_chunk(header, w[4 * i : 4 * i + 4])
client.push(chunks(), metadata=stream_metadata("s", 2, 0, [], 0))
"""
    proc = subprocess.run([sys.executable, "-c", script], timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 17
    deadline = time.monotonic() + 10
    while status_of(lambda: begin(client, big, 3)) == C.ABORTED and time.monotonic() < deadline:
        time.sleep(0.05)  # until the receiver sees the broken stream
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], SD["w"])
    assert status_of(lambda: commit(client, 2)) == C.NOT_FOUND
    raw_push(client, "s", 3, 0, [m for name, t in big.items() for m in shard_messages(name, t, (0,) * t.dim())])
    commit(client, 3)
    assert receiver.policy_version == 3 and torch.equal(sink.state_dict["w"], big["w"])


def test_cancelled_stream_aborts_the_update(one):
    receiver, sink, client = one
    begin(client, SD, 1)
    gate = threading.Event()

    def chunks():
        yield from shard_messages("w", SD["w"], (0, 0), chunk_elems=4)[:2]
        gate.wait(10)

    from weight_sync.relay import stream_metadata

    future = client.push.future(chunks(), metadata=stream_metadata("s", 1, 0, [], 0))
    # No Commit may probe before the receiver has seen the cancellation: a Commit of an update whose stream still runs
    # drops it itself (FAILED_PRECONDITION, remembered for repeats), which is not what this test is about.
    wait_until(lambda: any(w.bytes_received for w in list(receiver._grpc_writers)), "the stream to reach the receiver")
    future.cancel()
    gate.set()
    wait_until(lambda: not receiver._grpc_writers, "the receiver to end the cancelled stream")
    assert status_of(lambda: commit(client, 1)) == C.NOT_FOUND
    full_update(client, 2)
    assert receiver.policy_version == 2


class RejectingSink(StateDictSink):
    def __init__(self, sd, error):
        super().__init__(sd)
        self.error = error

    def apply(self, policy_version, tensors):
        if self.error is not None:
            raise self.error
        super().apply(policy_version, tensors)


def test_sink_rejection_keeps_the_old_version():
    for error, code in (
        (ValueError("fused group incomplete"), C.INVALID_ARGUMENT),
        (RuntimeError("engine died"), C.INTERNAL),
    ):
        sink = RejectingSink(zeros(), error)
        receiver = WeightReceiver(sink, WeightSyncConfig())
        receiver.start()
        client = WeightSyncClient(receiver.address, WeightSyncConfig())
        assert status_of(partial(full_update, client, 1)) == code
        assert receiver.policy_version == 0
        sink.error = None
        full_update(client, 2)
        assert receiver.policy_version == 2
        client.close()
        receiver.stop(0)


class SlowSink(StateDictSink):
    def apply(self, policy_version, tensors):
        time.sleep(1.0)  # an engine finishing its generation batch
        super().apply(policy_version, tensors)


def test_slow_apply_is_tolerated_and_blocks_other_updates_meanwhile():
    receiver = WeightReceiver(SlowSink(zeros()), WeightSyncConfig())
    receiver.start()
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("reply", full_update(client, 1)))
    worker.start()
    time.sleep(0.5)
    assert status_of(lambda: begin(client, SD, 2, session="other")) == C.ABORTED
    worker.join()
    assert result["reply"].policy_version == 1 and receiver.policy_version == 1
    client.close()
    receiver.stop(0)


def test_watch_version_streams_each_new_version(one):
    receiver, sink, client = one
    events = client.watch(pb.WatchVersionRequest(after_version=0), timeout=10, metadata=client.metadata)
    full_update(client, 1)
    assert next(events).policy_version == 1
    full_update(client, 4)
    assert next(events).policy_version == 4
    events.cancel()


def test_non_loopback_bind_without_tls_and_token_is_refused():
    receiver = WeightReceiver(StateDictSink(zeros()), WeightSyncConfig(bind_host="0.0.0.0"))
    with pytest.raises(ValueError, match="not loopback"):
        receiver.start()


def _sparse_update(client, version, base_version, new_w, base_w, checksum_of=None):
    from weight_sync.codec import sparse_encode, sparse_payload

    client.begin(pb.BeginRequest(session_id="s", policy_version=version, rank=0, num_ranks=1,
                                 tensors=[pb.TensorSpec(name="w", shape=(6, 8), dtype="float32")],
                                 base_version=base_version))
    new_bits = new_w.reshape(-1).view(torch.int32).numpy().view("u4")
    base_bits = base_w.reshape(-1).view(torch.int32).numpy().view("u4")
    idx, values = sparse_encode(new_bits, base_bits)
    target = (checksum_of if checksum_of is not None else new_w).reshape(-1).view(torch.int32).numpy()
    shard = pb.ShardHeader(name="w", offsets=(0, 0), shape=(6, 8), xxh3_64=xxhash.xxh3_64_intdigest(target))
    header = pb.ChunkHeader(num_elements=48, encoding=pb.ENCODING_SPARSE, shard=shard)
    raw_push(client, "s", version, 0, [encode_chunk(header, sparse_payload(idx, values))])
    return commit(client, version)


def test_delta_is_verified_by_the_checksum_of_the_result(one):
    receiver, sink, client = one
    full_update(client, 1)
    new_w = SD["w"].clone()
    new_w[2, 3], new_w[1, 1] = -1.0, 5.0
    assert status_of(lambda: _sparse_update(client, 2, 0, new_w, SD["w"])) == C.FAILED_PRECONDITION  # stale base
    assert receiver.policy_version == 1
    wrong_base = SD["w"].clone()
    wrong_base[1, 1] = 5.0  # the sender believes in another base: the decoded result misses its checksum
    assert status_of(lambda: _sparse_update(client, 2, 1, new_w, wrong_base, checksum_of=new_w)) == C.DATA_LOSS
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], SD["w"])
    _sparse_update(client, 2, 1, new_w, SD["w"])
    assert receiver.policy_version == 2 and torch.equal(sink.state_dict["w"], new_w)


def test_a_taken_port_is_named_with_the_option_to_change():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        receiver = WeightReceiver(StateDictSink(dict(SD)), WeightSyncConfig(port=port))
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port}.*choose another `port`"):
            receiver.start()
