"""A base model's tokenizer with a chat template ends a text with one token and a turn with another (Qwen 3 base:
``<|endoftext|>`` and ``<|im_end|>``): the engines stop a turn at the template's end-of-turn, and the warm start's
targets end with it, as the template writes an assistant turn."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.chat_turns import turn_end_id
from rollout.tokenizer import load_tokenizer, render_prompt
from tests.rollout.vllm_helpers import make_model

BASE_EOS = "<|endoftext|>"  # id 0 in the tiny tokenizer
TURN_END = "<|im_end|>"  # id 2: its end-of-sequence token, and the template's end of an assistant turn


def _as_base_model(model_dir: str, uniform: bool = False) -> str:
    """Make a tiny model's tokenizer and configs end a text with ``<|endoftext|>``, as a base model's do; with
    ``uniform`` its final norm is zero, so every token is equally likely at every step."""
    root = Path(model_dir)
    tokenizer_config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": BASE_EOS}))
    eos = load_tokenizer(model_dir).eos_token_id
    for name in ("config.json", "generation_config.json"):
        config = json.loads((root / name).read_text())
        (root / name).write_text(json.dumps({**config, "eos_token_id": eos}))
    if uniform:
        weights = load_file(str(root / "model.safetensors"))
        weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
        save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def test_the_turn_end_is_the_templates_when_prompts_use_it(tmp_path):
    tokenizer = load_tokenizer(_as_base_model(make_model(tmp_path / "m")))
    turn_end, eos = tokenizer.convert_tokens_to_ids(TURN_END), tokenizer.convert_tokens_to_ids(BASE_EOS)
    assert tokenizer.eos_token_id == eos != turn_end
    assert turn_end_id(tokenizer, None) == turn_end_id(tokenizer, True) == turn_end
    assert turn_end_id(tokenizer, False) == eos  # prompts as plain text: the text's end


def test_warm_start_targets_end_as_the_template_ends_an_assistant_turn(tmp_path):
    """Single-turn targets ended with the tokenizer's end-of-sequence text: a base model learned to end chat turns
    with ``<|endoftext|>``, never with the ``<|im_end|>`` its template (and every transcript target) ends them with."""
    from driver.warm_start import sft_samples
    from rollout.tasks.problem import Problem

    tokenizer = load_tokenizer(_as_base_model(make_model(tmp_path / "m")))
    problem = Problem(prompt="What is 2 + 3?", answer="5", problem_id="p")
    end = turn_end_id(tokenizer, None)
    assert end is not None
    [sample] = sft_samples(tokenizer, [(problem, "5" + tokenizer.decode([end]))], None)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": "5"}], tokenize=False)
    prompt = tokenizer.decode(render_prompt(tokenizer, problem.prompt))
    assert rendered.startswith(prompt + tokenizer.decode(sample.completion_ids.tolist()))
    assert sample.completion_ids[-1] == tokenizer.convert_tokens_to_ids(TURN_END)


def test_a_worker_stops_turns_at_the_templates_end_of_turn(tmp_path):
    """Every token equally likely: without the end-of-turn among the stop ids, ``<|im_end|>`` came mid-completion
    and generation ran on into turns the model made up."""
    pytest.importorskip("vllm")
    from rollout.config import EngineConfig, RolloutConfig, SamplingConfig
    from rollout.tasks.problem import Problem
    from rollout.worker import RolloutWorker

    model = _as_base_model(make_model(tmp_path / "m"), uniform=True)
    config = RolloutConfig(
        model_path=model, sampling=SamplingConfig(max_tokens=96, seed=3),
        engine=EngineConfig(max_model_len=256, max_num_seqs=16, cpu_threads_bind="nobind", kv_cache_gib=0.25,
                            enforce_eager=True),
    )  # fmt: skip
    worker = RolloutWorker(config)
    try:
        problems = [Problem(prompt=f"Say {i}.", answer=str(i), problem_id=str(i)) for i in range(4)]
        batch = worker.generate_groups(problems, group_ids=[0, 1, 2, 3], group_size=12)
    finally:
        worker.shutdown()
    turn_end = worker.tokenizer.convert_tokens_to_ids(TURN_END)
    completions = [s.completion_ids.tolist() for s in batch.samples]
    assert not [c for c in completions if turn_end in c[:-1]], "a turn went on past its end-of-turn token"
    ended = [c for c, s in zip(completions, batch.samples, strict=True) if c[-1] == turn_end]
    assert ended and all(s.finish_reason == "stop" for s in batch.samples if s.completion_ids[-1] == turn_end)
    assert np.mean([len(c) for c in completions]) < 96  # some stopped early; the rest ran to max_tokens


def test_an_export_of_a_base_like_model_stops_generate_at_the_end_of_a_turn(tmp_path):
    """Its generation_config.json named ``<|endoftext|>`` alone: HF ``generate`` on a chat prompt ran on past the
    ``<|im_end|>`` the run trained turns to end with (and stopped its engines at)."""
    import shutil

    import transformers

    from trainer.export import complete_from_source

    source = Path(_as_base_model(make_model(tmp_path / "m")))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(source / name, out / name)
    complete_from_source(out, source, use_chat_template=False)  # a run without the template: its turns end at eos
    tokenizer = load_tokenizer(str(out))
    turn_end, eos = tokenizer.convert_tokens_to_ids(TURN_END), tokenizer.convert_tokens_to_ids(BASE_EOS)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    complete_from_source(out, source)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [eos, turn_end]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([render_prompt(tokenizer, "What is 2 + 3?")])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False, sequence_bias={(turn_end,): 100.0})
    assert generated[0, ids.shape[1]:].tolist() == [turn_end]
