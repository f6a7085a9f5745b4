"""Torch reference for the output head's target log-probs and entropy (the parity target of the fused Pallas head)."""

from __future__ import annotations

import torch

__all__ = ["head_logprobs_reference"]


def head_logprobs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(logprobs [N], entropy [N])`` of ``softmax(hidden @ weight.T)``, materializing the ``[N, V]`` logits.

    Shapes: ``hidden [N, D]``, ``weight [V, D]``, ``targets [N]`` integer in ``[0, V)``.
    """
    logits = hidden.float() @ weight.float().T
    logp = torch.log_softmax(logits, dim=-1)
    logprobs = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy
