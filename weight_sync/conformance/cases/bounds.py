"""Cases: bounded resources and timeouts (abandoned updates, idle watchers, streams and connections that must not
starve a push, undecodable requests, idle streams cut, a silent update giving way), and that the kit leaves the
receiver idle. The cases that wait for one of the receiver's own timeouts wait at most `kit.max_wait_s`."""

from __future__ import annotations

import socket
import time

from protos import weight_sync_pb2 as pb
from weight_sync.conformance.case import CaseGroup
from weight_sync.conformance.cases.socket_plane import socket_push_commit, socket_update
from weight_sync.conformance.checks import code_of, need, require
from weight_sync.conformance.kit import Kit

GROUP = CaseGroup()


@GROUP.case("OK")
def abandoned_updates_release_buffers(kit: Kit) -> str:
    """8 updates begun, half-pushed with the stream left open, then aborted: each next Begin opens, the last commits."""
    specs = kit.payload() or [need(None, "tensor to push")]
    for _ in range(8):
        version = kit.version + 1
        request = kit.begin_request(version, specs)
        got = code_of(lambda: kit.begin(request))  # noqa: B023 (called at once)
        require(got == "OK", f"Begin after abandoned updates answered {got}")
        stream = kit.stream(version).send(kit.first_chunk(specs[0]))
        kit.abort_open(version, "Abort answered aborted = false")
        require(stream.wait() == "CANCELLED", "the aborted update's stream was not cut")
        kit.cleanup()
    kit.push_and_commit(kit.version + 1, specs)
    return "OK"


@GROUP.case("OK")
def idle_watch_streams_do_not_starve(kit: Kit) -> str:
    """40 idle WatchVersion streams (more than receivers serve) keep neither Describe nor a push from going on."""
    request = pb.WatchVersionRequest(after_version=2**62)
    watches = [kit.stub.WatchVersion(request, metadata=kit.metadata, timeout=30) for _ in range(40)]
    try:
        time.sleep(0.5)
        kit.push_and_commit(kit.version + 1, [kit.need_probe()])
    finally:
        for watch in watches:
            watch.cancel()
    return "OK"


@GROUP.case("OK")
def idle_push_streams_do_not_starve(kit: Kit) -> str:
    """48 idle Push streams of another session's update do not keep Describe, nor the trainer's push, from going on."""
    probe = kit.need_probe()
    kit.push_and_commit(kit.version + 1, [probe])  # the kit's session is now the trainer's
    hog = kit.session("hog")
    version, _ = kit.begin_probe(session=hog, num_streams=48)
    for _ in range(48):
        kit.stream(version, session=hog)
    time.sleep(0.5)
    kit.describe()
    kit.push_and_commit(version, [probe])
    return "OK"


@GROUP.case("OK")
def idle_connections_do_not_starve(kit: Kit) -> str:
    """40 silent TCP connections to the data port do not keep a socket-plane push from being served."""
    kit.need_socket()
    silent = [socket.create_connection((kit.host, kit.data_port), timeout=kit.timeout_s) for _ in range(40)]
    try:
        time.sleep(0.5)
        return socket_push_commit(kit)
    finally:
        for s in silent:
            s.close()


@GROUP.case("INVALID_ARGUMENT")
def begin_undecodable_message(kit: Kit) -> str:
    """Bytes that are no BeginRequest are refused as INVALID_ARGUMENT (not INTERNAL)."""
    return code_of(lambda: kit.begin_raw(b"\xff" * 16, metadata=kit.metadata, timeout=kit.timeout_s))


@GROUP.case("DEADLINE_EXCEEDED")
def socket_silent_connection_closed(kit: Kit) -> str:
    """A connection that sends no hello is answered DEADLINE_EXCEEDED after the receiver's hello timeout."""
    kit.need_socket()
    connection = kit.connect(b"")
    got = connection.reply(end=False, wait_s=kit.max_wait_s)
    require(kit.minor < 1 or connection.unopened is True, "the refused connection's reply is not unopened")
    return got


@GROUP.case("CANCELLED")
def push_idle_stream_cut(kit: Kit) -> str:
    """A gRPC Push stream that goes silent is cut after the receiver's stream idle timeout, its update dropped."""
    version, probe = kit.begin_probe()
    stream = kit.stream(version, timeout_s=kit.max_wait_s + kit.timeout_s)
    got = stream.send(kit.first_chunk(probe)).wait()
    kit.require_dropped(version, "Commit of the cut stream's update answered {}")
    return got


@GROUP.case("DEADLINE_EXCEEDED")
def socket_idle_stream_cut(kit: Kit) -> str:
    """A socket stream that goes silent is answered DEADLINE_EXCEEDED after the stream idle timeout, update dropped."""
    version, probe, hello = socket_update(kit)
    got = kit.connect(hello).chunk(kit.first_chunk(probe)).reply(end=False, wait_s=kit.max_wait_s)
    kit.require_dropped(version, "Commit of the cut stream's update answered {}")
    return got


@GROUP.case("OK")
def begin_replaces_silent_update(kit: Kit) -> str:
    """An update waiting for data that gets none gives way to another session's Begin after the stream idle timeout."""
    version, probe = kit.begin_probe(session=kit.session("silent"))
    late = kit.begin_request(version, [probe], session=kit.session("late"))
    deadline = time.monotonic() + kit.max_wait_s
    while (got := code_of(lambda: kit.begin(late))) == "ABORTED" and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


@GROUP.case("OK")
def receiver_left_idle(kit: Kit) -> str:
    """After the kit, no update of it is open: a new Begin opens one (then aborted)."""
    probe = kit.need_probe()
    version = kit.version + 1
    got = code_of(lambda: kit.begin(kit.begin_request(version, [probe])))
    require(got == "OK", f"Begin answered {got}: an update is still open")
    require(kit.abort(version), "Abort answered aborted = false")
    return "OK"
