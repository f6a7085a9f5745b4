"""Cases: the checks on a Push stream's chunks (shard boxes, order and sizes, encodings, checksums, delta payloads);
each refusal drops the whole update."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np
import zstandard

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import need, require
from weight_sync.conformance.kit import Kit
from weight_sync.conformance.wire import box_checksum, rows
from weight_sync.spec import TensorSpec, itemsize

GROUP = CaseGroup()
Messages = Callable[[Kit, TensorSpec, np.ndarray], Sequence[pb.PushChunk | bytes]]
Chunks = Callable[[Kit, TensorSpec, np.ndarray], list[pb.PushChunk]]


def _chunk_refusal(expected: str, make: Messages, doc: str, delta_base: bool = False) -> None:
    """Register a case (`doc`: "name: what the stream has"): a Push stream of the messages `make` builds is refused
    with `expected`, and the update is dropped (Commit: NOT_FOUND). `delta_base`: Begin with the committed base."""

    def run(kit: Kit) -> str:
        probe = kit.need_probe()
        if delta_base:
            kit.need_delta()
            version, reply = kit.begin_delta(probe)
        else:
            version = kit.version + 1
            reply = kit.begin(kit.begin_request(version, [probe]))
        require(reply.delta_accepted == delta_base, f"delta_accepted {reply.delta_accepted}")
        got = kit.stream(version).send(*make(kit, probe, kit.values(probe))).close()
        kit.require_dropped(version, "Commit after the refused stream answered {}: the update was not dropped")
        return got

    GROUP.refusal(expected, doc, "refuse a Push stream with {}, dropping the update", run)


def _edit(edit: Callable[[pb.PushChunk], None]) -> Chunks:
    """The whole tensor's chunks with `edit` applied to the first."""

    def build(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
        chunks = k.chunks(p, v)
        edit(chunks[0])
        return chunks

    return build


def _named(name: str) -> Chunks:
    return _edit(lambda c: setattr(c.header.shard, "name", name))


def _unannounced(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    other = next((s for s in k.manifest.values() if s.name != p.name), None)
    return _named(need(other, "second tensor").name)(k, p, v)


def _twice(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return k.chunks(p, v, rows(p, 0, 1)) + k.chunks(p, v, rows(p, 0, 1))


def _too_many_elements(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return k.chunks(p, v) + k.chunks(p, v, rows(p, 1, 2))


def _past_end(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    chunks = k.chunks(p, v, rows(p, 0, 1))
    chunks[-1].header.num_elements += 1
    chunks[-1].payload += chunks[-1].payload[: itemsize(p.dtype)]
    return chunks


def _empty(c: pb.PushChunk) -> None:
    c.header.num_elements, c.payload = 0, b""


def _over_limit(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    chunks = k.chunks(p, v)
    chunks[0].header.num_elements, chunks[0].payload = 1, bytes(k.max_chunk_bytes + 8)
    return chunks


def _encoding(value: int) -> Chunks:
    return _edit(lambda c: setattr(c.header, "encoding", value))


def _bad_checksum(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return k.chunks(p, v, checksum=box_checksum(p, v) ^ 1)


def _unfinished_shard(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    first = k.chunks(p, v)[0]
    cut = first.header.num_elements - 1
    first.header.num_elements = cut
    first.payload = first.payload[: cut * itemsize(p.dtype)]
    return [first]


def _shard_before_end(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return _unfinished_shard(k, p, v) + k.chunks(p, v, rows(p, 1, 2))


def _undecodable(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk | bytes]:
    return [b"\xff" * 16]  # a tag varint that never ends: no protobuf message


def _sparse(make: Callable[[int, int], bytes]) -> Chunks:
    """A stream of SPARSE chunks whose payloads `make(num_elements, itemsize)` builds."""

    def build(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
        chunks = k.chunks(p, v)
        for c in chunks:
            c.header.encoding = pb.ENCODING_SPARSE
            c.payload = make(c.header.num_elements, itemsize(p.dtype))
        return chunks

    return build


def _xor_wrong_size(c: pb.PushChunk) -> None:
    c.header.encoding = pb.ENCODING_XOR_ZSTD
    c.payload = zstandard.ZstdCompressor().compress(bytes(len(c.payload) + 8))


_chunk_refusal("INVALID_ARGUMENT", _edit(lambda c: c.header.ClearField("shard")),
               "push_first_chunk_without_shard: a stream's first chunk lacks a shard")
_chunk_refusal("NOT_FOUND", _named("no.such.tensor"), "push_unknown_tensor: a shard of a tensor not in the manifest")
_chunk_refusal("FAILED_PRECONDITION", _unannounced, "push_unannounced_tensor: a shard of a tensor Begin did not list")
_chunk_refusal("OUT_OF_RANGE", _edit(lambda c: c.header.shard.offsets.__setitem__(0, 1)),
               "push_box_outside_tensor: a shard box reaching past the tensor")
_chunk_refusal("INVALID_ARGUMENT", _twice, "push_box_twice: the same shard box pushed twice")
_chunk_refusal("INVALID_ARGUMENT", _too_many_elements, "push_more_elements_than_tensor: shards holding > numel")
_chunk_refusal("INVALID_ARGUMENT", _edit(lambda c: setattr(c.header, "element_offset", 1)),
               "push_chunk_out_of_order: element_offset not where the shard is")
_chunk_refusal("OUT_OF_RANGE", _past_end, "push_chunk_past_shard_end: a chunk running past its shard")
_chunk_refusal("OUT_OF_RANGE", _edit(_empty), "push_empty_chunk: a chunk of 0 elements in a non-empty shard")
_chunk_refusal("RESOURCE_EXHAUSTED", _over_limit, "push_payload_over_limit: a payload of max_chunk_bytes + 8")
_chunk_refusal("INVALID_ARGUMENT", _edit(lambda c: setattr(c, "payload", c.payload[:-1])),
               "push_raw_payload_wrong_size: RAW payload != num_elements x size")
_chunk_refusal("INVALID_ARGUMENT", _encoding(7), "push_unknown_encoding: encoding 7")
_chunk_refusal("FAILED_PRECONDITION", _encoding(pb.ENCODING_SPARSE),
               "push_delta_not_accepted: a SPARSE chunk although Begin accepted no delta")
_chunk_refusal("DATA_LOSS", _bad_checksum, "push_bad_checksum: a shard whose xxh3_64 does not match")
_chunk_refusal("INVALID_ARGUMENT", _shard_before_end, "push_shard_before_previous_ended: a new shard mid-shard")
_chunk_refusal("INVALID_ARGUMENT", _unfinished_shard, "push_stream_ends_inside_shard: a stream ending mid-shard")
_chunk_refusal("INVALID_ARGUMENT", _undecodable, "push_undecodable_message: bytes that are no PushChunk")
_chunk_refusal("DATA_LOSS", _sparse(lambda n, size: struct.pack("<II", 1, 0) + bytes(2 * size)),
               "delta_sparse_indices_not_increasing: SPARSE indices 1, 0", delta_base=True)
_chunk_refusal("DATA_LOSS", _sparse(lambda n, size: struct.pack("<I", n) + bytes(size)),
               "delta_sparse_index_out_of_range: a SPARSE index = num_elements", delta_base=True)
_chunk_refusal("DATA_LOSS", _sparse(lambda n, size: bytes(4 + size + 1)),
               "delta_sparse_ragged_payload: a SPARSE payload that is no whole number of pairs", delta_base=True)
_chunk_refusal("DATA_LOSS", _edit(_xor_wrong_size), "delta_xor_wrong_content_size: a zstd frame of another size",
               delta_base=True)
