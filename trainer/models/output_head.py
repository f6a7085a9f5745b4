"""Output heads: per-token log-probability of a target and the entropy of the next-token distribution.

- ``dense``: ``logits = hidden @ W^T`` for all tokens at once, then log-softmax; holds [N, V] float32 logits (and
  autograd keeps more of that size for backward). Simple; the reference for parity.
- ``chunked``: a custom autograd function that walks ``chunk_size`` tokens at a time, keeps only per-token
  log-sum-exp and entropy (``[N]``) from forward, and recomputes each chunk's logits in backward. Peak extra memory
  is a few ``[chunk_size, V]`` float32 buffers plus the weight gradient, never the full ``[N, V]``.

Both compute logits in the parameters' dtype and do the softmax math in float32, so they agree to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.models.registry import OUTPUT_HEADS

__all__ = ["chunked_token_logprobs", "dense_token_logprobs"]


@OUTPUT_HEADS.register("dense")
def dense_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [..., D]``, ``weight [V, D]``, ``targets [...]`` -> (logprobs ``[...]``, entropy ``[...]``), float32.

    The outputs are fresh tensors, not views (an FSDP root method must not return views).
    """
    del chunk_size
    logp = torch.log_softmax(F.linear(hidden, weight).float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[..., None]).sum(-1), entropy


@OUTPUT_HEADS.register("chunked")
def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`dense_token_logprobs`, in chunks of ``chunk_size`` tokens (see the module docstring)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedLogprobs.apply(hidden, weight, targets, chunk_size)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):  # noqa: ANN001 (autograd signature)
        flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        # Outputs are allocated in their final shape and filled through flat views: returned tensors are not views.
        logprobs = hidden.new_empty(targets.shape, dtype=torch.float32)
        entropy = hidden.new_empty(targets.shape, dtype=torch.float32)
        lse = hidden.new_empty(flat_targets.shape, dtype=torch.float32)
        flat_logprobs, flat_entropy = logprobs.view(-1), entropy.view(-1)
        for start in range(0, flat_targets.numel(), chunk_size):
            sl = slice(start, start + chunk_size)
            logits = F.linear(flat_hidden[sl], weight).float()
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[sl] = chunk_lse
            flat_logprobs[sl] = logits.gather(-1, flat_targets[sl, None]).squeeze(-1) - chunk_lse
            # entropy = lse - sum(p * logits); reuse the probs buffer for p * logits.
            probs = (logits - chunk_lse[:, None]).exp_()
            flat_entropy[sl] = chunk_lse - probs.mul_(logits).sum(-1)
            del logits, probs
        ctx.save_for_backward(flat_hidden, weight, flat_targets, lse, flat_entropy.detach().clone())
        ctx.chunk_size, ctx.hidden_shape = chunk_size, hidden.shape
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # noqa: ANN001
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        n, chunk_size = hidden.shape[0], ctx.chunk_size
        g_lp = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.reshape(-1).float()
        g_ent = torch.zeros_like(lse) if grad_entropy is None else grad_entropy.reshape(-1).float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            h = hidden[sl]
            logp = F.linear(h, weight).float().sub_(lse[sl, None])
            probs = logp.exp()
            # d entropy / d logits = -p * (log p + H);  d logprob[t] / d logits = onehot(t) - p
            grad_logits = logp.add_(entropy[sl, None]).mul_(probs).mul_(-g_ent[sl, None])
            grad_logits.sub_(probs.mul_(g_lp[sl, None]))
            del probs
            grad_logits.scatter_add_(-1, targets[sl, None], g_lp[sl, None])
            del logp  # same storage as grad_logits; drop the alias so a dtype cast below can free it
            grad_logits = grad_logits.to(weight.dtype)
            if need_h:
                grad_hidden[sl] = grad_logits @ weight
            if need_w:
                grad_weight.addmm_(grad_logits.t().float(), h.float())
            del grad_logits
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_h:
            grad_hidden = grad_hidden.view(ctx.hidden_shape)
        return grad_hidden, grad_weight, None, None
