"""The conformance kit (`weight_sync/conformance/`) passes against a real `python -m weight_sync serve` subprocess.

This is how CI checks that the receiver keeps what `weight_sync/PROTOCOL.md` writes down; the protocol version's
compatibility rule is checked here too (a sender and a receiver of different majors refuse each other).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file
from ws_helpers import begin, rank_shards, spec_msgs, status_of, tiny_state_dict

from protos import weight_sync_pb2 as pb
from weight_sync.__main__ import main
from weight_sync.channel import WeightSyncClient
from weight_sync.config import WeightSyncConfig
from weight_sync.conformance import CASES, format_table, run_conformance
from weight_sync.sender import WeightSender
from weight_sync.version import PROTOCOL_MAJOR

TOKEN = "conformance-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A `serve` subprocess on loopback and its directory: a token, 256-byte chunks (some tensors take several), short
    hello and stream idle timeouts so the cases that wait for them take seconds, the shared-memory plane, and a
    0-element tensor in its checkpoint."""
    directory = tmp_path_factory.mktemp("served")
    state = tiny_state_dict(3)
    state["model.layers.0.empty_buffer"] = torch.zeros(0, 4)  # a 0-element tensor: the empty-shard cases run
    save_file(state, str(directory / "model.safetensors"))
    env = {**os.environ, "RL_ALIGN_WEIGHT_SYNC_TOKEN": TOKEN, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weight_sync", "serve", "--dir", str(directory), "--port", "0", "--chunk_bytes", "256",
         "--hello_timeout_s", "1", "--stream_idle_timeout_s", "3", "--offer_shm", "true"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        assert line.startswith("serving"), proc.stderr.read() if proc.poll() is not None and proc.stderr else line
        yield line.split()[-1], directory
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_every_case_passes_against_serve(served: tuple[str, Path]) -> None:
    address, directory = served
    results = run_conformance(address, WeightSyncConfig(auth_token=TOKEN))
    table = format_table(results)
    assert [r.name for r in results] == [c.name for c in CASES]
    assert not [r for r in results if r.outcome == "FAIL"], table
    skipped = {r.name for r in results if r.outcome == "SKIP"}
    # serve offers sockets, shared memory, deltas, a token and 1.5; a served checkpoint takes no adapters
    assert skipped == {c.name for c in CASES if c.pending} | {"begin_adapters_of_another_alpha"}, table
    assert (directory / "policy_version.json").exists(), "the kit committed nothing"


def test_conformance_command_prints_the_table_and_exits_0(
    served: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = served
    assert main(["conformance", "--to", address, "--token", TOKEN, "--case", "describe", "--case", "push_commit"]) == 0
    out = capsys.readouterr().out
    assert "describe" in out and "push_commit" in out and "2 passed, 0 failed" in out
    assert main(["conformance", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(c.name in listed for c in CASES)


def test_conformance_command_fails_for_a_wrong_token(
    served: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = served
    assert main(["conformance", "--to", address, "--token", "wrong", "--num_retries", "0"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_receiver_reports_its_version_and_refuses_another_major(receivers) -> None:
    (receiver, _), = receivers(1)
    client = WeightSyncClient(receiver.address, WeightSyncConfig())
    assert client.describe().protocol_version.major == PROTOCOL_MAJOR
    sd = tiny_state_dict()
    other = pb.BeginRequest(session_id="s", policy_version=1, rank=0, num_ranks=1, tensors=spec_msgs(sd),
                            protocol_version=pb.ProtocolVersion(major=PROTOCOL_MAJOR + 1))
    assert status_of(lambda: client.begin(other)) == grpc.StatusCode.UNIMPLEMENTED
    assert status_of(lambda: begin(client, sd, 1)) == grpc.StatusCode.OK  # unset: a sender from before versions
    client.close()


def test_sender_pushes_nothing_to_a_receiver_of_another_major(receivers, monkeypatch: pytest.MonkeyPatch) -> None:
    import weight_sync.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "protocol_version", lambda: pb.ProtocolVersion(major=PROTOCOL_MAJOR + 1))
    (receiver, sink), = receivers(1)
    sd = tiny_state_dict(1)
    with WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=4096)) as sender:
        report = sender.push(1, rank_shards(sd, 0, 1))
    assert "major versions must match" in (report.errors[receiver.address] or "")
    assert receiver.policy_version == 0 and receiver.area.staging_bytes == 0  # no Begin reached it
    assert all(not t.any() for t in sink.state_dict.values())
