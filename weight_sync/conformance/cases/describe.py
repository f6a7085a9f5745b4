"""Cases: Describe, the bearer token, WatchVersion."""

from __future__ import annotations

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import CaseSkipped, code_of, require
from weight_sync.conformance.kit import Kit

GROUP = CaseGroup()


@GROUP.case("OK")
def describe(kit: Kit) -> str:
    """Describe lists a manifest of distinct names, a chunk limit, a version >= 0 and protocol major 1."""
    reply = kit.describe()
    require(len(reply.manifest) > 0, "empty manifest")
    require(len({s.name for s in reply.manifest}) == len(reply.manifest), "a tensor is listed twice")
    require(reply.max_chunk_bytes > 0, f"max_chunk_bytes {reply.max_chunk_bytes}")
    require(reply.policy_version >= 0, f"policy_version {reply.policy_version}")
    require(reply.protocol_version.major == 1, f"protocol_version {reply.protocol_version}")
    return "OK"


def _need_token(kit: Kit) -> str:
    if not kit.token:
        raise CaseSkipped("no token given (--token): cannot tell whether the receiver wants one")
    return kit.token


@GROUP.case("UNAUTHENTICATED")
def auth_missing_token(kit: Kit) -> str:
    """A call without `authorization` metadata is refused when the receiver has a token."""
    _need_token(kit)
    return code_of(lambda: kit.stub.Describe(pb.DescribeRequest(), timeout=kit.timeout_s))


@GROUP.case("UNAUTHENTICATED")
def auth_wrong_token(kit: Kit) -> str:
    """A call with another bearer token is refused, Begin included."""
    md = (("authorization", f"Bearer {_need_token(kit)}x"),)
    request = kit.begin_request(kit.version + 1, [kit.need_probe()])
    return code_of(lambda: kit.stub.Begin(request, metadata=md, timeout=kit.timeout_s))


@GROUP.case("OK")
def watch_version(kit: Kit) -> str:
    """WatchVersion starts with the current version when it is greater than `after_version`."""
    current = kit.version
    events = kit.stub.WatchVersion(
        pb.WatchVersionRequest(after_version=current - 1), metadata=kit.metadata, timeout=kit.timeout_s
    )
    try:
        first = next(iter(events))
    finally:
        events.cancel()
    require(first.policy_version == current, f"first event {first.policy_version}, current {current}")
    return "OK"
