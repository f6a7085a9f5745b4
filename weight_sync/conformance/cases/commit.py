"""Cases: Commit's checks (every rank, every stream ended, every element once), whole updates that commit, and
Commit's idempotence (repeated and concurrent Commits apply once)."""

from __future__ import annotations

import time
from concurrent import futures

from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import code_of, need, require
from weight_sync.conformance.kit import Kit
from weight_sync.conformance.wire import rows

GROUP = CaseGroup()


@GROUP.case("NOT_FOUND")
def commit_without_update(kit: Kit) -> str:
    """A Commit of an update nobody began is refused."""
    return code_of(lambda: kit.commit(kit.version + 1, kit.session("none")))


@GROUP.case("FAILED_PRECONDITION")
def commit_rank_missing(kit: Kit) -> str:
    """A Commit before every rank called Begin is refused (and the update dropped)."""
    version, _ = kit.begin_probe(num_ranks=2)
    return code_of(lambda: kit.commit(version))


@GROUP.case("FAILED_PRECONDITION")
def commit_no_tensor(kit: Kit) -> str:
    """A Commit of an update that announces no tensor is refused."""
    version = kit.version + 1
    kit.begin(kit.begin_request(version, []))
    require(kit.stream(version).close() == "OK", "an empty stream of an empty rank failed")
    return code_of(lambda: kit.commit(version))


@GROUP.case("FAILED_PRECONDITION")
def commit_before_streams_end(kit: Kit) -> str:
    """A Commit while a rank's stream is still open is refused, the update dropped and the open stream cut."""
    version, probe = kit.begin_probe()
    stream = kit.stream(version).send(*kit.chunks(probe, kit.values(probe)))
    time.sleep(0.3)
    got = code_of(lambda: kit.commit(version))
    cut = stream.wait()
    require(cut == "CANCELLED", f"the open stream of the dropped update ended {cut}, not CANCELLED")
    return got


@GROUP.case("FAILED_PRECONDITION")
def commit_incomplete_tensor(kit: Kit) -> str:
    """A Commit of a tensor missing its last row is refused, and a repeated Commit gets the same answer."""
    version, probe = kit.begin_probe()
    values = kit.values(probe)
    require(kit.stream(version).send(*kit.chunks(probe, values, rows(probe, 0, probe.shape[0] - 1))).close() == "OK",
            "a stream of whole shards failed")
    got = code_of(lambda: kit.commit(version))
    again = code_of(lambda: kit.commit(version))
    require(again == got, f"a repeated Commit answered {again}, the first {got}")
    return got


@GROUP.case("FAILED_PRECONDITION")
def commit_overlap_and_gap(kit: Kit) -> str:
    """Shards of the right total size that overlap (and so leave a gap) are refused at Commit."""
    version, probe = kit.begin_probe()
    values, num_rows = kit.values(probe), probe.shape[0]
    messages = kit.chunks(probe, values, rows(probe, 0, 2)) + kit.chunks(probe, values, rows(probe, 1, num_rows - 1))
    require(kit.stream(version).send(*messages).close() == "OK", "overlapping shards of the right size were refused")
    return code_of(lambda: kit.commit(version))


@GROUP.case("OK")
def push_commit(kit: Kit) -> str:
    """A whole single-rank update over gRPC commits; Describe then reports its version and older Begins are refused."""
    version = kit.version + 1
    reply = kit.push_and_commit(version, kit.payload() or [need(None, "tensor to push")])
    require(reply.policy_version == version, f"CommitReply.policy_version {reply.policy_version}")
    require(kit.version == version, "Describe does not report the committed version")
    stale = code_of(lambda: kit.begin(kit.begin_request(version, kit.payload())))
    require(stale == "FAILED_PRECONDITION", f"a Begin of the committed version answered {stale}")
    return "OK"


@GROUP.case("OK")
def push_commit_two_ranks_two_streams(kit: Kit) -> str:
    """Two ranks with two streams each, one row block per stream, commit as one update."""
    probe = kit.need_probe()
    version, values, num_rows = kit.version + 1, kit.values(probe), probe.shape[0]
    cuts = [num_rows * i // 4 for i in range(5)]
    for rank in (0, 1):
        kit.begin(kit.begin_request(version, [probe], rank=rank, num_ranks=2, num_streams=2))
    streams = [kit.stream(version, rank=i // 2).send(*kit.chunks(probe, values, rows(probe, cuts[i], cuts[i + 1])))
               for i in range(4)]
    got = [s.close() for s in streams]
    require(got == ["OK"] * 4, f"streams answered {got}")
    kit.commit(version)
    kit.remember(version, {probe.name: values})
    return "OK"


@GROUP.case("OK")
def push_commit_empty_tensor(kit: Kit) -> str:
    """A tensor with 0 elements commits beside the probe, its empty shard sent by each of two ranks."""
    empty = need(next((s for s in kit.manifest.values() if s.numel == 0), None), "tensor with 0 elements")
    probe = kit.need_probe()
    version, values, half = kit.version + 1, kit.values(probe), probe.shape[0] // 2
    for rank in (0, 1):
        kit.begin(kit.begin_request(version, [probe, empty], rank=rank, num_ranks=2))
    for rank, box in ((0, rows(probe, 0, half)), (1, rows(probe, half, probe.shape[0]))):
        messages = kit.chunks(probe, values, box) + kit.chunks(empty, kit.values(empty))
        got = kit.stream(version, rank=rank).send(*messages).close()
        require(got == "OK", f"rank {rank}'s stream with the empty shard answered {got}")
    reply = kit.commit(version)
    require(reply.policy_version == version, f"CommitReply.policy_version {reply.policy_version}")
    kit.remember(version, {probe.name: values})
    return "OK"


@GROUP.case("OK")
def commit_repeated(kit: Kit) -> str:
    """A repeated Commit of a committed update answers as the first did (same apply_seconds): no second apply."""
    version = kit.version + 1
    first = kit.push_and_commit(version, [kit.need_probe()])
    again = kit.commit(version)
    require(again.apply_seconds == first.apply_seconds, f"apply_seconds {first.apply_seconds}, {again.apply_seconds}")
    require(again.policy_version == version, f"policy_version {again.policy_version}")
    return "OK"


@GROUP.case("OK")
def commit_concurrent(kit: Kit) -> str:
    """Four concurrent Commits of one update all succeed with one answer (one apply)."""
    version, probe = kit.begin_probe()
    values = kit.values(probe)
    require(kit.stream(version).send(*kit.chunks(probe, values)).close() == "OK", "push failed")
    with futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: kit.commit(version), range(4)))
    kit.remember(version, {probe.name: values})
    require(len({r.apply_seconds for r in replies}) == 1, f"apply_seconds {[r.apply_seconds for r in replies]}")
    return "OK"
