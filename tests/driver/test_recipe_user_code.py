"""User code a recipe names (reward functions, tools) is imported and tried when the recipe loads or before the run
starts: a module that does not import, a name it lacks, a file path for a module, a function that returns no number."""

import pytest

from recipe import load_recipe
from tests.driver.recipe_checks import ROOT, broken_recipe, load_error, run_check


def _with_function_reward(text, spec):
    # No correctness term is left, so no held-out accuracy: the warm start stops by its step count alone.
    text = text.replace("stop_at_accuracy = 0.4", "stop_at_accuracy = false")
    return text.replace('type = "exact_match"', f'type = "function"\nfunction = "{spec}"')


def test_function_reward_whose_module_does_not_import_fails_at_check(tmp_path):
    path = broken_recipe(tmp_path, lambda t: _with_function_reward(t, "no_such_reward_module:score"))
    rc, err = run_check(["--recipe", str(path)])
    assert rc == 2 and "- reward.terms[0].function: reward function 'no_such_reward_module:score'" in err, err
    assert "module 'no_such_reward_module' not found" in err and str(path) in err, err


def test_function_reward_module_that_fails_inside_or_lacks_the_function_is_reported_at_load(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import no_such_dependency_of_it\n")
    (tmp_path / "ok_rewards.py").write_text("def score(completion, problem):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = broken_recipe(tmp_path, lambda t: _with_function_reward(t, "broken_rewards:score"))
    assert "importing module 'broken_rewards' failed" in load_error(broken)
    term = lambda spec: {"reward.terms": [{"type": "function", "function": spec}]}  # noqa: E731
    assert "has no attribute 'scor'" in load_error(broken, term("ok_rewards:scor"))
    load_recipe(broken, term("ok_rewards:score"))
    load_recipe(broken, check_paths=False)  # recipes for other machines validate anywhere


def test_a_reward_function_returning_no_number_fails_before_the_run_starts(tmp_path, monkeypatch, caplog):
    """A reward function that returns None (a forgotten ``return``) failed only at the first batch, after Ray and
    every actor had started: the preflight calls it once on the task's first problem."""
    from driver.preflight import check_data

    (tmp_path / "none_rewards.py").write_text("def score(completion, problem):\n    completion.strip()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = load_recipe(broken_recipe(tmp_path, lambda t: _with_function_reward(t, "none_rewards:score")))
    with pytest.raises(ValueError) as e:
        check_data(recipe)
    message = str(e.value)
    assert "function 'none_rewards:score' failed on the task's first problem" in message, message
    assert "returned None of type NoneType; a reward function must return a number" in message, message
    assert "checked before the run starts" in message and "reward.on_error = 'zero'" in message, message
    zero = recipe.model_copy(update={"reward": recipe.reward.model_copy(update={"on_error": "zero"})})
    with caplog.at_level("WARNING", logger="rl_align"):
        assert len(check_data(zero)) > 0  # the run would score such samples 0: said, not refused
    assert "function 'none_rewards:score' failed on the task's first problem" in caplog.text, caplog.text
    assert "returned None" in caplog.text and "such samples score 0" in caplog.text, caplog.text  # and how


def test_a_reward_function_that_never_returns_fails_before_the_run_starts(tmp_path, monkeypatch):
    """It hung the driver's preflight, and then every batch of the run, for good."""
    from driver.preflight import check_data

    (tmp_path / "hung_rewards.py").write_text("import time\ndef score(completion, problem):\n    time.sleep(1e6)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = load_recipe(broken_recipe(tmp_path, lambda t: _with_function_reward(t, "hung_rewards:score")),
                         {"reward.timeout_s": 1.0})  # fmt: skip
    with pytest.raises(ValueError, match=r"function 'hung_rewards:score' failed on the task's first problem .* "
                                         r"no result within reward.timeout_s = 1 s"):  # fmt: skip
        check_data(recipe)


def test_user_code_named_by_its_file_path_is_told_the_dotted_name(tmp_path):
    # class_path = "myenvs/fix.py:FixAnswer" got "module 'myenvs/fix.py' not found".
    path = broken_recipe(tmp_path, lambda t: _with_function_reward(t, "my_pkg/rewards.py:score"))
    assert "name the module with dots, as Python imports it ('my_pkg.rewards:score'" in load_error(path)


def test_a_users_tool_that_cannot_be_imported_fails_at_load_naming_its_place():
    msg = load_error(ROOT / "recipes" / "agent_calc_tiny.toml",
                     {"environment.tools": ["calculator", "tests.rollout.envs.user_tools:nope"]})  # fmt: skip
    assert "- environment.tools[1]: tool 'tests.rollout.envs.user_tools:nope'" in msg and "no attribute 'nope'" in msg
    agent = load_recipe(ROOT / "recipes" / "agent_openai_tiny.toml",
                        {"environment.warm_start_tools": ["tests.rollout.envs.user_tools:convert"]})  # fmt: skip
    assert agent.environment.warm_start_tools == ["tests.rollout.envs.user_tools:convert"]
