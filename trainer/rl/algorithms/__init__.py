"""The RL algorithms, one object per ``[algorithm] type``: whether it trains a critic, its advantages, its losses.

How to add one, say ``reinforce``:

1. its config in ``trainer.rl.config``: a ``PolicyConfig`` subclass with ``type: Literal["reinforce"]`` (and
   ``group_relative = True`` if its advantages compare the samples of a group, ``trains_critic = True`` if it learns a
   value function), added to the ``AlgorithmConfig`` union; configs stay there because recipes validate without
   importing torch;
2. one file here, ``reinforce.py``: a subclass of :class:`Algorithm` that implements ``compute_advantages`` (and
   ``value_loss`` with a critic; overrides ``policy_loss`` if it differs);
3. one line in :data:`ALGORITHMS`.

The train state, the step and the checkpoint code then need no change.
"""

from __future__ import annotations

from trainer.rl.algorithms.base import AdvantageInputs, Algorithm
from trainer.rl.algorithms.grpo import GRPO
from trainer.rl.algorithms.ppo import PPO
from trainer.rl.config import AlgorithmConfig

__all__ = ["ALGORITHMS", "AdvantageInputs", "Algorithm", "build_algorithm"]

ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPO, "ppo": PPO}
"""Algorithm class by config ``type``."""


def build_algorithm(config: AlgorithmConfig) -> Algorithm:
    """The algorithm object of ``config`` (looked up by ``config.type``)."""
    return ALGORITHMS[config.type](config)
