"""The weight-sync sink of a served vLLM (``vllm serve`` with the ``rl_align`` plugin): applies each verified version
through vLLM's own update API at a safe point, so no reply mixes versions and no operator step is needed.

It lives in the API-server process and drives the server's ``EngineClient`` (vLLM's public RL API) on the server's
event loop from the receiver's Commit thread. One update, in order:

1. check the update against the served checkpoint's manifest (names, shapes, dtypes, not empty): refused with the
   engine untouched;
2. write it as one safetensors file in ``stage_dir`` that every worker reads; generation runs on meanwhile;
3. ``pause_generation(mode="wait")``: running requests finish on the old weights, new ones queue. A request that was
   preempted with output already sampled would finish on the new weights: it is aborted (its client sees
   ``finish_reason="abort"``) rather than answered with a mix. A drain longer than ``drain_timeout_s`` refuses the
   update and resumes (``on_drain_timeout = "refuse"``) or aborts what still runs (``"abort"``);
4. ``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update(weight_version=str(v))`` ->
   ``reset_prefix_cache`` -> ``resume_generation``. A refusal by the worker (:data:`rollout.engine.transfer.REFUSED`)
   resumes on the old weights. Any other failure may have left the model half loaded: the server stays paused (no
   reply leaves it from a mixed model), the sink reports itself broken, and the process is asked to exit (SIGTERM)
   so its orchestrator restarts it on the last persisted version;
5. with ``persist_dir``, keep the served version there (the directory a restart serves, at that version), after the
   resume: it lengthens the Commit, not the pause. A failed write is logged and reported; the version stays served.

With ``lora`` (an :class:`weight_sync.peft.AdapterSpec`) the server takes LoRA adapter versions instead, as a trainer
with ``[model.lora]`` pushes them (PEFT names; base tensors too where the base itself trained): each is merged into
the served checkpoint's base weights (``rollout.engine.adapters.MergedAdapters``; a subset updates the served
adapter) and the merged projections go through steps 2-4 as an ordinary update, so clients keep calling the served
model by its name and every reply comes from one version. ``persist_dir`` is refused with it: a restart would serve
the base without the adapter under the adapter's version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rollout.engine.adapters import AdapterVersions, MergedAdapters
from rollout.engine.sink import check_update
from rollout.engine.transfer import (
    REFUSED,
    check_fused_groups,
    check_whole_expert_layers,
    engine_manifest,
    sweep_stage_dir,
    write_update_file,
)
from weight_sync.checkpoint import read_checkpoint_manifest
from weight_sync.peft import AdapterSpec, adapter_manifest, expert_tensor
from weight_sync.sink import SafetensorsDirSink, read_policy_version
from weight_sync.spec import TensorSpec, dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["ServedUpdateState", "ServerWeightSink"]

log = logging.getLogger(__name__)
RESUME_ON_CUT_S = 5.0  # how long a cut update waits to resume generation (an engine shutting down may not answer)
_SHUTTING_DOWN = ("weight update to version {version} was cut: the server is shutting down before serving it (it "
                  "served version {served}); push to it again once it is back")  # fmt: skip


@dataclass
class ServedUpdateState:
    """What ``GET /rl_align/weight_sync`` and the metrics report about the served weights (the count of refused
    updates is the receiver's, :attr:`weight_sync.receiver.WeightReceiver.num_refused`: it sees every refusal)."""

    policy_version: int
    broken: str | None = None
    num_updates: int = 0
    num_aborted_requests: int = 0
    last_update_s: float = 0.0
    """Seconds of the last applied update, from the check to the resume."""
    last_pause_s: float = 0.0
    """Seconds the last applied update held generation paused (drain included)."""
    last_error: str | None = None


class ServerWeightSink:
    """Applies verified versions to the ``EngineClient`` of a vLLM server (implements ``weight_sync``'s sink).

    ``apply`` is called from a receiver thread (the receiver calls it one update at a time) and blocks until the
    update is served or refused; it must not be called on ``loop``'s own thread. ``state`` is the one record of the
    served version and of every outcome (the plugin's route and metrics read it).
    """

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        model_dir: str,
        *,
        stage_dir: str,
        persist_dir: str | None = None,
        drain_timeout_s: float = 300.0,
        update_timeout_s: float = 600.0,
        on_drain_timeout: Literal["refuse", "abort"] = "refuse",
        exit_process: Callable[[], None] | None = None,
        lora: AdapterSpec | None = None,
    ) -> None:
        if lora is not None and persist_dir is not None:
            raise ValueError("persist_dir with lora is not built: a restart would serve the base model without the "
                             "adapter; unset persist_dir (a restarted server then starts at version 0 and takes the "
                             "trainer's next complete push)")  # fmt: skip
        self._engine = engine
        self._loop = loop
        dtype = _served_dtype(engine)
        base = _as_served(read_checkpoint_manifest(model_dir), dtype)
        self._adapter_specs = {} if lora is None else {s.name: s for s in adapter_manifest(base, lora)}
        self._specs = {**{s.name: s for s in base}, **self._adapter_specs}
        self._versions = None if lora is None else AdapterVersions(set(self._adapter_specs))
        self._merged = None if lora is None else MergedAdapters(model_dir, base, lora)
        self._lora_alpha = 0.0 if lora is None else lora.alpha
        self._stage_dir = stage_dir
        sweep_stage_dir(stage_dir)
        self._persist = _persist_sink(model_dir, persist_dir, base, dtype)
        self._packed_modules = _packed_modules(engine)
        self._experts = _experts_per_module(base)
        self._drain_timeout_s = drain_timeout_s
        self._update_timeout_s = update_timeout_s
        self._on_drain_timeout = on_drain_timeout
        self._exit_process = exit_process or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        served = read_policy_version(persist_dir if persist_dir is not None else model_dir)
        self.state = ServedUpdateState(policy_version=served)
        self._closing = False
        self._serving: concurrent.futures.Future[float] | None = None  # the update being served on the loop

    def manifest(self) -> list[TensorSpec]:
        """The served checkpoint's tensors (HF-canonical names, global shapes) in the dtypes the server holds them in
        (``vllm serve --dtype float32`` over a bfloat16 checkpoint takes float32: senders send what is declared); with
        ``lora`` also the adapters of that shape over it (``weight_sync.peft.adapter_manifest``)."""
        return list(self._specs.values())

    def lora_alpha(self) -> float:
        """The alpha adapters are merged with (the plugin's ``lora.alpha``), 0.0 without LoRA."""
        return self._lora_alpha

    def committed_version(self) -> int:
        """The version served now: the served (or persisted) checkpoint's version at start, then the last applied."""
        return self.state.policy_version

    def apply(self, policy_version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Serve ``tensors`` as ``policy_version`` (module docstring, steps 1-4); blocks until served or refused.

        Raises ``ValueError`` (engine unchanged) for a refused update, ``TimeoutError`` (unchanged) for a drain that
        took too long under ``"refuse"``, ``RuntimeError`` when the server is broken.
        """
        start = time.perf_counter()
        if self.state.broken is not None:
            raise RuntimeError(self.unavailable())
        if self._closing:
            raise RuntimeError(_SHUTTING_DOWN.format(version=policy_version, served=self.state.policy_version))
        try:
            check_update(self._specs, tensors)
        except ValueError as e:
            self._refused(e)
            raise
        weights, full, adapter = tensors, len(tensors) == len(self._specs), None
        base: dict[str, torch.Tensor] = {}
        if self._versions is not None and self._merged is not None:  # an adapter version, merged into the base
            base = {name: t for name, t in tensors.items() if name not in self._adapter_specs}
            update = {name: t for name, t in tensors.items() if name in self._adapter_specs}
            adapter = self._versions.merge(policy_version, update)
            weights, full = self._merged.weights(adapter, base), False
        if not full:  # a partial fused group or expert layer is refused here, before any worker sees it
            try:
                check_fused_groups(weights, self._packed_modules)
                check_whole_expert_layers(weights, self._experts)
            except ValueError as e:
                self._refused(e)
                raise
        path = self._stage(policy_version, weights)
        try:
            self._serving = future = asyncio.run_coroutine_threadsafe(
                self._serve(policy_version, path, full), self._loop)
            if self._closing:  # closed while this update was being staged
                future.cancel()
            pause_s = future.result(timeout=self._drain_timeout_s + self._update_timeout_s)
        except (ValueError, TimeoutError) as e:
            self._refused(e)
            raise
        except concurrent.futures.CancelledError:  # cut by close() or the server's loop: SIGTERM, shutdown
            self.state.last_error = _SHUTTING_DOWN.format(version=policy_version, served=self.state.policy_version)
            raise RuntimeError(self.state.last_error) from None
        finally:
            self._serving = None
            os.unlink(path)
        if adapter is not None and self._versions is not None and self._merged is not None:
            self._versions.tensors = adapter
            self._merged.commit_base(base)
        self.state.policy_version = policy_version
        self.state.num_updates += 1
        self.state.last_update_s = time.perf_counter() - start
        self.state.last_pause_s = pause_s
        self.state.last_error = None
        if self._persist is not None:
            try:
                self._persist.apply(policy_version, tensors)
            except Exception as e:  # the engine serves the version already: report, do not refuse
                self.state.last_error = f"version {policy_version} is served but was not persisted: {e}"
                log.error("%s", self.state.last_error)

    def unavailable(self) -> str | None:
        """Why no update is taken now: the server is broken (an update failed midway) or shutting down; else None."""
        if self.state.broken is not None:
            return f"this server stopped taking updates: {self.state.broken}; restart it"
        if self._closing:
            return "this server is shutting down; push to it again once it is back"
        return None

    def close(self) -> None:
        """The server is shutting down: cut the update being served, if any (its Commit fails and the version stays
        the one served and persisted; a drain would otherwise wait for an engine already gone up to
        ``drain_timeout_s``, holding the process), and refuse later ones."""
        self._closing = True
        serving = self._serving
        if serving is not None:
            serving.cancel()

    def _stage(self, policy_version: int, tensors: Mapping[str, torch.Tensor]) -> str:
        """Write the update where every worker can read it; a stage directory without room is named with the fix."""
        try:
            return write_update_file(tensors, self._stage_dir, policy_version)
        except OSError as e:  # typically a full /dev/shm (Docker's default is 64 MiB)
            raise RuntimeError(
                f"cannot stage version {policy_version} in stage_dir={self._stage_dir!r}: {e}; it needs room for "
                "one model (give the container --ipc=host or a larger --shm-size, or set stage_dir)"
            ) from e

    async def _serve(self, policy_version: int, path: str, full: bool) -> float:
        """Steps 3-4 on the server's event loop; returns the seconds generation was paused. Cut (``close``, the loop's
        shutdown) it tries to resume generation before it ends, so that a shutdown that drains its requests
        (``--shutdown-timeout``) does not wait on a paused engine."""
        try:
            return await self._serve_paused(policy_version, path, full)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._engine.resume_generation(), RESUME_ON_CUT_S)
            raise

    async def _serve_paused(self, policy_version: int, path: str, full: bool) -> float:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        engine = self._engine
        paused_at = time.perf_counter()
        try:
            await self._drain()
        except TimeoutError:
            raise  # refused, generation resumed (the drain-timeout policy)
        except Exception as e:  # a failed pause must not leave generation paused behind a healthy-looking server
            try:
                await engine.resume_generation()
            except Exception as again:
                raise self._break(policy_version, f"pausing generation failed ({e}), and resuming it ({again})") from e
            raise ValueError(f"weight update to version {policy_version} refused: pausing generation failed: {e}") \
                from e
        try:
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(
                update_info={"policy_version": policy_version, "full": full, "path": path}))
        except Exception as e:
            if REFUSED in str(e):
                await engine.resume_generation()
                raise ValueError(f"weight update to version {policy_version} refused by the engine: {e}") from e
            raise self._break(policy_version, f"failed midway: {e}") from e
        try:
            await engine.finish_weight_update(weight_version=str(policy_version))
            await engine.reset_prefix_cache()
        finally:
            await engine.resume_generation()
        return time.perf_counter() - paused_at

    def _refused(self, error: Exception) -> None:
        self.state.last_error = str(error)
        log.warning("weight update refused, the served version stays %d: %s", self.state.policy_version, error)

    def _break(self, policy_version: int, what: str) -> RuntimeError:
        """Mark the server broken after an update left the engine in an unknown state, make it exit (its orchestrator
        restarts it on a known version) and return the error to raise."""
        self.state.broken = f"weight update to version {policy_version}: {what}"
        log.error("%s; generation stays paused and the server exits so that it restarts on a known version",
                  self.state.broken)  # fmt: skip
        self._exit_process()
        return RuntimeError(self.state.broken)

    async def _drain(self) -> None:
        """Pause with in-flight requests finishing on the old weights; apply the drain-timeout policy; abort the
        requests that would otherwise resume on the new weights."""
        engine = self._engine
        try:
            await asyncio.wait_for(engine.pause_generation(mode="wait", clear_cache=True), self._drain_timeout_s)
        except TimeoutError:
            if self._on_drain_timeout == "refuse":
                await engine.resume_generation()
                raise TimeoutError(
                    f"in-flight requests did not finish within drain_timeout_s={self._drain_timeout_s}; update "
                    "refused, the server keeps its version (raise drain_timeout_s, bound max_tokens, or set "
                    "on_drain_timeout='abort')"
                ) from None
            # vLLM's abort mode ends every request it holds, those still waiting for their first token included.
            cut = len(_request_states(engine))
            await engine.pause_generation(mode="abort", clear_cache=True)
            self.state.num_aborted_requests += cut
            log.warning("drain_timeout_s=%s passed: aborted the %d request(s) running or queued (on_drain_timeout = "
                        "'abort')", self._drain_timeout_s, cut)  # fmt: skip
        partial = _requests_with_output(engine)
        if partial:
            await engine.abort(partial, internal=True)
            self.state.num_aborted_requests += len(partial)
            log.warning("aborted %d preempted request(s) that would have resumed on new weights", len(partial))


def _packed_modules(engine: Any) -> dict[str, list[str]]:
    """The served model class's fused groups (vLLM's ``packed_modules_mapping``), read in this process: a partial group
    (and a partial expert layer) is refused here, before the workers. Each worker refuses it too, but with tensor
    parallelism vLLM's executor answered a call with the first worker's refusal and the next call (the next update's
    pause) with the second's.
    Empty when the engine client names no model class (the workers' check remains)."""
    model_config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    if model_config is None:
        return {}
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        model_class, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    except Exception as e:  # an unusual model (remote code, another backend): the workers' check remains
        log.warning("fused groups of %s not read (%s): partial groups are refused by the workers only",
                    model_config.architectures, e)  # fmt: skip
        return {}
    return {name: list(members) for name, members in (getattr(model_class, "packed_modules_mapping", {}) or {}).items()}


def _experts_per_module(manifest: list[TensorSpec]) -> dict[str, int]:
    """Each MoE layer's experts module in the checkpoint (``model.layers.0.mlp.experts``) and its expert count."""
    experts: dict[str, set[int]] = {}
    for spec in manifest:
        if (where := expert_tensor(spec.name)) is not None:
            experts.setdefault(where.experts, set()).add(where.expert)
    return {module: len(indices) for module, indices in experts.items()}


def _served_dtype(engine: Any) -> str | None:
    """The dtype the server's model computes in (vLLM's resolved ``--dtype``), or ``None`` when the engine client does
    not say (the checkpoint's own dtypes are declared then)."""
    model_config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    dtype = getattr(model_config, "dtype", None)
    return None if dtype is None else dtype_name(dtype)


def _as_served(checkpoint: list[TensorSpec], dtype: str | None) -> list[TensorSpec]:
    return checkpoint if dtype is None else engine_manifest(checkpoint, dtype)


def _request_states(engine: Any) -> dict[str, Any]:
    """The requests vLLM's ``AsyncLLM`` holds (running, preempted or queued), by id, from its output processor;
    another engine client reports none."""
    return dict(getattr(getattr(engine, "output_processor", None), "request_states", None) or {})


def _requests_with_output(engine: Any) -> list[str]:
    """Requests that hold sampled tokens yet are not running after a drain (preempted ones)."""
    return [rid for rid, state in _request_states(engine).items() if getattr(state, "weight_version_starts", None)]


def _persist_sink(
    model_dir: str, persist_dir: str | None, manifest: list[TensorSpec], dtype: str | None
) -> SafetensorsDirSink | None:
    """The directory each version is kept in for a restart; on first use it starts as a copy of the served model.
    Versions are kept as served (``manifest``'s dtypes): a float32 server over a bfloat16 checkpoint persists float32,
    which a restart with the same ``--dtype`` serves exactly.

    Raises ``ValueError`` when ``persist_dir`` already holds another checkpoint than the one served: another version
    (a restart on the base model instead of on ``persist_dir``: the server would claim the persisted version while
    serving the base weights) or another model."""
    if persist_dir is None:
        return None
    import shutil
    from pathlib import Path

    target = Path(persist_dir)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"persist_dir {persist_dir!r} cannot be used: {e}") from None
    if os.path.realpath(model_dir) != os.path.realpath(persist_dir):
        seeding = target / ".seeding"  # a first start that dies while copying leaves only this behind
        if any(target.glob("*.safetensors")):
            _check_persisted_is_served(model_dir, persist_dir, manifest, dtype)
        else:
            shutil.rmtree(seeding, ignore_errors=True)
            seeding.mkdir()
            files = [item for item in Path(model_dir).iterdir() if item.is_file()]
            for item in files:
                shutil.copy2(item, seeding / item.name)
            for item in sorted(files, key=lambda f: f.suffix == ".safetensors"):  # the weights last
                os.replace(seeding / item.name, target / item.name)
        shutil.rmtree(seeding, ignore_errors=True)
    return SafetensorsDirSink(persist_dir, manifest)


def _check_persisted_is_served(model_dir: str, persist_dir: str, manifest: list[TensorSpec], dtype: str | None) -> None:
    persisted, served = read_policy_version(persist_dir), read_policy_version(model_dir)
    start_there = (f"start the server with --model {persist_dir} to serve what it holds, or give persist_dir an "
                   f"empty directory to start from --model {model_dir}")  # fmt: skip
    if _as_served(read_checkpoint_manifest(persist_dir), dtype) != manifest:
        raise ValueError(f"persist_dir {persist_dir!r} holds another model than --model {model_dir!r} (other tensors, "
                         f"shapes or dtypes): {start_there}")  # fmt: skip
    if persisted != served:
        raise ValueError(f"persist_dir {persist_dir!r} holds version {persisted}, but this server loads --model "
                         f"{model_dir!r} (version {served}): it would report version {persisted} while serving "
                         f"version {served}'s weights; {start_there}")  # fmt: skip
