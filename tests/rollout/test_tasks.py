"""Tasks and the prompt dataset: arithmetic generation, held-out disjointness, JSONL loading, seeded shuffle, resume."""

from __future__ import annotations

import json

import pytest

from common.config import Config, ConfigError, validate_config
from rollout.tasks import ArithmeticTaskConfig, JsonlTaskConfig, Problem, PromptDataset, TaskConfig, build_dataset
from rollout.tasks.arithmetic import generate_arithmetic
from rollout.tasks.config import arithmetic_capacity


class _Recipe(Config):
    task: TaskConfig = ArithmeticTaskConfig()


def _key(p: Problem) -> tuple:
    return p.metadata["a"], p.metadata["op"], p.metadata["b"]


def test_arithmetic_is_deterministic_and_correct():
    config = ArithmeticTaskConfig(operators=["+", "-", "*"], max_digits=3, num_train_problems=300, num_eval_problems=50)
    train, held_out = generate_arithmetic(config)
    again = generate_arithmetic(config)
    assert (train, held_out) == again
    other_seed = generate_arithmetic(config.model_copy(update={"seed": 1}))
    assert [p.answer for p in other_seed[0]] != [p.answer for p in train]
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for p in train + held_out:
        a, op, b = _key(p)
        assert p.answer == p.solution == str(ops[op](a, b))
        assert p.prompt == [{"role": "user", "content": f"What is {a} {op} {b}?"}]
        assert 0 <= a < 1000 and 0 <= b < 1000
        assert int(p.answer) >= 0  # allow_negative is off
    assert {p.metadata["op"] for p in train} == {"+", "-", "*"}
    ids = [p.problem_id for p in train + held_out]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_out_never_overlaps_train(seed):
    # Ask for half of the whole problem space, so collisions would be frequent if the split leaked.
    config = ArithmeticTaskConfig(
        max_digits=1, operators=["+", "*"], num_train_problems=80, num_eval_problems=20, seed=seed
    )
    assert arithmetic_capacity(config) == 200
    train, held_out = generate_arithmetic(config)
    train_keys, eval_keys = {_key(p) for p in train}, {_key(p) for p in held_out}
    assert len(train_keys) == 80 and len(eval_keys) == 20
    assert not train_keys & eval_keys


def test_system_prompt_and_template():
    config = ArithmeticTaskConfig(system_prompt="Reply with the number only.", prompt_template="{a}{op}{b}=")
    problem = build_dataset(config).eval_problems()[0]
    a, op, b = _key(problem)
    assert problem.prompt == [
        {"role": "system", "content": "Reply with the number only."},
        {"role": "user", "content": f"{a}{op}{b}="},
    ]


def test_negative_results_when_allowed():
    config = ArithmeticTaskConfig(operators=["-"], allow_negative=True, num_train_problems=500, num_eval_problems=0)
    train, _ = generate_arithmetic(config)
    assert any(int(p.answer) < 0 for p in train)


@pytest.mark.parametrize(
    "task, field, message",
    [
        ({"type": "arithmetic", "max_digits": 1, "num_train_problems": 1000}, "task", "give only"),
        ({"type": "arithmetic", "min_digits": 3, "max_digits": 2}, "task", "larger than max_digits"),
        ({"type": "arithmetic", "prompt_template": "What is {x}?"}, "task.prompt_template", "not a valid template"),
        ({"type": "arithmetic", "operators": ["/"]}, "task.operators[0]", "'+'"),
        ({"type": "arithmetic", "operators": ["+", "+"]}, "task", "duplicates"),
        ({"type": "csv"}, "task", "no type 'csv': set type = one of 'arithmetic', 'jsonl'"),
        ({"type": "jsonl", "path": "a.jsonl", "eval_path": "b.jsonl", "num_eval_problems": 3}, "task", "not both"),
        ({"type": "arithmetic", "num_train_problems": "10"}, "task.num_train_problems", "valid integer"),
        ({"max_digits": 3}, "task", "no type: set type = one of 'arithmetic', 'jsonl' (its keys fit type = "
                                    "'arithmetic')"),
    ],
)
def test_bad_task_configs_name_the_field(task, field, message):
    with pytest.raises(ConfigError) as info:
        validate_config(_Recipe, {"task": task}, source="recipe.toml")
    text = str(info.value)
    # common.config reports a union member's model-level errors at "task.<tag>", field errors at "task.<field>".
    assert "recipe.toml" in text and f"  - {field}" in text and message in text


def test_task_union_picks_by_type(tmp_path):
    recipe = validate_config(_Recipe, {"task": {"type": "jsonl", "path": str(tmp_path / "x.jsonl")}})
    assert isinstance(recipe.task, JsonlTaskConfig)
    assert isinstance(_Recipe().task, ArithmeticTaskConfig)


def _drain(dataset: PromptDataset, sizes: list[int]) -> list[str]:
    return [p.problem_id for n in sizes for p in dataset.next_batch(n)]


def test_epochs_are_seeded_permutations():
    config = ArithmeticTaskConfig(num_train_problems=50, num_eval_problems=5)
    dataset = build_dataset(config)
    epoch0, epoch1 = _drain(dataset, [50]), _drain(dataset, [50])
    assert sorted(epoch0) == sorted(epoch1) == sorted(p.problem_id for p in generate_arithmetic(config)[0])
    assert epoch0 != epoch1
    assert dataset.epoch == 1
    same_seed = build_dataset(config)
    assert _drain(same_seed, [7, 13, 30, 50]) == epoch0 + epoch1
    assert _drain(build_dataset(config.model_copy(update={"seed": 3})), [50]) != epoch0


@pytest.mark.parametrize("cut", [0, 1, 3, 5])
def test_resume_continues_exactly(cut):
    config = ArithmeticTaskConfig(num_train_problems=20, num_eval_problems=2)
    sizes = [3, 7, 4, 11, 9, 2]  # crosses several epoch boundaries mid-batch
    uninterrupted = _drain(build_dataset(config), sizes)
    first = build_dataset(config)
    head = _drain(first, sizes[:cut])
    state = json.loads(json.dumps(first.state_dict()))  # must survive a checkpoint round trip
    resumed = build_dataset(config)
    resumed.load_state_dict(state)
    assert resumed.stream_position == first.stream_position == sum(sizes[:cut])  # the group ids a resume goes on with
    assert head + _drain(resumed, sizes[cut:]) == uninterrupted
    assert resumed.stream_position == sum(sizes)


def test_resume_into_a_different_dataset_is_refused():
    dataset = build_dataset(ArithmeticTaskConfig(num_train_problems=20, num_eval_problems=2))
    dataset.next_batch(5)
    other = build_dataset(ArithmeticTaskConfig(num_train_problems=20, num_eval_problems=2, seed=9))
    with pytest.raises(ValueError, match="does not match this dataset"):
        other.load_state_dict(dataset.state_dict())


def test_eval_problems_stay_out_of_the_training_stream():
    dataset = build_dataset(ArithmeticTaskConfig(num_train_problems=30, num_eval_problems=10))
    seen = set(_drain(dataset, [30, 30]))
    held_out = [p.problem_id for p in dataset.eval_problems()]
    assert len(held_out) == 10 and not seen & set(held_out)
    assert held_out == [p.problem_id for p in dataset.eval_problems()]


def test_sft_examples_come_from_train_and_end_with_eos():
    dataset = build_dataset(ArithmeticTaskConfig(num_train_problems=10, num_eval_problems=5))
    before = dataset.state_dict()
    examples = dataset.sft_examples(25, eos_text="<|im_end|>")
    assert len(examples) == 25 and dataset.state_dict() == before
    eval_ids = {p.problem_id for p in dataset.eval_problems()}
    for problem, completion in examples:
        assert problem.problem_id not in eval_ids
        assert completion == problem.answer + "<|im_end|>"
    assert len({p.problem_id for p, _ in examples}) == 10  # cycles through the whole training set
    assert examples == dataset.sft_examples(25, eos_text="<|im_end|>")


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return str(path)


def test_jsonl_fields_prompts_and_split(tmp_path):
    records = [{"q": f"What is {i} + 1?", "a": i + 1, "uid": f"q{i}", "sol": f"{i} + 1 = {i + 1}"} for i in range(30)]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    records[3] = {"q": messages, "a": "4", "uid": "m", "sol": "4"}
    path = _write_jsonl(tmp_path / "data.jsonl", records)
    config = JsonlTaskConfig(
        path=path, prompt_field="q", answer_field="a", id_field="uid", solution_field="sol",
        system_prompt="Answer briefly.", num_eval_problems=6, seed=1,
    )
    dataset = build_dataset(config)
    held_out = dataset.eval_problems()
    train_ids = {p.problem_id for p in dataset.next_batch(len(dataset))}
    assert len(held_out) == 6 and len(train_ids) == 24 and not train_ids & {p.problem_id for p in held_out}
    assert [p.problem_id for p in build_dataset(config).eval_problems()] == [p.problem_id for p in held_out]
    by_id = {p.problem_id: p for p in [*held_out, *build_dataset(config).next_batch(24)]}
    assert by_id["q5"].prompt == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 5 + 1?"},
    ]
    assert by_id["q5"].answer == "6" and by_id["q5"].solution == "5 + 1 = 6"
    assert by_id["m"].prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def test_jsonl_eval_file_and_default_ids(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2"}])
    held_out = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "r", "answer": "3"}])
    dataset = build_dataset(JsonlTaskConfig(path=train, eval_path=held_out))
    assert sorted(p.problem_id for p in dataset.next_batch(2)) == ["train.jsonl:1", "train.jsonl:2"]
    (problem,) = dataset.eval_problems()
    assert problem.problem_id == "held-out:eval.jsonl:1" and problem.prompt == [{"role": "user", "content": "r"}]
    assert dataset.sft_examples(1, "</s>")[0][1] in ("1</s>", "2</s>")
    # train/data.jsonl beside eval/data.jsonl: default ids collided, an error about ids the user never chose
    (tmp_path / "train").mkdir(), (tmp_path / "eval").mkdir()
    same = [_write_jsonl(tmp_path / d / "data.jsonl", [{"prompt": "p", "answer": "1"}]) for d in ("train", "eval")]
    dataset = build_dataset(JsonlTaskConfig(path=same[0], eval_path=same[1]))
    assert [p.problem_id for p in dataset.eval_problems()] == ["held-out:data.jsonl:1"]


def test_jsonl_rows_keep_their_other_keys_for_rewards_and_refuse_half_characters(tmp_path):
    """Extra keys were dropped (a reward needing test cases had no way to them); a lone surrogate escape passed every
    check and crashed the first batch in the tokenizer, naming no row."""
    row = {"prompt": "p", "answer": "1", "id": "a", "tests": [{"in": 1, "out": 2}], "tolerance": 0.1}
    dataset = build_dataset(JsonlTaskConfig(path=_write_jsonl(tmp_path / "d.jsonl", [row]), id_field="id"))
    (problem,) = dataset.all_problems()
    assert problem.metadata == {"tests": [{"in": 1, "out": 2}], "tolerance": 0.1}
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "ok", "answer": 1}\n{"prompt": [{"role": "user", "content": "1 + \\ud83d?"}], '
                    '"answer": 1}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: key 'prompt\[0\].content' holds a lone UTF-16 surrogate"):
        build_dataset(JsonlTaskConfig(path=str(path)))


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "p"}'], r"data.jsonl:1: missing key 'answer'"),
        (['{"prompt": "p", "answer": "1"}', "{oops"], r"data.jsonl:2: not valid JSON"),
        (['["p", "1"]'], r"data.jsonl:1: expected a JSON object"),
        (['{"prompt": 5, "answer": "1"}'], r"'prompt' must be non-empty text or a non-empty list"),
        (['{"prompt": "p", "answer": null}'], r"must be a string or a number"),
        ([""], r"holds no problems"),
        # Accepted before: an empty prompt, a role no template knows.
        (['{"prompt": "  ", "answer": "1"}'], r"data.jsonl:1: 'prompt' must be non-empty text"),
        (['{"prompt": [{"role": "robot", "content": "p"}], "answer": "1"}'], r"roles: system, user, assistant, tool"),
        # A traceback (RecursionError), and an error naming no file or line (Python's digit limit), before.
        (['{"prompt": "p", "answer": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"],
         r"data.jsonl:1: JSON nested too deeply to read"),
        (['{"prompt": "p", "answer": ' + "9" * 5000 + "}"], r"data.jsonl:1: not valid JSON \(Exceeds the limit"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        build_dataset(JsonlTaskConfig(path=str(path)))


def test_jsonl_missing_file_and_duplicate_ids(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_dataset(JsonlTaskConfig(path=str(tmp_path / "none.jsonl")))
    records = [{"prompt": "p", "answer": "1", "id": 1}, {"prompt": "q", "answer": "2", "id": 1}]
    path = _write_jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(ValueError, match=r"d.jsonl:2: problem id '1' is also the id of .*d.jsonl:1; ids must be"):
        build_dataset(JsonlTaskConfig(path=path, id_field="id"))
    with pytest.raises(ValueError, match="leave some for training"):
        build_dataset(JsonlTaskConfig(path=path, num_eval_problems=2))


def test_jsonl_ids_must_be_given_and_solutions_may_be_transcripts(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1", "id": None}])
    with pytest.raises(ValueError, match="d.jsonl:1: 'id' must be a non-empty string or an integer, got None"):
        build_dataset(JsonlTaskConfig(path=path, id_field="id"))  # was the id "None"
    transcript = [{"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
                  {"role": "tool", "content": "1"}, {"role": "assistant", "content": "1"}]  # fmt: skip
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "1", "solution": transcript}])
    [problem] = build_dataset(JsonlTaskConfig(path=path, solution_field="solution")).sft_examples(1, "</s>")
    assert problem[1] == transcript  # README promised transcripts; the reader refused anything but a string
    path = _write_jsonl(tmp_path / "u.jsonl", [{"prompt": "p", "answer": "1", "solution": transcript[1:]}])
    with pytest.raises(ValueError, match="starts and ends with an assistant turn"):
        build_dataset(JsonlTaskConfig(path=path, solution_field="solution"))


def test_held_out_rows_need_no_solution(tmp_path):
    """``solution_field`` made the eval file need it too ("missing key 'sol'"), though evaluation trains on nothing."""
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "answer": "1", "sol": "1"}])
    held_out = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "q", "answer": "2"}])
    dataset = build_dataset(JsonlTaskConfig(path=train, eval_path=held_out, solution_field="sol"))
    assert len(dataset) == 1 and dataset.first_problem().solution == "1"
    no_solution = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(ValueError, match="bad.jsonl:1: missing key 'sol'"):  # training rows still need one
        build_dataset(JsonlTaskConfig(path=no_solution, eval_path=held_out, solution_field="sol"))


def test_an_inherited_eval_path_can_be_dropped_for_a_split():
    config = validate_config(JsonlTaskConfig, {"path": "x.jsonl", "eval_path": False, "num_eval_problems": 3})
    assert config.eval_path is None and config.num_eval_problems == 3
    # In a recipe the task is a tagged union: `false` reaches the variant its `type` names.
    recipe = validate_config(_Recipe, {"task": {"type": "jsonl", "path": "x.jsonl", "eval_path": False}})
    assert isinstance(recipe.task, JsonlTaskConfig) and recipe.task.eval_path is None


def test_task_config_round_trips_through_toml():
    import tomllib

    from common.config import to_toml

    recipe = _Recipe(task=ArithmeticTaskConfig(operators=["*"], max_digits=3, prompt_template="{a} {op} {b} = ?"))
    assert validate_config(_Recipe, tomllib.loads(to_toml(recipe))) == recipe


def test_held_out_data_the_run_trains_on_is_refused_or_warned_about(tmp_path, caplog):
    """The training file given as eval_path passed as 40 training and 40 held-out problems (the default ids differ)."""
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"p{i}", "answer": "1"} for i in range(4)])
    with pytest.raises(ValueError, match=r"task.eval_path is task.path .*train.jsonl.*: every held-out problem would"):
        build_dataset(JsonlTaskConfig(path=train, eval_path=str(tmp_path / "." / "train.jsonl")))
    held_out = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "p1", "answer": "1"}, {"prompt": "x", "answer": "2"}])
    with caplog.at_level("WARNING", logger="rl_align"):
        build_dataset(JsonlTaskConfig(path=train, eval_path=held_out))
    assert "1 of the 2 held-out problems have the prompt of a training problem (the first at " in caplog.text
