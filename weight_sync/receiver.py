"""The receiver: a gRPC server that stages pushed shards, checks them, and hands whole versions to a sink.

    receiver = WeightReceiver(StateDictSink(model.state_dict()), WeightSyncConfig())
    port = receiver.start()          # binds 127.0.0.1 by default; receiver.address -> "127.0.0.1:port"
    ...                              # trainers push; receiver.policy_version moves on every commit
    receiver.stop()

Any inference server takes pushes this way: implement `WeightSink` (manifest + apply) around the engine, run a
`WeightReceiver` next to it (in-process, as a Ray actor member, or `python -m weight_sync serve`), and register its
address with the trainer (`WeightSyncConfig.endpoints`). Clients in other languages use `protos/weight_sync.proto`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from protos import weight_sync_pb2 as pb
from weight_sync.channel import SERVICE, check_token, grpc_options, is_loopback, server_credentials
from weight_sync.codec import decode_chunk
from weight_sync.config import WeightSyncConfig
from weight_sync.dataplane import DataPlaneServer, StreamLimits
from weight_sync.peft import is_peft_name
from weight_sync.relay import Relay
from weight_sync.shm import ShmPlaneServer
from weight_sync.sink import WeightSink, lora_alpha_of, unavailable_reason
from weight_sync.spec import TensorSpec
from weight_sync.staging import StagingArea, StreamWriter, SyncError
from weight_sync.update import is_session_id, shown
from weight_sync.version import incompatibility, protocol_version

__all__ = ["WeightReceiver"]

log = logging.getLogger("weight_sync.receiver")
PUSH_SLOT_WAIT_S = 1.0  # how long a gRPC Push stream waits for the thread of a cut stream of a dropped update
_Request = TypeVar("_Request", bound=Message)


def committed_version_of(sink: WeightSink) -> int:
    """The version `sink` holds now (`WeightSink.committed_version`), where a (re)started receiver starts from.

    A sink written before that method existed starts at 0, with a warning: after a restart such a receiver would
    accept versions older than the ones it served.
    """
    report = getattr(sink, "committed_version", None)
    if report is None:
        log.warning(
            "%s has no committed_version(): the receiver starts at policy_version 0 and would accept older versions "
            "than the sink holds after a restart; implement WeightSink.committed_version", type(sink).__name__,
        )
        return 0
    version = report()
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"{type(sink).__name__}.committed_version() returned {version!r}; expected an int >= 0")
    return version


def _cut_rpc(context: grpc.ServicerContext, relay: Relay | None) -> None:
    """Cut a Push stream whose update was dropped: its handler's next read raises, so it stops writing."""
    context.cancel()
    if relay is not None:
        relay.cancel()


class WeightReceiver:
    """Serves the WeightSync protocol for one sink. Thread-safe; one update is staged at a time.

    Starts at the sink's committed version, applies each update exactly once and only ever moves forward, cuts the
    streams of dropped updates so staging memory stays within `area.staging_bound_bytes`, and relays only to the
    receivers a rank's Begin announced.

    No client starves the others: WatchVersion streams (`max_watch_streams`, each ending after `watch_timeout_s`),
    gRPC Push streams (`config.max_grpc_push_streams`) and waiting Commits each have their own share of the RPC
    threads, so Describe, Begin and Commit always find one; a Push stream idle for `stream_idle_timeout_s` is cut; the
    socket plane bounds connections before their hello separately (`dataplane.DataPlaneServer`); malformed request
    bytes get INVALID_ARGUMENT.

    :attr:`num_refused` counts the updates it refused, at Begin, in a stream (a bad chunk, a checksum) or at Commit
    (the sink's refusals included), once per update however many of its ranks were refused: what an operator alerts
    on (a trainer pushing versions that are not newer, or of another model, is refused at every step);
    :attr:`last_refusal` says which update was last refused, and why. A sink that
    says it takes no update now (``weight_sync.sink.unavailable_reason``) has every Begin refused with UNAVAILABLE.
    """

    def __init__(
        self, sink: WeightSink, config: WeightSyncConfig | None = None, sink_session: str | None = None
    ) -> None:
        """``sink_session``: the sender session whose weights the sink starts with, reported as the committed session
        until an update commits (an engine a trainer started on its own base: that trainer's adapters alone may go to
        it); None when unknown (a server started on a directory)."""
        self.sink = sink
        self.config = config or WeightSyncConfig()
        self.area = StagingArea(
            list(sink.manifest()),
            keep_base=self.config.delta is not False,
            idle_timeout_s=self.config.update_idle_timeout_s,
            max_chunk_bytes=self.config.chunk_bytes,
            policy_version=committed_version_of(sink),
            max_version_gap=self.config.max_version_gap,
            stream_idle_s=self.config.stream_idle_timeout_s,
            max_update_s=self.config.push_timeout_s + self.config.rpc_timeout_s,
        )
        self.area.trainer_session = sink_session
        self.area.on_refused = self._count_refusal
        self.lora_alpha = lora_alpha_of(sink)
        self._token = self.config.resolve_token()
        self._watch_slots = threading.BoundedSemaphore(self.config.max_watch_streams)
        self._push_slots = threading.BoundedSemaphore(self.config.max_grpc_push_streams)
        self._grpc_writers: set[StreamWriter] = set()  # open gRPC Push streams, watched for idleness
        self._writers_lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._server: grpc.Server | None = None
        self._handlers: futures.ThreadPoolExecutor | None = None
        self._data: DataPlaneServer | None = None
        self._shm: ShmPlaneServer | None = None
        self._port: int | None = None
        self._stopping = threading.Event()
        self.num_refused = 0
        self.last_refusal: str | None = None
        """The last counted refusal: ``"<session>@<version>: <STATUS>: <reason>"``."""
        self._refused_updates: deque[tuple[str, int]] = deque(maxlen=64)  # already counted: one count an update
        self._refused_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> int:
        """Bind and serve; return the bound port. Refuses a non-loopback bind without TLS and a token."""
        cfg = self.config
        if not is_loopback(cfg.bind_host) and not cfg.allow_insecure_remote:
            if cfg.tls_cert_path is None or self._token is None:
                raise ValueError(
                    f"bind_host={cfg.bind_host!r} is not loopback: configure TLS (tls_cert_path/tls_key_path) and a "
                    "token, or set allow_insecure_remote=true on a trusted network"
                )
        self._handlers = futures.ThreadPoolExecutor(max_workers=cfg.num_server_threads, thread_name_prefix="ws-rpc")
        server = grpc.server(self._handlers, options=[*grpc_options(cfg), *_connection_limits(cfg)])
        # Requests arrive as bytes and are parsed in `_parsed`: gRPC's own deserializers answer INTERNAL for bad bytes.
        handlers = {
            "Describe": grpc.unary_unary_rpc_method_handler(
                self._parsed(pb.DescribeRequest, self._describe), None, pb.DescribeReply.SerializeToString
            ),
            "Begin": grpc.unary_unary_rpc_method_handler(
                self._parsed(pb.BeginRequest, self._begin), None, pb.BeginReply.SerializeToString
            ),
            "Push": grpc.stream_unary_rpc_method_handler(self._push, None, pb.PushReply.SerializeToString),
            "Commit": grpc.unary_unary_rpc_method_handler(
                self._parsed(pb.CommitRequest, self._commit), None, pb.CommitReply.SerializeToString
            ),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self._parsed(pb.AbortRequest, self._abort), None, pb.AbortReply.SerializeToString
            ),
            "WatchVersion": grpc.unary_stream_rpc_method_handler(
                self._parsed(pb.WatchVersionRequest, self._watch), None, pb.VersionEvent.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        host = f"[{cfg.bind_host}]" if ":" in cfg.bind_host else cfg.bind_host
        creds = server_credentials(cfg)
        bind = f"{host}:{cfg.port}"
        try:  # gRPC raises RuntimeError for a taken port ("Failed to bind"), or returns 0
            port = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
        except RuntimeError as e:
            raise OSError(f"the weight-sync receiver cannot listen on {bind} ({e}): another process holds the port, "
                          "or the address is not this host's; choose another `port` (0 picks a free one) or "
                          "`bind_host`") from None  # fmt: skip
        if port == 0:
            raise OSError(f"the weight-sync receiver cannot listen on {bind}: choose another `port` (0 picks a free "
                          "one) or `bind_host`")  # fmt: skip
        if cfg.data_plane != "grpc" and creds is None:
            self._data = DataPlaneServer(self.area, cfg.bind_host, cfg.data_port, StreamLimits.of(cfg))
        if cfg.offers_shm:
            self._shm = self._shm_plane()
        server.start()
        self._server, self._port = server, port
        self._reaper = threading.Thread(target=self._cut_idle_streams, name="ws-idle-streams", daemon=True)
        self._reaper.start()
        log.info(
            "weight receiver on %s (tls=%s, token=%s, socket data plane port %s, shared-memory plane %s)",
            self.listening_on, creds is not None, self._token is not None,
            self._data.port if self._data is not None else "off",
            self._shm.offer.socket_name if self._shm is not None else "off",
        )
        return port

    def _shm_plane(self) -> ShmPlaneServer | None:
        """The shared-memory plane, or None (with a warning) where this host cannot offer it and only `offer_shm` asked;
        `data_plane = "shm"` insists: then it raises."""
        cfg = self.config
        try:
            return ShmPlaneServer(self.area, StreamLimits.of(cfg), max_mapped_bytes=self.area.staging_bound_bytes)
        except (OSError, AttributeError) as e:  # AttributeError: no memfd or SCM_RIGHTS support in this Python/OS
            if cfg.data_plane == "shm":
                raise OSError(f"data_plane='shm' but this host cannot offer a shared-memory plane: {e}") from e
            log.warning("offer_shm is set but this host cannot offer a shared-memory plane (%s): not offered", e)
            return None

    def stop(self, grace_s: float = 1.0) -> None:
        self._stopping.set()
        with self.area.version_changed:
            self.area.version_changed.notify_all()
        for plane in (self._data, self._shm):
            if plane is not None:
                plane.stop()
        self._data = self._shm = None
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        if self._handlers is not None:  # gRPC leaves the handler threads it was given idling
            self._handlers.shutdown(wait=False)
            self._handlers = None
        if self._reaper is not None:
            self._reaper.join(timeout=5)
            self._reaper = None

    @property
    def address(self) -> str:
        """Where a client on this host reaches the receiver: ``localhost:<port>`` for a wildcard bind, else
        :attr:`listening_on`."""
        host = "localhost" if self.listens_everywhere else self.config.bind_host
        return _host_port(host, self._started_port())

    @property
    def listening_on(self) -> str:
        """The bound address as configured (``0.0.0.0:<port>`` for a wildcard bind): what an operator reads."""
        return _host_port(self.config.bind_host, self._started_port())

    @property
    def listens_everywhere(self) -> bool:
        """Whether the receiver is bound to every interface (``0.0.0.0`` or ``::``)."""
        return self.config.bind_host in ("0.0.0.0", "::")

    def _started_port(self) -> int:
        if self._port is None:
            raise RuntimeError("receiver not started: call start() first")
        return self._port

    @property
    def policy_version(self) -> int:
        return self.area.policy_version

    def manifest(self) -> list[TensorSpec]:
        return list(self.area.manifest.values())

    # -- handlers ------------------------------------------------------------------------------------------------
    def _authorize(self, context: grpc.ServicerContext) -> None:
        problem = check_token(self._token, context.invocation_metadata())
        if problem:
            log.warning("refused a call from %s: %s", context.peer(), problem)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    def _parsed(
        self, message_type: type[_Request], handler: Callable[[_Request, grpc.ServicerContext], Any]
    ) -> Callable[[bytes, grpc.ServicerContext], Any]:
        """`handler` behind the token check and a parse of the request bytes that answers INVALID_ARGUMENT when they
        are not a `message_type` (gRPC's own deserializers answer INTERNAL)."""

        def run(data: bytes, context: grpc.ServicerContext) -> Any:
            self._authorize(context)
            try:
                request = message_type.FromString(data)
            except DecodeError as e:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {message_type.__name__}: {e}"
                )
            return handler(request, context)

        return run

    def _describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeReply:
        specs = [pb.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in self.area.manifest.values()]
        return pb.DescribeReply(
            manifest=specs,
            policy_version=self.area.policy_version,
            max_chunk_bytes=self.config.chunk_bytes,
            delta_supported=self.config.delta is not False,
            data_port=self._data.port if self._data is not None else 0,
            protocol_version=protocol_version(),
            shm_plane=self._shm.offer if self._shm is not None else None,
            lora_alpha=self.lora_alpha,
        )

    def _begin(self, request: pb.BeginRequest, context: grpc.ServicerContext) -> pb.BeginReply:
        problem = incompatibility(request.protocol_version, "sender")
        if problem:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, problem)
        try:
            unavailable = unavailable_reason(self.sink)
            if unavailable is not None:
                raise SyncError(grpc.StatusCode.UNAVAILABLE, unavailable)
            self._check_lora_alpha(request)
            update, delta = self.area.begin(request)
        except SyncError as e:
            log.warning("refused Begin of version %d from %s: %s", request.policy_version, context.peer(), e.message)
            self._count_refusal(request.session_id, request.policy_version, e)
            context.abort(e.code, e.message)
        ticket = update.tickets[request.rank] if self._data is not None or self._shm is not None else b""
        return pb.BeginReply(
            update_id=update.update_id,
            current_version=self.area.policy_version,
            delta_accepted=delta,
            data_ticket=ticket,
            committed_session_id=self.area.trainer_session or "",
        )

    def _check_lora_alpha(self, request: pb.BeginRequest) -> None:
        """Refuse adapters trained with another alpha than the sink applies: the tensors show the rank, not alpha, and
        a merge at the wrong scale would serve every version silently wrong. A Begin that does not say (0: a sender
        before protocol 1.5) is taken."""
        sent = request.lora_alpha
        if not (self.lora_alpha and sent and sent != self.lora_alpha):
            return
        if any(is_peft_name(t.name) for t in request.tensors):
            raise SyncError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"these adapters were trained with lora_alpha {sent:g} and this receiver applies adapters with "
                f"{self.lora_alpha:g} (its scale alpha / rank): restart it with the run's alpha (`weight_sync serve "
                f"--alpha {sent:g}`, or the rl_align plugin's lora.alpha) or push from a run of alpha "
                f"{self.lora_alpha:g}",
            )

    def _push(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        self._authorize(context)
        md = dict(context.invocation_metadata())
        try:
            session = md["x-ws-session"]
            version, rank = _metadata_int(md, "x-ws-version"), _metadata_int(md, "x-ws-rank")
            targets = [t for t in md.get("x-ws-relay", "").split(",") if t]
            fanout = _metadata_int(md, "x-ws-fanout", "2")
        except KeyError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Push needs metadata x-ws-session, x-ws-version, x-ws-rank")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self._push_slots.acquire(blocking=False) and not (
            self._cut_streams_running() and self._push_slots.acquire(timeout=PUSH_SLOT_WAIT_S)
        ):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this receiver serves at most {self.config.max_grpc_push_streams} gRPC Push streams at once "
                f"(num_server_threads={self.config.num_server_threads} less the threads set apart for other calls); "
                "raise the receiver's num_server_threads, push with fewer num_streams, or use the socket data plane",
            )
        try:
            return self._push_stream(chunks, context, session, version, rank, targets, fanout)
        finally:
            self._push_slots.release()

    def _push_stream(
        self, chunks: Iterator[bytes], context: grpc.ServicerContext, session: str, version: int, rank: int,
        targets: list[str], fanout: int,
    ) -> pb.PushReply:
        """One admitted gRPC Push stream: open it, write every chunk, answer; watched for idleness meanwhile."""
        try:
            writer = self.area.open_stream(session, version, rank, relay=[(t, None) for t in targets], fanout=fanout)
        except SyncError as e:
            context.abort(e.code, e.message)
        start = time.perf_counter()
        relay = Relay(targets, fanout, session, version, rank, self.config) if targets else None
        writer.set_cancel(functools.partial(_cut_rpc, context, relay))
        with self._writers_lock:
            self._grpc_writers.add(writer)
        try:
            return self._write_stream(chunks, context, writer, relay, rank, start)
        finally:
            with self._writers_lock:
                self._grpc_writers.discard(writer)

    def _write_stream(
        self, chunks: Iterator[bytes], context: grpc.ServicerContext, writer: StreamWriter, relay: Relay | None,
        rank: int, start: float,
    ) -> pb.PushReply:
        try:
            for raw in chunks:
                if relay is not None:
                    relay.forward(raw)
                try:
                    header, payload = decode_chunk(raw)
                except ValueError as e:
                    raise SyncError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                writer.feed(header, payload)
            writer.finish()
        except SyncError as e:
            writer.close_failed(e)
            if relay is not None:
                relay.cancel()
            context.abort(e.code, e.message)
        except BaseException as e:  # the client went away mid-stream (RpcError) or the server is stopping
            writer.close_failed(SyncError(grpc.StatusCode.CANCELLED, f"rank {rank} push stream broke: {e!r}"))
            if relay is not None:
                relay.cancel()
            raise
        relayed = relay.finish() if relay is not None else []
        log.info("push %s", writer.summary(time.perf_counter() - start))
        return pb.PushReply(bytes_received=writer.bytes_received, num_shards=writer.num_shards, relayed=relayed)

    def _cut_streams_running(self) -> bool:
        """Some gRPC Push stream of a dropped update still runs: its thread is about to be free (worth a wait)."""
        with self._writers_lock:
            return any(w.update.failure is not None for w in self._grpc_writers)

    def _cut_idle_streams(self) -> None:
        """Cut every gRPC Push stream that received nothing for `stream_idle_timeout_s` (its update is dropped): the
        request iterator has no timeout of its own, and an idle stream would hold its RPC thread for ever. Socket
        data-plane streams time out on their sockets."""
        limit = self.config.stream_idle_timeout_s
        while not self._stopping.wait(min(1.0, limit / 4)):
            now = time.monotonic()
            with self._writers_lock:
                idle = [w for w in self._grpc_writers if now - w.last_activity > limit]
            for writer in idle:
                error = SyncError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"rank {writer.rank}'s Push stream of {writer.update.update_id} received nothing for {limit:.0f} s "
                    "(stream_idle_timeout_s); the update is dropped",
                )
                if self.area.cut_stream(writer, error):  # its handler's close_failed then finds the update failed
                    self.area.stream_refused(writer.update, writer.rank, error)

    def _commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitReply:
        try:
            seconds = self.area.commit(request.session_id, request.policy_version, self._apply, context.is_active)
        except SyncError as e:
            log.warning("refused Commit of version %d from %s: %s", request.policy_version, context.peer(), e.message)
            self._count_refusal(request.session_id, request.policy_version, e)
            context.abort(e.code, e.message)
        log.info("committed policy_version %d (sink apply %.3f s)", request.policy_version, seconds)
        return pb.CommitReply(policy_version=self.area.policy_version, apply_seconds=seconds)

    def _count_refusal(self, session_id: str, policy_version: int, error: SyncError) -> None:
        """Count a refused update in :attr:`num_refused` and say it in :attr:`last_refusal`, unless another of its
        calls was counted already or the call was only turned away for now (another update holds the place, too many
        waiting Commits, a waiting Commit whose client left: a retry may well be taken)."""
        if error.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED):
            return
        key = (session_id, policy_version)
        with self._refused_lock:
            if key not in self._refused_updates:
                self._refused_updates.append(key)
                self.num_refused += 1
                session = session_id if is_session_id(session_id) else shown(session_id)  # else quoted and cut
                self.last_refusal = f"{session}@{policy_version}: {error.code.name}: {error.message}"

    def _apply(self, version: int, buffers: Mapping[str, tuple[np.ndarray, TensorSpec]]) -> None:
        self.sink.apply(version, {name: _as_tensor(buf, spec) for name, (buf, spec) in buffers.items()})

    def _abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        return pb.AbortReply(aborted=self.area.abort(request.session_id, request.policy_version, request.reason))

    def _changed_since(self, policy_version: int) -> bool:
        """A Watch's wake-up condition: a version newer than `policy_version` committed, or the receiver is stopping."""
        return self.area.policy_version > policy_version or self._stopping.is_set()

    def _watch(self, request: pb.WatchVersionRequest, context: grpc.ServicerContext) -> Iterator[pb.VersionEvent]:
        """At most `max_watch_streams` at once (RESOURCE_EXHAUSTED beyond); each ends after `watch_timeout_s`.

        The slot is taken once the stream is iterated and given back when it ends (a generator that never started
        has nothing to give back)."""
        if not self._watch_slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this receiver serves at most {self.config.max_watch_streams} WatchVersion streams at once "
                "(max_watch_streams); retry later, or poll Describe for policy_version",
            )
        last = request.after_version
        try:
            cond = self.area.version_changed
            end = time.monotonic() + self.config.watch_timeout_s
            while context.is_active() and not self._stopping.is_set() and (left := end - time.monotonic()) > 0:
                with cond:
                    cond.wait_for(functools.partial(self._changed_since, last), timeout=min(1.0, left))
                current = self.area.policy_version
                if current > last:
                    last = current
                    yield pb.VersionEvent(policy_version=current)
        finally:
            self._watch_slots.release()


IDLE_CONNECTION_S = 300


def _connection_limits(config: WeightSyncConfig) -> list[tuple[str, int]]:
    """gRPC server options that bound connections (``WeightSyncConfig.max_grpc_connections``): silent half-open
    connections (a TLS ClientHello never finished) held ~10,000 descriptors each of two clients until the server's
    ran out and its HTTP API failed with it."""
    return [
        ("grpc.max_allowed_incoming_connections", config.max_grpc_connections),
        ("grpc.server_handshake_timeout_ms", int(config.hello_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_S * 1000),
    ]


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _metadata_int(md: Mapping[str, str], key: str, default: str | None = None) -> int:
    """A Push metadata value that must be a decimal number (digits only: no sign, spaces or underscores)."""
    text = md[key] if default is None else md.get(key, default)
    if not (isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 20):
        raise ValueError(f"Push metadata {key} = {text[:40]!r} is not a decimal number")
    return int(text)


def _as_tensor(buf: np.ndarray, spec: TensorSpec) -> torch.Tensor:
    """The staged bytes of one tensor as that tensor, without a copy (a tensor of 0 elements: a new empty one, since
    torch cannot view 0 bytes as a wider dtype)."""
    dtype = getattr(torch, spec.dtype)
    if buf.size == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return torch.from_numpy(buf).view(dtype).reshape(spec.shape)
