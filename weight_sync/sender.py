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
        report = sender.push(version, local_shards(model, mesh))  # Iterable[Shard(hf_name, local, shape, offsets)]
        dist.barrier()                                       # every rank's streams have been answered
        if dist.get_rank() == 0:
            sender.commit(version)                           # receivers check coverage + checksums, apply, move on
        # a rank that failed: any rank may call sender.abort(version, reason); receivers keep the old version

`local_shards` for FSDP2/TP parameters yields `Shard(name, p.to_local(), tuple(p.shape), global_offset)`, with the
offset from `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`; given the mesh, a piece that
every rank of a tensor-parallel group holds comes from one of them (a receiver refuses a piece pushed twice). `push`
never raises for one bad receiver: the report lists per-receiver outcomes, and a receiver that missed a version gets a
full push next time.

Receivers on this host that offer the shared-memory plane (Describe's `shm_plane` with this host's identity) get every
stream through memfds (`weight_sync.shm_push`), outside relay trees, fed from their own threads while this loop feeds
the others; the rest take the socket plane where offered, else gRPC Push. With `data_plane = "auto"`, a receiver whose
socket or shared-memory plane refuses a stream before opening it (cannot connect, too many connections waiting for
their hello: `DataReply.unopened`) gets that stream again over gRPC Push, raw, after the others; the report lists it
in `grpc_fallback`. Each stream ends as soon as it has sent its share (receivers cut idle
streams), and a receiver that accepts no chunk for half of `stream_idle_timeout_s` is cut and reported, so it does not
stall the other receivers' streams; so is one that took its whole socket or gRPC stream and sends no answer for as
long (times one plus the receivers it relays to; shared-memory streams wait for their answer up to `push_timeout_s`).
A receiver of another model is reported failed at each push; an unreachable one is left out for 5 s after a failed
try, doubling up to 5 min; Commit skips receivers whose push failed on this rank. That state is each rank's own: a
receiver one rank left out fails its coverage check at Commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent import futures
from itertools import chain

import grpc
import numpy as np

from protos import weight_sync_pb2 as pb
from weight_sync.channel import WeightSyncClient
from weight_sync.chunking import (
    Chunk,
    DeltaCoder,
    LocalShard,
    Piece,
    Shard,
    as_local,
    piece_chunks,
    plan_streams,
    stream_chunks,
)
from weight_sync.config import WeightSyncConfig
from weight_sync.delta_policy import DeltaPolicy, LinkSample
from weight_sync.feed import encoded, feed
from weight_sync.peft import holds_base
from weight_sync.receivers import Receivers
from weight_sync.relay import ChunkStream, PushStream, StreamFailure, results_of, split_tree, stream_metadata
from weight_sync.report import PushReport, error_text, record_results
from weight_sync.routes import routes, with_relay_targets
from weight_sync.shm_push import SegmentPool, ShmPush, ShmStream
from weight_sync.socket_push import SocketStream, relay_hello
from weight_sync.spec import TensorSpec
from weight_sync.version import protocol_version, speaks

__all__ = ["PushReport", "Shard", "WeightSender"]

log = logging.getLogger("weight_sync.sender")
ShardKey = tuple[str, tuple[int, ...]]  # LocalShard.key: (tensor name, shard offsets)
SESSION_MINOR = 4  # the protocol minor that added BeginReply.committed_session_id


# Refusals of a socket stream before the receiver opened it after which the same stream may go over gRPC Push instead.
_FALLBACK_CODES = frozenset(
    {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
)
StreamGroup = tuple[str, list[str], list[ChunkStream], bool]  # (head receiver, receivers it relays to, streams, delta?)


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
        lora_alpha: float = 0.0,
    ) -> None:
        """``lora_alpha``: the alpha of the LoRA adapters this sender pushes (a run's ``[model.lora] alpha``), told to
        receivers in each Begin so that one applying adapters with another alpha refuses them (protocol 1.5); 0 when
        it pushes no adapters."""
        if lora_alpha < 0:
            raise ValueError(f"lora_alpha {lora_alpha} is negative; give the adapters' alpha, or 0 for none")
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is outside [0, num_ranks={num_ranks})")
        self.config = config or WeightSyncConfig()
        self.endpoints = list(dict.fromkeys([*endpoints, *self.config.endpoints]))
        if not self.endpoints:
            raise ValueError("no receivers: pass endpoints or set WeightSyncConfig.endpoints")
        self.rank, self.num_ranks, self.session_id = rank, num_ranks, session_id
        self.lora_alpha = lora_alpha
        self._clients = {a: WeightSyncClient(a, self.config) for a in self.endpoints}
        self._pool = futures.ThreadPoolExecutor(max_workers=32)
        self._encoders: futures.ThreadPoolExecutor | None = None
        self._delta = DeltaPolicy(self.config.delta)
        self._hasher = futures.ThreadPoolExecutor(self.config.num_streams, thread_name_prefix="ws-hash")
        self._base: dict[ShardKey, np.ndarray] = {}
        self._base_version = -1
        self._receivers = Receivers(self.describe)
        self._last_failed: tuple[int, dict[str, str]] = (-1, {})  # the last push's version and failed receivers
        self._segments = SegmentPool()

    def add_endpoint(self, address: str) -> None:
        """Start pushing to one more receiver (a late joiner gets a full push; later versions may be deltas)."""
        if address not in self._clients:
            self.endpoints.append(address)
            self._clients[address] = WeightSyncClient(address, self.config)
            self._receivers.mark_stale()  # check the newcomer's manifest on the next push

    def remove_endpoint(self, address: str) -> None:
        """Stop pushing to a receiver (e.g. one that was shut down)."""
        client = self._clients.pop(address, None)
        if client is not None:
            self.endpoints.remove(address)
            client.close()
        self._receivers.forget(address)

    def describe(self, addresses: list[str] | None = None) -> dict[str, pb.DescribeReply | str]:
        """Each receiver's (or those of ``addresses``) manifest and version, or the error text for unreachable ones."""
        out: dict[str, pb.DescribeReply | str] = {}
        for address, fut in self._each(lambda c: c.describe(), addresses).items():
            try:
                out[address] = fut.result()
            except grpc.RpcError as e:
                out[address] = error_text(e)
        return out

    def _each(self, fn, addresses: list[str] | None = None) -> dict[str, futures.Future]:
        """Run fn(client) for every receiver (or those in `addresses`) concurrently."""
        chosen = self._clients if addresses is None else {a: self._clients[a] for a in addresses}
        return {a: self._pool.submit(fn, c) for a, c in chosen.items()}

    def declared_dtypes(self) -> dict[str, str]:
        """Tensor name -> the dtype the receivers' manifests declare for it (the one to send it in: a trainer keeps
        float32 masters while engines serve bfloat16 checkpoints). Unreachable receivers, and those of another model,
        are left out. Where receivers declare different dtypes for one tensor (a float32 engine beside a directory sink
        of the bfloat16 file) one push cannot serve both: the widest wins, so no receiver gets rounded values, and the
        others are reported failed at each push, with what to change (``weight_sync.receivers``)."""
        return self._receivers.declared_dtypes(self.endpoints)

    def push(self, policy_version: int, shards: Iterable[Shard], min_version: int = -1) -> PushReport:
        """Begin + stream this rank's shards to every receiver. Never raises for a failing receiver (see the report).

        ``min_version``: the oldest version these shards apply on top of (a LoRA policy's adapters without their base
        apply to the base of that version). A receiver that holds a base model (``weight_sync.peft.holds_base``: an
        adapter sink holds none) and whose Begin reply shows an older committed version gets nothing: its update is
        aborted, and the report's ``behind`` lists it, to be pushed the base (a server restarted on its directory is
        back at that directory's version, and adapters merged into another base would be served silently wrong).

        CPU tensors are read in place: they must not change (no optimizer step) until `push` returns. A receiver whose
        manifest does not take the shards is reported failed (each push, until it serves the model); one unreachable
        is left out for a while after each failed try (reported failed meanwhile). Raises ValueError for malformed
        shards, or when no receiver that answers takes them.
        """
        start = time.perf_counter()
        locals_ = [as_local(s) for s in shards]
        specs: dict[str, TensorSpec] = {}
        for local in locals_:
            if specs.setdefault(local.name, local.spec) != local.spec:
                raise ValueError(f"shards of {local.name} disagree on global shape or dtype")
        self._receivers.refresh(self.endpoints)
        self._receivers.check(locals_, self.endpoints, self.lora_alpha)
        use_base = self._delta.enabled and all(local.key in self._base for local in locals_)
        request = pb.BeginRequest(
            session_id=self.session_id, policy_version=policy_version, rank=self.rank, num_ranks=self.num_ranks,
            tensors=[pb.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in specs.values()],
            base_version=self._base_version if use_base else -1, num_streams=self.config.num_streams,
            protocol_version=protocol_version(), lora_alpha=self.lora_alpha,
        )
        errors: dict[str, str | None] = {}
        ports, offers = routes(self.endpoints, self._receivers, self.config, errors)
        behind: dict[str, int] = {}
        tickets, delta, full, shm = self._begin_all(request, ports, offers, errors, (min_version, behind))
        stream_ports = {a: ports[a] if tickets[a] else 0 for a in (*delta, *full)}
        groups = self._open_streams(policy_version, delta, full, stream_ports, tickets)
        targets = {a: (offers[a], tickets[a]) for a in shm}
        shm_push = self._start_shm(policy_version, locals_, specs, targets) if shm else None
        payload = sum(local.values.nbytes for local in locals_)
        updated: set[ShardKey] = set()
        if groups:  # nobody to send to: skip the chunking work
            payload, updated = self._stream_shards(locals_, [(opened, is_delta) for _, _, opened, is_delta in groups])
        streams: list[tuple[str, list[str], int, ChunkStream | ShmStream]] = [
            (head, rest, i, s) for head, rest, opened, _ in groups for i, s in enumerate(opened)
        ]
        if shm_push is not None:
            streams += [(address, [], i, s) for address, i, s in shm_push.close()]
        codes: dict[str, int] = {}  # status of the stream error reported per receiver
        refused: list[tuple[str, list[str], int]] = []  # (head, rest, stream index) to send again over gRPC
        fallback: dict[str, str] = {}
        # Closed at once: each close may wait out a silent receiver's limit, and one after another those waits add up.
        outcomes = list(self._pool.map(lambda item: item[3].close(), streams))
        for (head, rest, index, stream), outcome in zip(streams, outcomes, strict=True):
            why = self._fallback_reason(stream, outcome)
            if why is not None:
                refused.append((head, rest, index))
                fallback[head] = why
                continue
            record_results(errors, codes, results_of(head, rest, outcome))
        resent = self._resend_over_grpc(policy_version, locals_, refused) if refused else []
        for head, rest, stream in resent:
            record_results(errors, codes, results_of(head, rest, stream.close()))
        if fallback:
            log.warning(
                "rank %d v%d: a data plane refused streams before opening them, sent again over gRPC Push: %s",
                self.rank, policy_version, fallback,
            )
        for address, error in errors.items():
            if error is None:
                self._receivers.reached(address)
        if any(errors.values()) or fallback:
            self._receivers.mark_stale()  # a receiver may have restarted (other ports, a fixed model)
        self._last_failed = (policy_version, {a: e for a, e in errors.items() if e})
        self._measure(groups, payload, errors, locals_)
        if self._delta.keeps_base([a for a in self.endpoints if a not in shm]):
            self._remember(locals_, policy_version, updated)
        else:  # full pushes only (same-host receivers take raw streams; "auto" on fast links): no base to keep
            self._base, self._base_version = {}, -1
        seconds = time.perf_counter() - start
        sent = sum(s.bytes_sent for *_, s in streams) + sum(s.bytes_sent for *_, s in resent)
        sockets = [
            head for head, _, opened, _ in groups
            if opened and isinstance(opened[0], SocketStream) and head not in fallback
        ]
        report = PushReport(
            policy_version, errors, delta, sockets, sent, payload, seconds, fallback,
            [a for a in shm if a not in fallback], behind,
        )
        log.info(
            "rank %d pushed v%d: %.1f MB of shards, %.1f MB sent to %d streams in %.3f s (%.2f GB/s per receiver); "
            "failed: %s", self.rank, policy_version, payload / 1e6, sent / 1e6, len(streams), seconds,
            payload / max(seconds, 1e-9) / 1e9, report.failed or "none",
        )
        return report

    def _begin_all(
        self, request: pb.BeginRequest, ports: dict[str, int], offers: dict[str, pb.ShmPlane],
        errors: dict[str, str | None], floor: tuple[int, dict[str, int]] = (-1, {}),
    ) -> tuple[dict[str, bytes], list[str], list[str], list[str]]:
        """Begin at every receiver of `ports` at once: (tickets, receivers that take deltas, those that take full
        pushes, those reached through their shared-memory plane), failures in `errors`. `floor`: (the push's
        `min_version`, the dict that gets each receiver holding a base below it, with its version: its update is
        aborted)."""
        min_version, behind = floor
        relay_ports = {a: p for a, p in ports.items() if a not in offers}  # same-host receivers stay out of relay trees
        begins = {
            a: self._pool.submit(self._clients[a].begin, self._begin_request(request, a, relay_ports)) for a in ports
        }
        tickets: dict[str, bytes] = {}
        delta: list[str] = []
        full: list[str] = []
        shm: list[str] = []
        for address, fut in begins.items():
            try:
                reply = fut.result()
            except grpc.RpcError as e:
                errors[address] = why = f"Begin: {error_text(e)}"
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._receivers.rest(address, why)
                continue
            lacks = self._lacks_base(address, reply, min_version) if min_version >= 0 else None
            if lacks is not None:
                behind[address] = reply.current_version
                errors[address] = f"Begin: {lacks}: it needs the base pushed with them"
                self._abort_at(address, request, "the receiver lacks the base these adapters apply to")
                continue
            tickets[address] = reply.data_ticket
            errors[address] = None
            if address not in offers:
                (delta if reply.delta_accepted else full).append(address)
            elif reply.data_ticket:
                shm.append(address)
            else:
                errors[address] = "Begin: the receiver offers a shared-memory plane but handed out no data ticket"
        return tickets, delta, full, shm

    def _start_shm(
        self, policy_version: int, locals_: list[LocalShard], specs: dict[str, TensorSpec],
        targets: dict[str, tuple[pb.ShmPlane, bytes]],
    ) -> ShmPush:
        """Open this rank's streams to its same-host receivers and start feeding them (their own threads; `close` the
        result after the other planes): the same split over streams as every other plane."""
        cfg = self.config
        plan: list[list[Piece]] = plan_streams(locals_, cfg.num_streams)
        announced = sum(spec.nbytes for spec in specs.values())
        segments = self._segments.segments([sum(p.nbytes for p in group) for group in plan], announced)
        hello = pb.DataHello(session_id=self.session_id, policy_version=policy_version, rank=self.rank)
        return ShmPush(
            plan, segments, targets, hello, self._chunk_bytes(), timeout_s=cfg.push_timeout_s, stall_s=self._stall_s,
            connect_timeout_s=cfg.hello_timeout_s,
        )

    def _lacks_base(self, address: str, reply: pb.BeginReply, min_version: int) -> str | None:
        """Why the receiver at `address` may not hold the base that adapters alone of this push apply to (the version
        `min_version`, pushed by this session), or None when it holds it or holds no base at all (an adapter sink).
        A version below `min_version` lacks it (a server restarted on its directory); so does, from a receiver of
        protocol 1.4, a version this session did not commit (another run's model at the same or a higher version,
        another sender's push), version numbers alone cannot tell those apart."""
        if not self._holds_base(address):
            return None
        if reply.current_version < min_version:
            return (f"it holds policy_version {reply.current_version}, older than {min_version}, the base model these "
                    "adapters apply to (a restarted server is back at its directory's version)")  # fmt: skip
        described = self._receivers.described.get(address)
        if described is not None and speaks(described.protocol_version, SESSION_MINOR) and (
            reply.committed_session_id != self.session_id
        ):
            session = reply.committed_session_id
            whose = f"session {session!r}" if session else "no push since it started"
            return (f"its policy_version {reply.current_version} comes from {whose}, not this run's, so the base "
                    "these adapters apply to may not be the one it holds")  # fmt: skip
        return None

    def _holds_base(self, address: str) -> bool:
        """Whether the receiver's manifest holds a base model's weights (adapter sinks hold adapters alone)."""
        described = self._receivers.described.get(address)
        return described is not None and holds_base(spec.name for spec in described.manifest)

    def _abort_at(self, address: str, request: pb.BeginRequest, reason: str) -> None:
        """Drop the update `request` began at `address` (nothing is streamed to it: it would hold its staging)."""
        abort = pb.AbortRequest(session_id=request.session_id, policy_version=request.policy_version, reason=reason)
        try:
            self._clients[address].abort(abort)
        except grpc.RpcError:
            pass  # an update left open there gives way to the next Begin of this session

    def _fallback_reason(self, stream: ChunkStream | ShmStream, outcome: pb.PushReply | Exception) -> str | None:
        """Why `stream` should go again over gRPC Push (its data plane refused it before opening it), or None."""
        if self.config.data_plane != "auto" or not getattr(stream, "unopened", False):
            return None
        if not isinstance(outcome, StreamFailure) or outcome.code() not in _FALLBACK_CODES:
            return None
        return f"{outcome.code().name}: {outcome.details()}"

    def _resend_over_grpc(
        self, policy_version: int, locals_: list[LocalShard], refused: list[tuple[str, list[str], int]]
    ) -> list[tuple[str, list[str], ChunkStream]]:
        """Send the streams the socket plane refused again over gRPC Push, raw (valid whatever the base); returns
        (head, rest, stream) to close. The receiver never opened them, so they count as the rank's announced ones."""
        cfg = self.config
        streams: list[ChunkStream | None] = [None] * cfg.num_streams
        trees: list[tuple[list[ChunkStream | None], bool]] = []
        out: list[tuple[str, list[str], ChunkStream]] = []
        for head, rest in dict.fromkeys((h, tuple(r)) for h, r, _ in refused):
            tree = list(streams)
            md = stream_metadata(self.session_id, policy_version, self.rank, list(rest), cfg.relay_fanout)
            for h, _, index in refused:
                if h == head:
                    stream = PushStream(self._clients[head], md, cfg.push_timeout_s, stall_s=self._stall_s,
                                        relayed=len(rest))  # fmt: skip
                    tree[index] = stream
                    out.append((head, list(rest), stream))
            trees.append((tree, False))
        groups = plan_streams(locals_, cfg.num_streams)  # the same split as the first pass: stream i's pieces again
        chunk_bytes = self._chunk_bytes()
        generators: list[Iterator[Chunk] | None] = [
            chain.from_iterable(piece_chunks(p, None, chunk_bytes) for p in group)
            if any(tree[i] is not None for tree, _ in trees) else None
            for i, group in enumerate(groups)
        ]
        feed(generators, trees)
        return out

    @property
    def _stall_s(self) -> float:
        """How long a receiver stream may accept no chunk before it is cut (half of the receivers' idle limit)."""
        return self.config.stream_idle_timeout_s / 2

    def _begin_request(self, request: pb.BeginRequest, address: str, ports: dict[str, int]) -> pb.BeginRequest:
        """`request` for one receiver: without a base version where the delta policy wants a full push, asking it to
        keep no base where no delta is coming (`drop_base`); with a relay tree (`ports`: the receivers in relay
        trees), it announces the receivers that one may forward to (`weight_sync.routes.with_relay_targets`)."""
        use_delta, keep = self._delta.use_delta(address), self._delta.wants_base(address)
        if (request.base_version >= 0 and not use_delta) or not keep:
            changed = pb.BeginRequest()
            changed.CopyFrom(request)
            if not use_delta:
                changed.base_version = -1  # the delta policy chose a full push for this receiver
            changed.drop_base = not keep  # nor will the next push be a delta: the receiver keeps no base
            request = changed
        return with_relay_targets(request, address, ports, self.config.relay_fanout)

    def _open_streams(
        self, policy_version: int, delta: list[str], full: list[str], ports: dict[str, int], tickets: dict[str, bytes]
    ) -> list[StreamGroup]:
        """Open this rank's streams: (head receiver, receivers it relays to, streams, delta?) per stream group."""
        groups: list[StreamGroup] = []
        streams = [(tree, True) for tree in split_tree(delta, self.config.relay_fanout)]
        streams += [(tree, False) for tree in split_tree(full, self.config.relay_fanout)]
        cfg = self.config
        for (head, rest), is_delta in streams:
            opened: list[ChunkStream]
            if all(ports[a] for a in (head, *rest)):  # a relay tree rides sockets only if every member offers them
                targets = [pb.RelayTarget(address=a, data_port=ports[a], ticket=tickets[a]) for a in (head, *rest)]
                base = pb.DataHello(session_id=self.session_id, policy_version=policy_version, rank=self.rank)
                hello = relay_hello(base, targets[0], targets[1:], cfg.relay_fanout)
                host = head.rpartition(":")[0]
                opened = [
                    SocketStream(
                        host, ports[head], hello, cfg.push_timeout_s, stall_s=self._stall_s,
                        connect_timeout_s=cfg.hello_timeout_s, relayed=len(rest),
                    )
                    for _ in range(cfg.num_streams)
                ]
            else:
                md = stream_metadata(self.session_id, policy_version, self.rank, rest, cfg.relay_fanout)
                opened = [
                    PushStream(self._clients[head], md, cfg.push_timeout_s, stall_s=self._stall_s, relayed=len(rest))
                    for _ in range(cfg.num_streams)
                ]
            groups.append((head, rest, opened, is_delta))
        return groups

    def _stream_shards(
        self, locals_: list[LocalShard], trees: list[tuple[list[ChunkStream], bool]]
    ) -> tuple[int, set[ShardKey]]:
        """Chunk every shard once, round-robin over the stream groups, feeding each stream raw or delta messages.

        Returns the payload bytes and the keys of the delta bases brought up to date in place while streaming.
        """
        any_delta = any(is_delta for _, is_delta in trees)
        coder = DeltaCoder(self.config.delta_encoding, self.config.delta_zstd_level) if any_delta else None
        self._base_version = -1  # bases change in place below: invalid until the whole push went through
        updated: set[ShardKey] = set()
        bases: dict[ShardKey, np.ndarray | None] = {}
        for local in locals_:
            base = self._base.get(local.key) if any_delta else None
            same = base is not None and base.shape == local.values.shape and base.dtype == local.values.dtype
            bases[local.key] = base if same else None
            if bases[local.key] is not None:
                updated.add(local.key)
        groups = plan_streams(locals_, self.config.num_streams)
        chunk_bytes = self._chunk_bytes()
        generators = [stream_chunks(group, bases, chunk_bytes, self._hasher) for group in groups]
        if coder is not None:
            if self._encoders is None:
                self._encoders = futures.ThreadPoolExecutor(self.config.delta_threads, thread_name_prefix="ws-delta")
            depth = 2 * self.config.delta_threads
            generators = [encoded(g, coder, self._encoders, depth) for g in generators]
        return feed(list(generators), list(trees)), updated

    def _measure(
        self, groups: list[StreamGroup], payload: int, errors: dict[str, str | None], locals_: list[LocalShard]
    ) -> None:
        """Tell the delta policy what this push measured of each receiver it streamed to without failing (a relay
        tree moves at its head's pace: its members get the head's figures); the first time, let it time the compare
        on these shards."""
        if self._delta.mode != "auto" or not groups:
            return
        self._delta.calibrate([local.values for local in locals_])
        for head, rest, opened, is_delta in groups:
            if not opened or errors.get(head):
                continue
            sample = LinkSample(
                payload_bytes=payload, wire_bytes=sum(s.bytes_sent for s in opened),
                send_s=max(s.send_s for s in opened), stream_s=max(s.stream_s for s in opened), delta=is_delta,
            )
            for address in (head, *rest):
                self._delta.record(address, sample)
                log.debug("rank %d -> %s: %s", self.rank, address, self._delta.describe(address))

    def _chunk_bytes(self) -> int:
        limits = [r.max_chunk_bytes for r in self._receivers.described.values() if r.max_chunk_bytes]
        size = min([self.config.chunk_bytes, *limits])
        return size - size % 8

    def _remember(self, locals_: list[LocalShard], policy_version: int, updated: set[ShardKey]) -> None:
        keep: dict[ShardKey, np.ndarray] = {}
        for local in locals_:
            key = local.key
            old = self._base.get(key)
            if key in updated:
                assert old is not None, f"{key}: an updated delta base must be a remembered one"
                keep[key] = old
            elif old is not None and old.shape == local.values.shape and old.dtype == local.values.dtype:
                np.copyto(old, local.values)
                keep[key] = old
            else:
                keep[key] = local.values.copy()
        self._base = keep
        self._base_version = policy_version

    def commit(self, policy_version: int) -> dict[str, str | None]:
        """Ask every receiver to apply `policy_version` (rank 0, after the barrier), but those whose push of it failed
        on this rank (a frozen one would hold the commit for `commit_timeout_s`: other ranks' failures the receivers
        report themselves).

        Returns address -> error or None.
        """
        request = pb.CommitRequest(session_id=self.session_id, policy_version=policy_version)
        out: dict[str, str | None] = {}
        version, failed_push = self._last_failed
        skipped = failed_push if version == policy_version else {}
        for address, error in skipped.items():
            out[address] = f"not committed: its push failed ({error})"
        pushed = [a for a in self.endpoints if a not in skipped]
        for address, fut in self._each(lambda c: c.commit(request), pushed).items():
            try:
                fut.result()
                out[address] = None
            except grpc.RpcError as e:
                out[address] = error_text(e)
        failed = {a: e for a, e in out.items() if e}
        log.info(
            "commit v%d: %d/%d receivers applied; failed: %s",
            policy_version, len(out) - len(failed), len(out), failed or "none",
        )
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
        self._hasher.shutdown(wait=True, cancel_futures=True)
        self._segments.close()
        if self._encoders is not None:
            self._encoders.shutdown(wait=True)
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
