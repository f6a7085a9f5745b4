"""Push streams fed from another thread, and the relay tree that lets receivers forward chunks to each other.

With `relay_fanout = k`, the sender streams each chunk to at most k receivers; a receiver that was handed a list of
downstream receivers (metadata `x-ws-relay`) splits it into at most k groups, streams to each group's head and hands it
the rest. The chunk bytes are forwarded as received (no re-encoding), so the sender's uplink carries about k x model
bytes per version however large the fleet, and every receiver still checks every shard checksum itself.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient

if TYPE_CHECKING:
    from weight_sync.chunking import Chunk

__all__ = ["ChunkStream", "PushStream", "Relay", "StreamFailure", "offer", "split_tree", "stream_metadata"]


class StreamFailure(Exception):
    """A Push stream that failed on this side of the wire (cut because its receiver stalled, cancelled, or refused
    over a data plane); `code()`/`details()` mirror `grpc.RpcError`, so callers report every plane alike."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def offer(items: queue.Queue, item: object, done: Callable[[], bool], stall_s: float | None) -> str:
    """Put `item` on the bounded queue of a stream's writer thread, waiting while it is full.

    Returns "put"; "done" when `done()` turned true first (the stream ended or failed); "stalled" when the queue
    stayed full for `stall_s` (None: wait as long as it takes), i.e. the receiver accepted nothing for that long.
    """
    stall: float | None = None
    while not done():
        try:
            items.put(item, timeout=0.05)
            return "put"
        except queue.Full:
            if stall_s is None:
                continue
            now = time.monotonic()
            stall = now + stall_s if stall is None else stall
            if now > stall:
                return "stalled"
    return "done"


def split_tree(targets: Sequence[str], fanout: int) -> list[tuple[str, list[str]]]:
    """Split receivers into at most `fanout` contiguous groups: [(head, rest the head forwards to), ...].

    fanout 0 means no relay: every target is its own group.
    """
    targets = list(targets)
    if fanout <= 0 or len(targets) <= fanout:
        return [(t, []) for t in targets]
    size, extra = divmod(len(targets), fanout)
    groups, start = [], 0
    for i in range(fanout):
        end = start + size + (1 if i < extra else 0)
        groups.append((targets[start], targets[start + 1 : end]))
        start = end
    return groups


def stream_metadata(
    session_id: str, policy_version: int, rank: int, relay: Sequence[str], fanout: int
) -> tuple[tuple[str, str], ...]:
    """Push stream metadata naming the update, the sender rank and the receivers this stream's head forwards to."""
    md = [("x-ws-session", session_id), ("x-ws-version", str(policy_version)), ("x-ws-rank", str(rank))]
    if relay:
        md += [("x-ws-relay", ",".join(relay)), ("x-ws-fanout", str(fanout))]
    return tuple(md)


class ChunkStream(Protocol):
    """What the sender feeds: one Push stream to a head receiver, `PushStream` (gRPC) or `socket_push.SocketStream`."""

    bytes_sent: int
    send_s: float
    """Seconds spent handing bytes to the transport: the link's pace where the link is the slower side."""
    stream_s: float
    """Seconds from opening the stream to its answer (set once it is done)."""

    def send_chunk(self, chunk: Chunk, delta: bool) -> bool:
        """Queue one chunk (its delta form when `delta` and it has one); False when the stream already failed."""
        ...

    def end(self) -> None:
        """End the stream after the queued chunks, without waiting for the answer (a stream with nothing more to send
        must not sit idle on the receiver, which cuts idle streams). Idempotent."""
        ...

    def close(self) -> pb.PushReply | Exception:
        """End the stream and wait for the receiver's answer: its reply, or the error the stream failed with."""
        ...

    def cancel(self) -> None:
        """Cut the stream (the receiver drops the update); `close` then returns the failure."""
        ...


class PushStream:
    """One Push stream to one receiver, fed message by message; a bounded queue keeps memory at a few chunks.

    A receiver that accepts no message for `stall_s` is cut (the stream fails with DEADLINE_EXCEEDED), so one stalled
    receiver does not hold up the others fed from the same loop.
    """

    def __init__(
        self, client: WeightSyncClient, metadata: tuple[tuple[str, str], ...], timeout_s: float, depth: int = 4,
        stall_s: float | None = None,
    ):
        self.client = client
        self.bytes_sent = 0
        self.send_s = 0.0  # gRPC pulls the messages itself: from opening to the answer, as `stream_s`
        self.stream_s = 0.0
        self._opened = time.perf_counter()
        self._stall_s = stall_s
        self._stalled = False
        self._ended = False
        self._queue: queue.Queue[bytes | None] = queue.Queue(depth)
        self.future = client.push.future(self._messages(), timeout=timeout_s, metadata=client.metadata + metadata)

    def _messages(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            yield item

    def send(self, message: bytes | None) -> bool:
        """Queue one serialized chunk (None ends the stream); False when the stream already failed or stalled."""
        outcome = offer(self._queue, message, self.future.done, self._stall_s)
        if outcome == "stalled":
            self._stalled = True
            self.future.cancel()
        if outcome != "put":
            return False
        if message is not None:
            self.bytes_sent += len(message)
        return True

    def send_chunk(self, chunk: Chunk, delta: bool) -> bool:
        """Queue one chunk of the sender (its delta form when `delta` and it has one)."""
        return self.send(chunk.message(delta))

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.send(None)

    def close(self) -> pb.PushReply | Exception:
        """End the stream and wait for the receiver's answer (a reply, or the error it failed with)."""
        self.end()
        try:
            return self.future.result()
        except grpc.RpcError as e:
            if not self._stalled:
                return e
        except grpc.FutureCancelledError:
            if not self._stalled:
                return StreamFailure(grpc.StatusCode.CANCELLED, "the Push stream was cancelled")
        finally:
            self.send_s = self.stream_s = time.perf_counter() - self._opened
        return StreamFailure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the receiver accepted no chunk for {self._stall_s:g} s (part of stream_idle_timeout_s): cut so the "
            "push to the other receivers goes on"
        )

    def cancel(self) -> None:
        self.future.cancel()


def results_of(address: str, subtree: Sequence[str], outcome: pb.PushReply | Exception) -> list[pb.RelayResult]:
    """Per-receiver outcomes of a stream to `address` that was to be forwarded to `subtree`.

    `outcome`: the stream's reply, or its failure (a grpc.RpcError, or a data-plane StreamFailure: same accessors).
    """
    if not isinstance(outcome, pb.PushReply):
        code = outcome.code() if hasattr(outcome, "code") else grpc.StatusCode.UNKNOWN
        details = outcome.details() if hasattr(outcome, "details") else str(outcome)
        own = pb.RelayResult(address=address, code=code.value[0], message=details or "")
        lost = [
            pb.RelayResult(address=t, code=grpc.StatusCode.UNAVAILABLE.value[0], message=f"relay {address} failed")
            for t in subtree
        ]
        return [own, *lost]
    return [pb.RelayResult(address=address, code=0), *outcome.relayed]


class Relay:
    """A receiver's forwarding of one incoming Push stream to its share of the downstream receivers; a child that
    accepts nothing for a quarter of `stream_idle_timeout_s` is cut (the sender's own limit is half of it)."""

    def __init__(self, targets: Sequence[str], fanout: int, session_id: str, policy_version: int, rank: int, config):
        self._streams: list[tuple[str, list[str], PushStream, WeightSyncClient]] = []
        stall_s = config.stream_idle_timeout_s / 4
        for head, rest in split_tree(targets, max(fanout, 1)):
            client = WeightSyncClient(head, config)
            md = stream_metadata(session_id, policy_version, rank, rest, fanout)
            stream = PushStream(client, md, config.push_timeout_s, stall_s=stall_s)
            self._streams.append((head, rest, stream, client))

    def forward(self, message: bytes) -> None:
        for _, _, stream, _ in self._streams:
            stream.send(message)

    def finish(self) -> list[pb.RelayResult]:
        results: list[pb.RelayResult] = []
        for head, rest, stream, client in self._streams:
            results += results_of(head, rest, stream.close())
            client.close()
        return results

    def cancel(self) -> None:
        for _, _, stream, client in self._streams:
            stream.cancel()
            client.close()
