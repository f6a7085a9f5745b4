"""Output heads: per-token log-probability of a target and the entropy of the next-token distribution.

- ``dense``: ``logits = hidden @ W^T`` for all tokens at once, then log-softmax; holds [N, V] float32 logits (and
  autograd keeps more of that size for backward). Simple; the reference for parity.
- ``chunked``: a custom autograd function that walks ``chunk_size`` tokens at a time, keeps only per-token
  log-sum-exp and entropy (``[N]``) from forward, and recomputes each chunk's logits in backward. Peak extra memory
  is a few ``[chunk_size, V]`` float32 buffers plus the weight gradient, never the full ``[N, V]``.
- ``cached``: ``chunked``'s forward, but it keeps every chunk's float32 probabilities (``[N, V]``, as much as
  ``dense``'s logits) so backward skips the logits matmul (a third of the head's FLOPs) and the exp. For when the
  head's tokens times vocabulary fit in memory comfortably (CPU training, short completions).

All compute logits in the parameters' dtype and do the softmax math in float32, so they agree to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.models.registry import OUTPUT_HEADS

__all__ = [
    "cached_token_logprobs", "chunked_token_logprobs", "dense_token_logprobs",
    "even_chunk", "logits_grad", "logits_into",  # shared with trainer.vocab_parallel's head
]  # fmt: skip


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
    return _chunked(hidden, weight, targets, chunk_size, keep_probs=False)


@OUTPUT_HEADS.register("cached")
def cached_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`dense_token_logprobs`; keeps ``[N, V]`` float32 probabilities for backward."""
    return _chunked(hidden, weight, targets, chunk_size, keep_probs=True)


def _chunked(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, *, keep_probs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedLogprobs.apply(hidden, weight, targets, chunk_size, keep_probs)


def even_chunk(n: int, chunk_size: int) -> int:
    """The chunk length that splits ``n`` tokens into as few chunks of at most ``chunk_size`` as possible, of equal
    length but the last: 1,036 tokens at 1,024 become 2 x 518, not 1,024 + a 12-row matmul at a fraction of the
    speed."""
    chunks = max(1, -(-n // chunk_size))
    return max(1, -(-n // chunks))


def logits_into(buf: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` in the parameters' dtype, as float32 in the leading rows of the reused buffer ``buf``.

    Reusing one buffer per call matters on CPU: a fresh ``[chunk, V]`` float32 block is above glibc's mmap
    threshold, so every allocation would page-fault its whole size in again.
    """
    out = buf[: hidden.shape[0]]
    if weight.dtype == torch.float32 and hidden.dtype == torch.float32:
        return torch.mm(hidden, weight.t(), out=out)
    return out.copy_(F.linear(hidden, weight))


def _softmax_stats(
    logits: torch.Tensor, targets: torch.Tensor, exp_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logit, log-sum-exp, entropy) per row of float32 ``logits [n, V]``; ``exp_out`` ends up holding the
    probabilities. Overwrites ``logits``."""
    target_logit = logits.gather(-1, targets[:, None]).squeeze(-1)
    row_max = logits.amax(dim=-1)
    shifted = logits.sub_(row_max[:, None])  # z - max <= 0: exp cannot overflow
    e = torch.exp(shifted, out=exp_out)
    sum_e = e.sum(-1)
    # entropy = log(sum e) - sum(e * (z - max)) / sum e, from the unnormalised e.
    entropy = sum_e.log() - shifted.mul_(e).sum(-1) / sum_e
    e.mul_(sum_e.reciprocal()[:, None])
    return target_logit, row_max + sum_e.log(), entropy


def logits_grad(
    out: torch.Tensor, probs: torch.Tensor, logp: torch.Tensor | None, targets: torch.Tensor,
    g_lp: torch.Tensor, g_ent: torch.Tensor | None, entropy: torch.Tensor, target_grad: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """d loss / d logits into ``out`` (may alias ``probs``; ``logp`` is overwritten, None: derived from ``probs``).

    d logprob[t] / d logits = onehot(t) - p and d entropy / d logits = -p * (log p + H), so the gradient is
    ``p * (a * log p + b) + g_lp * onehot(t)`` with ``a = -g_ent``, ``b = -g_ent * H - g_lp``. ``target_grad``
    replaces ``g_lp`` in the one-hot term (a vocabulary shard holding only some rows' targets: 0 for the others, whose
    ``targets`` then index any column).
    """
    if g_ent is None:
        grad = torch.mul(probs, -g_lp[:, None], out=out)
    else:
        a, b = -g_ent, -g_ent * entropy - g_lp
        if logp is None:  # p log p with 0 where p underflowed to 0 (its gradient term is 0 too)
            grad = torch.xlogy(probs, probs, out=out).mul_(a[:, None]).add_(probs * b[:, None])
        else:
            grad = torch.mul(probs, logp.mul_(a[:, None]).add_(b[:, None]), out=out)
    return grad.scatter_add_(-1, targets[:, None], (g_lp if target_grad is None else target_grad)[:, None])


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, keep_probs):  # noqa: ANN001 (autograd signature)
        ctx.set_materialize_grads(False)  # an unused output (entropy without a bonus) gets None: a cheaper backward
        flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        n, vocab = flat_targets.numel(), weight.shape[0]
        chunk_size = even_chunk(n, chunk_size)
        # Outputs are allocated in their final shape and filled through flat views: returned tensors are not views.
        logprobs = hidden.new_empty(targets.shape, dtype=torch.float32)
        entropy = hidden.new_empty(targets.shape, dtype=torch.float32)
        lse = hidden.new_empty(flat_targets.shape, dtype=torch.float32)
        flat_logprobs, flat_entropy = logprobs.view(-1), entropy.view(-1)
        logits_buf = hidden.new_empty((min(chunk_size, n), vocab), dtype=torch.float32)
        probs = hidden.new_empty((n if keep_probs else min(chunk_size, n), vocab), dtype=torch.float32)
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            logits = logits_into(logits_buf, flat_hidden[sl], weight)
            exp_out = probs[sl] if keep_probs else probs[: logits.shape[0]]
            target_logit, lse[sl], flat_entropy[sl] = _softmax_stats(logits, flat_targets[sl], exp_out)
            flat_logprobs[sl] = target_logit - lse[sl]
        del logits_buf
        saved_probs = probs if keep_probs else None
        ctx.save_for_backward(flat_hidden, weight, flat_targets, lse, flat_entropy.detach().clone(), saved_probs)
        ctx.chunk_size, ctx.hidden_shape = chunk_size, hidden.shape
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # noqa: ANN001
        hidden, weight, targets, lse, entropy, saved_probs = ctx.saved_tensors
        n, chunk_size = hidden.shape[0], ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs is None and grad_entropy is None) or not (need_h or need_w):
            return None, None, None, None, None
        g_lp = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.reshape(-1).float()
        g_ent = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # Written by the first chunk's matmul, accumulated by the others: no zero-fill pass over [V, D].
        grad_weight = None
        if need_w:
            alloc = torch.zeros if n == 0 else torch.empty
            grad_weight = alloc(weight.shape, dtype=torch.float32, device=weight.device)
        buf = hidden.new_empty((min(chunk_size, n), weight.shape[0]), dtype=torch.float32)
        probs_buf = torch.empty_like(buf) if saved_probs is None else None
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            h, g_ent_chunk = hidden[sl], None if g_ent is None else g_ent[sl]
            if saved_probs is None:
                logp = logits_into(buf, h, weight).sub_(lse[sl, None])
                probs = torch.exp(logp, out=probs_buf[: logp.shape[0]])
                grad_logits = logits_grad(probs, probs, logp, targets[sl], g_lp[sl], g_ent_chunk, entropy[sl])
            else:
                probs = saved_probs[sl]
                grad_logits = logits_grad(
                    buf[: probs.shape[0]], probs, None, targets[sl], g_lp[sl], g_ent_chunk, entropy[sl]
                )
            grad_logits = grad_logits.to(weight.dtype)
            if need_h and grad_hidden.dtype == weight.dtype:
                torch.mm(grad_logits, weight, out=grad_hidden[sl])
            elif need_h:
                grad_hidden[sl] = grad_logits @ weight
            if need_w and weight.dtype != torch.float32:
                # Each chunk's product in the parameters' dtype (tensor cores on a GPU; the same product of upcast
                # operands ran as a float32 SIMT GEMM there, ~40% of a bf16 step), summed in float32.
                part = torch.mm(grad_logits.t(), h.to(weight.dtype))
                if start == 0:
                    grad_weight.copy_(part)
                else:
                    grad_weight.add_(part)
            elif need_w and start == 0:
                torch.mm(grad_logits.t().float(), h.float(), out=grad_weight)
            elif need_w:
                grad_weight.addmm_(grad_logits.t().float(), h.float())
        del buf, probs_buf
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_h:
            grad_hidden = grad_hidden.view(ctx.hidden_shape)
        return grad_hidden, grad_weight, None, None, None
