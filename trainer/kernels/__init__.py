"""Pallas kernels behind config flags, each exposed to PyTorch as a custom op next to its torch reference.

- ``attention = "splash"``: :func:`trainer.kernels.splash_attention.splash_attention`, op
  ``rl_align::splash_attention``; reference :func:`trainer.kernels.attention_reference.attention_reference`.
- ``output_head = "fused_pallas"``: :func:`trainer.kernels.fused_head.fused_head_logprobs`, op
  ``rl_align::fused_head_logprobs``; reference :func:`trainer.kernels.head_reference.head_logprobs_reference`.
- ``moe_experts = "gmm_pallas"``: :func:`trainer.kernels.gmm.gmm`, op ``rl_align::gmm``; reference
  :func:`trainer.kernels.gmm_reference.gmm_reference`.

Each op has a ``..._backward`` twin that autograd calls. Each kernel module has ``check_supported(device)`` raising
``ValueError`` where it cannot run: CPU runs the kernels in Pallas interpret mode (exact, slow: tests and parity), TPU
hosts run them Mosaic-compiled through torch-tpu's ``torch.tpu.pallas.jax_op``, and other devices (CUDA) are refused
with the flag to change.

Each kernel module also registers its model block (the registry contract's adapter: ``splash_attention_block``,
``fused_head_block``, ``gmm_experts``) under its flag's name, with its ``check_supported``. Importing a kernel module
imports JAX, so nothing imports them up front: ``trainer.models.registry`` knows the three names and imports the
module on the first lookup, and ``build_model`` checks the model's device against them (``check_blocks_supported``).
"""
