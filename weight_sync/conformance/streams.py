"""The ways a rank's stream reaches a receiver, driven by hand: a gRPC Push stream fed message by message, a socket
data-plane connection written frame by frame (PROTOCOL.md's framing), and a shared-memory plane connection (the same
frames without payloads, which lie in a memfd passed with the hello: `memfd`). `Kit` opens them and closes them after
each case."""

from __future__ import annotations

import fcntl
import os
import queue
import socket
from collections.abc import Iterable, Iterator
from concurrent import futures

import grpc

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.wire import U32, U64, status_name


class Stream:
    """One gRPC Push stream, fed message by message and kept open until `close` (or `stop`)."""

    def __init__(self, push: grpc.StreamUnaryMultiCallable, metadata: tuple[tuple[str, str], ...],
                 timeout_s: float) -> None:
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._timeout_s = timeout_s
        self.future = push.future(self._messages(), metadata=metadata, timeout=timeout_s)

    def _messages(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not None:
            yield item

    def send(self, *messages: pb.PushChunk | bytes) -> Stream:
        """Queue `messages` (chunks, or raw bytes sent as they are) on the stream."""
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
        """End the stream from this side without waiting for an answer."""
        self._queue.put(None)
        self.future.cancel()


class Connection:
    """One socket data-plane connection, past its connect: frames as PROTOCOL.md writes them, then the DataReply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unopened: bool | None = None  # DataReply.unopened, once answered

    def send(self, data: bytes) -> Connection:
        """Write raw bytes; a closed peer is no error here (a receiver that refused the stream closed its side, and
        its reply says why)."""
        try:
            self.sock.sendall(data)
        except OSError:
            pass
        return self

    def hello(self, hello: pb.DataHello) -> Connection:
        """Frame: u32 length, DataHello."""
        return self.send(U32.pack(hello.ByteSize()) + hello.SerializeToString())

    def chunk(self, chunk: pb.PushChunk, payload_len: int | None = None) -> Connection:
        """Frame: u32 header length, ChunkHeader, u64 payload length, payload (`payload_len`: announce, send none)."""
        head = chunk.header.SerializeToString()
        if payload_len is not None:
            return self.send(U32.pack(len(head)) + head + U64.pack(payload_len))
        return self.send(U32.pack(len(head)) + head + U64.pack(len(chunk.payload)) + chunk.payload)

    def chunks(self, chunks: Iterable[pb.PushChunk]) -> Connection:
        """One chunk frame after another."""
        for chunk in chunks:
            self.chunk(chunk)
        return self

    def frames(self, chunks: Iterable[pb.PushChunk]) -> Connection:
        """The shared-memory plane's frames of `chunks`: header and payload length, the payload left in the memfd."""
        for chunk in chunks:
            self.chunk(chunk, payload_len=len(chunk.payload))
        return self

    def reply(self, end: bool = True, wait_s: float | None = None) -> str:
        """Send the end-of-stream frame (when `end`) and read the DataReply (within `wait_s`, default the connect
        timeout): its status name; `unopened` keeps its flag."""
        if end:
            self.send(U32.pack(0))
        try:
            if wait_s is not None:
                self.sock.settimeout(wait_s)
            (n,) = U32.unpack(_recv(self.sock, 4))
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


def memfd(data: bytes, *, seal: bool = True, allocate: bool = True, extra_bytes: int = 0) -> int:
    """A memfd holding `data` (then `extra_bytes` of zeros), as PROTOCOL.md 8.1 asks a sender to make one: fully
    allocated and sealed against shrinking and growth. `seal=False` leaves it unsealed, `allocate=False` leaves the
    pages past `data` unallocated (holes). The caller closes it."""
    fd = os.memfd_create("rl-align-conformance", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    size = len(data) + extra_bytes
    if allocate and size:
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)
    os.pwrite(fd, data, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd
