"""Issue 15 (items 1, 3, 4, 5): the receiver keeps its promises against any client, not only against our sender.

One regression test per finding: a duplicate Commit finishing late with a blocking sink, concurrent Commits, a
restarted `serve` that must not roll back, an empty update and a version jump that would burn the version space,
staging memory after 30 abandoned updates, the shard-overlap check's cost in shards, relays nobody announced.
Every client here talks to loopback only and is bounded in count and time.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file
from ws_helpers import (
    LoopbackListener,
    begin,
    commit,
    raw_push,
    receiver_with_client,
    shard_messages,
    spec_msgs,
    status_of,
)

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.relay import stream_metadata
from weight_sync.sender import Shard, WeightSender
from weight_sync.sink import SafetensorsDirSink, StateDictSink
from weight_sync.staging import StagingArea

C = grpc.StatusCode
SD = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": torch.arange(5, dtype=torch.int64)}


def values(version: int) -> dict[str, torch.Tensor]:
    return {k: v + 100 * version for k, v in SD.items()}


def stage(client: WeightSyncClient, version: int, sd: dict[str, torch.Tensor], session: str = "s") -> None:
    """Begin + push one whole update (one stream), leaving it ready for Commit."""
    begin(client, sd, version, session)
    raw_push(client, session, version, 0, [m for n, t in sd.items() for m in shard_messages(n, t, (0,) * t.dim())])


class GatedSink(StateDictSink):
    """A sink whose apply of a gated version blocks until the test opens that call's gate (an engine waiting for its
    generation batch); records every call."""

    def __init__(self, sd: dict[str, torch.Tensor], gated: set[int]) -> None:
        super().__init__(sd)
        self.gated = gated
        self.calls: list[tuple[int, threading.Event]] = []
        self.changed = threading.Condition()

    def apply(self, policy_version, tensors):
        gate = threading.Event()
        with self.changed:
            self.calls.append((policy_version, gate))
            self.changed.notify_all()
        if policy_version in self.gated:
            assert gate.wait(30), "test never opened the gate"
        super().apply(policy_version, tensors)

    def wait_calls(self, n: int, timeout_s: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= n, timeout_s), f"{len(self.calls)} calls, not {n}"

    def open_all(self) -> None:
        for _, gate in self.calls:
            gate.set()


@pytest.fixture
def gated():
    started = []

    def make(gates: set[int]) -> tuple[WeightReceiver, GatedSink, WeightSyncClient]:
        sink = GatedSink({k: torch.zeros_like(v) for k, v in SD.items()}, gates)
        receiver = WeightReceiver(sink, WeightSyncConfig(chunk_bytes=4096))
        receiver.start()
        client = WeightSyncClient(receiver.address, WeightSyncConfig(commit_timeout_s=60))
        started.append((receiver, sink, client))
        return receiver, sink, client

    yield make
    for receiver, sink, client in started:
        sink.open_all()
        client.close()
        receiver.stop(0)


def _in_thread(fn, results: list, index: int) -> threading.Thread:
    def run() -> None:
        try:
            results[index] = fn()
        except grpc.RpcError as e:
            results[index] = e.code()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- 1(a): exactly one apply per update, idempotent answers ----------------------------------------------------------
def test_eight_concurrent_commits_apply_once_and_all_get_the_same_answer(gated):
    receiver, sink, client = gated({1})
    stage(client, 1, values(1))
    replies: list = [None] * 8
    threads = [_in_thread(lambda: commit(client, 1), replies, i) for i in range(8)]
    sink.wait_calls(1)
    time.sleep(0.5)  # every Commit has arrived: before the fix each ran sink.apply again
    sink.open_all()
    for thread in threads:
        thread.join(30)
    assert [v for v, _ in sink.calls] == [1], f"sink.apply ran {len(sink.calls)} times for one update"
    assert all(isinstance(r, pb.CommitReply) and r.policy_version == 1 for r in replies), replies
    assert commit(client, 1).policy_version == 1  # a repeat after the fact: same answer, nothing applied again
    assert len(sink.calls) == 1 and receiver.policy_version == 1


def test_a_duplicate_commit_finishing_late_never_rolls_back_a_newer_version(gated):
    receiver, sink, client = gated({1})
    stage(client, 1, values(1))
    first, duplicate = [None], [None]
    a = _in_thread(lambda: commit(client, 1), first, 0)
    sink.wait_calls(1)
    b = _in_thread(lambda: commit(client, 1), duplicate, 0)
    time.sleep(0.5)  # the duplicate is in: before the fix it was blocked in a second apply of v1
    sink.calls[0][1].set()  # the first apply of v1 ends
    a.join(30)
    assert isinstance(first[0], pb.CommitReply) and receiver.policy_version == 1
    stage(client, 2, values(2))
    assert commit(client, 2).policy_version == 2
    sink.open_all()  # whatever else was blocked finishes now, after v2 was acknowledged
    b.join(30)
    assert isinstance(duplicate[0], pb.CommitReply), duplicate
    assert receiver.policy_version == 2 and sink.policy_version == 2
    assert all(torch.equal(sink.state_dict[k], v) for k, v in values(2).items()), "the sink went back to v1"
    assert [v for v, _ in sink.calls] == [1, 2]


def test_a_failed_commit_is_answered_alike_when_repeated(one_receiver):
    receiver, sink, client = one_receiver
    begin(client, SD, 1)
    raw_push(client, "s", 1, 0, shard_messages("w", SD["w"], (0, 0)))  # b never pushed
    assert status_of(lambda: commit(client, 1)) == C.FAILED_PRECONDITION
    assert status_of(lambda: commit(client, 1)) == C.FAILED_PRECONDITION  # not NOT_FOUND: the same answer
    assert receiver.policy_version == 0


@pytest.fixture
def one_receiver(receivers):
    with receiver_with_client(receivers, SD) as started:
        yield started


# -- 1(b): a restarted receiver starts at its sink's committed version ----------------------------------------------
def _push_dir(address: str, version: int, sd: dict[str, torch.Tensor]) -> dict[str, str | None]:
    with WeightSender([address], WeightSyncConfig(num_retries=0)) as sender:
        report = sender.push(version, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in sd.items()])
        assert not report.failed, report.failed
        return sender.commit(version)


def test_a_restarted_receiver_keeps_its_checkpoints_version_and_refuses_older_ones(tmp_path):
    save_file({k: torch.zeros_like(v) for k, v in SD.items()}, str(tmp_path / "model.safetensors"))
    first = WeightReceiver(SafetensorsDirSink(str(tmp_path)), WeightSyncConfig())
    assert first.policy_version == 0  # an HF checkpoint this sink never wrote
    first.start()
    assert not any(_push_dir(first.address, 5, values(5)).values())
    first.stop(0)

    restarted = WeightReceiver(SafetensorsDirSink(str(tmp_path)), WeightSyncConfig())
    restarted.start()
    client = WeightSyncClient(restarted.address, WeightSyncConfig(num_retries=0))
    try:
        assert restarted.policy_version == 5 and client.describe().policy_version == 5
        for older in (1, 5):
            assert status_of(lambda older=older: begin(client, SD, older)) == C.FAILED_PRECONDITION
        got = load_file(str(tmp_path / "model.safetensors"))
        assert all(torch.equal(got[k], v) for k, v in values(5).items()), "a refused version touched the checkpoint"
        assert not any(_push_dir(restarted.address, 6, values(6)).values())
        assert restarted.policy_version == 6
    finally:
        client.close()
        restarted.stop(0)


def test_the_directory_sink_reports_its_version_from_the_file_it_keeps(tmp_path):
    save_file({"a": torch.zeros(3)}, str(tmp_path / "model-1.safetensors"))
    sink = SafetensorsDirSink(str(tmp_path))
    assert sink.committed_version() == 0
    sink.apply(7, {"a": torch.ones(3)})
    assert SafetensorsDirSink(str(tmp_path)).committed_version() == 7
    (tmp_path / "model.safetensors").unlink()  # no checkpoint of ours: the version file alone still counts
    save_file({"a": torch.zeros(3)}, str(tmp_path / "model-1.safetensors"))
    assert SafetensorsDirSink(str(tmp_path)).committed_version() == 7
    (tmp_path / "policy_version.json").write_text('{"policy_version": "x"}')
    with pytest.raises(ValueError, match="policy_version"):
        WeightReceiver(SafetensorsDirSink(str(tmp_path)))


def test_serve_restarted_on_its_directory_starts_at_the_pushed_version(tmp_path, capsys):
    from weight_sync.__main__ import main

    served = tmp_path / "served"
    served.mkdir()
    save_file({k: torch.zeros_like(v) for k, v in SD.items()}, str(served / "model.safetensors"))

    def serve() -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weight_sync", "serve", "--dir", str(served), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        line = proc.stdout.readline()
        assert line.startswith("serving"), line
        return proc, line.split()[-1]

    proc, address = serve()
    try:
        assert not any(_push_dir(address, 5, values(5)).values())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, address = serve()
    try:
        assert main(["describe", "--to", address]) == 0
        assert "policy_version 5" in capsys.readouterr().out
        client = WeightSyncClient(address, WeightSyncConfig(num_retries=0))
        assert status_of(lambda: begin(client, SD, 1)) == C.FAILED_PRECONDITION  # accepted v1 before the fix
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- 1(c): no empty updates, no version jumps that burn the version space -------------------------------------------
def test_an_empty_update_and_a_version_jump_are_refused_and_the_version_space_survives(one_receiver):
    receiver, sink, client = one_receiver
    for version in (1, 2**63 - 1):  # Begin with no tensors, an empty stream, Commit: accepted before the fix
        try:
            client.begin(pb.BeginRequest(session_id="x", policy_version=version, rank=0, num_ranks=1, base_version=-1))
        except grpc.RpcError as e:
            assert e.code() == (C.OUT_OF_RANGE if version > 1 else C.INVALID_ARGUMENT), e.details()
            continue
        status_of(lambda version=version: raw_push(client, "x", version, 0, []))
        assert status_of(lambda version=version: commit(client, version, session="x")) == C.FAILED_PRECONDITION
    assert receiver.policy_version == 0, "an update without tensors moved the version"
    for version in (2**63 - 1, 2**53, (1 << 20) + 1):  # far past the current 0: OUT_OF_RANGE at Begin
        assert status_of(lambda version=version: begin(client, SD, version)) == C.OUT_OF_RANGE
    stage(client, 1, values(1))
    assert commit(client, 1).policy_version == 1
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], values(1)["w"])


# -- 3: bounded memory whatever clients do ----------------------------------------------------------------------------
def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _frame(message) -> bytes:
    data = message.SerializeToString()
    return struct.pack("<I", len(data)) + data


def test_thirty_abandoned_updates_leave_staging_memory_where_one_left_it(receivers):
    big = {"w": torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024)}  # 8 MiB
    model_bytes = 8 << 20
    (receiver, _), = receivers(1, config=WeightSyncConfig(chunk_bytes=1 << 20), sd=big)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    port = client.describe().data_port
    flat = big["w"].numpy().reshape(-1)
    shard = pb.ShardHeader(name="w", offsets=(0, 0), shape=(2048, 1024), xxh3_64=xxhash.xxh3_64_intdigest(flat))
    frames = []
    for i, start in enumerate(range(0, flat.size * 3 // 4, 1 << 18)):  # 3/4 of the model, 1 MiB chunks
        header = pb.ChunkHeader(element_offset=start, num_elements=1 << 18, shard=shard if i == 0 else None)
        head = header.SerializeToString()
        payload = flat[start : start + (1 << 18)].tobytes()
        frames.append(struct.pack("<I", len(head)) + head + struct.pack("<Q", len(payload)) + payload)
    body = b"".join(frames)
    sockets: list[socket.socket] = []
    measured = {}
    try:
        for round_ in range(1, 31):
            reply = begin(client, big, 1, session=f"s{round_}")
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sockets.append(sock)
            hello = pb.DataHello(session_id=f"s{round_}", policy_version=1, rank=0, ticket=reply.data_ticket)
            sock.sendall(_frame(hello))
            sock.sendall(body)  # most of the model, then silence with the socket held open (no 6 MiB concatenation)
            time.sleep(0.05)  # the receiver reads what was sent into its staging buffer
            client.abort(pb.AbortRequest(session_id=f"s{round_}", policy_version=1, reason="abandoned"))
            if round_ in (1, 30):
                time.sleep(0.3)
                measured[round_] = _rss_bytes()
        growth = measured[30] - measured[1]
        assert growth < model_bytes, f"RSS grew {growth / 2**20:.0f} MiB over 29 abandoned updates (model: 8 MiB)"
        area = receiver.area
        assert area.staging_bytes <= area.staging_bound_bytes == 2 * model_bytes
    finally:
        for sock in sockets:
            sock.close()
    assert not any(_push_dir(receiver.address, 1, big).values())  # and a real update still goes through
    assert receiver.area.staging_bytes <= 2 * model_bytes


def test_abandoned_grpc_push_streams_give_their_staging_memory_back(receivers):
    """The same on the gRPC Push path, 20 rounds (each abandoned stream held a server thread before the fix).

    Measured with tracemalloc (numpy reports its buffers to it): this process's RSS also holds the gRPC message
    buffers its own client threads left in glibc arenas, ~1 MiB a round whatever the receiver does.
    """
    import tracemalloc

    from weight_sync.codec import encode_chunk

    big = {"w": torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024)}  # 8 MiB
    model_bytes = 8 << 20
    (receiver, _), = receivers(1, config=WeightSyncConfig(chunk_bytes=1 << 20), sd=big)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    flat = big["w"].numpy().reshape(-1)
    shard = pb.ShardHeader(name="w", offsets=(0, 0), shape=(2048, 1024), xxh3_64=xxhash.xxh3_64_intdigest(flat))
    messages = [
        encode_chunk(pb.ChunkHeader(element_offset=start, num_elements=1 << 18, shard=shard if i == 0 else None),
                     flat[start : start + (1 << 18)])
        for i, start in enumerate(range(0, flat.size * 3 // 4, 1 << 18))
    ]
    held = threading.Event()

    def abandoned():
        yield from messages
        held.wait(60)  # the client keeps the stream open and sends nothing more

    streams, measured = [], {}
    tracemalloc.start()
    try:
        for round_ in range(1, 21):
            begin(client, big, 1, session=f"g{round_}")
            md = client.metadata + stream_metadata(f"g{round_}", 1, 0, [], 0)
            streams.append(client.push.future(abandoned(), timeout=60, metadata=md))
            time.sleep(0.1)
            client.abort(pb.AbortRequest(session_id=f"g{round_}", policy_version=1, reason="abandoned"))
            if round_ in (1, 20):
                time.sleep(0.3)
                measured[round_] = tracemalloc.get_traced_memory()[0]
        growth = measured[20] - measured[1]
        assert growth < model_bytes, f"{growth / 2**20:.0f} MiB more allocated after 19 abandoned updates (model: 8)"
        assert receiver.area.staging_bytes <= receiver.area.staging_bound_bytes
    finally:
        tracemalloc.stop()
        held.set()
        for future in streams:
            future.cancel()
    assert not any(_push_dir(receiver.address, 1, big).values())


# -- 4: shard checks in time linear in shards -------------------------------------------------------------------------
def _one_row_shards_cpu_s(num_rows: int) -> float:
    """Receiver CPU seconds (this thread) to stage and commit `num_rows` one-row shards of a (num_rows, 128) tensor."""
    values_ = np.arange(num_rows * 128, dtype=np.float32).reshape(num_rows, 128)
    area = StagingArea(
        [*_specs({"w": values_})], keep_base=False, idle_timeout_s=60, max_chunk_bytes=1 << 20
    )
    chunks = []
    for row in range(num_rows):
        data = values_[row]
        shard = pb.ShardHeader(name="w", offsets=(row, 0), shape=(1, 128), xxh3_64=xxhash.xxh3_64_intdigest(data))
        chunks.append((pb.ChunkHeader(num_elements=128, shard=shard), memoryview(data.tobytes())))
    start = time.thread_time()
    area.begin(pb.BeginRequest(session_id="s", policy_version=1, rank=0, num_ranks=1, base_version=-1,
                               tensors=[pb.TensorSpec(name="w", shape=(num_rows, 128), dtype="float32")]))
    writer = area.open_stream("s", 1, 0)
    for header, payload in chunks:
        writer.feed(header, payload)
    writer.finish()
    area.commit("s", 1, lambda version, tensors: None)
    return time.thread_time() - start


def _specs(arrays: dict[str, np.ndarray]):
    from weight_sync.spec import TensorSpec

    for name, a in arrays.items():
        yield TensorSpec(name, a.shape, "float32")


def test_the_overlap_check_costs_linear_time_in_shards():
    small = min(_one_row_shards_cpu_s(1024) for _ in range(2))
    large = min(_one_row_shards_cpu_s(4096) for _ in range(2))  # 4,096 one-row shards of a 2 MiB tensor
    assert large < 2.0, f"4,096 one-row shards took {large:.2f} s of receiver CPU (was 11.4 s: a quadratic check)"
    assert large / small < 10, f"4x the shards cost {large / small:.1f}x the CPU ({small:.3f} s -> {large:.3f} s)"


def test_overlapping_shards_are_refused_however_they_arrive(one_receiver):
    receiver, sink, client = one_receiver
    w = SD["w"]
    cases = [
        shard_messages("w", w[:4], (0, 0)) + shard_messages("w", w[2:], (2, 0)),  # more elements than w has
        shard_messages("w", w[:3], (0, 0)) + shard_messages("w", w[:3], (0, 0)),  # the same box twice
        shard_messages("w", w[:3], (0, 0)) + shard_messages("w", w[2:5], (2, 0)),  # row 2 twice, row 5 never
        shard_messages("w", w[:, :5], (0, 0)) + shard_messages("w", w[:, 4:7], (0, 4)),  # column 4 twice, 7 never
    ]
    for version, messages in enumerate(cases, start=1):
        begin(client, {"w": w}, version)
        pushed = status_of(lambda messages=messages, version=version: raw_push(client, "s", version, 0, messages))
        committed = status_of(lambda version=version: commit(client, version))
        assert pushed == C.INVALID_ARGUMENT or committed == C.FAILED_PRECONDITION, (version, pushed, committed)
    assert receiver.policy_version == 0 and torch.equal(sink.state_dict["w"], torch.zeros_like(w))


# -- 5: relays only where the update's Begin says ---------------------------------------------------------------------
@pytest.fixture
def listener():
    """A loopback listener that counts the connections a receiver opens to it (and reads nothing)."""
    counting = LoopbackListener()
    yield counting
    counting.close()


def _data_reply(port: int, hello: pb.DataHello) -> pb.DataReply | None:
    """Send a hello and an empty stream; the receiver's DataReply, or None when none came within 10 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_frame(hello) + struct.pack("<I", 0))
        data = b""
        try:
            while chunk := sock.recv(1 << 16):
                data += chunk
        except TimeoutError:
            return None  # e.g. still waiting on relays it opened
    return pb.DataReply.FromString(data[4 : 4 + struct.unpack("<I", data[:4])[0]])


def test_a_ticket_holder_cannot_make_the_receiver_connect_anywhere(one_receiver, listener):
    receiver, sink, client = one_receiver
    port = client.describe().data_port
    reply = begin(client, SD, 1)
    targets = [
        pb.RelayTarget(address=f"127.0.0.1:{20000 + i}", data_port=listener.port, ticket=b"t") for i in range(20)
    ]
    hello = pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=reply.data_ticket, relay=targets, fanout=20)
    answer = _data_reply(port, hello)
    opened = len(listener.accepted)
    assert answer is not None and answer.code == C.PERMISSION_DENIED.value[0], f"{answer}; {opened} connections opened"
    assert "not announced" in answer.message
    md = client.metadata + stream_metadata("s", 1, 0, [f"127.0.0.1:{listener.port}"], 2)  # the gRPC Push path
    try:
        client.push(iter([]), timeout=10, metadata=md)
        code = C.OK
    except grpc.RpcError as e:
        code = e.code()
    assert code == C.PERMISSION_DENIED
    time.sleep(0.5)
    assert not listener.accepted, f"the receiver opened {len(listener.accepted)} connections nobody announced"
    stage(client, 1, values(1))  # refused relays did not spend the rank's streams nor drop the update
    assert commit(client, 1).policy_version == 1


def test_relays_beyond_what_begin_announced_are_refused(one_receiver, listener):
    receiver, sink, client = one_receiver
    port = client.describe().data_port
    announced = [pb.RelayTarget(address=f"127.0.0.1:{listener.port}", data_port=listener.port)]
    request = pb.BeginRequest(session_id="s", policy_version=1, rank=0, num_ranks=1, tensors=spec_msgs(SD),
                              base_version=-1, relay_targets=announced, relay_fanout=1)
    ticket = client.begin(request).data_ticket
    for relay, fanout in (
        ([pb.RelayTarget(address=f"127.0.0.1:{listener.port}", data_port=listener.port + 1)], 1),  # other data port
        ([pb.RelayTarget(address=f"127.0.0.1:{listener.port}", data_port=listener.port)], 2),  # more children
    ):
        hello = pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket, relay=relay, fanout=fanout)
        answer = _data_reply(port, hello)
        assert answer is not None and answer.code == C.PERMISSION_DENIED.value[0], answer
    assert not listener.accepted
    too_many = [pb.RelayTarget(address=f"127.0.0.1:{i + 1}") for i in range(1025)]
    request = pb.BeginRequest(session_id="t", policy_version=2, rank=0, num_ranks=1, tensors=spec_msgs(SD),
                              base_version=-1, relay_targets=too_many, relay_fanout=2)
    assert status_of(lambda: client.begin(request)) == C.INVALID_ARGUMENT


# -- outside review (hostile clients), 2026-12 -------------------------------------------------------------------------
def test_a_model_with_a_tensor_of_no_elements_is_pushed_and_committed(receivers):
    # Every Commit failed INTERNAL (torch cannot view 0 bytes as float): such a model could never be updated.
    sd = {**SD, "empty": torch.zeros(0, 4)}
    with receiver_with_client(receivers, sd) as (receiver, sink, client):
        with WeightSender([receiver.address], WeightSyncConfig(num_retries=0)) as sender:
            new = {k: v + 1 for k, v in sd.items()}
            report = sender.push(1, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in new.items()])
            assert not report.failed, report.failed
            assert sender.commit(1) == {receiver.address: None}
        assert receiver.policy_version == 1 and sink.state_dict["empty"].shape == (0, 4)
        assert torch.equal(sink.state_dict["w"], new["w"])


def test_long_client_strings_are_quoted_short_so_the_status_survives(one_receiver):
    # A 50,000-character name went back whole in the status message, past gRPC's metadata limit: the client saw
    # RESOURCE_EXHAUSTED ("retry") instead of NOT_FOUND.
    receiver, sink, client = one_receiver
    request = pb.BeginRequest(session_id="s", policy_version=1, rank=0, num_ranks=1, base_version=-1,
                              tensors=[pb.TensorSpec(name="n" * 50_000, shape=[1], dtype="float32")])  # fmt: skip
    with pytest.raises(grpc.RpcError) as error:
        client.begin(request)
    assert error.value.code() == C.NOT_FOUND and "(+49800 characters)" in error.value.details()
    stage(client, 1, values(1))
    assert commit(client, 1).policy_version == 1


@pytest.mark.parametrize("field, value", [
    ("session_id", "a\nb"), ("session_id", "caf\u00e9"), ("num_streams", -1),
])  # fmt: skip
def test_begin_fields_outside_the_spec_are_refused(one_receiver, field, value):
    receiver, sink, client = one_receiver
    request = pb.BeginRequest(session_id="s", policy_version=1, rank=0, num_ranks=1, base_version=-1,
                              tensors=spec_msgs(SD))  # fmt: skip
    setattr(request, field, value)
    assert status_of(lambda: client.begin(request)) == C.INVALID_ARGUMENT
    port_99999 = pb.RelayTarget(address="127.0.0.1:99999", data_port=1)
    request = pb.BeginRequest(session_id="s", policy_version=1, rank=0, num_ranks=1, base_version=-1,
                              tensors=spec_msgs(SD), relay_targets=[port_99999], relay_fanout=1)  # fmt: skip
    assert status_of(lambda: client.begin(request)) == C.INVALID_ARGUMENT


def test_push_metadata_numbers_are_plain_decimals_and_a_bad_one_is_named(one_receiver):
    receiver, sink, client = one_receiver
    begin(client, SD, 1)
    for key, value in (("x-ws-fanout", "abc"), ("x-ws-version", "+1"), ("x-ws-rank", " 0")):
        md = [(k, value if k == key else v) for k, v in client.metadata + stream_metadata("s", 1, 0, [], 0)]
        if key not in dict(md):
            md.append((key, value))
        with pytest.raises(grpc.RpcError) as error:
            client.push(iter([]), timeout=10, metadata=md)
        assert error.value.code() == C.INVALID_ARGUMENT and key in error.value.details(), error.value.details()


def test_ranks_announcing_the_same_relay_targets_share_them_and_distinct_ones_are_bounded(one_receiver):
    # 65,536 ranks of 1,024 targets of 300 characters each were all kept: ~25 GB from one client.
    from weight_sync.relay_targets import MAX_RELAY_TARGETS, MAX_UPDATE_RELAY_TARGETS

    receiver, sink, client = one_receiver

    def announce(rank: int, prefix: str) -> grpc.StatusCode:
        targets = [pb.RelayTarget(address=f"{prefix}{i}.example:1", data_port=1) for i in range(MAX_RELAY_TARGETS)]
        request = pb.BeginRequest(session_id="r", policy_version=1, rank=rank, num_ranks=1024, base_version=-1,
                                  tensors=spec_msgs(SD) if rank == 0 else [], relay_targets=targets,
                                  relay_fanout=2)  # fmt: skip
        return status_of(lambda: client.begin(request))

    assert all(announce(rank, "same") == C.OK for rank in range(40))  # one shared copy
    distinct = MAX_UPDATE_RELAY_TARGETS // MAX_RELAY_TARGETS - 1  # the shared set holds one share already
    assert all(announce(100 + k, f"own{k}-") == C.OK for k in range(distinct))
    assert announce(200, "one-too-many-") == C.INVALID_ARGUMENT


def test_a_commit_answers_for_the_update_of_its_key_not_for_an_earlier_refused_one(one_receiver):
    receiver, sink, client = one_receiver
    begin(client, SD, 1)
    assert status_of(lambda: commit(client, 1)) == C.FAILED_PRECONDITION  # nothing pushed: refused, remembered
    begin(client, SD, 1)  # the same key again, then dropped by a bad checksum
    bad = shard_messages("w", SD["w"], (0, 0))
    header = pb.PushChunk.FromString(bad[0])
    header.header.shard.xxh3_64 ^= 1
    assert status_of(lambda: raw_push(client, "s", 1, 0, [header.SerializeToString(), *bad[1:]])) == C.DATA_LOSS
    assert status_of(lambda: commit(client, 1)) == C.NOT_FOUND  # was the first update's FAILED_PRECONDITION
    assert receiver.policy_version == 0
