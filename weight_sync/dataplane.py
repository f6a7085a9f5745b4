"""The socket data plane: a rank's Push stream as a plain TCP connection, at the socket's own rate.

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
listener, `weight_sync.shm.ShmPlaneServer` its same-host shared-memory one, whose payloads lie in a memfd.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import select
import socket
import struct
import threading
import time
from typing import Protocol, TypeVar

import grpc
import numpy as np
import xxhash
from google.protobuf.message import Message

from protos import weight_sync_pb2 as pb
from weight_sync.chunking import Chunk
from weight_sync.config import WeightSyncConfig
from weight_sync.relay import StreamFailure, offer, results_of, split_tree
from weight_sync.staging import StagingArea, StreamWriter, SyncError

__all__ = [
    "DataPlaneServer", "FrameSource", "SocketRelay", "SocketStream", "StreamFailure", "StreamLimits", "StreamServer",
    "answered", "chunk_prefix", "framed", "read_reply", "recv_message", "relay_hello", "reply_result",
]

log = logging.getLogger("weight_sync.dataplane")
_M = TypeVar("_M", bound=Message)

MAX_HEADER_BYTES = 1 << 16
# Reads of a payload that is hashed as it arrives: small enough that the hash finds the bytes in cache (xxh3 runs at
# ~30 GB/s there and at memory speed, a third of that, on a buffer read back later).
HASH_STEP = 256 << 10
DRAIN_S = 2.0  # how long a receiver keeps reading a refused stream so that its answer arrives
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
Code = grpc.StatusCode
_EVICTED = (
    Code.RESOURCE_EXHAUSTED,
    "too many data-plane connections waiting for their hello: this one, the oldest, was closed to make room; send "
    "the stream again (over gRPC Push, or a new connection that sends its hello at once)",
)


def _recv_into(sock: socket.socket, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> None:
    """Fill `view` from `sock`; with `hasher`, feed it each read's bytes at once, while they are still in cache."""
    got, size = 0, len(view)
    step = HASH_STEP if hasher is not None else size
    while got < size:
        n = sock.recv_into(view[got:], min(size - got, step))
        if n == 0:
            raise ConnectionError(f"peer closed the connection {size - got} bytes before the end of a frame")
        if hasher is not None:
            hasher.update(view[got : got + n])
        got += n


def _set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking reads that fail (BlockingIOError) after `seconds` without data: the kernel's SO_RCVTIMEO, not Python's
    socket timeout, which polls before every read (one more system call per read of a payload)."""
    sock.settimeout(None)
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """`n` bytes that must all arrive before `deadline` (time.monotonic); raises TimeoutError after it, whatever pace
    the peer sends at (a per-read timeout alone lets a byte every few seconds go on for ever)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{n - got} of {n} bytes still missing at the deadline")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed the connection {n - got} bytes before the end of a frame")
        got += k
    return bytes(buf)


def recv_message(
    sock: socket.socket, message_type: type[_M], limit: int = MAX_HEADER_BYTES, deadline: float | None = None,
    received: bytes = b"",
) -> _M:
    """One framed message (u32 length, bytes), of which `received` (at most 4 bytes) already arrived; all of it
    before `deadline` when one is given."""
    def recv(n: int) -> bytes:
        return _recv_bytes(sock, n) if deadline is None else _recv_by(sock, n, deadline)

    (n,) = _U32.unpack(received + recv(4 - len(received)))
    if n > limit:
        raise SyncError(Code.INVALID_ARGUMENT, f"{message_type.__name__} frame of {n} bytes exceeds {limit}")
    try:
        return message_type.FromString(recv(n))
    except Exception as e:  # protobuf's DecodeError types
        raise SyncError(Code.INVALID_ARGUMENT, f"malformed {message_type.__name__} frame: {e}") from None


def framed(message: Message) -> bytes:
    """`message` as a frame: u32 length, then its bytes."""
    data = message.SerializeToString()
    return _U32.pack(len(data)) + data


def chunk_prefix(header: pb.ChunkHeader, payload_bytes: int) -> bytes:
    """The frame of one chunk up to its payload: u32 header length, ChunkHeader, u64 payload length."""
    head = header.SerializeToString()
    return b"".join((_U32.pack(len(head)), head, _U64.pack(payload_bytes)))


def answered(sock: socket.socket) -> bool:
    """Whether the receiver already answered (or closed) a stream the sender is still writing: it refused it. (poll,
    not select: select fails on descriptor numbers past 1024, which busy processes reach.)"""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def read_reply(sock: socket.socket, timeout_s: float) -> pb.DataReply:
    """The receiver's answer on a data-plane connection; raises OSError, ConnectionError or SyncError when none came."""
    sock.settimeout(max(timeout_s, 1))
    return recv_message(sock, pb.DataReply)


def reply_result(reply: pb.DataReply) -> pb.PushReply:
    """The stream's PushReply when the receiver answered OK; raises its refusal as a StreamFailure otherwise."""
    if reply.code != 0:
        code = next((c for c in Code if c.value[0] == reply.code), Code.UNKNOWN)
        raise StreamFailure(code, reply.message)
    return reply.reply


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
        return _recv_bytes(self._conn, n)

    def read_into(self, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> None:
        _recv_into(self._conn, view, hasher)

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
        _set_recv_timeout(conn, self.idle_timeout_s)
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
        relayed = relay.finish() if relay is not None else []
        log.info("data-plane push %s", writer.summary(time.perf_counter() - start))
        reply = pb.PushReply(bytes_received=writer.bytes_received, num_shards=writer.num_shards, relayed=relayed)
        self._reply(conn, Code.OK, "", reply)

    @staticmethod
    def _write_frames(writer: StreamWriter, frames: FrameSource, relay: SocketRelay | None) -> None:
        """Check and stage every chunk frame up to the end-of-stream frame; raises SyncError for a refused chunk."""
        scratch = bytearray(0)
        while True:
            (head_len,) = _U32.unpack(frames.recv_bytes(4))
            if head_len == 0:
                break
            if head_len > MAX_HEADER_BYTES:
                raise SyncError(Code.INVALID_ARGUMENT, f"chunk header of {head_len} bytes exceeds {MAX_HEADER_BYTES}")
            head = frames.recv_bytes(head_len + 8)  # the header and the payload length in one read
            try:
                header = pb.ChunkHeader.FromString(head[:head_len])
            except Exception as e:  # protobuf's DecodeError types
                raise SyncError(Code.INVALID_ARGUMENT, f"malformed chunk header: {e}") from None
            (payload_len,) = _U64.unpack_from(head, head_len)
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


class SocketStream:
    """One Push stream over the data plane, fed chunk by chunk from the sender's loop; a thread does the writes.

    Same shape as `relay.PushStream`: `send_chunk` queues (bounded, a few chunks of memory), `end` ends the stream
    without waiting, `close` ends it and returns the receiver's PushReply or a StreamFailure. A receiver that accepts
    no chunk for `stall_s` is cut (DEADLINE_EXCEEDED), so one stalled receiver does not hold up the sender's others.
    `unopened` tells whether a failure left the receiver's update untouched (the stream may be sent another way).
    """

    def __init__(
        self, host: str, port: int, hello: pb.DataHello, timeout_s: float, *, depth: int = 4,
        stall_s: float | None = None, connect_timeout_s: float | None = None,
    ) -> None:
        self.bytes_sent = 0
        self.send_s = 0.0  # time spent handing bytes to the socket: the link's pace when it is the slower side
        self.stream_s = 0.0  # from opening to the answer (set when the stream is done)
        self._opened = time.perf_counter()
        self.unopened = False
        self._deadline = time.monotonic() + timeout_s
        self._stall_s = stall_s
        self._connect_timeout_s = connect_timeout_s
        self._queue: queue.Queue[tuple[Chunk, bool] | None] = queue.Queue(depth)
        self._outcome: pb.PushReply | StreamFailure | None = None
        self._done = threading.Event()
        self._ended = False
        self._stalled = False
        self._cancelled = False
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, args=(host.strip("[]"), port, hello), daemon=True)
        self._thread.start()

    def send_chunk(self, chunk: Chunk, delta: bool) -> bool:
        """Queue one chunk (its delta form when `delta` and it has one); False when the stream already failed."""
        return self._put((chunk, delta))

    def _put(self, item: tuple[Chunk, bool] | None) -> bool:
        if self._cancelled:
            return False
        outcome = offer(self._queue, item, self._done.is_set, self._stall_s)
        if outcome == "stalled":
            self._stalled = True
            self.cancel()
        return outcome == "put"

    def end(self) -> None:
        """End the stream (its end-of-stream frame follows the queued chunks) without waiting for the answer."""
        if not self._ended:
            self._ended = True
            self._put(None)

    def close(self) -> pb.PushReply | StreamFailure:
        self.end()
        self._thread.join(max(self._deadline - time.monotonic(), 0) + 5)
        if self._outcome is None:
            self.cancel()
            self._thread.join(5)
            return StreamFailure(Code.DEADLINE_EXCEEDED, "data-plane stream did not finish before push_timeout_s")
        if self._stalled:
            return StreamFailure(
                Code.DEADLINE_EXCEEDED,
                f"the receiver accepted no chunk for {self._stall_s:g} s (half of stream_idle_timeout_s): cut so the "
                "push to the other receivers goes on",
            )
        return self._outcome

    def cancel(self) -> None:
        """Cut the stream: its thread stops writing and the stream fails (also while it is still connecting)."""
        self._cancelled = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:  # wake the thread if it waits for chunks that will never come
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # it is not waiting for chunks: its next socket call fails

    def _run(self, host: str, port: int, hello: pb.DataHello) -> None:
        try:
            self._outcome = self._stream(host, port, hello)
        except StreamFailure as e:
            self._outcome = e
        finally:
            self.stream_s = time.perf_counter() - self._opened
            self._done.set()
            if self._sock is not None:
                self._sock.close()
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def _stream(self, host: str, port: int, hello: pb.DataHello) -> pb.PushReply:
        try:
            timeout = max(self._deadline - time.monotonic(), 1)
            try:
                connect_timeout = min(timeout, self._connect_timeout_s or timeout)
                self._sock = sock = socket.create_connection((host, port), timeout=connect_timeout)
            except OSError as e:
                self.unopened = True  # nothing was sent: the receiver's update has none of this stream
                problem = f"cannot connect to the data plane at {host}:{port}: {e!r}"
                raise StreamFailure(Code.UNAVAILABLE, problem) from e
            if self._cancelled:
                raise StreamFailure(Code.CANCELLED, "data-plane stream cut while it connected")
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(framed(hello))
            while (item := self._queue.get()) is not None:
                if answered(sock):
                    break  # the receiver answered early: it refused the stream (its reply says why)
                header, payload = item[0].parts(item[1])
                body = payload.data.cast("B") if isinstance(payload, np.ndarray) else memoryview(payload)
                self._send(sock, chunk_prefix(header, len(body)), body)
            else:
                if self._cancelled:  # cut, not ended: never send the end-of-stream frame
                    raise StreamFailure(Code.CANCELLED, "data-plane stream cut before its end")
                sock.sendall(_U32.pack(0))
        except OSError as e:
            # The receiver may have refused the stream and closed: its reply says why.
            broke = StreamFailure(Code.UNAVAILABLE, f"data-plane connection to {host}:{port} broke: {e!r}")
            return self._read_reply(fail=broke)
        return self._read_reply(fail=None)

    def _send(self, sock: socket.socket, prefix: bytes, body: memoryview) -> None:
        """Write a frame prefix and its payload without copying the payload (sendmsg gathers both)."""
        start = time.perf_counter()
        sent = sock.sendmsg([prefix, body])
        if sent < len(prefix):
            sock.sendall(prefix[sent:])
            sock.sendall(body)
        elif sent < len(prefix) + len(body):
            sock.sendall(body[sent - len(prefix) :])
        self.send_s += time.perf_counter() - start
        self.bytes_sent += len(prefix) + len(body)

    def _read_reply(self, fail: StreamFailure | None) -> pb.PushReply:
        sock = self._sock
        try:
            if sock is None:
                raise OSError("not connected")
            reply = read_reply(sock, self._deadline - time.monotonic())
        except (OSError, ConnectionError, SyncError) as e:
            raise fail or StreamFailure(Code.UNAVAILABLE, f"no reply from the receiver's data plane: {e!r}") from None
        self.unopened = reply.unopened and reply.code != 0
        return reply_result(reply)


def relay_hello(hello: pb.DataHello, head: pb.RelayTarget, rest: list[pb.RelayTarget], fanout: int) -> pb.DataHello:
    """The hello that opens `head`'s stream of the same update and rank, asking it to forward to `rest`."""
    return pb.DataHello(
        session_id=hello.session_id, policy_version=hello.policy_version, rank=hello.rank, ticket=head.ticket,
        relay=rest, fanout=fanout,
    )


class SocketRelay:
    """A receiver's forwarding of one data-plane stream to its share of the downstream receivers (`hello.relay`),
    split into at most `hello.fanout` subtrees; chunks are forwarded as received, after this receiver checked them."""

    def __init__(self, hello: pb.DataHello, timeout_s: float, stall_s: float) -> None:
        targets = {t.address: t for t in hello.relay}
        self._streams: list[tuple[str, list[str], SocketStream]] = []
        for head, rest in split_tree(list(targets), max(hello.fanout, 1)):
            first = relay_hello(hello, targets[head], [targets[a] for a in rest], hello.fanout)
            host, port = head.rpartition(":")[0], targets[head].data_port
            stream = SocketStream(host, port, first, timeout_s, stall_s=stall_s, connect_timeout_s=stall_s)
            self._streams.append((head, rest, stream))

    def forward(self, header: pb.ChunkHeader, payload: np.ndarray) -> None:
        chunk = Chunk(header, payload)
        for _, _, stream in self._streams:
            stream.send_chunk(chunk, False)

    def finish(self) -> list[pb.RelayResult]:
        results: list[pb.RelayResult] = []
        for head, rest, stream in self._streams:
            results += results_of(head, rest, stream.close())
        return results

    def cancel(self) -> None:
        for _, _, stream in self._streams:
            stream.cancel()
