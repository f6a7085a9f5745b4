"""Prompt dataset: a seeded shuffle per epoch and a resumable cursor over the training problems.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so it does not depend on how batches were
cut before; the cursor is ``(epoch, position)``. ``state_dict()`` after any number of ``next_batch`` calls, loaded
into a fresh dataset of the same task, continues with exactly the same problems.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from rollout.tasks.config import ArithmeticTaskConfig, JsonlTaskConfig, TaskConfig
from rollout.tasks.problem import Problem

__all__ = ["PromptDataset", "build_dataset"]


class PromptDataset:
    """Training problems served in seeded, per-epoch shuffled order; the held-out problems are kept apart.

    Usage::

        dataset = build_dataset(config.task)
        problems = dataset.next_batch(8)     # crosses epoch boundaries transparently
        state = dataset.state_dict()         # store with the checkpoint
        dataset.load_state_dict(state)       # the next batch is the one that would have followed
    """

    def __init__(self, train: list[Problem], eval_problems: list[Problem], seed: int) -> None:
        if not train:
            raise ValueError("a prompt dataset needs at least one training problem")
        self._train = list(train)
        self._eval = list(eval_problems)
        self._seed = seed
        self._fingerprint = _fingerprint(self._train)
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        """Number of training problems (one epoch)."""
        return len(self._train)

    def first_problem(self) -> Problem:
        """The first training problem in file order; the cursor does not move (a preflight's sample)."""
        return self._train[0]

    @property
    def epoch(self) -> int:
        """Epoch the next problem comes from (0-based)."""
        return self._epoch

    @property
    def stream_position(self) -> int:
        """How many training problems were drawn before the next one, over every epoch: the next problem's place in
        the training stream, which a resumed run (its cursor restored) continues from."""
        return self._epoch * len(self._train) + self._position

    def next_batch(self, num_prompts: int) -> list[Problem]:
        """The next ``num_prompts`` training problems; a batch may span two epochs (each epoch a new shuffle)."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts = {num_prompts}: ask for at least one prompt")
        batch: list[Problem] = []
        while len(batch) < num_prompts:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            take = min(num_prompts - len(batch), len(self._order) - self._position)
            batch.extend(self._train[i] for i in self._order[self._position : self._position + take])
            self._position += take
        return batch

    def train_problems(self) -> list[Problem]:
        """The training problems in file order; the cursor does not move."""
        return list(self._train)

    def all_problems(self) -> list[Problem]:
        """Every problem, training then held-out (for checks over the whole task)."""
        return [*self._train, *self._eval]

    def eval_problems(self) -> list[Problem]:
        """The held-out problems, in their fixed order (never shuffled, never in the training stream)."""
        return list(self._eval)

    def sft_examples(self, num_examples: int, eos_text: str) -> list[tuple[Problem, str | list[dict[str, str]]]]:
        """``(problem, ideal completion)`` pairs for a supervised warm start, from training problems only.

        The completion is the problem's ``solution`` (or its answer when it has none) followed by ``eos_text`` (the
        text of the token a model turn ends with, ``common.chat_turns.turn_end_id``: e.g. ``"<|im_end|>"``); a
        transcript solution (a list of messages)
        comes as it is. Problems come in the epoch-0 shuffle order of
        a separate stream, cycling if ``num_examples`` exceeds the training set; the cursor is not moved.
        """
        if num_examples < 0:
            raise ValueError(f"num_examples = {num_examples} must be >= 0")
        order = np.random.default_rng([self._seed, 2**31 - 1]).permutation(len(self._train))
        out = []
        for k in range(num_examples):
            problem = self._train[order[k % len(order)]]
            solution = problem.solution if problem.solution is not None else problem.answer
            out.append((problem, solution + eos_text if isinstance(solution, str) else solution))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The cursor, plus the seed and a fingerprint of the problems so a mismatched resume is caught."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed, "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by :meth:`state_dict` of a dataset with the same problems and seed."""
        if state.get("fingerprint") != self._fingerprint or state.get("seed") != self._seed:
            raise ValueError(
                "prompt dataset state does not match this dataset (different task file, task settings or seed); "
                "resume with the recipe's original task section"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._train):
            raise ValueError(f"prompt dataset state has an invalid cursor (epoch {epoch}, position {position})")
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        return np.random.default_rng([self._seed, 0, epoch]).permutation(len(self._train)).tolist()


def build_dataset(config: TaskConfig) -> PromptDataset:
    """Build the dataset a task config describes (generating or reading its problems)."""
    if isinstance(config, ArithmeticTaskConfig):
        from rollout.tasks.arithmetic import generate_arithmetic

        train, held_out = generate_arithmetic(config)
    elif isinstance(config, JsonlTaskConfig):
        from rollout.tasks.jsonl import load_jsonl

        train, held_out = load_jsonl(config)
    else:
        raise TypeError(f"unknown task config {type(config).__name__}")
    return PromptDataset(train, held_out, seed=config.seed)


def _fingerprint(problems: list[Problem]) -> str:
    digest = hashlib.sha256()
    for p in problems:
        digest.update(repr((p.problem_id, p.prompt, p.answer)).encode())
    return digest.hexdigest()[:16]
