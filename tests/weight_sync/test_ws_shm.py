"""The same-host shared-memory data plane: exact weights, the selection, and every refusal leaves the old version."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time

import grpc
import numpy as np
import pytest
import torch
import xxhash
from test_ws_tls import pki  # noqa: F401  (the certificates fixture)
from ws_helpers import begin, commit, rank_shards, run_ranks, status_of, tiny_state_dict

from protos import weight_sync_pb2 as pb
from weight_sync import routes as routes_module
from weight_sync.channel import WeightSyncClient
from weight_sync.config import WeightSyncConfig
from weight_sync.frames import chunk_prefix, framed, read_reply
from weight_sync.receiver import WeightReceiver
from weight_sync.sender import WeightSender
from weight_sync.shm import MemfdMappings, host_identity
from weight_sync.shm_push import ShmStream
from weight_sync.sink import StateDictSink
from weight_sync.staging import SyncError
from weight_sync.version import PROTOCOL_MINOR

C = grpc.StatusCode
SD = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": torch.ones(5)}
SHM = WeightSyncConfig(chunk_bytes=4096, offer_shm=True)
QUICK = WeightSyncConfig(num_retries=0, rpc_timeout_s=5)


def memfd(data: bytes, *, seal: bool = True, allocate: bool = True, size: int | None = None) -> int:
    """A memfd holding `data` (padded to `size`), sealed against shrinking and fully allocated unless told not to."""
    fd = os.memfd_create("test-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size if size is not None else len(data))
    if allocate and (size or len(data)):
        os.posix_fallocate(fd, 0, size if size is not None else len(data))
    os.pwrite(fd, data, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def stream_of(sd: dict[str, torch.Tensor], chunk_elems: int = 16) -> tuple[bytes, bytes]:
    """(frames, payload) of whole-tensor shards as a well-behaved shm sender writes them: the payloads in order."""
    frames, payload = [], []
    for name, t in sd.items():
        flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        shard = pb.ShardHeader(name=name, offsets=(0,) * t.dim(), shape=t.shape, xxh3_64=xxhash.xxh3_64_intdigest(flat))
        size = t.element_size()
        for start in range(0, t.numel(), chunk_elems):
            count = min(chunk_elems, t.numel() - start)
            header = pb.ChunkHeader(element_offset=start, num_elements=count, shard=shard if start == 0 else None)
            frames.append(chunk_prefix(header, count * size))
            payload.append(flat[start * size : (start + count) * size].tobytes())
    return b"".join(frames), b"".join(payload)


def shm_push(offer: pb.ShmPlane, hello: pb.DataHello, fds: list[int], frames: bytes) -> pb.DataReply | None:
    """A hand-made shm stream: the hello with `fds`, the frames, the end; the receiver's DataReply (None: none)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + offer.socket_name)
        data = framed(hello)
        try:
            sent = socket.send_fds(sock, [data], fds) if fds else 0
            sock.sendall(data[sent:] + frames + struct.pack("<I", 0))
        except OSError:
            pass  # refused early: the reply is still readable
        try:
            return read_reply(sock, 10)
        except (OSError, SyncError):
            return None


@pytest.fixture
def one(receivers):
    (receiver, sink), = receivers(1, config=SHM, sd=SD)
    client = WeightSyncClient(receiver.address, QUICK)
    described = client.describe()
    yield receiver, sink, client, described.shm_plane
    client.close()


def test_describe_offers_the_plane_with_this_hosts_identity_and_protocol_1_2(one):
    receiver, _, client, offer = one
    described = client.describe()
    assert described.HasField("shm_plane") and described.protocol_version.minor == PROTOCOL_MINOR >= 2
    assert offer.host_id == host_identity() and offer.pid == os.getpid() and offer.uid == os.getuid()
    assert offer.socket_name.startswith("rl-align-ws-") and len(offer.socket_name) == len("rl-align-ws-") + 32
    assert len(begin(client, SD, 1).data_ticket) == 32
    assert receiver.policy_version == 0


def test_two_ranks_push_exact_tensors_of_every_dtype_over_shared_memory_twice(receivers):
    pairs = receivers(2, config=SHM)
    addresses = sorted(r.address for r, _ in pairs)
    senders = [WeightSender(addresses, WeightSyncConfig(chunk_bytes=4096), rank=k, num_ranks=2) for k in range(2)]
    try:
        for version in (1, 2):  # the second push reuses the rank's memfds and the receivers' mappings of them
            sd = tiny_state_dict(version)
            reports = run_ranks(lambda k, sd=sd, v=version: senders[k].push(v, rank_shards(sd, k, 2)), 2)
            for report in reports:
                assert not report.failed, report.failed
                assert sorted(report.shm_endpoints) == addresses and report.socket_endpoints == []
                assert not report.grpc_fallback and report.delta_endpoints == []
            assert senders[0].commit(version) == {a: None for a in addresses}
            for receiver, sink in pairs:
                assert receiver.policy_version == version
                assert all(torch.equal(sink.state_dict[k], v) for k, v in sd.items())
    finally:
        for s in senders:
            s.close()


def test_shards_larger_than_a_block_travel_as_row_blocks_and_arrive_exact(receivers):
    sd = {"big": torch.randn(1024, 2048), "odd": torch.randn(3, 1 << 19)}  # 8 MiB in rows; 6 MiB in 3 rows
    (receiver, sink), = receivers(1, config=WeightSyncConfig(chunk_bytes=1 << 20, offer_shm=True), sd=sd)
    with WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=1 << 20, num_streams=1)) as sender:
        report = sender.push(1, rank_shards(sd, 0, 1))
        assert not report.failed and report.shm_endpoints == [receiver.address]
        assert sender.commit(1) == {receiver.address: None}
    assert all(torch.equal(sink.state_dict[k], v) for k, v in sd.items())


def test_same_host_receivers_leave_relay_trees_and_the_tree_still_commits(receivers):
    remote_like = receivers(3, config=WeightSyncConfig(chunk_bytes=4096), sd=SD)  # socket plane only
    local = receivers(2, config=SHM, sd=SD)
    addresses = [r.address for r, _ in remote_like + local]
    config = WeightSyncConfig(chunk_bytes=4096, relay_fanout=1)
    senders = [WeightSender(addresses, config, rank=k, num_ranks=2) for k in range(2)]
    try:
        reports = run_ranks(lambda k: senders[k].push(1, rank_shards(SD, k, 2)), 2)
        for report in reports:
            assert not report.failed, report.failed  # no PERMISSION_DENIED: the tree's Begins announce its members
            assert sorted(report.shm_endpoints) == sorted(r.address for r, _ in local)
            assert report.socket_endpoints == [remote_like[0][0].address]  # fanout 1: one head for the other three
        assert senders[0].commit(1) == {a: None for a in addresses}
    finally:
        for s in senders:
            s.close()
    for receiver, sink in remote_like + local:
        assert receiver.policy_version == 1 and all(torch.equal(sink.state_dict[k], v) for k, v in SD.items())


def test_auto_falls_back_to_the_socket_plane_when_the_receiver_offers_no_shared_memory(receivers):
    (receiver, sink), = receivers(1, sd=SD)  # a default receiver: socket plane only
    assert not WeightSyncClient(receiver.address, QUICK).describe().HasField("shm_plane")
    with WeightSender([receiver.address], WeightSyncConfig()) as sender:
        report = sender.push(1, rank_shards(SD, 0, 1))
        assert not report.failed and report.shm_endpoints == [] and report.socket_endpoints == [receiver.address]
        assert sender.commit(1) == {receiver.address: None}
    with WeightSender([receiver.address], WeightSyncConfig(data_plane="shm")) as sender:  # "shm" insists
        report = sender.push(2, rank_shards(SD, 0, 1))
        assert "offers no shared-memory data plane" in report.failed[receiver.address]
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], SD["w"])


def test_a_sender_on_another_host_never_tries_the_plane(receivers, monkeypatch):
    (receiver, sink), = receivers(1, config=SHM, sd=SD)
    monkeypatch.setattr(routes_module, "host_identity", lambda: "another-boot-id/net:[1]/pid:[1]/user:[1]")
    with WeightSender([receiver.address], WeightSyncConfig()) as sender:
        report = sender.push(1, rank_shards(SD, 0, 1))
        assert not report.failed and report.shm_endpoints == [] and report.socket_endpoints == [receiver.address]
        assert sender.commit(1) == {receiver.address: None}
    with WeightSender([receiver.address], WeightSyncConfig(data_plane="shm")) as sender:
        assert "is not on this host" in sender.push(2, rank_shards(SD, 0, 1)).failed[receiver.address]
    assert receiver.policy_version == 1


def test_grpc_and_tcp_senders_and_grpc_receivers_leave_the_plane_alone(receivers):
    (grpc_only, _), = receivers(1, config=WeightSyncConfig(data_plane="grpc", offer_shm=True), sd=SD)
    assert not WeightSyncClient(grpc_only.address, QUICK).describe().HasField("shm_plane")
    (receiver, sink), = receivers(1, config=SHM, sd=SD)
    for version, plane in ((1, "tcp"), (2, "grpc")):
        with WeightSender([receiver.address], WeightSyncConfig(data_plane=plane)) as sender:
            report = sender.push(version, rank_shards(SD, 0, 1))
            assert not report.failed and report.shm_endpoints == []
            assert report.socket_endpoints == ([receiver.address] if plane == "tcp" else [])
            assert sender.commit(version) == {receiver.address: None}
    assert receiver.policy_version == 2


def test_an_unreachable_plane_falls_back_to_grpc_under_auto_and_fails_under_shm(one):
    receiver, sink, _, _ = one
    assert receiver._shm is not None
    receiver._shm.offer.socket_name = "rl-align-ws-" + "0" * 32  # what Describe announces: nobody listens there
    with WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=4096)) as sender:
        report = sender.push(1, rank_shards(SD, 0, 1))
        assert not report.failed, report.failed
        assert list(report.grpc_fallback) == [receiver.address] and report.shm_endpoints == []
        assert report.grpc_fallback[receiver.address].startswith("UNAVAILABLE")
        assert sender.commit(1) == {receiver.address: None}
    assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], SD["w"])
    strict = WeightSyncConfig(chunk_bytes=4096, data_plane="shm", num_retries=0, rpc_timeout_s=5)
    with WeightSender([receiver.address], strict) as sender:
        report = sender.push(2, rank_shards(SD, 0, 1))
        assert "UNAVAILABLE" in report.failed[receiver.address] and not report.grpc_fallback
    assert receiver.policy_version == 1


def test_tls_receivers_offer_the_plane_and_tls_senders_use_it(pki):  # noqa: F811
    tls = {"tls_cert_path": pki["server_cert"], "tls_key_path": pki["server_key"], "auth_token": "t"}
    sink = StateDictSink({k: torch.zeros_like(v) for k, v in SD.items()})
    receiver = WeightReceiver(sink, WeightSyncConfig(offer_shm=True, **tls))
    receiver.start()
    try:
        client_config = WeightSyncConfig(tls_ca_path=pki["ca"], auth_token="t")
        described = WeightSyncClient(receiver.address, client_config).describe()
        assert described.data_port == 0 and described.HasField("shm_plane")  # no plaintext socket plane with TLS
        with WeightSender([receiver.address], client_config) as sender:
            report = sender.push(1, rank_shards(SD, 0, 1))
            assert not report.failed and report.shm_endpoints == [receiver.address]
            assert sender.commit(1) == {receiver.address: None}
        assert all(torch.equal(sink.state_dict[k], v) for k, v in SD.items())
    finally:
        receiver.stop(0)


# -- hand-made streams: every refusal leaves the receiver on its version -------------------------------------------
def test_a_hand_made_stream_commits_and_the_wrong_ticket_is_refused_before_opening(one):
    receiver, sink, client, offer = one
    ticket = begin(client, SD, 1).data_ticket
    frames, payload = stream_of(SD)
    fd = memfd(payload)
    try:
        wrong = pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=bytes(32))
        reply = shm_push(offer, wrong, [fd], frames)
        assert reply is not None and reply.code == C.UNAUTHENTICATED.value[0] and reply.unopened
        hello = pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket)
        reply = shm_push(offer, hello, [fd], frames)
        assert reply is not None and reply.code == 0 and reply.reply.num_shards == 2, reply
        assert reply.reply.bytes_received == len(payload)
    finally:
        os.close(fd)
    commit(client, 1)
    assert receiver.policy_version == 1 and all(torch.equal(sink.state_dict[k], v) for k, v in SD.items())


def test_an_empty_shard_over_shared_memory_commits(receivers):
    """A tensor of 0 elements travels as one chunk of 0 elements (PROTOCOL.md, section 6). Over this plane it killed the
    stream's thread without an answer and held the update's staging memory for ever: every later Begin was refused
    RESOURCE_EXHAUSTED until a restart."""
    sd = {"empty": torch.zeros(0, 4), "w": SD["w"]}
    (receiver, sink), = receivers(1, config=SHM, sd=sd)
    client = WeightSyncClient(receiver.address, QUICK)
    try:
        offer = client.describe().shm_plane
        ticket = begin(client, sd, 1).data_ticket
        empty = pb.ShardHeader(name="empty", offsets=(0, 0), shape=(0, 4), xxh3_64=xxhash.xxh3_64_intdigest(b""))
        frames, payload = stream_of({"w": sd["w"]})
        fd = memfd(payload)
        try:
            hello = pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket)
            reply = shm_push(offer, hello, [fd], chunk_prefix(pb.ChunkHeader(num_elements=0, shard=empty), 0) + frames)
        finally:
            os.close(fd)
        assert reply is not None and reply.code == 0 and reply.reply.num_shards == 2, reply
        commit(client, 1)
        assert receiver.policy_version == 1 and torch.equal(sink.state_dict["w"], sd["w"])
        begin(client, sd, 2)  # and the receiver takes the next update
    finally:
        client.close()


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("corrupted", C.DATA_LOSS),  # a flipped byte: the shard's checksum
        ("short", C.OUT_OF_RANGE),  # the frames name more payload than the memfd holds
        ("oversized", C.RESOURCE_EXHAUSTED),  # bigger than the tensors the rank announced
        ("unsealed", C.INVALID_ARGUMENT),  # could shrink under a read (SIGBUS)
        ("holes", C.INVALID_ARGUMENT),  # unallocated pages
        ("no_fd", C.INVALID_ARGUMENT),
        ("two_fds", C.INVALID_ARGUMENT),
        ("pipe", C.INVALID_ARGUMENT),  # not a file: a read could wait for ever
        ("disk_file", C.INVALID_ARGUMENT),  # a file, but no shared memory: reads could wait on a disk or a network
        ("relay", C.INVALID_ARGUMENT),  # the plane relays nothing
    ],
)
def test_bad_memfds_and_hellos_are_refused_and_the_old_version_stays(one, case, code, tmp_path):
    receiver, sink, client, offer = one
    ticket = begin(client, SD, 1).data_ticket
    frames, payload = stream_of(SD)
    announced = sum(t.numel() * t.element_size() for t in SD.values())
    fds: list[int] = []
    spare: list[int] = []  # descriptors to close that are not sent
    if case == "corrupted":
        fds = [memfd(payload[:10] + bytes([payload[10] ^ 1]) + payload[11:])]
    elif case == "short":
        fds = [memfd(payload[:-4])]
    elif case == "oversized":
        fds = [memfd(payload, size=announced + 4096)]
    elif case == "unsealed":
        fds = [memfd(payload, seal=False)]
    elif case == "holes":
        fds = [memfd(b"", allocate=False, size=len(payload))]
    elif case == "two_fds":
        fds = [memfd(payload), memfd(payload)]
    elif case == "pipe":
        read_end, write_end = os.pipe()
        fds, spare = [read_end], [write_end]
    elif case == "disk_file":
        (tmp_path / "payload").write_bytes(payload)
        fds = [os.open(tmp_path / "payload", os.O_RDONLY)]
    elif case == "relay":
        fds = [memfd(payload)]
    hello = pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=ticket)
    if case == "relay":
        hello.relay.append(pb.RelayTarget(address="127.0.0.1:9", data_port=9, ticket=b"t"))
        hello.fanout = 1
    try:
        reply = shm_push(offer, hello, fds, frames)
    finally:
        for fd in fds + spare:
            os.close(fd)
    assert reply is not None and reply.code == code.value[0], (reply, code)
    opened_first = case in ("corrupted", "short")  # refused inside the stream: the update is dropped
    assert reply.unopened == (not opened_first), reply
    if opened_first:
        assert status_of(lambda: commit(client, 1)) == C.NOT_FOUND
    else:
        assert status_of(lambda: commit(client, 1)) == C.FAILED_PRECONDITION  # its stream never came
    assert receiver.policy_version == 0 and torch.equal(sink.state_dict["w"], torch.zeros(6, 8))
    with WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=4096), session_id="s") as sender:
        report = sender.push(2, rank_shards(SD, 0, 1))  # the plane still works afterwards
        assert not report.failed and report.shm_endpoints == [receiver.address]
        assert sender.commit(2) == {receiver.address: None}
    assert receiver.policy_version == 2 and all(torch.equal(sink.state_dict[k], v) for k, v in SD.items())


# -- the sender's own checks --------------------------------------------------------------------------------------
def test_a_socket_held_by_another_process_gets_no_memfd_and_no_ticket(one):
    _, _, _, offer = one
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind("\0rl-align-ws-squatter-" + os.urandom(8).hex())
    squatter.listen()
    fake = pb.ShmPlane(host_id=offer.host_id, socket_name=squatter.getsockname()[1:].decode(), pid=1, uid=offer.uid)
    fd = memfd(b"secret weights")
    try:
        hello = pb.DataHello(session_id="s", policy_version=1, rank=0, ticket=b"secret ticket")
        stream = ShmStream(fake, hello, fd, 10, stall_s=1, connect_timeout_s=1)
        conn, _ = squatter.accept()
        conn.settimeout(0.5)
        with conn:
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 10, 4)
            except TimeoutError:
                data, fds = b"", []
        assert data == b"" and fds == []  # nothing came: no hello, no ticket, no file descriptor
        outcome = stream.close()
        assert stream.unopened and outcome.code() == C.UNAVAILABLE and "not by the receiver" in outcome.details()
    finally:
        os.close(fd)
        squatter.close()


def test_a_receiver_that_stops_reading_frames_is_cut_after_the_stall_limit():
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind("\0rl-align-ws-silent-" + os.urandom(8).hex())
    silent.listen()
    offer = pb.ShmPlane(socket_name=silent.getsockname()[1:].decode(), pid=os.getpid(), uid=os.getuid())
    fd = memfd(b"x" * 4096)
    try:
        stream = ShmStream(offer, pb.DataHello(session_id="s"), fd, 30, stall_s=0.5, connect_timeout_s=1)
        conn, _ = silent.accept()  # accepted, never read
        start = time.monotonic()
        while stream.send(b"f" * 4096, 0) and time.monotonic() - start < 20:
            pass
        outcome = stream.close()
        assert outcome.code() == C.DEADLINE_EXCEEDED and "accepted no frame" in outcome.details()
        assert time.monotonic() - start < 10 and not stream.unopened
        conn.close()
    finally:
        os.close(fd)
        silent.close()


def test_mappings_are_kept_per_memfd_and_bounded_while_unused():
    mappings = MemfdMappings(max_bytes=3 * 4096)
    fds = [memfd(bytes([i]) * 4096) for i in range(4)]
    try:
        first = mappings.acquire(fds[0], 4096)
        other = os.dup(fds[0])  # another descriptor of the same file, as each stream brings
        again = mappings.acquire(other, 4096)
        os.close(other)
        assert again is first and first.users == 2 and int(first.view[0]) == 0  # the same file: the same mapping
        mappings.release(first)
        mappings.release(again)
        held = [mappings.acquire(fd, 4096) for fd in fds[1:]]  # 4 mappings of 4 KiB, 3 allowed unused
        assert [int(m.view[0]) for m in held] == [1, 2, 3]
        for m in held:
            mappings.release(m)
        assert first.mapped is None and first.view.size == 0  # the least recently used one was unmapped
        assert all(m.mapped is not None for m in held)
        np.testing.assert_array_equal(mappings.acquire(fds[3], 4096).view, np.full(4096, 3, np.uint8))
    finally:
        mappings.close()
        for fd in fds:
            os.close(fd)



def test_mappings_of_many_tiny_memfds_are_bounded_in_count_too():
    # Each mapping holds a descriptor: a client pushing 64-byte memfds filled the receiver's descriptor table while
    # the byte bound (the manifest's size) allowed ~131,000 of them.
    mappings = MemfdMappings(max_bytes=1 << 30, max_entries=8)
    before = len(os.listdir("/proc/self/fd"))
    try:
        for i in range(40):
            fd = memfd(bytes([i]) * 64)
            mappings.release(mappings.acquire(fd, 64))
            os.close(fd)  # the stream's own descriptor goes; the cached mapping keeps its own
        assert len(os.listdir("/proc/self/fd")) - before <= 8
    finally:
        mappings.close()
    assert len(os.listdir("/proc/self/fd")) <= before
