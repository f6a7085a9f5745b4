"""Configuration of the reward: a weighted sum of named terms, each a tagged union on ``type``.

In a recipe::

    [reward]
    on_error = "fail"

    [[reward.terms]]
    type = "math"

    [[reward.terms]]
    type = "format"
    pattern = '^\\d+$'
    weight = 0.1

No torch import here, so recipes validate instantly; ``rollout.rewards.RewardScorer.from_config`` builds the scorer.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Literal

import pydantic

from common.config import Config, DType, changed_settings, setting_warning
from common.imports import check_import_path

__all__ = [
    "OverlongPenaltyConfig",
    "ExactMatchRewardConfig",
    "FormatRewardConfig",
    "FunctionRewardConfig",
    "MathRewardConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardTermConfig",
]

log = logging.getLogger("rl_align")


class _TermConfig(Config):
    name: str | None = pydantic.Field(default=None, pattern=r"^[^/\x00-\x1f]+$")
    """Name of the term in metrics (``reward/<name>/...``) and ``Sample.reward_terms``; defaults to its ``type``. Names
    must be unique, not empty, without ``/`` or control characters."""
    weight: float = 1.0
    """The term's score is multiplied by this before summing into the reward."""

    @property
    def term_name(self) -> str:
        """The configured name, or the type when none is given."""
        return self.name if self.name is not None else self.type  # type: ignore[attr-defined]


class MathRewardConfig(_TermConfig):
    """1.0 when the completion's final answer equals the reference mathematically (math-verify), else 0.0.

    Equivalent forms count: ``"0.5"`` and ``"1/2"``, ``"\\frac{1}{2}"``, ``"\\boxed{...}"``, ``"1,234"`` and ``"1234"``.
    """

    type: Literal["math"] = "math"
    """Selects this term."""
    timeout_s: int = pydantic.Field(default=5, ge=1)
    """Most seconds math-verify spends parsing or comparing one completion (its own SIGALRM limit, which holds on the
    reward process's main thread, :mod:`rollout.rewards.isolation`; ``reward.timeout_s`` bounds the whole call)."""


class ExactMatchRewardConfig(_TermConfig):
    """1.0 when the normalised completion equals the normalised reference answer, else 0.0."""

    type: Literal["exact_match"] = "exact_match"
    """Selects this term."""
    extract_pattern: str | None = None
    """Optional regex; the completion's text is replaced by the last match (group 1 if the pattern has a group),
    e.g. ``'Answer:\\s*(\\S+)'``. No match scores 0."""
    case_sensitive: bool = False
    """Compare letter case; by default both sides are lower-cased."""

    @pydantic.field_validator("extract_pattern")
    @classmethod
    def _check_pattern(cls, pattern: str | None) -> str | None:
        return _compile_check(pattern) if pattern is not None else None


class FormatRewardConfig(_TermConfig):
    """1.0 when the completion matches ``pattern``, else 0.0."""

    type: Literal["format"] = "format"
    """Selects this term."""
    pattern: str
    """Python regex the completion must match (with DOTALL, so ``.`` spans lines)."""
    mode: Literal["fullmatch", "search"] = "fullmatch"
    """'fullmatch': the whole completion (after stripping whitespace) must match; 'search': a match anywhere."""

    @pydantic.field_validator("pattern")
    @classmethod
    def _check_pattern(cls, pattern: str) -> str:
        return _compile_check(pattern)


class FunctionRewardConfig(_TermConfig):
    """A user function ``f(completion: str, problem: Problem) -> float``, given as ``"package.module:function"``.

    The module must be importable where the driver and the rollout workers run (installed, or on ``PYTHONPATH``).
    :func:`recipe.load_recipe` resolves it (:meth:`check_importable`), so a wrong name or a module that fails to import
    is reported at load, before any actor starts; the scorer resolves it again where it runs.
    """

    type: Literal["function"] = "function"
    """Selects this term."""
    function: str
    """Import path ``module:function``, e.g. ``"my_rewards:length_penalty"``. An ``async def`` function (a judge
    behind an HTTP API) is awaited, up to ``max_concurrency`` calls at once."""
    max_concurrency: int = pydantic.Field(default=32, ge=1)
    """Calls of an ``async def`` function in flight at once (a plain function is called one sample at a time)."""

    @pydantic.field_validator("function")
    @classmethod
    def _check_form(cls, path: str) -> str:
        return check_import_path(path, "reward function", "my_rewards:length_penalty")

    def check_importable(self) -> None:
        """Import the module and look the function up, as the scorer will; ``ValueError`` says what is missing. A
        ``max_concurrency`` set for a plain function (called one sample at a time) is warned about."""
        from rollout.rewards.function import is_async_function, resolve_function

        function = resolve_function(self.function)
        if not is_async_function(function) and (unused := changed_settings(self, ["max_concurrency"])):
            setting_warning(log, "reward term %r: %s is unused, as %r is no async function (called one sample at a "
                            "time)", self.term_name, unused[0], self.function)  # fmt: skip


class RewardModelConfig(_TermConfig):
    """Score of a local HF sequence-classification model (``AutoModelForSequenceClassification``) on prompt+completion.

    The text scored is the conversation rendered with the reward model's chat template (the completion as the
    assistant turn) when its tokenizer has one, else prompt text followed by the completion.
    """

    type: Literal["reward_model"] = "reward_model"
    """Selects this term."""
    path: str
    """Local directory with the model's config, weights and tokenizer."""
    label_index: int = pydantic.Field(default=0, ge=0)
    """Which output logit is the reward (0 for the usual single-label reward model)."""
    batch_size: int = pydantic.Field(default=16, ge=1)
    """Sequences scored per forward pass."""
    max_length: int = pydantic.Field(default=2048, ge=8)
    """Longer inputs keep their leading special tokens (a BOS, an encoder's ``[CLS]``) and their end (the completion);
    at most the model's positions (and its tokenizer's ``model_max_length``)."""
    device: str = "cpu"
    """Torch device of the reward model ('cpu', or 'cuda': the GPU Ray gives the rollout worker, which holds its own
    copy of the model)."""
    dtype: DType = "float32"
    """Dtype the reward model runs in."""

    def directory_problem(self) -> str | None:
        """What makes ``path`` no reward model this term can use, read from its files (no torch, no weights): no
        ``config.json``; an architecture that is no sequence classifier (its head would be random); ``label_index``
        past its labels; a tokenizer with more ids than its embedding rows. None when none of these."""
        import json
        from pathlib import Path

        from common.tokenizer_dir import tokenizer_num_ids

        try:
            config = json.loads((Path(self.path) / "config.json").read_text())
        except FileNotFoundError:
            return (f"{self.path!r} has no config.json: point it at a local HF sequence-classification model directory "
                    f"(relative paths resolve against {Path.cwd()})")  # fmt: skip
        except (OSError, ValueError) as e:
            return f"{self.path}/config.json cannot be read: {e}"
        architectures = config.get("architectures") or []
        if architectures and not any(str(a).endswith("ForSequenceClassification") for a in architectures):
            return (f"{self.path!r} holds a {', '.join(map(str, architectures))} (config.json architectures), not a "
                    "sequence classifier: loaded as one, its score head would be random. Point it at a reward model "
                    "(AutoModelForSequenceClassification, usually num_labels = 1)")  # fmt: skip
        num_labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2  # transformers' default: 2
        if self.label_index >= num_labels:
            return f"label_index = {self.label_index}, and the model in {self.path!r} has {num_labels} label(s)"
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        num_ids = tokenizer_num_ids(self.path)
        if isinstance(vocab, int) and num_ids is not None and num_ids > vocab:
            return (f"the tokenizer in {self.path!r} has {num_ids} token ids and the reward model {vocab} embedding "
                    "rows: tokens added to its tokenizer need rows of their own (resize_token_embeddings, then "
                    "save_pretrained)")  # fmt: skip
        return None


RewardTermConfig = Annotated[
    MathRewardConfig | ExactMatchRewardConfig | FormatRewardConfig | FunctionRewardConfig | RewardModelConfig,
    pydantic.Field(discriminator="type"),
]
"""One reward term, chosen by ``type``: 'math', 'exact_match', 'format', 'function' or 'reward_model'."""

_DEFAULT_TERM: RewardTermConfig = MathRewardConfig()


class OverlongPenaltyConfig(Config):
    """DAPO's soft overlong punishment: a length penalty over the last ``cache_tokens`` tokens before the rollout's
    ``max_tokens`` (L_max), added to the reward as the term ``overlong``.

    ``penalty(n) = 0`` for ``n <= L_max - cache_tokens``, then falls linearly to ``-1`` at ``n = L_max``:
    ``(L_max - cache_tokens - n) / cache_tokens``. A completion cut at ``max_tokens`` thus scores ``weight x -1`` on
    top of its other terms instead of looking like any other wrong answer.
    """

    cache_tokens: int = pydantic.Field(ge=1)
    """Length of the punishment interval (DAPO's L_cache), at most ``rollout.sampling.max_tokens``."""
    weight: float = 1.0
    """Scale of the penalty in the reward."""


class RewardConfig(Config):
    """The reward of a completion: ``sum(term.weight * term.score)`` over ``terms``, plus the overlong penalty."""

    terms: list[RewardTermConfig] = pydantic.Field(default_factory=lambda: [_DEFAULT_TERM], min_length=1)
    """The reward terms; each is reported on its own in metrics and ``Sample.reward_terms``."""
    on_error: Literal["fail", "zero"] = "fail"
    """When a user reward function raises, returns a non-number or passes ``timeout_s``: 'fail' stops the step with
    an error naming the sample; 'zero' scores that term 0 for the sample and counts it in the metrics
    (``reward/<term>/num_errors``)."""
    timeout_s: float = pydantic.Field(default=60.0, gt=0)
    """Most seconds one term may take on one completion. Every term but reward models runs in a process of its own
    beside the rollout worker (:mod:`rollout.rewards.isolation`), which is stopped and replaced when a call takes
    longer: a user function's sample then counts as failed (``on_error``); a rule term's (a math check that never
    ends on a model's output) scores 0 and is counted."""
    strip_suffixes: list[str] = pydantic.Field(
        default_factory=lambda: ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"]
    )
    """End-of-sequence texts removed (repeatedly) from the end of a completion, then trailing whitespace, before any
    term sees it, so a stop token decoded into the text does not change a score."""
    overlong: OverlongPenaltyConfig | None = None
    """DAPO's soft overlong punishment by completion length (term ``overlong``); None: off."""

    @property
    def accuracy_term(self) -> str | None:
        """Name of the term that says whether an answer is right (the first 'math' or 'exact_match' term): held-out
        accuracy is the fraction of completions it scores 1. ``None`` when no term does."""
        return next((t.term_name for t in self.terms if t.type in ("math", "exact_match")), None)

    @pydantic.model_validator(mode="after")
    def _check_names(self) -> RewardConfig:
        names = [t.term_name for t in self.terms] + (["overlong"] if self.overlong is not None else [])
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"reward terms share the name(s) {duplicates}; give each term of the same type its own `name`"
            )
        return self


def _compile_check(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{pattern!r} is not a valid Python regex: {e}") from None
    return pattern
