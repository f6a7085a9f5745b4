"""``trainer.host_memory``: freed host memory goes back to the system (the resident set falls), only when the allocator
holds at least the asked amount, and a CPU trainer asks as the backward reaches the first block and after each
optimizer step, with its numerics unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawn_helpers import full_weights
from trainer_batches import random_samples

from rollout.types import RolloutBatch
from trainer.config import TrainerConfig
from trainer.host_memory import RELEASE_MIN_FREE_BYTES, free_held_bytes, release_freed_memory
from trainer.models.config import ModelConfig
from trainer.rl.config import PPOConfig

REPO = Path(__file__).resolve().parents[2]
MODEL = ModelConfig(
    family="qwen3", vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=64,
    qk_norm=True, output_chunk_size=16,
)  # fmt: skip

# In a fresh process: 64 KiB tensors come from the heap (below glibc's mmap threshold); every 8th stays alive, so the
# freed ones are holes that glibc's own trimming (the top of the heap only) cannot return.
_HOLES = """
import sys
import torch
from trainer.host_memory import free_held_bytes, release_freed_memory
MIN_FREE = int(sys.argv[1])
def rss_bytes():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
chunks = [torch.ones(16384) for _ in range(4096)]  # 256 MiB
kept = chunks[::8]
del chunks
before = rss_bytes()
released = release_freed_memory(MIN_FREE)
print(released, before, rss_bytes(), free_held_bytes())
"""


def _release_holes(min_free_bytes: int) -> tuple[bool, int, int, str]:
    """In a fresh process holding 224 MiB of freed heap holes: (released, resident bytes before, after, what
    ``free_held_bytes`` said after)."""
    out = subprocess.run([sys.executable, "-c", _HOLES, str(min_free_bytes)], capture_output=True, text=True,
                         check=True, cwd=REPO)  # fmt: skip
    released, before, after, held = out.stdout.split()
    return released == "True", int(before), int(after), held


def test_freed_heap_memory_leaves_the_resident_set() -> None:
    if not release_freed_memory():
        pytest.skip("the C library has no malloc_trim")
    released, before, after, _ = _release_holes(0)
    assert released
    assert before - after > 150 * 2**20, (before, after)  # of the 224 MiB freed


def test_a_release_waits_until_the_allocator_holds_enough_freed_memory() -> None:
    if not release_freed_memory() or free_held_bytes() is None:
        pytest.skip("the C library has no malloc_trim or mallinfo2")
    released, before, after, _ = _release_holes(1 << 30)  # more than the 224 MiB freed: kept for reuse
    assert not released
    assert abs(before - after) < 16 * 2**20, (before, after)
    released, before, after, _ = _release_holes(128 << 20)
    assert released
    assert before - after > 150 * 2**20, (before, after)


def test_free_held_bytes_counts_what_the_allocator_keeps() -> None:
    if free_held_bytes() is None:
        pytest.skip("the C library has no mallinfo2")
    released, _, _, reported = _release_holes(1 << 40)  # nothing released: the holes are still held
    assert not released
    held = int(reported)
    assert 200 * 2**20 < held < 1 << 30, held  # the 224 MiB of holes (and what the interpreter freed)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("release", [True, False])
def test_a_cpu_trainer_releases_in_backward_and_after_the_optimizer_step(monkeypatch, release: bool) -> None:
    """PPO (a policy and a critic, each with its optimizer): a release (of at least ``RELEASE_MIN_FREE_BYTES``) as each
    trained model's backward enters its first block and after each optimizer step; none when turned off; the same
    update either way."""
    import trainer.host_memory
    import trainer.step
    from trainer.parallelize import build_mesh
    from trainer.state import build_train_state
    from trainer.step import plan_rank_micro_batches, rl_step

    calls = []

    def counted(min_free_bytes: int = 0) -> bool:
        calls.append(min_free_bytes)
        return release_freed_memory(min_free_bytes)

    monkeypatch.setattr(trainer.host_memory, "release_freed_memory", counted)
    monkeypatch.setattr(trainer.step, "release_freed_memory", counted)

    samples = random_samples(0, num_groups=2, group_size=2)
    micro_batches = []

    def update(release_freed: bool | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        cfg = TrainerConfig(optimizer={"lr": 1e-3}, micro_batch_tokens=48, release_freed_memory=release_freed)
        state = build_train_state(cfg, MODEL, PPOConfig(), torch.device("cpu"), build_mesh(cfg, "cpu"))
        micro_batches[:] = plan_rank_micro_batches(state, samples, range(len(samples)))
        return rl_step(state, RolloutBatch(samples)), full_weights(state.policy)

    got, weights = update(None if release else False)  # None: on, the trainer is on the CPU
    # Each micro-batch through the policy's backward and the critic's; each model's optimizer step.
    assert len(micro_batches) > 1
    assert calls == ([RELEASE_MIN_FREE_BYTES] * (2 * len(micro_batches) + 2) if release else [])
    calls.clear()
    reference, reference_weights = update(not release)
    assert got["loss"] == reference["loss"] and got["grad_norm"] == reference["grad_norm"]
    for name, w in weights.items():
        torch.testing.assert_close(w, reference_weights[name], rtol=0, atol=0, msg=name)


def test_on_by_default_on_the_cpu_only() -> None:
    assert TrainerConfig().releases_freed_memory
    assert not TrainerConfig(release_freed_memory=False).releases_freed_memory
    assert not TrainerConfig(device="cuda").releases_freed_memory
