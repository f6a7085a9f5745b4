"""Configuration of the rollout side: the serving engine, the sampling parameters and the pool of rollout workers.

No torch or vLLM import here, so recipes validate in well under a second. ``RolloutConfig`` is the ``[rollout]`` table
of a recipe; the group size (samples per prompt) is not here: the RL algorithm owns it and passes it to the pool.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic

from common.config import MAX_ACTORS, Config, DType, Seed
from weight_sync.peft import AdapterSpec

__all__ = [
    "MAX_SERVED_LORA_RANK", "MIN_TEMPERATURE", "EngineConfig", "RolloutConfig", "SamplingConfig", "UpdateMode",
    "check_temperature",
]  # fmt: skip

MIN_TEMPERATURE = 0.01
"""The lowest temperature vLLM samples at as asked: it raises any between 0 and this one to it (its ``_MAX_TEMP``),
so the trainer, tempering the logits by the asked one, would score another distribution. 0 is greedy decoding."""


def check_temperature(temperature: float) -> float:
    """``temperature`` if vLLM samples at it as asked (0, greedy, or at least :data:`MIN_TEMPERATURE`), else
    ``ValueError`` saying why."""
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature = {temperature:g}: vLLM samples at {MIN_TEMPERATURE:g} for any temperature between 0 and "
            f"{MIN_TEMPERATURE:g}, so the trainer's log-probs (tempered by {temperature:g}) would not be those of the "
            f"samples; use 0 (greedy) or at least {MIN_TEMPERATURE:g}"
        )
    return temperature

MAX_SERVED_LORA_RANK = 512
"""The largest adapter rank vLLM's LoRA path serves (the top of its ``max_lora_rank`` sizes, ``MaxLoRARanks``: a test
checks it against the installed vLLM, which recipe checks must not import)."""

UpdateMode = Literal["wait", "keep"]
"""How a weight update meets requests in flight (``EngineConfig.update_mode``)."""


class SamplingConfig(Config):
    """How completions are sampled (vLLM's ``SamplingParams`` minus the group size ``n``, which the algorithm sets)."""

    temperature: Annotated[float, pydantic.AfterValidator(check_temperature)] = pydantic.Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 is greedy (then all samples of a group are equal); otherwise at least
    :data:`MIN_TEMPERATURE`."""
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``; 1 disables it."""
    top_k: int = pydantic.Field(default=0, ge=0)
    """Keep only the ``top_k`` most likely tokens; 0 disables it."""
    max_tokens: int = pydantic.Field(default=256, ge=1)
    """Most tokens generated per completion (finish reason 'length' when reached)."""
    min_tokens: int = pydantic.Field(default=0, ge=0)
    """Fewest tokens generated before end-of-sequence and stop ids may end a completion."""
    stop: list[str] = []
    """Stop strings; a completion ends at the first one (it is not part of the completion ids' text)."""
    stop_token_ids: list[int] = []
    """Token ids that end a completion besides the tokenizer's end-of-sequence token (the id is kept in the ids)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence until ``max_tokens`` (benchmarks only)."""
    seed: Seed | None = None
    """Base seed: each sample's (and model turn's) seed derives from it and the sample's group id, index and turn
    (``rollout.sampling.turn_seed``), so results do not depend on which worker ran it or how episodes interleaved.
    ``None`` samples without a fixed seed."""

    @pydantic.model_validator(mode="after")
    def _check_lengths(self) -> SamplingConfig:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; lower min_tokens")
        return self


class EngineConfig(Config):
    """One serving engine (vLLM) inside a rollout worker."""

    dtype: DType = "float32"
    """Dtype the engine computes in and holds its floating-point weights in, whatever the checkpoint's: vLLM casts
    the checkpoint to it, and its receiver declares it, so pushes arrive in it."""
    kv_cache_gib: float = pydantic.Field(default=1.0, gt=0.0)
    """KV-cache memory per engine in GiB (vLLM's ``kv_cache_memory_bytes``; same meaning on CPU, GPU and TPU)."""
    max_model_len: int = pydantic.Field(default=2048, ge=16)
    """Longest prompt + completion in tokens."""
    max_num_seqs: int = pydantic.Field(default=64, ge=1)
    """Most sequences decoded together in one engine step (the batch size of decoding)."""
    max_num_batched_tokens: int | None = pydantic.Field(default=None, ge=16)
    """Token budget of one engine step (prefill chunking); ``None`` keeps vLLM's default."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: faster start, slower decoding (``python -m benchmarks.rollout`` measures
    both). Turn it on for short runs and tests dominated by engine start."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (the n samples of a group share their prompt, an episode's next turn
    extends its last); reset on every update."""
    block_size: int | None = pydantic.Field(default=None, ge=16, multiple_of=16)
    """Tokens per KV-cache block, a multiple of 16 (of 32 on CPU: vLLM's attention kernels' blocks); the prefix cache
    reuses whole blocks only. ``None``: the platform's choice (:func:`rollout.engine.platform.platform_engine_args`: 32
    on CPU, vLLM's default elsewhere)."""
    seed: Seed = 0
    """Engine-wide random seed (requests with a sampling seed use their own). In a recipe, unset means
    ``run.seed``."""
    cpu_threads_bind: str = "auto"
    """CPU engines only: cores the model's OpenMP threads bind to (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``): 'auto' (one
    thread per physical core), 'nobind' (``OMP_NUM_THREADS`` threads, unpinned; for engines sharing cores with other
    work), or a core list such as '0-3'. Ignored on GPU/TPU."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Which distribution the returned per-token log-probs come from: 'processed_logprobs' is the one sampled from
    (``log_softmax(logits / temperature)`` after top-k/top-p masking; equals what the trainer computes when top_k=0 and
    top_p=1), 'raw_logprobs' is ``log_softmax(logits)`` ignoring temperature."""
    tensor_parallel_size: int = pydantic.Field(default=1, ge=1)
    """Accelerators per engine (vLLM tensor parallelism); 1 on CPU."""
    lora: AdapterSpec | None = None
    """Serve LoRA adapters of this shape over the frozen model: every pushed version is an adapter (PEFT names, see
    ``weight_sync.peft``), served as ``lora_serving`` says. In a recipe it is set from ``[model.lora]``."""
    lora_serving: Literal["auto", "adapter", "merged"] = "auto"
    """How an engine with ``lora`` serves an adapter version: 'adapter' through vLLM's LoRA path (each request keeps
    the adapter it started on, so an update needs no drain; no reload of the base), 'merged' folded into the base
    weights and loaded as an ordinary weight update (drain per ``update_mode``, generation at the base model's
    speed). 'auto': 'merged' on CPU, where vLLM's LoRA ops are slow (README "Measured"), and for ranks above
    :data:`MAX_SERVED_LORA_RANK`; 'adapter' elsewhere."""
    update_mode: UpdateMode = "wait"
    """How a weight update meets requests in flight: 'wait' lets them finish on the old weights first (every
    completion is of one version; the pause includes that drain), 'keep' swaps at the next step boundary and they go
    on with the new weights, their KV recomputed (a completion may span versions: each token's is recorded, and its
    log-prob is that of the weights that sampled it, so the trainer's importance correction stays exact; the pause is
    the reload alone)."""

    def kv_cache_problem(self, num_layers: int, num_kv_heads: int, head_dim: int) -> str | None:
        """Why ``kv_cache_gib`` cannot hold one sequence of ``max_model_len`` tokens of a model of these shapes (vLLM
        then refuses to start, naming a setting of its own); None when it can. An engine of a tensor-parallel group
        holds its share of the key/value heads."""
        heads = max(1, num_kv_heads // self.tensor_parallel_size)
        per_token = 2 * num_layers * heads * head_dim * (4 if self.dtype == "float32" else 2)
        needed = self.max_model_len * per_token
        if needed <= self.kv_cache_gib * (1 << 30):
            return None
        return (f"{self.kv_cache_gib:g} GiB of KV cache holds {int(self.kv_cache_gib * (1 << 30)) // per_token} "
                f"tokens of this model ({per_token} bytes each in {self.dtype}), not one sequence of "
                f"rollout.engine.max_model_len = {self.max_model_len}: raise it to at least {needed / (1 << 30):.3g} "
                "GiB (more for sequences decoded together) or lower max_model_len")  # fmt: skip


class RolloutConfig(Config):
    """The rollout pool: which model to serve, how many workers, how each engine runs and how it samples."""

    model_path: str | None = None
    """Local HF model directory (config.json, safetensors, tokenizer files) every engine starts from. In a recipe,
    unset means the ``[model] path`` (the recipe fills it in, so ``recipe.rollout.model_path`` is always set); set it
    only to serve another copy of the same checkpoint. A config made for a pool by hand must set it."""
    tokenizer_path: str | None = None
    """Local tokenizer directory when it differs from ``model_path``."""
    use_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template: ``None`` when it has one, ``True`` requires it."""
    num_workers: Annotated[int, pydantic.Field(ge=1, le=MAX_ACTORS)] | Literal["auto"] = 1
    """Rollout workers (Ray actors), each one engine. 'auto' (in a recipe): as many as the run's placement makes
    best use of, decided by ``driver.placement.plan_placement``; a pool is always given a number."""
    num_cpus_per_worker: float = pydantic.Field(default=1.0, ge=0.0)
    """Ray CPUs reserved per worker."""
    num_gpus_per_worker: float = pydantic.Field(default=0.0, ge=0.0)
    """Ray GPUs reserved per worker (``engine.tensor_parallel_size`` on GPU hosts, 0 on CPU)."""
    max_groups_per_dispatch: int = pydantic.Field(default=64, ge=1)
    """Most groups sent to one worker in one call; smaller pieces balance load and lose less when a worker dies."""
    num_worker_restarts: int = pydantic.Field(default=3, ge=0)
    """Replacements the pool may start over its lifetime for workers that died; one more death fails the batch."""
    engine: EngineConfig = EngineConfig()
    """The serving engine of each worker."""
    sampling: SamplingConfig = SamplingConfig()
    """Default sampling parameters (a call may pass its own)."""

    @property
    def served_model_path(self) -> str:
        """``model_path``, the directory every engine serves; ``ValueError`` when a hand-made config left it unset."""
        if self.model_path is None:
            raise ValueError("rollout.model_path is unset: set it, or build the config as part of a recipe")
        return self.model_path

    @property
    def tokenizer_dir(self) -> str:
        """The directory the workers (and the driver) load the tokenizer from: ``tokenizer_path``, else the served
        model's."""
        return self.tokenizer_path or self.served_model_path
