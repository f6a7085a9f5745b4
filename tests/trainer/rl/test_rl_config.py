"""AlgorithmConfig: the tagged union, defaults, cross-field checks and their messages, documented fields, no torch."""

import logging
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
        {"importance_sampling": {"mode": "clip"}},
        {"importance_sampling": {"lower_bound": 0.0}},
        {"clip_ratio_c": 1.0},
        {"overlong_filter": 1},
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


def test_kl_estimator_default_follows_where_and_shows_in_the_resolved_recipe():
    assert KLConfig().estimator == "k3" and KLConfig(where="reward").estimator == "k1"
    assert _load({"type": "ppo", "kl": {"coef": 0.1, "where": "reward"}}).kl.estimator == "k1"
    assert _load({"type": "grpo", "kl": {"coef": 0.1}}).kl.estimator == "k3"
    assert KLConfig(where="reward", estimator="k3").estimator == "k3"  # an explicit choice stays
    recipe = _Recipe(algorithm=PPOConfig(kl=KLConfig(coef=0.1, where="reward")))
    text = to_toml(recipe)
    assert 'estimator = "k1"' in text and validate_config(_Recipe, tomllib.loads(text)) == recipe


def test_check_prints_the_resolved_kl_estimator():
    root = Path(__file__).parents[3]
    out = subprocess.run(
        [sys.executable, "rl_align.py", "--recipe", "recipes/grpo_tiny.toml", "--check", "--algorithm.kl.coef", "0.01",
         "--algorithm.kl.where", "reward"],
        cwd=root, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    kl = tomllib.loads(out)["algorithm"]["kl"]
    assert kl == {"coef": 0.01, "where": "reward", "estimator": "k1"}


def test_k1_as_a_loss_term_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.rl.config"):
        KLConfig(coef=0.1, estimator="k1")
    assert "expected gradient of k1 as a loss term is 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.rl.config"):
        KLConfig(coef=0.1, estimator="k1", where="reward")
        KLConfig(coef=0.0, estimator="k1")  # off
        KLConfig(coef=0.1)  # k3
    assert caplog.text == ""


def test_importance_sampling_modes_and_bounds():
    cfg = _load({"type": "grpo", "importance_sampling": {"level": "geometric", "mode": "mask", "cap": 1.001,
                                                         "lower_bound": 0.999}})  # fmt: skip
    assert cfg.importance_sampling.level == "geometric" and cfg.importance_sampling.mode == "mask"
    default = ImportanceSamplingConfig()
    assert (default.level, default.mode, default.cap, default.lower_bound) == ("token", "truncate", 2.0, None)
    msg = _error({"type": "grpo", "importance_sampling": {"cap": 1.0, "lower_bound": 1.0}})
    assert "algorithm.importance_sampling" in msg and "must be below cap" in msg


def test_dual_clip_and_overlong_filter_default_off():
    cfg = _load({"type": "ppo"})
    assert cfg.clip_ratio_c is None and cfg.overlong_filter is False
    assert _load({"type": "ppo", "clip_ratio_c": 3.0}).clip_ratio_c == 3.0
    assert _load({"type": "grpo", "overlong_filter": True}).overlong_filter


def test_a_kl_reward_under_std_scaled_group_advantages_warns(caplog):
    reward = KLConfig(coef=0.1, where="reward")
    with caplog.at_level(logging.WARNING, logger="trainer.rl.config"):
        GRPOConfig(kl=reward)
    assert "scales those differences up to advantages of order 1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.rl.config"):
        GRPOConfig(kl=reward, scale_advantages_by_std=False)  # Dr. GRPO: the penalty keeps its scale
        GRPOConfig(kl=KLConfig(coef=0.1))  # in the loss
        PPOConfig(kl=reward)  # per-token rewards for GAE
    assert caplog.text == ""
