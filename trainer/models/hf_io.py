"""HF checkpoint IO and the HF view of our parameters (for export and for pushing FSDP shards to serving engines).

- :func:`hf_shards` maps one of our parameters, whole or a shard (local piece + its place in the global tensor), to
  HF-named pieces with their places; no gather needed. A dim-0 shard of stacked experts becomes whole per-expert HF
  tensors; any other tensor keeps its shape and offsets under its HF name.
- :func:`hf_manifest` lists every HF tensor (name, shape, dtype) a full model has, in checkpoint order.
- :func:`save_hf_checkpoint` / :func:`load_hf_checkpoint` write / read a local HF directory (``model.safetensors`` or
  shards + ``model.safetensors.index.json``, plus ``config.json``) in the stock per-expert layout transformers and vLLM
  load; :func:`write_hf_checkpoint` writes one from a stream of whole parameters (e.g. read from a DCP checkpoint),
  and :func:`read_hf_parameters` reads one as such a stream, a parameter at a time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from trainer.devices import host_copies
from trainer.models.config import ModelConfig
from trainer.models.hf_config import hf_config_dict
from trainer.models.hf_names import NameMap, name_map
from trainer.models.lora import is_adapter, merged_parameters, peft_name
from trainer.models.transformer import build_model
from weight_sync.safetensors_stream import INDEX_FILE, SINGLE_FILE, TensorEntry, write_streamed
from weight_sync.spec import dtype_name

__all__ = [
    "canonical_name",
    "hf_manifest",
    "HFSource",
    "hf_shards",
    "hf_sources",
    "hf_state_dict",
    "load_hf_checkpoint",
    "read_hf_parameters",
    "save_hf_checkpoint",
    "write_hf_checkpoint",
]

_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")

Shape = tuple[int, ...]


def canonical_name(name: str) -> str:
    """Our parameter name without wrapper components (torch.compile, activation checkpointing, FSDP1)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def hf_shards(
    model_cfg: ModelConfig, our_name: str, local: torch.Tensor, global_shape: Shape, global_offsets: Shape
) -> Iterator[tuple[str, torch.Tensor, Shape, Shape]]:
    """Yield ``(hf_name, piece, hf_global_shape, hf_global_offsets)`` for one of our parameters or a shard of it.

    ``local`` is the piece this rank holds, at ``global_offsets`` inside a parameter of ``global_shape`` (pass the
    full tensor with zero offsets for an unsharded one). Pieces are views of ``local`` (no copy). A LoRA adapter
    parameter maps to its PEFT name (``trainer.models.lora.peft_name``). Raises ``ValueError`` for a name the family's
    table does not know.
    """
    global_shape, global_offsets = tuple(global_shape), tuple(global_offsets)
    if len(global_shape) != local.ndim or len(global_offsets) != local.ndim:
        raise ValueError(
            f"{our_name}: local {tuple(local.shape)}, global {global_shape}, offsets {global_offsets} disagree in rank"
        )
    if is_adapter(our_name):  # a LoRA adapter: its PEFT name, same layout
        yield peft_name(model_cfg, our_name), local, global_shape, global_offsets
        return
    try:
        hf_name, stacked = name_map(model_cfg.family).to_hf(canonical_name(our_name))
    except KeyError:
        raise ValueError(f"{our_name!r} is not a parameter of a {model_cfg.family} model") from None
    if not stacked:
        yield hf_name, local, global_shape, global_offsets
        return
    first = global_offsets[0]
    for i in range(local.shape[0]):
        yield hf_name.format(first + i), local[i], global_shape[1:], global_offsets[1:]


def hf_manifest(model_cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> list[tuple[str, Shape, torch.dtype]]:
    """Every HF tensor of a full ``model_cfg`` model as ``(hf_name, shape, dtype)``, in parameter order.

    ``dtype`` is the dtype the tensors are sent or saved in. With tied embeddings ``lm_head.weight`` is absent; LoRA
    adapters are not HF model tensors (``weight_sync.peft.adapter_manifest`` lists them).
    """
    meta = build_model(model_cfg, device="meta")
    out = []
    for name, p in meta.named_parameters():
        if is_adapter(name):
            continue
        for hf_name, piece, _, _ in hf_shards(model_cfg, name, p, tuple(p.shape), (0,) * p.ndim):
            out.append((hf_name, tuple(piece.shape), dtype))
    return out


def _model_config(model: nn.Module) -> ModelConfig:
    """The :class:`ModelConfig` of a :class:`Transformer`, also through the wrappers that keep its ``cfg`` attribute
    (FSDP2 ``fully_shard``, ``torch.compile``)."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"expected a Transformer (or a sharded / compiled one) with a ModelConfig `cfg`; got {type(model).__name__}"
        )
    return cfg


def hf_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model, cast to ``dtype`` if given.

    ``model``: a :class:`Transformer`, possibly FSDP2-sharded, tensor-parallel or compiled (parameter names are
    canonicalised). DTensor parameters are gathered with ``full_tensor()`` (a collective: every rank must iterate).
    With LoRA adapters the base weights come with the adapters' updates merged in (a plain model of the same family).
    """
    return _hf_pieces(_model_config(model), merged_parameters(model), dtype)


def _hf_pieces(
    cfg: ModelConfig, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of each of our whole parameters ``named``, cast to ``dtype`` if given."""
    for name, full in named:
        for hf_name, piece, _, _ in hf_shards(cfg, name, full, tuple(full.shape), (0,) * full.ndim):
            yield hf_name, piece if dtype is None else piece.to(dtype)


def save_hf_checkpoint(
    model: nn.Module, path: str, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None
) -> list[str]:
    """Write ``model`` as an HF checkpoint directory (:func:`write_hf_checkpoint`).

    ``model`` as in :func:`hf_state_dict`. With sharded (DTensor) parameters every rank must call this; only rank 0
    writes, and no rank holds more than one whole tensor of the model on top of its shards. Returns the written file
    names (``[]`` on the other ranks). Raises ``TypeError`` if ``model`` is not a (wrapped) :class:`Transformer`.
    """
    cfg = _model_config(model)
    tensors = merged_parameters(model)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        for _ in tensors:  # the gathers are collectives: every rank takes part, rank 0 writes
            pass
        return []
    params = [(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters() if not is_adapter(name)]
    try:
        return write_hf_checkpoint(cfg, path, params, tensors, max_shard_bytes, dtype)
    except BaseException:
        for _ in tensors:  # keep pace with the other ranks' gathers, so they finish and see the failure in the logs
            pass
        raise


def write_hf_checkpoint(
    cfg: ModelConfig,
    path: str | Path,
    params: Sequence[TensorEntry],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write a ``cfg`` model as an HF checkpoint directory at ``path``: safetensors (sharded above
    ``max_shard_bytes``) + ``config.json``; return the file names written.

    ``params``: ``(our name, global shape, dtype)`` of every non-adapter parameter; ``tensors`` yields ``(our name,
    whole tensor)`` for each, in that order, on any device. Each is written as it comes and not kept (the headers
    are planned from ``params``: :mod:`weight_sync.safetensors_stream`). ``dtype`` casts the saved tensors.
    """
    plan: list[TensorEntry] = []
    for name, shape, param_dtype in params:
        whole = torch.empty(shape, device="meta")
        for hf_name, piece, _, _ in hf_shards(cfg, name, whole, tuple(shape), (0,) * len(shape)):
            plan.append((hf_name, tuple(piece.shape), dtype or param_dtype))
    pieces = _on_host(_hf_pieces(cfg, tensors, dtype))
    files = write_streamed(path, plan, pieces, max_shard_bytes, metadata={"format": "pt"})
    saved_dtype = plan[0][2] if plan else torch.float32
    config = hf_config_dict(cfg, dtype=dtype_name(saved_dtype))
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [*files, "config.json"]


def _on_host(
    named: Iterable[tuple[str, torch.Tensor]], batch_bytes: int = 256 * 2**20
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` readable on the host: on ``xla`` fetched in batches of about ``batch_bytes`` (one graph and one bulk
    transfer a batch, :func:`host_copies`), elsewhere one by one as they come."""
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        if tensor.device.type != "xla":
            yield name, tensor
            continue
        batch.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= batch_bytes:
            yield from zip([n for n, _ in batch], host_copies([t for _, t in batch]), strict=True)
            batch, size = [], 0
    if batch:
        yield from zip([n for n, _ in batch], host_copies([t for _, t in batch]), strict=True)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json found")


HFSource = tuple[int | None, str, Path]
"""Where one HF tensor of a parameter lies: ``(expert index or None, HF name, file)``."""


def hf_sources(cfg: ModelConfig, path: Path, params: dict[str, Shape]) -> dict[str, list[HFSource]]:
    """The HF tensors of each of ``params`` (our non-adapter names and shapes) in the checkpoint at ``path``, in
    expert order, from the files' headers alone (``lm_head.weight`` is skipped when ``params`` has no output head: tied
    embeddings, or a critic's body). Raises ``ValueError`` for a tensor the model does not have, a
    parameter the checkpoint does not cover (each expert of stacked ones) and a shape that differs."""
    names = name_map(cfg.family)
    headless = cfg.tie_embeddings or "output.weight" not in params  # tied, or a critic's body: lm_head is not read
    sources: dict[str, list[HFSource]] = {n: [] for n in params}
    unknown = []
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                try:
                    target = names.to_ours(hf_name)
                except KeyError:
                    unknown.append(hf_name)
                    continue
                if target is None or (target[0] == "output.weight" and headless):
                    continue
                ours, index = target
                shape = params.get(ours)
                if shape is None or (index is not None and not 0 <= index < shape[0]):
                    unknown.append(hf_name)
                    continue
                expected = shape if index is None else shape[1:]
                saved = tuple(f.get_slice(hf_name).get_shape())
                if saved != tuple(expected):
                    raise ValueError(f"{file.name}: {hf_name} has shape {saved}, model expects {tuple(expected)}")
                sources[ours].append((index, hf_name, file))
    if unknown:
        raise ValueError(
            f"{path}: tensors not in the {cfg.family} model: {sorted(unknown)[:10]} ({len(unknown)} total)"
        )
    missing = [n for n, got in sources.items() if {i for i, _, _ in got} != _expected_indices(names, n, params[n])]
    if missing:
        raise ValueError(f"{path}: checkpoint does not cover parameters {missing[:10]} ({len(missing)} total)")
    return {n: sorted(got, key=lambda s: -1 if s[0] is None else s[0]) for n, got in sources.items()}


def _expected_indices(names: NameMap, our_name: str, shape: Shape) -> set[int | None]:
    return set(range(shape[0])) if names.to_hf(our_name)[1] else {None}


def read_hf_parameters(
    cfg: ModelConfig, path: str | Path, params: Sequence[tuple[str, Shape]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(our name, whole tensor in the dtype saved)`` of each of ``params`` (our non-adapter parameter names and
    shapes, e.g. a meta model's), in that order, read from the local HF checkpoint directory at ``path`` one parameter
    at a time (stacked experts from their per-expert tensors): a model of any size converts with one parameter in
    memory. The whole checkpoint is checked when this is called, before anything is read (:func:`load_hf_checkpoint`'s
    errors)."""
    sources = hf_sources(cfg, Path(path), dict(params))  # now, not at the first tensor
    return _read_parameters([name for name, _ in params], sources)


def _read_parameters(names: list[str], sources: dict[str, list[HFSource]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        pieces = []
        for _, hf_name, file in sources[name]:
            with safe_open(str(file), framework="pt") as f:
                pieces.append(f.get_tensor(hf_name))
        yield name, pieces[0] if sources[name][0][0] is None else torch.stack(pieces)


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | Path) -> set[str]:
    """Copy the weights of a local HF checkpoint directory into ``model`` (a :class:`Transformer`), casting dtypes:
    whole parameters, or the pieces this rank holds of sharded ones (FSDP2, tensor, expert or vocabulary parallel;
    after ``to_empty``), each read as a slice of its tensor in the safetensors files, so only those bytes are read.

    Every parameter must be covered (each expert of stacked ones) and every checkpoint tensor must map to one, except
    names the table drops and ``lm_head.weight`` when the model has no output head of its own (tied embeddings, a
    critic's body) (LoRA adapters are not loaded). Returns the
    set of HF names loaded. Raises ``ValueError`` on unknown, missing or mis-shaped tensors, before anything is copied.
    """
    from torch.distributed.tensor import DTensor

    from trainer.parallelize import local_shard_place, piece_slices

    cfg = _model_config(model)
    # LoRA adapters are not in an HF checkpoint: they keep their values (fresh: B = 0, the model is the base).
    params = {canonical_name(n): p for n, p in model.named_parameters() if not is_adapter(n)}
    sources = hf_sources(cfg, Path(path), {n: tuple(p.shape) for n, p in params.items()})
    files = {hf_name: file for pieces in sources.values() for _, hf_name, file in pieces}
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for name, p in params.items():
            local = p.to_local() if isinstance(p, DTensor) else p
            _, offsets = local_shard_place(p)
            for hf_name, piece, _, hf_offsets in hf_shards(cfg, name, local, tuple(p.shape), offsets):
                if piece.numel() == 0:  # an uneven split can leave a rank no rows of a tensor
                    continue
                file = files[hf_name]
                if file not in opened:
                    opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                piece.copy_(opened[file].get_slice(hf_name)[piece_slices(hf_offsets, tuple(piece.shape))])
    return set(files)
