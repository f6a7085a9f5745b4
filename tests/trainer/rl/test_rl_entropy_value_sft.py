"""Entropy from logits (against torch.distributions), the entropy bonus, the clipped value loss and the SFT loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.models.output_head import dense_token_logprobs
from trainer.rl.entropy import entropy_bonus
from trainer.rl.sft import sft_loss
from trainer.rl.value_loss import clipped_value_loss


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy the policy's output heads are checked against (``dense_token_logprobs``: logits = hidden @ I)."""
    vocab = logits.shape[-1]
    _, entropy = dense_token_logprobs(logits, torch.eye(vocab), torch.zeros(logits.shape[:-1], dtype=torch.long))
    return entropy


def test_entropy_hand_values():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3)]])
    expected = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(_entropy(logits), torch.tensor(expected))


def test_entropy_matches_torch_categorical():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 50) * 4
    reference = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(_entropy(logits), reference)


def test_entropy_bonus():
    ent = torch.tensor([[1.0, 3.0, 100.0]])
    assert entropy_bonus(ent, torch.tensor([[1, 1, 0]]), coef=0.01).item() == pytest.approx(0.02)


def test_clipped_value_loss_hand_computed():
    # token 0: V moved 1.0 -> 1.5 past the clip, clipped V 1.2 is further from R = 2: loss 0.5 * 0.64, no gradient.
    # token 1: V moved 1.0 -> 0.5, clipped V 0.8 further from R = 0: loss 0.5 * 0.64, no gradient.
    # token 2: V 1.1 within the clip: loss 0.5 * 0.81, gradient (1.1 - 2) / 3.
    # token 3: V 1.5 past the clip but closer to R = 1 unclipped: the larger (unclipped) term, gradient flows.
    values = torch.tensor([[1.5, 0.5, 1.1, 1.5]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 2.0, 1.0]])
    loss, m = clipped_value_loss(values, old, returns, torch.ones(1, 4), clip=0.2)
    assert loss.item() == pytest.approx((0.32 + 0.32 + 0.405 + 0.125) / 4)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, -0.9 / 4, 0.5 / 4]]))
    assert m["value_clip_frac"] == pytest.approx(0.5)
    assert m["value_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5) / 4)
    assert m["value_error"] == pytest.approx((0.25 + 0.25 + 0.81 + 0.25) / 4)


def test_sft_loss_hand_computed():
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    assert sft_loss(logprobs, torch.tensor([[1, 1], [1, 0]])).item() == pytest.approx(2.0)


def test_sft_loss_matches_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    targets = torch.randint(0, 11, (3, 6))
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    labels = targets.masked_fill(mask == 0, -100)
    reference = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(sft_loss(logprobs, mask), reference)
