"""AdamW with decoupled weight decay on matrices only, and the warmup + constant/cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import OptimizerConfig, ScheduleConfig
from trainer.devices import has_foreach_kernels

__all__ = [
    "apply_hyperparameters", "build_optimizer", "build_scheduler", "configured_hyperparameters", "lr_multiplier",
]

_FUSED_DEVICE_TYPES = {"cpu", "cuda"}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``; weight decay on tensors with >= 2 dims only.

    ``lr`` overrides ``cfg.lr`` (the PPO critic's own rate). Works on plain and FSDP2/DTensor parameters alike.
    The fused kernel (one pass per tensor, equal to ``foreach`` up to float32 rounding) runs where torch has it for
    DTensors, CPU and CUDA; other devices use ``foreach`` where they have its kernels, else one tensor at a time.
    """
    groups: dict[tuple[bool, int], list[nn.Parameter]] = {}
    device_types = set()
    for p in model.parameters():
        if p.requires_grad:
            # One group per (decay, device mesh): foreach kernels refuse DTensors of different meshes (FSDP x TP).
            groups.setdefault((p.ndim >= 2, id(getattr(p, "device_mesh", None))), []).append(p)
            device_types.add(p.device.type)
    param_groups = [
        {"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
        for (decay, _), params in groups.items()
    ]
    fused = bool(device_types) and device_types <= _FUSED_DEVICE_TYPES
    foreach = all(has_foreach_kernels(torch.device(t)) for t in device_types)
    return torch.optim.AdamW(
        param_groups, lr=cfg.lr if lr is None else lr, betas=cfg.betas, eps=cfg.eps,
        foreach=None if fused else foreach, fused=fused or None,
    )  # fmt: skip


def lr_multiplier(step: int, cfg: ScheduleConfig) -> float:
    """Factor applied to the peak lr at optimizer step ``step`` (0-based: the lr used by the first step is step 0's).

    Warmup ramps linearly from ``1/(W+1)`` to 1 over ``W`` steps, so the first step never uses lr 0. Cosine then
    decays to ``min_lr_ratio`` at ``num_total_steps`` and stays there.
    """
    warmup = cfg.num_warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.kind == "constant":
        return 1.0
    assert cfg.num_total_steps is not None  # the config validator requires it for cosine
    progress = min(1.0, (step - warmup) / max(1, cfg.num_total_steps - warmup))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`lr_multiplier`; call ``.step()`` once after each ``optimizer.step()``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))


_HYPERPARAMETERS = ("weight_decay", "betas", "eps")
"""AdamW settings of a param group that come from the recipe (the optimizer's state dict saves them too)."""


def configured_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: object = None) -> list[dict[str, object]]:
    """Each param group's rate as configured (its schedule's base rate) and AdamW settings, read from an optimizer
    and ``LambdaLR`` built from the recipe, before a checkpoint's state is loaded into them."""
    bases = getattr(scheduler, "base_lrs", None) or [g["lr"] for g in optimizer.param_groups]
    return [{"lr": base, **{k: g[k] for k in _HYPERPARAMETERS if k in g}}
            for g, base in zip(optimizer.param_groups, bases, strict=True)]  # fmt: skip


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: object, configured: list[dict[str, object]]
) -> None:
    """Put ``configured`` (:func:`configured_hyperparameters`) back after a checkpoint's optimizer and scheduler state
    were loaded, which restore the saving run's rates and settings: a resume with a changed ``lr`` or weight decay
    trains with the recipe's, at the restored schedule's step (moments and step counts stay the checkpoint's)."""
    for group, conf in zip(optimizer.param_groups, configured, strict=True):
        group.update({k: v for k, v in conf.items() if k != "lr"})
        group["initial_lr"] = group["lr"] = conf["lr"]
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.base_lrs = [float(conf["lr"]) for conf in configured]  # type: ignore[arg-type]
        for group, base, multiplier in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                           strict=True):  # fmt: skip
            group["lr"] = base * multiplier(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
