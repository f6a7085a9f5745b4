"""Cases: opening a gRPC Push stream (its metadata, the update and rank it names, how many streams a rank has)."""

from __future__ import annotations

from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import code_of, require
from weight_sync.conformance.kit import Kit

GROUP = CaseGroup()


@GROUP.case("INVALID_ARGUMENT")
def push_missing_metadata(kit: Kit) -> str:
    """A Push stream without x-ws-session / x-ws-version / x-ws-rank is refused."""
    return kit.open_stream(()).close()


@GROUP.case("NOT_FOUND")
def push_without_update(kit: Kit) -> str:
    """A Push stream naming no open update is refused."""
    return kit.stream(kit.version + 1, session=kit.session("none")).close()


@GROUP.case("FAILED_PRECONDITION")
def push_rank_without_begin(kit: Kit) -> str:
    """A Push stream of a rank that did not call Begin is refused."""
    version, _ = kit.begin_probe(num_ranks=2)
    return kit.stream(version, rank=1).close()


@GROUP.case("ALREADY_EXISTS")
def push_extra_stream(kit: Kit) -> str:
    """A stream beyond the rank's num_streams is refused, and the update stays: it commits."""
    version, probe = kit.begin_probe(num_streams=1)
    values = kit.values(probe)
    require(kit.stream(version).send(*kit.chunks(probe, values)).close() == "OK", "the first stream failed")
    got = kit.stream(version).close()
    require(code_of(lambda: kit.commit(version)) == "OK", "the update did not commit after the refused stream")
    kit.remember(version, {probe.name: values})
    return got


@GROUP.case("ALREADY_EXISTS")
def push_num_streams_zero_is_one(kit: Kit) -> str:
    """num_streams 0 in Begin means 1: a second stream is refused."""
    version, probe = kit.begin_probe(num_streams=0)
    require(kit.stream(version).send(*kit.chunks(probe, kit.values(probe))).close() == "OK", "the first stream failed")
    return kit.stream(version).close()


@GROUP.case("PERMISSION_DENIED")
def push_relay_not_announced(kit: Kit) -> str:
    """A stream asking (x-ws-relay) to forward to a receiver its Begin did not announce is refused; the update stays."""
    version, _ = kit.begin_probe()
    got = kit.stream(version, extra=(("x-ws-relay", "127.0.0.1:9"), ("x-ws-fanout", "1"))).close()
    require(kit.abort(version), "the update was gone after the refused relay stream")
    return got
