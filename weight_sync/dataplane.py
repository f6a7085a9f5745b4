"""The socket data plane: a rank's Push stream as a plain TCP connection, at the socket's own rate.

Python gRPC copies every chunk several times on both ends (see `weight_sync/README.md` for the rates); this plane writes
each chunk's header and element memory straight to the socket (`sendmsg`, no copy) and the receiver reads contiguous
raw payloads straight into its staging buffer (`recv_into`), so a push costs the socket plus one xxh3 pass per side.
Control stays on gRPC (Describe announces `data_port`, Begin hands each rank a ticket, Commit/Abort as before) and every
check of the gRPC path applies unchanged: both planes feed the same `StreamWriter`. Frames are documented in
`protos/weight_sync.proto`. The plane carries no encryption: receivers with TLS do not offer it.
"""

from __future__ import annotations

import functools
import logging
import queue
import select
import socket
import struct
import threading
import time
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from protos import weight_sync_pb2 as pb
from weight_sync.chunking import Chunk
from weight_sync.relay import results_of, split_tree
from weight_sync.staging import StagingArea, SyncError

__all__ = ["DataPlaneServer", "SocketRelay", "SocketStream", "StreamFailure", "relay_hello"]

log = logging.getLogger("weight_sync.dataplane")
_M = TypeVar("_M", bound=Message)

MAX_HEADER_BYTES = 1 << 16
DRAIN_S = 2.0  # how long a receiver keeps reading a refused stream so that its answer arrives
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
Code = grpc.StatusCode


class StreamFailure(Exception):
    """A socket stream that failed; `code()`/`details()` mirror `grpc.RpcError` so callers report both alike."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection {len(view) - got} bytes before the end of a frame")
        got += n


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_message(sock: socket.socket, message_type: type[_M], limit: int = MAX_HEADER_BYTES) -> _M:
    (n,) = _U32.unpack(_recv_bytes(sock, 4))
    if n > limit:
        raise SyncError(Code.INVALID_ARGUMENT, f"{message_type.__name__} frame of {n} bytes exceeds {limit}")
    try:
        return message_type.FromString(_recv_bytes(sock, n))
    except Exception as e:  # protobuf's DecodeError types
        raise SyncError(Code.INVALID_ARGUMENT, f"malformed {message_type.__name__} frame: {e}") from None


def _framed(message: Message) -> bytes:
    data = message.SerializeToString()
    return _U32.pack(len(data)) + data


class DataPlaneServer:
    """Accepts data-plane connections on `host` and writes each one's Push stream into the staging area.

    A connection opens its stream with the staging area's `open_stream(..., ticket=)`, so it needs the ticket that Begin
    gave its rank for the open update; at most `max_connections` streams are served at once (more are refused).
    """

    def __init__(
        self,
        area: StagingArea,
        host: str,
        port: int,
        *,
        max_connections: int,
        idle_timeout_s: float,
        push_timeout_s: float,
    ) -> None:
        self.area = area
        self.idle_timeout_s = idle_timeout_s
        self.push_timeout_s = push_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), port), family=family)
        self.port: int = self._listener.getsockname()[1]
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

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed by stop()
            threading.Thread(target=self._serve, args=(conn,), name="ws-dataplane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if not self._slots.acquire(blocking=False):
                self._reply(conn, Code.RESOURCE_EXHAUSTED, "too many data-plane connections; retry later")
                return
            with self._lock:
                self._connections.add(conn)
            try:
                conn.settimeout(self.idle_timeout_s)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._stream(conn)
            finally:
                with self._lock:
                    self._connections.discard(conn)
                self._slots.release()

    def _stream(self, conn: socket.socket) -> None:
        try:
            hello = _recv_message(conn, pb.DataHello)
            writer = self.area.open_stream(
                hello.session_id, hello.policy_version, hello.rank, ticket=hello.ticket,
                relay=[(t.address, t.data_port) for t in hello.relay], fanout=hello.fanout,
            )
        except SyncError as e:
            return self._reply(conn, e.code, e.message)
        except (OSError, ConnectionError) as e:
            log.warning("data-plane connection dropped before its hello: %r", e)
            return
        start = time.perf_counter()
        scratch = bytearray(0)
        relay = SocketRelay(hello, self.push_timeout_s) if hello.relay else None
        writer.set_cancel(functools.partial(_cut_connection, conn, relay))
        try:
            while True:
                (head_len,) = _U32.unpack(_recv_bytes(conn, 4))
                if head_len == 0:
                    break
                if head_len > MAX_HEADER_BYTES:
                    raise SyncError(
                        Code.INVALID_ARGUMENT, f"chunk header of {head_len} bytes exceeds {MAX_HEADER_BYTES}"
                    )
                try:
                    header = pb.ChunkHeader.FromString(_recv_bytes(conn, head_len))
                except Exception as e:  # protobuf's DecodeError types
                    raise SyncError(Code.INVALID_ARGUMENT, f"malformed chunk header: {e}") from None
                (payload_len,) = _U64.unpack(_recv_bytes(conn, 8))
                dest = writer.begin_chunk(header, payload_len)  # checks payload_len against the manifest first
                if dest is not None:
                    _recv_into(conn, dest)
                    writer.end_chunk(None)
                    if relay is not None:  # staging memory stays put until this stream (and its relay) finished
                        relay.forward(header, np.frombuffer(dest, dtype=np.uint8))
                    continue
                if len(scratch) < payload_len:
                    scratch = bytearray(payload_len)
                view = memoryview(scratch)[:payload_len]
                _recv_into(conn, view)
                writer.end_chunk(view)
                if relay is not None:  # the scratch buffer is reused by the next chunk: forward a copy
                    relay.forward(header, np.frombuffer(bytes(view), dtype=np.uint8))
            writer.finish()
        except SyncError as e:
            writer.close_failed(e)
            if relay is not None:
                relay.cancel()
            return self._reply(conn, e.code, e.message)
        except (OSError, ConnectionError) as e:  # the sender died or stalled, or the update was dropped (cut)
            dropped = writer.update.failure
            writer.close_failed(SyncError(Code.CANCELLED, f"rank {hello.rank} data-plane stream broke: {e!r}"))
            if relay is not None:
                relay.cancel()
            if dropped is not None:  # cut by `_cut_connection`: the write side is still open for the answer
                self._reply(conn, Code.ABORTED, f"update {writer.update.update_id} was dropped: {dropped.message}")
            return
        relayed = relay.finish() if relay is not None else []
        log.info("socket push %s", writer.summary(time.perf_counter() - start))
        reply = pb.PushReply(bytes_received=writer.bytes_received, num_shards=writer.num_shards, relayed=relayed)
        self._reply(conn, Code.OK, "", reply)

    @staticmethod
    def _reply(conn: socket.socket, code: grpc.StatusCode, message: str, reply: pb.PushReply | None = None) -> None:
        """Answer and close. A refusal may come while the sender is still writing: read and drop what it sends for a
        moment, so that closing with unread data does not reset the connection and destroy the answer."""
        try:
            conn.sendall(_framed(pb.DataReply(code=code.value[0], message=message, reply=reply)))
            if code == Code.OK:
                return
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.2)
            deadline = time.monotonic() + DRAIN_S
            while time.monotonic() < deadline and conn.recv(1 << 20):
                pass
        except OSError:
            pass  # the sender is gone (or quiet): the update is already failed or complete


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

    Same shape as `relay.PushStream`: `send_chunk` queues (bounded, a few chunks of memory), `close` ends the stream
    and returns the receiver's PushReply or a StreamFailure.
    """

    def __init__(self, host: str, port: int, hello: pb.DataHello, timeout_s: float, *, depth: int = 4) -> None:
        self.bytes_sent = 0
        self._deadline = time.monotonic() + timeout_s
        self._queue: queue.Queue[tuple[Chunk, bool] | None] = queue.Queue(depth)
        self._outcome: pb.PushReply | StreamFailure | None = None
        self._done = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, args=(host.strip("[]"), port, hello), daemon=True)
        self._thread.start()

    def send_chunk(self, chunk: Chunk, delta: bool) -> bool:
        """Queue one chunk (its delta form when `delta` and it has one); False when the stream already failed."""
        return self._put((chunk, delta))

    def _put(self, item: tuple[Chunk, bool] | None) -> bool:
        while not self._done.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> pb.PushReply | StreamFailure:
        self._put(None)
        self._thread.join(max(self._deadline - time.monotonic(), 0) + 5)
        if self._outcome is None:
            self.cancel()
            self._thread.join(5)
            return StreamFailure(Code.DEADLINE_EXCEEDED, "data-plane stream did not finish before push_timeout_s")
        return self._outcome

    def cancel(self) -> None:
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self, host: str, port: int, hello: pb.DataHello) -> None:
        try:
            self._outcome = self._stream(host, port, hello)
        except StreamFailure as e:
            self._outcome = e
        finally:
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
            self._sock = sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_framed(hello))
            while (item := self._queue.get()) is not None:
                if select.select([sock], [], [], 0)[0]:
                    break  # the receiver answered early: it refused the stream (its reply says why)
                header, payload = item[0].parts(item[1])
                head = header.SerializeToString()
                body = payload.data.cast("B") if isinstance(payload, np.ndarray) else memoryview(payload)
                self._send(sock, b"".join((_U32.pack(len(head)), head, _U64.pack(len(body)))), body)
            else:
                sock.sendall(_U32.pack(0))
        except OSError as e:
            # The receiver may have refused the stream and closed: its reply says why.
            broke = StreamFailure(Code.UNAVAILABLE, f"data-plane connection to {host}:{port} broke: {e!r}")
            return self._read_reply(fail=broke)
        return self._read_reply(fail=None)

    def _send(self, sock: socket.socket, prefix: bytes, body: memoryview) -> None:
        """Write a frame prefix and its payload without copying the payload (sendmsg gathers both)."""
        sent = sock.sendmsg([prefix, body])
        if sent < len(prefix):
            sock.sendall(prefix[sent:])
            sock.sendall(body)
        elif sent < len(prefix) + len(body):
            sock.sendall(body[sent - len(prefix) :])
        self.bytes_sent += len(prefix) + len(body)

    def _read_reply(self, fail: StreamFailure | None) -> pb.PushReply:
        sock = self._sock
        try:
            if sock is None:
                raise OSError("not connected")
            sock.settimeout(max(self._deadline - time.monotonic(), 1))
            reply = _recv_message(sock, pb.DataReply)
        except (OSError, ConnectionError, SyncError) as e:
            raise fail or StreamFailure(Code.UNAVAILABLE, f"no reply from the receiver's data plane: {e!r}") from None
        if reply.code != 0:
            code = next((c for c in Code if c.value[0] == reply.code), Code.UNKNOWN)
            raise StreamFailure(code, reply.message)
        return reply.reply


def relay_hello(hello: pb.DataHello, head: pb.RelayTarget, rest: list[pb.RelayTarget], fanout: int) -> pb.DataHello:
    """The hello that opens `head`'s stream of the same update and rank, asking it to forward to `rest`."""
    return pb.DataHello(
        session_id=hello.session_id, policy_version=hello.policy_version, rank=hello.rank, ticket=head.ticket,
        relay=rest, fanout=fanout,
    )


class SocketRelay:
    """A receiver's forwarding of one data-plane stream to its share of the downstream receivers (`hello.relay`),
    split into at most `hello.fanout` subtrees; chunks are forwarded as received, after this receiver checked them."""

    def __init__(self, hello: pb.DataHello, timeout_s: float) -> None:
        targets = {t.address: t for t in hello.relay}
        self._streams: list[tuple[str, list[str], SocketStream]] = []
        for head, rest in split_tree(list(targets), max(hello.fanout, 1)):
            first = relay_hello(hello, targets[head], [targets[a] for a in rest], hello.fanout)
            stream = SocketStream(head.rpartition(":")[0], targets[head].data_port, first, timeout_s)
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
