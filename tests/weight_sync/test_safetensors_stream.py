"""The streamed safetensors writer against the safetensors library's own reader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from weight_sync.safetensors_stream import split_into_files, write_streamed


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 3, generator=g),
        "b.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(7, dtype=torch.int64),
        "d.mask": torch.tensor([True, False, True]),
        "e.empty": torch.zeros(0, 4),
        "f.scalar": torch.tensor(2.5, dtype=torch.float16),
        "g.transposed": torch.randn(3, 8, generator=g).t(),  # not contiguous: written in its logical order
    }


def _plan(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def _read_all(directory) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_one_file_reads_back_through_safetensors(tmp_path):
    tensors = _tensors()
    files = write_streamed(tmp_path, _plan(tensors), tensors.items(), metadata={"format": "pt", "policy_version": "3"})
    assert files == ["model.safetensors"]
    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "policy_version": "3"}
    assert not list(tmp_path.glob(".*partial"))


def test_files_split_at_the_size_limit_with_an_index(tmp_path):
    tensors = {f"layer{i}.w": torch.full((8, 8), float(i)) for i in range(5)}  # 256 bytes each
    tensors["big"] = torch.ones(40, 8)  # 1,280 bytes: above the limit, a file of its own
    files = write_streamed(tmp_path, _plan(tensors), tensors.items(), max_file_bytes=600)
    assert files == [*(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)), "model.safetensors.index.json"]
    assert [len(g) for g in split_into_files(_plan(tensors), 600)] == [2, 2, 1, 1]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 256 + 1280
    assert index["weight_map"]["big"] == "model-00004-of-00004.safetensors"
    back = _read_all(tmp_path)
    assert all(torch.equal(back[n], t) for n, t in tensors.items()) and back.keys() == tensors.keys()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda items: [(n, t.double()) if n == "c.ids" else (n, t) for n, t in items], "expected c.ids"),
        (lambda items: [(n, t[:2]) if n == "a.weight" else (n, t) for n, t in items], "expected a.weight"),
        (lambda items: items[:-1], "ended before 'g.transposed'"),
        (lambda items: [*items, ("z.extra", torch.ones(1))], "'z.extra' is not in the plan"),
    ],
    ids=["dtype", "shape", "too-few", "too-many"],
)
def test_a_stream_that_differs_from_the_plan_writes_nothing(tmp_path, mutate, message):
    earlier = {"old": torch.ones(2)}
    save_file(earlier, str(tmp_path / "model.safetensors"))
    tensors = _tensors()
    with pytest.raises(ValueError, match=message):
        write_streamed(tmp_path, _plan(tensors), mutate(list(tensors.items())))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no partial file, the old one intact
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["old"], earlier["old"])


def test_a_new_layout_replaces_the_old_one(tmp_path):
    tensors = {f"w{i}": torch.full((4,), float(i)) for i in range(3)}
    write_streamed(tmp_path, _plan(tensors), tensors.items(), max_file_bytes=16)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 3
    again = {n: t + 1 for n, t in tensors.items()}
    assert write_streamed(tmp_path, _plan(again), again.items()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert torch.equal(_read_all(tmp_path)["w2"], again["w2"])


def test_a_plan_naming_a_tensor_twice_is_refused(tmp_path):
    t = torch.ones(2)
    with pytest.raises(ValueError, match="twice"):
        write_streamed(tmp_path, [("w", (2,), torch.float32)] * 2, [("w", t), ("w", t)])
