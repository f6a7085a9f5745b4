"""The sender side of the socket data plane: one Push stream as a TCP connection (`SocketStream`), and a receiver's
forwarding of a stream down its relay tree (`SocketRelay`)."""

from __future__ import annotations

import fcntl
import queue
import socket
import struct
import termios
import threading
import time

import grpc
import numpy as np

from protos import weight_sync_pb2 as pb
from weight_sync.chunking import Chunk
from weight_sync.frames import U32, answered, chunk_prefix, framed, read_reply, reply_result
from weight_sync.relay import (
    StreamFailure,
    await_answer,
    offer,
    reply_limit,
    results_of,
    silence_failure,
    split_tree,
)
from weight_sync.staging import SyncError

__all__ = ["SocketRelay", "SocketStream", "relay_hello"]

Code = grpc.StatusCode


class SocketStream:
    """One Push stream over the data plane, fed chunk by chunk from the sender's loop; a thread does the writes.

    Same shape as `relay.PushStream`: `send_chunk` queues (bounded, a few chunks of memory), `end` ends the stream
    without waiting, `close` ends it and returns the receiver's PushReply or a StreamFailure. A receiver that accepts
    no chunk for `stall_s` is cut (DEADLINE_EXCEEDED), so one stalled receiver does not hold up the sender's others.
    `unopened` tells whether a failure left the receiver's update untouched (the stream may be sent another way).
    """

    def __init__(
        self, host: str, port: int, hello: pb.DataHello, timeout_s: float, *, depth: int = 4,
        stall_s: float | None = None, connect_timeout_s: float | None = None, relayed: int = 0,
    ) -> None:
        """``relayed``: how many receivers the stream's receiver forwards it to (its answer waits for theirs: it may
        take ``stall_s`` per level of the tree below it)."""
        self.bytes_sent = 0
        self.send_s = 0.0  # time spent handing bytes to the socket: the link's pace when it is the slower side
        self.stream_s = 0.0  # from opening to the answer (set when the stream is done)
        self._opened = time.perf_counter()
        self.unopened = False
        self._deadline = time.monotonic() + timeout_s
        self._stall_s = stall_s
        self._reply_s = reply_limit(stall_s, relayed)
        self._connect_timeout_s = connect_timeout_s
        self._queue: queue.Queue[tuple[Chunk, bool] | None] = queue.Queue(depth)
        self._outcome: pb.PushReply | StreamFailure | None = None
        self._done = threading.Event()
        self._ended = False
        self._sent_all = False  # the end-of-stream frame is written
        self._stalled: float | None = None  # the silence it was cut after
        self._handed_over = False  # when cut: the receiver had the whole stream and owed its answer
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
            self._stalled = self._stall_s
            self.cancel()
        return outcome == "put"

    def end(self) -> None:
        """End the stream (its end-of-stream frame follows the queued chunks) without waiting for the answer."""
        if not self._ended:
            self._ended = True
            self._put(None)

    def close(self) -> pb.PushReply | StreamFailure:
        """End the stream and wait for the receiver's answer; a receiver silent too long is cut
        (:func:`weight_sync.relay.await_answer`: what it took is read off the socket's unacknowledged bytes)."""
        self.end()
        give_up = self._deadline + 5

        def answered(timeout: float) -> bool:
            self._thread.join(min(timeout, max(give_up - time.monotonic(), 0)))
            return not self._thread.is_alive() or time.monotonic() >= give_up

        def progress() -> tuple[object, bool]:
            unsent = unacknowledged_bytes(self._sock)
            mark = (self.bytes_sent, self._queue.qsize(), self._sent_all, unsent)
            return mark, self._sent_all and not unsent

        if self._stalled is None:
            silent = await_answer(answered, progress, self._stall_s, self._reply_s)
            if silent is not None:
                self._stalled, self._handed_over = silent, progress()[1]
                self.cancel()
                self._thread.join(5)
        if self._stalled is not None:
            return silence_failure(self._stalled, self._handed_over)
        if self._outcome is None:
            self.cancel()
            self._thread.join(5)
            return StreamFailure(Code.DEADLINE_EXCEEDED, "data-plane stream did not finish before push_timeout_s")
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
                sock.sendall(U32.pack(0))
                self._sent_all = True
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


def unacknowledged_bytes(sock: socket.socket | None) -> int | None:
    """Bytes written to ``sock`` that its peer has not acknowledged yet (Linux's ``TIOCOUTQ``): they stop draining when
    the peer stops reading. None where the platform does not tell, or the socket is closed."""
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return None
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return None


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
            stream = SocketStream(host, port, first, timeout_s, stall_s=stall_s, connect_timeout_s=stall_s,
                                  relayed=len(rest))  # fmt: skip
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
