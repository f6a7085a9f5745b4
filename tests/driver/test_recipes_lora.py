"""Recipes with LoRA: the engines' adapter shape resolved from ``[model.lora]``, the exports' base, the settings
that cannot run refused at load, PEFT's field names translated."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe import load_recipe
from tests.driver.recipe_checks import ROOT, load_error


def test_the_lora_recipe_resolves_the_engines_adapter_shape_from_model_lora():
    recipe = load_recipe(ROOT / "recipes" / "grpo_tiny_lora.toml")
    lora, served = recipe.model.lora, recipe.rollout.engine.lora
    assert lora is not None and served is not None
    assert (served.rank, served.alpha, served.target_modules) == (lora.rank, lora.alpha, lora.target_modules)
    assert load_recipe(ROOT / "recipes" / "grpo_tiny.toml").rollout.engine.lora is None


def test_a_derived_recipe_drops_the_bases_lora_with_false(tmp_path):
    # "Input should be an object (got False)": README's `= false` did not reach [model.lora].
    child = tmp_path / "full.toml"
    child.write_text(f'base = "{ROOT / "recipes" / "grpo_tiny_lora.toml"}"\n\n[model]\nlora = false\n')
    assert load_recipe(child).model.lora is None and load_recipe(child).rollout.engine.lora is None
    assert load_recipe(ROOT / "recipes" / "grpo_tiny_lora.toml", {"model.lora": False}).model.lora is None


def test_a_lora_runs_exports_name_the_base_its_adapters_apply_to():
    """The final and hf/step_<n> exports' adapter directories named the random ``[model] path`` of a run whose warm
    start trained the base (PeftModel over it: logits off by 10)."""
    lora = load_recipe(ROOT / "recipes" / "grpo_tiny_lora.toml", {"run.output_dir": "/runs/x"})
    assert lora.lora_base == Path("/runs/x/warm_start_model")
    assert lora.export_source_dir == "/runs/x/warm_start_model"
    adapters_only = load_recipe(ROOT / "recipes" / "grpo_tiny_lora.toml", {"run.warm_start.parameters": "trainable"})
    assert adapters_only.export_source_dir == adapters_only.model.path == str(adapters_only.lora_base)
    no_warm_start = load_recipe(ROOT / "recipes" / "grpo_tiny_lora.toml", {"run.warm_start.num_steps": 0})
    assert no_warm_start.export_source_dir == no_warm_start.model.path
    full = load_recipe(ROOT / "recipes" / "grpo_tiny.toml")
    assert full.lora_base is None and full.export_source_dir == full.model.path


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"algorithm.kl.coef": 0.05, "run.warm_start.parameters": "trainable"}, "run.warm_start.parameters = 'all'"),
        ({"rollout.engine.lora.rank": 8}, "leave it unset"),
        ({"model.lora.target_modules": []}, "at least one projection"),
        ({"model.lora.rank": 0}, "greater than 0"),
        # Found 34 s into the run, in the rollout actor: vLLM's LoRA path serves ranks up to 512.
        ({"model.lora.rank": 1024, "rollout.engine.lora_serving": "adapter"}, "set it to 'merged'"),
    ],
)
def test_lora_settings_that_cannot_run_fail_at_load(overrides, reason):
    message = load_error(ROOT / "recipes" / "grpo_tiny_lora.toml", overrides)
    assert reason in message, message


def test_engine_adapters_without_model_lora_fail_at_load():
    message = load_error(ROOT / "recipes" / "grpo_tiny.toml", {"rollout.engine.lora.rank": 8})
    assert "- rollout.engine.lora:" in message and "[model.lora]" in message, message


def test_peft_names_of_lora_fields_are_translated():
    lora = ROOT / "recipes" / "grpo_tiny_lora.toml"
    assert "unknown key 'r'; this field is model.lora.rank here" in load_error(lora, {"model.lora.r": 8})
    assert "this field is model.lora.alpha here" in load_error(lora, {"model.lora.lora_alpha": 16})
