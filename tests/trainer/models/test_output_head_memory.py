"""The chunked output head never holds the [tokens, vocab] logits: its peak extra memory, measured, stays small.

Peak is measured from the allocator events torch.profiler records (``profile_memory=True``): every allocation and
free in forward and backward, replayed in time order. The dense head is measured the same way as a control, so the
measurement is shown to see a full-logits-sized allocation when there is one.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.models.output_head import chunked_token_logprobs, dense_token_logprobs

NUM_TOKENS, VOCAB, DIM, CHUNK = 1024, 32768, 16, 64


def _peak_extra_bytes(fn) -> int:
    """Highest sum of live bytes allocated inside ``fn`` (allocations made before it do not count)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _fwd_bwd(head):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(NUM_TOKENS, DIM, generator=g).requires_grad_()
    weight = (torch.randn(VOCAB, DIM, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=g)

    def run():
        logprobs, entropy = head(hidden, weight, targets, chunk_size=CHUNK)
        (logprobs.sum() + entropy.sum()).backward()

    return run, weight


def test_chunked_head_peak_memory_is_below_a_quarter_of_full_logits():
    full_logits_bytes = NUM_TOKENS * VOCAB * 4
    run, weight = _fwd_bwd(chunked_token_logprobs)
    chunked_peak = _peak_extra_bytes(run)
    assert weight.grad is not None  # backward ran inside the measured region
    run_dense, _ = _fwd_bwd(dense_token_logprobs)
    dense_peak = _peak_extra_bytes(run_dense)
    ratio = chunked_peak / full_logits_bytes
    print(f"full logits {full_logits_bytes / 2**20:.0f} MiB; peak extra: dense {dense_peak / 2**20:.0f} MiB, "
          f"chunked {chunked_peak / 2**20:.1f} MiB (ratio {ratio:.3f})")  # fmt: skip
    assert dense_peak >= 2 * full_logits_bytes  # the measurement sees the dense head's logits and log-probs
    assert chunked_peak >= VOCAB * DIM * 4  # ... and sees the chunked head's weight gradient
    assert ratio < 0.25
