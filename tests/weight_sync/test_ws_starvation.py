"""Issue 15 item 2 (no client can starve the others) and item 6's malformed requests: regression tests.

One test per finding, each with a legitimate push succeeding alongside where the issue names one: idle WatchVersion
streams and idle gRPC Push streams that held every RPC thread (Describe timed out, the push hung), silent and trickling
data-plane connections that made every new connection RESOURCE_EXHAUSTED (with no fallback to gRPC), a Begin that never
pushes and blocked every other session for 120 s, Commits piling up behind a blocked apply, a stalled receiver that
would idle every other receiver's streams, and random bytes as a request answered INTERNAL.
Every client here talks to loopback only, is bounded in count and time, and closes what it opened.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from ws_helpers import LoopbackListener, begin, commit, raw_push, shard_messages, status_of

from protos import weight_sync_pb2 as pb
from weight_sync.channel import SERVICE, WeightSyncClient
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.relay import stream_metadata
from weight_sync.sender import Shard, WeightSender
from weight_sync.sink import StateDictSink

C = grpc.StatusCode
SD = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": torch.arange(5, dtype=torch.int64)}
QUICK = WeightSyncConfig(num_retries=0, rpc_timeout_s=5)  # a client that gives up fast instead of hanging the test


def values(version: int, sd: dict[str, torch.Tensor] = SD) -> dict[str, torch.Tensor]:
    return {k: v + 100 * version for k, v in sd.items()}


def shards(sd: dict[str, torch.Tensor]) -> list[Shard]:
    return [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in sd.items()]


def push_and_commit(address: str, version: int, session: str, config: WeightSyncConfig = QUICK, sd=SD):
    """A legitimate push of `values(version)` + commit; returns (report, commit errors)."""
    with WeightSender([address], config, session_id=session) as sender:
        report = sender.push(version, shards(values(version, sd)))
        return report, sender.commit(version)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


def frame(message) -> bytes:
    data = message.SerializeToString()
    return struct.pack("<I", len(data)) + data


def read_reply(sock: socket.socket, timeout_s: float = 10.0) -> pb.DataReply | None:
    """The DataReply a receiver answered on `sock`, or None when it sent none (closed, or nothing within timeout)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except OSError:
        pass
    if len(data) < 4:
        return None
    return pb.DataReply.FromString(data[4 : 4 + struct.unpack("<I", data[:4])[0]])


@pytest.fixture
def serve():
    """Start receivers with a given config (sink: zeros of SD or of `sd`); stopped after the test."""
    started: list[tuple[WeightReceiver, WeightSyncClient]] = []

    def make(config: WeightSyncConfig | None = None, sd=SD, sink=None) -> tuple[WeightReceiver, StateDictSink]:
        sink = sink or StateDictSink({k: torch.zeros_like(v) for k, v in sd.items()})
        receiver = WeightReceiver(sink, config or WeightSyncConfig())
        receiver.start()
        started.append((receiver, WeightSyncClient(receiver.address, QUICK)))
        return receiver, sink

    yield make
    for receiver, client in started:
        client.close()
        receiver.stop(grace_s=0)


def silent() -> Iterator[bytes]:
    """The request stream of a client that opens a Push stream and never sends a chunk (until the test ends)."""
    idle_until.wait(60)
    yield from ()


idle_until = threading.Event()


@pytest.fixture
def idle_clients():
    """Idle client calls opened by a test; cancelled (and their iterators released) at its end."""
    idle_until.clear()
    calls: list = []
    yield calls
    idle_until.set()
    for call in calls:
        call.cancel()


# -- 2(a): idle WatchVersion streams --------------------------------------------------------------------------------
def test_idle_watch_streams_leave_threads_for_describe_and_a_push(serve, idle_clients):
    receiver, sink = serve()
    config = receiver.config
    client = WeightSyncClient(receiver.address, QUICK)
    num_watches = max(32, config.num_server_threads) + 4  # more idle watchers than the receiver has RPC threads
    request = pb.WatchVersionRequest(after_version=0)
    watches = [client.watch(request, timeout=60, metadata=client.metadata) for _ in range(num_watches)]
    idle_clients.extend(watches)
    time.sleep(1.0)  # the watches are in (before the fix: every RPC thread held by one)
    assert status_of(client.describe) == C.OK, "Describe starved by idle WatchVersion streams"
    report, committed = push_and_commit(receiver.address, 1, "trainer")
    assert not report.failed and committed == {receiver.address: None}
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], values(1)["w"])
    refused = num_watches - config.max_watch_streams
    wait_for(lambda: sum(w.done() for w in watches) >= refused, 5, f"{refused} watches refused")
    codes = [w.code() for w in watches if w.done()]
    assert codes.count(C.RESOURCE_EXHAUSTED) == refused, codes
    for w in watches:
        w.cancel()
    events = []  # the slots come back: a new watcher sees the next version

    def watch_once() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            call = client.watch(pb.WatchVersionRequest(after_version=1), timeout=10, metadata=client.metadata)
            try:
                events.append(next(call).policy_version)
                return
            except grpc.RpcError as e:
                assert e.code() == C.RESOURCE_EXHAUSTED, e
                time.sleep(0.2)

    watcher = threading.Thread(target=watch_once)
    watcher.start()
    time.sleep(1.5)
    push_and_commit(receiver.address, 2, "trainer")
    watcher.join(15)
    assert events == [2]
    client.close()


def test_a_watch_stream_ends_after_watch_timeout_s(serve):
    receiver, _ = serve(WeightSyncConfig(watch_timeout_s=0.5))
    client = WeightSyncClient(receiver.address, QUICK)
    start = time.monotonic()
    assert list(client.watch(pb.WatchVersionRequest(after_version=0), timeout=10, metadata=client.metadata)) == []
    assert time.monotonic() - start < 5
    client.close()


# -- 2(a) + 2(c): idle gRPC Push streams, and a session that squats on the update ------------------------------------
def test_idle_push_streams_leave_threads_for_describe_and_the_trainer_preempts_them(serve, idle_clients):
    receiver, sink = serve()
    config = receiver.config
    report, committed = push_and_commit(receiver.address, 1, "trainer")  # the trainer's session: the last commit
    assert not report.failed and committed == {receiver.address: None}
    client = WeightSyncClient(receiver.address, QUICK)
    per_rank = 64
    for rank in (0, 1):
        client.begin(pb.BeginRequest(session_id="squatter", policy_version=2, rank=rank, num_ranks=2,
                                     tensors=[pb.TensorSpec(name="b", shape=(5,), dtype="int64")], base_version=-1,
                                     num_streams=per_rank))
    num_idle = min(config.num_server_threads + 8, 2 * per_rank)  # more idle streams than RPC threads
    for i in range(num_idle):
        md = client.metadata + stream_metadata("squatter", 2, i % 2, [], 0)
        idle_clients.append(client.push.future(silent(), timeout=60, metadata=md))
    time.sleep(2.0)  # the streams are in (before the fix: every RPC thread held by one)
    assert status_of(client.describe) == C.OK, "Describe starved by idle Push streams"
    grpc_only = WeightSyncConfig(num_retries=0, rpc_timeout_s=5, data_plane="grpc", push_timeout_s=30)
    start = time.monotonic()
    report, committed = push_and_commit(receiver.address, 2, "trainer", grpc_only)
    assert not report.failed, report.failed
    assert committed == {receiver.address: None} and time.monotonic() - start < 20
    assert receiver.policy_version == 2 and torch.equal(sink.state_dict["w"], values(2)["w"])
    wait_for(lambda: all(f.done() for f in idle_clients), 10, "every idle stream ended")
    codes = [f.code() for f in idle_clients]
    assert set(codes) <= {C.CANCELLED, C.RESOURCE_EXHAUSTED}, codes  # cut with their update, or never admitted
    assert codes.count(C.RESOURCE_EXHAUSTED) == num_idle - config.max_grpc_push_streams, codes
    assert status_of(lambda: commit(client, 2, session="squatter")) == C.NOT_FOUND
    client.close()


def test_an_idle_push_stream_is_cut_after_stream_idle_timeout_s(serve, idle_clients):
    receiver, _ = serve(WeightSyncConfig(stream_idle_timeout_s=1.0))
    client = WeightSyncClient(receiver.address, QUICK)
    begin(client, SD, 1, session="idle")
    md = client.metadata + stream_metadata("idle", 1, 0, [], 0)
    idle = client.push.future(silent(), timeout=60, metadata=md)
    idle_clients.append(idle)
    wait_for(idle.done, 5, "the idle stream was cut")
    assert idle.code() == C.CANCELLED
    assert status_of(lambda: commit(client, 1, session="idle")) == C.NOT_FOUND  # its update was dropped
    report, committed = push_and_commit(receiver.address, 1, "other")  # no wait for the 120 s update timeout
    assert not report.failed and committed == {receiver.address: None}
    client.close()


def test_a_begin_that_never_pushes_gives_way(serve):
    receiver, sink = serve(WeightSyncConfig(stream_idle_timeout_s=1.0))
    client = WeightSyncClient(receiver.address, QUICK)
    begin(client, SD, 1, session="squatter")  # a fresh receiver: no trainer session yet
    assert status_of(lambda: begin(client, SD, 1, session="other")) == C.ABORTED  # in progress, not idle yet
    for _ in range(5):  # repeating its Begin is no progress: it does not keep the update alive
        time.sleep(0.25)
        begin(client, SD, 1, session="squatter")
    report, committed = push_and_commit(receiver.address, 1, "trainer")  # idle 1.25 s > 1 s: replaced
    assert not report.failed and committed == {receiver.address: None}
    assert receiver.area.trainer_session == "trainer"

    begin(client, SD, 2, session="squatter")
    report, committed = push_and_commit(receiver.address, 2, "trainer")  # preempted at once by the trainer's session
    assert not report.failed and committed == {receiver.address: None}

    begin(client, SD, 3, session="trainer")  # a newer version of the same session supersedes its open update
    report, committed = push_and_commit(receiver.address, 4, "trainer")
    assert not report.failed and committed == {receiver.address: None}
    assert status_of(lambda: begin(client, SD, 5, session="squatter")) == C.OK
    assert status_of(lambda: begin(client, SD, 5, session="other")) == C.ABORTED  # active, and not the trainer
    assert receiver.policy_version == 4 and torch.equal(sink.state_dict["w"], values(4)["w"])
    client.close()


def test_the_trainer_session_preempts_a_squatter_with_default_timeouts(serve):
    receiver, sink = serve()
    report, committed = push_and_commit(receiver.address, 1, "trainer")
    assert not report.failed and committed == {receiver.address: None}
    client = WeightSyncClient(receiver.address, QUICK)
    begin(client, SD, 2, session="squatter")  # never pushes: blocked every other session for 120 s before the fix
    start = time.monotonic()
    report, committed = push_and_commit(receiver.address, 2, "trainer")
    assert not report.failed, report.failed
    assert committed == {receiver.address: None} and time.monotonic() - start < 10
    assert receiver.policy_version == 2 and torch.equal(sink.state_dict["w"], values(2)["w"])
    client.close()


# -- 2(b): silent, trickling and stalled data-plane connections ------------------------------------------------------
def test_silent_data_connections_do_not_refuse_the_real_push(serve):
    receiver, sink = serve()
    port = WeightSyncClient(receiver.address, QUICK).describe().data_port
    num_silent = 48  # 32 took every connection slot before the fix; now 16 wait for their hello, the oldest make room
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(num_silent)]
    try:
        time.sleep(0.5)  # accepted, and silent
        report, committed = push_and_commit(receiver.address, 1, "trainer")
        assert not report.failed, report.failed  # RESOURCE_EXHAUSTED before the fix, and no fallback
        assert report.socket_endpoints == [receiver.address] and not report.grpc_fallback
        assert committed == {receiver.address: None} and torch.equal(sink.state_dict["w"], values(1)["w"])
        evicted = sockets[: num_silent - receiver.config.max_pending_data_connections]  # the oldest made room
        replies = [read_reply(s, timeout_s=0.2) for s in evicted]
        assert all(r is not None and r.code == C.RESOURCE_EXHAUSTED.value[0] and r.unopened for r in replies), replies
    finally:
        for s in sockets:
            s.close()


def test_a_silent_or_trickling_connection_is_closed_at_the_hello_timeout(serve):
    receiver, _ = serve(WeightSyncConfig(hello_timeout_s=0.5))
    port = WeightSyncClient(receiver.address, QUICK).describe().data_port
    silent_sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    trickle = socket.create_connection(("127.0.0.1", port), timeout=10)
    start = time.monotonic()
    try:
        hello = frame(pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=b"x" * 32))
        for byte in hello[:20]:  # a byte every 0.2 s: each read is quick, the whole hello takes far too long
            if select.select([trickle], [], [], 0)[0]:
                break  # the receiver answered: stop (writing into a closed connection would reset it)
            trickle.sendall(bytes([byte]))
            time.sleep(0.2)
        for sock in (silent_sock, trickle):
            reply = read_reply(sock)
            assert reply is not None and reply.code == C.DEADLINE_EXCEEDED.value[0] and reply.unopened, reply
        assert time.monotonic() - start < 5  # was the 120 s update timeout
    finally:
        silent_sock.close()
        trickle.close()


def test_a_hello_that_stalls_inside_its_body_is_a_deadline_not_a_malformed_hello(serve):
    # Answered INVALID_ARGUMENT before: a sender falls back to gRPC only on DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED.
    receiver, _ = serve(WeightSyncConfig(hello_timeout_s=0.5))
    port = WeightSyncClient(receiver.address, QUICK).describe().data_port
    hello = frame(pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=b"x" * 32))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(hello[:7])  # the length and 3 bytes of the body, then nothing
        reply = read_reply(sock)
    assert reply is not None and reply.code == C.DEADLINE_EXCEEDED.value[0] and reply.unopened, reply


def test_a_data_stream_that_stalls_after_its_hello_is_cut_and_its_update_dropped(serve):
    receiver, _ = serve(WeightSyncConfig(stream_idle_timeout_s=0.5))
    client = WeightSyncClient(receiver.address, QUICK)
    port = client.describe().data_port
    ticket = begin(client, SD, 1, session="stall").data_ticket
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame(pb.DataHello(session_id="stall", policy_version=1, rank=0, ticket=ticket)))
        reply = read_reply(sock)
    assert reply is not None and reply.code == C.DEADLINE_EXCEEDED.value[0] and not reply.unopened, reply
    assert "stream_idle_timeout_s" in reply.message
    assert status_of(lambda: commit(client, 1, session="stall")) == C.NOT_FOUND
    report, committed = push_and_commit(receiver.address, 1, "trainer")
    assert not report.failed and committed == {receiver.address: None}
    client.close()


class RefusingDataPort(LoopbackListener):
    """A loopback data port that refuses every connection the way a full receiver does (RESOURCE_EXHAUSTED,
    unopened), after reading what the sender sends for a moment."""

    def __init__(self) -> None:
        self.num_refused = 0
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        with conn:
            refusal = pb.DataReply(code=C.RESOURCE_EXHAUSTED.value[0], message="full").SerializeToString()
            refusal += b"\x20\x01"  # unopened = true (field 4), by hand: the bytes any receiver would send
            try:
                conn.sendall(struct.pack("<I", len(refusal)) + refusal)
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(0.5)
                while conn.recv(1 << 16):
                    pass
            except OSError:
                pass
            self.num_refused += 1


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@pytest.mark.parametrize("refusal", ["resource_exhausted", "connection_refused"])
def test_the_sender_falls_back_to_grpc_when_the_socket_plane_refuses(serve, refusal):
    receiver, sink = serve()
    assert receiver._data is not None
    refusing = RefusingDataPort() if refusal == "resource_exhausted" else None
    receiver._data.port = refusing.port if refusing is not None else _closed_port()  # what Describe announces
    try:
        report, committed = push_and_commit(receiver.address, 1, "trainer")
        assert not report.failed, report.failed
        assert list(report.grpc_fallback) == [receiver.address] and report.socket_endpoints == []
        expected = "RESOURCE_EXHAUSTED" if refusing is not None else "UNAVAILABLE"
        assert report.grpc_fallback[receiver.address].startswith(expected), report.grpc_fallback
        assert committed == {receiver.address: None}
        assert receiver.policy_version == 1 and all(torch.equal(sink.state_dict[k], v) for k, v in values(1).items())
        if refusing is not None:
            wait_for(lambda: refusing.num_refused == receiver.config.num_streams, 5, "each stream refused once")
        strict = WeightSyncConfig(num_retries=0, rpc_timeout_s=5, data_plane="tcp")  # "tcp" insists: no fallback
        report, _ = push_and_commit(receiver.address, 2, "trainer", strict)
        assert expected in report.failed[receiver.address] and not report.grpc_fallback
    finally:
        if refusing is not None:
            refusing.close()


def test_a_stalled_receiver_is_cut_before_the_others_idle_out(serve):
    big = {"w": torch.arange(8 << 20, dtype=torch.float32).reshape(8192, 1024)}  # 32 MiB: more than socket buffers
    config = WeightSyncConfig(stream_idle_timeout_s=2.0, chunk_bytes=1 << 20)
    stalled, _ = serve(config, sd=big)
    healthy, sink = serve(config, sd=big)
    assert stalled._data is not None
    hole = LoopbackListener(receive_buffer_bytes=4096)  # accepts and never reads: a stalled receiver
    stalled._data.port = hole.port
    try:
        sender_config = WeightSyncConfig(num_retries=0, rpc_timeout_s=5, stream_idle_timeout_s=2.0, chunk_bytes=1 << 20)
        with WeightSender([stalled.address, healthy.address], sender_config, session_id="trainer") as sender:
            start = time.monotonic()
            report = sender.push(1, shards(values(1, big)))
            assert time.monotonic() - start < 15
            committed = sender.commit(1)
        assert report.errors[healthy.address] is None, report.errors  # its streams never idled 2 s
        assert "DEADLINE_EXCEEDED" in report.errors[stalled.address] and "accepted no data" in report.errors[
            stalled.address]
        assert committed[healthy.address] is None and torch.equal(sink.state_dict["w"], values(1, big)["w"])
        assert stalled.policy_version == 0
    finally:
        hole.close()


def test_a_receiver_that_freezes_once_it_has_the_whole_stream_is_cut_too(serve):
    """A stream small enough for the socket buffers (a delta, adapters, a small model) was all handed over before the
    receiver froze: only the wait for its answer was left, bounded by push_timeout_s alone (10 min by default)."""
    config = WeightSyncConfig(stream_idle_timeout_s=2.0)
    frozen, _ = serve(config)
    healthy, sink = serve(config)
    assert frozen._data is not None
    hole = LoopbackListener()  # takes the whole stream into its buffer and never answers
    frozen._data.port = hole.port
    try:
        sender_config = WeightSyncConfig(num_retries=0, rpc_timeout_s=5, stream_idle_timeout_s=2.0, push_timeout_s=60)
        with WeightSender([frozen.address, healthy.address], sender_config, session_id="trainer") as sender:
            start = time.monotonic()
            report = sender.push(1, shards(values(1)))
            assert time.monotonic() - start < 15, "the push waited for the frozen receiver's answer"
            committed = sender.commit(1)
        assert report.errors[healthy.address] is None, report.errors
        error = report.errors[frozen.address]
        assert error is not None and "DEADLINE_EXCEEDED" in error and "sent no answer after taking the whole" in error
        assert committed[healthy.address] is None and torch.equal(sink.state_dict["w"], values(1)["w"])
    finally:
        hole.close()


# -- Commits piling up behind a blocked apply -----------------------------------------------------------------------
class GateSink(StateDictSink):
    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        super().__init__(sd)
        self.gate = threading.Event()
        self.num_applies = 0

    def apply(self, policy_version, tensors):
        self.num_applies += 1
        assert self.gate.wait(30), "the test never opened the gate"
        super().apply(policy_version, tensors)


def test_commits_waiting_for_an_apply_are_bounded(serve):
    sink = GateSink({k: torch.zeros_like(v) for k, v in SD.items()})
    receiver, _ = serve(sink=sink)
    client = WeightSyncClient(receiver.address, WeightSyncConfig(num_retries=0, commit_timeout_s=30))
    begin(client, SD, 1)
    raw_push(client, "s", 1, 0, [m for n, t in SD.items() for m in shard_messages(n, t, (0,) * t.dim())])
    results: list = []
    lock = threading.Lock()

    def call() -> None:
        outcome = status_of(lambda: commit(client, 1))
        with lock:
            results.append(outcome)

    first = threading.Thread(target=call)
    first.start()
    num_others = 20
    others = [threading.Thread(target=call) for _ in range(num_others)]
    try:
        wait_for(lambda: sink.num_applies == 1, 10, "the first Commit is applying")
        for t in others:
            t.start()
        wait_for(lambda: len(results) >= 1, 10, "Commits refused")  # before the fix each one waited, holding a thread
        time.sleep(0.5)
    finally:
        sink.gate.set()
        for t in [first, *others]:
            if t.is_alive():
                t.join(30)
    from weight_sync.config import MAX_COMMIT_WAITERS

    refused = num_others - MAX_COMMIT_WAITERS
    assert results.count(C.RESOURCE_EXHAUSTED) == refused and results.count(C.OK) == MAX_COMMIT_WAITERS + 1, results
    assert sink.num_applies == 1 and commit(client, 1).policy_version == 1  # refused ones may simply repeat
    client.close()


# -- item 6: random bytes as a request ------------------------------------------------------------------------------
GARBAGE = [b"\xff" * 16, b"\x0a\xff\xff\xff\xff\xff", b"\x08", bytes(range(200, 256))]


@pytest.mark.parametrize("method", ["Describe", "Begin", "Commit", "Abort", "WatchVersion"])
def test_random_bytes_as_a_request_are_invalid_argument(serve, method):
    receiver, _ = serve()
    channel = grpc.insecure_channel(receiver.address)
    try:
        streamed = channel.unary_stream(f"/{SERVICE}/{method}", request_serializer=bytes)
        unary = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=bytes)
        for garbage in GARBAGE:
            if method == "WatchVersion":
                code = status_of(lambda garbage=garbage: next(streamed(garbage, timeout=5)))
            else:
                code = status_of(lambda garbage=garbage: unary(garbage, timeout=5))
            assert code == C.INVALID_ARGUMENT, (garbage, code)  # INTERNAL before the fix
    finally:
        channel.close()
    client = WeightSyncClient(receiver.address, QUICK)
    begin(client, SD, 1)
    assert status_of(lambda: raw_push(client, "s", 1, 0, GARBAGE)) == C.INVALID_ARGUMENT  # a Push chunk of garbage
    client.close()


def test_garbage_from_a_client_without_the_token_is_unauthenticated(serve, monkeypatch):
    monkeypatch.setenv("WS_STARVATION_TOKEN", "secret")
    receiver, _ = serve(WeightSyncConfig(auth_token_env="WS_STARVATION_TOKEN"))
    channel = grpc.insecure_channel(receiver.address)
    try:
        unary = channel.unary_unary(f"/{SERVICE}/Begin", request_serializer=bytes)
        assert status_of(lambda: unary(GARBAGE[0], timeout=5)) == C.UNAUTHENTICATED
    finally:
        channel.close()
