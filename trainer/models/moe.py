"""Qwen3-MoE sparse feed-forward: softmax router, top-k experts (optionally renormalised), stacked SwiGLU experts.

Expert weights are stacked ``[E, ...]`` parameters (HF stores one tensor per expert; ``trainer.models.hf_io`` maps
between the two). How tokens reach their experts is a registered function picked by ``ModelConfig.moe_experts``:

- ``loop``: one gather + three matmuls per expert that received tokens (simple reference);
- ``grouped``: all (token, expert) pairs sorted by expert, one grouped matmul per projection
  (``torch.nn.functional.grouped_mm`` where torch supports it: CPU, and CUDA in bfloat16, with 16-byte aligned rows;
  otherwise one batched matmul over experts padded to the largest group; same math);
- ``gmm_pallas`` (:func:`trainer.kernels.gmm.gmm_experts`): the same sort (:func:`sort_by_expert`), then the Pallas
  grouped-matmul kernel for each projection.

A kernel's ``w1/w3/w2`` are stacked tensors, or with LoRA on the experts (``trainer.models.lora``) an
:class:`AdaptedWeight` each: ``loop`` folds expert ``e``'s update into its weight, ``grouped`` adds the low-rank path
``scaling * (x A_e^T) B_e^T`` to each group's rows (two more grouped matmuls of width ``rank``); ``gmm_pallas`` takes
plain weights only (the model config refuses the combination).

Router load-balancing loss (Switch Transformer form, as HF's ``load_balancing_loss_func`` computes it for
Qwen3-MoE): ``E * sum_e f_e * p_e`` with f_e = top-k assignments to expert e per token and p_e = mean router
probability of e, over the tokens that count; it equals ``top_k`` when routing is perfectly balanced and is
differentiable through p_e only. Each forward records its routing (:attr:`MoE.routing`, held until the next forward),
so the loss can be taken afterwards over any token subset: :attr:`MoE.aux_loss` over all tokens of the call,
:func:`router_aux_loss` as the mean over a model's MoE layers with padding masked out. A mean of per-layer terms
balances every layer on its own (as Megatron and torchtitan do); HF instead pools the counts of all layers before
taking the product, which agrees with this for one layer only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.config import ModelConfig
from trainer.models.registry import MOE_EXPERTS

if TYPE_CHECKING:
    from trainer.models.lora import ExpertLoRA

__all__ = [
    "AdaptedWeight",
    "ExpertSort",
    "Experts",
    "MoE",
    "Routing",
    "grouped_experts",
    "load_balancing_loss",
    "loop_experts",
    "route_tokens",
    "router_aux_loss",
    "sort_by_expert",
]


def route_tokens(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits ``[N, E]`` -> (expert_idx ``[N, K]``, expert_weight ``[N, K]`` in logits' dtype, probs fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_idx, top_w.to(logits.dtype), probs


def load_balancing_loss(
    probs: torch.Tensor, top_idx: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Load-balancing loss of one layer (see the module docstring): 0-dim float32, differentiable through ``probs``.

    ``probs [N, E]`` router softmax (fp32), ``top_idx [N, K]`` chosen experts, ``token_mask`` (N elements, any shape;
    nonzero = the token counts) leaves padding out; None counts every token. No counted token gives exactly 0.
    """
    num_experts, top_k = probs.shape[1], top_idx.shape[1]
    if token_mask is None:
        weight = probs.new_ones(probs.shape[0])
    else:
        if token_mask.numel() != probs.shape[0]:
            raise ValueError(f"token_mask has {token_mask.numel()} elements for {probs.shape[0]} routed tokens")
        weight = (token_mask.reshape(-1) != 0).to(probs.dtype)
    num_counted = weight.sum().clamp_min(1.0)
    counts = probs.new_zeros(num_experts).index_add_(0, top_idx.reshape(-1), weight.repeat_interleave(top_k))
    mean_probs = (probs * weight[:, None]).sum(dim=0) / num_counted
    return num_experts * torch.sum(counts / num_counted * mean_probs)


def router_aux_loss(model: nn.Module, token_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Mean over the MoE layers of ``model`` of their load-balancing loss in the last forward; None if it has none.

    ``token_mask [B, T]`` (the shape of that forward's tokens; nonzero = counts) leaves padding out. Finds the layers
    through ``model.modules()``, so FSDP / tensor-parallel wrappers and a critic around the backbone work too.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return None
    routings = [m.routing for m in layers if m.routing is not None]
    if len(routings) != len(layers):
        missing = [i for i, m in enumerate(layers) if m.routing is None]
        raise RuntimeError(f"router_aux_loss: MoE layers {missing} have no routing yet; run a forward first")
    return torch.stack([load_balancing_loss(r.probs, r.expert_idx, token_mask) for r in routings]).mean()


class AdaptedWeight(NamedTuple):
    """A stacked expert weight with a low-rank update per expert: expert ``e`` computes with
    ``weight[e] + scaling * lora_B[e] @ lora_A[e]``."""

    weight: torch.Tensor
    """``[E, out, in]``, frozen."""
    lora_A: torch.Tensor
    """``[E, rank, in]``."""
    lora_B: torch.Tensor
    """``[E, out, rank]``."""
    scaling: float

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def expert(self, e: int) -> torch.Tensor:
        """Expert ``e``'s weight with its update folded in, ``[out, in]``."""
        return self.weight[e] + self.scaling * (self.lora_B[e] @ self.lora_A[e])


ExpertWeight = torch.Tensor | AdaptedWeight


def _expert(w: ExpertWeight, e: int) -> torch.Tensor:
    return w.expert(e) if isinstance(w, AdaptedWeight) else w[e]


def _swiglu(h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2)


@MOE_EXPERTS.register("loop")
def loop_experts(
    x: torch.Tensor, expert_idx: torch.Tensor, expert_weight: torch.Tensor,
    w1: ExpertWeight, w3: ExpertWeight, w2: ExpertWeight,
) -> torch.Tensor:
    """Reference: for each expert, gather its tokens, run its SwiGLU, scatter-add the weighted result."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = torch.where(expert_idx == e)
        if tok.numel() == 0:
            continue
        y = _swiglu(x[tok], _expert(w1, e), _expert(w3, e), _expert(w2, e))
        out.index_add_(0, tok, y * expert_weight[tok, slot, None])
    return out


@MOE_EXPERTS.register("grouped")
def grouped_experts(
    x: torch.Tensor, expert_idx: torch.Tensor, expert_weight: torch.Tensor,
    w1: ExpertWeight, w3: ExpertWeight, w2: ExpertWeight,
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert, then one grouped matmul per projection."""
    pairs = sort_by_expert(expert_idx, w1.shape[0])
    groups = _Groups(pairs.expert, pairs.counts)
    xs = x[pairs.token]
    h = F.silu(groups.linear(xs, w1)) * groups.linear(xs, w3)
    return pairs.combine(x, groups.linear(h, w2), expert_weight)


class ExpertSort(NamedTuple):
    """(token, expert) pairs sorted by expert: pair ``i`` sends token ``token[i]`` to expert ``expert[i]``."""

    order: torch.Tensor
    """``[N * K]`` positions into the flattened ``expert_idx`` (``n * K + k``), in sorted order."""
    token: torch.Tensor
    """``[N * K]`` token of each sorted pair (``order // K``)."""
    expert: torch.Tensor
    """``[N * K]`` expert of each sorted pair, ascending."""
    counts: torch.Tensor
    """``[E]`` pairs per expert (group sizes, int64)."""

    def combine(self, x: torch.Tensor, rows: torch.Tensor, expert_weight: torch.Tensor) -> torch.Tensor:
        """Unsort expert outputs ``rows [N * K, D]`` back to tokens: ``[N, D]`` sum of routing-weighted rows."""
        weighted = rows * expert_weight.reshape(-1)[self.order, None]
        return torch.zeros_like(x).index_add_(0, self.token, weighted)


def sort_by_expert(expert_idx: torch.Tensor, num_experts: int) -> ExpertSort:
    """Sort the (token, expert) pairs of ``expert_idx [N, K]`` by expert (stable, so tokens stay in order)."""
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return ExpertSort(order, order // expert_idx.shape[1], flat[order], counts)


class _Groups:
    """Rows sorted by expert (``expert_of_row`` ascending, ``counts`` per expert) and a per-expert linear over them."""

    def __init__(self, expert_of_row: torch.Tensor, counts: torch.Tensor):
        self.expert_of_row, self.counts = expert_of_row, counts
        self._pad_index: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def linear(self, rows: torch.Tensor, weight: ExpertWeight) -> torch.Tensor:
        """``rows [M, Din]`` (sorted), ``weight [E, Dout, Din]`` -> ``[M, Dout]``: row i @ weight[expert_of_row[i]].T"""
        if isinstance(weight, AdaptedWeight):
            low_rank = self.linear(self.linear(rows, weight.lora_A), weight.lora_B)
            return self.linear(rows, weight.weight) + weight.scaling * low_rank
        if _grouped_mm_supported(rows, weight):
            offs = torch.cumsum(self.counts, 0).to(torch.int32)
            return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offs)
        expert, pos, width = self._padding()
        padded = rows.new_zeros(weight.shape[0], width, rows.shape[1])
        padded = padded.index_put((expert, pos), rows)
        return torch.bmm(padded, weight.transpose(-2, -1))[expert, pos]

    def _padding(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self._pad_index is None:
            starts = torch.cumsum(self.counts, 0) - self.counts
            pos = torch.arange(self.expert_of_row.numel(), device=self.counts.device) - starts[self.expert_of_row]
            self._pad_index = (self.expert_of_row, pos, max(int(self.counts.max()), 1))
        return self._pad_index


def _grouped_mm_supported(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    if rows.device.type == "cpu":
        ok_dtype = rows.dtype in (torch.float32, torch.bfloat16)
    else:
        ok_dtype = rows.device.type == "cuda" and rows.dtype == torch.bfloat16
    aligned = all((d * rows.element_size()) % 16 == 0 for d in weight.shape[1:])
    return ok_dtype and aligned and rows.dtype == weight.dtype


class Routing(NamedTuple):
    """What a MoE layer's router decided in one forward (kept for the load-balancing loss)."""

    probs: torch.Tensor
    """``[N, E]`` float32 router softmax, part of the autograd graph when the forward was."""
    expert_idx: torch.Tensor
    """``[N, K]`` experts chosen for each token."""


class Experts(nn.Module):
    """The stacked SwiGLU experts of one MoE layer: parameters ``w1/w3 [E, I, D]``, ``w2 [E, D, I]`` and the kernel
    (an ``MOE_EXPERTS`` function) that runs them. Their own module, with a forward, so a sharding wrapper (FSDP over
    an expert-parallel mesh) gathers exactly these weights when they are used.

    ``gate_up_lora`` / ``down_lora``: per-expert LoRA adapters (``trainer.models.lora.ExpertLoRA``, set by
    ``apply_lora``) on the fused gate/up projection and on the down projection, None without."""

    def __init__(
        self, num_experts: int, dim: int, hidden: int, kernel: Callable[..., torch.Tensor],
        device: torch.device | None, dtype: torch.dtype | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim, device=device, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden, device=device, dtype=dtype))
        self.kernel = kernel
        self.gate_up_lora: ExpertLoRA | None = None
        self.down_lora: ExpertLoRA | None = None

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, expert_weight: torch.Tensor) -> torch.Tensor:
        """``x [N, D]``, ``expert_idx`` / ``expert_weight [N, K]`` -> ``[N, D]``, the routing-weighted expert sum."""
        w1: ExpertWeight = self.w1
        w3: ExpertWeight = self.w3
        w2: ExpertWeight = self.w2
        if self.gate_up_lora is not None and self.gate_up_lora.adapter_enabled:
            a, b = self.gate_up_lora()
            hidden = self.w1.shape[1]
            w1 = AdaptedWeight(self.w1, a, b[:, :hidden], self.gate_up_lora.scaling)
            w3 = AdaptedWeight(self.w3, a, b[:, hidden:], self.gate_up_lora.scaling)
        if self.down_lora is not None and self.down_lora.adapter_enabled:
            a, b = self.down_lora()
            w2 = AdaptedWeight(self.w2, a, b, self.down_lora.scaling)
        return self.kernel(x, expert_idx, expert_weight, w1, w3, w2)


class MoE(nn.Module):
    """Router (``router.weight [E, D]``) + stacked :class:`Experts` (``experts.w1/w3 [E, I, D]``,
    ``experts.w2 [E, D, I]``)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        assert cfg.moe is not None
        self.top_k, self.norm_topk_prob = cfg.moe.top_k, cfg.moe.norm_topk_prob
        num_experts, hidden = cfg.moe.num_experts, cfg.moe.expert_ffn_hidden_dim
        self.router = nn.Linear(cfg.dim, num_experts, bias=False, device=device, dtype=dtype)
        kernel = MOE_EXPERTS.get(cfg.moe_experts)
        self.experts = Experts(num_experts, cfg.dim, hidden, kernel, device, dtype)
        # The last forward's routing. Autograd saves these tensors anyway, so keeping them costs no memory in
        # training; after a no-grad forward they stay alive until the next one.
        self.routing: Routing | None = None

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Load-balancing loss of the last forward over all its tokens; None before the first forward."""
        return None if self.routing is None else load_balancing_loss(*self.routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; records :attr:`routing` (token order ``b * T + t``)."""
        flat = x.reshape(-1, x.shape[-1])
        top_idx, top_w, probs = route_tokens(self.router(flat), self.top_k, self.norm_topk_prob)
        self.routing = Routing(probs, top_idx)
        out = self.experts(flat, top_idx, top_w)
        return out.view_as(x)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.router.weight, std=std)
        for w in (self.experts.w1, self.experts.w3, self.experts.w2):
            nn.init.normal_(w, std=std)
