"""Write safetensors files one tensor at a time, so a checkpoint never has to be whole in memory.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's dtype, shape and
byte range, then the tensors' bytes back to back. The header depends only on names, shapes and dtypes, so it is
written first, from a plan, and each tensor's bytes follow as the caller produces it (e.g. gathers it from its
shards). The files are the ones ``safetensors.torch.save_file`` writes for the same tensors, read by safetensors,
transformers and vLLM alike.

    plan = [("model.embed_tokens.weight", (V, D), torch.float32), ...]
    files = write_streamed(out_dir, plan, tensors_in_plan_order, max_file_bytes=5 * 2**30)
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from weight_sync.spec import dtype_name

__all__ = [
    "DTYPE_CODES", "INDEX_FILE", "SINGLE_FILE", "TensorEntry", "is_weights_file", "shard_file_name", "split_into_files",
    "write_streamed",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def shard_file_name(index: int, count: int) -> str:
    """The name of file ``index`` (from 0) of ``count`` that a model split into several files is written as."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def is_weights_file(name: str) -> bool:
    """Whether ``name`` is one of the weights files :func:`write_streamed` writes (the index included)."""
    return name in (SINGLE_FILE, INDEX_FILE) or bool(_SHARD_FILE.match(name))

TensorEntry = tuple[str, tuple[int, ...], torch.dtype]
"""``(name, shape, dtype)`` of one tensor of a plan."""

DTYPE_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip
"""The safetensors header code of each dtype, by torch's name for it (``torch.bfloat16`` -> ``"bfloat16"``)."""
_ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned, as safetensors itself pads it


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def split_into_files(plan: Sequence[TensorEntry], max_file_bytes: int) -> list[list[TensorEntry]]:
    """``plan`` cut in order into files of at most ``max_file_bytes`` of tensor data each (a tensor larger than
    that gets a file of its own; an empty plan gives one empty file)."""
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    files: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in plan:
        nbytes = _nbytes(entry[1], entry[2])
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def _header(entries: Sequence[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        if name in header:
            raise ValueError(f"tensor {name!r} appears twice in the plan")
        code = DTYPE_CODES.get(dtype_name(dtype))
        if code is None:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
        end = offset + _nbytes(shape, dtype)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _ALIGN)
    return len(text).to_bytes(8, "little") + text


def _write_tensor(out: BinaryIO, tensor: torch.Tensor) -> None:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    if data.numel():
        out.write(data.view(torch.uint8).numpy().data)


def write_streamed(
    out_dir: str | Path,
    plan: Sequence[TensorEntry],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_file_bytes: int = 5 * 2**30,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write the tensors of ``plan`` into ``out_dir`` as ``model.safetensors``, or, when they exceed
    ``max_file_bytes``, as ``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``; return
    the file names written.

    ``tensors`` yields ``(name, tensor)`` in plan order, each with the plan's shape and dtype, on any device; each is
    written as it comes and not kept. ``metadata`` goes into every file's header. The files appear under their names
    only once all are written (temporary names until then, removed on failure), so a reader never sees a partial
    checkpoint under a final name; ``model*.safetensors`` files of another layout already in ``out_dir`` are removed.
    Raises ``ValueError`` when a tensor differs from the plan or the plan is not
    covered, and writes nothing then.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this writer runs on little-endian hosts only")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = split_into_files(plan, max_file_bytes)
    names = [SINGLE_FILE] if len(groups) == 1 else [shard_file_name(i, len(groups)) for i in range(len(groups))]
    temps = [out / f".{name}.partial" for name in names]
    produced = iter(tensors)
    try:
        for group, temp in zip(groups, temps, strict=True):
            with open(temp, "wb") as f:
                f.write(_header(group, metadata))
                for name, shape, dtype in group:
                    got = next(produced, None)
                    if got is None:
                        raise ValueError(f"the tensors ended before {name!r} of the plan")
                    got_name, tensor = got
                    if (got_name, tuple(tensor.shape), tensor.dtype) != (name, tuple(shape), dtype):
                        raise ValueError(f"expected {name} {tuple(shape)} {dtype} next, got {got_name} "
                                         f"{tuple(tensor.shape)} {tensor.dtype}")  # fmt: skip
                    _write_tensor(f, tensor)
        extra = next(produced, None)
        if extra is not None:
            raise ValueError(f"tensor {extra[0]!r} is not in the plan")
        for temp, name in zip(temps, names, strict=True):
            os.replace(temp, out / name)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)
    for stale in out.glob("model*.safetensors"):  # an earlier export's other layout would shadow or mix with this one
        if stale.name not in names:
            stale.unlink()
    if len(groups) == 1:
        (out / INDEX_FILE).unlink(missing_ok=True)
        return names
    total = sum(_nbytes(shape, dtype) for _, shape, dtype in plan)
    weight_map = {name: file for group, file in zip(groups, names, strict=True) for name, _, _ in group}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]
