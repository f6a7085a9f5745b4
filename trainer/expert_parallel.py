"""Expert parallelism for MoE models: each rank of the mesh's ``ep`` dimension holds ``E / ep`` of every MoE layer's
experts, and tokens travel to their experts' ranks and back by all-to-all.

Layout (``parallelism.expert_parallel_degree = ep``): the mesh is ``("efsdp", "ep")`` with ``num_ranks = efsdp x ep``
and ``"dp"`` the flattening of both, so every rank trains on its own samples. Non-expert parameters are FSDP-sharded
over all ranks (``dp``), as without EP. A layer's stacked expert weights ``[E, ...]`` are split by expert over ``ep``
(``Shard(0)``: ep rank j holds experts ``[j E/ep, (j+1) E/ep)``) and FSDP-sharded over ``efsdp`` within that, so
gathering a layer for its forward brings in this rank's ``E/ep`` experts, never all ``E``.

One MoE forward on each rank, after its router chose experts for its own tokens (:class:`ExpertParallelExperts`):

1. sort the (token, expert) pairs by expert, so the rows bound for each ep rank are contiguous;
2. exchange the per-expert row counts (all-to-all of ``E`` integers), then the rows (all-to-all, autograd: its
   backward returns each row's gradient to the rank that sent it);
3. run the configured expert kernel (``model.moe_experts``: loop, grouped, gmm_pallas) on the received rows with this
   rank's experts;
4. send the outputs back by the reverse all-to-all and sum them per token, weighted by the router.

An expert's weight gradient is thus the sum over every rank's tokens routed to it, exactly the terms of the one-rank
model. All ranks of an ep group must run the same MoE forwards in the same order (FSDP already requires it of every
forward); a rank with no tokens still takes part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single  # autograd-aware; public one deprecated
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainer.models.moe import AdaptedWeight, ExpertWeight, MoE, sort_by_expert

__all__ = ["ExpertParallelExperts", "ExpertsFn", "apply_expert_parallel"]

ExpertsFn = Callable[..., torch.Tensor]
"""An ``MOE_EXPERTS`` kernel: ``(x [N, D], expert_idx [N, K], expert_weight [N, K], w1, w3, w2) -> [N, D]``."""


class ExpertParallelExperts:
    """An ``MOE_EXPERTS`` kernel over an ep group: the same call as the kernel it wraps, with ``w1/w3/w2`` this rank's
    experts (DTensors sharded by expert over the group, or their local tensors) and ``expert_idx`` global expert ids.

    ``local`` computes this rank's experts on the rows it receives; ``num_experts`` is the layer's global count.
    """

    def __init__(self, local: ExpertsFn, group: dist.ProcessGroup, num_experts: int) -> None:
        self.local, self.group, self.num_experts = local, group, num_experts
        self.size = dist.get_world_size(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.size} expert-parallel ranks")

    def __call__(
        self, x: torch.Tensor, expert_idx: torch.Tensor, expert_weight: torch.Tensor,
        w1: ExpertWeight, w3: ExpertWeight, w2: ExpertWeight,
    ) -> torch.Tensor:  # fmt: skip
        per_rank = self.num_experts // self.size
        w1, w3, w2 = (self._local(w, per_rank) for w in (w1, w3, w2))
        if w1.shape[0] != per_rank:
            raise ValueError(f"this rank holds {w1.shape[0]} experts, expected {per_rank} of {self.num_experts}")
        pairs = sort_by_expert(expert_idx, self.num_experts)
        received = torch.empty_like(pairs.counts)  # [ep x per_rank]: rows from each source rank, per local expert
        dist.all_to_all_single(received, pairs.counts, group=self.group)
        send_splits = pairs.counts.view(self.size, per_rank).sum(1).tolist()
        recv_splits = received.view(self.size, per_rank).sum(1).tolist()
        rows = all_to_all_single(x[pairs.token], recv_splits, send_splits, self.group)
        out = self._compute(rows, received, per_rank, w1, w3, w2)
        back = all_to_all_single(out, send_splits, recv_splits, self.group)
        return pairs.combine(x, back, expert_weight)

    def _local(self, w: ExpertWeight, per_rank: int) -> ExpertWeight:
        """This rank's experts of ``w``: a DTensor's local shard; for an adapted weight, that of its base and this
        rank's slice of its adapters (every rank holds every expert's adapter factors, see ``trainer.parallelize``;
        the slice's gradient reaches only this rank's experts' rows, and FSDP sums the others' over the ranks)."""
        if isinstance(w, AdaptedWeight):
            first = dist.get_rank(self.group) * per_rank
            lora_a, lora_b = (f[first : first + per_rank] for f in (w.lora_A, w.lora_B))
            base = w.weight.to_local() if isinstance(w.weight, DTensor) else w.weight
            return AdaptedWeight(base, lora_a, lora_b, w.scaling)
        return w.to_local() if isinstance(w, DTensor) else w

    def _compute(
        self, rows: torch.Tensor, received: torch.Tensor, per_rank: int,
        w1: ExpertWeight, w3: ExpertWeight, w2: ExpertWeight,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's experts on ``rows`` (source-rank-major, then local expert); every row is one (token, expert)
        pair, so the wrapped kernel sees one expert per row at weight 1."""
        if rows.shape[0] == 0:
            # Nothing routed here. Keep the received rows in the graph, or this rank would skip their all-to-all in
            # backward while its peers wait in it; and the expert weights and adapters, so their (zero) gradients
            # still reach FSDP's reduce-scatter, which every rank of their group must join.
            keep = rows.sum() + sum(t.sum() for w in (w1, w3, w2) for t in _tensors(w))
            return rows.new_zeros(0, w2.shape[1]) + 0.0 * keep
        local_expert = torch.arange(per_rank, device=rows.device).repeat(self.size).repeat_interleave(received)
        return self.local(rows, local_expert[:, None], rows.new_ones(rows.shape[0], 1), w1, w3, w2)


def _tensors(w: ExpertWeight) -> tuple[torch.Tensor, ...]:
    """The tensors an expert weight computes with: the weight, and an adapted one's factors."""
    return (w.weight, w.lora_A, w.lora_B) if isinstance(w, AdaptedWeight) else (w,)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer of ``model`` by expert over ``ep_mesh`` (1-D) in place: ``experts.w1/w3/w2`` become
    DTensors ``Shard(0)``, and the layer's kernel dispatches tokens by all-to-all (:class:`ExpertParallelExperts`).

    Each rank keeps its slice of the weights it holds (the trainer's are still on the meta device: each rank's pieces
    are written after sharding, ``trainer.initial_weights``), so nothing is sent. Call before FSDP, which then shards
    each rank's experts over the rest of the mesh (and expert adapters, which stay whole here, over every rank).
    Raises ``ValueError`` when the model has no MoE layer or the group size does not divide a layer's experts
    (``TrainerConfig.check_model`` says so for a recipe before any rank starts).
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("expert parallelism splits MoE experts, but this model has no MoE layers")
    group = ep_mesh.get_group()
    for moe in layers:
        num_experts = moe.experts.w1.shape[0]
        for name in ("w1", "w3", "w2"):
            weight = getattr(moe.experts, name)
            sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(moe.experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        moe.experts.kernel = ExpertParallelExperts(moe.experts.kernel, group, num_experts)
