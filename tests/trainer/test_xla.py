"""The trainer on torch_xla's device (``trainer.device = "xla"``, PJRT's CPU device here): one GRPO step equals the
same step on the CPU (loss, gradient norm, every updated weight) for a dense and an MoE model, and a run of steps on
batches of changing lengths compiles its graphs in its first steps, then rarely.

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

    # Rows as long as the budget on both devices (XLA otherwise packs short rows, for its masked attention): the same
    # micro-batches, so that the MoE load-balancing term, a function of each micro-batch's routing, is the same too.
    cfg = TrainerConfig(device=device.type, optimizer={"lr": LR}, micro_batch_tokens=64, pack_row_tokens=64)
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


def test_a_run_of_changing_batches_compiles_in_a_handful_of_steps():
    """Static shapes (``trainer.packing``): 20 steps of batches whose lengths change every step compile in the first
    step and afterwards only when a dimension crosses a power of two; without them every micro-batch shape compiled
    its graphs anew (tens of graphs and ~35 s per step on 2 cores)."""
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg = TrainerConfig(device="xla", optimizer={"lr": 1e-3}, micro_batch_tokens=128)
    state = build_train_state(cfg, DENSE, GRPOConfig(group_size=4, kl=KLConfig(coef=0.1)), XLA, build_mesh(cfg, "cpu"))
    compiled = []
    for step in range(20):
        batch = RolloutBatch(random_samples(step, num_groups=4, group_size=4, completion_len=(1, 40)))
        compiled.append(int(rl_step(state, batch)["compiled_graphs"]))
    print("graphs compiled per step:", compiled)
    # (The first step's count depends on what the module's earlier tests compiled: the cache is per process.)
    assert sum(1 for n in compiled[1:] if n) <= 5, compiled
    assert sum(compiled[10:]) <= 2, compiled


def test_a_checkpoint_and_an_export_from_xla_resume_and_load_as_on_cpu(tmp_path):
    """A full-state checkpoint written from the XLA device resumes into a fresh XLA state (the next step then equals
    the uninterrupted run's), and the HF export holds the device's weights."""
    from safetensors.torch import load_file

    from trainer.checkpoint import CheckpointManager, TrainProgress
    from trainer.models.hf_io import save_hf_checkpoint
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import rl_step

    cfg = TrainerConfig(device="xla", optimizer={"lr": LR}, micro_batch_tokens=64)
    algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.1))

    def state():
        return build_train_state(cfg, DENSE, algo, XLA, build_mesh(cfg, "cpu"))

    def batch(seed):
        return RolloutBatch(random_samples(seed, num_groups=2, group_size=4))

    first, manager = state(), CheckpointManager(tmp_path / "ckpt")
    rl_step(first, batch(0))
    manager.save(first.checkpointables(), TrainProgress(first.step, first.policy_version, {}))
    files = save_hf_checkpoint(first.policy, str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / files[0]))
    weights = first.policy.state_dict()
    wq = weights["layers.0.attention.wq.weight"].cpu()
    assert torch.equal(exported["model.layers.0.self_attn.q_proj.weight"], wq)
    uninterrupted = rl_step(first, batch(1))
    resumed = state()
    manager.load(resumed.checkpointables())
    again = rl_step(resumed, batch(1))
    assert again["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-6, abs=1e-9)
    assert again["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], rel=1e-6)
    for (name, a), b in zip(first.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True):
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=0, atol=0, msg=name)


_SPMD_STEP = """
import sys, torch, torch.distributed as dist
sys.path[:0] = [{tests!r}]
from common.net import free_port
from trainer.devices import enable_spmd
enable_spmd(4)  # before any XLA tensor
import torch_xla
from trainer_batches import random_samples
from rollout.types import RolloutBatch
from trainer.config import TrainerConfig
from trainer.models.config import ModelConfig
from trainer.parallelize import build_mesh
from trainer.rl.config import GRPOConfig, KLConfig
from trainer.state import build_train_state
from trainer.step import rl_step
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
model = ModelConfig.model_validate_json({model!r})
out = {{}}
for name, device, spmd in (("cpu", torch.device("cpu"), 1), ("xla", torch_xla.device(), 4)):
    cfg = TrainerConfig(device=device.type, optimizer={{"lr": {lr}}}, micro_batch_tokens=64, pack_row_tokens=16,
                        parallelism={{"spmd_data_parallel": spmd}})
    algo = GRPOConfig(group_size=4, kl=KLConfig(coef=0.1))
    state = build_train_state(cfg, model, algo, device, build_mesh(cfg, "cpu"))
    samples = random_samples(0, num_groups=2, group_size=4)
    metrics = rl_step(state, RolloutBatch(samples))
    out[name] = (metrics, {{k: v.detach().cpu() for k, v in state.policy.state_dict().items()}})
from trainer.step import plan_rank_micro_batches
mbs = plan_rank_micro_batches(state, samples, range(len(samples)))
out["row_shardings"] = [torch_xla._XLAC._get_xla_sharding_spec(mb.tokens) for mb in mbs]
torch.save(out, {path!r})
"""


def test_spmd_over_four_devices_equals_the_step_on_cpu(tmp_path):
    """``parallelism.spmd_data_parallel = 4`` on PJRT's CPU device with 4 virtual devices (``CPU_NUM_DEVICES``): the
    rows of each micro-batch split over the devices, the step equals the CPU's. SPMD must be on before the process
    makes any XLA tensor, so this runs in a process of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    script = _SPMD_STEP.format(tests=tests, model=DENSE.model_dump_json(), lr=LR, path=str(tmp_path / "out.pt"))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    (cpu_metrics, cpu_weights), (xla_metrics, xla_weights) = out["cpu"], out["xla"]
    # Every micro-batch's rows are split over the 4 devices (HLO sharding {devices=[4,1]...}), not replicated.
    assert out["row_shardings"] and all("devices=[4,1]" in spec for spec in out["row_shardings"]), out["row_shardings"]
    assert xla_metrics["loss"] == pytest.approx(cpu_metrics["loss"], rel=1e-4, abs=1e-7)
    assert xla_metrics["grad_norm"] == pytest.approx(cpu_metrics["grad_norm"], rel=1e-5)
    for name, weight in cpu_weights.items():
        torch.testing.assert_close(xla_weights[name], weight, rtol=0, atol=LR / 100, msg=name)


def test_the_recipe_check_refuses_what_xla_does_not_run():
    with pytest.raises(ValueError, match="device 'xla' runs one trainer rank"):
        TrainerConfig(device="xla", num_ranks=2, parallelism={"fsdp": True})
    for device, spmd in (("cpu", 2), ("xla", 3)):
        with pytest.raises(ValueError, match="spmd_data_parallel = .* needs device 'xla' .* and a power of two"):
            TrainerConfig(device=device, parallelism={"spmd_data_parallel": spmd})
    with pytest.raises(ValueError, match="not supported on device 'xla'"):
        TrainerConfig(device="xla", mixed_precision={"param_dtype": "bfloat16"})
