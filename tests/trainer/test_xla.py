"""The trainer on torch_xla's device (``trainer.device = "xla"``, PJRT's CPU device here): one GRPO step equals the
same step on the CPU (loss, gradient norm, every updated weight) for a dense and an MoE model.

torch_xla 2.9 needs torch 2.9, so these run in their own environment: ``make test-xla`` (``make xla-env`` builds it);
elsewhere they are skipped. XLA compiles a graph per new shape, so each step here takes tens of seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from trainer_batches import random_samples

torch_xla = pytest.importorskip("torch_xla")

from rollout.types import RolloutBatch  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.models.config import ModelConfig, MoEConfig  # noqa: E402
from trainer.rl.config import GRPOConfig, KLConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_rank_group")

# Before any backward: torch's autograd engine sizes its per-device queues at its first backward, so an XLA device
# that appears later fails an internal assert (a trainer rank takes its device at setup, so it never meets this).
XLA = torch_xla.device()
LR = 1e-2

DENSE = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, tie_embeddings=False, output_chunk_size=16,
)  # fmt: skip
MOE = DENSE.model_copy(update={
    "family": "qwen3_moe", "moe": MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_dim=32, aux_loss_coef=0.01),
})  # fmt: skip


def _step(model: ModelConfig, device: torch.device) -> tuple[dict[str, float], dict[str, torch.Tensor], dict]:
    """The step's metrics, and the policy's weights (on the CPU) before and after it."""
    from trainer.devices import mesh_device_type
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg = TrainerConfig(device=device.type, optimizer={"lr": LR}, micro_batch_tokens=64)
    algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.1))
    state = build_train_state(cfg, model, algo, device, build_mesh(cfg, mesh_device_type(device)))
    before = {k: v.detach().cpu().clone() for k, v in state.policy.state_dict().items()}
    metrics = rl_step(state, RolloutBatch(random_samples(0, num_groups=2, group_size=4)))
    return metrics, before, {k: v.detach().cpu() for k, v in state.policy.state_dict().items()}


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_a_grpo_step_on_xla_equals_the_step_on_cpu(model):
    cpu_metrics, before, cpu_weights = _step(model, torch.device("cpu"))
    xla_metrics, xla_before, xla_weights = _step(model, XLA)
    assert xla_metrics["loss"] == pytest.approx(cpu_metrics["loss"], rel=1e-4, abs=1e-7)
    assert xla_metrics["grad_norm"] == pytest.approx(cpu_metrics["grad_norm"], rel=1e-5)
    assert xla_metrics["kl"] == pytest.approx(cpu_metrics["kl"], abs=1e-7)
    assert xla_weights.keys() == cpu_weights.keys()
    for name, weight in cpu_weights.items():
        torch.testing.assert_close(xla_before[name], before[name], rtol=0, atol=0, msg=name)
        # AdamW's first step moves each weight by ~lr * g / (|g| + eps): a gradient near 0 turns float32 rounding of
        # g into up to ~1% of lr (4.6e-5 measured at lr 1e-2), while a sign or scale error would be ~lr.
        torch.testing.assert_close(xla_weights[name], weight, rtol=0, atol=LR / 100, msg=name)
    moved = sum(not torch.equal(before[n], w) for n, w in cpu_weights.items())
    assert moved > len(cpu_weights) // 2  # the step changed the weights it compares


def test_the_recipe_check_refuses_what_xla_does_not_run():
    with pytest.raises(ValueError, match="device 'xla' runs one trainer rank"):
        TrainerConfig(device="xla", num_ranks=2, parallelism={"fsdp": True})
    with pytest.raises(ValueError, match="not supported on device 'xla'"):
        TrainerConfig(device="xla", mixed_precision={"param_dtype": "bfloat16"})
