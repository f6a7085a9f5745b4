"""`python -m weight_sync serve --adapter_of BASE` as a real subprocess keeps pushed LoRA adapters as a PEFT adapter
directory that PEFT loads; adapters for another base are refused with the directory untouched; a restart resumes
the version; a subset of a served adapter updates just those tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
import torch
from safetensors.torch import load_file

from protos import weight_sync_pb2 as pb
from tests.trainer.models.tiny_hf import save_hf_model
from weight_sync.__main__ import main
from weight_sync.channel import WeightSyncClient
from weight_sync.checkpoint import read_checkpoint_manifest
from weight_sync.config import WeightSyncConfig
from weight_sync.conformance import run_conformance
from weight_sync.peft import AdapterSpec, adapter_manifest, read_adapter_version, write_peft_adapter
from weight_sync.sink import PeftAdapterDirSink
from weight_sync.version import protocol_version

peft = pytest.importorskip("peft")

SPEC = AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
FLAGS = ["--rank", "4", "--alpha", "8", "--target_modules", "q_proj", "v_proj", "down_proj"]


def _adapter(base_dir, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    specs = adapter_manifest(read_checkpoint_manifest(base_dir), SPEC)
    return {s.name: torch.randn(s.shape, generator=gen) * 0.2 for s in specs}


def _serve(served, base, flags=FLAGS):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weight_sync", "serve", "--dir", str(served), "--adapter_of", str(base), "--port", "0",
         *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    line = proc.stdout.readline()
    assert line.startswith("serving"), proc.stderr.read() if proc.poll() is not None else line
    return proc, line.split()[-1]


def test_served_adapters_load_in_peft_and_other_bases_are_refused(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    base, other = tmp_path / "base", tmp_path / "other"
    save_hf_model("qwen3_tied", base)
    save_hf_model("llama3_scaled", other)
    source, wrong, served = tmp_path / "source", tmp_path / "wrong", tmp_path / "served"
    tensors = _adapter(str(base), seed=1)
    write_peft_adapter(source, tensors, SPEC, str(base))
    write_peft_adapter(wrong, _adapter(str(other), seed=2), SPEC, str(other))
    proc, address = _serve(served, base)
    try:
        assert main(["push", "--checkpoint", str(source), "--to", address, "--version", "3"]) == 0
        before = (served / "adapter_model.safetensors").read_bytes()
        assert main(["push", "--checkpoint", str(wrong), "--to", address, "--version", "4", "--num_retries", "0"]) == 2
        error = capsys.readouterr().err
        # Said once, the receiver's shape beside the pushed one (the dtype they share not repeated).
        assert "(it holds it as (" in error and "float32 (it" in error and error.count("float32") == 1, error
        assert "is it serving the same model (for adapters: the same rank and targets)?" in error
        assert (served / "adapter_model.safetensors").read_bytes() == before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert read_adapter_version(served) == 3
    got = load_file(str(served / "adapter_model.safetensors"))
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(served)).eval()
    expected = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(source)).eval()
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, expected(input_ids=tokens).logits)
        with model.disable_adapter():
            assert (model(input_ids=tokens).logits - expected(input_ids=tokens).logits).abs().max() > 1e-3


def test_a_restarted_sink_resumes_its_version_and_merges_subsets(tmp_path):
    base = tmp_path / "base"
    save_hf_model("qwen3_tied", base)
    sink = PeftAdapterDirSink(str(tmp_path / "served"), str(base), SPEC)
    tensors = _adapter(str(base), seed=3)
    name = next(iter(tensors))
    with pytest.raises(ValueError, match="push a complete adapter first"):
        sink.apply(1, {name: tensors[name]})
    assert sink.committed_version() == 0
    sink.apply(1, tensors)
    restarted = PeftAdapterDirSink(str(tmp_path / "served"), str(base), SPEC)
    assert restarted.committed_version() == 1
    restarted.apply(2, {name: torch.zeros_like(tensors[name])})
    got = load_file(str(tmp_path / "served" / "adapter_model.safetensors"))
    assert torch.equal(got[name], torch.zeros_like(tensors[name]))
    assert all(torch.equal(got[k], v) for k, v in tensors.items() if k != name)
    with pytest.raises(ValueError, match="rank/alpha/targets"):
        PeftAdapterDirSink(str(tmp_path / "served"), str(base), AdapterSpec(rank=8))


def test_expert_adapters_of_a_moe_base_are_kept_as_peft_loads_them(tmp_path):
    """PEFT ``target_parameters`` adapters (one per expert) over a Qwen3-MoE base: the sink's manifest, the directory
    PEFT loads, and a restart that asks for other targets refused."""
    from transformers import AutoModelForCausalLM

    from weight_sync.peft import EXPERT_TARGETS

    base = tmp_path / "base"
    save_hf_model("qwen3_moe", base)
    spec = AdapterSpec(rank=2, alpha=4.0, target_modules=("q_proj",), target_parameters=EXPERT_TARGETS)
    sink = PeftAdapterDirSink(str(tmp_path / "served"), str(base), spec)
    gen = torch.Generator().manual_seed(5)
    tensors = {s.name: torch.randn(s.shape, generator=gen) * 0.2 for s in sink.manifest()}
    assert any(".mlp.experts.base_layer.lora_B." in n for n in tensors)
    sink.apply(1, tensors)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "served"))
    assert {n for n, _ in model.named_parameters() if "lora_" in n and ".experts." in n}
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(input_ids=tokens).logits
        with model.disable_adapter():
            assert (adapted - model(input_ids=tokens).logits).abs().max() > 1e-3
    write_peft_adapter(tmp_path / "source", tensors, spec, str(base))
    expected = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "source"))
    with torch.no_grad():
        assert torch.equal(adapted, expected(input_ids=tokens).logits)
    with pytest.raises(ValueError, match="target_parameters"):
        PeftAdapterDirSink(str(tmp_path / "served"), str(base), spec.model_copy(update={"target_parameters": ()}))


def test_an_adapter_sink_needs_the_runs_alpha_unless_its_directory_holds_an_adapter(tmp_path, capsys):
    """Pushes carry the tensors, which show the rank but not alpha: a sink left at a default alpha scaled every
    pushed adapter wrong, silently. Its files are readable by a server running as another user (mkstemp made 0600)."""
    base, served = tmp_path / "base", tmp_path / "served"
    save_hf_model("qwen3_tied", base)
    assert main(["serve", "--dir", str(served), "--adapter_of", str(base), "--port", "0", "--rank", "4"]) == 2
    assert "give the --rank and --alpha of the run's [model.lora]" in capsys.readouterr().err
    PeftAdapterDirSink(str(served), str(base), SPEC).apply(5, _adapter(str(base), seed=4))
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in served.iterdir()} == {
        "adapter_model.safetensors": oct(0o666 & ~_umask()), "adapter_config.json": oct(0o666 & ~_umask())}
    proc, address = _serve(served, base, flags=[])  # the directory's own rank, alpha and targets
    try:
        assert main(["describe", "--to", address]) == 0
        assert "policy_version 5" in capsys.readouterr().out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_adapters_of_another_alpha_are_refused_by_sender_and_receiver(tmp_path, capsys):
    """A server restarted with another --alpha than the run's would merge every pushed adapter at the wrong scale,
    silently (the tensors show the rank, not alpha): protocol 1.5 carries alpha, and the push is refused, by our sender
    before Begin and by the receiver for any client that says its alpha; the directory keeps its version."""
    base, served, source = tmp_path / "base", tmp_path / "served", tmp_path / "source"
    save_hf_model("qwen3_tied", base)
    tensors = _adapter(str(base), seed=6)
    write_peft_adapter(source, tensors, SPEC.model_copy(update={"alpha": 16.0}), str(base))
    proc, address = _serve(served, base)  # alpha 8
    try:
        assert main(["describe", "--to", address]) == 0
        assert "applies adapters with lora_alpha 8" in capsys.readouterr().out
        assert main(["push", "--checkpoint", str(source), "--to", address, "--version", "3"]) == 2
        error = capsys.readouterr().err
        assert "applies adapters with lora_alpha 8, and these were trained with 16" in error, error
        assert "--alpha 16" in error, error
        assert read_adapter_version(served) == 0
        client = WeightSyncClient(address, WeightSyncConfig())
        request = pb.BeginRequest(session_id="other-client", policy_version=4, num_ranks=1, lora_alpha=16.0,
                                  tensors=spec_msgs(read_checkpoint_manifest(str(base)), SPEC),
                                  protocol_version=protocol_version())  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            client.begin(request)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "trained with lora_alpha 16 and this receiver applies adapters with 8" in refused.value.details()
        request.lora_alpha = 0.0  # a sender before 1.5 says nothing: taken, as before
        assert client.begin(request).current_version == 0
        client.abort(pb.AbortRequest(session_id=request.session_id, policy_version=4, reason="test"))
        client.close()
        results = run_conformance(address, WeightSyncConfig(), names=["begin_adapters_of_another_alpha"])
        assert [(r.name, r.outcome) for r in results] == [("begin_adapters_of_another_alpha", "PASS")], results
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert read_adapter_version(served) == 0


def spec_msgs(base: list, spec: AdapterSpec) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(name=s.name, shape=s.shape, dtype=s.dtype) for s in adapter_manifest(base, spec)]


def test_an_adapter_written_over_another_base_directory_is_named(tmp_path, caplog):
    """Serving a directory whose adapter was written over another base directory: the shapes match (a copy, or
    another fine-tune of the same architecture), so it is served, with a warning naming both bases."""
    base, copy, served = tmp_path / "base", tmp_path / "copy", tmp_path / "served"
    save_hf_model("qwen3_tied", base)
    save_hf_model("qwen3_tied", copy)
    PeftAdapterDirSink(str(served), str(base), SPEC).apply(3, _adapter(str(base), seed=5))
    with caplog.at_level("WARNING", logger="weight_sync.sink"):
        PeftAdapterDirSink(str(served), str(base), SPEC)
        assert not caplog.records  # the same base: nothing to say
        sink = PeftAdapterDirSink(str(served), str(copy), SPEC)
    assert sink.committed_version() == 3
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"written over {base}, served here over {copy}" in message and "version 3" in message, message


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
