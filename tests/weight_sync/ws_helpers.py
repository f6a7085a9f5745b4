"""Helpers for weight-sync tests: tiny state dicts, shard splitting, ranks on threads, raw protocol calls, a receiver
with its client, loopback listeners."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc
import torch
import xxhash

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.codec import encode_chunk
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.relay import stream_metadata
from weight_sync.sender import Shard
from weight_sync.sink import StateDictSink
from weight_sync.spec import dtype_name


def tiny_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few tensors of each supported kind: bf16 2-D, fp32 1-D and 3-D, fp16, int64, a scalar."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(37, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g).to(torch.float16),
        "model.norm.weight": torch.randn(16, generator=g),
        "model.layers.0.experts.w": torch.randn(4, 6, 5, generator=g),
        "model.step": torch.tensor(7, dtype=torch.int64),
        "model.buckets": torch.randint(0, 1000, (9,), generator=g, dtype=torch.int64),
    }


def zeros_like_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def shard_rows(name: str, t: torch.Tensor, rank: int, num_ranks: int, dim: int = 0) -> Shard:
    """Rank's piece of `t` split along `dim` (uneven splits like FSDP2: the first pieces are one longer)."""
    if t.dim() == 0:
        assert num_ranks == 1 or rank == 0
        return Shard(name, t, (), ())
    size = t.shape[dim]
    step = -(-size // num_ranks)
    start = min(rank * step, size)
    stop = min(start + step, size)
    offsets = [0] * t.dim()
    offsets[dim] = start
    return Shard(name, t.narrow(dim, start, stop - start).clone(), tuple(t.shape), tuple(offsets))


def rank_shards(sd: dict[str, torch.Tensor], rank: int, num_ranks: int) -> list[Shard]:
    """FSDP-style dim-0 shards for 2-D weights, column (dim-1) shards for 3-D, scalars on rank 0 only."""
    out = []
    for name, t in sd.items():
        if t.dim() == 0:
            if rank == 0:
                out.append(Shard(name, t, (), ()))
            continue
        dim = 1 if t.dim() == 3 else 0
        shard = shard_rows(name, t, rank, num_ranks, dim)
        if shard.tensor.numel():
            out.append(shard)
    return out


def run_ranks(fn: Callable[[int], object], num_ranks: int) -> list[object]:
    """Run fn(rank) on threads, like trainer ranks calling push at once; re-raise the first failure."""
    results: list[object] = [None] * num_ranks
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def spec_msgs(sd: dict[str, torch.Tensor]) -> list[pb.TensorSpec]:
    return [
        pb.TensorSpec(name=k, shape=tuple(v.shape), dtype=dtype_name(v.dtype)) for k, v in sd.items()
    ]


def shard_messages(name: str, t: torch.Tensor, offsets: Sequence[int], chunk_elems: int = 64) -> list[bytes]:
    """Serialized PushChunks of one whole local tensor, as a well-behaved sender would write them."""
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    size = t.element_size()
    header = pb.ShardHeader(name=name, offsets=offsets, shape=tuple(t.shape), xxh3_64=xxhash.xxh3_64_intdigest(flat))
    out = []
    n = t.numel()
    for begin in range(0, max(n, 1), chunk_elems):
        count = min(chunk_elems, n - begin)
        chunk = pb.ChunkHeader(element_offset=begin, num_elements=count)
        if begin == 0:
            chunk.shard.CopyFrom(header)
        out.append(encode_chunk(chunk, flat[begin * size : (begin + count) * size]))
    return out


def raw_push(
    client: WeightSyncClient, session: str, version: int, rank: int, messages: Sequence[bytes]
) -> pb.PushReply:
    """One Push stream of pre-serialized chunks; raises grpc.RpcError with the receiver's status."""
    md = client.metadata + stream_metadata(session, version, rank, [], 0)
    return client.push(iter(messages), timeout=30, metadata=md)


def begin(client: WeightSyncClient, sd: dict[str, torch.Tensor], version: int, session: str = "s", rank: int = 0,
          num_ranks: int = 1) -> pb.BeginReply:
    return client.begin(pb.BeginRequest(session_id=session, policy_version=version, rank=rank, num_ranks=num_ranks,
                                        tensors=spec_msgs(sd), base_version=-1))


def commit(client: WeightSyncClient, version: int, session: str = "s") -> pb.CommitReply:
    return client.commit(pb.CommitRequest(session_id=session, policy_version=version))


def status_of(fn: Callable[[], object]) -> grpc.StatusCode:
    """The gRPC status code `fn` fails with (OK when it does not fail)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@contextlib.contextmanager
def receiver_with_client(
    receivers: Callable[..., list[tuple[WeightReceiver, StateDictSink]]], sd: dict[str, torch.Tensor]
) -> Iterator[tuple[WeightReceiver, StateDictSink, WeightSyncClient]]:
    """One receiver of the `receivers` fixture, its sink zeros of `sd`, and a default client of it (closed after)."""
    (receiver, sink), = receivers(1, sd=sd)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    try:
        yield receiver, sink, client
    finally:
        client.close()


class LoopbackListener:
    """A TCP listener on a loopback `port` that accepts on its own thread until `close()`.

    Each connection goes to `handle`: by default it is kept open and never read, in `accepted` (a peer that stalls, or
    one that counts who connects); a subclass answers it instead. `receive_buffer_bytes` sets SO_RCVBUF before
    listening, so accepted connections inherit a small window and a sender fills it sooner. `close()` stops the
    thread and closes the listener and every kept connection.
    """

    def __init__(self, receive_buffer_bytes: int | None = None) -> None:
        self.sock = socket.socket()
        if receive_buffer_bytes is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        """Keep `conn` open, unread, in `accepted`."""
        self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.accepted:
            conn.close()
        self.sock.close()
