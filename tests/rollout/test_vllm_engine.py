"""The vLLM engine adapter and its weight sink on a tiny Qwen3, checked against HF transformers (one engine per module).

Covers: on CPU the engine's RMSNorm runs on vLLM's C++ kernels (``rollout.engine.cpu_kernels``); log-probs of vLLM's own
samples equal a teacher-forced HF forward pass, and the trainer's own log-probs of them at temperatures other than 1
(training sees the distribution it sampled: float32 engine, processed log-probs, the first step's importance ratio 1;
the untempered computation is checked to be far off, so the test has teeth); an applied update serves the new weights
(HF parity) and differs from the old, by reference and through a file (the served engine's form); an update waits for
the running batch, or in mode "keep" moves it onto the new weights; refused updates change nothing; an engine shut down
leaves the next engine of the process working; requests of one prompt join into one vLLM request without changing any
seeded sample, and a cancelled or refused caller affects no other.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from tests.rollout.vllm_helpers import (
    as_declared,
    hf_greedy,
    hf_logprobs,
    hf_model,
    make_model,
    perturbed_state,
    push_through_receiver,
    trainer_logprobs,
)  # fmt: skip

pytest.importorskip("vllm")

from rollout.config import EngineConfig, SamplingConfig  # noqa: E402
from rollout.engine.sink import VLLMWeightSink  # noqa: E402
from rollout.engine.vllm_engine import VLLMEngine  # noqa: E402
from rollout.types import Sample  # noqa: E402
from weight_sync.config import WeightSyncConfig  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 200, 300, 301, 302], [9]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    config = EngineConfig(max_model_len=256, max_num_seqs=16, cpu_threads_bind="nobind", enforce_eager=True)
    engine = VLLMEngine(model_dir, config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sink(engine) -> VLLMWeightSink:
    return VLLMWeightSink(engine)


@pytest.fixture(scope="module")
def receiver(sink):
    from weight_sync.receiver import WeightReceiver

    receiver = WeightReceiver(sink, WeightSyncConfig())
    receiver.start()
    yield receiver
    receiver.stop()


def _push(receiver, policy_version: int, state: dict[str, torch.Tensor]) -> dict[str, str | None]:
    """Push ``state`` as whole-tensor shards through the real gRPC channel; return the commit outcome per receiver."""
    from weight_sync.sender import Shard, WeightSender

    with WeightSender([receiver.address], WeightSyncConfig()) as sender:
        shards = [Shard(name, t, tuple(t.shape), (0,) * t.dim()) for name, t in state.items()]
        report = sender.push(policy_version, shards)
        assert not report.failed, report.failed
        return sender.commit(policy_version)


def _sampled(engine: VLLMEngine) -> list:
    sampling = SamplingConfig(temperature=1.0, max_tokens=12, seed=0)
    return [group[0] for group in engine.generate(PROMPTS, sampling, n=1, seeds=[0, 1, 2, 3])]


def test_on_cpu_the_engine_runs_rmsnorm_on_vllms_kernels(engine):
    """The HF parity of every test here then covers them: the engine's norms all go through these kernels."""
    from vllm import ir

    from rollout.engine.cpu_kernels import PROVIDER
    from rollout.engine.platform import is_cpu_platform

    if not is_cpu_platform():
        pytest.skip("vLLM's CPU build only")
    assert ir.ops.rms_norm.get_priority()[0] == PROVIDER
    assert ir.ops.fused_add_rms_norm.get_priority()[0] == PROVIDER


def test_the_engine_reports_the_kv_block_size_vllm_settled(engine):
    from rollout.engine.platform import is_cpu_platform, platform_engine_args

    if not is_cpu_platform():
        pytest.skip("only the CPU platform sets the block size; elsewhere vLLM picks it")
    assert engine.block_size == platform_engine_args()["block_size"] == 32


def test_sampled_logprobs_match_hf_teacher_forcing(engine, model_dir):
    sampling = SamplingConfig(temperature=1.0, max_tokens=16, seed=7)
    groups = engine.generate(PROMPTS, sampling, n=3, seeds=[7, 8, 9, 10])
    ref = hf_model(model_dir)
    deltas = []
    for prompt, group in zip(PROMPTS, groups):
        assert len(group) == 3
        assert len({tuple(c.token_ids) for c in group}) > 1, "n samples of a prompt should differ at temperature 1"
        for c in group:
            assert c.policy_version == 0 and c.finish_reason in ("stop", "length")
            assert c.token_ids.dtype == np.int64 and c.logprobs.dtype == np.float32
            deltas.append(np.abs(c.logprobs - hf_logprobs(ref, prompt, c.token_ids)))
    assert float(np.concatenate(deltas).mean()) <= 1e-4
    again = engine.generate(PROMPTS, sampling, n=3, seeds=[7, 8, 9, 10])
    assert [[c.token_ids.tolist() for c in g] for g in again] == [[c.token_ids.tolist() for c in g] for g in groups]


def _added_requests(engine: VLLMEngine, monkeypatch) -> list[int]:
    """Record the ``n`` of every request the engine adds to vLLM from now on."""
    added: list[int] = []
    add = engine._engine.add_request

    def recording(request_id, prompt, params, *args, **kwargs):
        added.append(params.n)
        return add(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine._engine, "add_request", recording)
    return added


def test_requests_of_one_prompt_join_and_each_keeps_its_own_seed(engine, monkeypatch):
    """Callers of one prompt and sampling, added between two steps, run as one vLLM request; a seeded caller gets
    exactly the completion it gets alone (vLLM seeds child i with seed + i), so joining never changes a sample."""
    import asyncio

    sampling = SamplingConfig(temperature=1.0, max_tokens=12, seed=0)
    seeds = [50, 51, 52, 53, 60, 61]  # two runs of consecutive seeds
    alone = [engine.generate([PROMPTS[0]], sampling, 1, seeds=[s])[0][0] for s in seeds]
    added = _added_requests(engine, monkeypatch)

    async def together():
        return await asyncio.gather(*(engine.generate_async(PROMPTS[0], sampling, 1, s) for s in seeds))

    joined = [out[0] for out in engine.run(together())]
    assert sorted(added) == [2, 4]
    for a, b in zip(alone, joined, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len({tuple(c.token_ids) for c in joined}) > 1

    added.clear()
    unseeded = SamplingConfig(temperature=1.0, max_tokens=12)

    async def mixed():
        return await asyncio.gather(
            *(engine.generate_async(PROMPTS[0], unseeded, 2) for _ in range(3)),
            engine.generate_async(PROMPTS[1], unseeded, 1),
        )  # fmt: skip

    outs = engine.run(mixed())
    assert sorted(added) == [1, 6] and [len(o) for o in outs] == [2, 2, 2, 1]


def test_greedy_callers_of_one_prompt_share_one_completion_each_gets_a_copy(engine, monkeypatch):
    """vLLM refuses n > 1 at temperature 0: two held-out problems of the same text failed the run's evaluation."""
    import asyncio

    greedy = SamplingConfig(temperature=0.0, max_tokens=8)
    alone = engine.generate([PROMPTS[0]], greedy, 1)[0][0]
    added = _added_requests(engine, monkeypatch)
    seen: dict[int, list[int]] = {}

    async def together():
        return await asyncio.gather(
            engine.generate_async(PROMPTS[0], greedy, 1), engine.generate_async(PROMPTS[0], greedy, 2, 5),
            engine.generate_async(PROMPTS[0], greedy, 2, on_tokens=lambda i, ids: seen.__setitem__(i, list(ids))),
        )  # fmt: skip

    outs = engine.run(together())
    assert sorted(added) == [1, 1] and [len(o) for o in outs] == [1, 2, 2]  # the streamed one is its own request
    for completion in (c for out in outs for c in out):
        assert completion.token_ids.tolist() == alone.token_ids.tolist()
        np.testing.assert_allclose(completion.logprobs, alone.logprobs, atol=1e-5)
    assert outs[1][0] is not outs[1][1] and seen == {0: alone.token_ids.tolist(), 1: alone.token_ids.tolist()}


def test_a_streamed_request_reports_its_choices_as_they_grow_and_ends_as_an_unstreamed_one(engine, monkeypatch):
    """``on_tokens`` sees each choice's ids grow step by step up to the final completion, which is token for token
    what the same seeded request gives unstreamed; a streamed request joins no other caller."""
    import asyncio

    sampling = SamplingConfig(temperature=1.0, max_tokens=10, seed=0, ignore_eos=True)
    unstreamed = engine.generate([PROMPTS[0]], sampling, 3, seeds=[70])[0]
    added = _added_requests(engine, monkeypatch)
    seen: dict[int, list[list[int]]] = {}

    def on_tokens(choice, ids):
        seen.setdefault(choice, []).append(list(ids))

    async def streamed_beside_another():
        return await asyncio.gather(engine.generate_async(PROMPTS[0], sampling, 3, 70, on_tokens=on_tokens),
                                    engine.generate_async(PROMPTS[0], sampling, 1, 73))  # fmt: skip

    streamed, _ = engine.run(streamed_beside_another())
    assert sorted(added) == [1, 3]  # the next seed in the run, but not joined to the streamed request
    assert sorted(seen) == [0, 1, 2]
    for a, b, growth in zip(unstreamed, streamed, (seen[j] for j in range(3)), strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert [len(ids) for ids in growth] == list(range(1, 11)) and growth[-1] == b.token_ids.tolist()


def test_a_cancelled_caller_leaves_the_others_of_its_request(engine):
    import asyncio

    sampling = SamplingConfig(temperature=1.0, max_tokens=40, ignore_eos=True)

    async def one_cancelled():
        tasks = [asyncio.ensure_future(engine.generate_async(PROMPTS[2], sampling)) for _ in range(4)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the request is in vLLM now
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outs = engine.run(one_cancelled())
    assert isinstance(outs[1], asyncio.CancelledError)
    assert all(len(o[0].token_ids) == 40 for i, o in enumerate(outs) if i != 1)

    async def all_cancelled():
        tasks = [asyncio.ensure_future(engine.generate_async(PROMPTS[2], sampling)) for _ in range(3)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return engine._engine.has_unfinished_requests()

    assert engine.run(all_cancelled()) is False  # nobody waits: the request was aborted
    assert len(engine.generate(PROMPTS[:1], GREEDY, 1)[0][0].token_ids) == GREEDY.max_tokens


def test_a_prompt_the_engine_refuses_fails_only_its_callers(engine):
    import asyncio

    sampling = SamplingConfig(temperature=1.0, max_tokens=8)
    too_long = list(range(5, 5 + 300))  # the engine's context is 256 tokens

    async def batch():
        return await asyncio.gather(
            *(engine.generate_async(too_long, sampling) for _ in range(2)),
            *(engine.generate_async(PROMPTS[1], sampling) for _ in range(2)),
            return_exceptions=True,
        )  # fmt: skip

    outs = engine.run(batch())
    assert all(isinstance(o, Exception) and "maximum context length" in str(o) for o in outs[:2]), outs[:2]
    assert all(isinstance(o, list) and len(o) == 1 for o in outs[2:])


def _trainer_logprobs(model_dir: str, samples: list[Sample], temperatures: list[float]) -> list[np.ndarray]:
    return trainer_logprobs(model_dir, [Sample(**{**vars(s), "temperature": t}) for s, t in zip(samples, temperatures)])


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_trainer_logprobs_equal_the_engines_at_the_sampling_temperature(engine, model_dir, temperature):
    sampling = SamplingConfig(temperature=temperature, max_tokens=24, ignore_eos=True, seed=3)
    groups = engine.generate(PROMPTS, sampling, n=2, seeds=[3, 4, 5, 6])
    samples = [
        Sample(np.asarray(p, np.int64), c.token_ids, c.logprobs, reward=0.0, group_id=g, policy_version=0,
               temperature=temperature)
        for g, (p, group) in enumerate(zip(PROMPTS, groups)) for c in group
    ]  # fmt: skip
    rollout = np.concatenate([s.rollout_logprobs for s in samples])
    tempered = np.concatenate(_trainer_logprobs(model_dir, samples, [temperature] * len(samples)))
    untempered = np.concatenate(_trainer_logprobs(model_dir, samples, [1.0] * len(samples)))
    gap = np.abs(tempered - rollout)
    assert gap.mean() <= 1e-5 and gap.max() <= 1e-4, (gap.mean(), gap.max())
    assert np.abs(untempered - rollout).mean() > 100 * max(gap.mean(), 1e-6)  # the check has teeth
    # The first step's importance ratio exp(old - rollout) is 1 within float32 rounding.
    assert np.abs(np.exp(tempered - rollout).mean() - 1.0) <= 1e-4


def test_push_through_grpc_serves_new_weights_and_matches_hf(engine, sink, receiver, model_dir):
    before = _sampled(engine)
    state = perturbed_state(model_dir)
    assert _push(receiver, 1, state) == {receiver.address: None}
    assert engine.policy_version == 1 and receiver.policy_version == 1
    after = _sampled(engine)
    assert [c.token_ids.tolist() for c in after] != [c.token_ids.tolist() for c in before]
    ref = hf_model(model_dir, state)
    for prompt, c in zip(PROMPTS, after):
        assert c.policy_version == 1
        assert np.abs(c.logprobs - hf_logprobs(ref, prompt, c.token_ids)).mean() <= 1e-4
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, GREEDY, n=1)):
        assert group[0].token_ids.tolist() == hf_greedy(ref, prompt, GREEDY.max_tokens)


def test_update_waits_for_the_running_batch(engine, sink, model_dir):
    import asyncio

    long = SamplingConfig(temperature=1.0, max_tokens=200, ignore_eos=True, seed=3)
    state = perturbed_state(model_dir, seed=2)
    version = engine.policy_version
    finished: list[float] = []

    async def one(prompt):
        out = await engine.generate_async(prompt, long, 4, 3)
        finished.append(time.perf_counter())  # woken before an update waiting for the drain can run
        return out

    async def batch():
        return await asyncio.gather(*(one(p) for p in PROMPTS * 4))

    running = engine.submit(batch())
    time.sleep(0.5)  # the batch's requests are in flight by now (they run for seconds)
    sink.apply(version + 1, state)
    applied = time.perf_counter()
    result = running.result()
    assert len(finished) == len(PROMPTS) * 4 and max(finished) <= applied
    assert all(c.policy_version == version for group in result for c in group)
    assert all(len(c.token_ids) == 200 for group in result for c in group)
    assert engine.generate(PROMPTS[:1], GREEDY, n=1)[0][0].policy_version == version + 1


def test_an_update_in_keep_mode_moves_requests_in_flight_onto_the_new_weights(engine, model_dir, monkeypatch):
    """Mode "keep": the swap does not wait for the request in flight; its tokens after the swap are sampled by the
    new weights with its KV recomputed on them (teacher forcing of the new weights over the whole sequence matches),
    the tokens before keep the old weights' log-probs, and each token's version is recorded."""
    version = engine.policy_version
    engine.load_weights(version + 1, perturbed_state(model_dir, scale=0.0), full=True)  # the checkpoint itself
    new_state = perturbed_state(model_dir, seed=4)
    step = engine._engine.step

    def slow_step():  # 160 tokens take >= 1.6 s, so the request is in flight when the update comes
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine._engine, "step", slow_step)
    sampling = SamplingConfig(temperature=1.0, max_tokens=160, ignore_eos=True, seed=3)
    running = engine.submit(engine.generate_async(PROMPTS[0], sampling, 1, 3))
    time.sleep(0.4)
    engine.load_weights(version + 2, new_state, full=True, mode="keep")
    assert not running.done()  # the update did not wait for it
    [c] = running.result()
    monkeypatch.undo()
    assert c.policy_version == version + 1 and c.token_versions is not None
    split = int(np.argmax(c.token_versions == version + 2))
    assert 0 < split < 160, split
    assert set(c.token_versions[:split].tolist()) == {version + 1}
    assert set(c.token_versions[split:].tolist()) == {version + 2}
    old = hf_logprobs(hf_model(model_dir), PROMPTS[0], c.token_ids)
    new = hf_logprobs(hf_model(model_dir, new_state), PROMPTS[0], c.token_ids)
    assert float(np.abs(c.logprobs[:split] - old[:split]).mean()) <= 1e-4
    assert float(np.abs(c.logprobs[split:] - new[split:]).mean()) <= 1e-4
    assert float(np.abs(c.logprobs[split:] - old[split:]).mean()) > 1e-2  # the two versions are told apart


def test_refused_updates_leave_outputs_unchanged(engine, sink, receiver, model_dir):
    before, version = [c.token_ids.tolist() for c in _sampled(engine)], engine.policy_version
    state = perturbed_state(model_dir, seed=5)
    bad_shape = {"model.norm.weight": torch.ones(3)}
    unknown = {"model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}
    q_only = {"model.layers.0.self_attn.q_proj.weight": state["model.layers.0.self_attn.q_proj.weight"]}
    gate_only = {"model.layers.1.mlp.gate_proj.weight": state["model.layers.1.mlp.gate_proj.weight"]}
    for update, match in [(bad_shape, "expected"), (unknown, "manifest"), (q_only, "fused"), (gate_only, "fused")]:
        with pytest.raises(ValueError, match=match):
            sink.apply(version + 1, update)
    received = receiver.policy_version
    outcome = _push(receiver, version + 1, q_only)  # the same refusal through gRPC: the receiver keeps its version
    assert "fused" in (outcome[receiver.address] or "") and receiver.policy_version == received
    assert engine.policy_version == version and engine.broken is None
    assert [c.token_ids.tolist() for c in _sampled(engine)] == before


def test_an_update_through_a_file_serves_the_same_as_by_reference(engine, sink, model_dir):
    """The file form of the rl_align backend (tensor parallel, or an engine core in another process; the form a
    served engine takes) loads what the in-process form loads, and vLLM labels completions with the version."""
    state = perturbed_state(model_dir, seed=11)
    version = engine.policy_version + 1
    engine._by_reference = False  # the form is chosen at start from the engine's layout; force the other one here
    try:
        sink.apply(version, state)
    finally:
        engine._by_reference = True
    assert engine._llm.get_weight_version() == str(version)
    ref = hf_model(model_dir, state)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, GREEDY, n=1)):
        assert group[0].policy_version == version
        assert group[0].token_ids.tolist() == hf_greedy(ref, prompt, GREEDY.max_tokens)
        assert np.abs(group[0].logprobs - hf_logprobs(ref, prompt, group[0].token_ids)).mean() <= 1e-4


def test_an_update_logs_no_warning_for_the_layers_it_did_not_cover(engine, sink, model_dir):
    """vLLM's reload warned "<Layer>: Failed to load weights" for every layer a partial update left alone (19 per
    push of one norm here), and for the tied head and the rotary cache on every full one."""
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    vllm_logger = logging.getLogger("vllm")  # vLLM's loggers hand records to its own handler, not to the root
    vllm_logger.addHandler(handler)
    try:
        state = perturbed_state(model_dir, seed=21)
        version = engine.policy_version
        sink.apply(version + 1, state)
        sink.apply(version + 2, {"model.norm.weight": state["model.norm.weight"]})
    finally:
        vllm_logger.removeHandler(handler)
    assert engine.policy_version == version + 2
    assert not [w for w in warnings if "load weights" in w], warnings


def test_a_shut_down_engine_leaves_the_next_one_working(engine, receiver, model_dir):
    """Last to use the module's engine: it shuts it down. vLLM's parallel groups are process-global; an engine
    released only by the garbage collector tore them down under the next engine of the process."""
    import gc

    receiver.stop()
    engine.shutdown()
    engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(PROMPTS[:1], GREEDY, n=1)
    config = EngineConfig(max_model_len=256, max_num_seqs=16, cpu_threads_bind="nobind", enforce_eager=True)
    successor = VLLMEngine(model_dir, config)
    try:
        gc.collect()
        [[completion]] = successor.generate(PROMPTS[:1], GREEDY, n=1)
        assert len(completion.token_ids) == GREEDY.max_tokens
    finally:
        successor.shutdown()


def test_a_float32_engine_on_a_bfloat16_checkpoint_serves_pushed_float32_weights_unrounded(tmp_path):
    """Regression: the sink declared the checkpoint file's dtypes, so the trainer's float32 weights went out rounded
    to bfloat16 and a float32 engine served those (train/logprob_gap 5e-7 -> 8e-3 after the first push). The engine
    holds its checkpoint in its own dtype; the push is declared and served in it. After the module's engine is shut
    down (one engine per process at a time)."""
    model_dir = make_model(tmp_path / "bf16", dtype="bfloat16")
    gen = torch.Generator().manual_seed(31)
    state = {name: t.float() + 0.05 * torch.randn(t.shape, generator=gen)  # float32, most not bfloat16-representable
             for name, t in perturbed_state(model_dir, scale=0.0).items()}  # fmt: skip
    config = EngineConfig(dtype="float32", max_model_len=128, max_num_seqs=4, cpu_threads_bind="nobind",
                          kv_cache_gib=0.25, enforce_eager=True)  # fmt: skip
    engine = VLLMEngine(model_dir, config)
    try:
        sink = VLLMWeightSink(engine)
        push_through_receiver(sink, 1, as_declared(sink, state))
        served = [group[0] for group in engine.generate(PROMPTS, GREEDY, n=1)]
    finally:
        engine.shutdown()
    exact, rounded = hf_model(model_dir, state), hf_model(model_dir, {n: t.bfloat16() for n, t in state.items()})
    gaps = {ref: float(np.concatenate([np.abs(c.logprobs - hf_logprobs(model, p, c.token_ids))
                                       for p, c in zip(PROMPTS, served)]).mean())  # fmt: skip
            for ref, model in (("float32", exact), ("bfloat16", rounded))}
    assert all(c.policy_version == 1 for c in served)
    assert gaps["float32"] <= 1e-5, gaps
    assert gaps["bfloat16"] > 10 * max(gaps["float32"], 1e-6), gaps  # the rounding shows: the check has teeth
