"""CheckpointManager bookkeeping (keep last n, incomplete saves ignored, RNG and scheduler restored) on a plain module,
and how step metrics combine across micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.checkpoint import Checkpointable, CheckpointManager, CheckpointWriteError, TrainProgress
from trainer.metrics import MetricsAccumulator, reduction_of


def _part() -> Checkpointable:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return Checkpointable(model, opt, sched)


def _train(part: Checkpointable, steps: int) -> None:
    for _ in range(steps):
        part.model(torch.rand(4, 3)).square().sum().backward()
        part.optimizer.step()
        part.scheduler.step()
        part.optimizer.zero_grad()


def test_save_keep_and_resume(tmp_path) -> None:
    manager = CheckpointManager(tmp_path, num_keep=2)
    part = _part()
    for step in (1, 2, 3):
        _train(part, 1)
        manager.save({"policy": part}, TrainProgress(step, step + 10, {"cursor": step}))
    assert [s for s, _ in manager.checkpoints()] == [2, 3]
    (tmp_path / "step_00000009").mkdir()  # a crashed save: no COMPLETE marker
    assert manager.latest() == tmp_path / "step_00000003"

    _train(part, 2)
    expected = {n: p.detach().clone() for n, p in part.model.named_parameters()}

    resumed = _part()
    state = manager.load({"policy": resumed})
    assert state == TrainProgress(3, 13, {"cursor": 3})
    assert resumed.scheduler.last_epoch == 3
    _train(resumed, 2)  # same RNG draws and optimizer state as the uninterrupted run
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_a_resume_trains_with_the_recipes_rates_not_the_checkpoints(tmp_path) -> None:
    """A resume with a changed lr said it applied from the checkpoint on, and trained with the saved one: the
    optimizer's state dict and the scheduler's restore the saving run's rates. Weight decay alike; the schedule's
    step and AdamW's moments stay the checkpoint's."""
    manager = CheckpointManager(tmp_path, num_keep=1)
    part = _part()
    _train(part, 3)
    manager.save({"policy": part}, TrainProgress(3, 3, {}))

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.3, weight_decay=0.5)
    changed = Checkpointable(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)))
    manager.load({"policy": changed})
    assert changed.scheduler.last_epoch == 3 and changed.scheduler.base_lrs == [0.3]
    group = changed.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.3 / 4) and group["weight_decay"] == 0.5
    assert changed.scheduler.get_last_lr() == [pytest.approx(0.3 / 4)]
    assert changed.optimizer.state[model.weight]["step"] == 3  # the moments are the checkpoint's
    _train(changed, 1)
    assert changed.optimizer.param_groups[0]["lr"] == pytest.approx(0.3 / 5)


def test_a_checkpoint_the_disk_cannot_hold_says_what_is_free_and_gives_the_space_back(tmp_path, monkeypatch) -> None:
    # A full disk failed the run with "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"; DCP
    # wraps each rank's error in its CheckpointException, a BaseException, which went past every handler.
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    manager = CheckpointManager(tmp_path, num_keep=2)
    part = _part()
    manager.save({"policy": part}, TrainProgress(1, 1, {}))

    def full_disk(state, checkpoint_id, **kwargs):
        (tmp_path / "step_00000002" / "__0_0.distcp").parent.mkdir()
        (tmp_path / "step_00000002" / "__0_0.distcp").write_bytes(b"partial")
        raise CheckpointException("Failed to save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint .*step_00000002 could not be written \(OSError: .*No "
                                                   r"space left on device\)\. [0-9,.]+ MB are free under .*num_keep "
                                                   r"\+ 1 = 3 checkpoints; each checkpoint takes ~"):  # fmt: skip
        manager.save({"policy": part}, TrainProgress(2, 2, {}))
    assert not (tmp_path / "step_00000002").exists() and manager.latest() == tmp_path / "step_00000001"
    # A finished run resumed and saving its last step again: a failure must not delete the complete checkpoint.
    with pytest.raises(CheckpointWriteError):
        manager.save({"policy": part}, TrainProgress(1, 1, {}))
    assert manager.latest() == tmp_path / "step_00000001"


def test_a_checkpoint_write_failure_that_is_not_space_says_so_without_space_advice(tmp_path, monkeypatch) -> None:
    import torch.distributed.checkpoint as dcp

    def read_only(state, checkpoint_id, **kwargs):
        raise PermissionError(13, "Permission denied", checkpoint_id)

    monkeypatch.setattr(dcp, "save", read_only)
    missing = tmp_path / "not" / "made"  # a root that does not exist: free space is read on its nearest parent
    with pytest.raises(CheckpointWriteError, match="Permission denied.*: fix the cause") as raised:
        CheckpointManager(missing).save({"policy": _part()}, TrainProgress(1, 1, {}))
    assert "MB are free" not in str(raised.value)


def test_load_without_checkpoint_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        CheckpointManager(tmp_path).load({"policy": _part()})


def test_metric_reductions() -> None:
    assert [reduction_of(n) for n in ("loss", "kl_loss", "num_tokens", "ratio_max", "ratio_min", "kl")] == [
        "sum", "sum", "sum", "max", "min", "mean",
    ]  # fmt: skip
    acc = MetricsAccumulator()
    acc.add({"loss": 0.5, "kl": 1.0, "ratio_max": 1.5, "num_tokens": 3.0}, weight=3)
    acc.add({"loss": 0.25, "kl": 2.0, "ratio_max": 1.2, "num_tokens": 1.0}, weight=1)
    acc.add({"loss": 0.0, "kl": 0.0, "ratio_max": 9.0, "num_tokens": 0.0}, weight=0)  # empty micro-batch
    out = acc.reduce()
    assert out == {"loss": 0.75, "kl": pytest.approx(1.25), "ratio_max": 1.5, "num_tokens": 4.0}
