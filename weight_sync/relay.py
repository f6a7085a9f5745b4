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

__all__ = [
    "ChunkStream", "PushStream", "Relay", "StreamFailure", "await_answer", "offer", "reply_limit", "silence_failure",
    "split_tree", "stream_metadata",
]  # fmt: skip


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


def await_answer(
    answered: Callable[[float], bool], progress: Callable[[], tuple[object, bool]], stall_s: float | None,
    reply_s: float | None,
) -> float | None:
    """Wait for the answer of a stream whose last item is queued: ``answered(timeout)`` waits up to ``timeout`` s and
    says whether it came. Returns None once it came, else the seconds of silence after which the stream is to be cut:
    ``progress()`` (what the stream can observe of the receiver taking its data, and whether the receiver has all of
    it) did not change for ``stall_s`` while data was still on its way, or for ``reply_s`` once the receiver had it
    all and owed only its answer (a receiver that froze there held the sender until ``push_timeout_s``). None limits:
    wait as long as ``answered`` does."""
    last: object = None
    since = time.monotonic()
    while not answered(0.2):
        mark, handed_over = progress()
        now = time.monotonic()
        if mark != last:
            last, since = mark, now
            continue
        limit = reply_s if handed_over else stall_s
        if limit is not None and now - since >= limit:
            return limit
    return None


def reply_limit(stall_s: float | None, relayed: int) -> float | None:
    """How long a stream's receiver may owe its answer once it has the whole stream: ``stall_s`` per level of the
    relay tree below it and its own (its answer waits for theirs; ``relayed`` receivers are at most that deep)."""
    return None if stall_s is None else stall_s * (1 + relayed)


def silence_failure(silent_s: float, handed_over: bool) -> StreamFailure:
    """The failure of a stream cut after ``silent_s`` s in which its receiver took no data (or, once it had it all,
    sent no answer), so that the push to the other receivers goes on."""
    what = "sent no answer after taking the whole stream" if handed_over else "accepted no data"
    return StreamFailure(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the receiver {what} for {silent_s:g} s: cut so the push to the other receivers goes on",
    )


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
        stall_s: float | None = None, relayed: int = 0,
    ):
        """``relayed``: how many receivers the stream's receiver forwards it to (its answer waits for theirs: it may
        take ``stall_s`` per level of the tree below it)."""
        self.client = client
        self.bytes_sent = 0
        self.send_s = 0.0  # gRPC pulls the messages itself: from opening to the answer, as `stream_s`
        self.stream_s = 0.0
        self._opened = time.perf_counter()
        self._stall_s = stall_s
        self._reply_s = reply_limit(stall_s, relayed)
        self._stalled: float | None = None  # the silence it was cut after
        self._drained = False  # gRPC took the end of the stream: the receiver owes its answer
        self._ended = False
        self._queue: queue.Queue[bytes | None] = queue.Queue(depth)
        self.future = client.push.future(self._messages(), timeout=timeout_s, metadata=client.metadata + metadata)

    def _messages(self):
        while True:
            item = self._queue.get()
            if item is None:
                self._drained = True
                return
            yield item

    def send(self, message: bytes | None) -> bool:
        """Queue one serialized chunk (None ends the stream); False when the stream already failed or stalled."""
        outcome = offer(self._queue, message, self.future.done, self._stall_s)
        if outcome == "stalled":
            self._stalled = self._stall_s
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
        """End the stream and wait for the receiver's answer (a reply, or the error it failed with); a receiver silent
        too long is cut (:func:`await_answer`)."""
        self.end()
        if self._stalled is None:
            def answered(timeout: float) -> bool:
                try:
                    self.future.result(timeout=timeout)
                except grpc.FutureTimeoutError:
                    return False
                except Exception:  # noqa: BLE001 (an answer too: the error is read below)
                    return True
                return True

            silent = await_answer(answered, lambda: ((self._queue.qsize(), self._drained), self._drained),
                                  self._stall_s, self._reply_s)  # fmt: skip
            if silent is not None:
                self._stalled = silent
                self.future.cancel()
        try:
            return self.future.result()
        except grpc.RpcError as e:
            if self._stalled is None:
                return e
        except grpc.FutureCancelledError:
            if self._stalled is None:
                return StreamFailure(grpc.StatusCode.CANCELLED, "the Push stream was cancelled")
        finally:
            self.send_s = self.stream_s = time.perf_counter() - self._opened
        return silence_failure(self._stalled, self._drained)

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
            stream = PushStream(client, md, config.push_timeout_s, stall_s=stall_s, relayed=len(rest))
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
