"""An engine serving LoRA adapters (``EngineConfig.lora``) on a tiny Qwen3, checked against PEFT on transformers,
through vLLM's LoRA path ("adapter") and merged into the base weights ("merged").

Covers: a pushed adapter (through the real gRPC receiver) is served with log-probs equal to PEFT's teacher forcing and
different from the base; requests in flight at an update finish on the version they started on (through vLLM's LoRA
path the update returns while they run), new ones run the new one; refused adapters (another base's shapes, a partial
first adapter, unknown or mis-shaped tensors) leave the engine on its adapter; a subset updates the served adapter; a
version that carries base tensors (the base trained) serves its adapter over the new base, and later adapter-only
versions keep that base; retired adapters leave vLLM; a float32 engine over a bfloat16 base serves float32 adapters
as pushed, not rounded to the file's dtype.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from tests.rollout.vllm_helpers import (
    as_declared,
    hf_logprobs,
    hf_model,
    make_model,
    perturbed_state,
    push_through_receiver,
)  # fmt: skip

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

from rollout.config import EngineConfig, SamplingConfig  # noqa: E402
from rollout.engine.sink import VLLMWeightSink  # noqa: E402
from rollout.engine.vllm_engine import VLLMEngine  # noqa: E402
from weight_sync.checkpoint import read_checkpoint_manifest  # noqa: E402
from weight_sync.peft import AdapterSpec, adapter_manifest, write_peft_adapter  # noqa: E402

SPEC = AdapterSpec(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 200, 300, 301, 302], [9]]
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=12, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["adapter", "merged"])
def engine(model_dir, request):
    config = EngineConfig(max_model_len=256, max_num_seqs=16, cpu_threads_bind="nobind", enforce_eager=True, lora=SPEC,
                          lora_serving=request.param)  # fmt: skip
    engine = VLLMEngine(model_dir, config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sink(engine) -> VLLMWeightSink:
    return VLLMWeightSink(engine)


def _adapter(sink: VLLMWeightSink, seed: int) -> dict[str, torch.Tensor]:
    """Random adapter tensors of the sink's manifest (B != 0, so the adapter changes the model)."""
    gen = torch.Generator().manual_seed(seed)
    specs = [s for s in sink.manifest() if s.name.startswith("base_model.model.")]
    assert specs and len(specs) == len(adapter_manifest(read_checkpoint_manifest(sink._engine.model_path), SPEC))
    return {s.name: torch.randn(s.shape, generator=gen) * 0.3 for s in specs}


def _peft_model(model_dir: str, tensors: dict[str, torch.Tensor], tmp_path, base_state=None):
    """PEFT with ``tensors`` on the HF model of ``model_dir`` (with ``base_state`` loaded over it, if given)."""
    write_peft_adapter(tmp_path, tensors, SPEC, model_dir)
    return peft.PeftModel.from_pretrained(hf_model(model_dir, base_state), str(tmp_path)).eval()


def _sampled(engine: VLLMEngine) -> list:
    return [group[0] for group in engine.generate(PROMPTS, SAMPLING, n=1, seeds=[0, 1, 2, 3])]


def _gap(model, completions) -> float:
    return float(np.concatenate([
        np.abs(c.logprobs - hf_logprobs(model, p, c.token_ids)) for p, c in zip(PROMPTS, completions)
    ]).mean())  # fmt: skip


def test_a_pushed_adapter_is_served_with_pefts_logprobs(engine, sink, model_dir, tmp_path):
    base = _sampled(engine)
    assert {c.policy_version for c in base} == {engine.policy_version}
    tensors = _adapter(sink, seed=1)
    version = engine.policy_version + 1
    push_through_receiver(sink, version, tensors)
    served = _sampled(engine)
    assert {c.policy_version for c in served} == {version}
    reference = _peft_model(model_dir, tensors, tmp_path)
    assert _gap(reference, served) <= 1e-4
    with reference.disable_adapter():
        assert _gap(reference, served) > 1e-2  # the served adapter is not the base
        assert _gap(reference, base) <= 1e-4  # before the first adapter the engine served the base


def test_requests_in_flight_finish_on_their_adapter_while_new_ones_get_the_next(engine, sink, model_dir, tmp_path):
    sink.apply(engine.policy_version + 1, _adapter(sink, seed=2))
    old_version = engine.policy_version
    long = SamplingConfig(temperature=1.0, max_tokens=150, ignore_eos=True, seed=3)

    async def batch():
        return await asyncio.gather(*(engine.generate_async(p, long, 1, 3) for p in PROMPTS))

    running = engine.submit(batch())
    deadline = time.monotonic() + 30
    while not engine._waiting:  # the requests are in vLLM (a fixed sleep was not enough on a busy machine)
        assert time.monotonic() < deadline, "the requests never reached vLLM"
        time.sleep(0.01)
    new = _adapter(sink, seed=3)
    sink.apply(old_version + 1, new)
    if engine.config.lora_serving == "adapter":  # vLLM's LoRA path does not wait for the requests in flight
        assert not running.done()
    # Merged is a weight update in "wait" mode: the requests finish on the old weights first (the versions below).
    after = _sampled(engine)
    old_outputs = [group[0] for group in running.result(timeout=60)]
    assert {c.policy_version for c in old_outputs} == {old_version}
    assert {c.policy_version for c in after} == {old_version + 1}
    assert _gap(_peft_model(model_dir, new, tmp_path / "new"), after) <= 1e-4
    # Every token of the long completions came from the adapter they started on (no mix of versions).
    old_adapter = _peft_model(model_dir, _adapter(sink, seed=2), tmp_path / "old")
    gaps = [np.abs(c.logprobs - hf_logprobs(old_adapter, p, c.token_ids)) for p, c in zip(PROMPTS, old_outputs)]
    assert float(np.concatenate(gaps).max()) <= 1e-3
    if engine.config.lora_serving == "adapter":
        assert engine._adapters.loaded() == 1, "the retired adapter should have left vLLM"


def test_refused_adapters_leave_the_engine_on_its_adapter(engine, sink, model_dir):
    version, before = engine.policy_version, _sampled(engine)
    good = _adapter(sink, seed=4)
    name = next(iter(good))
    other_base = {**good, name: torch.zeros(good[name].shape[0] + 1, *good[name].shape[1:])}
    with pytest.raises(ValueError, match=r"expected"):
        sink.apply(version + 1, other_base)
    with pytest.raises(ValueError, match="not in the model's manifest"):
        sink.apply(version + 1, {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 64)})
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: got \(3, 3\)"):
        sink.apply(version + 1, {**good, "model.embed_tokens.weight": torch.zeros(3, 3)})
    assert engine.policy_version == version
    assert [c.token_ids.tolist() for c in _sampled(engine)] == [c.token_ids.tolist() for c in before]
    # A subset of the served adapter updates just those tensors.
    sink.apply(version + 1, {name: good[name]})
    assert engine.policy_version == version + 1


def test_a_version_with_base_tensors_serves_its_adapter_over_the_new_base(engine, sink, model_dir, tmp_path):
    """A base that trained (a warm start of every weight) comes with the adapter once; later versions keep it."""
    base = perturbed_state(model_dir, scale=0.3, seed=5)
    first, second = _adapter(sink, seed=6), _adapter(sink, seed=7)
    version = engine.policy_version + 1
    sink.apply(version, {**base, **first})
    assert _gap(_peft_model(model_dir, first, tmp_path / "first", base), _sampled(engine)) <= 1e-4
    sink.apply(version + 1, second)
    served = _sampled(engine)
    assert {c.policy_version for c in served} == {version + 1}
    assert _gap(_peft_model(model_dir, second, tmp_path / "second", base), served) <= 1e-4
    assert _gap(_peft_model(model_dir, second, tmp_path / "old_base"), served) > 1e-2


def test_a_first_adapter_must_be_complete(engine, model_dir):
    engine.shutdown()  # one engine per process at a time (vLLM's model-parallel groups are process-global)
    config = engine.config.model_copy(update={"max_model_len": 128, "max_num_seqs": 4})
    engine = VLLMEngine(model_dir, config)
    try:
        sink = VLLMWeightSink(engine)
        tensors = _adapter(sink, seed=5)
        with pytest.raises(ValueError, match="missing and no earlier version"):
            sink.apply(1, dict(list(tensors.items())[:2]))
        assert engine.policy_version == 0
        sink.apply(1, tensors)
        assert engine.policy_version == 1
    finally:
        engine.shutdown()


def test_a_float32_engine_on_a_bfloat16_base_serves_pushed_float32_adapters_unrounded(engine, tmp_path):
    """Regression: adapters were declared in the bfloat16 file's dtype (and merged into the file's bfloat16 weights),
    so a float32 engine served bfloat16-rounded ones (train/logprob_gap 5e-7 -> 1e-3 after the first LoRA push). The
    engine holds its base in its own dtype, and adapters are declared and served in it. Shuts the module's engine
    down (one engine per process at a time)."""
    engine.shutdown()
    model_dir = make_model(tmp_path / "bf16", dtype="bfloat16")
    config = engine.config.model_copy(update={"dtype": "float32", "max_model_len": 128, "max_num_seqs": 4})
    engine = VLLMEngine(model_dir, config)
    try:
        sink = VLLMWeightSink(engine)
        tensors = _adapter(sink, seed=8)  # float32, most not bfloat16-representable
        push_through_receiver(sink, 1, as_declared(sink, tensors))
        served = _sampled(engine)
    finally:
        engine.shutdown()
    exact = _gap(_peft_model(model_dir, tensors, tmp_path / "exact"), served)
    rounded = _gap(_peft_model(model_dir, {n: t.bfloat16() for n, t in tensors.items()}, tmp_path / "rounded"), served)
    assert {c.policy_version for c in served} == {1}
    assert exact <= 1e-5, (exact, rounded)
    assert rounded > 10 * max(exact, 1e-6), (exact, rounded)  # the rounding shows: the check has teeth
