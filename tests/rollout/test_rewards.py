"""Reward terms on hand-made cases: math-verify equivalences, exact match, format, user functions and their errors."""

from __future__ import annotations

import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from common.config import Config, ConfigError, validate_config
from rollout.rewards import (
    ExactMatchRewardConfig,
    FormatRewardConfig,
    FunctionRewardConfig,
    MathRewardConfig,
    RewardConfig,
    RewardFunctionError,
    RewardScorer,
    resolve_function,
)
from rollout.tasks import Problem

USER_MODULE = "rl_align_test_user_rewards"


def _problem(answer: str, problem_id: str = "p0") -> Problem:
    return Problem(prompt=[{"role": "user", "content": "q"}], answer=answer, problem_id=problem_id)


def _scorer(*terms, on_error: str = "fail") -> RewardScorer:
    return RewardScorer.from_config(RewardConfig(terms=list(terms), on_error=on_error))


@pytest.fixture(scope="module")
def math_scorer() -> Iterator[RewardScorer]:
    """One scorer (one reward process) for the module's math cases."""
    scorer = _scorer(MathRewardConfig())
    yield scorer
    scorer.close()


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / f"{USER_MODULE}.py").write_text(
        textwrap.dedent(
            """
            def length(completion, problem):
                return float(len(completion))

            def boom(completion, problem):
                if completion == "bad":
                    raise KeyError("no such thing")
                return 1.0

            def not_a_number(completion, problem):
                return "high"

            def is_answer(completion, problem):
                return completion == problem.answer

            def held(completion, problem):  # a number another library holds: a 0-d tensor, a Decimal, an array
                import decimal

                import numpy as np
                import torch

                return {"t": torch.tensor(0.5), "d": decimal.Decimal("0.25"), "a": np.array([2.0]),
                        "many": torch.ones(2), "c": 1j}[completion]

            NOT_CALLABLE = 3
            """
        )
    )
    (tmp_path / "rl_align_test_broken_dep.py").write_text("import rl_align_test_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (USER_MODULE, "rl_align_test_broken_dep"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return USER_MODULE


@pytest.mark.parametrize(
    "answer, completion",
    [
        ("1/2", "0.5"),
        ("0.5", "The answer is $\\frac{1}{2}$."),
        ("\\frac{1}{2}", "\\boxed{0.5}"),
        ("1234", "1,234"),
        ("579", "579<|im_end|>"),
        ("579", "First 123 + 456, so 579"),
        ("-7", "-7"),
        ("2\\sqrt{2}", "$\\sqrt{8}$"),
        ("(1, 2)", "the open interval $(1, 2)$"),
        ("x^2+1", "$1 + x^2$"),
    ],
)
def test_math_equivalent_answers_score_one(math_scorer, answer, completion):
    rewards, terms, _ = math_scorer.score([completion], [_problem(answer)])
    assert rewards == terms["math"] == [1.0]


@pytest.mark.parametrize(
    "answer, completion", [("1/2", "0.25"), ("579", "578"), ("579", ""), ("579", "no idea"), ("2\\sqrt{2}", "2")]
)
def test_math_wrong_answers_score_zero(math_scorer, answer, completion):
    assert math_scorer.score([completion], [_problem(answer)])[0] == [0.0]


def test_math_reference_that_cannot_be_read_is_an_error(math_scorer):
    with pytest.raises(ValueError, match=r"cannot read the reference answer '\?\?\?' of problem 'p0'"):
        math_scorer.score(["1"], [_problem("???")])


def test_math_off_the_main_thread():
    # math-verify's SIGALRM timeout only works on the main thread; the scorer must still work in worker threads.
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(_scorer(MathRewardConfig()).score(["0.5", "3"], [_problem("1/2")] * 2)[0])
    )
    thread.start()
    thread.join()
    assert result == [[1.0, 0.0]]


def test_exact_match_normalises_case_and_whitespace():
    scorer = _scorer(ExactMatchRewardConfig())
    rewards, _, _ = scorer.score(
        ["  Paris ", "paris\n<|im_end|>", "PARIS  France", "Lyon"],
        [_problem("Paris"), _problem("Paris"), _problem("paris france"), _problem("Paris")],
    )
    assert rewards == [1.0, 1.0, 1.0, 0.0]
    assert _scorer(ExactMatchRewardConfig(case_sensitive=True)).score(["paris"], [_problem("Paris")])[0] == [0.0]


def test_exact_match_extracts_the_last_match():
    scorer = _scorer(ExactMatchRewardConfig(extract_pattern=r"Answer:\s*(\S+)"))
    rewards, _, _ = scorer.score(
        ["Answer: 3 ... Answer: 42", "42", "Answer: 41"], [_problem("42"), _problem("42"), _problem("42")]
    )
    assert rewards == [1.0, 0.0, 0.0]


def test_format_fullmatch_and_search():
    full = _scorer(FormatRewardConfig(pattern=r"\d+"))
    assert full.score(["123", " 123\n", "123 apples", "<|im_end|>"], [_problem("1")] * 4)[0] == [1.0, 1.0, 0.0, 0.0]
    search = _scorer(FormatRewardConfig(pattern=r"<answer>.*</answer>", mode="search"))
    assert search.score(["x <answer>a\nb</answer> y", "<answer>"], [_problem("1")] * 2)[0] == [1.0, 0.0]


def test_weighted_sum_terms_and_metrics():
    scorer = _scorer(
        MathRewardConfig(),
        FormatRewardConfig(name="digits_only", pattern=r"\d+", weight=0.25),
        FormatRewardConfig(name="short", pattern=r".{0,3}", weight=-1.0),
    )
    rewards, terms, metrics = scorer.score(["12", "12 ok", "13"], [_problem("12")] * 3)
    assert terms == {"math": [1.0, 1.0, 0.0], "digits_only": [1.0, 0.0, 1.0], "short": [1.0, 0.0, 1.0]}
    assert rewards == pytest.approx([0.25, 1.0, -0.75])
    assert metrics == {"reward/math/num_errors": 0.0, "reward/digits_only/num_errors": 0.0,
                       "reward/short/num_errors": 0.0, "reward/num_errors": 0.0}  # means come from sample_metrics
    assert scorer.term_names == ["math", "digits_only", "short"]


def test_user_function_scores(user_module):
    scorer = _scorer(FunctionRewardConfig(function=f"{user_module}:length"), FunctionRewardConfig(
        name="hit", function=f"{user_module}:is_answer", weight=2.0))
    rewards, terms, _ = scorer.score(["abc", "7<|im_end|>"], [_problem("7"), _problem("7")])
    # The stop-token text is stripped before any term sees the completion.
    assert terms == {"function": [3.0, 1.0], "hit": [0.0, 1.0]}
    assert rewards == [3.0, 3.0]


def test_user_function_error_fails_naming_the_sample(user_module):
    scorer = _scorer(FunctionRewardConfig(function=f"{user_module}:boom"), on_error="fail")
    problems = [_problem("1", "good-one"), _problem("1", "arith-train-17")]
    with pytest.raises(RewardFunctionError) as info:
        scorer.score(["ok", "bad"], problems)
    message = str(info.value)
    assert f"'{user_module}:boom'" in message and "problem 'arith-train-17' with completion 'bad'" in message
    assert "KeyError" in message and "on_error = 'zero'" in message
    # Raised in the reward process: its traceback comes along as a note.
    assert 'raise KeyError("no such thing")' in "".join(info.value.__notes__)


def test_user_function_error_scores_zero_and_is_counted(user_module, caplog):
    """Each exception type is logged once with its traceback and sample: counted alone, nobody saw why."""
    scorer = _scorer(
        FunctionRewardConfig(function=f"{user_module}:boom"),
        FunctionRewardConfig(name="nan", function=f"{user_module}:not_a_number"),
        on_error="zero",
    )
    with caplog.at_level("WARNING", logger="rl_align"):
        rewards, terms, metrics = scorer.score(["ok", "bad", "bad"], [_problem("1")] * 3)
        scorer.score(["bad"], [_problem("1")])
    logged = [r for r in caplog.records if "failed on" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in logged] == ["reward term 'function'", "reward term 'nan'"]
    assert "KeyError" in logged[0].getMessage() and 'raise KeyError("no such thing")' in logged[0].getMessage()
    assert terms["function"] == [1.0, 0.0, 0.0] and terms["nan"] == [0.0, 0.0, 0.0]
    assert rewards == [1.0, 0.0, 0.0]
    assert metrics["reward/function/num_errors"] == 2.0
    assert metrics["reward/nan/num_errors"] == 3.0
    assert metrics["reward/num_errors"] == 5.0


def test_a_number_held_by_a_tensor_decimal_or_array_is_a_reward_and_several_are_not(user_module):
    scorer = _scorer(FunctionRewardConfig(function=f"{user_module}:held"))
    assert scorer.score(["t", "d", "a"], [_problem("1")] * 3)[0] == [0.5, 0.25, 2.0]
    for bad, why in (("many", "which is no single real number"), ("c", "of type complex")):
        with pytest.raises(RewardFunctionError, match=why):
            scorer.score([bad], [_problem("1")])


def test_non_number_return_fails_in_fail_mode(user_module):
    scorer = _scorer(FunctionRewardConfig(function=f"{user_module}:not_a_number"))
    with pytest.raises(RewardFunctionError, match="returned 'high' of type str; a reward function must return a"):
        scorer.score(["x"], [_problem("1")])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("rl_align_no_such_module:f", "module 'rl_align_no_such_module' not found"),
        ("rl_align_no_such_pkg.sub:f", "module 'rl_align_no_such_pkg.sub' not found"),
        (f"{USER_MODULE}:missing", f"'{USER_MODULE}' .* has no attribute 'missing'; callables there: .*'length'"),
        (f"{USER_MODULE}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
        ("rl_align_test_broken_dep:f", "importing module 'rl_align_test_broken_dep' failed: No module named "
         "'rl_align_test_missing_dependency'"),
        ("no_colon", "expected 'package.module:name', e.g. 'my_rewards:length_penalty'"),
        ("my_pkg/rewards.py:f", "name the module with dots, as Python imports it .'my_pkg.rewards:f'"),
    ],
)
def test_bad_function_spec_fails_at_build_time(user_module, spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_function(spec)
    if ":" in spec:
        with pytest.raises(ValueError, match=message):
            RewardScorer.from_config(RewardConfig(terms=[FunctionRewardConfig(function=spec)]))


class _Recipe(Config):
    reward: RewardConfig = RewardConfig()


@pytest.mark.parametrize(
    "reward, field, message",
    [
        ({"terms": [{"type": "function", "function": "no colon"}]}, "reward.terms[0].function", "'package.mod"),
        ({"terms": [{"type": "format", "pattern": "("}]}, "reward.terms[0].pattern", "not a valid Python regex"),
        ({"terms": [{"type": "exact_match", "extract_pattern": "[a"}]}, "reward.terms[0].extract_pattern", "regex"),
        ({"terms": [{"type": "math"}, {"type": "math", "weight": 2.0}]}, "reward", "share the name(s) ['math']"),
        ({"terms": []}, "reward.terms", "at least 1 item"),
        ({"terms": [{"type": "bleu"}]}, "reward.terms[0]", "no type 'bleu': set type = one of 'math', 'exact_match'"),
        ({"on_error": "ignore"}, "reward.on_error", "'fail' or 'zero'"),
        ({"terms": [{"type": "reward_model"}]}, "reward.terms[0].path", "required field is missing"),
        ({"terms": [{"type": "math", "name": "a/b"}]}, "reward.terms[0].name", "should match pattern"),
        ({"terms": [{"type": "math", "name": ""}]}, "reward.terms[0].name", "should match pattern"),
    ],
)
def test_bad_reward_configs_name_the_field(reward, field, message):
    with pytest.raises(ConfigError) as info:
        validate_config(_Recipe, {"reward": reward}, source="r.toml")
    text = str(info.value)
    assert f"  - {field}" in text and message in text


def test_default_reward_is_math():
    scorer = RewardScorer.from_config(RewardConfig())
    assert scorer.term_names == ["math"]
    assert scorer.score(["46"], [_problem("46")])[0] == [1.0]


def test_mismatched_lengths_are_rejected(math_scorer):
    with pytest.raises(ValueError, match="2 completions but 1 problems"):
        math_scorer.score(["1", "2"], [_problem("1")])


def test_reward_config_round_trips_through_toml():
    import tomllib

    from common.config import to_toml

    recipe = _Recipe(
        reward=RewardConfig(
            terms=[MathRewardConfig(), FormatRewardConfig(name="fmt", pattern=r"^\d+$", weight=0.1)], on_error="zero"
        )
    )
    assert validate_config(_Recipe, tomllib.loads(to_toml(recipe))) == recipe


def test_overlong_penalty_is_dapos_soft_punishment():
    from rollout.rewards.scorer import overlong_penalty

    # L_max = 20, L_cache = 5: free up to 15 tokens, then linear to -1 at 20.
    assert [overlong_penalty(n, 20, 5) for n in (1, 15, 16, 18, 20, 25)] == [0.0, 0.0, -0.2, -0.6, -1.0, -1.0]


def test_overlong_term_adds_to_the_reward_by_length():
    from rollout.rewards.config import OverlongPenaltyConfig

    config = RewardConfig(terms=[MathRewardConfig()], overlong=OverlongPenaltyConfig(cache_tokens=4, weight=0.5))
    scorer = RewardScorer.from_config(config)
    rewards, terms, _ = scorer.score(["12", "12", "13"], [_problem("12")] * 3, num_tokens=[3, 8, 10], max_tokens=10)
    assert terms["overlong"] == [0.0, -0.5, -1.0]
    assert rewards == pytest.approx([1.0, 1.0 - 0.25, 0.0 - 0.5])
    assert scorer.term_names == ["math", "overlong"]
    with pytest.raises(ValueError, match="token count"):
        scorer.score(["12"], [_problem("12")])
