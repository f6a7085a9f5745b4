"""The data planes' framing, shared by both ends: length-prefixed protobuf messages, chunk frames, replies, and the
socket reads they need. Frames are documented in `protos/weight_sync.proto` and `weight_sync/PROTOCOL.md`."""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import TypeVar

import grpc
import xxhash
from google.protobuf.message import Message

from protos import weight_sync_pb2 as pb
from weight_sync.relay import StreamFailure
from weight_sync.staging import SyncError

__all__ = [
    "HASH_STEP", "MAX_HEADER_BYTES", "U32", "U64", "answered", "chunk_prefix", "framed", "read_reply", "recv_bytes",
    "recv_into", "recv_message", "reply_result", "set_recv_timeout",
]

_M = TypeVar("_M", bound=Message)

MAX_HEADER_BYTES = 1 << 16
# Steps of a payload hashed as it is read or copied: small enough that the hash finds the bytes still in cache, where
# xxh3 runs several times faster than on a buffer read back from memory.
HASH_STEP = 256 << 10
U32 = struct.Struct("<I")  # frame and header lengths
U64 = struct.Struct("<Q")  # payload lengths
Code = grpc.StatusCode

def recv_into(sock: socket.socket, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> None:
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


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking reads that fail (BlockingIOError) after `seconds` without data: the kernel's SO_RCVTIMEO, not Python's
    socket timeout, which polls before every read (one more system call per read of a payload)."""
    sock.settimeout(None)
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
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
        return recv_bytes(sock, n) if deadline is None else _recv_by(sock, n, deadline)

    (n,) = U32.unpack(received + recv(4 - len(received)))
    if n > limit:
        raise SyncError(Code.INVALID_ARGUMENT, f"{message_type.__name__} frame of {n} bytes exceeds {limit}")
    body = recv(n)  # a stall or a close here is the caller's to answer, as one before the length
    try:
        return message_type.FromString(body)
    except Exception as e:  # protobuf's DecodeError types
        raise SyncError(Code.INVALID_ARGUMENT, f"malformed {message_type.__name__} frame: {e}") from None


def framed(message: Message) -> bytes:
    """`message` as a frame: u32 length, then its bytes."""
    data = message.SerializeToString()
    return U32.pack(len(data)) + data


def chunk_prefix(header: pb.ChunkHeader, payload_bytes: int) -> bytes:
    """The frame of one chunk up to its payload: u32 header length, ChunkHeader, u64 payload length."""
    head = header.SerializeToString()
    return b"".join((U32.pack(len(head)), head, U64.pack(payload_bytes)))


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
