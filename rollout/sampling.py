"""Turn a ``SamplingConfig`` and a group size into the engine's sampling parameters (vLLM ``SamplingParams``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rollout.config import SamplingConfig

if TYPE_CHECKING:
    from vllm import SamplingParams

__all__ = ["is_greedy", "turn_seed", "to_vllm_sampling_params"]


def is_greedy(sampling: SamplingConfig) -> bool:
    """Whether vLLM decodes ``sampling`` greedily: one completion per prompt, the same for every caller."""
    return sampling.temperature == 0  # vLLM raises any other below MIN_TEMPERATURE to it (SamplingConfig refuses them)


def turn_seed(sampling: SamplingConfig, group_id: int, sample_index: int, turn: int, n: int = 1) -> int | None:
    """Seed of model turn ``turn`` of sample ``sample_index`` of group ``group_id`` (a function of these and
    ``sampling.seed`` only, so a batch is reproducible however its episodes interleave), or ``None`` when sampling is
    unseeded.

    The samples of a group count up from one seed per (group, turn): vLLM seeds the ``n`` completions of one request
    ``s, s + 1, ...``, so the engine can run a group's samples as one request (:mod:`rollout.engine.joining`)
    and each still gets exactly its own seed. A turn that samples ``n`` > 1 choices (an agent's call) would run into
    the next samples' seeds that way, so it gets a seed of its own (its choices take ``s .. s + n - 1``).
    """
    if sampling.seed is None:
        return None
    if n > 1:
        return int(np.random.SeedSequence([sampling.seed, group_id, turn, sample_index, n]).generate_state(1)[0] >> 2)
    base = int(np.random.SeedSequence([sampling.seed, group_id, turn]).generate_state(1)[0] >> 2)
    return base + sample_index


def to_vllm_sampling_params(
    sampling: SamplingConfig, n: int, seed: int | None = None, logprobs: bool = True
) -> SamplingParams:
    """vLLM parameters that draw ``n`` completions of one prompt with ``seed``, returning each sampled token's log-prob.

    ``logprobs=0`` asks vLLM for the log-prob of the sampled token only (no top-k alternatives), which is all the
    trainer needs and keeps the output small; ``flat_logprobs`` returns them as a few flat lists instead of a dict of
    ``Logprob`` objects per token (their construction was a visible part of a decode step on a small model).
    """
    from vllm import SamplingParams

    if n < 1:
        raise ValueError(f"group size n={n} must be at least 1")
    return SamplingParams(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        min_tokens=sampling.min_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos,
        seed=seed,
        logprobs=0 if logprobs else None,
        flat_logprobs=logprobs,
        detokenize=bool(sampling.stop),  # stop strings need text; token ids alone do not
    )
