"""The token embedding and output head with their ``[V, D]`` matrix split by vocabulary rows over a group of ranks:
each rank keeps its own block of rows and never gathers the matrix. The group is either the data-parallel ranks (each
holds its own tokens; the rows are the dim-0 shard FSDP would keep) or a tensor-parallel group (every rank holds the
same tokens, as TP's replicated activations are; FSDP then shards each rank's rows over the data-parallel ranks like
any TP weight).

Why: FSDP's root unit holds the embedding (and the output head, tied or not) gathered for the whole forward and
backward of every micro-batch, then its unsharded gradient and the buffer it reduce-scatters: at Qwen3-0.6B's
151,936 x 1,024 that is 0.6 GB each on every rank, whatever the rank count, and a 0.6 GB all-gather and
reduce-scatter per micro-batch. Here the ranks exchange activations instead of the matrix.

- Lookup (:class:`VocabParallelEmbedding`): the ranks all-gather every rank's token ids; each looks up the rows it
  holds (zeros for the others) and a reduce-scatter sums the pieces back to each rank's own tokens. Backward
  all-gathers the output gradients; each rank adds them into its rows.
- Head (:class:`VocabParallelHead`): the ranks all-gather every rank's hidden states and targets. Each rank computes,
  ``chunk_size`` tokens at a time, the logits of all of them against its rows and four numbers per token (the
  maximum, the sum of ``exp(z - max)``, the sum of ``exp(z - max) (z - max)``, the target's logit where it holds the
  target); an all-gather of those gives every rank each token's log-sum-exp and entropy over the whole vocabulary.
  Backward all-gathers the log-prob and entropy gradients; each rank's logit gradients for its rows give its weight
  gradient whole (every rank's tokens are in it) and a partial hidden gradient, which a reduce-scatter sums to the
  token's own rank.

The arithmetic is the whole head's, once per token; the traffic per micro-batch is a few ``[ranks x tokens, D]``
activations; the gathered activations grow with the rank count (``ranks x tokens x D``), so this pays while that
stays small beside ``V x D``. Ranks may hold different numbers of tokens (each exchange pads to the longest). Every
rank must make the same calls in the same order, as FSDP's own collectives already require of the step.
Gradients are summed over ranks, as ``trainer.parallelize`` sets FSDP's reductions.

Over a tensor-parallel group (``shared_tokens``) there is nothing to gather: every rank already holds every token and
its hidden state, and the gradients arriving from the (identical) loss are the same on every rank. The lookup sums the
ranks' pieces with an all-reduce; the head exchanges only the four numbers per token, and its backward sums the
ranks' partial hidden gradients with an all-reduce. Each rank then computes the head on ``1 / ranks`` of the
vocabulary instead of all of it, and holds ``1 / ranks`` of the matrix and its gradient (Megatron's vocabulary-parallel
embedding and cross entropy, with the entropy term as well).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainer.models.output_head import even_chunk, logits_grad, logits_into

__all__ = ["VocabParallelEmbedding", "VocabParallelHead", "shard_vocabulary_rows"]

# torch 2.13 renamed these collectives (the old names warn on every call); the TPU and XLA stacks' torch has the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_vocabulary_rows(weight: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
    """``weight [V, D]`` as a parameter split by rows over the 1-D ``mesh`` (a ``Shard(0)`` DTensor: the layout FSDP
    gives it, so checkpoints, the weight push and ``local_shards`` see no difference); keeps ``requires_grad``."""
    if mesh.ndim != 1:
        raise ValueError(f"the vocabulary is split over a 1-D data-parallel mesh, got {mesh.ndim} dimensions")
    rows, ranks = weight.shape[0], mesh.size()
    per_rank = -(-rows // ranks)  # Shard(0) splits as torch.chunk does
    if -(-rows // per_rank) < ranks:
        raise ValueError(f"a vocabulary of {rows} rows split over {ranks} ranks leaves a rank without rows: set "
                         "trainer.parallelism.vocab_parallel = false")
    sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)])
    return nn.Parameter(sharded, requires_grad=weight.requires_grad)


def _counts(n: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank's ``n`` (collective)."""
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    _all_gather(out, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return out.tolist()


def _gather_rows(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``[ranks x longest, ...]``: every rank's ``x`` (``counts[rank]`` rows), each padded with zeros to the longest."""
    longest = max(counts)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((len(counts) * longest, *x.shape[1:]))
    _all_gather(out, padded, group=group)
    return out


def _sum_own_rows(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of ``x [ranks x longest, ...]``, this rank keeping its own block's first ``counts[rank]``
    rows (a reduce-scatter)."""
    out = x.new_empty((max(counts), *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=group)
    return out[: counts[dist.get_rank(group)]]


def _own_rows(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's own rows of a gathered ``[ranks x longest, ...]`` tensor."""
    start = dist.get_rank(group) * max(counts)
    return x[start : start + counts[dist.get_rank(group)]]


class _Exchange:
    """How the ranks of ``group`` hold one call's ``n`` tokens: each its own (``shared`` False, the data-parallel split:
    gather every rank's, a reduce-scatter sums back to the owner) or all the same ones (``shared``, a tensor-parallel
    group: nothing to gather, an all-reduce sums). Constructing it is collective when not ``shared``."""

    def __init__(self, group: dist.ProcessGroup, shared: bool, n: int, device: torch.device) -> None:
        self.group, self.shared = group, shared
        self.counts = [n] * dist.get_world_size(group) if shared else _counts(n, group, device)
        self.empty = max(self.counts) == 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``x`` (:func:`_gather_rows`); ``x`` itself when shared."""
        return x if self.shared else _gather_rows(x, self.counts, self.group)

    def sum_own(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of gathered ``x``, this rank's own rows of it (:func:`_sum_own_rows`); all of it, summed
        in place, when shared."""
        if not self.shared:
            return _sum_own_rows(x, self.counts, self.group)
        dist.all_reduce(x, group=self.group)
        return x

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's own rows of gathered ``x`` (:func:`_own_rows`); ``x`` itself when shared."""
        return x if self.shared else _own_rows(x, self.counts, self.group)


def _local_ids(ids: torch.Tensor, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as row indices of this rank's shard, 0 where not held; whether it holds them)."""
    local = ids - first
    held = (local >= 0) & (local < rows)
    return torch.where(held, local, torch.zeros_like(local)), held


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, ids, first, group, shared):  # noqa: ANN001 (autograd signature)
        flat = ids.reshape(-1)
        exchange = ctx.exchange = _Exchange(group, shared, flat.numel(), ids.device)
        if exchange.empty:
            return rows.new_zeros((*ids.shape, rows.shape[1]))
        local, held = _local_ids(exchange.gather(flat), first, rows.shape[0])
        looked_up = F.embedding(local, rows).masked_fill_(~held[:, None], 0)
        ctx.save_for_backward(local, held)
        ctx.rows_shape = rows.shape
        return exchange.sum_own(looked_up).reshape(*ids.shape, rows.shape[1])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        if ctx.exchange.empty:
            return None, None, None, None, None
        local, held = ctx.saved_tensors
        grads = ctx.exchange.gather(grad.reshape(-1, grad.shape[-1]).contiguous())
        grad_rows = grads.new_zeros(ctx.rows_shape)
        grad_rows.index_add_(0, local[held], grads[held])
        return grad_rows, None, None, None, None


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a vocabulary split by rows across the ranks of ``mesh`` (see the module doc).

    ``weight`` is a ``Shard(0)`` DTensor parameter; the state-dict name stays ``weight``. Lookups run in
    ``compute_dtype`` (FSDP's mixed-precision parameter dtype). Collective: every rank of ``mesh`` calls ``forward``.
    """

    def __init__(
        self, weight: nn.Parameter, first: int, compute_dtype: torch.dtype, shared_tokens: bool = False
    ) -> None:
        """``weight``: from :func:`shard_vocabulary_rows`; ``first``: the vocabulary id of this rank's first row;
        ``shared_tokens``: every rank of the mesh looks up the same tokens (a tensor-parallel group)."""
        super().__init__()
        self.weight, self.first, self.compute_dtype = weight, first, compute_dtype
        self.shared_tokens = shared_tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [...]`` int64 -> ``[..., D]`` in ``compute_dtype``."""
        weight = self.weight
        assert isinstance(weight, DTensor), "shard_vocabulary_rows made it a DTensor"
        rows = weight.to_local().to(self.compute_dtype)
        return _Lookup.apply(rows, tokens, self.first, weight.device_mesh.get_group(), self.shared_tokens)


class _Logprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, rows, targets, first, chunk_size, group, shared):  # noqa: ANN001 (autograd signature)
        ctx.set_materialize_grads(False)
        flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        exchange = ctx.exchange = _Exchange(group, shared, flat_targets.numel(), hidden.device)
        logprobs = hidden.new_empty(targets.shape, dtype=torch.float32)
        entropy = hidden.new_empty(targets.shape, dtype=torch.float32)
        if exchange.empty:
            return logprobs, entropy
        all_hidden = exchange.gather(flat_hidden.contiguous())
        local_targets, held = _local_ids(exchange.gather(flat_targets), first, rows.shape[0])
        n, chunk = all_hidden.shape[0], even_chunk(all_hidden.shape[0], chunk_size)
        stats = hidden.new_empty((n, 4), dtype=torch.float32)
        logits_buf = hidden.new_empty((min(chunk, n), rows.shape[0]), dtype=torch.float32)
        exp_buf = torch.empty_like(logits_buf)
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            logits = logits_into(logits_buf, all_hidden[sl], rows)
            _shard_stats(logits, local_targets[sl], held[sl], exp_buf[: logits.shape[0]], out=stats[sl])
        del logits_buf, exp_buf
        every = hidden.new_empty((dist.get_world_size(group) * n, 4), dtype=torch.float32)
        _all_gather(every, stats, group=group)
        all_logprobs, lse, all_entropy = _combine(every.view(-1, n, 4))
        logprobs.view(-1).copy_(exchange.own(all_logprobs))
        entropy.view(-1).copy_(exchange.own(all_entropy))
        ctx.save_for_backward(all_hidden, rows, local_targets, held, lse, all_entropy)
        ctx.chunk, ctx.hidden_shape = chunk, hidden.shape
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # noqa: ANN001
        exchange = ctx.exchange
        if exchange.empty or (grad_logprobs is None and grad_entropy is None):
            return None, None, None, None, None, None, None
        all_hidden, rows, local_targets, held, lse, entropy = ctx.saved_tensors
        chunk, n = ctx.chunk, all_hidden.shape[0]
        own_count = exchange.counts[dist.get_rank(exchange.group)]

        def gathered(g: torch.Tensor | None) -> torch.Tensor:
            own = torch.zeros(own_count, device=lse.device) if g is None else g.reshape(-1).float()
            return exchange.gather(own.contiguous())

        g_lp = gathered(grad_logprobs)
        g_ent = None if grad_entropy is None else gathered(grad_entropy)
        g_target = torch.where(held, g_lp, torch.zeros_like(g_lp))
        grad_hidden = torch.empty((n, all_hidden.shape[1]), dtype=torch.float32, device=all_hidden.device)
        need_rows = ctx.needs_input_grad[1]
        grad_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device) if need_rows else None
        buf = all_hidden.new_empty((min(chunk, n), rows.shape[0]), dtype=torch.float32)
        probs_buf = torch.empty_like(buf)
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            h = all_hidden[sl]
            logp = logits_into(buf, h, rows).sub_(lse[sl, None])
            probs = torch.exp(logp, out=probs_buf[: logp.shape[0]])
            g_ent_chunk = None if g_ent is None else g_ent[sl]
            grad_logits = logits_grad(
                probs, probs, logp, local_targets[sl], g_lp[sl], g_ent_chunk, entropy[sl], target_grad=g_target[sl]
            ).to(rows.dtype)
            grad_hidden[sl] = grad_logits @ rows
            if grad_rows is not None and rows.dtype == torch.float32:
                grad_rows.addmm_(grad_logits.t(), h)  # in place: no [V_rank, D] temporary per chunk
            elif grad_rows is not None:  # each chunk's product in the parameters' dtype, summed in float32
                grad_rows.add_(torch.mm(grad_logits.t(), h))
        del buf, probs_buf
        own_grad_hidden = exchange.sum_own(grad_hidden).to(all_hidden.dtype).view(ctx.hidden_shape)
        grad_rows = None if grad_rows is None else grad_rows.to(rows.dtype)
        return own_grad_hidden, grad_rows, None, None, None, None, None


def _shard_stats(
    logits: torch.Tensor, targets: torch.Tensor, held: torch.Tensor, exp_out: torch.Tensor, *, out: torch.Tensor
) -> None:
    """Into ``out [n, 4]``: per row of this rank's float32 ``logits [n, V_rank]``, the maximum ``m``, ``sum exp(z -
    m)``, ``sum exp(z - m) (z - m)`` and the target's logit (0 where this rank does not hold the target). Overwrites
    ``logits``."""
    out[:, 3] = torch.where(held, logits.gather(-1, targets[:, None]).squeeze(-1), 0.0)
    out[:, 0] = logits.amax(dim=-1)
    shifted = logits.sub_(out[:, :1])
    e = torch.exp(shifted, out=exp_out)
    out[:, 1] = e.sum(-1)
    out[:, 2] = shifted.mul_(e).sum(-1)


def _combine(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob of the target, log-sum-exp, entropy) per token over the whole vocabulary, from every rank's
    :func:`_shard_stats` (``stats [ranks, n, 4]``).

    With ``M`` the largest maximum, ``c_r = exp(m_r - M)`` and ``S = sum_r c_r s_r``: log-sum-exp ``= M + log S``
    and entropy ``= lse - E[z] = log S - sum_r c_r (a_r + (m_r - M) s_r) / S``.
    """
    m, s, a, target_logit = stats.unbind(-1)
    top = m.amax(dim=0)
    scale = torch.exp(m - top)
    total = (scale * s).sum(0)
    lse = top + total.log()
    entropy = total.log() - (scale * (a + (m - top) * s)).sum(0) / total
    return target_logit.sum(0) - lse, lse, entropy


class VocabParallelHead:
    """An output head (``OUTPUT_HEADS``' contract: ``head(hidden, weight, targets, *, chunk_size) -> (logprobs,
    entropy)``) for a ``weight`` split by vocabulary rows (:func:`shard_vocabulary_rows`); see the module doc.

    Computes in ``hidden``'s dtype, the softmax in float32; collective over the weight's mesh. ``first``: the vocabulary
    id of this rank's first row; ``shared_tokens``: every rank of the mesh passes the same hidden states and targets
    and gets every token's results (a tensor-parallel group), else each rank its own tokens'.
    """

    def __init__(self, first: int, shared_tokens: bool = False) -> None:
        self.first, self.shared_tokens = first, shared_tokens

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int = 1024
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(weight, DTensor):
            raise TypeError("the vocabulary-parallel head needs the output weight split by rows (a Shard(0) DTensor)")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        rows = weight.to_local().to(hidden.dtype)
        group = weight.device_mesh.get_group()
        return _Logprobs.apply(hidden, rows, targets, self.first, chunk_size, group, self.shared_tokens)
