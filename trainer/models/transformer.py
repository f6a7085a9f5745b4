"""The decoder-only transformer shared by Llama 3, Qwen 3 and Qwen 3 MoE, built from a :class:`ModelConfig`.

Usage::

    model = build_model(cfg, device="cpu", dtype=torch.float32)
    hidden = model(tokens, positions, segment_ids)          # [B, T, D], after the final norm
    hidden = model(tokens, positions, segment_ids, output_positions=idx)  # [N, D] at flat positions idx only
    logprobs, entropy = model.token_logprobs(hidden, targets)  # [B, T] each, float32, through cfg.output_head
    loss = ... + coef * model.moe_aux_loss()                 # MoE only: router load-balancing loss of that forward
    model.checkpoint_blocks(range(0, cfg.num_layers, 2))      # activation checkpointing of every other block

Packed rows: pass ``segment_ids`` (equal ids = one sequence; attention stays inside a segment) and ``positions`` that
restart at 0 per segment (computed from ``segment_ids`` when omitted).

FSDP2: ``model.layers`` is an ``nn.ModuleList`` of blocks (shard each, then the root, keeping embeddings, final norm
and output head in the root unit so tied weights stay tied). ``logits``/``token_logprobs`` are called outside
``forward``: register them with ``torch.distributed.fsdp.register_fsdp_forward_method(model, name)`` so the root's
parameters are gathered for them. ``trainer.vocab_parallel`` instead splits the embedding and output matrices by
vocabulary rows over the ranks, swapping in its lookup module and head (:meth:`Transformer.set_output_head`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from trainer.models.attention import Attention
from trainer.models.config import ModelConfig
from trainer.models.layers import FeedForward, RMSNorm
from trainer.models.lora import ExpertLoRA, LoRALinear, apply_lora
from trainer.models.moe import MoE
from trainer.models.output_head import chunked_token_logprobs  # noqa: F401 (registers the built-in heads)
from trainer.models.registry import ATTENTION_BLOCKS, OUTPUT_HEADS, check_blocks_supported
from trainer.models.rope import rope_cos_sin

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["Transformer", "TransformerBlock", "build_model", "positions_from_segments"]

_INIT_STD = 0.02


@runtime_checkable
class _CompiledSwitch(Protocol):
    """A module whose elementwise ops can run through their ``torch.compile``-d copies (RMSNorm, FeedForward,
    Attention): the switch :meth:`Transformer.compile_elementwise` flips."""

    use_compiled: bool


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + ffn(norm(h))``; ffn is dense SwiGLU or MoE."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, dtype)
        self.attention = Attention(cfg, device, dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, dtype)
        if cfg.moe is None:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim, device, dtype)
        else:
            self.moe = MoE(cfg, device, dtype)
        self.checkpointed = False
        """Activation checkpointing: in a pass with gradients keep only the inputs and recompute the rest in backward
        (set by :meth:`Transformer.checkpoint_blocks`)."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segment_ids: torch.Tensor | None,
        keep: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; with ``keep`` (int64 flat positions ``b * T + t``) -> ``[N, D]`` at
        those positions only: attention still reads every position's keys and values, but its output projection and
        a dense feed-forward run on the kept rows alone (an MoE block runs every row and selects afterwards).
        ``prefix_ids``: shared prompts, see :meth:`Transformer.forward`."""
        if self.checkpointed and torch.is_grad_enabled():
            # Non-reentrant: works with inputs that need no grad (frozen embeddings under LoRA), FSDP2's hooks around
            # this block, and keeps the RNG state so dropout draws the same masks when recomputed.
            return checkpoint(self._forward, x, rope, segment_ids, keep, prefix_ids, use_reentrant=False)
        return self._forward(x, rope, segment_ids, keep, prefix_ids)

    def _forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segment_ids: torch.Tensor | None,
        keep: torch.Tensor | None,
        prefix_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dense = hasattr(self, "feed_forward")
        # MoE: route every token, so the router's load-balancing statistics match an untrimmed forward.
        trim = keep if dense else None
        attn = self.attention(self.attention_norm(x), rope, segment_ids, keep=trim, prefix_ids=prefix_ids)
        # index_select, not x[...]: its backward is an index_add, ~5x faster on CPU than indexing's accumulating put
        # (on CUDA, like the embedding's backward, bitwise repeatable only under torch.use_deterministic_algorithms).
        h = (x if trim is None else x.reshape(-1, x.shape[-1]).index_select(0, trim)) + attn
        out = h + (self.feed_forward if dense else self.moe)(self.ffn_norm(h))
        if keep is not None and trim is None:
            out = out.reshape(-1, out.shape[-1]).index_select(0, keep)
        return out

    def init_weights(self, std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std)
        (self.feed_forward if hasattr(self, "feed_forward") else self.moe).init_weights(std)


class Transformer(nn.Module):
    """Token embedding, ``cfg.num_layers`` blocks in ``self.layers``, final RMSNorm, output head (see module doc)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, device=device, dtype=dtype)
        blocks = [TransformerBlock(cfg, device, dtype) for _ in range(cfg.num_layers)]
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device, dtype)
        self.output = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        )
        self._head = OUTPUT_HEADS.get(cfg.output_head)
        # A plain list (not registered): the MoE modules stay reachable through FSDP/checkpoint wrappers.
        self._moe_layers: list[MoE] = [block.moe for block in blocks if hasattr(block, "moe")]
        if cfg.lora is not None:
            apply_lora(self, cfg)  # adapters on the targeted projections, every other parameter frozen

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        output_positions: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens [B, T]`` -> hidden states ``[B, T, D]`` after the final norm.

        ``positions [B, T]`` default to ``0..T-1`` (or restart per segment when ``segment_ids`` is given);
        ``segment_ids [B, T]``: attention is causal and only between tokens of equal id (packed sequences).
        ``output_positions`` (int64 ``[N]`` flat positions ``b * T + t``): return ``[N, D]`` for those positions
        only, equal to ``forward(...).reshape(-1, D)[output_positions]``. Nothing after the last block's attention
        can reach another position, so the last dense block runs its output projection and feed-forward on those
        rows alone (an RL loss reads only completion positions: prompts are often half the tokens).
        ``prefix_ids [B, T]`` (with ``segment_ids`` and ``positions``, for an attention block registered
        ``shared_prefix``): each token's segment also attends to the segment of that id (a prompt packed once for
        several completions, ``trainer.packing``); -1 for none. ``output_positions`` may then repeat a position.
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        for name, t in (("positions", positions), ("segment_ids", segment_ids), ("prefix_ids", prefix_ids)):
            if t is not None and t.shape != tokens.shape:
                raise ValueError(f"{name} shape {tuple(t.shape)} must equal tokens shape {tuple(tokens.shape)}")
        if prefix_ids is not None and (segment_ids is None or positions is None):
            raise ValueError("prefix_ids need segment_ids and positions (a shared prompt's completions continue its "
                             "positions, which segment ids alone cannot say)")
        if prefix_ids is not None and not ATTENTION_BLOCKS.takes_shared_prefix(self.cfg.attention):
            raise ValueError(f"attention block {self.cfg.attention!r} takes no prefix_ids (shared prompts); pack each "
                             "sequence whole (trainer.share_prompts = false)")
        if positions is None:
            positions = (
                positions_from_segments(segment_ids)
                if segment_ids is not None
                else torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            )
        h = self.tok_embeddings(tokens)
        rope = rope_cos_sin(self.cfg, positions, h.dtype)
        last = len(self.layers) - 1
        for i, block in enumerate(self.layers):
            h = block(h, rope, segment_ids, keep=output_positions if i == last else None, prefix_ids=prefix_ids)
        return self.norm(h)

    def checkpoint_blocks(self, indices: Iterable[int]) -> None:
        """Turn activation checkpointing on for the blocks at ``indices`` (of ``self.layers``) and off for the rest.

        Works before or after sharding (FSDP2 and TP keep the block modules); names, parameters and outputs are
        unchanged. Raises ``IndexError`` for an index outside the blocks."""
        chosen = set(indices)
        if outside := sorted(i for i in chosen if not 0 <= i < len(self.layers)):
            raise IndexError(f"blocks {outside} do not exist: the model has {len(self.layers)} blocks")
        for i, block in enumerate(self.layers):
            assert isinstance(block, TransformerBlock), f"a block is a TransformerBlock, got {type(block)}"
            block.checkpointed = i in chosen

    @property
    def output_weight(self) -> torch.Tensor:
        """The ``[V, D]`` output projection (the embedding matrix when embeddings are tied). Raises ``ValueError`` for
        a body whose untied head was dropped (a PPO critic's)."""
        if self.output is not None:
            return self.output.weight
        if not self.cfg.tie_embeddings:
            raise ValueError("this model's untied output head was dropped (a critic's body): it has no output weight")
        return self.tok_embeddings.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Dense logits ``[B, T, V]`` (float32) for ``hidden [B, T, D]``; holds them all (evaluation, parity). Needs
        the whole output matrix: ``ValueError`` when it is split by vocabulary rows (:meth:`set_output_head`)."""
        if isinstance(self.output_weight, DTensor):
            raise ValueError("logits() needs the whole output matrix, which is split by vocabulary rows over the ranks "
                             "(trainer.parallelism.vocab_parallel): use token_logprobs()")
        return F.linear(hidden, self.output_weight).float()

    def set_output_head(self, head: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Compute :meth:`token_logprobs` with ``head`` (``OUTPUT_HEADS``' contract) instead of ``cfg.output_head``'s
        block: how ``trainer.parallelize`` installs the head of a vocabulary split over ranks."""
        self._head = head

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(targets), entropy of the full next-token distribution), each ``[B, T]`` float32, differentiable.

        Computed by the ``cfg.output_head`` block (``chunked`` never holds the full [tokens, vocab] logits).
        """
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden's {tuple(hidden.shape[:-1])}")
        return self._head(hidden, self.output_weight, targets, chunk_size=self.cfg.output_chunk_size)

    def compile_elementwise(self) -> None:
        """Run the elementwise ops of every block (RMSNorm, SwiGLU, and any module with a ``use_compiled`` switch)
        through their ``torch.compile``-d copies (see :mod:`trainer.models.layers`); same math within float32
        rounding. Call before sharding or copying the model; parameters and state-dict names are untouched."""
        for module in self.modules():
            if isinstance(module, _CompiledSwitch):
                module.use_compiled = True

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Mean over MoE layers of the router load-balancing loss of the last forward; ``None`` for dense models."""
        if not self._moe_layers:
            return None
        losses = [loss for loss in (m.aux_loss for m in self._moe_layers) if loss is not None]
        if len(losses) != len(self._moe_layers):
            raise RuntimeError("moe_aux_loss() called before any forward")
        return torch.stack(losses).mean()

    def tensor_parallel_plan(self, degree: int) -> dict[str, ParallelStyle]:
        """Per-block plan for ``parallelize_module(block, tp_mesh, plan)`` over ``degree`` ranks: Megatron-style
        column/row splits, so each block needs one all-reduce after attention and one after the feed-forward.

        q/k/v and w1/w3 are split by output rows (heads / hidden units), o and w2 by input columns. Norms stay plain
        replicas; the q/k norms (Qwen 3) then see only this rank's heads, so their weight gradients are partial sums
        that :func:`trainer.parallelize.sync_tensor_parallel_partial_grads` adds up after backward. Sharded pieces keep
        the HF layout, so :func:`trainer.models.hf_io.hf_shards` maps them unchanged.

        LoRA adapters follow their projections (``trainer.models.lora.split_adapters_like_their_weights``, applied
        by :func:`trainer.parallelize.parallelize_model`). Raises ``ValueError`` for MoE blocks (experts are not
        split) and when ``degree`` does not divide ``num_heads`` and ``num_kv_heads``.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        problem = self.cfg.tensor_parallel_problem(degree)
        if problem is not None:
            raise ValueError(problem)
        return {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }  # fmt: skip

    @torch.no_grad()
    def init_weights(self, std: float = _INIT_STD) -> None:
        """Fresh initialisation: normal(0, std) matrices, unit norms (call after ``to_empty`` on a meta-built model)."""
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for block in self.layers:
            assert isinstance(block, TransformerBlock), f"init_weights runs on unwrapped blocks, got {type(block)}"
            block.init_weights(std)
        self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=std)
        for module in self.modules():
            if isinstance(module, LoRALinear | ExpertLoRA):
                module.reset_adapter()


def positions_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, T]`` that restart at 0 wherever the segment id changes along each row."""
    t = segment_ids.shape[1]
    idx = torch.arange(t, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_of_segment = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_of_segment


def build_model(
    cfg: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    runs_on: torch.device | str | None = None,
) -> Transformer:
    """Build the model of ``cfg`` on ``device``; initialised unless ``device`` is ``"meta"`` (then ``to_empty`` +
    ``init_weights``). ``runs_on``: the device it will compute on when that is not ``device`` (the trainer builds on
    the meta device, shards, and writes each rank's pieces on the device: ``trainer.initial_weights``).

    Raises ``ValueError`` if a block name in ``cfg`` is not registered (the message lists the registered ones) or
    names a kernel that cannot run on ``runs_on`` (the message names the flag and the setting to use instead).
    """
    device = torch.device(device) if device is not None else None
    check_blocks_supported(cfg, runs_on if runs_on is not None else device)
    model = Transformer(cfg, device=device, dtype=dtype)
    if device is None or device.type != "meta":
        model.init_weights()
    return model
