"""`python -m weight_sync serve` as a real subprocess takes a `push --checkpoint` of an HF-style directory."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from ws_helpers import tiny_state_dict, zeros_like_dict

from weight_sync.__main__ import build_parser, config_of, main
from weight_sync.config import RECEIVER_FIELDS, WeightSyncConfig


def test_serve_and_push_a_checkpoint_with_a_token_from_the_environment(tmp_path, monkeypatch, capsys):
    sd = tiny_state_dict(6)
    served, source = tmp_path / "served", tmp_path / "source"
    served.mkdir()
    source.mkdir()
    save_file(zeros_like_dict(sd), str(served / "model-00001-of-00002.safetensors"))
    save_file(sd, str(source / "model.safetensors"))
    env = {**os.environ, "RL_ALIGN_WEIGHT_SYNC_TOKEN": "tok", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weight_sync", "serve", "--dir", str(served), "--port", "0", "--chunk_bytes", "65536",
         "--offer_shm", "true"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving"), proc.stderr.read() if proc.poll() is not None else line
        address = line.split()[-1]
        monkeypatch.setenv("RL_ALIGN_WEIGHT_SYNC_TOKEN", "wrong")
        assert main(["push", "--checkpoint", str(source), "--to", address, "--version", "3", "--num_retries", "0"]) == 1
        monkeypatch.setenv("RL_ALIGN_WEIGHT_SYNC_TOKEN", "tok")
        assert main(["push", "--checkpoint", str(source), "--to", address, "--version", "3"]) == 0
        assert main(["describe", "--to", address]) == 0
        described = capsys.readouterr().out
        assert "policy_version 3" in described and "shared-memory plane" in described, described
        # A refused push commits nothing and says why (it printed "committed v3" and exited 0 before).
        other = tmp_path / "other"
        other.mkdir()
        newer = {k: v + 1 for k, v in sd.items()}
        save_file(newer, str(other / "model.safetensors"))
        assert main(["push", "--checkpoint", str(other), "--to", address, "--version", "3"]) == 1
        out = capsys.readouterr().out
        assert "push failed" in out and "not newer" in out and "nothing committed" in out, out
        assert main(["push", "--checkpoint", str(other), "--to", address]) == 0  # the next version by default
        assert "committed v4" in capsys.readouterr().out
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0
    got = load_file(str(served / "model.safetensors"))
    assert sorted(got) == sorted(newer) and all(torch.equal(got[k], v) for k, v in newer.items())
    assert json.loads((served / "policy_version.json").read_text()) == {"policy_version": 4}
    assert not (served / "model-00001-of-00002.safetensors").exists()


def test_bad_config_flag_is_a_clear_error(capsys):
    assert main(["describe", "--to", "127.0.0.1:1", "--chunk_byts", "5"]) == 2
    assert "chunk_byts" in capsys.readouterr().err
    # A flag's value that the settings refuse names the flag's field, as settings (it read "invalid recipe ... (whole
    # file)" for a command line).
    assert main(["describe", "--to", "127.0.0.1:1", "--chunk_bytes", "1001"]) == 2
    assert "error: command line: invalid settings (1 problem(s)):\n  - chunk_bytes: chunk_bytes=1001" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("command", ["serve", "push", "describe", "conformance"])
def test_help_lists_every_config_field_with_its_doc_and_default(command):
    result = subprocess.run(
        [sys.executable, "-m", "weight_sync", command, "--help"], capture_output=True, text=True, check=True,
        env={**os.environ, "COLUMNS": "400"},
    )
    text = " ".join(result.stdout.split())
    for name, field in WeightSyncConfig.model_fields.items():
        if command != "serve" and name in RECEIVER_FIELDS:  # a client command lists no receiver setting
            assert f"--{name} " not in text, f"{command} --help lists the receiver's --{name}"
            continue
        assert f"--{name} " in text, f"{command} --help lacks --{name}"
        doc = " ".join((field.description or "").split())
        assert doc and doc in text, f"{command} --help lacks the doc of {name}"
    assert "--chunk_bytes INT Raw payload bytes per streamed chunk" in text
    assert "(default: 4194304)" in text and "(default: RL_ALIGN_WEIGHT_SYNC_TOKEN)" in text


def test_config_flags_reach_the_config_and_aliases_work():
    parser, _ = build_parser()
    args, extra = parser.parse_known_args(
        ["serve", "--dir", "d", "--host", "127.0.0.2", "--chunk_bytes", "4096", "--delta", "false", "--port=7"]
    )
    config = config_of(args, extra)
    assert (config.bind_host, config.chunk_bytes, config.delta, config.port) == ("127.0.0.2", 4096, False, 7)
    args, extra = parser.parse_known_args(["push", "--checkpoint", "c", "--to", "h:1", "--endpoints", '["a:1"]'])
    assert config_of(args, extra).endpoints == ["a:1"]


@pytest.mark.parametrize("command", [["push", "--checkpoint", "c"], ["describe"], ["conformance"]])
def test_a_client_command_refuses_a_receivers_setting_naming_it(command, capsys):
    # `push --port 5` was taken and did nothing: the push went to --to whatever the port said.
    assert main([*command, "--to", "127.0.0.1:1", "--port", "5", "--num_server_threads=8"]) == 2
    err = capsys.readouterr().err
    assert "--num_server_threads, --port: receiver settings" in err and command[0] in err


def test_text_fields_take_their_flag_as_given():
    # "--auth_token 123456" was read as a TOML integer and refused ("Input should be a valid string").
    parser, _ = build_parser()
    args, extra = parser.parse_known_args(["serve", "--dir", "d", "--auth_token", "123456", "--host", "0"])
    config = config_of(args, extra)
    assert (config.auth_token, config.bind_host) == ("123456", "0")
    args, extra = parser.parse_known_args(["serve", "--dir", "d", "--auth_token", "1e3", "--chunk_bytes", "4096"])
    assert (config_of(args, extra).auth_token, config_of(args, extra).chunk_bytes) == ("1e3", 4096)


def test_the_describe_reply_name_of_the_chunk_limit_points_at_the_field(capsys):
    assert main(["describe", "--to", "127.0.0.1:1", "--max_chunk_bytes", "5"]) == 2
    assert "did you mean chunk_bytes" in capsys.readouterr().err


def test_push_sends_a_checkpoint_in_the_dtype_the_receiver_declares_and_describe_errors_are_one_line(tmp_path, capsys):
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import StateDictSink

    sd = tiny_state_dict(7)
    source = tmp_path / "source"
    source.mkdir()
    save_file(sd, str(source / "model.safetensors"))
    sink = StateDictSink({k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in sd.items()})
    receiver = WeightReceiver(sink, WeightSyncConfig())
    receiver.start()
    try:
        assert main(["push", "--checkpoint", str(source), "--to", receiver.address, "--version", "1"]) == 0
    finally:
        receiver.stop(grace_s=0)
    assert all(torch.equal(sink.state_dict[k], v.to(torch.bfloat16)) for k, v in sd.items())
    capsys.readouterr()
    assert main(["describe", "--to", "127.0.0.1:1", "--num_retries", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 127.0.0.1:1 does not answer Describe: UNAVAILABLE") and "Traceback" not in err


def test_a_push_with_the_wrong_token_says_so(tmp_path, capsys):
    """It printed "nothing pushed: give --version, or reach every receiver": neither was the problem."""
    import torch
    from safetensors.torch import save_file

    from weight_sync.config import WeightSyncConfig
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import StateDictSink

    receiver = WeightReceiver(StateDictSink({"w": torch.zeros(2)}), WeightSyncConfig(auth_token="right"))
    receiver.start()
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    try:
        assert main(["push", "--checkpoint", str(tmp_path), "--to", receiver.address, "--auth_token", "wrong",
                     "--num_retries", "0"]) == 1  # fmt: skip
    finally:
        receiver.stop(grace_s=0)
    out = capsys.readouterr().out
    assert "UNAUTHENTICATED" in out and "nothing pushed: the receiver refused the token" in out, out
    assert receiver.policy_version == 0
