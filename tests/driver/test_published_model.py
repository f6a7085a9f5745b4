"""``[model.create_published]``: a random model of a published architecture's real sizes, created locally (no hub),
that our trainer config, HF transformers and the recipe agree on; bad settings fail at recipe load naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError
from common.published import PUBLISHED_CONFIGS
from recipe import load_recipe
from tools.make_tiny_model import make_published_model
from trainer.models.hf_config import model_config_from_hf, model_config_from_hf_dict

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "qwen3_0p6b_cpu.toml"


def test_a_reduced_published_model_keeps_the_real_layer_shapes(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open

    out = make_published_model(tmp_path / "m", "Qwen3-0.6B", seed=1, num_layers=1)
    ours = model_config_from_hf(str(out))
    published = model_config_from_hf_dict(PUBLISHED_CONFIGS["Qwen3-0.6B"], source="published")
    assert ours.num_layers == 1
    assert ours.model_dump(exclude={"num_layers"}) == published.model_dump(exclude={"num_layers"})
    assert ours.vocab_size == 151_936 and ours.tie_embeddings
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        assert embed.shape == (151_936, 1024) and embed.dtype == torch.bfloat16
        assert "lm_head.weight" not in f.keys()  # tied
    config = json.loads((out / "config.json").read_text())
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token_id"] is not None and tokenizer["eos_token"] == "<|im_end|>"


def test_unknown_architecture_and_experts_of_a_dense_model_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown architecture 'Qwen3-7B'; choose one of \['Qwen3-0.6B'"):
        make_published_model("/nonexistent", "Qwen3-7B")
    with pytest.raises(ValueError, match="Qwen3-0.6B has no experts"):
        make_published_model("/nonexistent", "Qwen3-0.6B", num_experts=4)
    with pytest.raises(ValueError, match=r"below Qwen3-30B-A3B's top-k \(8\)"):
        make_published_model("/nonexistent", "Qwen3-30B-A3B", num_experts=4)
    with pytest.raises(ValueError, match=r"vocab_size = 300 is below the tokenizer's \d+ tokens"):
        make_published_model("/nonexistent", "Qwen3-0.6B", num_layers=1, vocab_size=300)


def test_the_real_size_recipe_validates_and_resolves_its_seed() -> None:
    recipe = load_recipe(RECIPE, {"model.path": "/nowhere/yet", "run.seed": 7})  # created at start: no dir needed
    spec = recipe.model.create_published
    assert spec is not None and spec.architecture == "Qwen3-0.6B" and spec.seed == 7
    assert recipe.trainer.activation_checkpoint.mode == "full"


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"model.create_published.architecture": "Qwen3-7B"}, "model.create_published.architecture",
         "unknown architecture 'Qwen3-7B'"),
        ({"model.create_published.num_experts": 4}, "model.create_published", "has no experts"),
        ({"model.create_published.architecture": "Qwen3-30B-A3B", "model.create_published.num_experts": 4},
         "model.create_published", "below Qwen3-30B-A3B's top-k (8)"),
        ({"model.create_tiny.family": "qwen3"}, "model", "both create the model"),
        ({"model.create_published.vocab_size": 200_000}, "model.create_published",
         "vocab_size = 200000 exceeds Qwen3-0.6B's 151936"),
    ],
)  # fmt: skip
def test_bad_settings_name_the_field(overrides: dict, field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_recipe(RECIPE, overrides)
    assert f"- {field}:" in str(e.value) and reason in str(e.value), str(e.value)


def test_a_created_model_appears_with_its_config_last_and_no_files_left_beside_it(tmp_path: Path, monkeypatch) -> None:
    """Two jobs of one cluster created the same model in the same directory at once (Ray's shared copy of the working
    dir), and the check that a model exists is its config.json: the config must be the last file to appear."""
    import os

    from tools.make_tiny_model import make_tiny_model

    moved: list[str] = []
    replace = os.replace

    def recording(src, dst):
        moved.append(Path(dst).name)
        assert not (tmp_path / "m" / "config.json").exists(), "config.json appeared before the model's other files"
        replace(src, dst)

    monkeypatch.setattr(os, "replace", recording)
    out = make_tiny_model(tmp_path / "m", "qwen3", hidden_size=32, num_layers=1)
    assert moved[-1] == "config.json" and "model.safetensors" in moved and "tokenizer.json" in moved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # the staging directory is gone
    monkeypatch.undo()
    again = make_tiny_model(out, "qwen3", hidden_size=32, num_layers=1)  # over an existing copy: the same bytes
    assert model_config_from_hf(str(again)).dim == 32
