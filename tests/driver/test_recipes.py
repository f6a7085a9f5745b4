"""Every checked-in recipe validates; broken recipes fail at load naming the file and field; the CLI stays light."""

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, parse_overrides
from recipe import Recipe, load_recipe, write_resolved

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"grpo_tiny.toml", "ppo_tiny.toml", "dapo_tiny.toml", "gspo_tiny.toml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    recipe = load_recipe(path, check_paths=False)  # hardware recipes name model dirs of other machines
    assert isinstance(recipe, Recipe)
    assert recipe.rollout.model_path == recipe.model.path


def _broken(tmp_path, edit):
    text = (ROOT / "recipes" / "grpo_tiny.toml").read_text()
    path = tmp_path / "broken.toml"
    path.write_text(edit(text))
    return path


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
    path = _broken(tmp_path, edit)
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    msg = str(e.value)
    assert str(path) in msg and f"- {field}:" in msg and reason in msg, msg


def test_missing_model_dir_without_create_tiny_is_rejected(tmp_path):
    path = _broken(tmp_path, lambda t: t.split("[model.create_tiny]")[0] + "[algorithm]" + t.split("[algorithm]")[1])
    with pytest.raises(ConfigError, match="model.path .* has no config.json"):
        load_recipe(path, {"model.path": str(tmp_path / "nowhere")})


def test_cli_overrides_and_resolved_config_round_trip(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "grpo_tiny.toml", parse_overrides(["--trainer.optimizer.lr", "2e-5"]))
    assert recipe.trainer.optimizer.lr == 2e-5
    resolved = write_resolved(recipe, tmp_path)
    assert load_recipe(resolved) == recipe


def test_help_and_recipe_check_do_not_import_torch():
    code = (
        "import sys, rl_align; rc = rl_align.main(['--recipe', 'recipes/grpo_tiny.toml', '--check']);"
        "assert rc == 0; assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "[algorithm]" in out.stdout


def test_bad_recipe_exits_2_with_message(tmp_path):
    path = _broken(tmp_path, lambda t: t.replace("group_size = 8", "group_size = 1"))
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
