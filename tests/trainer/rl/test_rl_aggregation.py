"""aggregate(): the three reduction modes on hand-computed cases, and exact splitting across micro-batches."""

import pytest
import torch

from trainer.rl.aggregation import aggregate, masked_mean

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is padding


def test_token_mean():
    assert aggregate(X, MASK, "token_mean").item() == pytest.approx((1 + 2 + 4) / 3)


def test_seq_mean_token_mean_ignores_padding_rows():
    assert aggregate(X, MASK, "seq_mean_token_mean").item() == pytest.approx(((1 + 2) / 2 + 4 / 1) / 2)


def test_token_sum_norm_divides_by_sequences_times_constant():
    assert aggregate(X, MASK, "token_sum_norm", norm_length=4).item() == pytest.approx(7 / (2 * 4))
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(X, MASK, "token_sum_norm")


def test_bool_mask_and_unknown_mode():
    assert aggregate(X, MASK.bool(), "token_mean").item() == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(X, MASK, "sum")


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(X, torch.zeros_like(X)).item() == 0.0


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_micro_batches_with_global_counts_sum_to_the_full_batch(mode):
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).int()
    mask[:, 0] = 1
    full = aggregate(x, mask, mode, norm_length=5)
    counts = dict(norm_length=5, num_tokens=float(mask.sum()), num_seqs=6.0)
    parts = aggregate(x[:2], mask[:2], mode, **counts) + aggregate(x[2:], mask[2:], mode, **counts)
    torch.testing.assert_close(parts, full)


def test_rows_of_one_episode_make_one_sequence_mean():
    """Rows 0 and 1 are one episode (5 tokens), row 2 another (2 tokens): the per-sequence mean is the mean of the two
    episodes' token means; padding rows (count 0, empty mask) add nothing."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 8.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
    seq_tokens = torch.tensor([5.0, 5.0, 2.0, 0.0])
    out = aggregate(x, mask, "seq_mean_token_mean", num_seqs=2, seq_tokens=seq_tokens)
    assert out.item() == pytest.approx((15 / 5 + 14 / 2) / 2)
    # Without the episode counts every row is a sequence of its own.
    assert aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx((6 / 3 + 9 / 2 + 14 / 2) / 3)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_a_mini_batch_without_model_tokens_has_a_zero_loss(mode):
    """Agent episodes that made no call are samples without model tokens; a mini-batch of only those got global
    normalisers of 0 and a NaN loss (0 / 0)."""
    x = X.clone().requires_grad_()
    empty = torch.zeros_like(MASK)
    loss = aggregate(x, empty, mode, norm_length=4, num_tokens=0.0, num_seqs=0.0)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(X))
