"""Cases: delta pushes against the committed base (SPARSE, XOR_ZSTD), when a Begin gets one, and the decoded-size
limit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import CaseSkipped, need, require
from weight_sync.conformance.kit import Kit
from weight_sync.conformance.wire import sparse_payload, xor_payload
from weight_sync.spec import itemsize

GROUP = CaseGroup()


def _delta_push(kit: Kit, encode: Callable[[np.ndarray, np.ndarray], bytes], encoding: pb.Encoding) -> str:
    """Push a few changed elements of the probe as `encoding` chunks against the committed base, and commit."""
    kit.need_delta()
    probe = kit.need_probe()
    version, reply = kit.begin_delta(probe)
    require(reply.delta_accepted, "Begin with base_version = the current version accepted no delta")
    base = kit.committed[probe.name]
    new = base.copy()
    new[:: max(1, new.shape[0] // 3)] ^= 1  # a few changed elements
    chunks = kit.chunks(probe, new)
    for c in chunks:
        start = c.header.element_offset
        part = slice(start, start + c.header.num_elements)
        c.header.encoding = encoding
        c.payload = encode(new[part], base[part])
    require(kit.stream(version).send(*chunks).close() == "OK", "the delta stream was refused")
    kit.commit(version)
    kit.remember(version, {probe.name: new})
    return "OK"


@GROUP.case("OK")
def delta_sparse(kit: Kit) -> str:
    """SPARSE chunks against the committed base decode to the new values (checked by xxh3_64) and commit."""
    return _delta_push(kit, sparse_payload, pb.ENCODING_SPARSE)


@GROUP.case("OK")
def delta_xor_zstd(kit: Kit) -> str:
    """XOR_ZSTD chunks against the committed base decode to the new values (checked by xxh3_64) and commit."""
    return _delta_push(kit, xor_payload, pb.ENCODING_XOR_ZSTD)


@GROUP.case("OK")
def delta_refused_for_old_base(kit: Kit) -> str:
    """A Begin whose base_version is not the current version opens the update without delta (delta_accepted false)."""
    probe = kit.need_probe()
    current = kit.version
    reply = kit.begin(kit.begin_request(current + 1, [probe], base_version=max(current - 1, 0) if current else 7))
    require(not reply.delta_accepted, "delta accepted against a base that is not the current version")
    return "OK"


@GROUP.case("OK")
def delta_base_dropped(kit: Kit) -> str:
    """(1.3) After an update whose Begin set drop_base, a Begin against that version gets no delta (the receiver kept
    no base of it); the next update without drop_base is a base again."""
    kit.need_delta()
    if kit.minor < 3:
        raise CaseSkipped(f"BeginRequest.drop_base is protocol 1.3; the receiver speaks 1.{kit.minor}")
    probe = kit.need_probe()
    kit.push_and_commit(kit.version + 1, [probe], drop_base=True)
    current = kit.version
    reply = kit.begin(kit.begin_request(current + 1, [probe], base_version=current))
    require(not reply.delta_accepted, "delta accepted against a version committed with drop_base")
    kit.abort(current + 1)
    kit.push_and_commit(current + 2, [probe])  # a base again for the cases after this one
    _, reply = kit.begin_delta(probe)
    require(reply.delta_accepted, "no delta against a version committed without drop_base")
    return "OK"


@GROUP.case("RESOURCE_EXHAUSTED")
def delta_decoded_over_limit(kit: Kit) -> str:
    """A delta chunk decoding to more than max_chunk_bytes (num_elements x size) is refused, however small."""
    kit.need_delta()
    big = need(kit.big, f"tensor larger than max_chunk_bytes ({kit.max_chunk_bytes})")
    version, reply = kit.begin_delta(big)
    require(reply.delta_accepted, "no delta")
    chunk = kit.first_chunk(big)
    chunk.header.num_elements = kit.max_chunk_bytes // itemsize(big.dtype) + 1
    chunk.header.encoding = pb.ENCODING_SPARSE
    chunk.payload = b""  # k = 0: every element equals the base
    return kit.stream(version).send(chunk).close()
