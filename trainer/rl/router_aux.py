"""The MoE router load-balancing term of the policy loss: its weight, which packed tokens count, each one's share.

Per micro-batch the term is ``coef x mean over MoE layers of the layer's load-balancing loss`` over the micro-batch's
real tokens (prompt and completion; padding never counts: padded positions all see the same pad token and would
pile onto the same experts). Gradient accumulation: each micro-batch enters with weight ``its tokens / the optimizer
batch's tokens`` (all ranks), so the accumulated gradient is that of the token-weighted mean over micro-batches, the
same on 1 or N ranks. Use inside a step, after ``compute_policy_loss``::

    coef = moe_aux_coef(state.algorithm.config, state.model_cfg)  # None: dense model, nothing to add
    num_tokens = count_router_tokens(samples, minibatch_indices)  # once per optimizer batch
    loss, metrics = add_router_aux_loss(loss, metrics, model, mb, coef, num_tokens)

``metrics['loss/moe_aux']`` is the micro-batch's share of the *unweighted* term (sum the shares: ``top_k`` means
perfectly balanced routing); ``metrics['loss']`` then includes ``coef x`` that share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.metrics import Metrics
from trainer.models.moe import router_aux_loss
from trainer.rl.config import PolicyConfig

if TYPE_CHECKING:
    from rollout.types import Sample
    from trainer.models.config import ModelConfig
    from trainer.packing import MicroBatch

__all__ = ["METRIC", "add_router_aux_loss", "count_router_tokens", "moe_aux_coef", "router_token_mask"]

METRIC = "loss/moe_aux"


def moe_aux_coef(algorithm: PolicyConfig, model_cfg: ModelConfig) -> float | None:
    """The weight of the term: the algorithm's override, else the model's own; None for a dense model."""
    if model_cfg.moe is None:
        return None
    if algorithm.moe_aux_loss_coef is not None:
        return algorithm.moe_aux_loss_coef
    return model_cfg.moe.aux_loss_coef


def count_router_tokens(samples: Sequence[Sample], indices: Sequence[int]) -> float:
    """Tokens of ``samples[indices]`` that :func:`router_token_mask` counts (sequences with a completion)."""
    lengths = [(len(samples[i].prompt_ids), len(samples[i].completion_ids)) for i in indices]
    return float(sum(p + c for p, c in lengths if c > 0))


def router_token_mask(mb: MicroBatch) -> torch.Tensor:
    """``[R, L]`` bool: the row positions holding a token of a sequence with a non-empty completion.

    Derived from the loss layout alone: the last completion token of sequence ``s`` (a model token) sits one past the
    position that predicts it (``gather_index``), and its position inside the sequence says where the sequence
    starts. Sequences without completion tokens carry no loss and are left out along with the padding.
    """
    rows, width = mb.tokens.shape
    model_tokens = mb.loss_mask > 0
    if not model_tokens.any():
        return torch.zeros(rows, width, dtype=torch.bool, device=mb.tokens.device)
    seqs = torch.nonzero(model_tokens.any(dim=1))[:, 0]
    columns = torch.arange(model_tokens.shape[1], device=mb.tokens.device)
    last_column = torch.where(model_tokens, columns, 0).amax(dim=1)  # a trajectory ends with a model token
    last = mb.gather_index[seqs, last_column[seqs]] + 1
    first = last - mb.positions.reshape(-1)[last]
    edges = torch.zeros(rows * width + 1, dtype=torch.long, device=mb.tokens.device)
    edges.index_add_(0, first, torch.ones_like(first))
    edges.index_add_(0, last + 1, -torch.ones_like(last))
    return (edges.cumsum(0)[:-1] > 0).reshape(rows, width)


def add_router_aux_loss(
    loss: torch.Tensor,
    metrics: Metrics,
    model: nn.Module,
    mb: MicroBatch,
    coef: float | None,
    num_tokens: float,
) -> tuple[torch.Tensor, Metrics]:
    """``loss + coef x share`` and the metrics with ``loss/moe_aux`` (and ``loss`` updated), after ``model``'s forward
    on ``mb``.

    ``share`` = the model's :func:`~trainer.models.moe.router_aux_loss` over :func:`router_token_mask` x (the mask's
    tokens / ``num_tokens``, the optimizer batch's count). ``coef`` None (dense model) returns the inputs unchanged;
    ``coef`` 0 reports the metric and leaves the loss and its graph untouched.
    """
    if coef is None:
        return loss, metrics
    token_mask = router_token_mask(mb)
    num_mine = float(token_mask.sum())
    if num_mine > num_tokens:
        raise ValueError(f"num_tokens ({num_tokens}) must count the whole optimizer batch, which holds at least this "
                         f"micro-batch's {num_mine} routed tokens; use count_router_tokens")
    share = num_mine / num_tokens if num_mine else 0.0
    aux = router_aux_loss(model, token_mask)
    assert aux is not None, "moe_aux_coef gave a coefficient for a model without MoE layers"
    metrics = {**metrics, METRIC: aux.detach() * share}
    if coef == 0:
        return loss, metrics
    loss = loss + (coef * share) * aux
    metrics["loss"] = metrics["loss"] + coef * metrics[METRIC]
    return loss, metrics
