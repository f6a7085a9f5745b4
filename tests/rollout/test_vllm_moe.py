"""Engines serving a tiny Qwen3-MoE: pushed expert weights are what the engine computes with (against transformers
on the same weights), an update with part of a layer's experts is refused, and LoRA adapters on every expert
(``target_parameters``) and on attention, merged into the base weights (the CPU serving mode), are served as PEFT
computes them.

vLLM's CPU backend runs MoE in bfloat16 only, so the engine's log-probs are compared at bfloat16 tolerance (as
tests/trainer/models/test_vllm_load.py does for the base model) and against a gap to the reference without the
change an order larger.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.rollout.vllm_helpers import TINY_ARCH, hf_logprobs, hf_model, push_through_receiver

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

from rollout.config import EngineConfig, SamplingConfig  # noqa: E402
from rollout.engine.sink import VLLMWeightSink  # noqa: E402
from rollout.engine.vllm_engine import VLLMEngine  # noqa: E402
from weight_sync.peft import EXPERT_TARGETS, AdapterSpec, write_peft_adapter  # noqa: E402

SPEC = AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "o_proj"), target_parameters=EXPERT_TARGETS)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 200, 300, 301, 302], [9]]
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=12, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tools.make_tiny_model import make_tiny_model

    arch = {**TINY_ARCH, "num_experts": 4, "top_k": 2, "moe_intermediate_size": 32}
    return str(make_tiny_model(tmp_path_factory.mktemp("moe"), family="qwen3_moe", dtype="bfloat16", **arch))


def _engine(model_dir: str, lora: AdapterSpec | None) -> VLLMEngine:
    config = EngineConfig(max_model_len=256, max_num_seqs=8, cpu_threads_bind="nobind", enforce_eager=True,
                          dtype="bfloat16", kv_cache_gib=0.25, lora=lora, lora_serving="merged")  # fmt: skip
    return VLLMEngine(model_dir, config)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = _engine(model_dir, SPEC)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def plain_engine(model_dir):
    engine = _engine(model_dir, None)
    yield engine
    engine.shutdown()


def _sampled(engine: VLLMEngine) -> list:
    return [group[0] for group in engine.generate(PROMPTS, SAMPLING, n=1, seeds=[0, 1, 2, 3])]


def _hf_with(model_dir: str, state: dict[str, torch.Tensor], out: Path):
    """transformers' model of ``model_dir`` with ``state`` (checkpoint names: experts one by one) written over it,
    loaded from disk, so transformers fuses the experts as it does for any checkpoint."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    for file in out.glob("*.safetensors*"):
        file.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({n: t.contiguous() for n, t in state.items()}, str(out / "model.safetensors"))
    return hf_model(str(out))


def test_pushed_expert_weights_are_the_ones_the_engine_computes_with(plain_engine, model_dir, tmp_path):
    """vLLM prepacks CPU expert weights at load only; after a reload the engine must not read the new weights in the
    old layout (``rollout.engine.transfer._repack_cpu_experts``)."""
    from weight_sync.checkpoint import checkpoint_shards

    sink = VLLMWeightSink(plain_engine)
    base = {s.name: s.tensor for s in checkpoint_shards(model_dir)}
    gen = torch.Generator().manual_seed(0)
    experts = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype)
               for n, t in base.items() if ".mlp.experts." in n}  # fmt: skip
    sink.apply(plain_engine.policy_version + 1, experts)
    served = _sampled(plain_engine)
    gap = _gaps(_hf_with(model_dir, {**base, **experts}, tmp_path / "pushed"), served)
    old_gap = _gaps(hf_model(model_dir), served)
    assert np.median(gap) < 0.02 and gap.max() < 0.3, gap
    assert np.median(old_gap) > 10 * max(np.median(gap), 1e-3), (gap, old_gap)
    # Some of a layer's experts alone would leave the rest of the layer uninitialised: refused, nothing changes.
    version = plain_engine.policy_version
    partial = {n: t for n, t in experts.items() if ".layers.0.mlp.experts.0." in n}
    with pytest.raises(ValueError, match="3 of the 12 expert weights"):
        sink.apply(version + 1, partial)
    assert plain_engine.policy_version == version
    again = _sampled(plain_engine)
    assert [list(c.token_ids) for c in again] == [list(c.token_ids) for c in served]


def _adapter(sink: VLLMWeightSink, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    specs = [s for s in sink.manifest() if s.name.startswith("base_model.model.")]
    return {s.name: (torch.randn(s.shape, generator=gen) * 0.3).to(torch.bfloat16) for s in specs}


def _gaps(model, completions) -> np.ndarray:
    return np.concatenate([
        np.abs(c.logprobs - hf_logprobs(model, p, c.token_ids)) for p, c in zip(PROMPTS, completions)
    ])  # fmt: skip


def test_expert_adapters_pushed_to_a_merged_engine_are_served_as_peft_computes_them(engine, model_dir, tmp_path):
    sink = VLLMWeightSink(engine)
    tensors = _adapter(sink, seed=1)
    names = sorted(tensors)
    experts = "base_model.model.model.layers.0.mlp.experts"
    assert f"{experts}.base_layer.lora_A.weight" in names and f"{experts}.lora_B.weight" in names
    assert tensors[f"{experts}.base_layer.lora_B.weight"].shape == (2 * 32, 4 * SPEC.rank)  # [2I, r E]
    version = engine.policy_version + 1
    push_through_receiver(sink, version, tensors)
    served = _sampled(engine)
    assert {c.policy_version for c in served} == {version}
    write_peft_adapter(tmp_path, {n: t.float() for n, t in tensors.items()}, SPEC, model_dir)
    reference = peft.PeftModel.from_pretrained(hf_model(model_dir), str(tmp_path)).eval()
    gap = _gaps(reference, served)
    with reference.disable_adapter():
        base_gap = _gaps(reference, served)
    assert np.median(gap) < 0.02 and gap.max() < 0.3, gap
    assert np.median(base_gap) > 10 * max(np.median(gap), 1e-3), (gap, base_gap)


def test_an_update_of_the_down_adapters_alone_keeps_the_served_gate_up_ones(engine):
    """A subset push merges over the served adapter; the engine's weights then equal a full push of the union."""
    sink = VLLMWeightSink(engine)
    first = _adapter(sink, seed=2)
    sink.apply(engine.policy_version + 1, first)
    after_full = _sampled(engine)
    down = {n: t for n, t in _adapter(sink, seed=3).items() if n.endswith("experts.lora_A.weight")}
    assert down and all(".base_layer." not in n for n in down)
    sink.apply(engine.policy_version + 1, down)
    after_down = _sampled(engine)
    sink.apply(engine.policy_version + 1, {**first, **down})
    union = _sampled(engine)
    def ids(completions) -> list[list[int]]:
        return [list(c.token_ids) for c in completions]

    assert ids(after_down) == ids(union)
    np.testing.assert_array_equal(np.concatenate([c.logprobs for c in after_down]),
                                  np.concatenate([c.logprobs for c in union]))  # fmt: skip
    assert ids(after_full) != ids(after_down)
