"""On a TPU host (torch-tpu installed, ``torch.device("tpu")`` present): each op runs Mosaic-compiled through
``torch.tpu.pallas.jax_op`` and matches its torch reference, forward and backward. Run with ``-m tpu``."""

import pytest
import torch

from trainer.kernels.attention_reference import attention_reference
from trainer.kernels.bridge import tpu_backend_available
from trainer.kernels.fused_head import fused_head_logprobs
from trainer.kernels.gmm import gmm
from trainer.kernels.gmm_reference import gmm_reference
from trainer.kernels.head_reference import head_logprobs_reference
from trainer.kernels.splash_attention import splash_attention

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(not tpu_backend_available(), reason="needs torch-tpu and a TPU device"),
]

# Mosaic runs fp32 matmuls in multi-pass bf16 by default: tolerances are looser than interpret mode's.
ATOL, RTOL = 2e-3, 2e-3


def _check(fn, ref_fn, inputs: list[torch.Tensor], num_diff: int) -> None:
    cpu = [t.detach().clone().requires_grad_(i < num_diff) for i, t in enumerate(inputs)]
    tpu = [t.detach().to("tpu").requires_grad_(i < num_diff) for i, t in enumerate(inputs)]
    out, ref = fn(*tpu), ref_fn(*cpu)
    out, ref = (out,) if torch.is_tensor(out) else out, (ref,) if torch.is_tensor(ref) else ref
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.cpu(), r, atol=ATOL, rtol=RTOL)
    sum(o.float().sum() for o in out).backward()
    sum(r.float().sum() for r in ref).backward()
    for t, c in zip(tpu[:num_diff], cpu[:num_diff]):
        torch.testing.assert_close(t.grad.cpu(), c.grad, atol=ATOL, rtol=RTOL)


def test_splash_attention_on_tpu() -> None:
    q, k, v = torch.randn(2, 8, 512, 128), torch.randn(2, 2, 512, 128), torch.randn(2, 2, 512, 128)
    segments = torch.cat([torch.zeros(2, 300), torch.ones(2, 212)], dim=1).int()
    _check(
        lambda q, k, v, s: splash_attention(q, k, v, s, 128**-0.5),
        lambda q, k, v, s: attention_reference(q, k, v, s, 128**-0.5),
        [q, k, v, segments],
        num_diff=3,
    )


def test_fused_head_on_tpu() -> None:
    hidden, weight = torch.randn(512, 256), 0.1 * torch.randn(32_000, 256)
    targets = torch.randint(0, 32_000, (512,), dtype=torch.int32)
    _check(fused_head_logprobs, head_logprobs_reference, [hidden, weight, targets], num_diff=2)


def test_gmm_on_tpu() -> None:
    x, w = torch.randn(1024, 256), 0.1 * torch.randn(4, 256, 512)
    group_sizes = torch.tensor([300, 0, 500, 224], dtype=torch.int32)
    _check(gmm, gmm_reference, [x, w, group_sizes], num_diff=2)
