"""Cases: the shared-memory data plane (PROTOCOL.md 8.1): a stream whose payloads lie in a memfd passed with its
hello, and every refusal of the hello, the memfd and the frames. Skipped unless the receiver offers the plane on the
kit's own host."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import need, require
from weight_sync.conformance.kit import Kit
from weight_sync.conformance.streams import memfd
from weight_sync.conformance.wire import box_checksum, other_ticket
from weight_sync.spec import TensorSpec

GROUP = CaseGroup()


def shm_update(kit: Kit, before: Sequence[TensorSpec] = ()) -> tuple[int, TensorSpec, pb.DataHello, np.ndarray]:
    """Begin an update of the probe (after the tensors ``before``) at the next version, for a receiver with a
    shared-memory plane: (version, probe, the rank's hello with the ticket Begin handed out, fresh values of the
    probe)."""
    kit.need_shm()
    probe = kit.need_probe()
    version = kit.version + 1
    reply = kit.begin(kit.begin_request(version, [*before, probe]))
    require(len(reply.data_ticket) > 0, "Begin handed out no data ticket although Describe offers a shm plane")
    hello = pb.DataHello(session_id=kit.session(), policy_version=version, rank=0, ticket=reply.data_ticket)
    return version, probe, hello, kit.values(probe)


@contextmanager
def payload_memfd(
    chunks: list[pb.PushChunk], *, seal: bool = True, allocate: bool = True, extra_bytes: int = 0
) -> Iterator[int]:
    """A memfd holding the chunks' payloads one after another (`streams.memfd` options), closed afterwards."""
    fd = memfd(b"".join(c.payload for c in chunks), seal=seal, allocate=allocate, extra_bytes=extra_bytes)
    try:
        yield fd
    finally:
        os.close(fd)


def _refused_unopened(kit: Kit, hello: pb.DataHello | bytes, fds: list[int]) -> str:
    """Send `hello` with `fds` and read the answer, which must say the stream never opened."""
    connection = kit.shm_connect(hello, fds)
    got = connection.reply(end=False)
    require(connection.unopened is True, f"{got} answered unopened = {connection.unopened}")
    return got


@GROUP.case("OK")
def shm_push_commit(kit: Kit) -> str:
    """A rank's stream over shared memory (hello + memfd, payload-less frames, u32 0) gets DataReply OK and commits
    the values the memfd held."""
    version, probe, hello, values = shm_update(kit)
    return _stream_and_commit(kit, version, hello, kit.chunks(probe, values), {probe.name: values})


@GROUP.case("OK")
def shm_empty_shard(kit: Kit) -> str:
    """A stream whose first shard is a tensor of 0 elements (one chunk of 0 elements, no payload in the memfd), then
    the probe: DataReply OK, and the update commits (PROTOCOL.md 6 and 8.1)."""
    empty = need(next((s for s in kit.manifest.values() if s.numel == 0), None), "tensor with 0 elements")
    version, probe, hello, values = shm_update(kit, before=[empty])
    chunks = kit.chunks(empty, kit.values(empty)) + kit.chunks(probe, values)
    return _stream_and_commit(kit, version, hello, chunks, {probe.name: values})


def _stream_and_commit(
    kit: Kit, version: int, hello: pb.DataHello, chunks: list[pb.PushChunk], values: dict[str, np.ndarray]
) -> str:
    """Send ``chunks`` as the rank's one stream (their payloads in a memfd), require DataReply OK, commit ``version``
    and remember ``values`` as what it holds."""
    with payload_memfd(chunks) as fd:
        got = kit.shm_connect(hello, [fd]).frames(chunks).reply()
    require(got == "OK", f"DataReply {got}")
    kit.commit(version)
    kit.remember(version, values)
    return got


@GROUP.case("INVALID_ARGUMENT")
def shm_hello_without_memfd(kit: Kit) -> str:
    """A hello that brings no file descriptor is refused, unopened."""
    _, _, hello, _ = shm_update(kit)
    return _refused_unopened(kit, hello, [])


@GROUP.case("INVALID_ARGUMENT")
def shm_hello_with_two_memfds(kit: Kit) -> str:
    """A hello that brings two file descriptors is refused, unopened."""
    _, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values)
    with payload_memfd(chunks) as first, payload_memfd(chunks) as second:
        return _refused_unopened(kit, hello, [first, second])


@GROUP.case("INVALID_ARGUMENT")
def shm_relay_refused(kit: Kit) -> str:
    """A shared-memory hello asking for a relay is refused, unopened: this plane relays nothing."""
    _, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values)
    hello.relay.append(pb.RelayTarget(address="127.0.0.1:9", data_port=9, ticket=b"t"))
    hello.fanout = 1
    with payload_memfd(chunks) as fd:
        return _refused_unopened(kit, hello, [fd])


@GROUP.case("INVALID_ARGUMENT")
def shm_pipe_is_no_memfd(kit: Kit) -> str:
    """A descriptor that is no shared-memory file (a pipe) is refused, unopened."""
    _, _, hello, _ = shm_update(kit)
    read_end, write_end = os.pipe()
    try:
        return _refused_unopened(kit, hello, [read_end])
    finally:
        os.close(read_end)
        os.close(write_end)


@GROUP.case("INVALID_ARGUMENT")
def shm_unsealed_memfd(kit: Kit) -> str:
    """A memfd not sealed against shrinking is refused, unopened (a read past a shrunk end would kill the receiver)."""
    _, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values)
    with payload_memfd(chunks, seal=False) as fd:
        return _refused_unopened(kit, hello, [fd])


@GROUP.case("INVALID_ARGUMENT")
def shm_memfd_with_holes(kit: Kit) -> str:
    """A memfd with unallocated pages is refused, unopened."""
    _, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values)
    with payload_memfd(chunks, allocate=False, extra_bytes=1 << 16) as fd:
        return _refused_unopened(kit, hello, [fd])


@GROUP.case("UNAUTHENTICATED")
def shm_wrong_ticket(kit: Kit) -> str:
    """A shared-memory hello with another ticket is refused, unopened."""
    _, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values)
    hello.ticket = other_ticket(hello.ticket)
    with payload_memfd(chunks) as fd:
        return _refused_unopened(kit, hello, [fd])


@GROUP.case("RESOURCE_EXHAUSTED")
def shm_memfd_larger_than_announced(kit: Kit) -> str:
    """A memfd larger than the tensors the rank's Begin announced is refused, unopened."""
    _, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values)
    with payload_memfd(chunks, extra_bytes=probe.nbytes + (1 << 16)) as fd:
        return _refused_unopened(kit, hello, [fd])


@GROUP.case("OUT_OF_RANGE")
def shm_payload_past_the_end(kit: Kit) -> str:
    """A frame whose payload runs past the end of the memfd fails the stream and drops the update."""
    version, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values)
    with payload_memfd(chunks[:-1] + [pb.PushChunk(header=chunks[-1].header)]) as fd:
        got = kit.shm_connect(hello, [fd]).frames(chunks).reply()
    kit.require_dropped(version, "the update survived a payload past the memfd's end: Commit answered {}")
    return got


@GROUP.case("DATA_LOSS")
def shm_bad_checksum(kit: Kit) -> str:
    """A shard whose xxh3_64 does not match the memfd's bytes is refused on the shared-memory plane too."""
    _, probe, hello, values = shm_update(kit)
    chunks = kit.chunks(probe, values, checksum=box_checksum(probe, values) ^ 1)
    with payload_memfd(chunks) as fd:
        return kit.shm_connect(hello, [fd]).frames(chunks).reply()
