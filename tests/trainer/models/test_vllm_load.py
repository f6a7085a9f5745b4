"""vLLM (CPU build) loads what save_hf_checkpoint writes and computes the same prompt logprobs as our model.

Slow (a vLLM engine start per case, 10-20 s). vLLM's CPU backend needs head_dim in its supported set (32 here) and
runs MoE only in bfloat16, so the MoE case compares at bfloat16 tolerance (a routing flip may move one position).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.models.tiny_hf import TINY_HF, make_hf_model
from trainer.models.hf_config import model_config_from_hf
from trainer.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from trainer.models.transformer import build_model

pytest.importorskip("vllm")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "dtype"), [("llama3_scaled", "float32"), ("qwen3_tied", "float32"), ("qwen3_moe", "bfloat16")]
)
def test_vllm_loads_our_checkpoint(tmp_path, monkeypatch, name, dtype):
    cls, kwargs = TINY_HF[name]
    monkeypatch.setitem(TINY_HF, name, (cls, {**kwargs, "hidden_size": 64, "num_attention_heads": 2,
                                              "num_key_value_heads": 1, "head_dim": 32}))  # fmt: skip
    make_hf_model(name).save_pretrained(str(tmp_path / "hf"))
    model = build_model(model_config_from_hf(str(tmp_path / "hf")))
    load_hf_checkpoint(model, str(tmp_path / "hf"))
    save_hf_checkpoint(model, str(tmp_path / "ours"))
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.token_logprobs(model(tokens), torch.roll(tokens, -1, dims=1))[0][0, :-1]
    script = Path(__file__).with_name("vllm_prompt_logprobs.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ours"), dtype, json.dumps(tokens[0].tolist())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LOGPROBS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    diff = (torch.tensor(json.loads(lines[0].removeprefix("LOGPROBS "))) - ours).abs()
    if dtype == "float32":
        assert diff.max().item() < 1e-4
    else:
        assert diff.median().item() < 0.02 and diff.max().item() < 0.3
