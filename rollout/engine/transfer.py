"""The ``rl_align`` weight-transfer backend of vLLM: the one way pushed weights enter vLLM, in process or served.

vLLM builds one :class:`RLAlignWeightTransferEngine` inside every worker whose engine was started with
``weight_transfer_config={"backend": "rl_align"}`` (``--weight-transfer-config '{"backend": "rl_align"}'`` on a
server); :mod:`rollout.engine.vllm_plugin` registers the name. The caller drives vLLM's own update API:
``start_weight_update`` -> ``update_weights(update_info)`` (one chunk per version) -> ``finish_weight_update``.

An update info names a complete, verified version (HF-canonical tensor names), as tensors (an in-process engine with
one worker: the dict reaches the worker by reference) or as the path of a safetensors file every worker can read (a
served engine, or tensor parallel: update infos cross a process boundary as msgpack). The whole reload runs inside
``update_weights``, in this order, so that a refusal comes before anything changed:

1. a partial fused group (``q_proj`` without ``k_proj``), or some of a mixture-of-experts layer's expert weights but
   not all, is refused with an error whose message starts with :data:`REFUSED` (the error type is lost over vLLM's
   process boundary; the prefix is not);
2. vLLM's layer-wise reload (``initialize_layerwise_reload`` -> ``model.load_weights`` ->
   ``finalize_layerwise_reload``), which re-runs each layer's post-load processing (the CPU backend's GEMM repack
   included);
3. modules whose weight is tied to a reloaded parameter (a tied ``lm_head``) are processed again: vLLM's reload
   documents that tied parameters only reflect one parent's processing, so the CPU head kept its old packed weight;
   and on CPU every reloaded MoE layer's experts are prepacked again (:func:`_repack_cpu_experts`);
4. every parameter the update covers (every parameter for a full update) must have been loaded, else ``RuntimeError``:
   the model may then hold a mix and the caller must stop serving from it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, get_args

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from common.config import DType
from rollout.engine.platform import is_cpu_platform
from rollout.engine.vllm_plugin import BACKEND
from weight_sync.peft import expert_tensor
from weight_sync.spec import TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "REFUSED",
    "RLAlignInitInfo",
    "RLAlignRefused",
    "RLAlignUpdateInfo",
    "RLAlignWeightTransferEngine",
    "check_fused_groups",
    "check_whole_expert_layers",
    "default_stage_dir",
    "engine_manifest",
    "expected_parameters",
    "write_update_file",
]

log = logging.getLogger(__name__)

REFUSED = "rl_align refused:"
"""Prefix of the message of an update refused before the model changed (the engine keeps serving its version)."""

# Float8 tensors are a quantized checkpoint's, which vLLM keeps in their own dtype.
_CAST_AT_LOAD = frozenset({*get_args(DType), "float64"})


def engine_manifest(checkpoint: Iterable[TensorSpec], dtype: str) -> list[TensorSpec]:
    """The tensors an engine computing in ``dtype`` holds for a checkpoint whose manifest is ``checkpoint``: the same
    names and shapes, every float32/bfloat16/float16/float64 tensor in ``dtype`` (vLLM casts them as it loads: a
    bfloat16 file in a float32 engine is float32 weights), any other tensor in its file's dtype. What an engine's
    receiver declares, in process or served: senders send each tensor in the declared dtype."""
    return [replace(s, dtype=dtype) if s.dtype in _CAST_AT_LOAD else s for s in checkpoint]


class RLAlignRefused(ValueError):
    """An update refused before anything was loaded; its message starts with :data:`REFUSED`."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{REFUSED} {reason}")


@dataclass
class RLAlignInitInfo(WeightTransferInitInfo):
    """No rendezvous: pushes arrive through the weight-sync receiver, so there is nothing to hand the engine."""


@dataclass
class RLAlignUpdateInfo(WeightTransferUpdateInfo):
    """One complete, verified version: exactly one of ``tensors`` (same process only) or ``path``."""

    policy_version: int
    full: bool
    """The update is a complete checkpoint: every engine parameter must be loaded."""
    path: str | None = None
    """A safetensors file holding the update (readable by every worker)."""
    tensors: Mapping[str, torch.Tensor] | None = None
    """The update's tensors, by reference (an in-process engine with one worker)."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.tensors is None):
            raise ValueError("rl_align update info needs exactly one of `path` or `tensors`")
        if isinstance(self.policy_version, bool) or not isinstance(self.policy_version, int) or self.policy_version < 0:
            raise ValueError(f"rl_align update info: policy_version {self.policy_version!r} is not an integer >= 0")


def default_stage_dir() -> str:
    """Where update files go by default: ``/dev/shm`` (memory, shared by every process of the host) where it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


_STAGED = re.compile(r"^rl-align-(?P<pid>\d+)-ns(?P<ns>\d+)-v\d+-.+\.(safetensors|tmp)$")


def _pid_namespace() -> int:
    """This process's PID namespace (its inode), 0 where it cannot be read: pids are compared only within one (two
    containers sharing ``/dev/shm`` with ``--ipc=host`` each see their own pids)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def sweep_stage_dir(directory: str) -> list[str]:
    """Remove the update files in ``directory`` of processes of this host that are gone (a server or engine killed
    mid-update, SIGKILL or the OOM killer, leaves one the size of the update, in memory under ``/dev/shm``), with a
    warning; return their names. A file of a live process (another server sharing the directory), or of a process in
    another PID namespace (another container), is left alone."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    namespace = _pid_namespace()
    for name in names:
        match = _STAGED.match(name)
        if match is None or not namespace or int(match["ns"]) != namespace or _alive(int(match["pid"])):
            continue  # not ours, alive, or of another PID namespace (whose pids cannot be checked from here)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    if removed:
        log.warning("removed %d update file(s) of weight-sync servers or engines that died mid-update from %s: %s",
                    len(removed), directory, ", ".join(removed[:5]))  # fmt: skip
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def write_update_file(tensors: Mapping[str, torch.Tensor], directory: str, policy_version: int) -> str:
    """Write one update as a safetensors file in ``directory`` (created if missing) for the file form of
    :class:`RLAlignUpdateInfo`; return its path. Atomic: a reader never sees a partial file. The caller unlinks it."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    prefix = f"rl-align-{os.getpid()}-ns{_pid_namespace()}-v{policy_version}-"  # what sweep_stage_dir reads
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, tmp,
                  metadata={"policy_version": str(policy_version)})
        path = tmp.removesuffix(".tmp") + ".safetensors"
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def check_fused_groups(names: Iterable[str], packed_modules: Mapping[str, list[str]]) -> None:
    """Raise :class:`RLAlignRefused` when an update holds some members of a fused group but not all.

    A partial fused group loads into a slice of the fused parameter and corrupts the model, so it is refused before
    anything is loaded.
    """
    present = set(names)
    for name in sorted(present):
        for members in packed_modules.values():
            for member in members:
                if f".{member}." not in name:
                    continue
                missing = [name.replace(f".{member}.", f".{m}.") for m in members if m != member]
                missing = [m for m in missing if m not in present]
                if missing:
                    raise RLAlignRefused(
                        f"update has {name} but not {', '.join(missing)} of the same fused group; "
                        f"send whole fused groups ({' + '.join(members)})"
                    )


def check_whole_expert_layers(names: Iterable[str], experts_per_layer: Mapping[str, int]) -> None:
    """Raise :class:`RLAlignRefused` when an update holds some of an MoE layer's expert weights but not all (gate,
    up and down of each of its experts; HF checkpoint names, e.g. ``model.layers.0.mlp.experts.7.up_proj.weight``).
    ``experts_per_layer``: the expert count of each module holding a layer's stacked weights, that module being the
    checkpoint's experts module or inside it.

    vLLM keeps a layer's experts in two stacked parameters, and its layer-wise reload rebuilds a layer from the
    tensors sent alone: the rest of the layer would be uninitialised memory. Layers the model does not list are left
    to the loader.
    """
    sent: dict[str, int] = {}
    for name in names:
        if (where := expert_tensor(name)) is not None:
            sent[where.experts] = sent.get(where.experts, 0) + 1
    for module, count in sorted(sent.items()):
        # vLLM may hold the stacked weights in a submodule of the checkpoint's experts module (``.routed_experts``)
        total = next((3 * n for layer, n in experts_per_layer.items() if f"{layer}.".startswith(f"{module}.")), None)
        if total is not None and count != total:
            raise RLAlignRefused(
                f"update has {count} of the {total} expert weights of {module}; send every expert's gate_proj, "
                "up_proj and down_proj of a layer it touches"
            )


def expected_parameters(names: Iterable[str], packed_modules: Mapping[str, list[str]], params: set[str]) -> set[str]:
    """Engine parameter names that checkpoint ``names`` must load into (names with no engine parameter are skipped)."""
    out = set()
    for name in names:
        for packed, members in packed_modules.items():
            for member in members:
                name = name.replace(f".{member}.", f".{packed}.")
        if name in params:
            out.add(name)
    return out


class RLAlignWeightTransferEngine(WeightTransferEngine[RLAlignInitInfo, RLAlignUpdateInfo]):
    """vLLM worker side of the ``rl_align`` backend (see the module docstring for the order of one update)."""

    init_info_cls = RLAlignInitInfo
    update_info_cls = RLAlignUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        additional: Any = self.vllm_config.additional_config or {}
        driver = (additional.get(BACKEND) or {}).get("driver", "server")
        plugins = [p.strip() for p in os.environ.get("VLLM_PLUGINS", "").split(",")]
        if driver != "inproc" and BACKEND not in plugins:  # else no receiver opens and the server looks healthy
            raise RuntimeError("--weight-transfer-config selects backend 'rl_align' but the rl_align endpoint plugin "
                               "is not enabled: set VLLM_PLUGINS=rl_align (see deploy/OPERATIONS.md)")

    def init_transfer_engine(self, init_info: RLAlignInitInfo) -> None:
        """Nothing to set up: calling it is allowed and does nothing."""

    def start_weight_update(self) -> None:
        """Nothing yet: the reload starts in ``receive_weights``, after the update was checked."""

    def finish_weight_update(self) -> None:
        """Nothing left: ``receive_weights`` finished the reload."""

    def shutdown(self) -> None:
        """No transfer resources are held between updates."""

    def receive_weights(self, update_info: RLAlignUpdateInfo) -> None:
        """Check, then load one whole version into the model (module docstring, steps 1-4)."""
        import torch
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model: Any = self.model
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        with _weights_of(update_info) as (names, weights):
            check_fused_groups(names, packed)
            check_whole_expert_layers(names, _experts_per_layer(model))
            params = {name for name, _ in model.named_parameters()}
            with torch.no_grad():
                initialize_layerwise_reload(model)
                with disable_mtp_completeness_check():
                    loaded = set(model.load_weights(weights) or ())
                with _without_unloaded_layer_warnings():
                    finalize_layerwise_reload(model, self.model_config)
                _refresh_tied_modules(model, loaded)
                if is_cpu_platform():
                    _repack_cpu_experts(model, loaded)
        expected = params if update_info.full else expected_parameters(names, packed, params)
        missing = sorted(expected - loaded)
        if missing:
            raise RuntimeError(f"weight update to version {update_info.policy_version} did not load "
                               f"{len(missing)} parameter(s): {missing[:8]}")


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_UNLOADED_LAYER = "Failed to load weights"


@contextlib.contextmanager
def _without_unloaded_layer_warnings() -> Iterator[None]:
    """vLLM's reload warns "<Layer>: Failed to load weights" for every layer an update did not cover: each layer of a
    partial update's model but the few it changes, and on every full update the tied head and the rotary cache, which
    no checkpoint holds. Step 4 is the check of what an update had to load (it names the parameters), so these go."""

    def keep(record: logging.LogRecord) -> bool:
        return _UNLOADED_LAYER not in record.getMessage()

    logger = logging.getLogger(_LAYERWISE_LOGGER)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class _weights_of:
    """``with _weights_of(info) as (names, iterator)``: the update's tensor names and a lazy (name, tensor) iterator;
    a file is read through safetensors' mmap, so each tensor-parallel worker's loader slices out only its shard."""

    def __init__(self, info: RLAlignUpdateInfo) -> None:
        self._info = info
        self._file: Any = None

    def __enter__(self) -> tuple[list[str], Iterator[tuple[str, torch.Tensor]]]:
        if self._info.tensors is not None:
            tensors = self._info.tensors
            return sorted(tensors), iter(tensors.items())
        from safetensors import safe_open

        try:
            self._file = safe_open(self._info.path, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error type for a bad header or a missing file
            raise RLAlignRefused(f"cannot read the update file {self._info.path}: {e}") from e
        names = sorted(self._file.keys())
        return names, ((name, self._file.get_tensor(name)) for name in names)

    def __exit__(self, *exc: object) -> None:
        self._file = None


def _experts_per_layer(model: torch.nn.Module) -> dict[str, int]:
    """Every MoE layer of a vLLM model (a module holding stacked ``w13_weight``) and its global expert count."""
    return {
        prefix: int(module.global_num_experts) for prefix, module in model.named_modules()
        if hasattr(module, "w13_weight") and hasattr(module, "global_num_experts")
    }  # fmt: skip


def _repack_cpu_experts(model: torch.nn.Module, loaded: set[str]) -> None:
    """Prepack the reloaded experts of every MoE layer again for vLLM's CPU MoE kernel.

    vLLM's unquantized MoE method runs the expert kernel's own post-load step (on CPU: prepacking both stacked weights
    into its grouped-GEMM layout) on the first load only; on a weight update it copies the new weights into the
    packed parameters in their plain layout, so the kernel then read scrambled experts (a reloaded MoE model's
    log-probs were off by ~0.05-0.15 nats; ``tests/rollout/test_vllm_moe_lora.py``). The plain weights are what the
    parameters hold after the reload, so the kernel's step applies to them as on the first load.
    """
    for prefix, module in model.named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None and f"{prefix}.w13_weight" in loaded:
            experts.process_weights_after_loading(module)


def _refresh_tied_modules(model: torch.nn.Module, loaded: set[str]) -> None:
    """Re-run weight post-processing of modules whose weight is tied to a reloaded parameter (a tied ``lm_head``).

    The reload skips a tied ``lm_head`` (its checkpoint has no tensor of its own), so kernels derived from its weight at
    load time (the CPU backend's packed GEMM weight) kept the old values: logits came from the old head
    (``tests/rollout/test_vllm_engine.py`` checks log-probs after a push against HF). A no-op where nothing is
    derived.
    """
    # With LoRA enabled vLLM wraps layers (``embed_tokens.base_layer.weight``) while load_weights reports the plain
    # names: compare without the wrapper part, or a tied head under LoRA would keep its old weight.
    def plain(name: str) -> str:
        return name.replace(".base_layer.", ".")

    loaded_ptrs = {p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False) if plain(n) in loaded}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if method is None or weight is None or plain(f"{prefix}.weight") in loaded:
            continue
        if weight.data_ptr() in loaded_ptrs:
            method.process_weights_after_loading(module)
