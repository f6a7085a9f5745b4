"""The socket data plane: same results as gRPC Push, tickets, precise refusals, broken senders, fuzzed frames."""

from __future__ import annotations

import socket
import struct
import time

import grpc
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ws_helpers import begin, commit, rank_shards, run_ranks, status_of, tiny_state_dict

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.config import WeightSyncConfig
from weight_sync.sender import WeightSender

C = grpc.StatusCode
SD = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": torch.ones(5)}


def frame(message) -> bytes:
    data = message.SerializeToString()
    return struct.pack("<I", len(data)) + data


def chunk_frame(header: pb.ChunkHeader, payload: bytes) -> bytes:
    head = header.SerializeToString()
    return struct.pack("<I", len(head)) + head + struct.pack("<Q", len(payload)) + payload


def shard_frames(name: str, values: np.ndarray, shape: tuple[int, ...], chunk_elems: int = 16) -> list[bytes]:
    flat = values.reshape(-1)
    header = pb.ShardHeader(name=name, offsets=(0,) * len(shape), shape=shape, xxh3_64=xxhash.xxh3_64_intdigest(flat))
    out = []
    for start in range(0, flat.size, chunk_elems):
        part = flat[start : start + chunk_elems]
        chunk = pb.ChunkHeader(element_offset=start, num_elements=part.size)
        if start == 0:
            chunk.shard.CopyFrom(header)
        out.append(chunk_frame(chunk, part.tobytes()))
    return out


def socket_push(port: int, hello: pb.DataHello, body: bytes, end: bool = True) -> pb.DataReply | None:
    """Send a hello and raw frames on one connection; the receiver's DataReply (None when it closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(frame(hello) + body + (struct.pack("<I", 0) if end else b""))
            sock.shutdown(socket.SHUT_WR)  # a truncated stream ends here, as when a sender dies
        except OSError:
            pass  # refused early: the reply is still readable
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    if len(data) < 4:
        return None
    return pb.DataReply.FromString(data[4 : 4 + struct.unpack("<I", data[:4])[0]])


@pytest.fixture
def one(receivers):
    (receiver, sink), = receivers(1, sd=SD)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    yield receiver, sink, client, client.describe().data_port
    client.close()


def full_body() -> bytes:
    return b"".join(m for name, t in SD.items() for m in shard_frames(name, t.numpy(), tuple(t.shape)))


@pytest.mark.parametrize("plane", ["tcp", "grpc"])
def test_both_planes_assemble_two_ranks_into_every_receiver(receivers, plane):
    pairs = receivers(2)
    sd = tiny_state_dict(3)
    config = WeightSyncConfig(chunk_bytes=4096, data_plane=plane)
    senders = [WeightSender([r.address for r, _ in pairs], config, rank=r, num_ranks=2) for r in range(2)]
    reports = run_ranks(lambda r: senders[r].push(1, rank_shards(sd, r, 2)), 2)
    assert senders[0].commit(1) == {r.address: None for r, _ in pairs}
    for report in reports:
        assert not report.failed
        assert sorted(report.socket_endpoints) == (sorted(r.address for r, _ in pairs) if plane == "tcp" else [])
    for _, sink in pairs:
        assert all(torch.equal(sink.state_dict[k], v) for k, v in sd.items())
    for s in senders:
        s.close()


def test_auto_uses_sockets_and_deltas_travel_on_them(receivers):
    sd = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    (receiver, sink), = receivers(1, sd=sd)
    with WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=1024, delta=True)) as sender:
        first = sender.push(1, [rank_shards(sd, 0, 1)[0]])
        assert sender.commit(1) == {receiver.address: None}
        sd2 = {"w": sd["w"].clone()}
        sd2["w"][::8, ::8] += 1
        second = sender.push(2, rank_shards(sd2, 0, 1))
        assert sender.commit(2) == {receiver.address: None}
    assert first.socket_endpoints == second.socket_endpoints == [receiver.address]
    assert second.delta_endpoints == [receiver.address] and second.bytes_sent < first.bytes_sent / 4
    assert torch.equal(sink.state_dict["w"], sd2["w"])


def test_a_grpc_only_receiver_offers_no_port_and_tcp_senders_say_so(receivers):
    (receiver, sink), = receivers(1, config=WeightSyncConfig(data_plane="grpc"), sd=SD)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    assert client.describe().data_port == 0
    with WeightSender([receiver.address], WeightSyncConfig(data_plane="tcp")) as sender:
        report = sender.push(1, rank_shards(SD, 0, 1))
        assert "offers no socket data plane" in report.failed[receiver.address]
    with WeightSender([receiver.address], WeightSyncConfig()) as sender:  # auto falls back to gRPC Push
        report = sender.push(2, rank_shards(SD, 0, 1))
        assert not report.failed and report.socket_endpoints == []
        assert sender.commit(2) == {receiver.address: None}
    assert torch.equal(sink.state_dict["w"], SD["w"])


def test_config_refuses_plaintext_sockets_with_tls():
    with pytest.raises(ValueError, match="plaintext"):
        WeightSyncConfig(data_plane="tcp", tls_ca_path="/ca.pem")
    with pytest.raises(ValueError, match="plaintext"):
        WeightSyncConfig(data_plane="tcp", tls_cert_path="/c.pem", tls_key_path="/k.pem")


def test_a_wrong_ticket_is_unauthenticated_and_a_right_one_applies(one):
    receiver, sink, client, port = one
    ticket = begin(client, SD, 1).data_ticket
    assert len(ticket) == 32
    bad = socket_push(port, pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=b"x" * 32), full_body())
    assert bad.code == C.UNAUTHENTICATED.value[0] and "ticket" in bad.message
    good = socket_push(port, pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket), full_body())
    assert good.code == 0 and good.reply.num_shards == 2
    commit(client, 1)
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], SD["w"])


def test_a_corrupted_payload_is_data_loss_and_nothing_applies(one):
    receiver, sink, client, port = one
    ticket = begin(client, SD, 1).data_ticket
    body = bytearray(full_body())
    body[-3] ^= 0xFF  # last payload byte of the last shard
    reply = socket_push(port, pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket), bytes(body))
    assert reply.code == C.DATA_LOSS.value[0] and "checksum" in reply.message
    assert status_of(lambda: commit(client, 1)) == C.NOT_FOUND
    assert receiver.policy_version == 0 and not sink.state_dict["w"].any()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (struct.pack("<I", 1 << 20), C.INVALID_ARGUMENT),  # header longer than any ChunkHeader may be
        (chunk_frame(pb.ChunkHeader(num_elements=4), b"")[:-8] + struct.pack("<Q", 1 << 40), C.INVALID_ARGUMENT),
        (
            shard_frames("w", np.zeros(48, np.float32), (6, 8), 48)[0][:-192 - 8] + struct.pack("<Q", 1 << 40),
            C.RESOURCE_EXHAUSTED,
        ),
        (shard_frames("nope", np.zeros(4, np.float32), (4,))[0], C.NOT_FOUND),
    ],
    ids=["huge-header", "no-shard-header", "huge-payload", "unknown-tensor"],
)
def test_malformed_frames_get_precise_statuses_before_any_allocation(one, body, code):
    receiver, _, client, port = one
    ticket = begin(client, SD, 1).data_ticket
    reply = socket_push(port, pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket), body, end=False)
    assert reply.code == code.value[0], reply.message
    assert receiver.policy_version == 0


def test_a_sender_that_dies_mid_payload_leaves_the_old_version_and_the_next_update_succeeds(one):
    receiver, sink, client, port = one
    ticket = begin(client, SD, 1).data_ticket
    body = full_body()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(frame(pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket)) + body[:100])
    deadline = time.monotonic() + 10
    while status_of(lambda: begin(client, SD, 2)) == C.ABORTED and time.monotonic() < deadline:
        time.sleep(0.05)  # until the receiver saw the broken connection and dropped update 1
    assert receiver.policy_version == 0 and status_of(lambda: commit(client, 1)) == C.NOT_FOUND
    client.abort(pb.AbortRequest(session_id="s", policy_version=2, reason="probe done"))
    with WeightSender([receiver.address], WeightSyncConfig(), session_id="s") as sender:
        report = sender.push(3, rank_shards(SD, 0, 1))
        assert not report.failed and report.socket_endpoints == [receiver.address]
        assert sender.commit(3) == {receiver.address: None}
    assert receiver.policy_version == 3 and torch.equal(sink.state_dict["w"], SD["w"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=4))
def test_fuzzed_streams_never_crash_the_receiver_nor_apply_bad_data(one, cut, flips):
    receiver, sink, client, port = one
    version = receiver.policy_version + 1
    while status_of(lambda: begin(client, SD, version)) != C.OK:
        time.sleep(0.02)  # the previous example's update is still being dropped
    ticket = begin(client, SD, version).data_ticket
    body = bytearray(full_body())
    for pos, mask in flips:
        body[pos % len(body)] ^= mask
    hello = pb.DataHello(session_id="s", policy_version=version, rank=0, ticket=ticket)
    socket_push(port, hello, bytes(body[: cut or None]))
    status = status_of(lambda: commit(client, version))
    if status == C.OK:  # only an intact stream may commit, and then the weights are exact
        assert torch.equal(sink.state_dict["w"], SD["w"]) and torch.equal(sink.state_dict["b"], SD["b"])
    else:
        assert receiver.policy_version == version - 1
        client.abort(pb.AbortRequest(session_id="s", policy_version=version, reason="fuzz"))
