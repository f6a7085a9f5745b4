"""`Kit`: the receiver under test as the cases see it, a raw protocol client with the receiver's manifest and limits,
and a record of what the current case opened, undone after it."""

from __future__ import annotations

import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import TypedDict, Unpack

import grpc
import numpy as np

from protos import weight_sync_pb2 as pb
from protos import weight_sync_pb2_grpc as pb_grpc
from weight_sync.channel import client_channel
from weight_sync.config import WeightSyncConfig
from weight_sync.conformance.checks import CaseSkipped, code_of, need, require
from weight_sync.conformance.streams import Connection, Stream
from weight_sync.conformance.wire import U32, Box, shard_chunks, synthetic, whole
from weight_sync.peft import is_peft_name
from weight_sync.shm import host_identity
from weight_sync.spec import TensorSpec
from weight_sync.version import protocol_version

SERVICE = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
FUSED_MEMBERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # fused in vLLM: avoid pushing one alone


class BeginOptions(TypedDict, total=False):
    """The BeginRequest fields a case may set beyond version and tensors (defaults: the kit's session, rank 0 of 1,
    one stream, no delta base, the LoRA alpha the receiver declares)."""

    session: str | None
    rank: int
    num_ranks: int
    num_streams: int
    base_version: int
    drop_base: bool
    lora_alpha: float


class Kit:
    """The receiver under test: its stubs, manifest and limits, and what the current case opened (undone after it).

    `probe` is the tensor positive cases push (default: the smallest with at least 4 rows), `big` the smallest one
    larger than a chunk; calls wait at most `timeout_s`, a case waiting for one of the receiver's own timeouts at most
    `max_wait_s`. Raises grpc.RpcError when Describe fails, ValueError for a `probe` the manifest does not list.
    """

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
        self.shm_plane = described.shm_plane if described.HasField("shm_plane") else None
        self.minor = described.protocol_version.minor if described.protocol_version.major else 0
        self.lora_alpha = described.lora_alpha
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

    # -- what a case needs of the receiver (CaseSkipped otherwise) ------------------------------------------------
    def need_probe(self) -> TensorSpec:
        """The probe tensor."""
        return need(self.probe, "tensor of 4+ rows")

    def need_socket(self) -> None:
        """The receiver offers a socket data plane."""
        if not self.data_port:
            raise CaseSkipped("the receiver offers no socket data plane (Describe.data_port = 0)")

    def need_shm(self) -> pb.ShmPlane:
        """The receiver offers the shared-memory plane (1.2) and runs on this kit's host (its namespaces too)."""
        plane = self.shm_plane
        if plane is None:
            raise CaseSkipped("the receiver offers no shared-memory plane (Describe.shm_plane unset)")
        if plane.host_id != host_identity():
            raise CaseSkipped("the receiver's shared-memory plane is on another host or namespace (host_id differs)")
        return plane

    def need_adapter(self) -> TensorSpec:
        """The receiver applies pushed LoRA adapters with a declared alpha (1.5): its smallest adapter tensor."""
        if not self.lora_alpha:
            raise CaseSkipped("the receiver declares no LoRA alpha (Describe.lora_alpha = 0: it takes no adapters)")
        return need(self._pick(lambda s: is_peft_name(s.name)), "LoRA adapter tensor")

    def need_delta(self) -> None:
        """The receiver takes delta pushes."""
        if not self.delta_supported:
            raise CaseSkipped("the receiver does not take delta pushes (Describe.delta_supported = false)")

    # -- calls ---------------------------------------------------------------------------------------------------
    def describe(self) -> pb.DescribeReply:
        """Describe, with the kit's token."""
        return self.stub.Describe(pb.DescribeRequest(), metadata=self.metadata, timeout=self.timeout_s)

    @property
    def version(self) -> int:
        """The receiver's policy_version now (a Describe)."""
        return self.describe().policy_version

    def session(self, tag: str = "") -> str:
        """The kit's session id, or another one of the kit's named by `tag`."""
        return f"{self.prefix}-{tag}" if tag else self.prefix

    def begin_request(
        self, version: int, tensors: Sequence[TensorSpec], **options: Unpack[BeginOptions]
    ) -> pb.BeginRequest:
        """A conforming BeginRequest of `tensors` at `version` (this protocol version), changed by `options`."""
        return pb.BeginRequest(
            session_id=options.get("session") or self.session(), policy_version=version, rank=options.get("rank", 0),
            num_ranks=options.get("num_ranks", 1),
            tensors=[pb.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in tensors],
            base_version=options.get("base_version", -1), num_streams=options.get("num_streams", 1),
            protocol_version=protocol_version(), drop_base=options.get("drop_base", False),
            lora_alpha=options.get("lora_alpha", self.lora_alpha),
        )

    def begin(self, request: pb.BeginRequest) -> pb.BeginReply:
        """Begin (the update is aborted after the case)."""
        self.opened.add((request.session_id, request.policy_version))
        return self.stub.Begin(request, metadata=self.metadata, timeout=self.timeout_s)

    def begin_probe(self, **options: Unpack[BeginOptions]) -> tuple[int, TensorSpec]:
        """Begin an update of the probe at the next version: (that version, the probe)."""
        probe = self.need_probe()
        version = self.version + 1
        self.begin(self.begin_request(version, [probe], **options))
        return version, probe

    def begin_delta(self, spec: TensorSpec) -> tuple[int, pb.BeginReply]:
        """Begin an update of `spec` at the next version with the current one as its delta base, whose values the kit
        knows (`committed`; pushed and committed first when it does not): (that version, the reply)."""
        self.base_for(spec)
        current = self.version
        return current + 1, self.begin(self.begin_request(current + 1, [spec], base_version=current))

    def commit(self, version: int, session: str | None = None) -> pb.CommitReply:
        """Commit the update (`session`, default the kit's, `version`)."""
        request = pb.CommitRequest(session_id=session or self.session(), policy_version=version)
        return self.stub.Commit(request, metadata=self.metadata, timeout=self.timeout_s)

    def require_dropped(self, version: int, message: str, session: str | None = None) -> None:
        """The update (`session`, `version`) is gone: its Commit answers NOT_FOUND (CaseFailed otherwise, `message`
        with the answer in place of `{}`)."""
        after = code_of(lambda: self.commit(version, session))
        require(after == "NOT_FOUND", message.format(after))

    def abort(self, version: int, session: str | None = None) -> bool:
        """Abort: whether the receiver dropped an update (`aborted`)."""
        request = pb.AbortRequest(session_id=session or self.session(), policy_version=version, reason="conformance")
        return self.stub.Abort(request, metadata=self.metadata, timeout=self.timeout_s).aborted

    def abort_open(self, version: int, message: str = "Abort of the open update answered aborted = false") -> None:
        """Abort the kit's open update at `version` once the receiver has had a moment to take what was sent to it
        (CaseFailed with `message` unless the receiver answers aborted = true)."""
        time.sleep(0.3)
        require(self.abort(version), message)

    def open_stream(self, metadata: tuple[tuple[str, str], ...], timeout_s: float | None = None) -> Stream:
        """A Push stream with the kit's authorization and `metadata` (closed after the case)."""
        stream = Stream(self.push_method, self.metadata + metadata, timeout_s or self.timeout_s)
        self.streams.append(stream)
        return stream

    def stream(self, version: int, *, session: str | None = None, rank: int = 0, extra: Sequence[tuple[str, str]] = (),
               timeout_s: float | None = None) -> Stream:
        """A Push stream of a rank of the update (`session`, `version`), with `extra` metadata."""
        md = (("x-ws-session", session or self.session()), ("x-ws-version", str(version)), ("x-ws-rank", str(rank)))
        return self.open_stream(md + tuple(extra), timeout_s)

    def connect(self, hello: pb.DataHello | bytes) -> Connection:
        """A connection to the data port that has sent `hello` (a DataHello frame, or raw bytes as they are); closed
        after the case."""
        require(self.data_port > 0, "no data port")
        connection = Connection(socket.create_connection((self.host, self.data_port), timeout=self.timeout_s))
        self.connections.append(connection)
        return connection.send(hello) if isinstance(hello, bytes) else connection.hello(hello)

    def shm_connect(self, hello: pb.DataHello | bytes, fds: Sequence[int]) -> Connection:
        """A connection to the shared-memory plane's socket, its peer checked (SO_PEERCRED) against the pid and uid
        Describe announced, that has sent `hello` (a DataHello frame, or raw bytes) with `fds` as SCM_RIGHTS on its
        first bytes; closed after the case."""
        plane = self.need_shm()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection = Connection(sock)
        self.connections.append(connection)
        sock.settimeout(self.timeout_s)
        sock.connect("\0" + plane.socket_name)
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        require((pid, uid) == (plane.pid, plane.uid), f"the socket's peer is pid {pid} uid {uid}, not the announced "
                f"{plane.pid}/{plane.uid}: another process holds the name")  # fmt: skip
        frame = hello if isinstance(hello, bytes) else U32.pack(hello.ByteSize()) + hello.SerializeToString()
        socket.send_fds(sock, [frame[:4]], list(fds))
        return connection.send(frame[4:])

    # -- values and whole updates --------------------------------------------------------------------------------
    def values(self, spec: TensorSpec) -> np.ndarray:
        """Fresh synthetic values for `spec` (another seed each call)."""
        self._seed += 1
        return synthetic(spec, self._seed)

    def chunks(self, spec: TensorSpec, values: np.ndarray, box: Box | None = None, **kw: int) -> list[pb.PushChunk]:
        """The RAW chunks of the shard `box` (default: the whole tensor) of `values`, at the receiver's chunk limit."""
        offsets, shape = box or whole(spec)
        return shard_chunks(spec, values, offsets, shape, self.max_chunk_bytes, **kw)

    def first_chunk(self, spec: TensorSpec) -> pb.PushChunk:
        """The first RAW chunk of fresh values of the whole `spec` (what a case sends on a stream it leaves open)."""
        return self.chunks(spec, self.values(spec))[0]

    def payload(self) -> list[TensorSpec]:
        """The tensors positive cases push whole: the probe, and the big one when there is one."""
        return [s for s in (self.probe, self.big) if s is not None]

    def push_and_commit(
        self, version: int, specs: Sequence[TensorSpec], **options: Unpack[BeginOptions]
    ) -> pb.CommitReply:
        """A full single-rank update of `specs` over gRPC, committed (raises CaseFailed otherwise); `options` change
        its Begin."""
        self.begin(self.begin_request(version, specs, **options))
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
        """Record a commit of the kit's: the receiver's delta base is now `values` at `version`."""
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
