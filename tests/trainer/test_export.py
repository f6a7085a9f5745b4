"""The trained policy as a model to take away: the exported directory loads with HF transformers' own
``from_pretrained`` (model and tokenizer), computes the trainer's logits, stops generating at the source's
end-of-sequence token, and any DCP checkpoint converts to the same directory (``python -m trainer.export``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tools.make_tiny_model import make_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src"), family="qwen3", seed=3, hidden_size=64, num_layers=2,
                           num_heads=2)  # fmt: skip


def _trained(source: Path):
    """Our model of ``source``, its weights moved (as training would)."""
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import load_hf_checkpoint
    from trainer.models.transformer import build_model

    model = build_model(model_config_from_hf(str(source)), device=torch.device("cpu"), dtype=torch.float32)
    load_hf_checkpoint(model, str(source))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def _assert_usable(out: Path, model, source: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    with torch.no_grad():
        ours = model.logits(model(ids, positions=torch.arange(ids.shape[1])[None]))
        torch.testing.assert_close(hf(ids).logits.float(), ours, atol=1e-5, rtol=1e-5)
    src_config = json.loads((source / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == src_config["eos_token_id"] == tokenizer.eos_token_id
    assert config["pad_token_id"] == src_config["pad_token_id"]
    assert hf.generation_config.eos_token_id == tokenizer.eos_token_id
    # End-of-sequence made the likeliest token must end generation there: HF generate knows the stop token (without
    # it, generate would emit ten of them).
    with torch.no_grad():
        generated = hf.generate(ids, max_new_tokens=10, do_sample=False,
                                sequence_bias={(tokenizer.eos_token_id,): 100.0})  # fmt: skip
    assert generated[0, ids.shape[1]:].tolist() == [tokenizer.eos_token_id]


def test_exported_policy_loads_and_generates_with_hf(source, tmp_path):
    from trainer.export import export_policy

    model = _trained(source)
    files = export_policy(model, tmp_path / "out", source, policy_version=12)
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= set(files)
    _assert_usable(tmp_path / "out", model, source)
    from weight_sync.sink import SafetensorsDirSink

    assert SafetensorsDirSink(str(tmp_path / "out")).committed_version() == 12  # a receiver on it starts at 12


def test_a_dcp_checkpoint_exports_to_the_same_model(source, tmp_path):
    from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress
    from trainer.config import OptimizerConfig
    from trainer.export import main
    from trainer.optim import build_optimizer

    model = _trained(source)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.resolved.toml").write_text(f'[model]\npath = "{source}"\n')  # what a run leaves next to it
    manager = CheckpointManager(run / "checkpoints")
    ckpt = manager.save({"policy": Checkpointable(model, build_optimizer(model, OptimizerConfig()))},
                        TrainProgress(7, 7, {}))  # fmt: skip
    assert main([str(ckpt), str(tmp_path / "out")]) == 0
    _assert_usable(tmp_path / "out", model, source)
    assert json.loads((tmp_path / "out" / "policy_version.json").read_text())["policy_version"] == 7
    assert main([str(run / "checkpoints"), str(tmp_path / "bad")]) == 2  # not a step_<n> directory


def test_a_checkpoint_reads_back_a_tensor_at_a_time_and_refuses_another_model(source, tmp_path):
    from trainer.checkpoint import (
        Checkpointable,
        CheckpointManager,
        TrainProgress,
        read_model_tensors,
        saved_model_params,
    )

    model = _trained(source)
    ckpt = CheckpointManager(tmp_path).save({"policy": Checkpointable(model)}, TrainProgress(1, 1, {}))
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    params = saved_model_params(ckpt, "policy", shapes)
    assert [dtype for _, _, dtype in params] == [torch.float32] * len(shapes)
    read = list(read_model_tensors(ckpt, "policy", params, group_bytes=1))  # every tensor a group of its own
    assert [name for name, _ in read] == [name for name, _ in shapes]
    for (_, tensor), p in zip(read, model.parameters(), strict=True):
        assert torch.equal(tensor, p.detach())
    name, shape = shapes[0]
    with pytest.raises(ValueError, match=f"{name} has shape"):
        saved_model_params(ckpt, "policy", [(name, (shape[0] + 1, *shape[1:])), *shapes[1:]])
    with pytest.raises(ValueError, match="holds no tensor policy.model.nope"):
        saved_model_params(ckpt, "policy", [*shapes, ("nope", (1,))])
    with pytest.raises(ValueError, match=f"holds tensors this model has not \\(policy.model.{name};"):
        saved_model_params(ckpt, "policy", shapes[1:])


def test_export_refuses_a_source_without_tokenizer(tmp_path, source):
    from trainer.export import complete_from_source

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no tokenizer"):
        complete_from_source(tmp_path / "out", tmp_path)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe"), family="qwen3_moe", seed=4, hidden_size=64, num_layers=2,
                           num_heads=2, num_experts=4, top_k=2, moe_intermediate_size=32)  # fmt: skip


DENSE_LORA = {"rank": 4, "alpha": 8.0, "target_modules": ("q_proj", "v_proj", "up_proj")}
EXPERT_LORA = {"rank": 4, "alpha": 8.0, "target_modules": ("q_proj", "o_proj"),
               "target_parameters": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")}  # fmt: skip


def _trained_lora(source: Path, lora_fields: dict):
    """Our model of ``source`` with LoRA adapters that moved (B != 0), the base untouched."""
    from trainer.models.config import LoRAConfig
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import load_hf_checkpoint
    from trainer.models.lora import is_adapter
    from trainer.models.transformer import build_model

    lora = LoRAConfig(**lora_fields)
    model = build_model(model_config_from_hf(str(source), lora=lora), device=torch.device("cpu"), dtype=torch.float32)
    load_hf_checkpoint(model, str(source))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(0.2 * torch.randn_like(p))
    return model


def _assert_adapter_loads_in_peft(out: Path, model, source: Path) -> None:
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, model.logits(model(ids)), atol=1e-5, rtol=1e-5)


def test_a_lora_policy_exports_merged_and_as_a_peft_adapter(source, tmp_path):
    from trainer.export import export_policy

    model = _trained_lora(source, DENSE_LORA)
    from weight_sync.peft import read_adapter_version

    files = export_policy(model, tmp_path / "out", source, policy_version=3)
    assert {"model.safetensors", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(files)
    assert read_adapter_version(tmp_path / "out" / "adapter") == 3  # as an adapter sink's copy records it
    _assert_usable(tmp_path / "out", model, source)  # the merged model is a plain HF model
    _assert_adapter_loads_in_peft(tmp_path / "out", model, source)


def _assert_same_adapter_file(out: Path, live: Path) -> None:
    """The two exports' adapter weights are the same tensors, bit for bit, with the same metadata (policy_version
    included); not compared as bytes: safetensors writes a metadata map of two keys in no fixed order."""
    from safetensors import safe_open

    files = [safe_open(str(d / "adapter" / "adapter_model.safetensors"), framework="pt") for d in (out, live)]
    assert files[0].metadata() == files[1].metadata() and "policy_version" in files[0].metadata()
    assert list(files[0].keys()) == list(files[1].keys())
    for name in files[0].keys():
        assert torch.equal(files[0].get_tensor(name), files[1].get_tensor(name)), name


def _save_lora_run(run: Path, model, source: Path, lora_fields: dict) -> Path:
    """``model``'s adapter-only checkpoint (step 2) in a run directory whose resolved recipe names ``source``."""
    from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress
    from trainer.config import OptimizerConfig
    from trainer.optim import build_optimizer

    (run / "checkpoints").mkdir(parents=True)
    lora = "".join(f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}\n" for k, v in lora_fields.items())
    (run / "recipe.resolved.toml").write_text(f'[model]\npath = "{source}"\n\n[model.lora]\n{lora}')
    part = Checkpointable(model, build_optimizer(model, OptimizerConfig()), trainable_only=True)
    return CheckpointManager(run / "checkpoints").save({"policy": part}, TrainProgress(2, 2, {}))


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "expert-adapters"])
def test_an_adapter_only_checkpoint_exports_over_the_runs_base(source, moe_source, tmp_path, experts):
    """The checkpoint's adapters merge into the base weights read from the run's model directory a tensor at a time,
    giving, byte for byte, the directory the live policy exports (merged weights, PEFT adapter, config)."""
    from trainer.export import export_policy, main

    base, fields = (moe_source, EXPERT_LORA) if experts else (source, DENSE_LORA)
    model = _trained_lora(base, fields)
    ckpt = _save_lora_run(tmp_path / "run", model, base, fields)
    # adapters and their AdamW state only: below the base model alone (far below at any real size)
    assert sum(f.stat().st_size for f in ckpt.glob("*.distcp")) < (base / "model.safetensors").stat().st_size
    assert main([str(ckpt), str(tmp_path / "out")]) == 0
    export_policy(model, tmp_path / "live", base, policy_version=2)
    for name in ("model.safetensors", "config.json", "adapter/adapter_config.json", "policy_version.json",
                 "generation_config.json"):  # fmt: skip
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "live" / name).read_bytes(), name
    _assert_same_adapter_file(tmp_path / "out", tmp_path / "live")
    _assert_usable(tmp_path / "out", model, base)
    _assert_adapter_loads_in_peft(tmp_path / "out", model, base)


def _lora_run_over_its_warm_start(source: Path, run: Path):
    """(warm_start_model, the adapter-trained policy, its checkpoint) of a LoRA run in ``run`` whose warm start trained
    every weight of ``source`` (``run.warm_start.parameters = "all"``, the LoRA demo's)."""
    from trainer.export import export_policy

    warm = run / "warm_start_model"
    export_policy(_trained(source), warm, source, policy_version=1)  # a base that moved away from ``source``
    model = _trained_lora(warm, DENSE_LORA)
    ckpt = _save_lora_run(run, model, source, DENSE_LORA)
    record = (run / "recipe.resolved.toml").read_text()
    (run / "recipe.resolved.toml").write_text(f'[run.warm_start]\nnum_steps = 5\nparameters = "all"\n\n{record}')
    return warm, model, ckpt


def test_a_lora_run_whose_warm_start_trained_the_base_exports_over_its_warm_started_model(source, tmp_path):
    """``run.warm_start.parameters = "all"`` (the LoRA demo): the adapters apply to the warm-started base. The
    checkpoint's export merged them into the random ``[model] path`` instead (greedy output ' f f f f') and the
    adapter directory named that model as its base."""
    from trainer.export import export_policy, main

    warm, model, ckpt = _lora_run_over_its_warm_start(source, tmp_path / "run")
    assert main([str(ckpt), str(tmp_path / "out")]) == 0
    export_policy(model, tmp_path / "live", warm, policy_version=2)
    for name in ("model.safetensors", "adapter/adapter_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "live" / name).read_bytes(), name
    _assert_same_adapter_file(tmp_path / "out", tmp_path / "live")
    config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(warm.resolve())
    _assert_adapter_loads_in_peft(tmp_path / "out", model, warm)
    # The warm start's own export writes no adapter directory: its adapters never trained.
    assert "adapter/adapter_config.json" not in export_policy(model, tmp_path / "merged", source, adapter=False)
    assert not (tmp_path / "merged" / "adapter").exists()


def test_a_lora_checkpoint_whose_base_is_gone_says_the_adapters_need_that_base(source, tmp_path, capsys):
    """The warm start a LoRA run's adapters apply to, removed: the export offered to write a tiny model instead."""
    from trainer.export import main

    warm, _, ckpt = _lora_run_over_its_warm_start(source, tmp_path / "run")
    shutil.rmtree(warm)
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"apply to its base model {warm}" in err and "make_tiny_model" not in err


def test_an_adapter_checkpoint_over_another_base_is_refused_before_writing(source, tmp_path, capsys):
    from trainer.export import main

    # A base of one layer takes the checkpoint's layer-0 adapters (same shapes) but not its layer-1 ones, which must
    # not be dropped silently.
    short = make_tiny_model(tmp_path / "short", family="qwen3", seed=3, hidden_size=64, num_layers=1, num_heads=2)
    ckpt = _save_lora_run(tmp_path / "run", _trained_lora(source, DENSE_LORA), short, DENSE_LORA)
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "layers.1.attention" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_model_dir_other_than_the_base_a_lora_run_records_is_refused(source, tmp_path, capsys):
    """Regression: ``--model-dir [model] path`` on a run whose warm start trained the base merged the adapters into
    the untrained model without a word."""
    from trainer.export import main

    warm, _, ckpt = _lora_run_over_its_warm_start(source, tmp_path / "run")
    assert main([str(ckpt), str(tmp_path / "out"), "--model-dir", str(source)]) == 2
    error = _error(capsys)
    assert f"trained over {warm}" in error and f"not over --model-dir {source}" in error and "Leave out" in error
    assert not (tmp_path / "out").exists()
    assert main([str(ckpt), str(tmp_path / "out"), "--model-dir", str(warm)]) == 0  # the recorded base itself


def test_a_relative_model_path_from_another_directory_names_where_it_is_relative_to(source, tmp_path, capsys,
                                                                                     monkeypatch):
    """Regression: a run whose ``[model] path`` was relative, exported from another directory, said only that the
    path had no tokenizer."""
    from trainer.export import main

    monkeypatch.chdir(source.parent)
    ckpt = _save_run(tmp_path / "run", Path(source.name))  # the record names it relative to where the run started
    monkeypatch.chdir(tmp_path)
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    error = _error(capsys)
    assert f"names the model directory {source.name!r}, a path relative to the directory the run started in" in error
    assert "--model-dir" in error
    monkeypatch.chdir(source.parent)  # from where the run started it exports
    assert main([str(ckpt), str(tmp_path / "out")]) == 0


# Regression tests of an outside review of ``python -m trainer.export``: an output that was the model directory
# overwrote its weights, then crashed (SameFileError); an output that was a file, or a checkpoint missing a file or
# holding a cut-short one, gave a traceback; a checkpoint without its trainer state left weights without a tokenizer.


def _own_source(source: Path, tmp_path: Path) -> Path:
    """A copy of the model directory ``source`` that a test may see damaged without harming the others."""
    import shutil

    return Path(shutil.copytree(source, tmp_path / "model"))


def _save_run(run: Path, model_dir: Path, step: int = 7) -> Path:
    """A full checkpoint (step ``step``) of a trained model of ``model_dir`` in a run directory naming it."""
    from trainer.checkpoint import Checkpointable, CheckpointManager, TrainProgress

    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run / "recipe.resolved.toml").write_text(f'[model]\npath = "{model_dir}"\n')
    return CheckpointManager(run / "checkpoints", num_keep=5).save(
        {"policy": Checkpointable(_trained(model_dir))}, TrainProgress(step, step, {})
    )


def _error(capsys) -> str:
    """The command's own last line on stderr (a library's warning may come before it)."""
    return capsys.readouterr().err.splitlines()[-1]


def _contents(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("out", ["model", "model-by-link", "model-relative", "in-checkpoint", "run"])
def test_an_output_that_is_holds_or_lies_in_an_input_is_refused_before_writing(source, tmp_path, capsys, monkeypatch,
                                                                                out):  # fmt: skip
    from trainer.export import main

    model_dir = _own_source(source, tmp_path)
    ckpt = _save_run(tmp_path / "run", model_dir)
    (tmp_path / "link").symlink_to(model_dir)
    monkeypatch.chdir(tmp_path / "run")
    out_path, named = {
        "model": (str(model_dir), model_dir), "model-by-link": (str(tmp_path / "link"), model_dir),
        "model-relative": ("../run/../model/", model_dir), "in-checkpoint": (str(ckpt / "hf"), ckpt),
        "run": (str(tmp_path / "run"), ckpt),
    }[out]  # fmt: skip
    before = {d: _contents(d) for d in (tmp_path / "run", model_dir)}
    assert main([str(ckpt), out_path, "--model-dir", str(model_dir)]) == 2
    err = _error(capsys)
    assert err.startswith("error: output ") and str(named) in err and out_path.rstrip("/") in err, err
    assert {d: _contents(d) for d in before} == before  # nothing written, nothing removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "model", "run"]


def test_the_live_export_refuses_the_model_directory_as_its_output(source, tmp_path):
    from trainer.export import export_policy

    model_dir = _own_source(source, tmp_path)
    before = _contents(model_dir)
    with pytest.raises(ValueError, match="is the model directory"):
        export_policy(_trained(model_dir), model_dir, model_dir)
    assert _contents(model_dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_output_that_is_a_file_or_holds_other_files_is_refused(source, tmp_path, capsys):
    from trainer.export import main

    ckpt = _save_run(tmp_path / "run", source)
    (tmp_path / "a_file").write_text("mine\n")
    assert main([str(ckpt), str(tmp_path / "a_file")]) == 2
    assert _error(capsys) == f"error: output {tmp_path / 'a_file'} exists and is not a directory: pass a new " \
                             "directory path"  # fmt: skip
    assert (tmp_path / "a_file").read_text() == "mine\n"
    # The export replaces its output whole: a directory holding anything else is not taken (an earlier export is).
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    assert main([str(ckpt), str(tmp_path / "mine")]) == 2
    assert "holds files an export does not write (notes.txt)" in _error(capsys)
    assert _contents(tmp_path / "mine") == {"notes.txt": b"mine\n"}
    # Another HF model directory has only names an export writes too: without the export's policy_version.json it is
    # not an earlier export, and it is not deleted (nor is an adapter/ folder of other files).
    other = tmp_path / "other_model"
    shutil.copytree(source, other)
    before = _contents(other)
    assert main([str(ckpt), str(other)]) == 2
    assert "is a model directory, not an earlier export of this project" in _error(capsys)
    assert _contents(other) == before
    (tmp_path / "with_adapter" / "adapter").mkdir(parents=True)
    (tmp_path / "with_adapter" / "adapter" / "notes.txt").write_text("mine\n")
    assert main([str(ckpt), str(tmp_path / "with_adapter")]) == 2
    assert "holds files an export does not write (adapter/notes.txt)" in _error(capsys)


def _damage(ckpt: Path, how: str) -> None:
    if how == "no-trainer-state":
        (ckpt / "trainer_state_rank0.pt").unlink()
    elif how == "trainer-state-cut-short":
        (ckpt / "trainer_state_rank0.pt").write_bytes((ckpt / "trainer_state_rank0.pt").read_bytes()[:100])
    elif how == "no-metadata":
        (ckpt / ".metadata").unlink()
    else:
        (distcp,) = ckpt.glob("*.distcp")
        if how == "no-distcp":
            distcp.unlink()
        else:
            distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])


@pytest.mark.parametrize("how", ["no-trainer-state", "trainer-state-cut-short", "no-metadata", "no-distcp",
                                 "distcp-cut-short"])  # fmt: skip
def test_a_damaged_checkpoint_is_refused_before_writing(source, tmp_path, capsys, how):
    from trainer.export import main

    ckpt = _save_run(tmp_path / "run", source)
    _damage(ckpt, how)
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    assert _error(capsys).startswith(f"error: checkpoint {ckpt} is damaged (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no output, no temporary directory left


def test_a_read_that_fails_midway_leaves_the_earlier_export_as_it_was(source, tmp_path, capsys, monkeypatch):
    """Damage the up-front checks cannot see fails while the tensors are written: the earlier export at the output
    is untouched and the partial one removed; a complete export then replaces the earlier one whole."""
    import trainer.export
    from trainer.export import main

    earlier = _save_run(tmp_path / "run", source, step=3)
    assert main([str(earlier), str(tmp_path / "out")]) == 0
    (tmp_path / "out" / "model.safetensors.index.json").write_text("{}")  # another layout, as a larger model writes
    before = _contents(tmp_path / "out")
    ckpt = _save_run(tmp_path / "run", source, step=5)
    _damage(ckpt, "distcp-cut-short")
    monkeypatch.setattr(trainer.export, "_dcp_files_problem", lambda ckpt: None, raising=False)
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    assert _error(capsys).startswith(f"error: checkpoint {ckpt} is damaged (reading it failed: ")
    assert _contents(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    later = _save_run(tmp_path / "run", source, step=6)
    assert main([str(later), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "policy_version.json").read_text())["policy_version"] == 6
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()  # replaced whole, not written into
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]


def test_a_model_directory_without_tokenizer_is_refused_before_writing(source, tmp_path, capsys):
    from trainer.export import main

    model_dir = _own_source(source, tmp_path)
    ckpt = _save_run(tmp_path / "run", model_dir)
    (model_dir / "tokenizer.json").unlink()
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "has no tokenizer" in _error(capsys)
    assert not (tmp_path / "out").exists()
