"""Training sees the distribution it sampled from: vLLM's log-probs of its own samples (float32 engine, processed
log-probs) equal the trainer's log-probs of the same tokens, packed as the step packs them, at temperatures other
than 1, so the first step's importance ratios are 1. The untempered trainer log-probs (what the trainer computed
before samples carried their temperature) are checked to be far off, so the comparison can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.rollout.vllm_helpers import make_model

pytest.importorskip("vllm")

from rollout.config import EngineConfig, SamplingConfig  # noqa: E402
from rollout.engine.vllm_engine import VLLMEngine  # noqa: E402
from rollout.types import Sample  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 200, 300, 301, 302], [9, 10]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir) -> VLLMEngine:
    config = EngineConfig(max_model_len=256, max_num_seqs=16, cpu_threads_bind="nobind", enforce_eager=True,
                          kv_cache_gib=0.25)  # fmt: skip
    return VLLMEngine(model_dir, config)


def _trainer_logprobs(model_dir: str, samples: list[Sample], temperatures: list[float]) -> list[np.ndarray]:
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import load_hf_checkpoint
    from trainer.models.transformer import build_model
    from trainer.packing import pack_samples
    from trainer.step import forward_logprobs

    model = build_model(model_config_from_hf(model_dir), device=torch.device("cpu"), dtype=torch.float32)
    load_hf_checkpoint(model, model_dir)
    tempered = [Sample(**{**vars(s), "temperature": t}) for s, t in zip(samples, temperatures)]
    out: list[np.ndarray] = [np.zeros(0)] * len(samples)
    with torch.no_grad():
        for mb in pack_samples(tempered, range(len(samples)), token_budget=4096):
            logprobs = forward_logprobs(model, mb)[0]
            for row, i in enumerate(mb.sample_indices):
                out[i] = logprobs[row, : len(samples[i].completion_ids)].numpy()
    return out


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
