"""What differs between the devices a trainer rank runs on, in one place: waiting for queued work, and which tensor
kernels a device has.

Devices: ``cpu`` (ops finish when called), ``cuda`` and ``tpu`` (torch-tpu's native device: eager ops queued on a
stream), and ``xla`` (torch_xla's lazy tensors: ops are recorded into a graph that runs, compiled, when something
needs its values or the graph is cut; :func:`synchronize` cuts it and waits).
"""

from __future__ import annotations

import torch

__all__ = [
    "compiled_graphs", "cut_graph", "data_parallel_devices", "enable_spmd", "has_foreach_kernels", "host_copies",
    "mesh_device_type", "needs_static_shapes", "shard_rows", "synchronize",
]  # fmt: skip


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


def needs_static_shapes(device: torch.device) -> bool:
    """Whether ``device`` compiles a graph per tensor shape, so that batches must come in a few fixed shapes
    (``trainer.packing``'s ``static_shapes``): ``xla``."""
    return device.type == "xla"


def cut_graph(device: torch.device) -> None:
    """End the graph recorded so far on ``xla`` and start running it (not waiting), so that every micro-batch and
    optimizer step is a graph of its own, compiled once per shape, instead of being fused with whatever comes
    before or after it (a graph that changes with the number of micro-batches). A no-op elsewhere."""
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def compiled_graphs(device: torch.device) -> int | None:
    """How many graphs this process has compiled for ``device`` so far (``xla``); ``None`` where nothing compiles
    per shape."""
    if device.type != "xla":
        return None
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` readable on the host, for export: on ``xla`` CPU copies of all of them, their graph run once and
    the results fetched in one batch (torch_xla's own bulk transfer, which ``xm.save`` uses) instead of a graph and a
    transfer per tensor; elsewhere the tensors themselves (CPU tensors are already there, and the weight sender and
    safetensors copy CUDA / TPU tensors chunk by chunk)."""
    if not any(t.device.type == "xla" for t in tensors):
        return tensors
    import torch_xla.core.xla_model as xm

    return list(xm._maybe_convert_to_cpu(list(tensors)))


def enable_spmd(num_devices: int) -> None:
    """Drive ``num_devices`` XLA devices from this process through torch_xla's SPMD partitioner (``num_devices`` > 1;
    1 leaves SPMD off). Must run before the process creates any XLA tensor; raises ``ValueError`` when the runtime has
    another number of devices."""
    if num_devices == 1:
        return
    import torch_xla.runtime as xr

    xr.use_spmd()
    found = xr.global_runtime_device_count()
    if found != num_devices:
        raise ValueError(
            f"parallelism.spmd_data_parallel = {num_devices}, but the XLA runtime has {found} device(s) "
            "(a TPU host's chips; CPU_NUM_DEVICES on PJRT's CPU device): set it to the device count"
        )


def data_parallel_devices(device: torch.device) -> int:
    """How many devices the rank's batch rows are split over: the SPMD device count on ``xla`` with SPMD on, else 1."""
    if device.type != "xla":
        return 1
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count() if xr.is_spmd() else 1


def shard_rows(tensors: list[torch.Tensor]) -> None:
    """Under SPMD, mark ``tensors`` (``[R, ...]``, ``R`` a multiple of the device count) as split by rows over all the
    devices: the data-parallel layout the partitioner then carries through the step. A no-op without SPMD."""
    if not tensors or data_parallel_devices(tensors[0].device) == 1:
        return
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    for t in tensors:
        xs.mark_sharding(t, mesh, ("data",) + (None,) * (t.dim() - 1))
