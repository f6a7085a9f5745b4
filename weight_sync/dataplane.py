"""The receiving end of the data planes: a rank's Push stream as a plain TCP connection, at the socket's own rate.

Python gRPC copies every chunk several times on both ends (see `weight_sync/README.md` for the rates); this plane writes
each chunk's header and element memory straight to the socket (`sendmsg`, no copy) and the receiver reads contiguous
raw payloads straight into its staging buffer (`recv_into`), so a push costs the socket plus one xxh3 pass per side.
Control stays on gRPC (Describe announces `data_port`, Begin hands each rank a ticket, Commit/Abort as before) and every
check of the gRPC path applies unchanged: both planes feed the same `StreamWriter`. Frames are documented in
`protos/weight_sync.proto`. The plane carries no encryption: receivers with TLS do not offer it.

No client starves the others here either: connections that have not sent their hello are bounded in number (a new one
beyond closes the oldest) and in time (`hello_timeout_s` for the whole hello), a connection past its hello belongs to
the open update (bounded by what its Begins announced), and a stream that receives nothing for `idle_timeout_s` is
cut. A refusal before the stream opened says so (`DataReply.unopened`): the sender may send that stream over gRPC.

`StreamServer` is the plane-neutral part (accept, hello bounds, the frame loop, answers); `DataPlaneServer` is its TCP
listener, `weight_sync.shm.ShmPlaneServer` its same-host shared-memory one, whose payloads lie in a memfd. The sending
end is `weight_sync.socket_push`; the framing both ends share is `weight_sync.frames`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
import threading
import time
from typing import Protocol

import grpc
import numpy as np
import xxhash

from protos import weight_sync_pb2 as pb
from weight_sync.config import WeightSyncConfig
from weight_sync.frames import (
    MAX_HEADER_BYTES,
    U32,
    U64,
    framed,
    recv_bytes,
    recv_into,
    recv_message,
    set_recv_timeout,
)
from weight_sync.socket_push import SocketRelay
from weight_sync.staging import StagingArea, StreamWriter, SyncError

__all__ = ["DataPlaneServer", "FrameSource", "SocketFrames", "StreamLimits", "StreamServer"]

log = logging.getLogger("weight_sync.dataplane")
DRAIN_S = 2.0  # how long a receiver keeps reading a refused stream so that its answer arrives
Code = grpc.StatusCode
_EVICTED = (
    Code.RESOURCE_EXHAUSTED,
    "too many data-plane connections waiting for their hello: this one, the oldest, was closed to make room; send "
    "the stream again (over gRPC Push, or a new connection that sends its hello at once)",
)


class FrameSource(Protocol):
    """Where a data-plane stream's frames come from once its hello was read: frame bytes from the connection, payloads
    from the connection (socket plane) or from shared memory (the shm plane)."""

    memory_bytes: int
    """Bytes of shared memory the stream brought (0 on the socket plane): at most what the rank's Begin announced."""

    def recv_bytes(self, n: int) -> bytes:
        """The next `n` bytes of the connection's frames; raises ConnectionError when it closes first."""
        ...

    def read_into(self, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> None:
        """The next payload, `len(view)` bytes, into `view`, fed to `hasher` (when given) in order as it lands; raises
        SyncError when it cannot be where the frame says."""
        ...

    def close(self) -> None:
        """Release what the stream held (file descriptors, mappings); idempotent."""
        ...


class SocketFrames:
    """The socket plane's frames: payloads follow their headers on the connection."""

    memory_bytes = 0

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn

    def recv_bytes(self, n: int) -> bytes:
        return recv_bytes(self._conn, n)

    def read_into(self, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> None:
        recv_into(self._conn, view, hasher)

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    """A data-plane server's bounds: see `StreamServer`. `of(config)` reads them from a receiver's config."""

    max_pending: int
    hello_timeout_s: float
    idle_timeout_s: float
    push_timeout_s: float
    relay_stall_s: float

    @classmethod
    def of(cls, config: WeightSyncConfig) -> StreamLimits:
        return cls(
            max_pending=config.max_pending_data_connections, hello_timeout_s=config.hello_timeout_s,
            idle_timeout_s=config.stream_idle_timeout_s, push_timeout_s=config.push_timeout_s,
            relay_stall_s=config.stream_idle_timeout_s / 4,
        )


class StreamServer:
    """Accepts data-plane connections on `listener` and writes each one's Push stream into the staging area.

    A connection opens its stream with the staging area's `open_stream(..., ticket=)`, so it needs the ticket that Begin
    gave its rank for the open update. Before that, at most `limits.max_pending` connections wait for their hello (a
    new one closes the oldest: RESOURCE_EXHAUSTED), each for at most `hello_timeout_s` (DEADLINE_EXCEEDED); a refusal
    before the stream opened sets `DataReply.unopened`. An open stream that receives nothing for `idle_timeout_s` is
    cut (DEADLINE_EXCEEDED) and its update dropped; a relay child that accepts nothing for `relay_stall_s` is cut.
    A plane's own way of reading the hello and the payloads is `_read_hello`.
    """

    def __init__(self, area: StagingArea, listener: socket.socket, limits: StreamLimits) -> None:
        self.area = area
        self.max_pending = limits.max_pending
        self.hello_timeout_s = limits.hello_timeout_s
        self.idle_timeout_s = limits.idle_timeout_s
        self.push_timeout_s = limits.push_timeout_s
        self.relay_stall_s = limits.relay_stall_s
        self._pending: dict[socket.socket, float] = {}  # connections waiting for their hello, oldest first
        self._evicted: set[socket.socket] = set()  # closed to make room for newer ones; their thread answers
        self._listener = listener
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="ws-dataplane-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and break open connections (their updates fail; the committed version stays)."""
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=5)

    def _accepted(self, conn: socket.socket) -> None:
        """Set up a new connection (socket options)."""

    def _read_hello(self, conn: socket.socket, deadline: float) -> tuple[pb.DataHello, FrameSource]:
        """The connection's hello, all of it before `deadline`, and where its frames come from. Raises SyncError for a
        hello to refuse, TimeoutError at the deadline, OSError when the peer went away."""
        return recv_message(conn, pb.DataHello, deadline=deadline), SocketFrames(conn)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed by stop()
            with self._lock:
                self._connections.add(conn)
                if len(self._pending) >= self.max_pending:  # the oldest silent one makes room: the newest is live
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]
                    self._evicted.add(oldest)
                    try:
                        oldest.shutdown(socket.SHUT_RD)  # its thread's read returns; it answers and closes
                    except OSError:
                        pass
                self._pending[conn] = time.monotonic()
            threading.Thread(target=self._serve, args=(conn,), name="ws-dataplane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._accepted(conn)
                opened = self._hello(conn)
                if opened is not None:
                    hello, frames = opened
                    try:
                        self._stream(conn, hello, frames)
                    finally:
                        frames.close()
            except OSError:
                pass  # the peer went away before its hello was read
            finally:
                with self._lock:
                    self._connections.discard(conn)
                    self._pending.pop(conn, None)
                    self._evicted.discard(conn)

    def _hello(self, conn: socket.socket) -> tuple[pb.DataHello, FrameSource] | None:
        """Read the connection's hello within `hello_timeout_s` of its accept and leave the pending set; None when
        refused (answered here, `unopened`) or gone."""
        with self._lock:
            accepted = self._pending.get(conn, time.monotonic())
        opened: tuple[pb.DataHello, FrameSource] | None = None
        refusal: tuple[grpc.StatusCode, str] | None = None
        try:
            opened = self._read_hello(conn, accepted + self.hello_timeout_s)
        except SyncError as e:
            refusal = (e.code, e.message)
        except TimeoutError:
            late = f"no complete DataHello within {self.hello_timeout_s:g} s of connecting (hello_timeout_s)"
            refusal = (Code.DEADLINE_EXCEEDED, late)
        except OSError as e:
            log.debug("data-plane connection dropped before its hello: %r", e)
        with self._lock:
            self._pending.pop(conn, None)
            evicted = conn in self._evicted
        if evicted and opened is not None:  # closed to make room for a newer one (perhaps as its hello arrived)
            opened[1].close()
            opened = None
        if evicted:
            refusal = _EVICTED
        if refusal is not None:
            self._reply(conn, *refusal, unopened=True)
        return opened

    def _stream(self, conn: socket.socket, hello: pb.DataHello, frames: FrameSource) -> None:
        try:
            writer = self.area.open_stream(
                hello.session_id, hello.policy_version, hello.rank, ticket=hello.ticket,
                relay=[(t.address, t.data_port) for t in hello.relay], fanout=hello.fanout,
                memory_bytes=frames.memory_bytes,
            )
        except SyncError as e:
            return self._reply(conn, e.code, e.message, unopened=True)
        set_recv_timeout(conn, self.idle_timeout_s)
        start = time.perf_counter()
        relay = SocketRelay(hello, self.push_timeout_s, self.relay_stall_s) if hello.relay else None
        writer.set_cancel(functools.partial(_cut_connection, conn, relay))
        try:
            self._write_frames(writer, frames, relay)
        except SyncError as e:
            writer.close_failed(e)
            if relay is not None:
                relay.cancel()
            return self._reply(conn, e.code, e.message)
        except (TimeoutError, BlockingIOError):  # the sender stalled: nothing for idle_timeout_s (SO_RCVTIMEO)
            idle = SyncError(
                Code.DEADLINE_EXCEEDED,
                f"rank {hello.rank}'s data-plane stream of {writer.update.update_id} received nothing for "
                f"{self.idle_timeout_s:g} s (stream_idle_timeout_s); the update is dropped",
            )
            writer.close_failed(idle)
            if relay is not None:
                relay.cancel()
            log.warning("%s", idle.message)
            return self._reply(conn, idle.code, idle.message)
        except (OSError, ConnectionError) as e:  # the sender died, or the update was dropped (cut)
            dropped = writer.update.failure
            writer.close_failed(SyncError(Code.CANCELLED, f"rank {hello.rank} data-plane stream broke: {e!r}"))
            if relay is not None:
                relay.cancel()
            if dropped is not None:  # cut by `_cut_connection`: the write side is still open for the answer
                self._reply(conn, Code.ABORTED, f"update {writer.update.update_id} was dropped: {dropped.message}")
            return
        except Exception as e:  # a defect here: the update is dropped, so its staging memory is not held for ever
            log.exception("rank %d's data-plane stream of %s failed", hello.rank, writer.update.update_id)
            failed = SyncError(Code.INTERNAL, f"rank {hello.rank}'s data-plane stream failed in the receiver: {e!r}")
            writer.close_failed(failed)
            if relay is not None:
                relay.cancel()
            return self._reply(conn, failed.code, failed.message)
        relayed = relay.finish() if relay is not None else []
        log.info("data-plane push %s", writer.summary(time.perf_counter() - start))
        reply = pb.PushReply(bytes_received=writer.bytes_received, num_shards=writer.num_shards, relayed=relayed)
        self._reply(conn, Code.OK, "", reply)

    @staticmethod
    def _write_frames(writer: StreamWriter, frames: FrameSource, relay: SocketRelay | None) -> None:
        """Check and stage every chunk frame up to the end-of-stream frame; raises SyncError for a refused chunk."""
        scratch = bytearray(0)
        while True:
            (head_len,) = U32.unpack(frames.recv_bytes(4))
            if head_len == 0:
                break
            if head_len > MAX_HEADER_BYTES:
                raise SyncError(Code.INVALID_ARGUMENT, f"chunk header of {head_len} bytes exceeds {MAX_HEADER_BYTES}")
            head = frames.recv_bytes(head_len + 8)  # the header and the payload length in one read
            try:
                header = pb.ChunkHeader.FromString(head[:head_len])
            except Exception as e:  # protobuf's DecodeError types
                raise SyncError(Code.INVALID_ARGUMENT, f"malformed chunk header: {e}") from None
            (payload_len,) = U64.unpack_from(head, head_len)
            dest = writer.begin_chunk(header, payload_len)  # checks payload_len against the manifest first
            if dest is not None:
                frames.read_into(dest, writer.raw_hasher)
                writer.end_chunk(None, hashed=True)
                if relay is not None:  # staging memory stays put until this stream (and its relay) finished
                    relay.forward(header, np.frombuffer(dest, dtype=np.uint8))
                continue
            if len(scratch) < payload_len:
                scratch = bytearray(payload_len)
            # A private copy whatever the plane: the writer checks the bytes it stages, never shared ones.
            view = memoryview(scratch)[:payload_len]
            frames.read_into(view)
            writer.end_chunk(view)
            if relay is not None:  # the scratch buffer is reused by the next chunk: forward a copy
                relay.forward(header, np.frombuffer(bytes(view), dtype=np.uint8))
        writer.finish()

    @staticmethod
    def _reply(
        conn: socket.socket, code: grpc.StatusCode, message: str, reply: pb.PushReply | None = None,
        unopened: bool = False,
    ) -> None:
        """Answer and close (`unopened`: refused before the stream opened, nothing of it reached the update). A refusal
        may come while the sender is still writing, and a stream may carry stray bytes after its end: read and drop
        what the sender sends until it closes (for a moment at most), so that closing with unread data does not reset
        the connection and destroy the answer."""
        try:
            conn.settimeout(DRAIN_S)
            answer = pb.DataReply(code=code.value[0], message=message, reply=reply, unopened=unopened)
            conn.sendall(framed(answer))
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.2)
            deadline = time.monotonic() + DRAIN_S
            while time.monotonic() < deadline and conn.recv(1 << 20):
                pass
        except OSError:
            pass  # the sender is gone (or quiet): the update is already failed or complete


class DataPlaneServer(StreamServer):
    """The socket data plane: a TCP listener on `host`:`port` (0 picks one; `port` says which)."""

    def __init__(self, area: StagingArea, host: str, port: int, limits: StreamLimits) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host.strip("[]"), port), family=family)
        self.port: int = listener.getsockname()[1]
        super().__init__(area, listener, limits)

    def _accepted(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _cut_connection(conn: socket.socket, relay: SocketRelay | None) -> None:
    """Cut a data-plane stream whose update was dropped: a read blocked in `recv_into` (a staging buffer) returns at
    once, so the stream stops writing; the write side stays open for the ABORTED answer."""
    try:
        conn.shutdown(socket.SHUT_RD)
    except OSError:
        pass  # already closed
    if relay is not None:
        relay.cancel()
