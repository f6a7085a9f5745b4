"""Environments without an engine: tool calls, the calculator, the tool and feedback environments, observation
rendering, and the recipe's [environment] section."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable

import pytest

from common.chat_turns import end_of_turn_id
from recipe import load_recipe
from rollout.envs import build_environment
from rollout.envs.builtin import FeedbackEnvironment, ToolEnvironment
from rollout.envs.config import CustomEnvConfig, FeedbackEnvConfig, ToolEnvConfig
from rollout.envs.tools import Tool, ToolOutput, calculate, format_tool_call, parse_tool_calls, strip_tool_calls
from rollout.tasks.problem import Problem
from rollout.tokenizer import render_continuation, render_prompt
from tools.tiny_tokenizer import build_tokenizer

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("expression, value", [
    ("123 * 456", "56088"), ("7 / 2", "3.5"), ("2 ** -2", "0.25"), ("-(3 + 4) * 2", "-14"), ("10 // 3", "3"),
    ("10 % 4", "2"), ("1.5 * 4", "6"), ("999999 * 999999", "999998000001"), ("1e-50", "1e-50"), ("0.1 + 0.2", "0.3"),
])  # fmt: skip
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('ls')", "only numbers"), ("2 ** 100", "at most 64"), ("1 / 0", "division by zero"),
    ("9 ** 64 * 9 ** 64", "more than 60 digits"), ("1 +", "cannot read"), ("x * 2", "only numbers"),
    ("1" * 300, "longer than 200"),
    # Model-written edge cases that raised other errors (and failed the whole batch) or ran for minutes on the loop:
    ("0 ** -1", "division by zero"), ("(1 - 1) ** -2", "division by zero"), ("0.0 ** -1", "division by zero"),
    ("1e999", "more than 60 digits"), ("(10 ** 59) ** -64", "more than 60 digits"),
    ("(((1 / 10 ** 59) ** 64) ** 64) ** 64", "more than 60 digits"),  # its denominator grew unbounded: 12 s
])  # fmt: skip
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, reason):
    with pytest.raises(ValueError, match=reason):
        calculate(expression)


def test_tool_calls_are_parsed_and_malformed_ones_named():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
            "<tool_call>[1]</tool_call><tool_call>{nope</tool_call><tool_call>")  # fmt: skip
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "1+2"}, True), ("calculator", {"expression": "3"}, True)]
    assert "string \"name\"" in calls[2].error and "not valid JSON" in calls[3].error
    assert "not closed" in calls[4].error and len(calls) == 5
    assert parse_tool_calls("The answer is 408.") == []


@pytest.mark.parametrize("body", [
    '{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}",  # past Python's int-string limit
    "[" * 3000 + "]" * 3000,  # nesting past the recursion limit
    '{"name": "calculator", "arguments": "' + "[" * 3000 + '"}',  # the same in string-encoded arguments
])
def test_tool_calls_python_cannot_read_are_malformed_calls_not_errors(body):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and not call.arguments


def test_a_formatted_call_parses_back_and_stripping_keeps_the_text_outside_closed_calls():
    call = format_tool_call("python", {"code": "print('</tool_call>')"})
    [parsed] = parse_tool_calls(f"Run it. {call}")
    assert (parsed.name, parsed.arguments, parsed.error) == ("python", {"code": "print('</tool_call>')"}, None)
    assert strip_tool_calls(f"a{call}b{call}c<tool_call>open") == "abc<tool_call>open"
    assert strip_tool_calls("<tool_call>x</tool_call></tool_call>") == "</tool_call>"


def test_many_unclosed_tool_calls_are_one_malformed_call():
    calls = parse_tool_calls("<tool_call>" * 20_000)  # a lazy regex rescanned the rest from every tag: minutes
    assert len(calls) == 1 and "not closed" in calls[0].error


def _step(env, text):
    return asyncio.run(env.step(text))


def test_tool_environment_answers_every_call_and_ends_on_an_answer():
    env = ToolEnvironment(ToolEnvConfig(tools=["calculator"], max_calls_per_turn=2))
    call = '<tool_call>{"name": "%s", "arguments": {"expression": "%s"}}</tool_call>'
    result = _step(env, call % ("calculator", "12*34") + call % ("search", "x") + call % ("calculator", "1"))
    assert [m["role"] for m in result.observation] == ["tool"] * 3 and not result.done
    assert result.observation[0]["content"] == "408"
    assert "no tool named 'search'" in result.observation[1]["content"]
    assert "at most 2 tool calls" in result.observation[2]["content"]
    assert result.info["tool_calls"] == 3 and result.info["tool_errors"] == 2
    bad = _step(env, call % ("calculator", "1/0"))
    assert bad.observation[0]["content"] == "calculator error: division by zero" and bad.info["tool_errors"] == 1
    assert _step(env, "408").done
    assert env.tools[0]["function"]["name"] == "calculator"


def _tool(name, run):
    return Tool(name, f"{name}, for tests", {"type": "object", "properties": {}}, run)


def test_a_tool_that_raises_or_returns_the_wrong_type_is_an_error_observation(caplog):
    # A user's tool (README's "Your own tool") that raised failed the episode (EpisodeFailed: ... step raised
    # ValueError: tool exploded) and by default the run; one returning a str: AttributeError: 'str' object has no
    # attribute 'text'. README and the class promise an error observation and the episode going on.
    async def explodes(arguments):
        raise ValueError("tool exploded")

    async def says_text(arguments):
        return "408"

    def not_async(arguments):
        return ToolOutput("408")

    async def number_text(arguments):
        return ToolOutput(408)

    async def fine(arguments):
        return ToolOutput(f"fine: {arguments['x']}")

    tools = [_tool("explodes", explodes), _tool("says_text", says_text), _tool("not_async", not_async),
             _tool("number_text", number_text), _tool("fine", fine)]  # fmt: skip
    env = ToolEnvironment(ToolEnvConfig(max_calls_per_turn=5), tools=tools)
    result = _step(env, "".join(format_tool_call(t.name, {"x": 1}) for t in tools))
    contents = [m["content"] for m in result.observation]
    assert contents == [
        "error: the tool 'explodes' failed (ValueError: tool exploded)",
        "error: the tool 'says_text' failed (it returned str, not a rollout.envs.tools.ToolOutput)",
        "error: the tool 'not_async' failed (it returned ToolOutput, not an awaitable: its run must be an async "
        "function)",
        "error: the tool 'number_text' failed (it returned a ToolOutput whose text is int, not str)",
        "fine: 1",
    ]
    assert not result.done and result.info["tool_calls"] == 5 and result.info["tool_errors"] == 4
    assert all(result.info[f"tool_calls/{t.name}"] == 1 for t in tools)
    # The tool's author hears of it (with the traceback), once per tool and kind of failure.
    _step(env, format_tool_call("explodes", {}))
    said = [r for r in caplog.records if "the tool 'explodes' failed" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None and "ToolEnvironment" in said[0].getMessage()


def test_a_sandbox_the_host_cannot_set_up_fails_the_episode_rather_than_answer_the_model():
    """The python tool on a host without user namespaces: an error observation at every call would train the model on
    a broken tool, the run going on; it fails the episode (and by default the run), naming the cause."""
    from rollout.envs.sandbox import SandboxUnavailableError

    async def no_namespaces(arguments):
        raise SandboxUnavailableError("user namespaces are disabled on this host")

    env = ToolEnvironment(ToolEnvConfig(), tools=[_tool("python", no_namespaces)])
    with pytest.raises(SandboxUnavailableError, match="user namespaces"):
        _step(env, format_tool_call("python", {"x": 1}))


def test_an_episode_goes_on_past_a_tool_that_raises():
    from tests.rollout.envs.scripted_engine import play
    from tests.rollout.envs.scripted_env import ScriptedToolCalls

    async def explodes(arguments):
        raise ValueError("tool exploded")

    env = ScriptedToolCalls(ToolEnvConfig(), [format_tool_call("explodes", {})], tools=[_tool("explodes", explodes)])
    episode = play(env)
    assert episode.num_turns == 2 and episode.finish_reason == "stop" and episode.info["tool_errors"] == 1


def test_feedback_depends_on_the_previous_answer():
    env = FeedbackEnvironment(FeedbackEnvConfig(max_turns=3, turn_penalty=-0.1))
    asyncio.run(env.reset(Problem(prompt="Guess", answer="42", problem_id="g")))
    low = _step(env, "17")
    assert "higher" in low.observation[0]["content"] and low.reward == -0.1 and not low.done
    high = _step(env, "50")
    assert "lower" in high.observation[0]["content"]
    assert _step(env, "44").done  # the last turn ends it, right or not
    env2 = FeedbackEnvironment(FeedbackEnvConfig(extract_pattern=r"Answer: (\d+)"))
    asyncio.run(env2.reset(Problem(prompt="Guess", answer="42", problem_id="g")))
    assert _step(env2, "I think... Answer: 42").done


def test_observations_render_as_template_continuations():
    tok = build_tokenizer()
    eot = end_of_turn_id(tok)
    assert tok.convert_ids_to_tokens(eot) == "<|im_end|>"
    history = [{"role": "user", "content": "What is 12 * 34?"}]
    turn = '<tool_call>{"name": "calculator"}</tool_call>'
    tool = [{"role": "tool", "content": "408"}]
    # prompt + model turn + end-of-turn + continuation == the template's rendering of the whole conversation
    ids = render_prompt(tok, history) + tok.encode(turn, add_special_tokens=False) + [eot]
    ids += render_continuation(tok, tool)
    whole = render_prompt(tok, [*history, {"role": "assistant", "content": turn}, *tool])
    assert ids == whole


def test_the_tiny_template_lists_tools_with_and_without_parameters():
    """A function without ``parameters`` (valid in OpenAI's API) failed to render: 'dict object' has no attribute."""
    calc = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
        "expression": {"type": "string"}}}}}  # fmt: skip
    now = {"type": "function", "function": {"name": "now"}}
    text = build_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tools=[calc, now], tokenize=False)
    assert "Tools: calc(expression) now()." in text


def test_the_recipe_environment_section_is_checked(tmp_path):
    base = ROOT / "recipes" / "grpo_tiny.toml"
    recipe = load_recipe(base, {"environment.type": "tools", "environment.tools": ["calculator", "python"]})
    assert isinstance(recipe.environment, ToolEnvConfig) and recipe.environment.max_turns == 4
    with pytest.raises(Exception, match="environment.tools"):
        load_recipe(base, {"environment.type": "tools", "environment.tools": ["browser"]})
    with pytest.raises(Exception, match="rollout.use_chat_template"):
        load_recipe(base, {"environment.type": "feedback", "rollout.use_chat_template": False})
    with pytest.raises(Exception, match="environment.max_total_tokens"):
        load_recipe(base, {"environment.type": "feedback", "environment.max_total_tokens": 4096})
    with pytest.raises(Exception, match="environment.class_path.*no_such_env_module"):
        load_recipe(base, {"environment.type": "custom", "environment.class_path": "no_such_env_module:Env"})
    # A synchronous step passed the check and failed at run time: object StepResult can't be used in 'await'.
    with pytest.raises(Exception, match="environment.class_path.*SynchronousStep.step is not an async"):
        load_recipe(base, {"environment.type": "custom",
                           "environment.class_path": "tests.rollout.envs.scripted_env:SynchronousStep"})


def test_a_custom_environment_is_built_with_its_options():
    config = CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:EchoObservations", options={"turns": 2})
    new = build_environment(config)
    first, second = new(), new()
    assert first is not second and first._turns == 2
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        build_environment(CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:Missing"))
    with pytest.raises(ValueError, match="expected 'package.module:name', e.g. 'my_envs:GuessNumber'"):
        CustomEnvConfig(class_path="no_colon")


@pytest.mark.parametrize("name, error", [
    ("SynchronousStep", r"'tests.rollout.envs.scripted_env:SynchronousStep': SynchronousStep.step is not an async "
                        r"method: write it `async def step\(self, text\)`"),
    ("SynchronousReset", r"SynchronousReset.reset is not an async method: write it `async def reset\(self, problem\)`"),
    ("DescribesToolObjects", r"'tests.rollout.envs.scripted_env:DescribesToolObjects': tools\[0\] is a "
                             r"rollout.envs.tools.Tool, not a mapping.*\(a Tool's description is Tool.schema\(\)"),
])  # fmt: skip
def test_a_custom_environment_that_cannot_run_is_refused_when_built(name, error):
    # A synchronous reset or step, or Tool objects as tools, passed --check and failed every episode at run time.
    with pytest.raises(ValueError, match=error):
        build_environment(CustomEnvConfig(class_path=f"tests.rollout.envs.scripted_env:{name}"))


def test_a_custom_environment_may_wrap_its_async_methods_and_compute_its_tools(monkeypatch):
    import functools

    import tests.rollout.envs.scripted_env as module
    from rollout.envs import Environment

    def logged(method):  # a plain function handing back the coroutine: awaitable as the runner awaits it
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            return method(*args, **kwargs)

        return wrapper

    class Wrapped(Environment):
        @logged
        async def reset(self, problem):
            return []

        async def step(self, text):
            return None

        @property
        def tools(self):  # computed per instance: checked when an episode runs
            return [object()]

    monkeypatch.setattr(module, "Wrapped", Wrapped, raising=False)
    assert build_environment(CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:Wrapped"))

    class HandsOn(Wrapped):  # a plain def that returns another coroutine, and says so, runs as it did
        def step(self, text) -> Awaitable[None]:
            return self._step(text)

        async def _step(self, text):
            return None

    monkeypatch.setattr(module, "HandsOn", HandsOn, raising=False)
    assert build_environment(CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:HandsOn"))

    class Abstract(Environment):  # step forgotten: "Can't instantiate abstract class" in every episode
        async def reset(self, problem):
            return []

    monkeypatch.setattr(module, "Abstract", Abstract, raising=False)
    with pytest.raises(ValueError, match="scripted_env:Abstract' leaves step abstract: define them"):
        build_environment(CustomEnvConfig(class_path="tests.rollout.envs.scripted_env:Abstract"))


def test_a_calculator_transcript_renders_as_the_template_renders_the_conversation():
    from rollout.envs.episode import render_transcript
    from rollout.tasks.arithmetic import calculator_transcript

    tok = build_tokenizer()
    env = ToolEnvironment(ToolEnvConfig(tools=["calculator"]))
    problem = Problem(prompt="What is 868 * 242?", answer="210056", problem_id="t")
    messages = asyncio.run(env.reset(problem))
    turns = calculator_transcript("868 * 242")
    assert turns[1] == {"role": "tool", "content": "210056"} and turns[2]["content"] == "210056"
    prompt = render_prompt(tok, messages, tools=env.tools)
    ids, mask = render_transcript(tok, turns, env.tools)
    whole = tok.encode(tok.apply_chat_template(messages + turns, tools=env.tools, tokenize=False),
                       add_special_tokens=False)  # fmt: skip
    assert prompt + ids.tolist() == whole[: len(prompt) + len(ids)]  # the template adds a newline after the last turn
    model = tok.decode(ids[mask == 1].tolist())
    assert model.count("<|im_end|>") == 2 and "210056" in model and "<|im_start|>tool" not in model
    assert "<|im_start|>tool\n210056" in tok.decode(ids[mask == 0].tolist())
    # What the environment makes of the transcript's call is the transcript's tool turn.
    assert asyncio.run(env.step(turns[0]["content"])).observation == [turns[1]]
    with pytest.raises(ValueError, match="start and end with an assistant"):
        render_transcript(tok, turns[:2], env.tools)


def test_a_users_tool_is_named_by_import_path_beside_the_built_ins():
    """``tools`` named the built-ins only: a tool of one's own needed a custom environment class, and an agent's
    warm start could not describe it at all."""
    from rollout.envs.tools import build_tool

    env = ToolEnvironment(ToolEnvConfig(tools=["calculator", "tests.rollout.envs.user_tools:convert"]))
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "convert"]
    call = '<tool_call>{"name": "convert", "arguments": {"value": 37, "from": "km", "to": "m"}}</tool_call>'
    assert _step(env, call).observation[0]["content"] == "37000"
    assert build_tool("tests.rollout.envs.user_tools:make_convert").name == "convert"  # a factory of one
    with pytest.raises(ValueError, match="tool 'tests.rollout.envs.user_tools:NOT_A_TOOL' is a int; it must be a "):
        build_tool("tests.rollout.envs.user_tools:NOT_A_TOOL")
    with pytest.raises(ValueError, match="name a built-in tool .calculator, python. or your own as 'package.module:"):
        ToolEnvConfig(tools=["convert"])
    with pytest.raises(ValueError, match="name the module with dots"):
        ToolEnvConfig(tools=["my_tools/convert.py:convert"])


def test_a_tool_cut_by_the_episodes_timeout_is_named(caplog, monkeypatch):
    # Hanging tools ended as env/num_timeouts with nothing naming the tool, and env/tool_s read 0.006 s.
    monkeypatch.setattr("rollout.envs.base._warned", set())

    async def hangs(arguments):
        await asyncio.sleep(60)

    env = ToolEnvironment(ToolEnvConfig(), tools=[_tool("lookup", hangs)])

    async def step_with_deadline():
        await asyncio.wait_for(env.step('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'), 0.2)

    with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError):
        asyncio.run(step_with_deadline())
    assert re.search(r"the tool 'lookup' was still running after [0-9.]+ s when the episode's timeout_s cut it",
                     caplog.text), caplog.text
