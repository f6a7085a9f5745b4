"""Feeding one rank's chunks into its open streams: stream index i of every receiver tree takes generator i's chunks.

Each stream index has its own feeder thread, so a stream whose queue is full (its socket is momentarily slower) never
holds up the other indices' streams; the receivers of one index take the same chunks in lock step (a chunk and its
delta form are made once for all of them). Delta forms are encoded on a pool ahead of the feeders (`encoded`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures

from weight_sync.chunking import Chunk, DeltaCoder
from weight_sync.relay import ChunkStream

__all__ = ["encoded", "feed"]


def encoded(chunks: Iterator[Chunk], coder: DeltaCoder, pool: futures.Executor, depth: int) -> Iterator[Chunk]:
    """`chunks` in order, each with its delta form, encoded on `pool` up to `depth` chunks ahead of the consumer."""
    pending: collections.deque[futures.Future | Chunk] = collections.deque()
    for chunk in chunks:
        pending.append(pool.submit(coder.encode, chunk) if chunk.base is not None else chunk)
        if len(pending) >= depth:
            head = pending.popleft()
            yield head.result() if isinstance(head, futures.Future) else head
    for head in pending:
        yield head.result() if isinstance(head, futures.Future) else head


def feed(
    generators: Sequence[Iterator[Chunk] | None], trees: Sequence[tuple[Sequence[ChunkStream | None], bool]]
) -> int:
    """Send the chunks of `generators[i]` into stream i of every tree (raw or delta per tree; None: not fed), one
    thread per fed index; each stream is ended as soon as its generator is done. Returns the payload bytes.

    A stream that fails (stalled, broken, refused) fails its receiver's whole update, so the tree's other streams
    are cut at once and fed no more (one stalled receiver costs the others one stall, not one per stream); a socket
    stream refused before it opened (`unopened`) is left to the gRPC fallback and its siblings go on.
    """
    dead: set[int] = set()  # trees whose receiver failed the update
    lock = threading.Lock()

    def is_dead(tree: int) -> bool:
        with lock:
            return tree in dead

    def feed_index(index: int, generator: Iterator[Chunk]) -> int:
        payload = 0
        for item in generator:
            payload += item.nbytes
            for t, (streams, is_delta) in enumerate(trees):
                stream = streams[index]
                if stream is None or is_dead(t) or stream.send_chunk(item, is_delta):
                    continue
                if not getattr(stream, "unopened", False):
                    with lock:
                        dead.add(t)
                    for other in streams:
                        if other is not None and other is not stream:
                            other.cancel()
        for t, (streams, _) in enumerate(trees):
            stream = streams[index]
            if stream is not None and not is_dead(t):
                stream.end()  # nothing more: receivers cut streams that stay idle
        return payload

    fed = [(i, g) for i, g in enumerate(generators) if g is not None]
    if len(fed) <= 1:
        return sum(feed_index(i, g) for i, g in fed)
    with futures.ThreadPoolExecutor(len(fed) - 1, thread_name_prefix="ws-feed") as pool:
        others = [pool.submit(feed_index, i, g) for i, g in fed[1:]]
        payload = feed_index(*fed[0])
        return payload + sum(f.result() for f in others)
