"""Where a receiver may forward an update's streams: only to the relay targets a rank's Begin announced, checked
and bounded (protocol rules of `PROTOCOL.md` on relays). Every refusal is a `SyncError`; nothing here holds state of
its own: an update's announced targets live on its `StagedUpdate`.

    targets, fanout = announced_relay_targets(begin_request)   # INVALID_ARGUMENT for a malformed list
    targets = shared_relay_targets(update, targets)             # one copy per distinct set; bounded per update
    check_relay(update, rank, [(address, data_port)], fanout)    # PERMISSION_DENIED for an unannounced target
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from protos import weight_sync_pb2 as pb
from weight_sync.config import MAX_RELAY_FANOUT
from weight_sync.update import StagedUpdate, SyncError, shown

__all__ = ["MAX_RELAY_TARGETS", "MAX_UPDATE_RELAY_TARGETS", "announced_relay_targets", "check_relay",
           "shared_relay_targets"]  # fmt: skip

MAX_RELAY_TARGETS = 1024  # relay targets one rank's Begin may announce to one receiver
MAX_UPDATE_RELAY_TARGETS = 16 * MAX_RELAY_TARGETS  # distinct (rank's set) relay targets all Begins of an update hold
Code = grpc.StatusCode


def announced_relay_targets(req: pb.BeginRequest) -> tuple[dict[str, int], int]:
    """The relay targets and fanout a Begin announces, checked: ({address: data port, 0 for gRPC}, fanout; 0 without
    targets). INVALID_ARGUMENT for more than `MAX_RELAY_TARGETS`, an address that is not HOST:PORT, a data port out of
    range, a ticket (tickets travel in hellos) or a fanout outside [1, `MAX_RELAY_FANOUT`]."""
    if len(req.relay_targets) > MAX_RELAY_TARGETS:
        raise SyncError(
            Code.INVALID_ARGUMENT,
            f"Begin announces {len(req.relay_targets)} relay targets; at most {MAX_RELAY_TARGETS} are accepted",
        )
    targets: dict[str, int] = {}
    for target in req.relay_targets:
        host, sep, port = target.address.rpartition(":")
        if not sep or not host or not _is_port(port) or len(target.address) > 300:
            raise SyncError(Code.INVALID_ARGUMENT, f"relay target {shown(target.address)} is not HOST:PORT")
        if target.data_port and not 1 <= target.data_port <= 65535:
            raise SyncError(Code.INVALID_ARGUMENT, f"relay target {target.address}: data_port {target.data_port}")
        if target.ticket:
            raise SyncError(Code.INVALID_ARGUMENT, "relay targets in Begin carry no ticket (tickets travel in hellos)")
        targets[target.address] = target.data_port
    if targets and not 1 <= req.relay_fanout <= MAX_RELAY_FANOUT:
        raise SyncError(Code.INVALID_ARGUMENT, f"relay_fanout {req.relay_fanout} is outside [1, {MAX_RELAY_FANOUT}]")
    return targets, req.relay_fanout if targets else 0


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 1 <= int(text) <= 65535


def shared_relay_targets(update: StagedUpdate, targets: dict[str, int]) -> dict[str, int]:
    """One copy of each distinct set of relay targets per update (ranks usually announce the same receivers);
    INVALID_ARGUMENT past `MAX_UPDATE_RELAY_TARGETS` in all. The caller holds the update's lock."""
    if not targets:
        return targets
    key = frozenset(targets.items())
    shared = update.relay_sets.get(key)
    if shared is not None:
        return shared
    held = sum(len(t) for t in update.relay_sets.values())
    if held + len(targets) > MAX_UPDATE_RELAY_TARGETS:
        raise SyncError(
            Code.INVALID_ARGUMENT,
            f"the Begins of {update.update_id} announce more than {MAX_UPDATE_RELAY_TARGETS} distinct relay "
            "targets in all; ranks of one update announce the same receivers",
        )
    update.relay_sets[key] = targets
    return targets


def check_relay(update: StagedUpdate, rank: int, relay: Sequence[tuple[str, int | None]], fanout: int) -> None:
    """PERMISSION_DENIED unless every (address, data port or None for a gRPC relay) of a stream's `relay` and its
    `fanout` were announced in `rank`'s Begin of `update`."""
    allowed = update.relay_targets[rank]
    for address, data_port in relay:
        if address not in allowed or (data_port is not None and allowed[address] != data_port):
            port = "" if data_port is None else f" (data port {data_port})"
            raise SyncError(
                Code.PERMISSION_DENIED,
                f"relay target {address[:300]}{port} was not announced in rank {rank}'s Begin "
                f"(BeginRequest.relay_targets); a receiver forwards only where the update's Begin says",
            )
    if max(fanout, 1) > update.relay_fanout[rank]:
        raise SyncError(
            Code.PERMISSION_DENIED,
            f"relay fanout {fanout} exceeds the {update.relay_fanout[rank]} rank {rank}'s Begin announced",
        )
