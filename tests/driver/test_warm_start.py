"""The warm start stops at its step count or earlier at a target (loss, held-out accuracy), with hand-written fakes
for the trainer and dataset; the real SFT step is covered by tests/trainer/test_step.py and the demo."""

import logging
import re

import pytest

from driver.warm_start import WarmStartError, sft_samples, warm_start
from recipe.sections import WarmStartConfig
from rollout.tasks.problem import Problem


class FakeTokenizer:
    eos_token, eos_token_id = "<e>", 4
    chat_template = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.eos_token if i == self.eos_token_id else "x" for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3] * len(text)}

    def encode(self, text, add_special_tokens=True):
        return [5] * len(text)


class FakeDataset:
    def sft_examples(self, n, eos):
        return [(Problem(prompt=f"p{i}", answer="1", problem_id=str(i)), "1" + eos) for i in range(n)]


class FakeTrainer:
    """SFT loss 1/(step+1); accuracy rises by 0.1 per 10 steps."""

    def __init__(self):
        self.steps = 0

    def sft_step(self, samples, lr):
        self.steps += 1
        return {"sft_loss": 1.0 / self.steps}


def _run(evaluate=None, **cfg):
    trainer, logged = FakeTrainer(), []
    steps = warm_start(trainer, FakeDataset(), FakeTokenizer(), WarmStartConfig(num_examples_per_step=2, **cfg),
                       False, lambda s, m: logged.append((s, m)), evaluate)  # fmt: skip
    return steps, trainer, logged


def test_runs_its_steps_without_a_target():
    steps, trainer, logged = _run(num_steps=30)
    assert steps == trainer.steps == len(logged) == 30


def test_stops_at_the_loss_target():
    steps, _, _ = _run(num_steps=100, stop_at_loss=0.1)  # mean of 1/(k+1) over the last 10 steps <= 0.1
    assert steps == next(n for n in range(10, 101) if sum(1 / k for k in range(n - 9, n + 1)) / 10 <= 0.1)


def test_stops_at_the_accuracy_target_checked_every_k_steps(caplog):
    trainer_steps = []

    def evaluate():
        trainer_steps.append(len(trainer_steps))
        return {"eval/accuracy": 0.1 * len(trainer_steps)}

    with caplog.at_level(logging.INFO, logger="rl_align"):
        steps, _, logged = _run(evaluate, num_steps=500, stop_at_accuracy=0.3, check_every_num_steps=20)
    assert steps == 60 and len(trainer_steps) == 3
    checks = [m["warm_start/eval_accuracy"] for _, m in logged if "warm_start/eval_accuracy" in m]
    assert checks == pytest.approx([0.1, 0.2, 0.3])
    # Minutes of warm start printed nothing to the console: each check (and every 15 s) prints a line.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm start step")]
    assert [line.split(" | ")[0] for line in lines] == ["warm start step 20/500", "warm start step 40/500",
                                                        "warm start step 60/500"]  # fmt: skip
    assert "held-out accuracy 0.300 (target 0.3)" in lines[-1] and "loss " in lines[-1]
    assert re.search(r"s/step at most \d+s left$", lines[0]), lines[0]  # an ETA, which the target may cut short


def test_an_accuracy_target_needs_an_evaluation():
    with pytest.raises(ValueError, match="stop_at_accuracy needs"):
        _run(num_steps=10, stop_at_accuracy=0.5)


def test_the_warm_start_closes_the_environments_it_rendered_prompts_with_and_names_one_that_fails():
    from rollout.envs.config import CustomEnvConfig
    from tests.driver import warm_start_envs

    envs = "tests.driver.warm_start_envs"

    examples = FakeDataset().sft_examples(3, "<e>")
    config = CustomEnvConfig(class_path="tests.driver.warm_start_envs:CountsCloses")
    closed = warm_start_envs.CountsCloses.closed
    assert len(sft_samples(FakeTokenizer(), examples, False, config)) == 3
    assert warm_start_envs.CountsCloses.closed == closed + 3  # a sandbox each would otherwise stay up
    config = CustomEnvConfig(class_path="tests.driver.warm_start_envs:ResetFailsOnTheSecond")
    closed = warm_start_envs.CountsCloses.closed
    with pytest.raises(WarmStartError) as info:
        sft_samples(FakeTokenizer(), examples, False, config)
    assert str(info.value).startswith("warm start: environment tests.driver.warm_start_envs:ResetFailsOnTheSecond: "
                                      "reset of problem '1' raised ConnectionError: the sandbox is down")
    assert warm_start_envs.CountsCloses.closed == closed + 2  # the failed one's too (the third was never made)
    for name, error in [("ToolObjects", "ToolObjects: tools[0] is a rollout.envs.tools.Tool"),
                        ("FailsToConstruct", "environment for problem '0' raised OSError: no sandbox")]:
        with pytest.raises(WarmStartError, match=re.escape(error)):
            sft_samples(FakeTokenizer(), examples, False, CustomEnvConfig(class_path=f"{envs}:{name}"))


def test_a_prompt_longer_than_the_engines_hold_stops_the_warm_start_before_it_trains_on_it():
    """The warm start trained on a 669-token prompt that the engines (max_model_len 128) could not hold; the run then
    died at its first RL batch."""
    examples = FakeDataset().sft_examples(3, "<e>")
    longest = max(len(s.prompt_ids) for s in sft_samples(FakeTokenizer(), examples, False))
    assert len(sft_samples(FakeTokenizer(), examples, False, max_model_len=longest + 1)) == 3
    with pytest.raises(WarmStartError, match=rf"warm start: problem '\d': its prompt is {longest} tokens, and the "
                                             rf"engine holds rollout.engine.max_model_len = {longest}"):
        sft_samples(FakeTokenizer(), examples, False, max_model_len=longest)
