"""The same-host shared-memory data plane, receiver side: Push streams whose payloads lie in a sender's memfd.

A sender on the receiver's host writes a stream's payloads into a memfd and passes its file descriptor with the
stream's hello over an abstract-namespace Unix socket (SCM_RIGHTS); the frames that follow are the socket plane's
(`weight_sync.dataplane`), without the payload bytes: each payload is the next `p` bytes of the memfd. The receiver
copies each payload into its own staging buffer and the `StreamWriter` checks it there (checksums, sizes, order, the
ticket of the rank's Begin): every check of the other planes applies, and as the bytes checked are the receiver's
private copy, a memfd the sender changes meanwhile can fail the update but never get unchecked bytes applied. No
payload crosses a socket, so a push costs one copy per side (plus one xxh3 pass over data still in cache).

Describe announces `ShmPlane(host_id, socket_name, pid, uid)`. `host_id` (`host_identity`) names the kernel and the
namespaces a sender must share to reach the socket and read the pid alike; a sender elsewhere never tries. The socket's
name is random (128 bits), and a sender checks the connected peer's SO_PEERCRED against the announced pid and uid
before it passes anything, so a process that binds the name after the receiver went away gets no weights.
The memfd must be sealed against shrinking (a read past a shrunk end would kill the receiver with SIGBUS), fully
allocated, of normal pages, and at most the bytes of the tensors the rank's Begin announced.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import functools
import logging
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import xxhash

from protos import weight_sync_pb2 as pb
from weight_sync.dataplane import StreamLimits, StreamServer
from weight_sync.frames import HASH_STEP, MAX_HEADER_BYTES, recv_message
from weight_sync.staging import StagingArea, SyncError

__all__ = ["MemfdMappings", "ShmPlaneServer", "check_memfd", "host_identity", "peer_credentials", "unmap"]

log = logging.getLogger("weight_sync.shm")
Code = grpc.StatusCode
SOCKET_PREFIX = "rl-align-ws-"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@functools.cache
def host_identity() -> str | None:
    """This process's kernel boot id and network, pid and user namespaces, or None where /proc does not say.

    Two processes with the same identity reach the same abstract Unix sockets and see the same pids and uids, so the
    shared-memory plane works between them and its SO_PEERCRED check means something.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        spaces = [os.readlink(f"/proc/self/ns/{name}") for name in ("net", "pid", "user")]
    except OSError:
        return None
    return "/".join([boot_id, *spaces]) if boot_id else None


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def check_memfd(fd: int) -> int:
    """The size of a memfd a sender passed, once it is safe to map: raises SyncError (INVALID_ARGUMENT) otherwise.

    Safe means: a regular file that supports seals (shared memory: reads never wait on a disk or a network), sealed
    against shrinking (so no read can fall past its end), of normal pages, with every page allocated.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SyncError(Code.INVALID_ARGUMENT, "the file descriptor passed with the hello is no memfd (not a file)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise SyncError(
            Code.INVALID_ARGUMENT, "the file descriptor passed with the hello is no memfd (it takes no seals)"
        ) from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise SyncError(
            Code.INVALID_ARGUMENT,
            "the memfd is not sealed against shrinking (F_SEAL_SHRINK): a read past a shrunk end would crash the "
            "receiver",
        )
    if info.st_blksize != mmap.PAGESIZE:
        raise SyncError(Code.INVALID_ARGUMENT, f"the memfd has pages of {info.st_blksize} bytes (huge pages)")
    if info.st_blocks * 512 < info.st_size:
        raise SyncError(
            Code.INVALID_ARGUMENT, "the memfd has unallocated pages (holes): allocate it (fallocate) before passing it"
        )
    return info.st_size


def unmap(mapped: mmap.mmap | None) -> None:
    """Unmap `mapped` now, or, while a view of it is still alive somewhere, when the last one goes."""
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:
            pass  # numpy views still export it: the mapping goes with its last reference


@dataclasses.dataclass(eq=False)
class _Mapping:
    key: tuple[int, int]  # (st_dev, st_ino) of the memfd
    size: int
    view: np.ndarray  # read-only bytes of the mapping
    mapped: mmap.mmap | None
    users: int = 1
    cached: bool = False

    def unmap(self) -> None:
        self.view = np.empty(0, np.uint8)
        unmap(self.mapped)
        self.mapped = None


class MemfdMappings:
    """Read-only mappings of senders' memfds, kept from stream to stream.

    A first read of a fresh mapping takes a page fault per page, which costs more than the copy itself; senders reuse
    their memfds from push to push, so a mapping is kept for the next stream that brings the same file (the same
    (device, inode): a file cannot be reused while mapped). At most `max_bytes` in at most `max_entries` mappings stay
    mapped while no stream uses them, the least recently used going first: each mapping holds a descriptor, so a bound
    on bytes alone let a client of tiny memfds use up the receiver's descriptors. The pages are the senders' memory,
    not more of the receiver's.
    """

    def __init__(self, max_bytes: int, max_entries: int = 256) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[int, int], _Mapping] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, fd: int, size: int) -> _Mapping:
        """A mapping of the whole memfd `fd` of `size` bytes (its `view`); `release` it when the stream ends."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.size == size:
                entry.users += 1
                self._entries.move_to_end(key)
                return entry
        try:
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
        except (OSError, ValueError) as e:
            raise SyncError(Code.RESOURCE_EXHAUSTED, f"cannot map the stream's memfd of {size} bytes: {e}") from None
        view = np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else np.empty(0, np.uint8)
        fresh = _Mapping(key, size, view, mapped)
        with self._lock:
            old = self._entries.get(key)
            if old is None or old.users == 0:
                if old is not None:
                    old.unmap()
                fresh.cached = True
                self._entries[key] = fresh
            self._trim()
        return fresh

    def release(self, entry: _Mapping) -> None:
        with self._lock:
            entry.users -= 1
            if entry.users == 0 and (not entry.cached or self._closed):
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
                entry.unmap()
            self._trim()

    def close(self) -> None:
        """Unmap every mapping no stream uses now, and the others as their streams end (the receiver stops)."""
        with self._lock:
            self._closed = True
            for key, entry in list(self._entries.items()):
                if entry.users == 0:
                    del self._entries[key]
                    entry.unmap()

    def _trim(self) -> None:
        """Drop the least recently used idle mappings past `max_bytes` or `max_entries` (caller holds the lock)."""
        total, count = sum(e.size for e in self._entries.values()), len(self._entries)
        for key, entry in list(self._entries.items()):
            if total <= self.max_bytes and count <= self.max_entries:
                return
            if entry.users == 0:
                del self._entries[key]
                entry.unmap()
                total, count = total - entry.size, count - 1


class MemfdFrames:
    """A shm-plane stream's frames: headers from the Unix socket (read in batches), payloads from its memfd, each the
    next `len(view)` bytes of it. Implements `dataplane.FrameSource`; owns the memfd's descriptor."""

    def __init__(self, conn: socket.socket, fd: int, size: int, mappings: MemfdMappings) -> None:
        self.memory_bytes = size
        self._conn, self._fd, self._mappings = conn, fd, mappings
        self._mapping: _Mapping | None = None
        self._offset = 0
        self._buffer = bytearray()
        self._start = 0

    def recv_bytes(self, n: int) -> bytes:
        while len(self._buffer) - self._start < n:
            if self._start:
                del self._buffer[: self._start]
                self._start = 0
            data = self._conn.recv(1 << 16)
            if not data:
                raise ConnectionError(f"peer closed the connection {n - len(self._buffer)} bytes before a frame's end")
            self._buffer += data
        out = bytes(self._buffer[self._start : self._start + n])
        self._start += n
        return out

    def read_into(self, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> None:
        n = len(view)
        if self._offset + n > self.memory_bytes:
            raise SyncError(
                Code.OUT_OF_RANGE,
                f"a payload of {n} bytes at offset {self._offset} runs past the end of the stream's memfd "
                f"({self.memory_bytes} bytes)",
            )
        if self._mapping is None:
            self._mapping = self._mappings.acquire(self._fd, self.memory_bytes)
        dest, src = np.frombuffer(view, dtype=np.uint8), self._mapping.view[self._offset : self._offset + n]
        step = HASH_STEP if hasher is not None else max(n, 1)  # a 0-byte payload (an empty shard): no step at all
        for i in range(0, n, step):  # each step hashed right after its copy, from cache
            np.copyto(dest[i : i + step], src[i : i + step])
            if hasher is not None:
                hasher.update(dest[i : i + step].data)
        self._offset += n

    def close(self) -> None:
        if self._mapping is not None:
            self._mappings.release(self._mapping)
            self._mapping = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShmPlaneServer(StreamServer):
    """The shared-memory data plane: an abstract-namespace Unix socket with a random name (`offer` says which).

    Connections are bounded and timed like the socket plane's (`dataplane.StreamServer`, `limits`); `max_mapped_bytes`
    bounds
    the senders' memfds kept mapped between streams (`MemfdMappings`). Raises OSError where this host cannot say who
    it is (`host_identity`), and so cannot offer the plane.
    """

    def __init__(self, area: StagingArea, limits: StreamLimits, max_mapped_bytes: int) -> None:
        identity = host_identity()
        if identity is None:
            raise OSError("this host does not name its kernel and namespaces (/proc/sys/kernel/random/boot_id, "
                          "/proc/self/ns): no shared-memory plane")
        name = SOCKET_PREFIX + secrets.token_hex(16)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + name)
            listener.listen()
        except OSError:
            listener.close()
            raise
        self.offer = pb.ShmPlane(host_id=identity, socket_name=name, pid=os.getpid(), uid=os.getuid())
        self.mappings = MemfdMappings(max_mapped_bytes)
        super().__init__(area, listener, limits)

    def stop(self) -> None:
        super().stop()
        self.mappings.close()

    def _read_hello(self, conn: socket.socket, deadline: float) -> tuple[pb.DataHello, MemfdFrames]:
        """The hello and the one memfd that came with its first bytes; the memfd is checked before anything maps it."""
        conn.settimeout(max(deadline - time.monotonic(), 1e-3))
        data, fds, flags, _ = socket.recv_fds(conn, 4, 1)
        try:
            if not data:
                raise ConnectionError("closed before its hello")
            hello = recv_message(conn, pb.DataHello, MAX_HEADER_BYTES, deadline, received=data)
            if flags & socket.MSG_CTRUNC or len(fds) != 1:
                raise SyncError(
                    Code.INVALID_ARGUMENT,
                    f"a shared-memory hello carries exactly one memfd (SCM_RIGHTS with its first bytes); it came with "
                    f"{'more than one' if flags & socket.MSG_CTRUNC else len(fds)}",
                )
            if hello.relay:
                raise SyncError(
                    Code.INVALID_ARGUMENT,
                    "the shared-memory plane relays nothing: send relay trees over the socket plane",
                )
            size = check_memfd(fds[0])
            frames = MemfdFrames(conn, fds.pop(), size, self.mappings)
        finally:
            for fd in fds:
                os.close(fd)
        return hello, frames
