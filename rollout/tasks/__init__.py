"""Prompt sources for rollouts: the built-in arithmetic task and JSONL files, served by a resumable, seeded dataset."""

from rollout.tasks.config import ArithmeticTaskConfig, JsonlTaskConfig, TaskConfig
from rollout.tasks.dataset import PromptDataset, build_dataset
from rollout.tasks.problem import Problem

__all__ = ["ArithmeticTaskConfig", "JsonlTaskConfig", "Problem", "PromptDataset", "TaskConfig", "build_dataset"]
