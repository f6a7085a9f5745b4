"""Sharding of a model across the trainer ranks: FSDP2 per block and root, optional tensor parallel via DTensor,
optional expert parallel for MoE layers (``trainer.expert_parallel``), and the activation checkpointing of its blocks.

:func:`parallelize_model` is applied once to a freshly built model (policy, reference or critic alike, so they shard
identically). :func:`local_shards` walks what this rank holds, each piece with its place in the full tensor; the weight
push sends exactly these pieces, so no rank ever gathers the whole model.

Gradients are *summed* across data-parallel ranks (the FSDP divide factor is 1): the step normalises its loss by the
global token/sequence count itself, which makes 1 rank and N ranks compute the same update.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainer.config import TrainerConfig
from trainer.critic import Critic
from trainer.expert_parallel import apply_expert_parallel
from trainer.models.moe import Experts
from trainer.models.transformer import Transformer
from trainer.vocab_parallel import VocabParallelEmbedding, VocabParallelHead, shard_vocabulary_rows

ModelT = TypeVar("ModelT", Transformer, Critic)
"""What the trainer shards: a policy / reference :class:`Transformer` or a PPO :class:`Critic` (same blocks)."""

__all__ = [
    "build_mesh", "data_parallel_mesh", "local_shard_place", "local_shards", "parallelize_model", "piece_slices",
    "sync_tensor_parallel_partial_grads", "uses_fsdp",
]  # fmt: skip


def build_mesh(cfg: TrainerConfig, device_type: str) -> DeviceMesh:
    """The device mesh over all ranks: 1-D ``("dp",)``; 2-D ``("dp", "tp")`` when tensor parallel is on; 2-D
    ``("efsdp", "ep")`` when expert parallel is on, with ``"dp"`` (all ranks) its flattening.

    Needs an initialised default process group of ``cfg.num_ranks`` ranks. :func:`data_parallel_mesh` is the part
    over which samples (and the non-expert FSDP shards) are split.
    """
    tp = cfg.parallelism.tensor_parallel_degree
    ep = cfg.parallelism.expert_parallel_degree
    if tp > 1:
        mesh = init_device_mesh(device_type, (cfg.num_ranks // tp, tp), mesh_dim_names=("dp", "tp"))
        # DTensor reduces (the gradient norm) and gathers (the HF export) over both dimensions at once through a
        # flattened mesh when one exists, instead of one collective per dimension in turn.
        mesh._flatten("dp_tp")
        return mesh
    if ep > 1:
        mesh = init_device_mesh(device_type, (cfg.num_ranks // ep, ep), mesh_dim_names=("efsdp", "ep"))
        mesh._flatten("dp")  # private but stable since torch 2.4; torchtitan builds its flattened dims the same way
        return mesh
    return init_device_mesh(device_type, (cfg.num_ranks,), mesh_dim_names=("dp",))


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that hold different samples: the whole mesh when it is 1-D, the ``"dp"`` part of dp x tp, every rank
    of efsdp x ep (the ``"dp"`` flattening :func:`build_mesh` made)."""
    if mesh.ndim == 1:
        return mesh
    if "ep" in (mesh.mesh_dim_names or ()):
        return mesh._flatten("dp")  # the flattening build_mesh created (torch keeps it by name on the root mesh)
    return mesh["dp"]


def _apply_tensor_parallel(model: Transformer | Critic, tp_mesh: DeviceMesh) -> None:
    """Split each block over ``tp_mesh`` by the model's ``tensor_parallel_plan`` (``Transformer`` or ``Critic``), LoRA
    adapters along with their projections; embeddings, norms and the output head stay replicated."""
    from torch.distributed.tensor.parallel import parallelize_module

    from trainer.models.lora import split_adapters_like_their_weights

    plan = model.tensor_parallel_plan(tp_mesh.size())
    for block in model.layers:
        parallelize_module(block, tp_mesh, plan)
        split_adapters_like_their_weights(block, tp_mesh)


def sync_tensor_parallel_partial_grads(model: nn.Module, mesh: DeviceMesh) -> None:
    """Sum over the TP group the gradients of replicated parameters applied to each rank's slice of heads.

    The per-head q/k RMSNorm weights (Qwen3), plain replicas under ``Transformer.tensor_parallel_plan``, are shared by
    all heads but each TP rank only sees its own heads, so their gradient is a partial sum; without this the replicas
    drift apart. DTensor parameters whose gradient DTensor left as a pending partial sum (replicated LoRA factors)
    get it reduced to their own placements. Call after backward, before clipping (``trainer.step`` does).
    """
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return
    group = mesh["tp"].get_group()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            # A replicated LoRA factor beside a split one (lora_A of a column split): its gradient is a partial sum
            # over the TP ranks, which DTensor leaves pending; the optimizer steps on local values.
            p.grad = p.grad.redistribute(placements=p.placements)
        elif name.split(".")[-2] in ("q_norm", "k_norm"):
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            torch.distributed.all_reduce(grad, group=group)


def uses_fsdp(mesh: DeviceMesh, cfg: TrainerConfig) -> bool:
    """Whether :func:`parallelize_model` applies FSDP2: ``parallelism.fsdp`` is on and there is something to shard or
    cast. On a one-rank mesh with float32 parameters and reductions, FSDP would only copy every parameter into and out
    of its flat buffers and scale gradients by 1 (~3% of a CPU step), so the model stays a plain module; DCP
    checkpoints load across both layouts and ``local_shards`` yields the same whole tensors."""
    if not cfg.parallelism.fsdp:
        return False
    float32 = cfg.mixed_precision.param_dtype == "float32" and cfg.mixed_precision.reduce_dtype == "float32"
    return mesh.size() > 1 or not float32


def parallelize_model(model: ModelT, mesh: DeviceMesh, cfg: TrainerConfig) -> ModelT:
    """Apply TP or EP (if configured), activation checkpointing (``cfg.activation_checkpoint``), then FSDP2 in place
    (when :func:`uses_fsdp`): ``fully_shard`` on every block of ``model.layers``, then the root.

    The root unit keeps embeddings, final norm and output head together, so tied embeddings stay tied; with
    ``parallelism.vocab_parallel`` (``trainer.vocab_parallel``) the embedding and output matrices are split by
    vocabulary rows: over the tensor-parallel group when TP is on (FSDP then shards each rank's rows over the
    data-parallel ranks, as it does the blocks' TP weights), else over the data-parallel ranks (when more than one),
    where FSDP leaves them alone. With EP each
    MoE layer's experts are their own FSDP unit over ``efsdp``, inside the block's unit over all ranks. Returns
    ``model`` (now an ``FSDPModule`` when FSDP is on).
    """
    expert_parallel = cfg.parallelism.expert_parallel_degree > 1
    tensor_parallel = cfg.parallelism.tensor_parallel_degree > 1
    compute_dtype = getattr(torch, cfg.mixed_precision.param_dtype)
    if tensor_parallel:
        _apply_tensor_parallel(model, mesh["tp"])
        if cfg.parallelism.vocab_parallel:
            _split_vocabulary(model, mesh["tp"], compute_dtype, shared_tokens=True)
    if expert_parallel:
        apply_expert_parallel(model, mesh["ep"])
    # Inside each block's FSDP unit, as torchtitan orders them: backward's recompute runs on the gathered parameters.
    model.checkpoint_blocks(cfg.activation_checkpoint.checkpointed_blocks(len(model.layers)))
    if not uses_fsdp(mesh, cfg):
        return model
    dp_mesh = data_parallel_mesh(mesh)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=getattr(torch, cfg.mixed_precision.reduce_dtype))
    reshard = cfg.parallelism.reshard_after_forward
    blocks = list(model.layers)
    for block in blocks:
        experts = [m for m in block.modules() if isinstance(m, Experts)] if expert_parallel else []
        for unit in experts:  # its own unit over efsdp: the block's unit (over all ranks) cannot hold ep shards
            for adapter in (unit.gate_up_lora, unit.down_lora):
                # Expert adapters are not split by expert (PEFT's lora_B keeps experts as its minor index, so one
                # rank's experts are no contiguous slice): every rank uses its experts' slice of the whole factors
                # and FSDP sums their gradients over all ranks. A unit of their own, outside the experts' efsdp
                # unit; kept gathered after forward, whose outputs are views of the gathered factors.
                if adapter is not None:
                    fully_shard(adapter, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
            fully_shard(unit, mesh=mesh["efsdp"], mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    split = cfg.parallelism.vocab_parallel and not tensor_parallel and dp_mesh.size() > 1
    ignored = _split_vocabulary(model, dp_mesh, compute_dtype) if split else None
    # The root's parameters are needed right after the last block's forward: keep them gathered.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (gloo has no PREMUL_SUM; NCCL transfers them zero-copy).
            module.set_force_sum_reduction_for_comms(True)
    return model


def _split_vocabulary(
    model: ModelT, mesh: DeviceMesh, compute_dtype: torch.dtype, shared_tokens: bool = False
) -> set[nn.Parameter]:
    """Split the embedding and output matrices by vocabulary rows over the 1-D ``mesh`` (``trainer.vocab_parallel``)
    and install the lookup and head that work on the split; returns those parameters (over data-parallel ranks FSDP
    must leave them alone). ``shared_tokens``: ``mesh`` is a tensor-parallel group, whose ranks hold the same tokens."""
    body = model.body if isinstance(model, Critic) else model
    weight = shard_vocabulary_rows(body.tok_embeddings.weight, mesh)
    first = local_shard_place(weight)[1][0]
    # The same lookup contract and `weight` name as the nn.Embedding it replaces.
    body.tok_embeddings = VocabParallelEmbedding(weight, first, compute_dtype, shared_tokens)  # type: ignore[assignment]
    split = {weight}
    if body.output is not None:  # untied: the same [V, D] shape, so the same rows on this rank
        body.output.weight = shard_vocabulary_rows(body.output.weight, mesh)
        split.add(body.output.weight)
    body.set_output_head(VocabParallelHead(first, shared_tokens))
    return split


def local_shard_place(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of this rank's piece of ``param``.

    The one place that calls torch's private ``compute_local_shape_and_global_offset`` (exact for Shard and
    _StridedShard placements, and for uneven shards); plain tensors are whole, at offset 0.
    """
    if not isinstance(param, DTensor):
        return tuple(param.shape), (0,) * param.ndim
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offsets)


def piece_slices(offsets: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    """The index of a piece of ``shape`` at global ``offsets`` inside its whole tensor (``whole[index]`` is it)."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))


def local_shards(
    model: nn.Module, mesh: DeviceMesh | None = None
) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """Yield ``(name, local_tensor, global_shape, global_offsets)`` for every parameter piece this rank holds.

    Names are the model's own (FSDP2 keeps them); tied parameters appear once. Local tensors are detached views of
    the stored (full-precision) shards: copy before mutating. Every rank of a tensor-parallel group holds the same
    pieces of the parameters TP does not split (the norms; the embedding and head unless the vocabulary is split;
    replicated LoRA factors). Given the run's ``mesh``, those come from the group's first rank only, so the ranks
    together yield each piece of the model exactly once, as a push must send it (a receiver refuses a piece pushed
    twice); without it every rank yields all it holds.
    """
    first_of_group = mesh is None or "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].get_local_rank() == 0
    for name, p in model.named_parameters():
        if not first_of_group and not _split_over_tensor_parallel(p):
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        shape, offsets = local_shard_place(p)
        assert tuple(local.shape) == shape, f"{name}: local piece {tuple(local.shape)} vs computed {shape}"
        yield name, local.detach(), tuple(p.shape), offsets


def _split_over_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor split (``Shard``) along a mesh dimension named ``"tp"``."""
    if not isinstance(param, DTensor):
        return False
    dims = param.device_mesh.mesh_dim_names or ()
    return any(dim == "tp" and placement.is_shard() for dim, placement in zip(dims, param.placements, strict=True))
