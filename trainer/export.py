"""A trained policy as a model the user takes away: a ``from_pretrained``-ready HF directory.

    export_policy(policy, "runs/x/final_model", source_dir="artifacts/tiny-qwen3")   # from a live (sharded) policy
    python -m trainer.export runs/x/checkpoints/step_00000300 runs/x/exported        # from any DCP checkpoint

The directory holds the safetensors weights and a ``config.json`` written from the model config, plus everything
else a user needs to load and generate that training does not change, taken from the model directory the run started
from: the tokenizer files, ``generation_config.json`` (written from the token ids when the source has none, with
the chat template's end-of-turn token among its ``eos_token_id``) and the special-token ids of the source
``config.json`` (``eos_token_id``, ``pad_token_id``, ``bos_token_id``), so HF ``generate`` stops where the trained
policy learnt to stop.

An export is written into a temporary sibling directory and renamed into place when complete, so a reader finds the
whole export under its name or nothing new; a failure removes the temporary directory and leaves the output as it was.
The output must be a new or empty directory or an earlier export (which is replaced whole), and neither be nor hold
the model directory or the checkpoint it is made from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import shutil
import sys
import typing
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from common.config import DType
from common.run_dir import ADAPTER_DIR, RESOLVED_RECIPE, lora_base_dir, read_run_record
from common.tokenizer_dir import TOKENIZER_FILES, check_tokenizer_dir
from weight_sync.peft import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from weight_sync.safetensors_stream import is_weights_file
from weight_sync.sink import POLICY_VERSION_FILE

if TYPE_CHECKING:
    import torch

    from trainer.models.config import ModelConfig

__all__ = ["complete_from_source", "export_checkpoint", "export_policy"]

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_EXPORT_FILES = frozenset({
    *TOKENIZER_FILES, ADAPTER_DIR, "config.json", "generation_config.json", POLICY_VERSION_FILE,
})  # fmt: skip
"""Names an export writes besides its weights files (``is_weights_file``): a directory holding only these (and a
killed writer's hidden ``*.partial`` files) is an earlier export, which a new one replaces whole. Every export writes
``POLICY_VERSION_FILE`` (:func:`_complete`): what tells an earlier export from another model."""
_ADAPTER_FILES = frozenset({ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE})


def complete_from_source(
    out_dir: str | Path, source_dir: str | Path, use_chat_template: bool | None = None
) -> list[str]:
    """Copy the tokenizer files and ``generation_config.json`` of ``source_dir`` into the HF directory ``out_dir``,
    and its special-token ids into ``out_dir/config.json``; return the names written. The token a turn ends with
    where the run's prompts used the chat template (``common.chat_turns.turn_end_id`` with the run's
    ``use_chat_template``) joins the ``eos_token_id`` of ``generation_config.json`` when it is not there: a base
    model's tokenizer with a chat template lists its end-of-text token only (Qwen 3 base: ``<|endoftext|>``, against
    ``<|im_end|>``), and ``generate`` on a chat prompt ran past the end of the turn the run trained.

    Raises ``ValueError`` when ``source_dir`` has no tokenizer (``common.tokenizer_dir.check_tokenizer_dir``): a model
    without one cannot be used by the person it is exported for.
    """
    out, src = Path(out_dir), Path(source_dir)
    copied = _tokenizer_files(src)
    for name in copied:
        shutil.copyfile(src / name, out / name)
    source_config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    ids = {k: source_config[k] for k in _TOKEN_IDS if source_config.get(k) is not None}
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(ids)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_file = src / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else dict(ids)
    eos = generation.get("eos_token_id", ids.get("eos_token_id"))
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    turn_end = _turn_end(out, use_chat_template)
    if turn_end is not None and turn_end not in eos_ids:
        generation["eos_token_id"] = [*eos_ids, turn_end]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    return [*copied, "generation_config.json"]


def _turn_end(model_dir: Path, use_chat_template: bool | None) -> int | None:
    """``common.chat_turns.turn_end_id`` of the tokenizer in ``model_dir``."""
    from transformers import AutoTokenizer

    from common.chat_turns import turn_end_id

    return turn_end_id(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True), use_chat_template)


def _tokenizer_files(source_dir: Path) -> list[str]:
    """The tokenizer files ``source_dir`` holds (``common.tokenizer_dir.check_tokenizer_dir``, the check a run starts
    with); ``ValueError`` when they make no tokenizer."""
    try:
        return check_tokenizer_dir(source_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{source_dir} has no tokenizer ({e}): export needs the model directory the run started "
                         "from, with its tokenizer files") from None


def export_policy(
    policy: nn.Module,
    out_dir: str | Path,
    source_dir: str | Path | None,
    dtype: str | None = None,
    policy_version: int | None = None,
    adapter: bool = True,
    use_chat_template: bool | None = None,
) -> list[str]:
    """Write ``policy`` (plain or sharded; collective when sharded: every rank calls it, rank 0 writes) as a
    complete HF directory at ``out_dir``; ``dtype`` casts the weights (e.g. ``"bfloat16"``). Returns the file names
    on rank 0, ``[]`` elsewhere. ``source_dir`` None writes the weights and ``config.json`` only (a model built from
    a config in a test has no tokenizer to copy). A LoRA policy is written merged (a plain model of its family), and
    its adapters alone as a PEFT adapter directory in ``out_dir/adapter`` (``PeftModel.from_pretrained(base,
    out_dir / "adapter")``, or a vLLM ``LoRARequest`` over the base), whose base is ``source_dir``; ``adapter`` False
    writes the merged model only (adapters that were not trained: a warm start that fine-tuned every weight).
    ``use_chat_template``: the run's ``rollout.use_chat_template`` (which token ends a turn:
    :func:`complete_from_source`). ``policy_version`` is recorded as ``policy_version.json``, so a
    weight-sync receiver serving the directory (``vllm serve`` with the rl_align plugin, ``python -m weight_sync
    serve``) starts at that version and refuses older pushes.

    The directory appears whole or not at all (:func:`_write_whole`). Raises ``ValueError`` on rank 0, after the
    gathers and before ``out_dir`` is touched, when ``out_dir`` is or holds ``source_dir``, is a file, or holds files
    an export does not write."""
    import torch

    from trainer.models.hf_io import save_hf_checkpoint
    from trainer.models.lora import adapter_state_dict

    def write(stage: Path) -> list[str]:
        files = save_hf_checkpoint(policy, str(stage), dtype=getattr(torch, dtype) if dtype is not None else None)
        model_cfg = getattr(policy, "cfg")  # noqa: B009 (save_hf_checkpoint checked that it is a ModelConfig)
        adapters = None
        if model_cfg.lora is not None and adapter:  # gathered on every rank (a collective when sharded)
            adapters = list(adapter_state_dict(policy, model_cfg))
        if not files:
            return files  # [] on the ranks that do not write
        if adapters is not None:
            files = [*files, *_write_adapter(stage, model_cfg, adapters, source_dir, dtype, policy_version)]
        return _complete(stage, files, source_dir, policy_version, use_chat_template)

    source = Path(source_dir) if source_dir is not None else None
    return _write_whole(out_dir, write, source)


def _write_adapter(
    out_dir: str | Path,
    model_cfg: ModelConfig,
    adapter: Iterable[tuple[str, torch.Tensor]],
    source_dir: str | Path | None,
    dtype: str | None,
    policy_version: int | None = None,
) -> list[str]:
    """Write ``adapter`` (``(PEFT name, whole tensor)``) as the PEFT adapter directory of the export at ``out_dir``
    (``dtype`` casts it; ``policy_version`` recorded in its weights, as an adapter sink records it); return its file
    names relative to ``out_dir``."""
    import torch

    from weight_sync.peft import write_peft_adapter

    lora = model_cfg.lora
    assert lora is not None
    cast = [(name, t if dtype is None else t.to(getattr(torch, dtype))) for name, t in adapter]
    base = str(Path(source_dir).resolve()) if source_dir is not None else None
    written = write_peft_adapter(Path(out_dir) / ADAPTER_DIR, cast, lora, base, dropout=lora.dropout,
                                 policy_version=policy_version)  # fmt: skip
    return [f"{ADAPTER_DIR}/{name}" for name in written]


def _complete(
    out_dir: str | Path, files: list[str], source_dir: str | Path | None, policy_version: int | None,
    use_chat_template: bool | None,
) -> list[str]:
    """Add ``policy_version.json`` and the source's tokenizer and generation files to the exported weights ``files``."""
    from weight_sync.sink import write_policy_version

    if policy_version is not None:
        write_policy_version(str(out_dir), policy_version)
        files = [*files, POLICY_VERSION_FILE]
    if source_dir is None:
        return files
    return [*files, *complete_from_source(out_dir, source_dir, use_chat_template)]


def _write_whole(
    out_dir: str | Path, write: Callable[[Path], list[str]], source: Path | None, checkpoint: Path | None = None
) -> list[str]:
    """Run ``write`` into a new temporary sibling directory of ``out_dir`` (it writes the export into the directory it
    is given and returns the file names, ``[]`` on a rank that writes nothing) and put that directory in place of
    ``out_dir``, once :func:`_check_out` passes. On any failure the temporary directory is removed and ``out_dir``
    is as it was; a rank whose ``write`` returns ``[]`` touches nothing. Returns what ``write`` returned."""
    out = Path(out_dir).resolve()
    stage = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.partial"  # same filesystem: the rename is atomic
    try:
        files = write(stage)
        if files:
            _check_out(Path(out_dir), source, checkpoint)  # again (callers may check first): now, just before
            _replace(out, stage)
        return files
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _replace(out: Path, stage: Path) -> None:
    """Rename the complete export ``stage`` to ``out``; an earlier export there is moved aside first and removed."""
    if not out.exists():
        stage.rename(out)
        return
    old = stage.with_suffix(".old")
    out.rename(old)
    try:
        stage.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old)


def _check_out(out_dir: Path, source: Path | None, checkpoint: Path | None = None) -> None:
    """Raise ``ValueError`` unless an export may be put in place of ``out_dir``: a new path, an empty directory or an
    earlier export (replaced whole), that is neither the model directory ``source`` nor holds it, and neither lies in
    nor holds ``checkpoint``. Paths are compared resolved (symbolic links, ``..``, relative paths)."""
    out = out_dir.resolve()
    if source is not None:
        src = source.resolve()
        if out == src or out in src.parents:
            what = "is" if out == src else "holds"
            raise ValueError(f"output {out_dir} {what} the model directory {source} ({out}): the export would "
                             "replace the weights and tokenizer it is made from; pass another output "
                             "directory")  # fmt: skip
    if checkpoint is not None:
        ckpt = checkpoint.resolve()
        if out == ckpt or ckpt in out.parents or out in ckpt.parents:
            what = "holds" if out in ckpt.parents else "lies in"
            raise ValueError(f"output {out_dir} {what} the checkpoint {checkpoint} ({out}): pass an output directory "
                             "outside the checkpoint (it holds only what the trainer wrote, and an old one is removed "
                             "whole)")  # fmt: skip
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory: pass a new directory path")
    if out.is_dir() and any(out.iterdir()):
        other = sorted(p.name for p in out.iterdir() if not _is_export_file(p.name))
        adapter = out / ADAPTER_DIR
        if adapter.is_dir():
            other += [f"{ADAPTER_DIR}/{p.name}" for p in adapter.iterdir() if p.name not in _ADAPTER_FILES]
        if other:
            raise ValueError(f"output {out_dir} holds files an export does not write ({', '.join(other[:3])}"
                             f"{', ...' if len(other) > 3 else ''}), which replacing it would delete: pass a new or "
                             "empty directory, or an earlier export")  # fmt: skip
        if not (out / POLICY_VERSION_FILE).is_file():  # the names alone are any HF model directory's
            raise ValueError(f"output {out_dir} is a model directory, not an earlier export of this project (those "
                             f"hold {POLICY_VERSION_FILE}), and replacing it would delete it: pass a new or empty "
                             "directory")  # fmt: skip


def _is_export_file(name: str) -> bool:
    killed_writer = name.startswith(".") and name.endswith(".partial")
    return name in _EXPORT_FILES or is_weights_file(name) or killed_writer


def _check_checkpoint(ckpt: Path) -> int:
    """The policy version of the complete checkpoint ``ckpt``, once its trainer state reads and every file its DCP
    metadata names is there and long enough; raises ``ValueError`` naming what is damaged otherwise."""
    from trainer.checkpoint import rank_state_file, saved_policy_version

    what_to_do = "export another checkpoint of the run (its checkpoints directory keeps the newest ones)"
    state = rank_state_file(ckpt, 0)
    if not state.is_file():
        raise ValueError(f"checkpoint {ckpt} is damaged (no {state.name}, which records its policy version): "
                         f"{what_to_do}")  # fmt: skip
    try:
        version = saved_policy_version(ckpt)
    except (RuntimeError, EOFError, pickle.UnpicklingError, KeyError) as e:
        raise ValueError(f"checkpoint {ckpt} is damaged ({state.name} does not read: {e}): {what_to_do}") from e
    problem = _dcp_files_problem(ckpt)
    if problem is not None:
        raise ValueError(f"checkpoint {ckpt} is damaged ({problem}): {what_to_do}")
    return version


def _dcp_files_problem(ckpt: Path) -> str | None:
    """What is wrong with the DCP files of ``ckpt`` as its metadata describes them (a file missing or shorter than
    the bytes it should hold), or None; nothing is read beyond the metadata."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(ckpt)).read_metadata()
    except FileNotFoundError:
        return "no .metadata, the index of its tensor files"
    except (EOFError, pickle.UnpicklingError, AttributeError) as e:
        return f".metadata does not read: {e!r}"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = ckpt / name
        if not path.is_file():
            return f"no {name}"
        if path.stat().st_size < size:
            return f"{name} holds {path.stat().st_size} bytes, its tensors end at {size}: it was cut short"
    return None


@contextlib.contextmanager
def _reads_of(ckpt: Path) -> Iterator[None]:
    """Report a DCP read of ``ckpt`` failing inside (damage :func:`_check_checkpoint` cannot see) as ``ValueError``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:  # a BaseException: it carries each rank's exception and traceback
        errors = [exc for exc, _ in e.failures.values()] or [e]
        raise ValueError(f"checkpoint {ckpt} is damaged (reading it failed: {errors[0]!r}): export another "
                         "checkpoint of the run") from e  # fmt: skip


def export_checkpoint(
    checkpoint: str | Path, out_dir: str | Path, model_dir: str | Path | None = None, dtype: str | None = None
) -> list[str]:
    """Convert the policy of a DCP checkpoint (``.../checkpoints/step_<n>``, any number of saving ranks) into a
    complete HF directory at ``out_dir``, in this process.

    ``model_dir``: the HF model directory the run started from (architecture, tokenizer); default: the
    ``[model] path`` of the run's ``recipe.resolved.toml`` next to the checkpoints directory (a LoRA run whose warm
    start trained every weight: that run's ``warm_start_model``, the base its adapters apply to:
    ``common.run_dir.lora_base_dir``). The checkpoint is read
    and written a few tensors at a time, no model built, so a model of any size converts in little memory. A LoRA
    run's checkpoint holds the adapters only (``[model.lora]`` of that recipe): each base weight is read from
    ``model_dir`` as it is written and its adapter's update merged in, and the adapters are also written as a PEFT
    adapter directory (``adapter/``), as :func:`export_policy` writes a live LoRA policy.
    The export records the checkpoint's policy version (``policy_version.json``).

    Everything that can be checked is checked before anything is written, each failing with ``ValueError``: the
    output (a new or empty directory or an earlier export, neither the model directory nor holding it, neither in nor
    holding the checkpoint), the checkpoint (its trainer state, the files its metadata names), the model directory's
    tokenizer and that the checkpoint holds this model. The directory then appears whole or not at all.
    """
    import torch

    from trainer.checkpoint import read_model_tensors, saved_policy_params
    from trainer.checkpoint_dirs import COMPLETE
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import read_hf_parameters, write_hf_checkpoint
    from trainer.models.lora import is_adapter, merged_parameters, peft_name
    from trainer.models.transformer import build_model

    ckpt = Path(checkpoint)
    if not (ckpt / COMPLETE).is_file():
        raise ValueError(f"{ckpt} is not a complete checkpoint (no COMPLETE marker): pass a .../step_<n> directory")
    record = _run_record(ckpt)
    if model_dir is None and record is None:
        raise ValueError(f"no {RESOLVED_RECIPE} next to {ckpt.parent}: pass --model-dir (the HF model directory the "
                         "run started from; a LoRA run's warm_start_model when its warm start trained every "
                         "weight)")  # fmt: skip
    recipe_model = record[0].get("model", {}) if record is not None else None
    use_chat_template = record[0].get("rollout", {}).get("use_chat_template") if record is not None else None
    if model_dir is not None:
        source = Path(model_dir)
        _check_model_dir(ckpt, source, record)
    elif record is not None:
        source = lora_base_dir(*record) or Path(record[0].get("model", {}).get("path", ""))
        if not source.is_absolute() and not source.exists():
            raise ValueError(f"{record[1] / RESOLVED_RECIPE} names the model directory {str(source)!r}, a path "
                             "relative to the directory the run started in, and there is none relative to this one "
                             f"({Path.cwd()}): run the export from the directory the run started in, or pass "
                             "--model-dir")  # fmt: skip
    _check_out(Path(out_dir), source, ckpt)
    policy_version = _check_checkpoint(ckpt)
    if (recipe_model or {}).get("lora") and not (source / "config.json").is_file():
        raise ValueError(f"{ckpt} holds the adapters of a LoRA run, which apply to its base model {source} (its warm "
                         "start, or the model it started from) and to no other; that directory is not there: restore "
                         "it, or pass that exact base as --model-dir")  # fmt: skip
    _tokenizer_files(source)
    model_cfg = model_config_from_hf(str(source), lora=(recipe_model or {}).get("lora"))
    meta = build_model(model_cfg, device="meta")  # names and shapes only
    shapes = [(name, tuple(p.shape)) for name, p in meta.named_parameters()]
    base_shapes = [(name, shape) for name, shape in shapes if not is_adapter(name)]
    saved = saved_policy_params(ckpt, meta)
    if model_cfg.lora is None:
        params = saved
        tensors = read_model_tensors(ckpt, "policy", params)
        adapters = None
    else:  # the run trained adapters only: the base weights are the run's model directory's, in the trainer's float32
        with _reads_of(ckpt):
            adapters = dict(read_model_tensors(ckpt, "policy", saved))
        params = [(name, shape, torch.float32) for name, shape in base_shapes]
        base = ((name, t.float()) for name, t in read_hf_parameters(model_cfg, source, base_shapes))
        tensors = merged_parameters(meta, base, adapters)

    def write(stage: Path) -> list[str]:
        cast = getattr(torch, dtype) if dtype else None
        with _reads_of(ckpt):
            files = write_hf_checkpoint(model_cfg, stage, params, tensors, dtype=cast)
        if adapters is not None:
            pairs = [(peft_name(model_cfg, name), t) for name, t in adapters.items()]
            files = [*files, *_write_adapter(stage, model_cfg, pairs, source, dtype, policy_version)]
        return _complete(stage, files, source, policy_version, use_chat_template)

    return _write_whole(out_dir, write, source, ckpt)


def _check_model_dir(ckpt: Path, model_dir: Path, record: tuple[dict, Path] | None) -> None:
    """``ValueError`` when ``--model-dir`` is not the base the run's record names for its LoRA adapters
    (``common.run_dir.lora_base_dir``) while that base exists: merged into another base of the same shapes, the
    adapters would make another model without a word. A run without LoRA, or whose base is gone, takes any."""
    base = lora_base_dir(*record) if record is not None else None
    if base is None or not base.is_dir() or base.resolve() == model_dir.resolve():
        return
    raise ValueError(f"{ckpt} holds LoRA adapters trained over {base} (the base its run's {RESOLVED_RECIPE} names), "
                     f"not over --model-dir {model_dir}: merged there they would make another model. Leave out "
                     f"--model-dir to export over {base}, or pass that directory")  # fmt: skip


def _run_record(ckpt: Path) -> tuple[dict, Path] | None:
    """The resolved recipe of the run that wrote ``ckpt`` and that run's directory (where the record is), or None."""
    for run_dir in (ckpt.parent.parent, ckpt.parent):
        record = read_run_record(run_dir)
        if record is not None:
            return record, run_dir
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.export CHECKPOINT OUT [--model-dir DIR] [--dtype bfloat16]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=export_checkpoint.__doc__)
    parser.add_argument("checkpoint",
                        help="a complete checkpoint directory, e.g. runs/grpo_tiny/checkpoints/step_00000300")
    parser.add_argument("out", help="directory to write the HF model to")
    parser.add_argument("--model-dir", help="HF model directory the run started from (default: from the run's recipe)")
    parser.add_argument("--dtype", choices=typing.get_args(DType), help="cast the weights")
    args = parser.parse_args(argv)
    try:
        files = export_checkpoint(args.checkpoint, args.out, args.model_dir, args.dtype)
    except (ValueError, OSError) as e:  # OSError: what the system refused (permissions, space), as it says it
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
