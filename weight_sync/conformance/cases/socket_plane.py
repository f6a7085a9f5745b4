"""Cases: the socket data plane (hello, tickets, frame limits, the checks a gRPC stream gets, Abort, `unopened`)."""

from __future__ import annotations

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import CaseSkipped, require
from weight_sync.conformance.kit import Kit
from weight_sync.conformance.wire import MAX_HEADER_BYTES, U32, box_checksum, other_ticket
from weight_sync.spec import TensorSpec

GROUP = CaseGroup()


def socket_update(kit: Kit, num_streams: int = 1) -> tuple[int, TensorSpec, pb.DataHello]:
    """Begin an update of the probe at the next version, for a receiver with a socket plane: (version, probe, the
    rank's hello with the ticket Begin handed out)."""
    kit.need_socket()
    probe = kit.need_probe()
    version = kit.version + 1
    reply = kit.begin(kit.begin_request(version, [probe], num_streams=num_streams))
    require(len(reply.data_ticket) > 0, "Begin handed out no data ticket although Describe offers a data port")
    hello = pb.DataHello(session_id=kit.session(), policy_version=version, rank=0, ticket=reply.data_ticket)
    return version, probe, hello


@GROUP.case("OK")
def socket_push_commit(kit: Kit) -> str:
    """A rank's stream as a TCP connection (hello, frames, u32 0) gets DataReply OK and commits."""
    version, probe, hello = socket_update(kit)
    values = kit.values(probe)
    got = kit.connect(hello).chunks(kit.chunks(probe, values)).reply()
    require(got == "OK", f"DataReply {got}")
    kit.commit(version)
    kit.remember(version, {probe.name: values})
    return got


@GROUP.case("UNAUTHENTICATED")
def socket_wrong_ticket(kit: Kit) -> str:
    """A hello with another ticket is refused."""
    _, _, hello = socket_update(kit)
    hello.ticket = other_ticket(hello.ticket)
    return kit.connect(hello).reply(end=False)


@GROUP.case("NOT_FOUND")
def socket_without_update(kit: Kit) -> str:
    """A hello naming no open update is refused."""
    _, _, hello = socket_update(kit)
    hello.session_id = kit.session("none")
    return kit.connect(hello).reply(end=False)


@GROUP.case("ALREADY_EXISTS")
def socket_extra_connection(kit: Kit) -> str:
    """A connection beyond the rank's num_streams is refused (gRPC and socket streams count together)."""
    _, probe, hello = socket_update(kit, num_streams=1)
    first = kit.connect(hello).chunks(kit.chunks(probe, kit.values(probe)))
    require(first.reply() == "OK", "the first connection failed")
    return kit.connect(hello).reply(end=False)


@GROUP.case("INVALID_ARGUMENT")
def socket_malformed_hello(kit: Kit) -> str:
    """A hello frame that is no DataHello is refused."""
    kit.need_socket()
    return kit.connect(U32.pack(16) + b"\xff" * 16).reply(end=False)


@GROUP.case("INVALID_ARGUMENT")
def socket_oversized_hello(kit: Kit) -> str:
    """A hello frame announcing more than 65536 bytes is refused before it is read."""
    kit.need_socket()
    return kit.connect(U32.pack(MAX_HEADER_BYTES + 1)).reply(end=False)


@GROUP.case("INVALID_ARGUMENT")
def socket_oversized_chunk_header(kit: Kit) -> str:
    """A chunk header frame announcing more than 65536 bytes is refused."""
    _, _, hello = socket_update(kit)
    return kit.connect(hello).send(U32.pack(MAX_HEADER_BYTES + 1)).reply(end=False)


@GROUP.case("RESOURCE_EXHAUSTED")
def socket_payload_over_limit(kit: Kit) -> str:
    """A payload length over max_chunk_bytes is refused from the frame header, before any payload is sent."""
    _, probe, hello = socket_update(kit)
    chunk = kit.first_chunk(probe)
    chunk.header.num_elements = 1
    return kit.connect(hello).chunk(chunk, payload_len=kit.max_chunk_bytes + 8).reply(end=False)


@GROUP.case("DATA_LOSS")
def socket_bad_checksum(kit: Kit) -> str:
    """A shard whose xxh3_64 does not match is refused on the socket plane too."""
    _, probe, hello = socket_update(kit)
    values = kit.values(probe)
    return kit.connect(hello).chunks(kit.chunks(probe, values, checksum=box_checksum(probe, values) ^ 1)).reply()


@GROUP.case("PERMISSION_DENIED")
def socket_relay_not_announced(kit: Kit) -> str:
    """A hello asking to relay to a receiver the rank's Begin did not announce is refused; nothing is opened."""
    _, _, hello = socket_update(kit)
    hello.relay.append(pb.RelayTarget(address="127.0.0.1:9", data_port=9, ticket=b"t"))
    hello.fanout = 1
    return kit.connect(hello).reply(end=False)


@GROUP.case("ABORTED")
def socket_abort_cuts_connection(kit: Kit) -> str:
    """Abort cuts an open socket stream of the update: the connection gets DataReply ABORTED."""
    version, probe, hello = socket_update(kit)
    connection = kit.connect(hello).chunk(kit.first_chunk(probe))
    kit.abort_open(version)
    return connection.reply(end=False)


@GROUP.case("UNAUTHENTICATED")
def socket_refusal_before_open_is_unopened(kit: Kit) -> str:
    """A hello refused before its stream opened says so (DataReply.unopened, 1.1); a refusal after that does not."""
    if kit.minor < 1:
        raise CaseSkipped(f"DataReply.unopened is protocol 1.1; the receiver speaks 1.{kit.minor}")
    _, _, hello = socket_update(kit)
    wrong = pb.DataHello()
    wrong.CopyFrom(hello)
    wrong.ticket = other_ticket(hello.ticket)
    refused = kit.connect(wrong)
    got = refused.reply(end=False)
    require(refused.unopened is True, f"a refused hello answered unopened = {refused.unopened}")
    opened = kit.connect(hello).send(U32.pack(MAX_HEADER_BYTES + 1))
    late = opened.reply(end=False)
    require(late == "INVALID_ARGUMENT" and opened.unopened is False, f"after the hello: {late}, {opened.unopened}")
    return got
