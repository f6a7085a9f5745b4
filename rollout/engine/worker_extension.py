"""vLLM worker extension that swaps pushed weights into a running engine through the worker's own reload path.

vLLM mixes this class into its worker (``LLM(..., worker_extension_cls="rollout.engine.worker_extension.
WeightUpdateExtension")``) and runs its methods inside every worker process via ``LLM.collective_rpc``. Weights travel
as safetensors bytes: raw tensors do not pickle across vLLM's worker processes, bytes do on every platform.

Why the worker's ``reload_weights`` and not ``model.load_weights``: the CPU backend repacks linear weights at load time
and leaves the original parameters empty, so ``load_weights`` alone reports success and changes nothing there;
``reload_weights(is_checkpoint_format=True)`` re-runs the loader's post-processing on every platform.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["WeightUpdateExtension", "check_fused_groups", "expected_parameters"]

EXTENSION_CLASS = f"{__name__}.WeightUpdateExtension"


def check_fused_groups(names: Iterable[str], packed_modules: Mapping[str, list[str]]) -> None:
    """Raise ``ValueError`` when an update holds some members of a fused group but not all (e.g. q_proj without v_proj).

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
                    raise ValueError(
                        f"update has {name} but not {', '.join(missing)} of the same fused group; "
                        f"send whole fused groups ({' + '.join(members)})"
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


class WeightUpdateExtension:
    """Methods added to vLLM's worker; ``self`` is the worker (``self.model_runner``, ``self.reload_weights``)."""

    # Provided by the vLLM worker class this is mixed into (declared for the type checker only).
    model_runner: Any
    reload_weights: Callable[..., Any]

    def rl_align_check_update(self, names: list[str]) -> str | None:
        """Why an update with these tensor names must be refused (a partial fused group), or ``None``; loads nothing."""
        model = self.model_runner.get_model()
        try:
            check_fused_groups(names, dict(getattr(model, "packed_modules_mapping", {}) or {}))
        except ValueError as e:
            return str(e)
        return None

    def rl_align_load_weights(self, payload: bytes, full: bool) -> list[str]:
        """Load the tensors in ``payload`` (safetensors bytes, HF-canonical names) into the model; return the engine
        parameter names that were loaded.

        ``full``: the update is a complete checkpoint, so every engine parameter must be loaded. Call
        ``rl_align_check_update`` first. Raises ``RuntimeError`` when the loader skipped parameters the update covers
        (the model may then hold a mix: the caller must stop serving from it).
        """
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(payload)
        model = self.model_runner.get_model()
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        params = {name for name, _ in model.named_parameters()}
        loaded: set[str] = set()
        original = model.load_weights

        def load_and_record(weights):  # reload_weights drops the loaded-name set; this keeps it for the check below
            result = original(weights)
            loaded.update(result or ())
            return result

        model.load_weights = load_and_record  # instance attribute shadows the method for this one call
        try:
            self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        finally:
            del model.load_weights
        _refresh_tied_modules(model, loaded)
        expected = params if full else expected_parameters(tensors, packed, params)
        missing = sorted(expected - loaded)
        if missing:
            raise RuntimeError(f"weight update did not load {len(missing)} parameter(s): {missing[:8]}")
        return sorted(loaded)


def _refresh_tied_modules(model, loaded: set[str]) -> None:
    """Re-run weight post-processing of modules whose weight is tied to a reloaded parameter (a tied ``lm_head``).

    The reload skips a tied ``lm_head`` (its checkpoint has no tensor of its own), so kernels derived from its weight at
    load time (the CPU backend's packed GEMM weight) kept the old values: logits came from the old head
    (``tests/rollout/test_vllm_engine.py`` checks log-probs after a push against HF). A no-op where nothing is
    derived.
    """
    loaded_ptrs = {p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False) if n in loaded}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if method is None or weight is None or f"{prefix}.weight" in loaded:
            continue
        if weight.data_ptr() in loaded_ptrs:
            method.process_weights_after_loading(module)
