"""The torch <-> JAX bridge is zero-copy, and every kernel refuses a platform it cannot run on with a clear error."""

import jax.numpy as jnp
import pytest
import torch

from trainer.kernels import fused_head, gmm, splash_attention
from trainer.kernels.bridge import float_tag, jax_to_torch, torch_to_jax, tpu_backend_available

KERNEL_MODULES = [splash_attention, fused_head, gmm]
FLAGS = {
    splash_attention: 'attention = "splash"',
    fused_head: 'output_head = "fused_pallas"',
    gmm: 'moe_experts = "gmm_pallas"',
}
ALTERNATIVES = {
    splash_attention: 'attention = "sdpa"', fused_head: 'output_head = "chunked"', gmm: 'moe_experts = "grouped"'
}


def test_torch_to_jax_and_back_share_memory() -> None:
    tensor = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    array = torch_to_jax(tensor)
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    result = jnp.asarray(array) * 2
    back = jax_to_torch(result)
    assert back.data_ptr() == result.unsafe_buffer_pointer()
    torch.testing.assert_close(back, tensor * 2)


def test_torch_to_jax_detaches_and_keeps_bfloat16() -> None:
    tensor = torch.randn(4, 4, requires_grad=True).to(torch.bfloat16)
    array = torch_to_jax(tensor)
    assert array.dtype == jnp.bfloat16
    torch.testing.assert_close(jax_to_torch(array), tensor.detach())


def test_int64_is_refused_with_a_hint() -> None:
    with pytest.raises(TypeError, match="32-bit"):
        torch_to_jax(torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_cpu_and_meta_are_supported(module) -> None:
    module.check_supported("cpu")
    module.check_supported(torch.device("meta"))


@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_cuda_is_refused_naming_the_flag(module) -> None:
    with pytest.raises(ValueError, match="no path for device 'cuda'") as info:
        module.check_supported(torch.device("cuda", 0))
    assert FLAGS[module] in str(info.value) and f"set {ALTERNATIVES[module]}" in str(info.value)


@pytest.mark.skipif(tpu_backend_available(), reason="this host has a TPU backend")
@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_tpu_without_torch_tpu_is_refused(module) -> None:
    with pytest.raises(ValueError, match="torch-tpu") as info:
        module.check_supported("tpu")
    assert FLAGS[module] in str(info.value) and f"set {ALTERNATIVES[module]}" in str(info.value)


def test_float_tag_is_an_identifier() -> None:
    assert float_tag(0.125) == "0p125"
    assert float_tag(-1e-05) == "m1em05"
