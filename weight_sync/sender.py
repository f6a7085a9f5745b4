"""The sender: each trainer rank streams its own shards to every receiver; nothing is gathered on one rank.

Ordering across the N ranks of one torch.distributed group (weight_sync never imports torch.distributed: the caller
runs the barrier)::

    sender = WeightSender(endpoints, config, rank=dist.get_rank(), num_ranks=dist.get_world_size(),
                          session_id=run_id)              # same session_id on every rank
    for step in ...:
        optimizer.step()
        version = step + 1
        # every rank, in parallel: Begin (idempotent per (session_id, version): each rank joins the same update and
        # announces the tensors it holds shards of), then one Push stream per receiver with this rank's shards
        report = sender.push(version, local_shards(model))   # Iterable[Shard(hf_name, local, global_shape, offsets)]
        dist.barrier()                                       # every rank's streams have been answered
        if dist.get_rank() == 0:
            sender.commit(version)                           # receivers check coverage + checksums, apply, move on
        # a rank that failed: any rank may call sender.abort(version, reason); receivers keep the old version

`local_shards` for FSDP2/TP parameters yields `Shard(name, p.to_local(), tuple(p.shape), global_offset)`, with the
offset from `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`. `push` never raises for one bad
receiver: the report lists per-receiver outcomes, and a receiver that missed a version gets a full push next time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent import futures
from typing import Iterable, Sequence

import grpc
import numpy as np
import torch
import xxhash
import zstandard

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.codec import encode_chunk, xor_encode
from weight_sync.config import WeightSyncConfig
from weight_sync.layout import box_error
from weight_sync.relay import PushStream, results_of, split_tree, stream_metadata
from weight_sync.spec import TensorSpec, element_dtype

__all__ = ["PushReport", "Shard", "WeightSender"]

log = logging.getLogger("weight_sync.sender")


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's piece of a parameter: HF name, the local tensor, the global shape and the piece's global offsets."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offsets: tuple[int, ...]


@dataclasses.dataclass
class PushReport:
    """Outcome of one rank's push: per-receiver error (None = its stream succeeded) and traffic counters."""

    policy_version: int
    errors: dict[str, str | None]
    delta_endpoints: list[str]
    bytes_sent: int
    payload_bytes: int
    seconds: float

    @property
    def ok(self) -> list[str]:
        return [a for a, err in self.errors.items() if err is None]

    @property
    def failed(self) -> dict[str, str]:
        return {a: err for a, err in self.errors.items() if err is not None}


@dataclasses.dataclass
class _Local:
    name: str
    spec: TensorSpec
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    values: np.ndarray  # flat, unsigned elements (bit patterns)


def _as_local(shard: Shard) -> _Local:
    tensor = shard.tensor.detach()
    dtype = str(tensor.dtype).removeprefix("torch.")
    spec = TensorSpec(shard.name, tuple(shard.global_shape), dtype)
    problem = box_error(spec.shape, tuple(shard.global_offsets), tuple(tensor.shape))
    if problem:
        raise ValueError(f"shard of {shard.name}: {problem}")
    flat = tensor.cpu().contiguous().reshape(-1)
    values = flat.view(torch.uint8).numpy().view(element_dtype(dtype)) if flat.numel() else np.empty(0, element_dtype(dtype))
    return _Local(shard.name, spec, tuple(shard.global_offsets), tuple(tensor.shape), values)


def _status_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), f"code {code}")


def _error_text(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


class WeightSender:
    """Pushes one rank's shards to many receivers concurrently (directly, or through a relay tree)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        config: WeightSyncConfig | None = None,
        *,
        rank: int = 0,
        num_ranks: int = 1,
        session_id: str = "trainer",
    ) -> None:
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is outside [0, num_ranks={num_ranks})")
        self.config = config or WeightSyncConfig()
        self.endpoints = list(dict.fromkeys([*endpoints, *self.config.endpoints]))
        if not self.endpoints:
            raise ValueError("no receivers: pass endpoints or set WeightSyncConfig.endpoints")
        self.rank, self.num_ranks, self.session_id = rank, num_ranks, session_id
        self._clients = {a: WeightSyncClient(a, self.config) for a in self.endpoints}
        self._pool = futures.ThreadPoolExecutor(max_workers=32)
        self._base: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
        self._base_version = -1
        self._described: dict[str, pb.DescribeReply] = {}

    def add_endpoint(self, address: str) -> None:
        """Start pushing to one more receiver (a late joiner gets a full push; later versions may be deltas)."""
        if address not in self._clients:
            self.endpoints.append(address)
            self._clients[address] = WeightSyncClient(address, self.config)
            self._described.clear()  # check the newcomer's manifest on the next push

    def remove_endpoint(self, address: str) -> None:
        """Stop pushing to a receiver (e.g. one that was shut down)."""
        client = self._clients.pop(address, None)
        if client is not None:
            self.endpoints.remove(address)
            client.close()

    def describe(self) -> dict[str, pb.DescribeReply | str]:
        """Each receiver's manifest and version, or the error text for unreachable ones."""
        out: dict[str, pb.DescribeReply | str] = {}
        for address, fut in self._each(lambda c: c.describe()).items():
            try:
                out[address] = fut.result()
            except grpc.RpcError as e:
                out[address] = _error_text(e)
        return out

    def _each(self, fn) -> dict[str, futures.Future]:
        return {a: self._pool.submit(fn, c) for a, c in self._clients.items()}

    def _check_compatible(self, locals_: list[_Local]) -> None:
        for address, reply in self.describe().items():
            if isinstance(reply, str):
                continue  # unreachable now: reported per push
            self._described[address] = reply
            theirs = {s.name: (tuple(s.shape), s.dtype) for s in reply.manifest}
            for local in locals_:
                want = theirs.get(local.name)
                if want != (local.spec.shape, local.spec.dtype):
                    raise ValueError(
                        f"receiver {address} does not accept {local.name} {local.spec.shape} {local.spec.dtype} "
                        f"(it has {want}); is it serving the same model?"
                    )

    def push(self, policy_version: int, shards: Iterable[Shard]) -> PushReport:
        """Begin + stream this rank's shards to every receiver. Never raises for a failing receiver (see the report)."""
        start = time.perf_counter()
        locals_ = [_as_local(s) for s in shards]
        specs: dict[str, TensorSpec] = {}
        for local in locals_:
            if specs.setdefault(local.name, local.spec) != local.spec:
                raise ValueError(f"shards of {local.name} disagree on global shape or dtype")
        if not self._described:
            self._check_compatible(locals_)
        use_base = self.config.delta and all((l.name, l.offsets) in self._base for l in locals_)
        request = pb.BeginRequest(
            session_id=self.session_id, policy_version=policy_version, rank=self.rank, num_ranks=self.num_ranks,
            tensors=[pb.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in specs.values()],
            base_version=self._base_version if use_base else -1,
        )
        errors: dict[str, str | None] = {}
        delta, full = [], []
        for address, fut in self._each(lambda c: c.begin(request)).items():
            try:
                (delta if fut.result().delta_accepted else full).append(address)
                errors[address] = None
            except grpc.RpcError as e:
                errors[address] = f"Begin: {_error_text(e)}"
        streams = [(tree, True) for tree in split_tree(delta, self.config.relay_fanout)]
        streams += [(tree, False) for tree in split_tree(full, self.config.relay_fanout)]
        opened = [
            (head, rest, is_delta, PushStream(self._clients[head], stream_metadata(
                self.session_id, policy_version, self.rank, rest, self.config.relay_fanout), self.config.push_timeout_s))
            for (head, rest), is_delta in streams
        ]
        payload = self._stream_shards(locals_, opened)
        for head, rest, _, stream in opened:
            for result in results_of(head, rest, stream.close()):
                errors[result.address] = None if result.code == 0 else f"Push: {_status_name(result.code)}: {result.message}"
        if self.config.delta:
            self._remember(locals_, policy_version)
        seconds = time.perf_counter() - start
        sent = sum(s.bytes_sent for *_, s in opened)
        report = PushReport(policy_version, errors, delta, sent, payload, seconds)
        log.info(
            "rank %d pushed v%d: %.1f MB of shards, %.1f MB sent to %d streams in %.3f s (%.2f GB/s per receiver); "
            "failed: %s", self.rank, policy_version, payload / 1e6, sent / 1e6, len(opened), seconds,
            payload / max(seconds, 1e-9) / 1e9, report.failed or "none",
        )
        return report

    def _stream_shards(self, locals_: list[_Local], opened: list) -> int:
        """Chunk every shard once and feed each open stream the raw or the delta encoding; return payload bytes."""
        compressor = zstandard.ZstdCompressor(level=self.config.delta_zstd_level)
        any_full = any(not d for *_, d, _ in opened)
        any_delta = any(d for *_, d, _ in opened)
        scratch = np.empty(0, dtype=np.uint8)
        payload = 0
        for local in locals_:
            values = local.values
            elem = values.dtype.itemsize
            step = max(1, self._chunk_bytes() // elem)
            base = self._base.get((local.name, local.offsets)) if any_delta else None
            if base is not None and base.shape != values.shape:
                base = None
            if base is not None and scratch.nbytes < min(values.nbytes, step * elem):
                scratch = np.empty(step * elem, dtype=np.uint8)
            header = pb.ShardHeader(
                name=local.name, offsets=local.offsets, shape=local.shape, xxh3_64=xxhash.xxh3_64_intdigest(values)
            )
            for begin in range(0, max(values.shape[0], 1), step):
                piece = values[begin : begin + step]
                chunk = pb.ChunkHeader(element_offset=begin, num_elements=piece.shape[0])
                if begin == 0:
                    chunk.shard.CopyFrom(header)
                raw = encode_chunk(chunk, piece) if any_full or base is None else None
                packed = None
                if base is not None:
                    coded = xor_encode(piece, base[begin : begin + step], compressor, scratch.view(values.dtype))
                    if coded is not None:
                        chunk.encoding = pb.ENCODING_XOR_ZSTD
                        packed = encode_chunk(chunk, coded)
                if packed is None and raw is None:
                    raw = encode_chunk(chunk, piece)
                for *_, is_delta, stream in opened:
                    stream.send(packed if is_delta and packed is not None else raw)
                payload += piece.nbytes
        return payload

    def _chunk_bytes(self) -> int:
        limits = [r.max_chunk_bytes for r in self._described.values() if r.max_chunk_bytes]
        size = min([self.config.chunk_bytes, *limits])
        return size - size % 8

    def _remember(self, locals_: list[_Local], policy_version: int) -> None:
        keep = {}
        for local in locals_:
            key = (local.name, local.offsets)
            old = self._base.get(key)
            if old is not None and old.shape == local.values.shape and old.dtype == local.values.dtype:
                np.copyto(old, local.values)
                keep[key] = old
            else:
                keep[key] = local.values.copy()
        self._base = keep
        self._base_version = policy_version

    def commit(self, policy_version: int) -> dict[str, str | None]:
        """Ask every receiver to apply `policy_version` (rank 0, after the barrier). Returns address -> error or None."""
        request = pb.CommitRequest(session_id=self.session_id, policy_version=policy_version)
        out: dict[str, str | None] = {}
        for address, fut in self._each(lambda c: c.commit(request)).items():
            try:
                fut.result()
                out[address] = None
            except grpc.RpcError as e:
                out[address] = _error_text(e)
        failed = {a: e for a, e in out.items() if e}
        log.info("commit v%d: %d/%d receivers applied; failed: %s", policy_version, len(out) - len(failed), len(out), failed or "none")
        return out

    def abort(self, policy_version: int, reason: str = "") -> None:
        """Drop `policy_version` everywhere (any rank may call it); receivers keep serving their old version."""
        request = pb.AbortRequest(session_id=self.session_id, policy_version=policy_version, reason=reason)
        for fut in self._each(lambda c: c.abort(request)).values():
            try:
                fut.result()
            except grpc.RpcError:
                pass  # unreachable receivers have nothing staged that could be applied without a Commit

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
