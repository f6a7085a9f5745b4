"""Cases: Abort drops an update and cuts its open streams; an Abort of nothing is no error."""

from __future__ import annotations

from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import require
from weight_sync.conformance.kit import Kit

GROUP = CaseGroup()


@GROUP.case("CANCELLED")
def abort_cuts_grpc_stream(kit: Kit) -> str:
    """Abort drops the update (True once, then False), cuts its open gRPC stream (CANCELLED); Commit finds nothing."""
    version, probe = kit.begin_probe()
    stream = kit.stream(version).send(kit.first_chunk(probe))
    kit.abort_open(version)
    got = stream.wait()
    require(not kit.abort(version), "a second Abort answered aborted = true")
    kit.require_dropped(version, "Commit after Abort answered {}")
    return got


@GROUP.case("OK")
def abort_unknown_update(kit: Kit) -> str:
    """Abort of an update that is not open answers aborted = false, no error."""
    require(not kit.abort(kit.version + 1, kit.session("none")), "aborted = true for nothing")
    return "OK"
