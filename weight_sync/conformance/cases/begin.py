"""Cases: Begin's own checks (each refused before any update opens), joining an update, and which update gives way."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.checks import CaseSkipped, code_of, require
from weight_sync.conformance.kit import Kit

GROUP = CaseGroup()
Mutation = Callable[[Kit, pb.BeginRequest], None]


def _begin_refusal(expected: str, mutate: Mutation, doc: str) -> None:
    """Register a case (`doc`: "name: what the Begin has"): a Begin of the probe changed by `mutate` is refused with
    `expected` before any update opens, so a conforming Begin right after it opens one."""

    def run(kit: Kit) -> str:
        request = kit.begin_request(kit.version + 1, [kit.need_probe()])
        mutate(kit, request)
        got = code_of(lambda: kit.begin(request))
        if got != "OK":
            after = code_of(kit.begin_probe)
            require(after == "OK", f"a conforming Begin after the refused one answered {after}")
        return got

    GROUP.refusal(expected, doc, "refuse a Begin with {}", run)


def _set(field: str, value: object) -> Mutation:
    return lambda kit, r: setattr(r, field, value)


def _relay(n: int, fanout: int, ticket: bytes = b"", port: int = 10000) -> Mutation:
    def mutate(kit: Kit, request: pb.BeginRequest) -> None:
        request.relay_targets.extend(
            pb.RelayTarget(address=f"127.0.0.1:{port + i}", data_port=20000 + i, ticket=ticket) for i in range(n)
        )
        request.relay_fanout = fanout

    return mutate


def _version(delta: int) -> Mutation:
    return lambda kit, r: setattr(r, "policy_version", kit.version + delta)


def _tensors(make: Callable[[Kit], list[pb.TensorSpec]]) -> Mutation:
    def mutate(kit: Kit, request: pb.BeginRequest) -> None:
        del request.tensors[:]
        request.tensors.extend(make(kit))

    return mutate


def _probe_msg(kit: Kit, shape: Sequence[int] | None = None, name: str | None = None) -> pb.TensorSpec:
    probe = kit.need_probe()
    return pb.TensorSpec(name=name or probe.name, shape=probe.shape if shape is None else shape, dtype=probe.dtype)


_begin_refusal("UNIMPLEMENTED", lambda k, r: r.protocol_version.CopyFrom(pb.ProtocolVersion(major=2)),
               "begin_protocol_major_mismatch: protocol major 2")
_begin_refusal("FAILED_PRECONDITION", _version(0), "begin_version_not_newer: policy_version = the current one")
_begin_refusal("OUT_OF_RANGE", _set("policy_version", 2**53), "begin_version_past_2_53: policy_version 2^53")
_begin_refusal("OUT_OF_RANGE", _set("policy_version", 2**63 - 1), "begin_version_int64_max: policy_version 2^63 - 1")
_begin_refusal("INVALID_ARGUMENT", _set("session_id", ""), "begin_empty_session: an empty session_id")
_begin_refusal("INVALID_ARGUMENT", _set("session_id", "s" * 257), "begin_long_session: a 257-character session_id")
_begin_refusal("INVALID_ARGUMENT", _set("session_id", "a\nb"), "begin_unprintable_session: a session_id with a newline")
_begin_refusal("INVALID_ARGUMENT", _set("num_streams", -1), "begin_negative_streams: num_streams -1")
_begin_refusal("INVALID_ARGUMENT", _set("rank", 1), "begin_rank_out_of_range: rank 1 of num_ranks 1")
_begin_refusal("INVALID_ARGUMENT", _set("num_ranks", 0), "begin_no_ranks: num_ranks 0")
_begin_refusal("INVALID_ARGUMENT", _set("num_streams", 65), "begin_too_many_streams: num_streams 65")
_begin_refusal("NOT_FOUND", _tensors(lambda k: [_probe_msg(k, name="no.such.tensor")]),
               "begin_unknown_tensor: a tensor the manifest does not list")
_begin_refusal("INVALID_ARGUMENT", _tensors(lambda k: [_probe_msg(k, shape=[1, 2, 3, 4, 5])]),
               "begin_wrong_shape: a manifest tensor with another shape")
_begin_refusal("INVALID_ARGUMENT", _tensors(lambda k: [_probe_msg(k), _probe_msg(k)]),
               "begin_tensor_twice: one tensor listed twice")
_begin_refusal("INVALID_ARGUMENT", _relay(1025, 2), "begin_too_many_relay_targets: 1025 relay targets")
_begin_refusal("INVALID_ARGUMENT", _relay(1, 2, b"t"), "begin_relay_target_with_ticket: a relay target with a ticket")
_begin_refusal("INVALID_ARGUMENT", _relay(1, 0), "begin_relay_fanout_zero: relay targets with relay_fanout 0")
_begin_refusal("INVALID_ARGUMENT", _relay(1, 65), "begin_relay_fanout_65: relay targets with relay_fanout 65")
_begin_refusal("INVALID_ARGUMENT", _relay(1, 2, port=99999), "begin_relay_port_out_of_range: a relay target on port "
               "99999")


@GROUP.case("OK")
def begin_without_protocol_version(kit: Kit) -> str:
    """A Begin without protocol_version (a sender from before versions) reads as 1.0 and opens the update."""
    request = kit.begin_request(kit.version + 1, [kit.need_probe()])
    request.ClearField("protocol_version")
    return code_of(lambda: kit.begin(request))


@GROUP.case("OK")
def begin_idempotent(kit: Kit) -> str:
    """The same Begin twice joins the same update: same update_id, same data ticket."""
    request = kit.begin_request(kit.version + 1, [kit.need_probe()])
    first, again = kit.begin(request), kit.begin(request)
    require(first.update_id == again.update_id, f"update_id {first.update_id} then {again.update_id}")
    require(first.data_ticket == again.data_ticket, "a repeated Begin handed out another ticket")
    planes = kit.data_port or kit.shm_plane is not None  # a TLS receiver may offer shared memory without a port
    require(len(first.data_ticket) == (32 if planes else 0), f"ticket of {len(first.data_ticket)} bytes")
    return "OK"


@GROUP.case("OK")
def begin_reports_the_committing_session(kit: Kit) -> str:
    """(1.4) BeginReply.committed_session_id names the session whose update made current_version: the kit's, once it
    committed one, as seen by a Begin of another session."""
    if kit.minor < 4:
        raise CaseSkipped(f"BeginReply.committed_session_id is protocol 1.4; the receiver speaks 1.{kit.minor}")
    probe = kit.need_probe()
    kit.push_and_commit(kit.version + 1, [probe])
    version, other = kit.version + 1, kit.session("other")
    reply = kit.begin(kit.begin_request(version, [probe], session=other))
    kit.abort(version, session=other)
    require(reply.committed_session_id == kit.session(),
            f"committed_session_id {reply.committed_session_id!r} after session {kit.session()!r} committed")
    return "OK"


@GROUP.case("FAILED_PRECONDITION")
def begin_adapters_of_another_alpha(kit: Kit) -> str:
    """(1.5) A Begin of LoRA adapters trained with another lora_alpha than the receiver declares is refused; one with
    its alpha opens the update."""
    if kit.minor < 5:
        raise CaseSkipped(f"Describe/Begin lora_alpha is protocol 1.5; the receiver speaks 1.{kit.minor}")
    adapter = kit.need_adapter()
    got = code_of(lambda: kit.begin(kit.begin_request(kit.version + 1, [adapter], lora_alpha=kit.lora_alpha * 2)))
    if got != "OK":
        after = code_of(lambda: kit.begin(kit.begin_request(kit.version + 1, [adapter])))
        require(after == "OK", f"a Begin of the same adapters with the receiver's lora_alpha answered {after}")
    return got


@GROUP.case("INVALID_ARGUMENT")
def begin_rank_again_other_tensors(kit: Kit) -> str:
    """A rank's second Begin of one update with other tensors (or streams, relay targets) is refused."""
    version, probe = kit.begin_probe()
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe], num_streams=2)))


@GROUP.case("INVALID_ARGUMENT")
def begin_num_ranks_changes(kit: Kit) -> str:
    """Rank 1 joining with num_ranks 3 an update rank 0 opened with num_ranks 2 is refused."""
    version, probe = kit.begin_probe(num_ranks=2)
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe], rank=1, num_ranks=3)))


@GROUP.case("ABORTED")
def begin_other_update_in_progress(kit: Kit) -> str:
    """A Begin of another session while an update is open (and active) is refused."""
    version, probe = kit.begin_probe()
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe], session=kit.session("other"))))


@GROUP.case("OK")
def begin_newer_version_supersedes(kit: Kit) -> str:
    """A session's Begin of a newer version replaces its own open older update, whose Commit then finds nothing."""
    version, probe = kit.begin_probe()
    got = code_of(lambda: kit.begin(kit.begin_request(version + 1, [probe])))
    if got == "OK":
        kit.require_dropped(version, "Commit of the superseded update answered {}")
    return got


@GROUP.case("ABORTED")
def begin_older_version_of_session(kit: Kit) -> str:
    """A session's Begin of an older version than its own open update is refused."""
    probe = kit.need_probe()
    version = kit.version + 1
    kit.begin(kit.begin_request(version + 1, [probe]))
    return code_of(lambda: kit.begin(kit.begin_request(version, [probe])))


@GROUP.case("OK")
def begin_trainer_session_preempts(kit: Kit) -> str:
    """The session of the last commit (the trainer's) preempts another session's open update, which is dropped."""
    kit.push_and_commit(kit.version + 1, [kit.need_probe()])  # the kit's session is now the trainer's
    intruder = kit.session("intruder")
    version, probe = kit.begin_probe(session=intruder)
    got = code_of(lambda: kit.begin(kit.begin_request(version, [probe])))
    if got == "OK":
        kit.require_dropped(version, "Commit of the preempted update answered {}", intruder)
    return got
