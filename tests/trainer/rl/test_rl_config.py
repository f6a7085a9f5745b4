"""AlgorithmConfig: the tagged union, defaults, cross-field checks and their messages, documented fields, no torch."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pydantic
import pytest

from common.config import Config, ConfigError, to_toml, validate_config
from trainer.rl.config import AlgorithmConfig, GRPOConfig, ImportanceSamplingConfig, KLConfig, PPOConfig


class _Recipe(Config):
    algorithm: AlgorithmConfig


def _load(algorithm: dict) -> GRPOConfig | PPOConfig:
    return validate_config(_Recipe, {"algorithm": algorithm}).algorithm


def _error(algorithm: dict) -> str:
    with pytest.raises(ConfigError) as info:
        _load(algorithm)
    return str(info.value)


def test_type_selects_the_algorithm_and_defaults_are_valid():
    grpo = _load({"type": "grpo"})
    ppo = _load({"type": "ppo", "gamma": 0.99})
    assert isinstance(grpo, GRPOConfig) and grpo.group_size == 8 and grpo.advantage_estimator == "grpo"
    assert isinstance(ppo, PPOConfig) and ppo.gamma == 0.99 and ppo.group_size == 1
    assert grpo.kl.coef == 0 and not grpo.kl.needs_reference
    assert _load({"type": "grpo", "kl": {"coef": 0.01}}).kl.needs_reference


def test_torch_free_facts_for_recipe_checks():
    assert _load({"type": "grpo"}).group_relative and not _load({"type": "ppo"}).group_relative
    assert "group_relative" not in GRPOConfig.model_fields  # a fact of the class, not a recipe key
    in_loss, in_reward = KLConfig(coef=0.1), KLConfig(coef=0.1, where="reward")
    assert in_loss.in_loss and not in_loss.in_reward and in_reward.in_reward and not in_reward.in_loss
    assert not KLConfig(where="reward").in_reward  # coef 0: off


def test_unknown_type_and_fields_of_the_other_algorithm_are_rejected():
    assert "algorithm" in _error({"type": "reinforce"})
    msg = _error({"type": "grpo", "gamma": 0.9})  # a PPO field
    assert "gamma" in msg and "unknown key" in msg


def test_group_size_below_two_is_rejected_for_grpo_with_a_hint():
    msg = _error({"type": "grpo", "group_size": 1})
    assert "algorithm.group_size" in msg and "group_size >= 2" in msg and "ppo" in msg


def test_rloo_with_std_scaling_is_rejected():
    assert "scale_advantages_by_std = false" in _error({"type": "grpo", "advantage_estimator": "rloo"})
    cfg = _load({"type": "grpo", "advantage_estimator": "rloo", "scale_advantages_by_std": False})
    assert cfg.advantage_estimator == "rloo"


def test_token_sum_norm_needs_its_length_and_only_it_uses_one():
    assert "set loss_norm_length" in _error({"type": "grpo", "loss_aggregation": "token_sum_norm"})
    assert "remove it" in _error({"type": "ppo", "loss_norm_length": 512})
    cfg = _load({"type": "grpo", "loss_aggregation": "token_sum_norm", "loss_norm_length": 512})
    assert cfg.loss_norm_length == 512


def test_sequence_ratio_needs_sequence_mean_aggregation():
    assert "seq_mean_token_mean" in _error({"type": "grpo", "ratio_level": "sequence"})
    cfg = _load({"type": "grpo", "ratio_level": "sequence", "loss_aggregation": "seq_mean_token_mean"})
    assert cfg.ratio_level == "sequence"


@pytest.mark.parametrize(
    "bad",
    [
        {"clip_low": 1.0},
        {"clip_high": 0.0},
        {"kl": {"coef": -0.1}},
        {"kl": {"estimator": "k4"}},
        {"kl": {"where": "advantage"}},
        {"importance_sampling": {"cap": 0.5}},
        {"importance_sampling": {"level": "chunk"}},
        {"entropy_coef": "0.01"},  # strict: no strings for numbers
        {"gamma": 1.5},
        {"lam": -0.1},
        {"value_clip": 0.0},
    ],
)
def test_out_of_range_values_are_rejected(bad):
    with pytest.raises(ConfigError):
        _load({"type": "ppo", **bad})


def test_every_field_is_documented():
    for cls in (GRPOConfig, PPOConfig, KLConfig, ImportanceSamplingConfig):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no docstring"


def test_configs_are_frozen():
    cfg = GRPOConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.clip_low = 0.3


def test_config_module_does_not_import_torch():
    code = "import sys, trainer.rl.config; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


def test_toml_round_trip():
    recipe = _Recipe(algorithm=GRPOConfig(clip_high=0.28, kl=KLConfig(coef=0.01, estimator="k2")))
    assert validate_config(_Recipe, tomllib.loads(to_toml(recipe))) == recipe
