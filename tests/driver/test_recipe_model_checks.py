"""The model a recipe names, checked at load against the trainer's sharding, its LoRA settings and its own
config.json; for a model the run creates, what ``--check`` can see before it exists."""

from __future__ import annotations

from recipe import load_recipe
from tests.driver.recipe_checks import ROOT, load_error, run_check


def test_check_says_what_it_leaves_to_the_run_for_a_tiny_model_not_yet_created(tmp_path):
    """--check printed a bare "ok" where sharding and tokenizer checks of a model it cannot see were still to come."""
    rc, err = run_check(["--recipe", "recipes/grpo_tiny.toml", "--model.path", str(tmp_path / "tiny")])
    assert rc == 0 and "(nothing was started); the tiny model for" in err, err
    assert "checked against the trainer's sharding and the tokenizer once a run creates it" in err, err


def test_expert_parallel_the_model_cannot_take_fails_at_load_naming_the_field(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    moe = str(make_tiny_model(tmp_path / "moe", family="qwen3_moe", hidden_size=32, num_layers=1))  # 4 experts
    dense = str(make_tiny_model(tmp_path / "dense", family="qwen3", hidden_size=32, num_layers=1))
    recipe = ROOT / "recipes" / "grpo_tiny.toml"
    three = {"trainer.num_ranks": 3, "trainer.parallelism.expert_parallel_degree": 3}
    msg = load_error(recipe, {"model.path": moe, **three})
    assert "- trainer.parallelism.expert_parallel_degree: " in msg and "does not divide the model's 4 experts" in msg
    two = {"trainer.num_ranks": 2, "trainer.parallelism.expert_parallel_degree": 2}
    assert "has no experts: set it to 1" in load_error(recipe, {"model.path": dense, **two})
    load_recipe(recipe, {"model.path": moe, **two})


def test_tensor_parallel_the_model_cannot_take_fails_at_load_naming_the_field(tmp_path):
    """Checked at load, as expert parallelism is: otherwise it failed in the trainer ranks' setup, after Ray and the
    engines had started."""
    from tools.make_tiny_model import make_tiny_model

    moe = str(make_tiny_model(tmp_path / "moe", family="qwen3_moe", hidden_size=32, num_layers=1))
    dense = str(make_tiny_model(tmp_path / "dense", family="qwen3", hidden_size=32, num_layers=1))  # 4 q, 2 kv heads
    recipe = ROOT / "recipes" / "grpo_tiny.toml"
    tp = "trainer.parallelism.tensor_parallel_degree"
    msg = load_error(recipe, {"model.path": moe, "trainer.num_ranks": 2, tp: 2})
    assert "- trainer.parallelism.tensor_parallel_degree: tensor parallelism supports dense blocks only" in msg, msg
    msg = load_error(recipe, {"model.path": dense, "trainer.num_ranks": 4, tp: 4})
    assert "tensor_parallel_degree 4 must divide num_heads and num_kv_heads (4, 2): use one of [1, 2]" in msg, msg
    load_recipe(recipe, {"model.path": dense, "trainer.num_ranks": 2, tp: 2})


def test_sharding_a_published_model_cannot_take_fails_at_load_before_it_is_created(tmp_path):
    """A real-size recipe's model is created at start, for minutes: its sharding is checked from the published
    fields, with nothing written."""
    recipe, where = ROOT / "recipes" / "qwen3_30b_a3b_reduced_cpu.toml", str(tmp_path / "not_yet")
    ep = "trainer.parallelism.expert_parallel_degree"
    msg = load_error(recipe, {"model.path": where, "trainer.num_ranks": 3, ep: 3})
    assert "- trainer.parallelism.expert_parallel_degree: " in msg and "does not divide the model's 8 experts" in msg
    dense = ROOT / "recipes" / "qwen3_0p6b_cpu.toml"
    msg = load_error(dense, {"model.path": where, "trainer.num_ranks": 2, ep: 2})
    assert "has no experts: set it to 1" in msg, msg
    assert not (tmp_path / "not_yet").exists()
    load_recipe(recipe, {"model.path": where})


def test_a_model_config_without_the_keys_every_model_has_is_an_error_on_model_path(tmp_path):
    """Every load reads the model's config.json now (to check the model fits): a KeyError escaped as a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    msg = load_error(ROOT / "recipes" / "grpo_tiny.toml", {"model.path": str(tmp_path), "model.create_tiny": False})
    assert "- model.path: " in msg and "is not a model config this code reads (KeyError: 'num_attention_heads')" in msg


def test_a_model_settings_warning_is_given_once_per_start(tmp_path, caplog):
    """The LoRA rank warning came twice: the model config is built at recipe load and again before the run starts."""
    from driver.preflight import check_offline
    from tools.make_tiny_model import make_tiny_model

    model = str(make_tiny_model(tmp_path / "tiny", family="qwen3", hidden_size=32, num_layers=1))
    with caplog.at_level("WARNING", logger="rl_align"):
        recipe = load_recipe(ROOT / "recipes" / "grpo_tiny_lora.toml", {"model.path": model, "model.lora.rank": 64})
        check_offline(recipe)
        recipe.policy_config(quiet=True)
    assert sum("lora.rank = 64 exceeds" in r.getMessage() for r in caplog.records) == 1, caplog.records


def test_a_kv_cache_too_small_for_one_sequence_fails_at_load_naming_the_field():
    """kv_cache_gib = 1e-9 passed --check; vLLM then refused every engine's start naming gpu_memory_utilization, a
    setting no recipe has. Qwen3-0.6B's shapes (28 layers, 8 kv heads of 128) in bfloat16: 114,688 bytes a token."""
    recipe = ROOT / "recipes" / "qwen3_0p6b_cpu.toml"
    msg = load_error(recipe, {"rollout.engine.kv_cache_gib": 0.001})
    assert "- rollout.engine.kv_cache_gib: 0.001 GiB of KV cache holds 9 tokens of this model (114688 bytes each in " \
        "bfloat16), not one sequence of rollout.engine.max_model_len = 256" in msg, msg  # fmt: skip
    load_recipe(recipe, {"rollout.engine.kv_cache_gib": 0.03})
