"""``ServerWeightSink`` against a recording engine client on a real event loop (the real server is covered by
``tests/integration/test_vllm_serve_plugin.py``): the order of vLLM's update calls, what each failure leaves behind,
the drain-timeout policies, the stage file's lifetime, persistence and the plugin's config sources.

The engine client here is a fake by necessity (a vLLM server's failure modes cannot be provoked on demand); its
methods are the public ``EngineClient`` ones the sink calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import ConfigError
from rollout.engine.server_sink import ServerWeightSink
from rollout.engine.transfer import REFUSED
from rollout.engine.vllm_plugin import lora_option, served_receiver_config
from trainer.models.config import LoRAConfig
from weight_sync.sink import read_policy_version

STATE = {"model.norm.weight": torch.ones(4), "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4)}


class RecordingEngine:
    """The ``EngineClient`` calls the sink makes, recorded; ``fail_update`` makes ``update_weights`` raise."""

    def __init__(self, fail_update: str | None = None, drain_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.fail_update, self.drain_s = fail_update, drain_s
        self.staged: dict[str, torch.Tensor] = {}
        self.output_processor = types.SimpleNamespace(request_states={})

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}")
        if mode == "wait":
            await asyncio.sleep(self.drain_s)
        else:  # vLLM's abort mode ends every request it holds
            self.output_processor.request_states.clear()

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def start_weight_update(self) -> None:
        self.calls.append("start")

    async def update_weights(self, request) -> None:
        info = request.update_info
        self.calls.append(f"update:{info['policy_version']}:{'full' if info['full'] else 'partial'}")
        self.staged = load_file(info["path"])
        if self.fail_update:
            raise Exception(f"Call to collective_rpc method failed: {self.fail_update}")

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish:{weight_version}")

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "model").mkdir()
    save_file(STATE, str(tmp_path / "model" / "model.safetensors"))
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


def _sink(engine, loop, model_dir, tmp_path, **kwargs) -> ServerWeightSink:
    return ServerWeightSink(engine, loop, model_dir, stage_dir=str(tmp_path / "stage"), **kwargs)


def test_an_update_drains_loads_labels_resets_and_resumes_in_that_order(loop, model_dir, tmp_path):
    engine = RecordingEngine()
    sink = _sink(engine, loop, model_dir, tmp_path)
    assert sink.committed_version() == 0
    sink.apply(3, {"model.norm.weight": torch.full((4,), 2.0)})
    assert engine.calls == ["pause:wait", "start", "update:3:partial", "finish:3", "reset_prefix_cache", "resume"]
    assert torch.equal(engine.staged["model.norm.weight"], torch.full((4,), 2.0))
    assert sink.committed_version() == 3 and sink.state.num_updates == 1 and sink.state.last_pause_s > 0
    assert not os.listdir(tmp_path / "stage")  # the stage file lives for the update only


def test_a_pause_that_fails_resumes_generation_and_refuses_the_update(loop, model_dir, tmp_path):
    """With tensor parallelism vLLM's executor once answered the next update's pause with a worker's refusal of the
    update before it: the pause failed and generation stayed paused behind a healthy-looking server."""
    engine = RecordingEngine()
    pause = engine.pause_generation
    failures = [Exception(f"Call to pause_scheduler method failed: {REFUSED} update has q_proj but not k_proj")]

    async def failing_once(mode: str = "abort", clear_cache: bool = True) -> None:
        if failures:
            engine.calls.append("pause failed")
            raise failures.pop()
        await pause(mode, clear_cache)

    engine.pause_generation = failing_once
    sink = _sink(engine, loop, model_dir, tmp_path)
    with pytest.raises(ValueError, match="pausing generation failed"):
        sink.apply(1, {"model.norm.weight": torch.full((4,), 2.0)})
    assert engine.calls == ["pause failed", "resume"]
    assert sink.state.broken is None and sink.state.last_error is not None
    sink.apply(2, {"model.norm.weight": torch.full((4,), 3.0)})  # the next update goes through
    assert sink.committed_version() == 2


def test_a_partial_fused_group_is_refused_before_any_engine_call(loop, model_dir, tmp_path):
    engine = RecordingEngine()
    sink = _sink(engine, loop, model_dir, tmp_path)
    sink._packed_modules = {"gate_up_proj": ["gate_proj", "up_proj"]}  # what the served model class declares
    with pytest.raises(ValueError, match="gate_proj"):
        sink.apply(1, {"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4)})
    assert engine.calls == [] and sink.state.last_error is not None and sink.committed_version() == 0


def test_a_refusal_by_the_worker_resumes_on_the_old_version(loop, model_dir, tmp_path):
    engine = RecordingEngine(fail_update=f"{REFUSED} update has q_proj but not k_proj")
    sink = _sink(engine, loop, model_dir, tmp_path)
    with pytest.raises(ValueError, match="k_proj"):
        sink.apply(1, STATE)
    assert engine.calls == ["pause:wait", "start", "update:1:full", "resume"]  # no finish: the worker closed it
    assert sink.committed_version() == 0 and sink.state.broken is None and sink.state.last_error is not None
    assert not os.listdir(tmp_path / "stage")


def test_a_failure_midway_stays_paused_marks_broken_and_exits(loop, model_dir, tmp_path):
    exits = []
    engine = RecordingEngine(fail_update="weight update did not load 2 parameter(s)")
    sink = _sink(engine, loop, model_dir, tmp_path, exit_process=lambda: exits.append(1))
    with pytest.raises(RuntimeError, match="failed midway"):
        sink.apply(1, STATE)
    assert "resume" not in engine.calls and exits == [1]
    assert sink.state.broken and sink.committed_version() == 0
    with pytest.raises(RuntimeError, match="restart it"):
        sink.apply(2, STATE)


def test_an_update_cut_by_the_servers_shutdown_says_so(loop, model_dir, tmp_path):
    # A push cut by SIGTERM was reported as "sink failed to apply: CancelledError: " (no reason).
    engine = RecordingEngine(drain_s=30.0)
    pause = engine.pause_generation

    async def shut_down_while_draining(mode: str = "abort", clear_cache: bool = True) -> None:
        for task in asyncio.all_tasks(loop):  # what the server's loop does to its tasks at shutdown
            loop.call_soon(task.cancel)
        await pause(mode, clear_cache)

    engine.pause_generation = shut_down_while_draining
    sink = _sink(engine, loop, model_dir, tmp_path)
    with pytest.raises(RuntimeError, match="was cut: the server is shutting down before serving it .it served version"):
        sink.apply(1, STATE)
    assert sink.committed_version() == 0 and not os.listdir(tmp_path / "stage")
    assert "was cut" in (sink.state.last_error or "")


def test_close_cuts_an_update_draining_into_a_stopped_engine_and_refuses_later_ones(loop, model_dir, tmp_path):
    """A SIGTERM while an update drained: the drain waited for an engine already gone up to ``drain_timeout_s`` (121 s
    measured), holding the Commit and the process. ``close`` (the plugin calls it as the engine shuts down) cuts it."""
    import time

    engine = RecordingEngine(drain_s=60.0)
    sink = _sink(engine, loop, model_dir, tmp_path, drain_timeout_s=120.0)
    outcome: list[BaseException] = []

    def push() -> None:
        try:
            sink.apply(1, STATE)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=push)
    thread.start()
    deadline = time.monotonic() + 10
    while "pause:wait" not in engine.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    sink.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert isinstance(outcome[0], RuntimeError) and "shutting down" in str(outcome[0]), outcome
    assert sink.committed_version() == 0 and not os.listdir(tmp_path / "stage")
    with pytest.raises(RuntimeError, match="version 2 was cut: the server is shutting down"):
        sink.apply(2, STATE)
    # Generation resumed as the cut update ended (a draining shutdown would wait on a paused engine); nothing of the
    # second update reached the engine.
    assert engine.calls == ["pause:wait", "resume"]


def test_a_broken_or_closing_server_refuses_begin_before_any_data(loop, model_dir, tmp_path):
    """A broken server took whole pushes (300 MB) and refused only at Commit, at every step of the trainer."""
    import grpc

    from protos import weight_sync_pb2 as pb
    from weight_sync.channel import WeightSyncClient
    from weight_sync.receiver import WeightReceiver
    from weight_sync.version import protocol_version

    sink = _sink(RecordingEngine(fail_update="worker 0 died"), loop, model_dir, tmp_path, exit_process=lambda: None)
    receiver = WeightReceiver(sink)
    receiver.start()
    client = WeightSyncClient(receiver.address, receiver.config)
    norm = pb.TensorSpec(name="model.norm.weight", shape=[4], dtype="float32")
    request = pb.BeginRequest(session_id="t", policy_version=1, num_ranks=1, protocol_version=protocol_version(),
                              tensors=[norm])  # fmt: skip
    try:
        assert client.begin(request).current_version == 0
        client.abort(pb.AbortRequest(session_id="t", policy_version=1, reason="test"))
        with pytest.raises(RuntimeError, match="failed midway"):
            sink.apply(1, {"model.norm.weight": torch.full((4,), 2.0)})
        with pytest.raises(grpc.RpcError) as refused:
            client.begin(request)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "this server stopped taking updates" in refused.value.details()
    finally:
        client.close()
        receiver.stop(grace_s=0)
    fresh = _sink(RecordingEngine(), loop, model_dir, tmp_path)
    fresh.close()
    assert fresh.unavailable() == "this server is shutting down; push to it again once it is back"


def test_the_plugin_stops_its_receiver_as_the_engine_shuts_down_and_fails_what_is_in_flight(loop):
    """vLLM's SIGTERM handler calls the engine client's ``shutdown`` first; the process exits only after the HTTP
    server waited for its open requests: the receiver must not stay open meanwhile, and a request the shutdown left
    waiting (its output task cancelled, not failed) must be answered, else the process stayed up for good."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from rollout.engine.vllm_plugin import _stop_with_engine

    calls: list[str] = []
    answered: list[BaseException] = []

    class Queue:
        def put(self, item):
            answered.append(item)

    class Client:
        def __init__(self):
            self.output_processor = types.SimpleNamespace(
                request_states={"r1": types.SimpleNamespace(queue=Queue())},
                propagate_error=lambda e: [s.queue.put(e) for s in self.output_processor.request_states.values()],
            )

        def shutdown(self, timeout: float | None = None) -> None:
            calls.append(f"engine shutdown {timeout}")

    client = Client()
    _stop_with_engine(client, lambda: calls.append("receiver stopped"), loop)
    client.shutdown(timeout=0)
    assert calls == ["receiver stopped", "engine shutdown 0"]
    done = threading.Event()
    loop.call_soon_threadsafe(done.set)  # after the propagation queued on the loop
    assert done.wait(5) and len(answered) == 1 and isinstance(answered[0], EngineDeadError)

    def failing_stop() -> None:
        raise OSError("already stopped")

    again = Client()
    _stop_with_engine(again, failing_stop, loop)
    again.shutdown()  # the engine's shutdown runs whatever the receiver's stop does
    assert calls[-1] == "engine shutdown None"


@pytest.mark.parametrize("policy", ["refuse", "abort"])
def test_a_drain_past_its_timeout_refuses_or_aborts(loop, model_dir, tmp_path, policy):
    engine = RecordingEngine(drain_s=5.0)
    sink = _sink(engine, loop, model_dir, tmp_path, drain_timeout_s=0.2, on_drain_timeout=policy)
    if policy == "refuse":
        with pytest.raises(TimeoutError, match="drain_timeout_s"):
            sink.apply(1, STATE)
        assert engine.calls == ["pause:wait", "resume"] and sink.committed_version() == 0
    else:
        running, queued = types.SimpleNamespace(weight_version_starts=[0]), types.SimpleNamespace()
        engine.output_processor.request_states.update({"a": running, "b": queued, "c": queued})
        sink.apply(1, STATE)
        assert engine.calls[:3] == ["pause:wait", "pause:abort", "start"] and sink.committed_version() == 1
        assert sink.state.num_aborted_requests == 3  # the queued ones too: vLLM's abort mode ends them all


def test_updates_that_do_not_fit_the_manifest_are_refused_before_any_call(loop, model_dir, tmp_path):
    engine = RecordingEngine()
    sink = _sink(engine, loop, model_dir, tmp_path)
    for update, match in [({"model.norm.weight": torch.ones(5)}, "expected"), ({"lm_head.weight": torch.ones(2)},
                          "manifest"), ({"model.norm.weight": torch.ones(4, dtype=torch.float16)}, "float16"),
                          ({}, "empty")]:
        with pytest.raises(ValueError, match=match):
            sink.apply(1, update)
    assert engine.calls == []


def test_update_files_of_servers_that_died_mid_update_are_removed_at_start(loop, model_dir, tmp_path):
    """A server SIGKILLed mid-update left its update file (the model's size, in memory under /dev/shm) for good."""
    import subprocess
    import sys

    stage = tmp_path / "stage"
    stage.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ns = os.stat("/proc/self/ns/pid").st_ino
    gone = stage / f"rl-align-{dead.stdout.strip()}-ns{ns}-v3-abc123.safetensors"
    live = stage / f"rl-align-{os.getpid()}-ns{ns}-v4-def456.safetensors"  # another server, still serving
    # Another container's (its own PID namespace, /dev/shm shared by --ipc=host): its pid means nothing here.
    elsewhere = stage / f"rl-align-{dead.stdout.strip()}-ns{ns + 1}-v5-aaa111.safetensors"
    other = stage / "someone-elses.safetensors"
    for path in (gone, live, elsewhere, other):
        path.write_bytes(b"x")
    _sink(RecordingEngine(), loop, model_dir, tmp_path)
    assert sorted(p.name for p in stage.iterdir()) == sorted([live.name, elsewhere.name, other.name])


def test_a_stage_dir_that_cannot_take_the_update_is_named(loop, model_dir, tmp_path):
    (tmp_path / "stage").write_text("a file, not a directory")
    engine = RecordingEngine()
    with pytest.raises(RuntimeError, match="stage_dir=.*shm-size"):
        _sink(engine, loop, model_dir, tmp_path).apply(1, STATE)
    assert engine.calls == []


def test_persisted_versions_are_what_a_restart_serves(loop, model_dir, tmp_path):
    persist = tmp_path / "live"
    sink = _sink(RecordingEngine(), loop, model_dir, tmp_path, persist_dir=str(persist))
    assert (persist / "config.json").exists() and sink.committed_version() == 0
    sink.apply(4, {"model.norm.weight": torch.full((4,), 7.0)})
    assert read_policy_version(str(persist)) == 4
    kept = load_file(str(persist / "model.safetensors"))
    assert torch.equal(kept["model.norm.weight"], torch.full((4,), 7.0)) and set(kept) == set(STATE)
    restarted = _sink(RecordingEngine(), loop, str(persist), tmp_path, persist_dir=str(persist))
    assert restarted.committed_version() == 4
    # A restart on the base model with the same persist_dir would report version 4 while serving version 0's weights.
    with pytest.raises(ValueError, match=r"holds version 4, but this server loads --model .* \(version 0\).*--model"):
        _sink(RecordingEngine(), loop, model_dir, tmp_path, persist_dir=str(persist))
    # A first start that died while seeding left only its staging folder: the next one seeds again.
    fresh = tmp_path / "fresh"
    (fresh / ".seeding").mkdir(parents=True)
    (fresh / ".seeding" / "model.safetensors").write_bytes(b"half a file")
    assert _sink(RecordingEngine(), loop, model_dir, tmp_path, persist_dir=str(fresh)).committed_version() == 0
    assert not (fresh / ".seeding").exists() and set(load_file(str(fresh / "model.safetensors"))) == set(STATE)
    other = tmp_path / "other_model"
    other.mkdir()
    save_file({"model.norm.weight": torch.ones(8)}, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="holds another model"):
        _sink(RecordingEngine(), loop, model_dir, tmp_path, persist_dir=str(other))


class Float32Engine(RecordingEngine):
    """A client of a server started with ``--dtype float32`` (vLLM's resolved ``model_config.dtype``)."""

    vllm_config = type("VllmConfig", (), {
        "model_config": type("ModelConfig", (), {"dtype": torch.float32, "architectures": ["Qwen3ForCausalLM"]})})


def test_a_float32_server_over_a_bfloat16_checkpoint_takes_serves_and_keeps_float32(loop, tmp_path):
    base = tmp_path / "bf16"
    base.mkdir()
    save_file({name: t.to(torch.bfloat16) for name, t in STATE.items()}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    persist = tmp_path / "live"
    engine = Float32Engine()
    sink = _sink(engine, loop, str(base), tmp_path, persist_dir=str(persist))
    assert {s.dtype for s in sink.manifest()} == {"float32"}  # what senders are told to send
    exact = torch.tensor([1.0 + 2**-20, 2.0, 3.0, 4.0])  # not a bfloat16 value
    sink.apply(1, {"model.norm.weight": exact})  # partial: the rest is rewritten from the bf16 file, as float32
    assert torch.equal(engine.staged["model.norm.weight"], exact)
    kept = load_file(str(persist / "model.safetensors"))
    assert torch.equal(kept["model.norm.weight"], exact) and {t.dtype for t in kept.values()} == {torch.float32}
    assert torch.equal(kept["model.layers.0.mlp.up_proj.weight"], STATE["model.layers.0.mlp.up_proj.weight"])
    assert _sink(Float32Engine(), loop, str(persist), tmp_path, persist_dir=str(persist)).committed_version() == 1
    with pytest.raises(ValueError, match=r"holds version 1, but this server loads --model"):
        _sink(Float32Engine(), loop, str(base), tmp_path, persist_dir=str(persist))
    with pytest.raises(ValueError, match="refused.*float32"):  # a sender that ignores the declaration
        sink.apply(2, {"model.norm.weight": exact.to(torch.bfloat16)})
    assert sink.committed_version() == 1


def test_the_plugin_config_reads_additional_config_then_the_environment(tmp_path):
    cfg = served_receiver_config({"port": 50051, "drain_timeout_s": 9, "max_watch_streams": 2}, {})
    assert cfg.weight_sync.port == 50051 and cfg.drain_timeout_s == 9 and cfg.weight_sync.max_watch_streams == 2
    env = {"RL_ALIGN_WEIGHT_SYNC_PORT": "50052", "RL_ALIGN_WEIGHT_SYNC_ON_DRAIN_TIMEOUT": "abort",
           "RL_ALIGN_WEIGHT_SYNC_TOKEN": "secret", "RL_ALIGN_WEIGHT_SYNC_BIND_HOST": "127.0.0.1"}
    cfg = served_receiver_config({"port": 50051}, env)
    assert cfg.weight_sync.port == 50052 and cfg.on_drain_timeout == "abort" and cfg.weight_sync.auth_token is None
    with pytest.raises(ValueError, match="auth_token"):
        served_receiver_config({"auth_token": "x"}, {})
    with pytest.raises(ConfigError, match=r"(?s)additional_config\['rl_align'\]: .*- prot: unknown key.*mean port\?"):
        served_receiver_config({"prot": 1}, {})
    # Misspelt variables are refused as misspelt keys are (they were ignored: the token's most of all).
    with pytest.raises(ConfigError, match=r"(?s)\$RL_ALIGN_WEIGHT_SYNC_PROT: invalid rl_align options.*mean port"):
        served_receiver_config({}, {"RL_ALIGN_WEIGHT_SYNC_PROT": "50051"})
    with pytest.raises(ValueError, match="RL_ALIGN_WEIGHT_SYNC_TOKEN"):
        served_receiver_config({}, {"RL_ALIGN_WEIGHT_SYNC_AUTH_TOKEN": "secret"})
    named = {"RL_ALIGN_WEIGHT_SYNC_AUTH_TOKEN_ENV": "RL_ALIGN_WEIGHT_SYNC_SECRET", "RL_ALIGN_WEIGHT_SYNC_SECRET": "s"}
    assert served_receiver_config({}, named).weight_sync.auth_token_env == "RL_ALIGN_WEIGHT_SYNC_SECRET"


def test_an_rl_align_section_without_the_backend_stops_the_server_at_start():
    """Pushes could never arrive: the server used to start healthy with no receiver and only a warning."""
    from types import SimpleNamespace

    from rollout.engine.vllm_plugin import RLAlignEndpointPlugin

    def engine(additional: dict) -> SimpleNamespace:
        return SimpleNamespace(vllm_config=SimpleNamespace(weight_transfer_config=None, additional_config=additional))

    plugin = RLAlignEndpointPlugin()
    with pytest.raises(ValueError, match="--weight-transfer-config"):
        asyncio.run(plugin.init_state(engine({"rl_align": {"port": 50051}}), SimpleNamespace(), SimpleNamespace()))
    asyncio.run(plugin.init_state(engine({}), SimpleNamespace(), SimpleNamespace()))  # no section: serve without one
    assert plugin.receiver is None


def test_the_plugin_is_installed_and_registers_its_backend():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout.engine.vllm_plugin import register

    assert entry_points(group="vllm.general_plugins")["rl_align"].value == "rollout.engine.vllm_plugin:register"
    endpoint = entry_points(group="vllm.endpoint_plugins")["rl_align"].load()()
    assert endpoint.name == "rl_align"
    register()
    register()  # idempotent: vLLM's registry raises on a second registration of a name
    assert "rl_align" in WeightTransferEngineFactory._registry



def test_a_lora_sink_stages_adapters_merged_into_the_base_and_keeps_the_served_adapter(loop, model_dir, tmp_path):
    """What reaches the workers is ``W + alpha/r B A`` of each adapted projection; a subset is merged over the
    served adapter; an incomplete first adapter is refused before any call; ``persist_dir`` with ``lora`` refused."""
    from weight_sync.peft import AdapterSpec, peft_name

    spec = AdapterSpec(rank=2, alpha=4.0, target_modules=("up_proj",))
    engine = RecordingEngine()
    sink = _sink(engine, loop, model_dir, tmp_path, lora=spec)
    module = "model.layers.0.mlp.up_proj"
    names = {part: peft_name(module, part) for part in ("lora_A", "lora_B")}
    assert {s.name for s in sink.manifest()} == set(STATE) | set(names.values())
    with pytest.raises(ValueError, match="push a complete adapter first"):
        sink.apply(1, {names["lora_A"]: torch.ones(2, 4)})
    assert engine.calls == []
    a, b = torch.randn(2, 4), torch.randn(8, 2)
    sink.apply(1, {names["lora_A"]: a, names["lora_B"]: b})
    assert "update:1:partial" in engine.calls and set(engine.staged) == {f"{module}.weight"}
    torch.testing.assert_close(engine.staged[f"{module}.weight"], STATE[f"{module}.weight"] + 2.0 * (b @ a))
    sink.apply(2, {names["lora_B"]: 2 * b})  # over the served A
    torch.testing.assert_close(engine.staged[f"{module}.weight"], STATE[f"{module}.weight"] + 4.0 * (b @ a))
    assert sink.committed_version() == 2
    with pytest.raises(ValueError, match="persist_dir with lora"):
        _sink(RecordingEngine(), loop, model_dir, tmp_path, lora=spec, persist_dir=str(tmp_path / "p"))
    with pytest.raises(ConfigError, match="persist_dir with lora"):
        served_receiver_config({"lora": {"rank": 2, "alpha": 4}, "persist_dir": "/x"}, {})
    lora = served_receiver_config({"lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj"]}}, {}).lora
    assert lora is not None and (lora.rank, lora.alpha) == (2, 4.0)
    # What the run's log prints for the trainer's [model.lora] (its dropout is not the plugin's) is taken as it is.
    trained = LoRAConfig(rank=32, alpha=64, dropout=0.1, target_modules=("q_proj", "v_proj"))
    printed = json.loads("{" + lora_option(trained) + "}")
    served = served_receiver_config(printed, {}).lora
    assert served == AdapterSpec(rank=32, alpha=64, target_modules=("q_proj", "v_proj"))
    # Regression: {"rank": 32} served adapters trained at alpha 64 at the default alpha 32 (half their scale).
    for given, missing in (({"rank": 32}, "alpha"), ({}, "rank, alpha"), ({"alpha": 64}, "rank")):
        with pytest.raises(ConfigError, match=f"lora needs the rank and alpha .*missing: {missing}"):
            served_receiver_config({"lora": given}, {})


_SERVER_WITH_A_WATCHER = """
import subprocess, sys, time
from safetensors.torch import save_file
import torch
from rollout.engine.vllm_plugin import _stop_at_shutdown
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.sink import SafetensorsDirSink

save_file({"w": torch.zeros(4)}, sys.argv[1] + "/model.safetensors")
receiver = WeightReceiver(SafetensorsDirSink(sys.argv[1]), WeightSyncConfig(watch_timeout_s=600))
receiver.start()
_stop_at_shutdown(receiver.stop)
watch = (
    "import sys; from protos import weight_sync_pb2 as pb; from weight_sync.channel import WeightSyncClient; "
    "from weight_sync.config import WeightSyncConfig; c = WeightSyncClient(sys.argv[1], WeightSyncConfig()); "
    "events = c.watch(pb.WatchVersionRequest(after_version=-1), timeout=600); next(events); "
    "print('watching', flush=True); list(events)"
)
watcher = subprocess.Popen([sys.executable, "-c", watch, receiver.address], stdout=subprocess.PIPE, text=True)
assert watcher.stdout.readline().startswith("watching")
time.sleep(1.0)  # the stream is open on a handler thread
print("returning", flush=True)
"""


def test_a_served_receiver_with_an_open_watch_stream_lets_the_process_exit(tmp_path):
    """The plugin stops its receiver before Python waits for the gRPC handler threads (at ``atexit`` it ran after that
    wait: a ``WatchVersion`` stream kept a SIGTERMed vLLM server alive, its port bound, until SIGKILL)."""
    import subprocess
    import sys
    import time

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _SERVER_WITH_A_WATCHER, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert done.returncode == 0 and "returning" in done.stdout, done.stderr[-3000:]
    assert time.monotonic() - start < 60, "the process waited for the watch stream"


def test_an_adapter_over_part_of_a_fused_group_passes_the_servers_fused_check(loop, tmp_path):
    """Adapters on q_proj and v_proj reach the workers merged, with k_proj's base weight beside them: the server's own
    fused-group check reads what the workers will load, not the adapter names (it refused every such push)."""
    from weight_sync.peft import AdapterSpec, peft_name

    model = tmp_path / "qkv"
    model.mkdir()
    state = {f"model.layers.0.self_attn.{p}.weight": torch.randn(4, 4) for p in ("q_proj", "k_proj", "v_proj")}
    save_file(state, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    engine = RecordingEngine()
    sink = _sink(engine, loop, str(model), tmp_path, lora=AdapterSpec(rank=2, alpha=4.0,
                                                                      target_modules=("q_proj", "v_proj")))
    sink._packed_modules = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # what Qwen 3's vLLM class declares
    push = {peft_name(f"model.layers.0.self_attn.{p}", part): torch.randn(*((2, 4) if part == "lora_A" else (4, 2)))
            for p in ("q_proj", "v_proj") for part in ("lora_A", "lora_B")}  # fmt: skip
    sink.apply(1, push)
    assert set(engine.staged) == set(state) and sink.committed_version() == 1


def test_a_partial_expert_layer_is_refused_before_any_engine_call(loop, tmp_path):
    """The experts of a layer load together (vLLM stacks them): some of them alone is refused in this process, as a
    partial fused group is, not by each worker (with tensor parallelism a worker's refusal answered the next call)."""
    model = tmp_path / "moe"
    model.mkdir()
    state = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": torch.zeros(4, 4) for e in range(2)
             for p in ("gate", "up", "down")}  # fmt: skip
    save_file(state, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    engine = RecordingEngine()
    sink = _sink(engine, loop, str(model), tmp_path)
    one_expert = {name: torch.ones(4, 4) for name in state if ".experts.0." in name}
    with pytest.raises(ValueError, match="3 of the 6 expert weights of model.layers.0.mlp.experts"):
        sink.apply(1, one_expert)
    assert engine.calls == [] and sink.state.last_error is not None
    sink.apply(1, {name: torch.ones(4, 4) for name in state})
    assert sink.committed_version() == 1
