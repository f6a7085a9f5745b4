"""Pallas kernels behind config flags, each exposed to PyTorch as a custom op next to its torch reference.

| flag | kernel (this package) | torch reference | custom ops |
|---|---|---|---|
| ``attention = "splash"`` | :func:`splash_attention.splash_attention` | :func:`attention_reference.attention_reference` | ``rl_align::splash_attention`` (+ ``_backward``) |
| ``output_head = "fused_pallas"`` | :func:`fused_head.fused_head_logprobs` | :func:`head_reference.head_logprobs_reference` | ``rl_align::fused_head_logprobs`` (+ ``_backward``) |
| ``moe_experts = "gmm_pallas"`` | :func:`gmm.gmm` | :func:`gmm_reference.gmm_reference` | ``rl_align::gmm`` (+ ``_backward``) |

Each kernel module has ``check_supported(device)`` raising ``ValueError`` where it cannot run: CPU runs the kernels in
Pallas interpret mode (exact, slow: tests and parity), TPU hosts run them Mosaic-compiled through torch-tpu's
``torch.tpu.pallas.jax_op``, and other devices (CUDA) are refused with the flag to change. Importing a kernel module
imports JAX; import the modules (not this package's names) only when a flag selects them.
"""
