"""Rewards scored next to the rollout engine: math-verify answers, exact match, format regex, user functions and
reward models, summed with weights by a :class:`RewardScorer`."""

from rollout.rewards.config import (
    ExactMatchRewardConfig,
    FormatRewardConfig,
    FunctionRewardConfig,
    MathRewardConfig,
    RewardConfig,
    RewardModelConfig,
    RewardTermConfig,
)
from rollout.rewards.function import RewardFunctionError, resolve_function
from rollout.rewards.scorer import RewardScorer, RewardTerm, build_term

__all__ = [
    "ExactMatchRewardConfig",
    "FormatRewardConfig",
    "FunctionRewardConfig",
    "MathRewardConfig",
    "RewardConfig",
    "RewardFunctionError",
    "RewardModelConfig",
    "RewardScorer",
    "RewardTerm",
    "RewardTermConfig",
    "build_term",
    "resolve_function",
]
