"""What a run checks and holds before Ray starts, so that bad input fails in seconds and moves nothing.

    recipe = with_run_defaults(recipe, out_dir)
    problem = outputs_lost_with_the_job(recipe)          # a relative path under `ray job submit`
    lock = hold_checkpoint_dir(ckpt_dir, out_dir)        # writable, not shared with another run
    checked = check_run(recipe, out_dir, ckpt_dir, resume)   # the task, the model, the tokenizer, the checkpoint

``check_run`` raises ``ValueError`` / ``FileNotFoundError`` naming what is wrong and what to do; the driver prints it
and exits 2.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.run_dir import CHECKPOINTS, RESOLVED_RECIPE, RunDirLock, lora_base_dir, read_run_record
from driver.resume import resume_command
from recipe import Recipe

if TYPE_CHECKING:
    from rollout.tasks.dataset import PromptDataset
    from rollout.tasks.problem import Problem
    from trainer.models.config import ModelConfig

__all__ = [
    "CheckedRun", "check_data", "check_resumable", "check_reward_functions", "check_run", "ensure_model",
    "hold_checkpoint_dir", "outputs_lost_with_the_job", "with_run_defaults",
]  # fmt: skip

log = logging.getLogger("rl_align")


@dataclass(frozen=True)
class CheckedRun:
    """What :func:`check_run` read and built on the way: the checkpoint to resume from (None: a fresh start), the
    policy's model config, and the task's dataset (its cursor at the checkpoint's position when resuming)."""

    resume_from: Path | None
    model_cfg: ModelConfig
    dataset: PromptDataset


def with_run_defaults(recipe: Recipe, out_dir: Path) -> Recipe:
    """Put checkpoints under the run directory unless the recipe says where."""
    ckpt = recipe.trainer.checkpoint
    if ckpt.dir is None:
        ckpt = ckpt.model_copy(update={"dir": str(out_dir / CHECKPOINTS)})
        recipe = recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update={"checkpoint": ckpt})})
    return recipe


def outputs_lost_with_the_job(recipe: Recipe) -> str | None:
    """Why the run's outputs would not outlive it, or None: a Ray job runs in Ray's copy of its working directory
    (``common.ray_job.ray_job_working_dir``), so relative output paths land in that copy."""
    from common.ray_job import ray_job_working_dir

    job_dir = ray_job_working_dir()
    if job_dir is None:
        return None
    for field, value in (("run.output_dir", str(recipe.run.resolved_output_dir)),
                         ("trainer.checkpoint.dir", recipe.trainer.checkpoint.dir)):  # fmt: skip
        if value is not None and not Path(value).is_absolute():
            return (f"{field} = {value!r} is relative, and this Ray job runs in Ray's copy of its working directory "
                    f"({job_dir}): checkpoints and models written there are lost with the cluster's session, and a "
                    "--resume after any change to the code (a new copy) would not find them. Give an absolute path on "
                    f"storage that outlives the job, e.g. --{field} /shared/runs/{recipe.run.name}"
                    f"{'/checkpoints' if field == 'trainer.checkpoint.dir' else ''}")  # fmt: skip
    return None


def hold_checkpoint_dir(ckpt_dir: Path, out_dir: Path) -> RunDirLock:
    """Lock ``ckpt_dir`` for this run, having made sure the driver can write it (a run found it could not at its first
    checkpoint, 50 steps in; trainer ranks on other hosts write their own filesystems). Locked wherever it lies, since
    another run may name a checkpoint directory inside this one's run directory: two runs sharing one would prune each
    other's checkpoints and resume from the other's. ``ValueError`` for a checkpoint directory that holds the run
    directory (a fresh start would move the run's own outputs with the earlier checkpoints); ``OSError``,
    ``RunDirBusy``."""
    if out_dir.resolve().is_relative_to(ckpt_dir.resolve()):
        raise ValueError(f"trainer.checkpoint.dir {str(ckpt_dir)!r} holds run.output_dir {str(out_dir)!r}: give the "
                         "checkpoints a directory of their own (by default <run.output_dir>/checkpoints)")  # fmt: skip
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=ckpt_dir):
        pass
    lock = RunDirLock(ckpt_dir, what="checkpoint directory", field="trainer.checkpoint.dir")
    lock.acquire()
    _remove_half_saved(ckpt_dir)
    return lock


def _remove_half_saved(ckpt_dir: Path) -> None:
    """Remove the checkpoints a killed run left half saved (held by this run's lock, nothing else writes them): no
    resume reads them and no pruning counts them, so each would keep its size on the disk for good."""
    from trainer.checkpoint_dirs import incomplete_checkpoints

    for partial in incomplete_checkpoints(ckpt_dir):
        size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        log.warning("removing %s (%.1f MB): a checkpoint left half saved (no COMPLETE marker), which a resume "
                    "never reads", partial, size / 1e6)  # fmt: skip
        shutil.rmtree(partial, ignore_errors=True)


def check_run(recipe: Recipe, out_dir: Path, ckpt_dir: Path, resume: str | None) -> CheckedRun:
    """Check what the run needs before Ray starts, for a run holding ``out_dir`` and ``ckpt_dir``: the weight-sync
    token's variable, the task's data, the model (created here when the recipe creates one), the tokenizer, the
    exports' tokenizer, the model against the trainer's sharding, the engines' start version against the trainer's,
    and for a resume (``resume``: "required" or "auto", as :func:`driver.run.run` takes it) the newest checkpoint
    against the recipe. ``ValueError`` / ``FileNotFoundError`` otherwise, naming what to change."""
    from common.tokenizer_dir import check_tokenizer_dir
    from trainer.checkpoint import saved_data_cursor
    from trainer.checkpoint_dirs import latest_checkpoint

    resume_from = latest_checkpoint(ckpt_dir) if resume is not None else None
    if resume == "required" and resume_from is None:
        raise ValueError(f"--resume: no complete checkpoint under {ckpt_dir}; run without --resume (or --resume "
                         "auto)")  # fmt: skip
    recipe.weight_sync.resolve_token()  # a token variable set but empty: the engines' receivers would refuse to start
    _check_prometheus_port(recipe.run.logging.prometheus_port)
    dataset = check_data(recipe)
    checked_at_load = recipe.policy_config_known
    ensure_model(recipe)
    check_tokenizer_dir(recipe.rollout.tokenizer_dir)  # loaded while the actors start
    _check_exportable(recipe)
    model_cfg = recipe.policy_config(quiet=checked_at_load)  # its warnings were given at load
    recipe.check_model(model_cfg)
    check_tokenizer(recipe, model_cfg.vocab_size, dataset)
    if resume_from is not None:
        check_resumable(resume_from, model_cfg, recipe, out_dir)
        _check_steps_left(resume_from, recipe.run.num_steps)
        _warn_changed_settings(recipe, out_dir)
        dataset.load_state_dict(saved_data_cursor(resume_from))
    _check_engines_not_ahead(recipe, resume_from)
    return CheckedRun(resume_from, model_cfg, dataset)


def _check_prometheus_port(port: int | None) -> None:
    """``ValueError`` when another process holds ``run.logging.prometheus_port`` (another run's driver on this host:
    a cluster's drivers all run on its head node), found before Ray starts rather than after it."""
    from common.net import port_taken
    from driver.metrics import prometheus_port_taken

    taken = port_taken(port) if port else None
    if port and taken is not None:
        raise ValueError(prometheus_port_taken(port, taken))


def check_offline(recipe: Recipe) -> PromptDataset:
    """What ``--check`` verifies beyond the recipe, starting nothing: the task's data, and for a model directory that
    exists its tokenizer against the model and the task (a model the run creates is checked once it exists, before
    Ray starts: :func:`check_run`). ``ValueError`` / ``FileNotFoundError`` naming what to change."""
    from common.tokenizer_dir import check_tokenizer_dir

    dataset = check_data(recipe)
    if (Path(recipe.model.path) / "config.json").is_file():
        check_tokenizer_dir(recipe.rollout.tokenizer_dir)
        check_tokenizer(recipe, recipe.policy_config(quiet=True).vocab_size, dataset)  # warned at load
    return dataset


def check_tokenizer(recipe: Recipe, vocab_size: int, dataset: PromptDataset) -> None:
    """``ValueError`` when the tokenizer (``rollout.tokenizer_dir``) cannot serve the model and the task, read from its
    files (no transformers import): ids past the model's ``vocab_size`` rows (tokens added without resizing the
    embeddings: an index error deep in the first step otherwise), or prompts that need a chat template it lacks
    (message prompts, or ``rollout.use_chat_template = true``; ``false`` joins messages as plain text)."""
    from common.tokenizer_dir import has_chat_template_file, tokenizer_num_ids

    directory = recipe.rollout.tokenizer_dir
    num_ids = tokenizer_num_ids(directory)
    if num_ids is not None and num_ids > vocab_size:
        raise ValueError(
            f"the tokenizer in {directory} has {num_ids} token ids and the model in {recipe.model.path} {vocab_size} "
            "embedding rows (config.json vocab_size): tokens added to the tokenizer need rows of their own; resize "
            "the model (model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or use its own tokenizer"
        )
    use = recipe.rollout.use_chat_template
    if use is False or has_chat_template_file(directory):
        return
    if use:
        raise ValueError(f"rollout.use_chat_template = true, and the tokenizer in {directory} has no chat template "
                         "(no chat_template.jinja, chat_template.json or chat_template in tokenizer_config.json): give "
                         "it one, or set use_chat_template = false")  # fmt: skip
    messages = next((p for p in dataset.all_problems() if not _plain_text(p.prompt)), None)
    if messages is not None:
        raise ValueError(
            f"problem {messages.problem_id!r} (and any like it) has a prompt of several chat messages (or a role "
            f"other than user: a system prompt, say), and the tokenizer in {directory} has no chat template to render "
            "them: give it one (chat_template.jinja), or set rollout.use_chat_template = false to join the messages "
            "as plain text (roles dropped)"
        )


def _plain_text(prompt: object) -> bool:
    """Whether a prompt renders without a chat template losing nothing: text, or one user message (the tasks turn
    a text prompt into that)."""
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and len(prompt) == 1 and prompt[0].get("role") == "user"


_SHOWN_CHANGES = 8


def _warn_changed_settings(recipe: Recipe, out_dir: Path) -> None:
    """Name the settings in which a resumed run's recipe differs from the run's record (a flag or an edited file:
    they apply from the checkpoint on, and the record is rewritten with them), so none changes unnoticed."""
    import tomllib

    from common.config import ConfigError, to_toml
    from recipe import load_recipe

    record_path = out_dir / RESOLVED_RECIPE
    if not record_path.is_file():
        return
    now = _flat(tomllib.loads(to_toml(recipe)))
    try:  # read through today's schema, so that both sides name every setting alike (unset ones left out of both)
        recorded = with_run_defaults(load_recipe(record_path, check_paths=False, quiet=True), out_dir)
        before = _flat(tomllib.loads(to_toml(recorded)))
        keys = before.keys() | now.keys()
        if recorded.run.resolved_output_dir.resolve() != out_dir.resolve():  # moved or copied: its paths follow it
            keys -= {"run.output_dir", "trainer.checkpoint.dir"}
    except (ConfigError, ValueError, OSError):  # a record of older code: compare what both still name
        before = _flat(read_run_record(out_dir) or {})
        keys = before.keys() & now.keys()
    changed = [f"{k}: {before.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}" for k in sorted(keys)
               if before.get(k) != now.get(k)]  # fmt: skip
    schedule = "trainer.schedule.num_total_steps"  # derived from run.num_steps once, then recorded
    steps_changed = before.get("run.num_steps") != now.get("run.num_steps")
    if steps_changed and schedule in now and before.get(schedule) == now[schedule]:
        changed.insert(0, f"{schedule} stays {now[schedule]} (the record's): give it again to decay over the new run")
    if changed:
        more = f" and {len(changed) - _SHOWN_CHANGES} more" if len(changed) > _SHOWN_CHANGES else ""
        log.warning("--resume with settings other than the run's record (%s): %s%s; they apply from the checkpoint "
                    "on, and the record is rewritten with them", out_dir / RESOLVED_RECIPE,
                    "; ".join(changed[:_SHOWN_CHANGES]), more)  # fmt: skip


def _flat(table: dict, prefix: str = "") -> dict[str, object]:
    """A TOML document's values by dotted key (arrays of tables whole)."""
    out: dict[str, object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_data(recipe: Recipe) -> PromptDataset:
    """The task's dataset, every row read and checked, and the user reward functions tried on its first problem (for
    :func:`check_run` and ``rl_align.py --check``); ``ValueError`` / ``FileNotFoundError`` naming the file and line,
    or the function."""
    from rollout.tasks import build_dataset

    dataset = build_dataset(recipe.task)
    check_reward_functions(recipe, dataset.first_problem())
    return dataset


def check_reward_functions(recipe: Recipe, problem: Problem) -> None:
    """Call each user reward function (``type = "function"`` terms) once, on ``problem`` with its reference answer as
    the completion: one that fails or returns no number there would fail the first batch, after every actor started.
    With ``reward.on_error = "zero"`` (the run would score such samples 0) a warning instead of ``ValueError``."""
    from rollout.rewards.config import FunctionRewardConfig
    from rollout.rewards.function import ON_ERROR_HINT, RewardFunctionError
    from rollout.rewards.scorer import RewardScorer

    functions = [t for t in recipe.reward.terms if isinstance(t, FunctionRewardConfig)]
    if not functions:
        return
    on_error = recipe.reward.on_error
    # In the reward process the run uses, under reward.timeout_s: a function that never returns is reported too.
    scorer = RewardScorer.from_config(recipe.reward.model_copy(update={"terms": functions, "on_error": "fail"}))
    label = (f"the task's first problem (id {problem.problem_id!r}) with its reference answer {problem.answer!r} as "
             "the completion")
    try:
        for term in scorer.terms:
            try:
                term.score([problem.answer], [problem], [label])
            except RewardFunctionError as e:
                if on_error == "fail":
                    raise ValueError(f"{e}; checked before the run starts") from e
                told = str(e).replace(ON_ERROR_HINT, "")
                log.warning("%s; with reward.on_error = 'zero' such samples score 0", told)
    finally:
        scorer.close()


def _check_engines_not_ahead(recipe: Recipe, resume_from: Path | None) -> None:
    """``ValueError`` when the engines would start at a newer policy version than the trainer (the version their model
    directory records, against the checkpoint's or the model's): they would refuse every push up to theirs as not
    newer and generate with their own weights meanwhile."""
    from trainer.checkpoint import saved_policy_version
    from weight_sync.sink import read_policy_version

    served = recipe.rollout.served_model_path
    engines = read_policy_version(served)
    if resume_from is not None:
        trainer, where = saved_policy_version(resume_from), f"the checkpoint {resume_from}"
    else:
        trainer, where = read_policy_version(recipe.model.path), f"model.path {recipe.model.path}"
    if engines > trainer:
        raise ValueError(
            f"the rollout engines would start from {served} at policy version {engines}, ahead of the trainer's "
            f"{trainer} ({where}): they would refuse its pushes as not newer; serve the directory the trainer "
            f"starts from (rollout.model_path), or delete {served}/policy_version.json if that copy is the same "
            "weights numbered by an earlier run"
        )


def ensure_model(recipe: Recipe) -> None:
    """Create the recipe's model at ``model.path`` (``[model.create_tiny]`` / ``[model.create_published]``) unless the
    directory already holds one; nothing for a recipe that creates none."""
    path = Path(recipe.model.path)
    tiny, published = recipe.model.create_tiny, recipe.model.create_published
    if (tiny is None and published is None) or (path / "config.json").is_file():
        return
    from tools.make_tiny_model import make_published_model, make_tiny_model

    if published is not None:
        log.info("creating a random %s model at %s", published.architecture, path)
        make_published_model(path, published.architecture, seed=published.seed, dtype=published.dtype,
                             num_layers=published.num_layers, num_experts=published.num_experts,
                             vocab_size=published.vocab_size)  # fmt: skip
        return
    assert tiny is not None
    log.info("creating a tiny %s model at %s", tiny.family, path)
    make_tiny_model(path, tiny.family, seed=tiny.seed, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers,
                    num_heads=tiny.num_heads)  # fmt: skip


def check_resumable(ckpt: Path, model_cfg: ModelConfig, recipe: Recipe, out_dir: Path) -> None:
    """Raise ``ValueError`` when the checkpoint ``ckpt`` holds another policy than ``model_cfg`` (names, shapes; a LoRA
    run's adapters) or a critic where the recipe's algorithm has none (or none where it trains one), read from its
    metadata: such a resume would fail only once the actors had started, with the trainer's error (or, for a critic
    the recipe does not use, go on without it). The model is built with the default blocks: the recipe's kernels name
    the same parameters and may not even import here (a Pallas kernel on a driver without JAX)."""
    from trainer.checkpoint import saved_parts, saved_policy_params
    from trainer.models.config import BlockChoices
    from trainer.models.transformer import build_model

    meta = build_model(model_cfg.model_copy(update=BlockChoices().model_dump()), device="meta")
    try:
        saved_policy_params(ckpt, meta)
        critic = recipe.algorithm.trains_critic
        if critic != ("critic" in saved_parts(ckpt)):
            holds, has = ("no", "trains one") if critic else ("a", "has none")
            raise ValueError(f"checkpoint {ckpt} holds {holds} critic, and algorithm {recipe.algorithm.type!r} {has}: "
                             "it was written by a run of another algorithm")  # fmt: skip
    except ValueError as e:
        lora = ", [model.lora] rank and targets" if recipe.model.lora is not None else ""
        raise ValueError(
            f"--resume: {e}. The run in {out_dir} trained another model than this recipe's ({recipe.model.path}, "
            f"{recipe.algorithm.type}{lora}): "
            f"resume with the recipe it started with ({resume_command(out_dir / RESOLVED_RECIPE)}), or start afresh "
            "without --resume"
        ) from e
    _check_lora_base(recipe, out_dir)


def _check_steps_left(checkpoint: Path, num_steps: int) -> None:
    """``ValueError`` when the checkpoint is past ``run.num_steps``: the resumed run would train nothing, log its end
    at an earlier step than its checkpoint and replace the final model with the checkpoint's. A checkpoint at
    ``num_steps`` (a finished run resumed again, e.g. a retried job) goes on: its end is written again."""
    from trainer.checkpoint_dirs import checkpoint_step

    step = checkpoint_step(checkpoint)
    if step > num_steps:
        raise ValueError(
            f"--resume: the newest checkpoint, {checkpoint}, is at step {step}, past run.num_steps = {num_steps}: "
            f"there is nothing to train. Give run.num_steps above {step} to extend the run (or start fresh elsewhere)"
        )
    if step == num_steps:
        log.warning("--resume: the newest checkpoint, %s, is at run.num_steps = %d: nothing is left to train, and the "
                    "run's end (final evaluation, final_model/) is written again; give run.num_steps above %d to "
                    "extend the run", checkpoint, num_steps, step)  # fmt: skip


def _check_exportable(recipe: Recipe) -> None:
    """Raise ``ValueError`` when the run's exports could not be completed: they copy the tokenizer of ``[model] path``
    (directly, or through ``warm_start_model``), so a model directory without one, its tokenizer elsewhere
    (``rollout.tokenizer_path``), would fail the final export after all the training."""
    if recipe.rollout.tokenizer_path is None:
        return  # the model directory's tokenizer is the one just checked
    from common.tokenizer_dir import check_tokenizer_dir

    try:
        check_tokenizer_dir(recipe.model.path)
    except (ValueError, FileNotFoundError):
        raise ValueError(
            f"the model directory {recipe.model.path} has no tokenizer files, and the run's exported models "
            f"(final_model/, hf/) take theirs from it: copy the tokenizer there (tokenizer.save_pretrained(DIR), from "
            f"rollout.tokenizer_path = {recipe.rollout.tokenizer_path}) and the run can leave tokenizer_path unset"
        ) from None


def _check_lora_base(recipe: Recipe, out_dir: Path) -> None:
    """Raise ``ValueError`` when a LoRA run would resume its adapters over other base weights than the run trained
    them on (``common.run_dir.lora_base_dir``: the model directory, or the warm-started model when the warm start
    trained every weight), or over a base that is gone. Names and shapes match either way, so nothing later would
    notice: the adapters would silently apply to another model."""
    base = recipe.lora_base
    if base is None:
        return
    record = read_run_record(out_dir)
    trained_on = lora_base_dir(record, out_dir) if record is not None else None
    if trained_on is not None and trained_on.resolve() != base.resolve():
        raise ValueError(
            f"--resume: the run in {out_dir} trained its adapters over {trained_on}, and this recipe would resume them "
            f"over {base} (its [model] path or run.warm_start.parameters / num_steps differ): resume with the recipe "
            f"it started with ({resume_command(out_dir / RESOLVED_RECIPE)}), or start afresh "
            "without --resume"
        )
    if not (base / "config.json").is_file():
        raise ValueError(f"--resume: the adapters of the run in {out_dir} apply to the model in {base}, which is gone "
                         f"(no config.json there): restore it, or start afresh without --resume")  # fmt: skip
    trained_lora = ((record or {}).get("model") or {}).get("lora") or {}
    alpha = recipe.model.lora.alpha if recipe.model.lora is not None else None
    if "alpha" in trained_lora and alpha is not None and float(trained_lora["alpha"]) != alpha:
        raise ValueError(
            f"--resume: the run in {out_dir} trained its adapters with [model.lora] alpha = {trained_lora['alpha']:g}, "
            f"and this recipe gives {alpha:g}: the same adapters would apply at another scale (alpha / rank), a "
            f"different policy. Resume with the recipe it started with ({resume_command(out_dir / RESOLVED_RECIPE)}), "
            "or start afresh without --resume"
        )

