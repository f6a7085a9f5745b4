"""Conformance kit: the cases of `weight_sync/PROTOCOL.md`, run against any receiver like an outside client would.

    python -m weight_sync conformance --to HOST:PORT [--token TOKEN] [--case NAME ...] [--include_pending]

Each case is a small function with a name, what it checks (its docstring) and the status it expects; the kit prints
a pass/fail table and exits 1 when a case fails. It speaks only the public protocol: stock protobuf messages over
the gRPC service and hand-written frames on the socket data plane; chunking, checksums and delta payloads are built
here from the written rules, not with the sender's code.

What it needs and what it changes: a receiver nobody else pushes to while the kit runs, whose manifest it reads with
Describe. Positive cases push synthetic values into a few of the smallest tensors (`probe`: the smallest tensor with
at least 4 rows; `big`: the smallest one larger than a chunk) and commit them as the next versions, so run it only
against a receiver whose weights may be overwritten (the kit's session is then the receiver's trainer session until
the real trainer commits again). Everything else it opens (updates, streams, connections) it aborts or closes before
the next case, so the receiver ends idle at a newer version. Cases that wait for one of the receiver's own timeouts
(hello, idle streams) wait at most `max_wait_s`.

A case whose expected status depends on work that has not landed in this repository is `pending` (none today): it is
skipped with the reason unless `include_pending` is set.
"""

from __future__ import annotations

import dataclasses
import queue
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from types import EllipsisType

import grpc
import numpy as np
import xxhash
import zstandard

from protos import weight_sync_pb2 as pb
from protos import weight_sync_pb2_grpc as pb_grpc
from weight_sync.channel import client_channel
from weight_sync.config import WeightSyncConfig
from weight_sync.spec import TensorSpec, element_dtype, itemsize
from weight_sync.version import protocol_version

__all__ = ["CASES", "Case", "Result", "format_table", "run_conformance"]

SERVICE = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
MAX_HEADER_BYTES = 1 << 16  # PROTOCOL.md: hello and chunk-header frames
FUSED_MEMBERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # fused in vLLM: avoid pushing one alone
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
Code = grpc.StatusCode


class CaseFailed(Exception):
    """A step of a case went otherwise than the protocol says (the message says how)."""


class CaseSkipped(Exception):
    """The receiver cannot run this case (no socket plane, no token, no tensor of the right size, ...)."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CaseFailed(message)


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case: `run(kit)` returns the status it observed, which must equal `expected`."""

    name: str
    checks: str
    expected: str
    run: Callable[[Kit], str]
    pending: str | None = None
    """Why the expectation depends on work not landed yet; such a case is skipped unless asked for."""


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    expected: str
    got: str
    outcome: str  # PASS, FAIL or SKIP
    detail: str = ""


CASES: list[Case] = []


def case(
    expected: str, pending: str | None = None, *, name: str | None = None, checks: str | None = None
) -> Callable[[Callable[[Kit], str]], Callable[[Kit], str]]:
    """Register a case function; its name is the case name (or `name`), its docstring's first line what it checks
    (or `checks`)."""

    def register(fn: Callable[[Kit], str]) -> Callable[[Kit], str]:
        what = checks or (fn.__doc__ or "").strip().splitlines()[0]
        CASES.append(Case(name or fn.__name__, what, expected, fn, pending))
        return fn

    return register


# -- wire helpers: values, chunks, frames -------------------------------------------------------------------------
def synthetic(spec: TensorSpec, seed: int) -> np.ndarray:
    """Flat little-endian element bit patterns of plausible values for `spec` (finite floats, small integers)."""
    rng = np.random.default_rng(seed)
    n, dtype = spec.numel, spec.dtype
    if dtype in ("float64", "float32", "float16"):
        values = rng.uniform(-1, 1, n).astype(f"<f{itemsize(dtype)}")
    elif dtype == "bfloat16":
        values = (rng.uniform(-1, 1, n).astype("<f4").view("<u4") >> 16).astype("<u2")
    elif dtype.startswith("float8"):
        values = rng.integers(0x20, 0x38, n, dtype=np.uint8)  # small positive normals in both float8 formats
    elif dtype == "bool":
        values = rng.integers(0, 2, n, dtype=np.uint8)
    else:
        values = rng.integers(0, 100, n).astype(f"<{np.dtype(dtype).str[1:]}")
    return values.view(element_dtype(dtype).newbyteorder("<"))


def box_values(spec: TensorSpec, values: np.ndarray, offsets: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """The elements of the box (`offsets`, `shape`) of a tensor held flat in `values`, in C order."""
    box: tuple[EllipsisType | slice, ...] = (Ellipsis, *(slice(o, o + s) for o, s in zip(offsets, shape)))
    return np.ascontiguousarray(values.reshape(spec.shape)[box]).reshape(-1)


def shard_chunks(
    spec: TensorSpec, values: np.ndarray, offsets: Sequence[int], shape: Sequence[int], max_chunk_bytes: int,
    *, checksum: int | None = None,
) -> list[pb.PushChunk]:
    """RAW chunks of one shard, each at most `max_chunk_bytes`, the first with the ShardHeader (xxh3_64, seed 0)."""
    box = box_values(spec, values, offsets, shape)
    digest = xxhash.xxh3_64_intdigest(box.tobytes()) if checksum is None else checksum
    header = pb.ShardHeader(name=spec.name, offsets=offsets, shape=shape, xxh3_64=digest)
    step = max(1, max_chunk_bytes // box.itemsize)
    chunks = []
    for begin in range(0, max(box.shape[0], 1), step):
        part = box[begin : begin + step]
        chunk = pb.PushChunk(
            header=pb.ChunkHeader(element_offset=begin, num_elements=part.shape[0]), payload=part.tobytes()
        )
        if begin == 0:
            chunk.header.shard.CopyFrom(header)
        chunks.append(chunk)
    return chunks


def whole(spec: TensorSpec) -> tuple[list[int], list[int]]:
    return [0] * len(spec.shape), list(spec.shape)


def rows(spec: TensorSpec, start: int, stop: int) -> tuple[list[int], list[int]]:
    """The box of rows [start, stop) along dim 0."""
    return [start] + [0] * (len(spec.shape) - 1), [stop - start, *spec.shape[1:]]


def sparse_payload(new: np.ndarray, base: np.ndarray) -> bytes:
    """SPARSE: k u32 little-endian indices (strictly increasing, relative to the chunk), then the k new values."""
    idx = np.flatnonzero(new != base).astype("<u4")
    return idx.tobytes() + new[idx].tobytes()


def xor_payload(new: np.ndarray, base: np.ndarray) -> bytes:
    """XOR_ZSTD: one zstd frame, content size in its header, of the XOR of the chunk's new and base bytes."""
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(np.bitwise_xor(new, base).tobytes())


def status_name(code: int) -> str:
    return next((c.name for c in Code if c.value[0] == code), f"code {code}")


# -- the receiver under test --------------------------------------------------------------------------------------
class Stream:
    """One gRPC Push stream of `Kit`, fed message by message and kept open until `close`."""

    def __init__(self, kit: Kit, metadata: tuple[tuple[str, str], ...], timeout_s: float | None = None) -> None:
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._timeout_s = timeout_s or kit.timeout_s
        self.future = kit.push_method.future(
            self._messages(), metadata=kit.metadata + metadata, timeout=self._timeout_s
        )
        kit.streams.append(self)

    def _messages(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not None:
            yield item

    def send(self, *messages: pb.PushChunk | bytes) -> Stream:
        for message in messages:
            self._queue.put(message if isinstance(message, bytes) else message.SerializeToString())
        return self

    def wait(self) -> str:
        """The status the stream ended with, without ending it from this side (for streams the receiver cuts)."""
        try:
            self.future.result(timeout=self._timeout_s)
        except grpc.RpcError as e:
            return e.code().name
        except futures.TimeoutError:
            return "NO ANSWER"
        return "OK"

    def close(self) -> str:
        """End the stream and return the receiver's status for it."""
        self._queue.put(None)
        return self.wait()

    def stop(self) -> None:
        self._queue.put(None)
        self.future.cancel()


class Connection:
    """One socket data-plane connection of `Kit` (frames as PROTOCOL.md writes them)."""

    def __init__(self, kit: Kit, hello: pb.DataHello | bytes) -> None:
        require(kit.data_port > 0, "no data port")
        self.sock = socket.create_connection((kit.host, kit.data_port), timeout=kit.timeout_s)
        self.unopened: bool | None = None  # DataReply.unopened, once answered
        kit.connections.append(self)
        data = hello if isinstance(hello, bytes) else _U32.pack(hello.ByteSize()) + hello.SerializeToString()
        self.send(data)

    def send(self, data: bytes) -> Connection:
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # the receiver refused the stream and closed its side: its reply says why
        return self

    def chunk(self, chunk: pb.PushChunk, payload_len: int | None = None) -> Connection:
        """Frame: u32 header length, ChunkHeader, u64 payload length, payload (`payload_len`: announce, send none)."""
        head = chunk.header.SerializeToString()
        if payload_len is not None:
            return self.send(_U32.pack(len(head)) + head + _U64.pack(payload_len))
        return self.send(_U32.pack(len(head)) + head + _U64.pack(len(chunk.payload)) + chunk.payload)

    def reply(self, end: bool = True, wait_s: float | None = None) -> str:
        """Send the end-of-stream frame (when `end`) and read the DataReply (within `wait_s`, default the kit's call
        timeout): its status name; `unopened` keeps its flag."""
        if end:
            self.send(_U32.pack(0))
        try:
            if wait_s is not None:
                self.sock.settimeout(wait_s)
            (n,) = _U32.unpack(_recv(self.sock, 4))
            reply = pb.DataReply.FromString(_recv(self.sock, n))
        except (OSError, ConnectionError) as e:
            return f"NO REPLY ({e!r})"
        self.unopened = reply.unopened
        return status_name(reply.code)

    def close(self) -> None:
        self.sock.close()


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed before the end of the reply")
        data += part
    return data


class Kit:
    """The receiver under test: its stubs, manifest and limits, and what the current case opened (undone after it)."""

    def __init__(
        self, address: str, config: WeightSyncConfig, timeout_s: float, probe: str | None = None,
        max_wait_s: float = 60.0,
    ) -> None:
        self.address, self.config, self.timeout_s, self.max_wait_s = address, config, timeout_s, max_wait_s
        self.host = address.rpartition(":")[0].strip("[]")
        self.channel = client_channel(address, config)
        self.stub = pb_grpc.WeightSyncStub(self.channel)
        token = config.resolve_token()
        self.token = token
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.push_method = self.channel.stream_unary(
            f"/{SERVICE}/Push", request_serializer=bytes, response_deserializer=pb.PushReply.FromString
        )
        self.begin_raw = self.channel.unary_unary(
            f"/{SERVICE}/Begin", request_serializer=bytes, response_deserializer=pb.BeginReply.FromString
        )
        described = self.describe()
        self.manifest = {s.name: TensorSpec(s.name, tuple(s.shape), s.dtype) for s in described.manifest}
        self.max_chunk_bytes = described.max_chunk_bytes
        self.delta_supported = described.delta_supported
        self.data_port = described.data_port
        self.minor = described.protocol_version.minor if described.protocol_version.major else 0
        if probe is not None and probe not in self.manifest:
            raise ValueError(f"tensor {probe!r} is not in {address}'s manifest")
        self.probe = self.manifest[probe] if probe else self._pick(lambda s: len(s.shape) >= 1 and s.shape[0] >= 4)
        self.big = self._pick(lambda s: s.nbytes > self.max_chunk_bytes)
        self.prefix = f"conformance-{secrets.token_hex(3)}"
        self.committed: dict[str, np.ndarray] = {}  # what this kit committed last, per tensor (the receiver's base)
        self.committed_version = -1
        self.streams: list[Stream] = []
        self.connections: list[Connection] = []
        self.opened: set[tuple[str, int]] = set()
        self._seed = 0

    def _pick(self, fits: Callable[[TensorSpec], bool]) -> TensorSpec | None:
        """The smallest non-empty tensor that `fits`, members of commonly fused groups last."""
        candidates = [s for s in self.manifest.values() if fits(s) and s.numel]
        candidates.sort(key=lambda s: (any(f".{m}." in s.name for m in FUSED_MEMBERS), s.nbytes, s.name))
        return candidates[0] if candidates else None

    # -- calls ---------------------------------------------------------------------------------------------------
    def describe(self) -> pb.DescribeReply:
        return self.stub.Describe(pb.DescribeRequest(), metadata=self.metadata, timeout=self.timeout_s)

    @property
    def version(self) -> int:
        return self.describe().policy_version

    def session(self, tag: str = "") -> str:
        return f"{self.prefix}-{tag}" if tag else self.prefix

    def begin_request(
        self, version: int, tensors: Sequence[TensorSpec], *, session: str | None = None, rank: int = 0,
        num_ranks: int = 1, num_streams: int = 1, base_version: int = -1,
    ) -> pb.BeginRequest:
        return pb.BeginRequest(
            session_id=session or self.session(), policy_version=version, rank=rank, num_ranks=num_ranks,
            tensors=[pb.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in tensors],
            base_version=base_version, num_streams=num_streams,
            protocol_version=protocol_version(),
        )

    def begin(self, request: pb.BeginRequest) -> pb.BeginReply:
        self.opened.add((request.session_id, request.policy_version))
        return self.stub.Begin(request, metadata=self.metadata, timeout=self.timeout_s)

    def commit(self, version: int, session: str | None = None) -> pb.CommitReply:
        request = pb.CommitRequest(session_id=session or self.session(), policy_version=version)
        return self.stub.Commit(request, metadata=self.metadata, timeout=self.timeout_s)

    def abort(self, version: int, session: str | None = None) -> bool:
        request = pb.AbortRequest(session_id=session or self.session(), policy_version=version, reason="conformance")
        return self.stub.Abort(request, metadata=self.metadata, timeout=self.timeout_s).aborted

    def stream(self, version: int, *, session: str | None = None, rank: int = 0, extra: Sequence[tuple[str, str]] = (),
               timeout_s: float | None = None) -> Stream:
        md = (("x-ws-session", session or self.session()), ("x-ws-version", str(version)), ("x-ws-rank", str(rank)))
        return Stream(self, md + tuple(extra), timeout_s)

    def values(self, spec: TensorSpec) -> np.ndarray:
        self._seed += 1
        return synthetic(spec, self._seed)

    def chunks(self, spec: TensorSpec, values: np.ndarray, box: tuple[list[int], list[int]] | None = None,
               **kw: int) -> list[pb.PushChunk]:
        offsets, shape = box or whole(spec)
        return shard_chunks(spec, values, offsets, shape, self.max_chunk_bytes, **kw)

    def payload(self) -> list[TensorSpec]:
        """The tensors positive cases push whole: the probe, and the big one when there is one."""
        return [s for s in (self.probe, self.big) if s is not None]

    def push_and_commit(self, version: int, specs: Sequence[TensorSpec]) -> pb.CommitReply:
        """A full single-rank update of `specs` over gRPC, committed (raises CaseFailed otherwise)."""
        self.begin(self.begin_request(version, specs))
        values = {s.name: self.values(s) for s in specs}
        stream = self.stream(version)
        for spec in specs:
            stream.send(*self.chunks(spec, values[spec.name]))
        got = stream.close()
        require(got == "OK", f"push of a conforming update answered {got}")
        reply = self.commit(version)
        self.remember(version, values)
        return reply

    def remember(self, version: int, values: dict[str, np.ndarray]) -> None:
        self.committed.update(values)
        self.committed_version = version

    def base_for(self, spec: TensorSpec) -> np.ndarray:
        """The values the receiver holds for `spec` as its delta base at its current version (committed now if the
        kit does not know them)."""
        if spec.name not in self.committed or self.committed_version != self.version:
            self.push_and_commit(self.version + 1, [spec])
        return self.committed[spec.name]

    def cleanup(self) -> None:
        """Undo what the case left open: streams, connections, staged updates."""
        for stream in self.streams:
            stream.stop()
        for connection in self.connections:
            connection.close()
        for session, version in self.opened:
            try:
                self.abort(version, session)
            except grpc.RpcError:
                pass
        self.streams, self.connections, self.opened = [], [], set()


def code_of(fn: Callable[[], object]) -> str:
    """The status name `fn`'s gRPC call ends with ("OK" when it returns)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def need(spec: TensorSpec | None, what: str) -> TensorSpec:
    if spec is None:
        raise CaseSkipped(f"the manifest has no {what}")
    return spec


def need_socket(kit: Kit) -> None:
    if not kit.data_port:
        raise CaseSkipped("the receiver offers no socket data plane (Describe.data_port = 0)")


def need_delta(kit: Kit) -> None:
    if not kit.delta_supported:
        raise CaseSkipped("the receiver does not take delta pushes (Describe.delta_supported = false)")


# -- Describe, auth, WatchVersion ---------------------------------------------------------------------------------
@case("OK")
def describe(kit: Kit) -> str:
    """Describe lists a manifest of distinct names, a chunk limit, a version >= 0 and protocol major 1."""
    reply = kit.describe()
    require(len(reply.manifest) > 0, "empty manifest")
    require(len({s.name for s in reply.manifest}) == len(reply.manifest), "a tensor is listed twice")
    require(reply.max_chunk_bytes > 0, f"max_chunk_bytes {reply.max_chunk_bytes}")
    require(reply.policy_version >= 0, f"policy_version {reply.policy_version}")
    require(reply.protocol_version.major == 1, f"protocol_version {reply.protocol_version}")
    return "OK"


@case("UNAUTHENTICATED")
def auth_missing_token(kit: Kit) -> str:
    """A call without `authorization` metadata is refused when the receiver has a token."""
    if not kit.token:
        raise CaseSkipped("no token given (--token): cannot tell whether the receiver wants one")
    return code_of(lambda: kit.stub.Describe(pb.DescribeRequest(), timeout=kit.timeout_s))


@case("UNAUTHENTICATED")
def auth_wrong_token(kit: Kit) -> str:
    """A call with another bearer token is refused, Begin included."""
    if not kit.token:
        raise CaseSkipped("no token given (--token): cannot tell whether the receiver wants one")
    md = (("authorization", f"Bearer {kit.token}x"),)
    request = kit.begin_request(kit.version + 1, [need(kit.probe, "tensor of 4+ rows")])
    return code_of(lambda: kit.stub.Begin(request, metadata=md, timeout=kit.timeout_s))


@case("OK")
def watch_version(kit: Kit) -> str:
    """WatchVersion starts with the current version when it is greater than `after_version`."""
    current = kit.version
    events = kit.stub.WatchVersion(
        pb.WatchVersionRequest(after_version=current - 1), metadata=kit.metadata, timeout=kit.timeout_s
    )
    try:
        first = next(iter(events))
    finally:
        events.cancel()
    require(first.policy_version == current, f"first event {first.policy_version}, current {current}")
    return "OK"


# -- Begin --------------------------------------------------------------------------------------------------------
def _begin_refusal(expected: str, mutate: Callable[[Kit, pb.BeginRequest], None], doc: str) -> None:
    """Register a case (`doc`: "name: what the Begin has"): a Begin of the probe changed by `mutate` is refused with
    `expected` before any update opens, so a conforming Begin right after it opens one."""

    def run(kit: Kit) -> str:
        request = kit.begin_request(kit.version + 1, [need(kit.probe, "tensor of 4+ rows")])
        mutate(kit, request)
        got = code_of(lambda: kit.begin(request))
        if got != "OK":
            after = code_of(lambda: kit.begin(kit.begin_request(kit.version + 1, [need(kit.probe, "tensor")])))
            require(after == "OK", f"a conforming Begin after the refused one answered {after}")
        return got

    name, what = doc.split(": ", 1)
    case(expected, name=name, checks=f"refuse a Begin with {what}")(run)


def _set(field: str, value: object) -> Callable[[Kit, pb.BeginRequest], None]:
    return lambda kit, r: setattr(r, field, value)


def _relay(n: int, fanout: int, ticket: bytes = b"") -> Callable[[Kit, pb.BeginRequest], None]:
    def mutate(kit: Kit, request: pb.BeginRequest) -> None:
        request.relay_targets.extend(
            pb.RelayTarget(address=f"127.0.0.1:{10000 + i}", data_port=20000 + i, ticket=ticket) for i in range(n)
        )
        request.relay_fanout = fanout

    return mutate


def _version(delta: int) -> Callable[[Kit, pb.BeginRequest], None]:
    return lambda kit, r: setattr(r, "policy_version", kit.version + delta)


def _tensors(make: Callable[[Kit], list[pb.TensorSpec]]) -> Callable[[Kit, pb.BeginRequest], None]:
    def mutate(kit: Kit, request: pb.BeginRequest) -> None:
        del request.tensors[:]
        request.tensors.extend(make(kit))

    return mutate


def _probe_msg(kit: Kit, shape: Sequence[int] | None = None, name: str | None = None) -> pb.TensorSpec:
    probe = need(kit.probe, "tensor of 4+ rows")
    return pb.TensorSpec(name=name or probe.name, shape=probe.shape if shape is None else shape, dtype=probe.dtype)


_begin_refusal("UNIMPLEMENTED", lambda k, r: r.protocol_version.CopyFrom(pb.ProtocolVersion(major=2)),
               "begin_protocol_major_mismatch: protocol major 2")
_begin_refusal("FAILED_PRECONDITION", _version(0), "begin_version_not_newer: policy_version = the current one")
_begin_refusal("OUT_OF_RANGE", _set("policy_version", 2**53), "begin_version_past_2_53: policy_version 2^53")
_begin_refusal("OUT_OF_RANGE", _set("policy_version", 2**63 - 1), "begin_version_int64_max: policy_version 2^63 - 1")
_begin_refusal("INVALID_ARGUMENT", _set("session_id", ""), "begin_empty_session: an empty session_id")
_begin_refusal("INVALID_ARGUMENT", _set("session_id", "s" * 257), "begin_long_session: a 257-character session_id")
_begin_refusal("INVALID_ARGUMENT", _set("rank", 1), "begin_rank_out_of_range: rank 1 of num_ranks 1")
_begin_refusal("INVALID_ARGUMENT", _set("num_ranks", 0), "begin_no_ranks: num_ranks 0")
_begin_refusal("INVALID_ARGUMENT", _set("num_streams", 65), "begin_too_many_streams: num_streams 65")
_begin_refusal("NOT_FOUND", _tensors(lambda k: [_probe_msg(k, name="no.such.tensor")]),
               "begin_unknown_tensor: a tensor the manifest does not list")
_begin_refusal("INVALID_ARGUMENT", _tensors(lambda k: [_probe_msg(k, shape=[1, 2, 3, 4, 5])]),
               "begin_wrong_shape: a manifest tensor with another shape")
_begin_refusal("INVALID_ARGUMENT", _tensors(lambda k: [_probe_msg(k), _probe_msg(k)]),
               "begin_tensor_twice: one tensor listed twice")
_begin_refusal("INVALID_ARGUMENT", _relay(1025, 2), "begin_too_many_relay_targets: 1025 relay targets")
_begin_refusal("INVALID_ARGUMENT", _relay(1, 2, b"t"), "begin_relay_target_with_ticket: a relay target with a ticket")
_begin_refusal("INVALID_ARGUMENT", _relay(1, 0), "begin_relay_fanout_zero: relay targets with relay_fanout 0")
_begin_refusal("INVALID_ARGUMENT", _relay(1, 65), "begin_relay_fanout_65: relay targets with relay_fanout 65")


@case("OK")
def begin_without_protocol_version(kit: Kit) -> str:
    """A Begin without protocol_version (a sender from before versions) reads as 1.0 and opens the update."""
    request = kit.begin_request(kit.version + 1, [need(kit.probe, "tensor of 4+ rows")])
    request.ClearField("protocol_version")
    return code_of(lambda: kit.begin(request))


@case("OK")
def begin_idempotent(kit: Kit) -> str:
    """The same Begin twice joins the same update: same update_id, same data ticket."""
    request = kit.begin_request(kit.version + 1, [need(kit.probe, "tensor of 4+ rows")])
    first, again = kit.begin(request), kit.begin(request)
    require(first.update_id == again.update_id, f"update_id {first.update_id} then {again.update_id}")
    require(first.data_ticket == again.data_ticket, "a repeated Begin handed out another ticket")
    require(len(first.data_ticket) == (32 if kit.data_port else 0), f"ticket of {len(first.data_ticket)} bytes")
    return "OK"


@case("INVALID_ARGUMENT")
def begin_rank_again_other_tensors(kit: Kit) -> str:
    """A rank's second Begin of one update with other tensors (or streams, relay targets) is refused."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe], num_streams=2)))


@case("INVALID_ARGUMENT")
def begin_num_ranks_changes(kit: Kit) -> str:
    """Rank 1 joining with num_ranks 3 an update rank 0 opened with num_ranks 2 is refused."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe], num_ranks=2))
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe], rank=1, num_ranks=3)))


@case("ABORTED")
def begin_other_update_in_progress(kit: Kit) -> str:
    """A Begin of another session while an update is open (and active) is refused."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe], session=kit.session("other"))))


@case("OK")
def begin_newer_version_supersedes(kit: Kit) -> str:
    """A session's Begin of a newer version replaces its own open older update, whose Commit then finds nothing."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    got = code_of(lambda: kit.begin(kit.begin_request(version + 1, [probe])))
    if got == "OK":
        after = code_of(lambda: kit.commit(version))
        require(after == "NOT_FOUND", f"Commit of the superseded update answered {after}")
    return got


@case("ABORTED")
def begin_older_version_of_session(kit: Kit) -> str:
    """A session's Begin of an older version than its own open update is refused."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version + 1, [probe]))
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe])))


@case("OK")
def begin_trainer_session_preempts(kit: Kit) -> str:
    """The session of the last commit (the trainer's) preempts another session's open update, which is dropped."""
    probe = need(kit.probe, "tensor of 4+ rows")
    kit.push_and_commit(kit.version + 1, [probe])  # the kit's session is now the trainer's
    version, intruder = kit.version + 1, kit.session("intruder")
    kit.begin(kit.begin_request(version, [probe], session=intruder))
    got = code_of(lambda: kit.begin(kit.begin_request(version, [probe])))
    if got == "OK":
        after = code_of(lambda: kit.commit(version, intruder))
        require(after == "NOT_FOUND", f"Commit of the preempted update answered {after}")
    return got


# -- Push: opening a stream ---------------------------------------------------------------------------------------
@case("INVALID_ARGUMENT")
def push_missing_metadata(kit: Kit) -> str:
    """A Push stream without x-ws-session / x-ws-version / x-ws-rank is refused."""
    return Stream(kit, ()).close()


@case("NOT_FOUND")
def push_without_update(kit: Kit) -> str:
    """A Push stream naming no open update is refused."""
    return kit.stream(kit.version + 1, session=kit.session("none")).close()


@case("FAILED_PRECONDITION")
def push_rank_without_begin(kit: Kit) -> str:
    """A Push stream of a rank that did not call Begin is refused."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe], num_ranks=2))
    return kit.stream(version, rank=1).close()


@case("ALREADY_EXISTS")
def push_extra_stream(kit: Kit) -> str:
    """A stream beyond the rank's num_streams is refused, and the update stays: it commits."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe], num_streams=1))
    values = kit.values(probe)
    require(kit.stream(version).send(*kit.chunks(probe, values)).close() == "OK", "the first stream failed")
    got = kit.stream(version).close()
    require(code_of(lambda: kit.commit(version)) == "OK", "the update did not commit after the refused stream")
    kit.remember(version, {probe.name: values})
    return got


@case("ALREADY_EXISTS")
def push_num_streams_zero_is_one(kit: Kit) -> str:
    """num_streams 0 in Begin means 1: a second stream is refused."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe], num_streams=0))
    require(kit.stream(version).send(*kit.chunks(probe, kit.values(probe))).close() == "OK", "the first stream failed")
    return kit.stream(version).close()


@case("PERMISSION_DENIED")
def push_relay_not_announced(kit: Kit) -> str:
    """A stream asking (x-ws-relay) to forward to a receiver its Begin did not announce is refused; the update stays."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    got = kit.stream(version, extra=(("x-ws-relay", "127.0.0.1:9"), ("x-ws-fanout", "1"))).close()
    require(kit.abort(version), "the update was gone after the refused relay stream")
    return got


# -- Push: chunk checks (each drops the update) -------------------------------------------------------------------
def _chunk_refusal(expected: str, make: Callable[[Kit, TensorSpec, np.ndarray], Sequence[pb.PushChunk | bytes]],
                   doc: str, delta_base: bool = False) -> None:
    """Register a case (`doc`: "name: what the stream has"): a Push stream of the messages `make` builds is refused
    with `expected`, and the update is dropped (Commit: NOT_FOUND). `delta_base`: Begin with the committed base."""

    def run(kit: Kit) -> str:
        probe = need(kit.probe, "tensor of 4+ rows")
        base_version = -1
        if delta_base:
            need_delta(kit)
            kit.base_for(probe)
            base_version = kit.version
        version = kit.version + 1
        reply = kit.begin(kit.begin_request(version, [probe], base_version=base_version))
        require(reply.delta_accepted == delta_base, f"delta_accepted {reply.delta_accepted}")
        got = kit.stream(version).send(*make(kit, probe, kit.values(probe))).close()
        after = code_of(lambda: kit.commit(version))
        require(after == "NOT_FOUND", f"Commit after the refused stream answered {after}: the update was not dropped")
        return got

    name, what = doc.split(": ", 1)
    case(expected, name=name, checks=f"refuse a Push stream with {what}, dropping the update")(run)


def _edit(chunks: list[pb.PushChunk], edit: Callable[[pb.PushChunk], None], index: int = 0) -> list[pb.PushChunk]:
    edit(chunks[index])
    return chunks


def _no_shard(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return _edit(k.chunks(p, v), lambda c: c.header.ClearField("shard"))


def _named(name: str) -> Callable[[Kit, TensorSpec, np.ndarray], list[pb.PushChunk]]:
    return lambda k, p, v: _edit(k.chunks(p, v), lambda c: setattr(c.header.shard, "name", name))


def _unannounced(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    other = next((s for s in k.manifest.values() if s.name != p.name), None)
    return _named(need(other, "second tensor").name)(k, p, v)


def _outside(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return _edit(k.chunks(p, v), lambda c: c.header.shard.offsets.__setitem__(0, 1))


def _twice(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return k.chunks(p, v, rows(p, 0, 1)) + k.chunks(p, v, rows(p, 0, 1))


def _too_many_elements(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return k.chunks(p, v) + k.chunks(p, v, rows(p, 1, 2))


def _out_of_order(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return _edit(k.chunks(p, v), lambda c: setattr(c.header, "element_offset", 1))


def _past_end(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    chunks = k.chunks(p, v, rows(p, 0, 1))
    chunks[-1].header.num_elements += 1
    chunks[-1].payload += chunks[-1].payload[: itemsize(p.dtype)]
    return chunks


def _empty_chunk(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    chunks = k.chunks(p, v)
    chunks[0].header.num_elements, chunks[0].payload = 0, b""
    return chunks


def _over_limit(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    chunks = k.chunks(p, v)
    chunks[0].header.num_elements, chunks[0].payload = 1, bytes(k.max_chunk_bytes + 8)
    return chunks


def _short_payload(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    return _edit(k.chunks(p, v), lambda c: setattr(c, "payload", c.payload[:-1]))


def _encoding(value: int) -> Callable[[Kit, TensorSpec, np.ndarray], list[pb.PushChunk]]:
    return lambda k, p, v: _edit(k.chunks(p, v), lambda c: setattr(c.header, "encoding", value))


def _bad_checksum(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    box = box_values(p, v, *whole(p))
    return k.chunks(p, v, checksum=xxhash.xxh3_64_intdigest(box.tobytes()) ^ 1)


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


def _sparse(make: Callable[[int, int], bytes]) -> Callable[[Kit, TensorSpec, np.ndarray], list[pb.PushChunk]]:
    """A stream of SPARSE chunks whose payloads `make(num_elements, itemsize)` builds."""

    def build(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
        chunks = k.chunks(p, v)
        for c in chunks:
            c.header.encoding = pb.ENCODING_SPARSE
            c.payload = make(c.header.num_elements, itemsize(p.dtype))
        return chunks

    return build


def _xor_wrong_size(k: Kit, p: TensorSpec, v: np.ndarray) -> list[pb.PushChunk]:
    chunks = k.chunks(p, v)
    chunks[0].header.encoding = pb.ENCODING_XOR_ZSTD
    chunks[0].payload = zstandard.ZstdCompressor().compress(bytes(len(chunks[0].payload) + 8))
    return chunks


_chunk_refusal("INVALID_ARGUMENT", _no_shard, "push_first_chunk_without_shard: a stream's first chunk lacks a shard")
_chunk_refusal("NOT_FOUND", _named("no.such.tensor"), "push_unknown_tensor: a shard of a tensor not in the manifest")
_chunk_refusal("FAILED_PRECONDITION", _unannounced, "push_unannounced_tensor: a shard of a tensor Begin did not list")
_chunk_refusal("OUT_OF_RANGE", _outside, "push_box_outside_tensor: a shard box reaching past the tensor")
_chunk_refusal("INVALID_ARGUMENT", _twice, "push_box_twice: the same shard box pushed twice")
_chunk_refusal("INVALID_ARGUMENT", _too_many_elements, "push_more_elements_than_tensor: shards holding > numel")
_chunk_refusal("INVALID_ARGUMENT", _out_of_order, "push_chunk_out_of_order: element_offset not where the shard is")
_chunk_refusal("OUT_OF_RANGE", _past_end, "push_chunk_past_shard_end: a chunk running past its shard")
_chunk_refusal("OUT_OF_RANGE", _empty_chunk, "push_empty_chunk: a chunk of 0 elements in a non-empty shard")
_chunk_refusal("RESOURCE_EXHAUSTED", _over_limit, "push_payload_over_limit: a payload of max_chunk_bytes + 8")
_chunk_refusal("INVALID_ARGUMENT", _short_payload, "push_raw_payload_wrong_size: RAW payload != num_elements x size")
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
_chunk_refusal("DATA_LOSS", _xor_wrong_size, "delta_xor_wrong_content_size: a zstd frame of another size",
               delta_base=True)


# -- Commit -------------------------------------------------------------------------------------------------------
@case("NOT_FOUND")
def commit_without_update(kit: Kit) -> str:
    """A Commit of an update nobody began is refused."""
    return code_of(lambda: kit.commit(kit.version + 1, kit.session("none")))


@case("FAILED_PRECONDITION")
def commit_rank_missing(kit: Kit) -> str:
    """A Commit before every rank called Begin is refused (and the update dropped)."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe], num_ranks=2))
    return code_of(lambda: kit.commit(version))


@case("FAILED_PRECONDITION")
def commit_no_tensor(kit: Kit) -> str:
    """A Commit of an update that announces no tensor is refused."""
    version = kit.version + 1
    kit.begin(kit.begin_request(version, []))
    require(kit.stream(version).close() == "OK", "an empty stream of an empty rank failed")
    return code_of(lambda: kit.commit(version))


@case("FAILED_PRECONDITION")
def commit_before_streams_end(kit: Kit) -> str:
    """A Commit while a rank's stream is still open is refused, the update dropped and the open stream cut."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    stream = kit.stream(version).send(*kit.chunks(probe, kit.values(probe)))
    time.sleep(0.3)
    got = code_of(lambda: kit.commit(version))
    cut = stream.wait()
    require(cut == "CANCELLED", f"the open stream of the dropped update ended {cut}, not CANCELLED")
    return got


@case("FAILED_PRECONDITION")
def commit_incomplete_tensor(kit: Kit) -> str:
    """A Commit of a tensor missing its last row is refused, and a repeated Commit gets the same answer."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    values = kit.values(probe)
    require(kit.stream(version).send(*kit.chunks(probe, values, rows(probe, 0, probe.shape[0] - 1))).close() == "OK",
            "a stream of whole shards failed")
    got = code_of(lambda: kit.commit(version))
    again = code_of(lambda: kit.commit(version))
    require(again == got, f"a repeated Commit answered {again}, the first {got}")
    return got


@case("FAILED_PRECONDITION")
def commit_overlap_and_gap(kit: Kit) -> str:
    """Shards of the right total size that overlap (and so leave a gap) are refused at Commit."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    values, num_rows = kit.values(probe), probe.shape[0]
    messages = kit.chunks(probe, values, rows(probe, 0, 2)) + kit.chunks(probe, values, rows(probe, 1, num_rows - 1))
    require(kit.stream(version).send(*messages).close() == "OK", "overlapping shards of the right size were refused")
    return code_of(lambda: kit.commit(version))


@case("OK")
def push_commit(kit: Kit) -> str:
    """A whole single-rank update over gRPC commits; Describe then reports its version and older Begins are refused."""
    version = kit.version + 1
    reply = kit.push_and_commit(version, kit.payload() or [need(None, "tensor to push")])
    require(reply.policy_version == version, f"CommitReply.policy_version {reply.policy_version}")
    require(kit.version == version, "Describe does not report the committed version")
    stale = code_of(lambda: kit.begin(kit.begin_request(version, kit.payload())))
    require(stale == "FAILED_PRECONDITION", f"a Begin of the committed version answered {stale}")
    return "OK"


@case("OK")
def push_commit_two_ranks_two_streams(kit: Kit) -> str:
    """Two ranks with two streams each, one row block per stream, commit as one update."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version, values, num_rows = kit.version + 1, kit.values(probe), probe.shape[0]
    cuts = [num_rows * i // 4 for i in range(5)]
    for rank in (0, 1):
        kit.begin(kit.begin_request(version, [probe], rank=rank, num_ranks=2, num_streams=2))
    streams = [kit.stream(version, rank=i // 2).send(*kit.chunks(probe, values, rows(probe, cuts[i], cuts[i + 1])))
               for i in range(4)]
    got = [s.close() for s in streams]
    require(got == ["OK"] * 4, f"streams answered {got}")
    kit.commit(version)
    kit.remember(version, {probe.name: values})
    return "OK"


@case("OK")
def commit_repeated(kit: Kit) -> str:
    """A repeated Commit of a committed update answers as the first did (same apply_seconds): no second apply."""
    version = kit.version + 1
    first = kit.push_and_commit(version, [need(kit.probe, "tensor of 4+ rows")])
    again = kit.commit(version)
    require(again.apply_seconds == first.apply_seconds, f"apply_seconds {first.apply_seconds}, {again.apply_seconds}")
    require(again.policy_version == version, f"policy_version {again.policy_version}")
    return "OK"


@case("OK")
def commit_concurrent(kit: Kit) -> str:
    """Four concurrent Commits of one update all succeed with one answer (one apply)."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version, values = kit.version + 1, kit.values(probe)
    kit.begin(kit.begin_request(version, [probe]))
    require(kit.stream(version).send(*kit.chunks(probe, values)).close() == "OK", "push failed")
    with futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: kit.commit(version), range(4)))
    kit.remember(version, {probe.name: values})
    require(len({r.apply_seconds for r in replies}) == 1, f"apply_seconds {[r.apply_seconds for r in replies]}")
    return "OK"


# -- Delta --------------------------------------------------------------------------------------------------------
def _delta_push(kit: Kit, encode: Callable[[np.ndarray, np.ndarray], bytes], encoding: pb.Encoding) -> str:
    need_delta(kit)
    probe = need(kit.probe, "tensor of 4+ rows")
    base = kit.base_for(probe)
    new = base.copy()
    new[:: max(1, new.shape[0] // 3)] ^= 1  # a few changed elements
    current = kit.version
    reply = kit.begin(kit.begin_request(current + 1, [probe], base_version=current))
    require(reply.delta_accepted, "Begin with base_version = the current version accepted no delta")
    chunks = kit.chunks(probe, new)
    for c in chunks:
        start = c.header.element_offset
        part = slice(start, start + c.header.num_elements)
        c.header.encoding = encoding
        c.payload = encode(new[part], base[part])
    require(kit.stream(current + 1).send(*chunks).close() == "OK", "the delta stream was refused")
    kit.commit(current + 1)
    kit.remember(current + 1, {probe.name: new})
    return "OK"


@case("OK")
def delta_sparse(kit: Kit) -> str:
    """SPARSE chunks against the committed base decode to the new values (checked by xxh3_64) and commit."""
    return _delta_push(kit, sparse_payload, pb.ENCODING_SPARSE)


@case("OK")
def delta_xor_zstd(kit: Kit) -> str:
    """XOR_ZSTD chunks against the committed base decode to the new values (checked by xxh3_64) and commit."""
    return _delta_push(kit, xor_payload, pb.ENCODING_XOR_ZSTD)


@case("OK")
def delta_refused_for_old_base(kit: Kit) -> str:
    """A Begin whose base_version is not the current version opens the update without delta (delta_accepted false)."""
    probe = need(kit.probe, "tensor of 4+ rows")
    current = kit.version
    reply = kit.begin(kit.begin_request(current + 1, [probe], base_version=max(current - 1, 0) if current else 7))
    require(not reply.delta_accepted, "delta accepted against a base that is not the current version")
    return "OK"


@case("RESOURCE_EXHAUSTED")
def delta_decoded_over_limit(kit: Kit) -> str:
    """A delta chunk decoding to more than max_chunk_bytes (num_elements x size) is refused, however small."""
    need_delta(kit)
    big = need(kit.big, f"tensor larger than max_chunk_bytes ({kit.max_chunk_bytes})")
    kit.base_for(big)
    current = kit.version
    require(kit.begin(kit.begin_request(current + 1, [big], base_version=current)).delta_accepted, "no delta")
    chunk = kit.chunks(big, kit.values(big))[0]
    chunk.header.num_elements = kit.max_chunk_bytes // itemsize(big.dtype) + 1
    chunk.header.encoding = pb.ENCODING_SPARSE
    chunk.payload = b""  # k = 0: every element equals the base
    return kit.stream(current + 1).send(chunk).close()


# -- Abort --------------------------------------------------------------------------------------------------------
@case("CANCELLED")
def abort_cuts_grpc_stream(kit: Kit) -> str:
    """Abort drops the update (True once, then False), cuts its open gRPC stream (CANCELLED); Commit finds nothing."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    stream = kit.stream(version).send(kit.chunks(probe, kit.values(probe))[0])
    time.sleep(0.3)
    require(kit.abort(version), "Abort of the open update answered aborted = false")
    got = stream.wait()
    require(not kit.abort(version), "a second Abort answered aborted = true")
    after = code_of(lambda: kit.commit(version))
    require(after == "NOT_FOUND", f"Commit after Abort answered {after}")
    return got


@case("OK")
def abort_unknown_update(kit: Kit) -> str:
    """Abort of an update that is not open answers aborted = false, no error."""
    require(not kit.abort(kit.version + 1, kit.session("none")), "aborted = true for nothing")
    return "OK"


# -- socket data plane --------------------------------------------------------------------------------------------
def _socket_update(kit: Kit, num_streams: int = 1) -> tuple[int, TensorSpec, pb.DataHello]:
    need_socket(kit)
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    reply = kit.begin(kit.begin_request(version, [probe], num_streams=num_streams))
    require(len(reply.data_ticket) > 0, "Begin handed out no data ticket although Describe offers a data port")
    hello = pb.DataHello(session_id=kit.session(), policy_version=version, rank=0, ticket=reply.data_ticket)
    return version, probe, hello


@case("OK")
def socket_push_commit(kit: Kit) -> str:
    """A rank's stream as a TCP connection (hello, frames, u32 0) gets DataReply OK and commits."""
    version, probe, hello = _socket_update(kit)
    values = kit.values(probe)
    connection = Connection(kit, hello)
    for chunk in kit.chunks(probe, values):
        connection.chunk(chunk)
    got = connection.reply()
    require(got == "OK", f"DataReply {got}")
    kit.commit(version)
    kit.remember(version, {probe.name: values})
    return got


@case("UNAUTHENTICATED")
def socket_wrong_ticket(kit: Kit) -> str:
    """A hello with another ticket is refused."""
    _, _, hello = _socket_update(kit)
    hello.ticket = bytes(32) if hello.ticket != bytes(32) else b"\x01" * 32
    return Connection(kit, hello).reply(end=False)


@case("NOT_FOUND")
def socket_without_update(kit: Kit) -> str:
    """A hello naming no open update is refused."""
    _, _, hello = _socket_update(kit)
    hello.session_id = kit.session("none")
    return Connection(kit, hello).reply(end=False)


@case("ALREADY_EXISTS")
def socket_extra_connection(kit: Kit) -> str:
    """A connection beyond the rank's num_streams is refused (gRPC and socket streams count together)."""
    _, probe, hello = _socket_update(kit, num_streams=1)
    first = Connection(kit, hello)
    for chunk in kit.chunks(probe, kit.values(probe)):
        first.chunk(chunk)
    require(first.reply() == "OK", "the first connection failed")
    return Connection(kit, hello).reply(end=False)


@case("INVALID_ARGUMENT")
def socket_malformed_hello(kit: Kit) -> str:
    """A hello frame that is no DataHello is refused."""
    need_socket(kit)
    return Connection(kit, _U32.pack(16) + b"\xff" * 16).reply(end=False)


@case("INVALID_ARGUMENT")
def socket_oversized_hello(kit: Kit) -> str:
    """A hello frame announcing more than 65536 bytes is refused before it is read."""
    need_socket(kit)
    return Connection(kit, _U32.pack(MAX_HEADER_BYTES + 1)).reply(end=False)


@case("INVALID_ARGUMENT")
def socket_oversized_chunk_header(kit: Kit) -> str:
    """A chunk header frame announcing more than 65536 bytes is refused."""
    _, _, hello = _socket_update(kit)
    return Connection(kit, hello).send(_U32.pack(MAX_HEADER_BYTES + 1)).reply(end=False)


@case("RESOURCE_EXHAUSTED")
def socket_payload_over_limit(kit: Kit) -> str:
    """A payload length over max_chunk_bytes is refused from the frame header, before any payload is sent."""
    _, probe, hello = _socket_update(kit)
    chunk = kit.chunks(probe, kit.values(probe))[0]
    chunk.header.num_elements = 1
    return Connection(kit, hello).chunk(chunk, payload_len=kit.max_chunk_bytes + 8).reply(end=False)


@case("DATA_LOSS")
def socket_bad_checksum(kit: Kit) -> str:
    """A shard whose xxh3_64 does not match is refused on the socket plane too."""
    _, probe, hello = _socket_update(kit)
    values = kit.values(probe)
    digest = xxhash.xxh3_64_intdigest(box_values(probe, values, *whole(probe)).tobytes()) ^ 1
    connection = Connection(kit, hello)
    for chunk in kit.chunks(probe, values, checksum=digest):
        connection.chunk(chunk)
    return connection.reply()


@case("PERMISSION_DENIED")
def socket_relay_not_announced(kit: Kit) -> str:
    """A hello asking to relay to a receiver the rank's Begin did not announce is refused; nothing is opened."""
    _, _, hello = _socket_update(kit)
    hello.relay.append(pb.RelayTarget(address="127.0.0.1:9", data_port=9, ticket=b"t"))
    hello.fanout = 1
    return Connection(kit, hello).reply(end=False)


@case("ABORTED")
def socket_abort_cuts_connection(kit: Kit) -> str:
    """Abort cuts an open socket stream of the update: the connection gets DataReply ABORTED."""
    version, probe, hello = _socket_update(kit)
    connection = Connection(kit, hello).chunk(kit.chunks(probe, kit.values(probe))[0])
    time.sleep(0.3)
    require(kit.abort(version), "Abort of the open update answered aborted = false")
    return connection.reply(end=False)


@case("UNAUTHENTICATED")
def socket_refusal_before_open_is_unopened(kit: Kit) -> str:
    """A hello refused before its stream opened says so (DataReply.unopened, 1.1); a refusal after that does not."""
    if kit.minor < 1:
        raise CaseSkipped(f"DataReply.unopened is protocol 1.1; the receiver speaks 1.{kit.minor}")
    _, _, hello = _socket_update(kit)
    wrong = pb.DataHello()
    wrong.CopyFrom(hello)
    wrong.ticket = bytes(32) if hello.ticket != bytes(32) else b"\x01" * 32
    refused = Connection(kit, wrong)
    got = refused.reply(end=False)
    require(refused.unopened is True, f"a refused hello answered unopened = {refused.unopened}")
    opened = Connection(kit, hello).send(_U32.pack(MAX_HEADER_BYTES + 1))
    late = opened.reply(end=False)
    require(late == "INVALID_ARGUMENT" and opened.unopened is False, f"after the hello: {late}, {opened.unopened}")
    return got


# -- resources (bounded) ------------------------------------------------------------------------------------------
@case("OK")
def abandoned_updates_release_buffers(kit: Kit) -> str:
    """8 updates begun, half-pushed with the stream left open, then aborted: each next Begin opens, the last commits."""
    specs = kit.payload() or [need(None, "tensor to push")]
    for _ in range(8):
        version = kit.version + 1
        request = kit.begin_request(version, specs)
        got = code_of(lambda: kit.begin(request))  # noqa: B023 (called at once)
        require(got == "OK", f"Begin after abandoned updates answered {got}")
        stream = kit.stream(version).send(kit.chunks(specs[0], kit.values(specs[0]))[0])
        time.sleep(0.3)
        require(kit.abort(version), "Abort answered aborted = false")
        require(stream.wait() == "CANCELLED", "the aborted update's stream was not cut")
        kit.cleanup()
    kit.push_and_commit(kit.version + 1, specs)
    return "OK"


@case("OK")
def idle_watch_streams_do_not_starve(kit: Kit) -> str:
    """40 idle WatchVersion streams (more than receivers serve) keep neither Describe nor a push from going on."""
    request = pb.WatchVersionRequest(after_version=2**62)
    watches = [kit.stub.WatchVersion(request, metadata=kit.metadata, timeout=30) for _ in range(40)]
    try:
        time.sleep(0.5)
        kit.push_and_commit(kit.version + 1, [need(kit.probe, "tensor of 4+ rows")])
    finally:
        for watch in watches:
            watch.cancel()
    return "OK"


@case("OK")
def idle_push_streams_do_not_starve(kit: Kit) -> str:
    """48 idle Push streams of another session's update do not keep Describe, nor the trainer's push, from going on."""
    probe = need(kit.probe, "tensor of 4+ rows")
    kit.push_and_commit(kit.version + 1, [probe])  # the kit's session is now the trainer's
    hog, version = kit.session("hog"), kit.version + 1
    kit.begin(kit.begin_request(version, [probe], session=hog, num_streams=48))
    for _ in range(48):
        kit.stream(version, session=hog)
    time.sleep(0.5)
    kit.describe()
    kit.push_and_commit(version, [probe])
    return "OK"


@case("OK")
def idle_connections_do_not_starve(kit: Kit) -> str:
    """40 silent TCP connections to the data port do not keep a socket-plane push from being served."""
    need_socket(kit)
    silent = [socket.create_connection((kit.host, kit.data_port), timeout=kit.timeout_s) for _ in range(40)]
    try:
        time.sleep(0.5)
        return socket_push_commit(kit)
    finally:
        for s in silent:
            s.close()


@case("INVALID_ARGUMENT")
def begin_undecodable_message(kit: Kit) -> str:
    """Bytes that are no BeginRequest are refused as INVALID_ARGUMENT (not INTERNAL)."""
    return code_of(lambda: kit.begin_raw(b"\xff" * 16, metadata=kit.metadata, timeout=kit.timeout_s))


@case("DEADLINE_EXCEEDED")
def socket_silent_connection_closed(kit: Kit) -> str:
    """A connection that sends no hello is answered DEADLINE_EXCEEDED after the receiver's hello timeout."""
    need_socket(kit)
    connection = Connection(kit, b"")
    got = connection.reply(end=False, wait_s=kit.max_wait_s)
    require(kit.minor < 1 or connection.unopened is True, "the refused connection's reply is not unopened")
    return got


@case("CANCELLED")
def push_idle_stream_cut(kit: Kit) -> str:
    """A gRPC Push stream that goes silent is cut after the receiver's stream idle timeout, its update dropped."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe]))
    stream = kit.stream(version, timeout_s=kit.max_wait_s + kit.timeout_s)
    got = stream.send(kit.chunks(probe, kit.values(probe))[0]).wait()
    after = code_of(lambda: kit.commit(version))
    require(after == "NOT_FOUND", f"Commit of the cut stream's update answered {after}")
    return got


@case("DEADLINE_EXCEEDED")
def socket_idle_stream_cut(kit: Kit) -> str:
    """A socket stream that goes silent is answered DEADLINE_EXCEEDED after the stream idle timeout, update dropped."""
    version, probe, hello = _socket_update(kit)
    connection = Connection(kit, hello).chunk(kit.chunks(probe, kit.values(probe))[0])
    got = connection.reply(end=False, wait_s=kit.max_wait_s)
    after = code_of(lambda: kit.commit(version))
    require(after == "NOT_FOUND", f"Commit of the cut stream's update answered {after}")
    return got


@case("OK")
def begin_replaces_silent_update(kit: Kit) -> str:
    """An update waiting for data that gets none gives way to another session's Begin after the stream idle timeout."""
    probe = need(kit.probe, "tensor of 4+ rows")
    version = kit.version + 1
    kit.begin(kit.begin_request(version, [probe], session=kit.session("silent")))
    late = kit.begin_request(version, [probe], session=kit.session("late"))
    deadline = time.monotonic() + kit.max_wait_s
    while (got := code_of(lambda: kit.begin(late))) == "ABORTED" and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


@case("OK")
def receiver_left_idle(kit: Kit) -> str:
    """After the kit, no update of it is open: a new Begin opens one (then aborted)."""
    version = kit.version + 1
    got = code_of(lambda: kit.begin(kit.begin_request(version, [need(kit.probe, "tensor of 4+ rows")])))
    require(got == "OK", f"Begin answered {got}: an update is still open")
    require(kit.abort(version), "Abort answered aborted = false")
    return "OK"


# -- running ------------------------------------------------------------------------------------------------------
def run_conformance(
    address: str,
    config: WeightSyncConfig | None = None,
    *,
    names: Sequence[str] = (),
    include_pending: bool = False,
    timeout_s: float = 10.0,
    probe: str | None = None,
    max_wait_s: float = 60.0,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run the cases (all, or those in `names`) against the receiver at `address`, one after another.

    Raises grpc.RpcError when the receiver cannot be described at all, ValueError for an unknown case or tensor name.
    `probe`: the tensor the cases push (default: the smallest with 4+ rows). Each call waits at most `timeout_s`; a
    case waiting for one of the receiver's own timeouts (hello, idle stream) at most `max_wait_s`.
    """
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; `conformance --list` names them")
    kit = Kit(address, config or WeightSyncConfig(), timeout_s, probe, max_wait_s)
    results = []
    for c in CASES:
        if names and c.name not in names:
            continue
        result = _run_case(kit, c, include_pending)
        results.append(result)
        if on_result is not None:
            on_result(result)
    kit.channel.close()
    return results


def _run_case(kit: Kit, c: Case, include_pending: bool) -> Result:
    if c.pending and not include_pending:
        return Result(c.name, c.expected, "-", "SKIP", f"pending: {c.pending}")
    try:
        got = c.run(kit)
    except CaseSkipped as e:
        return Result(c.name, c.expected, "-", "SKIP", str(e))
    except CaseFailed as e:
        return Result(c.name, c.expected, "-", "FAIL", str(e))
    except grpc.RpcError as e:
        return Result(c.name, c.expected, e.code().name, "FAIL", f"unexpected refusal: {e.details()}")
    except Exception as e:  # a case must report, never stop the kit
        return Result(c.name, c.expected, "-", "FAIL", f"{type(e).__name__}: {e}")
    finally:
        kit.cleanup()
    passed = got == c.expected
    return Result(c.name, c.expected, got, "PASS" if passed else "FAIL", "" if passed else c.checks)


def format_table(results: Sequence[Result]) -> str:
    """The results as a fixed-width table, then a summary line."""
    width = max([len(r.name) for r in results] + [4])
    lines = [f"{'case':<{width}}  {'expected':<19}  {'got':<19}  result"]
    for r in results:
        line = f"{r.name:<{width}}  {r.expected:<19}  {r.got:<19}  {r.outcome}"
        lines.append(f"{line}  {r.detail}" if r.detail else line)
    counts = {o: sum(r.outcome == o for r in results) for o in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return "\n".join(lines)


def describe_cases() -> str:
    """Every case with its expected status and what it checks (`conformance --list`)."""
    width = max(len(c.name) for c in CASES)
    return "\n".join(
        f"{c.name:<{width}}  {c.expected:<19}  {c.checks}" + (f"  [pending: {c.pending}]" if c.pending else "")
        for c in CASES
    )
