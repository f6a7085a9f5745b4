"""What differs between the devices a trainer rank runs on, in one place: waiting for queued work, and which tensor
kernels a device has.

Devices: ``cpu`` (ops finish when called), ``cuda`` and ``tpu`` (torch-tpu's native device: eager ops queued on a
stream), and ``xla`` (torch_xla's lazy tensors: ops are recorded into a graph that runs, compiled, when something
needs its values or the graph is cut; :func:`synchronize` cuts it and waits).
"""

from __future__ import annotations

import torch

__all__ = ["has_foreach_kernels", "mesh_device_type", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (on ``xla``: run the graph recorded so far, then wait)."""
    if device.type == "cpu":
        return
    if device.type == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()
        return
    torch.accelerator.synchronize()


def has_foreach_kernels(device: torch.device) -> bool:
    """Whether torch's multi-tensor (``foreach``) kernels run on ``device``; torch_xla has none."""
    return device.type != "xla"


def mesh_device_type(device: torch.device) -> str:
    """The device type of the rank's device mesh: its own, except on ``xla``, whose single rank is coordinated by the
    host's gloo group (torch's meshes know no XLA device)."""
    return "cpu" if device.type == "xla" else device.type
