"""How a sender's streams reach each receiver: its shared-memory plane (same host), its socket plane, or gRPC Push;
and, with relay trees, which receivers a Begin announces as relay targets.

    ports, offers = routes(endpoints, receivers, config, errors)   # {address: data port, 0 = gRPC}, {address: shm}
    request = with_relay_targets(request, address, ports, config.relay_fanout)
"""

from __future__ import annotations

from collections.abc import Sequence

from protos import weight_sync_pb2 as pb
from weight_sync.config import WeightSyncConfig
from weight_sync.receivers import Receivers
from weight_sync.relay_targets import MAX_RELAY_TARGETS
from weight_sync.shm import host_identity
from weight_sync.version import incompatibility, speaks

__all__ = ["SHM_MINOR", "routes", "shm_offer", "socket_port", "with_relay_targets"]

SHM_MINOR = 2  # the protocol minor that added the shared-memory plane (DescribeReply.shm_plane)


def routes(
    endpoints: Sequence[str], receivers: Receivers, config: WeightSyncConfig, errors: dict[str, str | None]
) -> tuple[dict[str, int], dict[str, pb.ShmPlane]]:
    """The receivers of ``endpoints`` to Begin and how their streams travel: ({address: data port, 0 for gRPC Push},
    {address: its shared-memory plane, for those reached through one}); receivers refused before Begin (left out,
    of an incompatible protocol, without the plane ``config.data_plane`` demands) go to ``errors`` with the reason."""
    ports: dict[str, int] = {}
    offers: dict[str, pb.ShmPlane] = {}
    for address in endpoints:
        left_out = receivers.left_out(address)
        if left_out is not None:
            errors[address] = left_out  # refused before Begin: nothing is staged there
            continue
        described = receivers.described.get(address)
        problem = incompatibility(described.protocol_version, "receiver") if described is not None else None
        if problem:
            errors[address] = f"Describe: {problem}"  # refused before Begin: nothing is staged there
            continue
        try:
            offer = shm_offer(config, described, address)
            ports[address] = 0 if offer is not None else socket_port(config, described, address)
        except ValueError as e:
            errors[address] = f"Push: {e}"  # refused before Begin: nothing is left staged there
            continue
        if offer is not None:
            offers[address] = offer
    return ports, offers


def shm_offer(config: WeightSyncConfig, described: pb.DescribeReply | None, address: str) -> pb.ShmPlane | None:
    """The shared-memory plane of the receiver at ``address`` (``described``: its Describe reply, None when unknown)
    when streams to it should take it (it offers one on this host: the same ``host_identity``), else None. Raises
    ValueError when ``data_plane = "shm"`` demands a plane the receiver does not offer here."""
    if config.data_plane not in ("auto", "shm"):
        return None
    offer: pb.ShmPlane | None = None
    if described is not None and described.HasField("shm_plane") and speaks(described.protocol_version, SHM_MINOR):
        offer = described.shm_plane
    here = host_identity()
    if offer is not None and offer.socket_name and here is not None and offer.host_id == here:
        return offer
    if config.data_plane == "shm":
        where = "offers no shared-memory data plane" if offer is None else "is not on this host"
        raise ValueError(f"data_plane='shm' but receiver {address} {where}")
    return None


def socket_port(config: WeightSyncConfig, described: pb.DescribeReply | None, address: str) -> int:
    """The receiver's data port when streams to it should use the socket plane, else 0 (gRPC Push streams: asked for,
    under TLS, or not offered). Raises ValueError when ``data_plane = "tcp"`` demands a socket plane the receiver does
    not offer."""
    if config.data_plane == "grpc" or config.tls_ca_path is not None:
        return 0
    port = described.data_port if described is not None else 0
    if config.data_plane == "tcp" and not port:
        raise ValueError(f"data_plane='tcp' but receiver {address} offers no socket data plane")
    return port


def with_relay_targets(request: pb.BeginRequest, address: str, ports: dict[str, int], fanout: int) -> pb.BeginRequest:
    """``request`` for the receiver at ``address`` announcing, with relay trees (``fanout`` > 0; ``ports``: the
    receivers in relay trees), every other receiver of the push as one it may forward to; ``request`` itself when no
    tree includes it.

    Which receivers end up below which depends on the Begin replies (delta or full), so every other receiver is
    announced; a receiver refuses (PERMISSION_DENIED) a relay list naming any receiver not announced. Raises ValueError
    when the receivers outnumber what one accepts (``MAX_RELAY_TARGETS``)."""
    if address not in ports or not fanout or len(ports) < 2:
        return request
    if len(ports) - 1 > MAX_RELAY_TARGETS:
        raise ValueError(
            f"relay_fanout={fanout} with {len(ports)} receivers: a receiver accepts at most {MAX_RELAY_TARGETS} "
            "relay targets; split the receivers over several senders or push without relays"
        )
    out = pb.BeginRequest()
    out.CopyFrom(request)
    out.relay_targets.extend(pb.RelayTarget(address=a, data_port=p) for a, p in ports.items() if a != address)
    out.relay_fanout = fanout
    return out
