"""Reward terms in their own process: a call that never ends, a process that dies, async functions, CPU accounting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from rollout.rewards import FormatRewardConfig, FunctionRewardConfig, RewardConfig, RewardFunctionError, RewardScorer
from rollout.tasks import Problem

MODULE = "rl_align_test_isolated_rewards"


def _problems(n: int) -> list[Problem]:
    return [Problem(prompt="q", answer="1", problem_id=f"p{i}") for i in range(n)]


@pytest.fixture
def module(tmp_path, monkeypatch) -> str:
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(
        """
        import asyncio
        import os
        import time

        def sleepy(completion, problem):
            if completion == "hang":
                time.sleep(1000)
            return float(len(completion))

        def dies(completion, problem):
            if completion == "die":
                os._exit(3)
            return 1.0

        def busy(completion, problem):
            end = time.process_time() + 0.3
            while time.process_time() < end:
                pass
            return 1.0

        IN_FLIGHT = [0, 0]  # now, most

        async def judge(completion, problem):
            IN_FLIGHT[0] += 1
            IN_FLIGHT[1] = max(IN_FLIGHT)
            try:
                await asyncio.sleep(1000 if completion == "hang" else 0.2)
            finally:
                IN_FLIGHT[0] -= 1
            return float(IN_FLIGHT[1])

        async def slow_or_bad(completion, problem):
            if completion == "bad":
                raise ValueError("bad")
            if completion.startswith("sleep"):
                await asyncio.sleep(float(completion[5:]))
                return 100.0
            return 1.0

        async def threaded(completion, problem):  # a judge wrapping a blocking client in a thread
            if completion == "hang":
                await asyncio.to_thread(time.sleep, 1000)
            return 1.0

        def dies_or_raises(completion, problem):
            if completion == "die":
                os._exit(3)
            if completion == "bad":
                raise ValueError("bad")
            return 1.0

        LOOPS = set()

        async def loops_seen(completion, problem):  # a client made on one batch's loop must work on the next
            LOOPS.add(id(asyncio.get_running_loop()))
            return float(len(LOOPS))
        """))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))  # on sys.path, not PYTHONPATH: the process must still find it
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return MODULE


def _scorer(*terms, on_error: str = "fail", timeout_s: float = 1.0) -> RewardScorer:
    return RewardScorer.from_config(RewardConfig(terms=list(terms), on_error=on_error, timeout_s=timeout_s))


def test_a_call_that_never_returns_fails_its_sample_and_the_next_batch_runs(module):
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:sleepy"))
    with pytest.raises(RewardFunctionError) as info:
        scorer.score(["ab", "hang", "abc"], _problems(3))
    message = str(info.value)
    assert f"function '{module}:sleepy' failed on problem 'p1' with completion 'hang'" in message
    assert "no result within reward.timeout_s = 1 s" in message and "on_error = 'zero'" in message
    assert scorer.score(["abcd"], _problems(1))[0] == [4.0]  # a new process
    scorer.close()


def test_with_on_error_zero_the_stalled_sample_scores_zero_and_the_rest_of_the_batch_is_scored(module, caplog):
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:sleepy"), on_error="zero")
    with caplog.at_level("WARNING", logger="rl_align"):
        rewards, _, metrics = scorer.score(["ab", "hang", "abc", "hang", "a"], _problems(5))
    assert rewards == [2.0, 0.0, 3.0, 0.0, 1.0]
    assert metrics["reward/function/num_errors"] == 2.0
    assert sum("no result within" in r.getMessage() for r in caplog.records) == 1  # logged once, not per sample
    scorer.close()


def test_a_process_that_dies_fails_only_the_sample_it_was_scoring(module):
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:dies"), on_error="zero")
    rewards, _, metrics = scorer.score(["a", "die", "b"], _problems(3))
    assert rewards == [1.0, 0.0, 1.0] and metrics["reward/num_errors"] == 1.0
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:dies"))
    with pytest.raises(RewardFunctionError, match=r"the reward process ended \(exit status 3\): it died"):
        scorer.score(["die"], _problems(1))
    scorer.close()


def test_a_rule_term_that_backtracks_forever_scores_zero_and_is_counted_whatever_on_error(caplog):
    """A regex holds the interpreter's lock while it backtracks: no thread could stop it, the process is killed."""
    scorer = _scorer(FormatRewardConfig(pattern=r"(a+)+"), on_error="fail")
    with caplog.at_level("WARNING", logger="rl_align"):
        rewards, _, metrics = scorer.score(["aaa", "a" * 40 + "b", "aa"], _problems(3))
    assert rewards == [1.0, 0.0, 1.0] and metrics["reward/format/num_errors"] == 1.0
    assert any("reward term 'format': the format check failed on problem 'p1'" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    scorer.close()


def test_async_functions_run_concurrently_and_each_call_has_the_timeout(module, caplog):
    before = {c.pid for c in psutil.Process().children()}
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:judge", max_concurrency=4), on_error="zero")
    (child,) = [c.pid for c in psutil.Process().children() if c.pid not in before]
    with caplog.at_level("WARNING", logger="rl_align"):
        rewards, _, metrics = scorer.score(["x"] * 6 + ["hang"], _problems(7))
    assert rewards[-1] == 0.0 and metrics["reward/num_errors"] == 1.0
    assert max(rewards) == 4.0  # at most max_concurrency calls in flight, and that many were
    # The call was cancelled in the process (its own timeout), which goes on serving: not stopped by the parent.
    assert "the call was cancelled" in caplog.text and [c.pid for c in psutil.Process().children()
                                                        if c.pid not in before] == [child]  # fmt: skip
    scorer.close()


def test_an_async_error_cancels_the_batch_s_other_calls_before_the_next_batch(module):
    """A call left running after another raised finished during the next batch, into that batch's slots."""
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:slow_or_bad"))
    with pytest.raises(RewardFunctionError, match="ValueError: bad"):
        scorer.score(["sleep0.3", "bad"], _problems(2))
    assert scorer.score(["a", "sleep0.6"], _problems(2))[0] == [1.0, 100.0]
    scorer.close()


def test_calls_past_the_limit_are_paid_for_a_few_times_a_batch_not_once_a_sample(module, monkeypatch, caplog):
    import rollout.rewards.isolation as isolation

    monkeypatch.setattr(isolation, "_SLACK_S", 0.2)
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:sleepy"), on_error="zero", timeout_s=0.3)
    with caplog.at_level("WARNING", logger="rl_align"):
        rewards, _, metrics = scorer.score(["hang"] * 6 + ["ab"], _problems(7))
    assert rewards == [0.0] * 7 and metrics["reward/num_errors"] == 7.0
    assert f"{isolation.MAX_STALLS_PER_BATCH} calls of this term in this batch took longer than" in caplog.text
    assert scorer.score(["ab"], _problems(1))[0] == [2.0]  # the next batch is tried again
    scorer.close()


def test_close_during_a_batch_stops_it_at_once(module):
    import threading

    scorer = _scorer(FunctionRewardConfig(function=f"{module}:sleepy"), timeout_s=600.0)
    raised: list[BaseException] = []

    def scoring() -> None:
        try:
            scorer.score(["hang"], _problems(1))
        except BaseException as e:  # noqa: BLE001
            raised.append(e)

    thread = threading.Thread(target=scoring)
    thread.start()
    time.sleep(1.0)
    scorer.close()
    thread.join(30)
    assert not thread.is_alive() and isinstance(raised[0], RuntimeError) and "closed" in str(raised[0])


def test_the_process_dies_with_its_parent_even_inside_a_call_that_holds_the_interpreter(tmp_path):
    """A backtracking regex holds the interpreter's lock: a watching thread never ran, and the process spun on,
    parentless, after its rollout worker was killed."""
    script = textwrap.dedent("""
        import os, threading, time, psutil
        from rollout.rewards import FormatRewardConfig, RewardConfig, RewardScorer
        from rollout.tasks import Problem

        scorer = RewardScorer.from_config(RewardConfig(terms=[FormatRewardConfig(pattern=r"(a+)+")]))
        threading.Thread(target=scorer.score, args=(["a" * 60 + "b"], [Problem("q", "1", "p")]), daemon=True).start()
        time.sleep(1.0)
        print(*[c.pid for c in psutil.Process().children()], flush=True)
        os._exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    (pid,) = [int(p) for p in done.stdout.split()]
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the reward process outlived its parent"
        time.sleep(0.1)


def test_the_process_cpu_is_counted_and_close_stops_it(module):
    before = {c.pid for c in psutil.Process().children()}
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:busy"))
    scorer.cpu_lap()
    scorer.score(["a", "b"], _problems(2))
    assert scorer.cpu_lap() >= 0.5
    ours = [c for c in psutil.Process().children() if c.pid not in before]
    assert len(ours) == 1 and "rollout.rewards.reward_process" in " ".join(ours[0].cmdline())
    scorer.close()
    assert not any(psutil.pid_exists(c.pid) for c in ours)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["a"], _problems(1))


def test_max_concurrency_of_a_plain_function_is_warned_about_as_unused(module, caplog):
    with caplog.at_level("WARNING", logger="rl_align"):
        FunctionRewardConfig(function=f"{module}:judge", max_concurrency=4).check_importable()
        assert not caplog.records
        FunctionRewardConfig(function=f"{module}:sleepy", max_concurrency=4).check_importable()
    assert "max_concurrency = 4 is unused, as 'rl_align_test_isolated_rewards:sleepy' is no async function" in (
        caplog.records[0].getMessage())


def test_a_process_that_died_between_batches_is_replaced_without_failing_a_sample(module):
    before = {c.pid for c in psutil.Process().children()}
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:sleepy"))
    assert scorer.score(["a"], _problems(1))[0] == [1.0]
    (child,) = [c for c in psutil.Process().children() if c.pid not in before]
    child.kill()
    child.wait()
    rewards, _, metrics = scorer.score(["ab", "abc"], _problems(2))
    assert rewards == [2.0, 3.0] and metrics["reward/num_errors"] == 0.0
    scorer.close()


def test_an_async_function_runs_on_one_event_loop_across_batches(module):
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:loops_seen"))
    scorer.score(["a", "b"], _problems(2))
    assert scorer.score(["c"], _problems(1))[0] == [1.0]
    scorer.close()


def test_a_judge_whose_thread_never_returns_fails_that_sample_and_the_batch_goes_on(module):
    """The thread kept asyncio.run from returning after every sample was done: the batch then failed as a whole,
    on_error = 'zero' or not."""
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:threaded"), on_error="zero")
    rewards, _, metrics = scorer.score(["hang", "a"], _problems(2))
    assert rewards == [0.0, 1.0] and metrics["reward/num_errors"] == 1.0
    assert scorer.score(["b"], _problems(1))[0] == [1.0]
    scorer.close()


def test_an_exception_type_is_logged_once_over_the_processes_that_replace_each_other(module, caplog):
    scorer = _scorer(FunctionRewardConfig(function=f"{module}:dies_or_raises"), on_error="zero")
    with caplog.at_level("WARNING", logger="rl_align"):
        rewards, _, _ = scorer.score(["bad", "die", "bad", "die", "bad", "a"], _problems(6))
    assert rewards == [0.0] * 5 + [1.0]
    assert sum("ValueError: bad" in r.getMessage() for r in caplog.records) == 1, caplog.text
    scorer.close()
