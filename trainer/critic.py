"""PPO's critic: the policy's transformer body with a scalar value head instead of the output head (an untied head is
dropped; a tied one is the input embedding, which the body keeps).

The critic is built from the same :class:`ModelConfig` (and usually the same initial weights) as the policy, so it
shards the same way (``critic.layers`` are its blocks). Its value at row position ``t`` estimates the return of the
state in which the token at ``t + 1`` is generated, matching the alignment of log-probs in ``trainer.packing``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from trainer.models.transformer import Transformer

__all__ = ["Critic"]


class Critic(nn.Module):
    """``values = value_head(body(tokens))``: float32 per position."""

    def __init__(self, body: Transformer, dim: int) -> None:
        """Takes ``body`` over (give it a copy of the policy): its untied output head is dropped."""
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(dim, 1, bias=True, device=body.tok_embeddings.weight.device)
        if self.value_head.weight.device.type != "meta":
            self.reset_value_head()
        # The body's (untied) token output head is never used by the critic: dropped, so it is neither read from the
        # initial checkpoint, sharded, gathered nor saved ([V, D]: 1.2 GB in float32 for Qwen3-30B-A3B's).
        body.output = None

    @torch.no_grad()
    def reset_value_head(self) -> None:
        """A zero head (also sharded): every value starts at 0, so the first GAE is plain Monte Carlo, no random
        critic noise."""
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def layers(self) -> nn.ModuleList:
        """The transformer blocks (what ``parallelize_model`` wraps in FSDP units)."""
        return self.body.layers

    def checkpoint_blocks(self, indices: Iterable[int]) -> None:
        """Activation checkpointing of the body's blocks at ``indices`` (``Transformer.checkpoint_blocks``)."""
        self.body.checkpoint_blocks(indices)

    def tensor_parallel_plan(self, degree: int) -> dict[str, ParallelStyle]:
        """The body's per-block plan (``Transformer.tensor_parallel_plan``); the value head stays replicated."""
        return self.body.tensor_parallel_plan(degree)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        output_positions: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values ``[B, T]``, or ``[N]`` at the flat ``output_positions`` only (as ``Transformer.forward``)."""
        hidden = self.body(tokens, positions=positions, segment_ids=segment_ids, output_positions=output_positions,
                           prefix_ids=prefix_ids)  # fmt: skip
        values = self.value_head(hidden.to(self.value_head.weight.dtype))[..., 0]
        return values.float().clone()  # a fresh tensor, not a view: FSDP hooks the output for backward
