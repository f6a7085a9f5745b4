"""The weight-sync protocol's version (`weight_sync/PROTOCOL.md`, "Versions") and its one compatibility rule.

A peer speaks MAJOR.MINOR. Peers of the same major interoperate: a minor release only adds optional fields, metadata
keys or statuses whose defaults keep the older behaviour (proto3 peers ignore fields they do not know), and a peer uses
an addition only when the other side's minor has it. Another major does not interoperate: a sender pushes nothing to
such a receiver, and a receiver refuses such a Begin with UNIMPLEMENTED. A peer that sends no version (one written
before versions existed) reads as 1.0.
"""

from __future__ import annotations

from protos import weight_sync_pb2 as pb

__all__ = ["PROTOCOL_MAJOR", "PROTOCOL_MINOR", "incompatibility", "major_of", "protocol_version", "speaks"]

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 5
# 1.1: DataReply.unopened (a socket refusal before the stream opened; the sender may use gRPC)
# 1.2: DescribeReply.shm_plane (the same-host shared-memory data plane)
# 1.3: BeginRequest.drop_base (the sender will not send deltas against this update: keep no base of it)
# 1.4: BeginReply.committed_session_id (whose update the receiver's version is: a base pushed by this session or not)
# 1.5: DescribeReply.lora_alpha, BeginRequest.lora_alpha (adapters trained with one alpha are refused by a receiver
#      that would apply them with another)


def protocol_version() -> pb.ProtocolVersion:
    """The version this package speaks, as it travels in DescribeReply and BeginRequest."""
    return pb.ProtocolVersion(major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR)


def major_of(version: pb.ProtocolVersion) -> int:
    """The major of a peer's version; unset (major 0) is a peer from before versions: 1."""
    return version.major or 1


def speaks(version: pb.ProtocolVersion, minor: int) -> bool:
    """Whether a peer speaking `version` has this major's additions up to `minor` (use an addition only then)."""
    return major_of(version) == PROTOCOL_MAJOR and version.minor >= minor


def incompatibility(version: pb.ProtocolVersion, peer: str) -> str | None:
    """Why a `peer` ("receiver", "sender") speaking `version` cannot interoperate with this package, or None."""
    if major_of(version) == PROTOCOL_MAJOR:
        return None
    return (
        f"the {peer} speaks weight-sync protocol {major_of(version)}.{version.minor}, this one "
        f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}: major versions must match (weight_sync/PROTOCOL.md, 'Versions')"
    )
