"""What every RL algorithm provides to the step, and what the step hands it.

An :class:`Algorithm` owns what differs between algorithms: whether a critic is trained, how advantages are computed
from the batch, and the losses. The step (``trainer.step``) owns everything else: packing, the no-grad pass that
fills ``old_logprobs`` / ``ref_logprobs`` / ``values``, backward, clipping and the optimizers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from trainer.metrics import Metrics
from trainer.rl.config import PolicyConfig
from trainer.rl.loss import compute_policy_loss

if TYPE_CHECKING:
    from rollout.types import Sample
    from trainer.packing import MicroBatch

__all__ = ["AdvantageInputs", "Algorithm"]

ConfigT = TypeVar("ConfigT", bound=PolicyConfig)


@dataclass
class AdvantageInputs:
    """What advantages are computed from, on one data-parallel rank, after the step's no-grad pass."""

    samples: Sequence[Sample]
    """The whole rollout batch, the same on every rank (rewards, group ids)."""
    micro_batches: list[MicroBatch]
    """This rank's micro-batches of every mini-batch, ``extra`` filled by the no-grad pass (``values`` when the
    algorithm has a critic): the samples that carry loss, each in exactly one micro-batch of one rank."""
    token_kl: Callable[[MicroBatch], torch.Tensor]
    """``[S, C]`` per-token KL estimate of the policy the update starts from (the sampling policy in sync mode) to the
    reference, 0 off-mask (needs the reference)."""
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    """Sums a tensor over the data-parallel ranks (in place) and returns it; every rank must call it alike."""
    device: torch.device
    """Where the micro-batches live."""
    untrained: list[MicroBatch] = field(default_factory=list)
    """This rank's micro-batches of the samples that carry no loss (``overlong_filter``), when the KL penalty is in
    the reward: they still count in their group's statistics, with their penalised reward. Read by
    :meth:`sample_sums`; their advantages are never used."""

    def sample_sums(self, per_token: Callable[[MicroBatch], torch.Tensor]) -> torch.Tensor:
        """``[len(samples)]`` float64: each sample's completion sum of ``per_token(mb)`` (``[S, C]``), from every rank
        (0 for a sample in no micro-batch: one that carries no loss, where :attr:`untrained` is not planned).

        Collective: every rank calls it (each sample lives on one rank, so the sum over ranks gathers them all).
        """
        sums = torch.zeros(len(self.samples) + 1, dtype=torch.float64, device=self.device)  # + padding rows' slot
        for mb in self.micro_batches + self.untrained:
            sums.index_add_(0, mb.sample_rows, per_token(mb).sum(dim=-1).double())
        return self.all_reduce_sum(sums[:-1].contiguous())


class Algorithm(ABC, Generic[ConfigT]):
    """One RL algorithm, built from its config by ``trainer.rl.algorithms.build_algorithm``.

    Subclasses implement :meth:`compute_advantages` (and :meth:`value_loss` when their config ``trains_critic``); the
    policy loss defaults to the clipped loss of ``trainer.rl.loss`` (with KL, entropy and IS terms as the config says).
    """

    def __init__(self, config: ConfigT) -> None:
        self.config = config

    @property
    def needs_critic(self) -> bool:
        """Whether the train state (``trainer.state``) builds a critic and the step trains it with :meth:`value_loss`
        (the config's ``trains_critic``)."""
        return self.config.trains_critic

    @property
    def needs_reference(self) -> bool:
        """Whether the train state loads a frozen reference model (the KL penalty is on)."""
        return self.config.kl.needs_reference

    @abstractmethod
    def compute_advantages(self, inputs: AdvantageInputs) -> None:
        """Set ``mb.advantages`` ``[S, C]`` (0 off-mask) of every micro-batch, and ``mb.extra['returns']`` when the
        algorithm has a critic. Collective: every rank calls it. The step runs it without gradients."""

    def policy_loss(
        self, mb: MicroBatch, logprobs: torch.Tensor, entropies: torch.Tensor, num_tokens: float, num_seqs: float
    ) -> tuple[torch.Tensor, Metrics]:
        """This micro-batch's share of the policy loss and its metrics (``trainer.rl.loss.compute_policy_loss``).

        logprobs, entropies: ``[S, C]`` from the policy (carry the gradient); num_tokens, num_seqs: the optimizer
        batch's global counts (an episode of several samples counts once: ``trainer.rl.aggregation``).
        """
        return compute_policy_loss(
            logprobs, mb.advantages, mb.loss_mask, self.config,
            old_logprobs=mb.extra.get("old_logprobs"), ref_logprobs=mb.extra.get("ref_logprobs"),
            rollout_logprobs=mb.rollout_logprobs, entropies=entropies, num_tokens=num_tokens, num_seqs=num_seqs,
            seq_tokens=mb.sequence_tokens,
        )  # fmt: skip

    def value_loss(
        self, mb: MicroBatch, values: torch.Tensor, num_tokens: float, num_seqs: float
    ) -> tuple[torch.Tensor, Metrics]:
        """This micro-batch's share of the critic loss (``values`` ``[S, C]`` carry the gradient) and its metrics;
        only algorithms with :attr:`needs_critic`."""
        raise NotImplementedError(f"{type(self).__name__} trains no critic")
