"""The same-host shared-memory data plane, sender side: one rank's streams to the receivers on its host.

Per stream index the rank keeps a `Segment`, a memfd sized to that stream's share and reused from push to push (fresh
pages cost a page fault each, more than the copy). One thread per stream index copies the stream's shards into it and
hashes each step while it is still in cache, then hands the frames of what it wrote to every same-host receiver's
stream of that index (`ShmStream`), so receivers copy block k while the thread writes block k + 1, and N receivers
on the host cost the sender one copy. Shards larger than `BLOCK_BYTES` travel as a few row blocks (ordinary shards to
the receiver) for that overlap. Frames and replies are the socket plane's (`weight_sync.shm` has the receiver side).
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import xxhash

from protos import weight_sync_pb2 as pb
from weight_sync.chunking import Piece
from weight_sync.frames import HASH_STEP, answered, chunk_prefix, framed, read_reply, reply_result
from weight_sync.relay import StreamFailure
from weight_sync.shm import peer_credentials, unmap
from weight_sync.staging import SyncError

__all__ = ["BLOCK_BYTES", "Segment", "SegmentPool", "ShmPush", "ShmStream"]

Code = grpc.StatusCode
BLOCK_BYTES = 4 << 20  # a receiver starts copying once the first block of a stream is written
MAX_BLOCKS_PER_PIECE = 8  # keeps the shards per tensor far below the receiver's 4096
SEND_BUFFER = 4096  # small: a receiver that stops reading frames blocks the writes, so a stall is noticed


class Segment:
    """A memfd of `size` bytes, allocated, sealed against shrinking and growing, and mapped writable here (`view`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("rl-align-weight-push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            if size:
                os.posix_fallocate(self.fd, 0, size)  # receivers refuse memfds with holes
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._mapped = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) if size else None
        except BaseException:
            os.close(self.fd)
            raise
        self.view = np.frombuffer(self._mapped, dtype=np.uint8) if self._mapped is not None else np.empty(0, np.uint8)

    def close(self) -> None:
        self.view = np.empty(0, np.uint8)
        unmap(self._mapped)
        self._mapped = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SegmentPool:
    """A rank's segments, one per stream index, kept from push to push while they fit."""

    def __init__(self) -> None:
        self._segments: list[Segment] = []

    def segments(self, shares: Sequence[int], limit: int) -> list[Segment]:
        """Segments for streams of `shares` bytes: a kept one when it holds the share and stays within `limit` (the
        bytes of the tensors the rank's Begin announced, which receivers allow), else a new one of the share's size."""
        for index, share in enumerate(shares):
            if index == len(self._segments):
                self._segments.append(Segment(share))
            elif not share <= self._segments[index].size <= limit:
                self._segments[index].close()
                self._segments[index] = Segment(share)
        return self._segments[: len(shares)]

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []


def blocks(piece: Piece) -> Iterator[Piece]:
    """`piece` cut into at most `MAX_BLOCKS_PER_PIECE` row blocks of about `BLOCK_BYTES` (whole when smaller)."""
    rows = piece.row1 - piece.row0
    count = min(MAX_BLOCKS_PER_PIECE, rows, math.ceil(piece.nbytes / BLOCK_BYTES))
    if count <= 1:
        yield piece
        return
    bounds = [piece.row0 + rows * i // count for i in range(count + 1)]
    for row0, row1 in zip(bounds, bounds[1:]):
        yield Piece(piece.local, row0, row1)


def write_block(dest: np.ndarray, block: Piece, chunk_bytes: int) -> bytes:
    """Copy `block`'s elements into `dest` (its bytes of the segment), hashing each step from cache; return the frames
    of its chunks (a shard of its own, chunks of at most `chunk_bytes`)."""
    local = block.local
    first, last = block.span
    values = local.values[first:last]
    raw = values.view(np.uint8)
    hasher = xxhash.xxh3_64()
    for start in range(0, raw.size, HASH_STEP):
        written = dest[start : start + HASH_STEP]
        np.copyto(written, raw[start : start + HASH_STEP])
        hasher.update(written.data)
    offsets, shape = list(local.offsets), list(local.shape)
    if shape:
        offsets[0] += block.row0
        shape[0] = block.row1 - block.row0
    shard = pb.ShardHeader(name=local.name, offsets=offsets, shape=shape, xxh3_64=hasher.intdigest())
    step = max(1, chunk_bytes // values.itemsize)
    frames = []
    for begin in range(0, max(values.size, 1), step):
        count = min(step, values.size - begin)
        header = pb.ChunkHeader(element_offset=begin, num_elements=count, shard=shard if begin == 0 else None)
        frames.append(chunk_prefix(header, count * values.itemsize))
    return b"".join(frames)


class ShmStream:
    """One Push stream to a receiver's shared-memory plane: connect, check the peer, hello with the memfd, frames.

    Same outcome shape as the other planes' streams (`close` returns the PushReply or a StreamFailure; `unopened` when
    nothing of it reached the receiver's update, so it may go another way). A receiver that accepts no frame for
    `stall_s` is cut (DEADLINE_EXCEEDED).
    """

    def __init__(
        self, offer: pb.ShmPlane, hello: pb.DataHello, fd: int, timeout_s: float, *, stall_s: float,
        connect_timeout_s: float,
    ) -> None:
        self.bytes_sent = 0
        self.unopened = False
        self._deadline = time.monotonic() + timeout_s
        self._stall_s = stall_s
        self._failure: StreamFailure | None = None
        self._broken: StreamFailure | None = None  # the connection broke: the receiver's reply may say why
        self._answered = False
        self._ended = False
        self._reply: pb.DataReply | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._open(offer, hello, fd, connect_timeout_s)
        except StreamFailure as e:
            self._failure = e
            self._sock.close()

    def _open(self, offer: pb.ShmPlane, hello: pb.DataHello, fd: int, connect_timeout_s: float) -> None:
        sock = self._sock
        sock.settimeout(connect_timeout_s)
        try:
            sock.connect("\0" + offer.socket_name)
            peer = peer_credentials(sock)
        except OSError as e:
            self.unopened = True  # nothing was sent: the receiver's update has none of this stream
            raise StreamFailure(Code.UNAVAILABLE, f"cannot connect to the shared-memory plane: {e!r}") from e
        if peer != (offer.pid, offer.uid):
            self.unopened = True
            raise StreamFailure(
                Code.UNAVAILABLE,
                f"the shared-memory socket is held by pid {peer[0]} uid {peer[1]}, not by the receiver that Describe "
                f"announced (pid {offer.pid} uid {offer.uid}): nothing was sent to it",
            )
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        sock.settimeout(self._stall_s)
        data = framed(hello)
        try:
            sent = socket.send_fds(sock, [data], [fd])
            sock.sendall(data[sent:])
        except OSError as e:
            self._broken = StreamFailure(Code.UNAVAILABLE, f"the shared-memory connection broke at its hello: {e!r}")

    @property
    def live(self) -> bool:
        """Frames may still be sent: not failed, cut, broken, answered early or ended."""
        return self._failure is None and self._broken is None and not self._answered and not self._ended

    def send(self, frames: bytes, payload_bytes: int) -> bool:
        """Send the frames of payloads already written to the memfd; False when the stream cannot take them."""
        if not self.live:
            return False
        if answered(self._sock):
            self._answered = True  # the receiver answered early: it refused the stream; its reply says why
            self._read_answer(self._stall_s)
            return False
        try:
            self._sock.sendall(frames)
        except TimeoutError:
            self.cancel(StreamFailure(
                Code.DEADLINE_EXCEEDED,
                f"the receiver accepted no frame for {self._stall_s:g} s (half of stream_idle_timeout_s): cut so the "
                "push to the other receivers goes on",
            ))
            return False
        except OSError as e:
            self._broken = StreamFailure(Code.UNAVAILABLE, f"the shared-memory connection broke: {e!r}")
            return False
        self.bytes_sent += len(frames) + payload_bytes
        return True

    def end(self) -> None:
        """Send the end-of-stream frame (once)."""
        if self.send(b"\0\0\0\0", 0):
            self._ended = True

    def close(self) -> pb.PushReply | Exception:
        """The receiver's answer: its reply, or why the stream failed."""
        if self._reply is None and self._failure is None:
            self._read_answer(self._deadline - time.monotonic())
        self._sock.close()
        if self._failure is not None:
            return self._failure
        assert self._reply is not None, "an answer or a failure after _read_answer"
        try:
            return reply_result(self._reply)
        except StreamFailure as e:
            return e

    def _read_answer(self, timeout_s: float) -> None:
        """Read the receiver's DataReply into `_reply` (`unopened` from it), or record why none came."""
        try:
            self._reply = read_reply(self._sock, timeout_s)
        except (OSError, ConnectionError, SyncError) as e:
            self._failure = self._broken or StreamFailure(
                Code.UNAVAILABLE, f"no reply from the shared-memory plane: {e!r}"
            )
            return
        self.unopened = self.unopened or (self._reply.unopened and self._reply.code != 0)

    def cancel(self, failure: StreamFailure | None = None) -> None:
        """Cut the stream (the receiver drops the update); `close` then returns `failure` or CANCELLED."""
        if self._failure is None:
            self._failure = failure or StreamFailure(Code.CANCELLED, "shared-memory stream cut before its end")
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ShmPush:
    """One rank's push of one version to its same-host receivers: a thread per stream index fills that index's segment
    and feeds every receiver's stream of it, while the sender's loop feeds the other planes.

    `targets`: address -> (the receiver's ShmPlane, the rank's ticket there). A stream that fails (not `unopened`)
    fails its receiver's update, so that receiver's other streams are cut and fed no more.
    """

    def __init__(
        self, groups: Sequence[Sequence[Piece]], segments: Sequence[Segment],
        targets: dict[str, tuple[pb.ShmPlane, bytes]], hello: pb.DataHello, chunk_bytes: int, *, timeout_s: float,
        stall_s: float, connect_timeout_s: float,
    ) -> None:
        self._deadline = time.monotonic() + timeout_s
        self._chunk_bytes = chunk_bytes
        self._dead: set[str] = set()
        self.streams: dict[str, list[ShmStream]] = {}
        for address, (offer, ticket) in targets.items():
            own = pb.DataHello()
            own.CopyFrom(hello)
            own.ticket = ticket
            self.streams[address] = [
                ShmStream(offer, own, s.fd, timeout_s, stall_s=stall_s, connect_timeout_s=connect_timeout_s)
                for s in segments
            ]
        self._threads = [
            threading.Thread(target=self._feed, args=(index, group, segment), name="ws-shm-feed", daemon=True)
            for index, (group, segment) in enumerate(zip(groups, segments))
        ]
        for thread in self._threads:
            thread.start()

    def _feed(self, index: int, group: Sequence[Piece], segment: Segment) -> None:
        streams = [(address, opened[index]) for address, opened in self.streams.items()]
        offset = 0
        try:
            for block in (b for piece in group for b in blocks(piece)):
                if not any(s.live for _, s in streams):
                    return  # nobody to write for
                frames = write_block(segment.view[offset : offset + block.nbytes], block, self._chunk_bytes)
                offset += block.nbytes
                for address, stream in streams:
                    if address not in self._dead and not stream.send(frames, block.nbytes) and not stream.unopened:
                        self._fail(address, stream)
        finally:
            for address, stream in streams:
                if address not in self._dead:
                    stream.end()

    def _fail(self, address: str, failed: ShmStream) -> None:
        """`failed` failed its receiver's update: cut that receiver's other streams (the receiver drops them too)."""
        self._dead.add(address)
        for stream in self.streams[address]:
            if stream is not failed:
                stream.cancel()

    def close(self) -> list[tuple[str, int, ShmStream]]:
        """Wait for the feeding threads; (address, stream index, stream) of every stream, to `close` for its outcome."""
        for thread in self._threads:
            thread.join(max(self._deadline - time.monotonic(), 0) + 5)
        return [(address, index, s) for address, opened in self.streams.items() for index, s in enumerate(opened)]
