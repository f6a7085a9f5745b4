"""Our models against transformers' LlamaForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.trainer.models.tiny_hf import TINY_HF
from trainer.models.hf_config import model_config_from_hf
from trainer.models.hf_io import hf_manifest, load_hf_checkpoint, read_hf_parameters, save_hf_checkpoint
from trainer.models.transformer import build_model

CASES = [
    ("llama3_scaled", {"attention": "sdpa"}),
    ("llama3_scaled", {"attention": "eager"}),
    ("qwen3_tied", {}),
    ("qwen3_moe", {"moe_experts": "grouped"}),
    ("qwen3_moe", {"moe_experts": "loop"}),
    ("qwen3_moe_tied_unnormed", {"moe_experts": "grouped"}),
]


def _load_ours(path: Path, **blocks):
    cfg = model_config_from_hf(str(path), **blocks)
    model = build_model(cfg, dtype=torch.float32)
    load_hf_checkpoint(model, str(path))
    return model.eval()


def _tokens(vocab: int, batch: int = 2, seq: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("name", "blocks"), CASES)
def test_logits_match_transformers(hf_dirs, name, blocks):
    path, hf_model = hf_dirs[name]
    ours = _load_ours(path, **blocks)
    tokens = _tokens(ours.cfg.vocab_size)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        got = ours.logits(ours(tokens))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4
    # the model does something non-trivial (guards against comparing two near-constant outputs)
    assert expected.std().item() > 0.1


def test_moe_aux_loss_matches_transformers(hf_dirs):
    """One MoE layer: our per-layer mean equals HF's aux_loss (HF pools layers differently when there are more)."""
    path, hf_model = hf_dirs["qwen3_moe_tied_unnormed"]
    ours = _load_ours(path)
    tokens = _tokens(ours.cfg.vocab_size)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens, output_router_logits=True).aux_loss
        ours(tokens)
    assert ours.cfg.num_layers == 1 and torch.allclose(ours.moe_aux_loss(), expected, atol=1e-6)


def test_rope_scaling_changes_outputs(hf_dirs):
    """The Llama 3.1 scaling in the tiny config matters at these positions, so the parity test covers it."""
    path, _ = hf_dirs["llama3_scaled"]
    scaled = _load_ours(path)
    plain = build_model(scaled.cfg.model_copy(update={"rope_scaling": None}))
    plain.load_state_dict(scaled.state_dict())
    tokens = _tokens(scaled.cfg.vocab_size)
    with torch.no_grad():
        assert (scaled(tokens) - plain(tokens)).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", list(TINY_HF))
def test_save_load_round_trip_through_transformers(hf_dirs, tmp_path, name):
    """our save -> transformers load (same logits) -> transformers save -> our load: bit-identical parameters."""
    import transformers

    original = _load_ours(hf_dirs[name][0])
    ours_dir, hf_dir = tmp_path / "ours", tmp_path / "hf"
    save_hf_checkpoint(original, str(ours_dir))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(ours_dir), dtype=torch.float32).eval()
    tokens = _tokens(original.cfg.vocab_size, seq=16)
    with torch.no_grad():
        assert (hf_model(input_ids=tokens).logits - original.logits(original(tokens))).abs().max().item() < 1e-4
    hf_model.save_pretrained(str(hf_dir))
    for source in (ours_dir, hf_dir):
        again = _load_ours(source)
        assert again.cfg == original.cfg
        for (n1, p1), (n2, p2) in zip(original.state_dict().items(), again.state_dict().items(), strict=True):
            assert n1 == n2 and torch.equal(p1, p2), n1


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_tied", "llama3_scaled"])
def test_manifest_matches_transformers_checkpoint(hf_dirs, tmp_path, name):
    """Names and shapes we export are exactly what transformers writes (tied lm_head omitted, per-expert names)."""
    path, _ = hf_dirs[name]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        expected = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    cfg = model_config_from_hf(str(path))
    manifest = hf_manifest(cfg)
    assert {n: s for n, s, _ in manifest} == expected
    assert len(manifest) == len(expected)
    save_hf_checkpoint(build_model(cfg), str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected)


def test_sharded_checkpoint_loads_in_transformers_and_back(hf_dirs, tmp_path):
    original = _load_ours(hf_dirs["qwen3_moe"][0])
    files = save_hf_checkpoint(original, str(tmp_path), max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_files = [f for f in files if f.endswith(".safetensors")]
    assert len(shard_files) > 2 and set(index["weight_map"].values()) == set(shard_files)
    assert not (tmp_path / "model.safetensors").exists()
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = _tokens(original.cfg.vocab_size, seq=12)
    with torch.no_grad():
        assert (hf_model(input_ids=tokens).logits - original.logits(original(tokens))).abs().max().item() < 1e-4
    again = _load_ours(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), again.state_dict().values()))


def test_bf16_save_writes_bf16_config(hf_dirs, tmp_path):
    original = _load_ours(hf_dirs["qwen3_tied"][0])
    save_hf_checkpoint(original, str(tmp_path), dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_load_rejects_incomplete_and_foreign_checkpoints(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = hf_dirs["qwen3_moe"]
    model = build_model(model_config_from_hf(str(path)))
    tensors = load_file(str(path / "model.safetensors"))
    (tmp_path / "a").mkdir()
    partial = {k: v for k, v in tensors.items() if "experts.3." not in k}
    save_file(partial, str(tmp_path / "a" / "model.safetensors"))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="does not cover"):
        load_hf_checkpoint(model, str(tmp_path / "a"))
    # refused before anything is copied: the model keeps every weight it had
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    (tmp_path / "b").mkdir()
    foreign = {**tensors, "model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}
    save_file(foreign, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(ValueError, match="not in the qwen3_moe model"):
        load_hf_checkpoint(model, str(tmp_path / "b"))


@pytest.mark.parametrize("name", ["qwen3_moe", "llama3_scaled"])
def test_parameters_read_one_at_a_time_equal_the_loaded_model(hf_dirs, tmp_path, name):
    """The streamed reader (what converts a checkpoint without building the model) yields every parameter as the
    loaded model holds it, stacked experts assembled from their per-expert tensors, also from a sharded directory."""
    path, _ = hf_dirs[name]
    model = _load_ours(path)
    save_hf_checkpoint(model, str(tmp_path), max_shard_bytes=50_000)  # several files + an index
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    for source in (path, tmp_path):
        read = list(read_hf_parameters(model.cfg, source, shapes))
        assert [n for n, _ in read] == [n for n, _ in shapes]
        for (_, tensor), p in zip(read, model.parameters(), strict=True):
            assert torch.equal(tensor.float(), p.detach())
    wrong = [(n, (s[0] + 1, *s[1:])) for n, s in shapes]
    with pytest.raises(ValueError, match="has shape"):
        read_hf_parameters(model.cfg, path, wrong)  # refused when called, before a tensor is read
