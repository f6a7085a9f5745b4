"""WeightSyncConfig validation, and the two plain sinks (state dict, safetensors directory)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import ConfigError, validate_config
from weight_sync.config import WeightSyncConfig
from weight_sync.sink import SafetensorsDirSink, StateDictSink, TensorSpec, WeightSink


def test_config_rejects_mistakes_with_field_names(monkeypatch):
    with pytest.raises(ConfigError, match="chunk_byte"):
        validate_config(WeightSyncConfig, {"chunk_byte": 1})
    with pytest.raises(ConfigError, match="tls_key_path"):
        validate_config(WeightSyncConfig, {"tls_cert_path": "c.pem"})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        validate_config(WeightSyncConfig, {"endpoints": ["nohost"]})
    with pytest.raises(ConfigError, match="multiple of 8"):
        validate_config(WeightSyncConfig, {"chunk_bytes": 4100})
    monkeypatch.setenv("MY_TOKEN", "abc")
    assert WeightSyncConfig(auth_token_env="MY_TOKEN").resolve_token() == "abc"
    assert WeightSyncConfig(auth_token="x", auth_token_env="MY_TOKEN").resolve_token() == "x"
    assert WeightSyncConfig(auth_token_env=None).resolve_token() is None
    monkeypatch.setenv("MY_TOKEN", " ")  # set but empty: the receiver would run without a token
    with pytest.raises(ValueError, match=r"variable MY_TOKEN \(auth_token_env\) is set but empty"):
        WeightSyncConfig(auth_token_env="MY_TOKEN").resolve_token()


def test_tensor_spec_validates_dtype_and_shape():
    assert TensorSpec("w", [2, 3], "bfloat16").nbytes == 12
    with pytest.raises(ValueError, match="not supported"):
        TensorSpec("w", (2,), "complex64")
    with pytest.raises(ValueError, match="negative"):
        TensorSpec("w", (-1,), "float32")


def test_state_dict_sink_copies_in_place_and_rejects_unknown_names():
    target = {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    sink = StateDictSink(target)
    assert isinstance(sink, WeightSink)
    assert sink.manifest() == [TensorSpec("a", (3,), "float32"), TensorSpec("b", (2,), "bfloat16")]
    sink.apply(4, {"a": torch.ones(3)})
    assert torch.equal(target["a"], torch.ones(3)) and sink.policy_version == 4
    with pytest.raises(ValueError, match="not in this state dict"):
        sink.apply(5, {"zzz": torch.ones(1)})


def test_safetensors_sink_merges_subset_updates_atomically(tmp_path):
    save_file({"a": torch.zeros(3)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "model-2.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sink = SafetensorsDirSink(str(tmp_path))
    assert sorted(s.name for s in sink.manifest()) == ["a", "b"]
    sink.apply(1, {"b": torch.ones(2, dtype=torch.bfloat16)})
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()  # loaders would look for the folded shards
    got = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(got["a"], torch.zeros(3)) and torch.equal(got["b"], torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="manifest"):
        sink.apply(2, {"c": torch.ones(1)})
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        SafetensorsDirSink(str(tmp_path / "empty"))


def test_safetensors_sink_refuses_an_update_it_cannot_complete_and_keeps_its_version(tmp_path):
    manifest = [TensorSpec("a", (3,), "float32"), TensorSpec("b", (2,), "bfloat16")]
    fresh = SafetensorsDirSink(str(tmp_path / "fresh"), manifest)
    with pytest.raises(ValueError, match=r"leaves \['b'\].*first update must cover every tensor"):
        fresh.apply(1, {"a": torch.ones(3)})
    assert list((tmp_path / "fresh").iterdir()) == []  # nothing written
    fresh.apply(1, {"a": torch.ones(3), "b": torch.ones(2, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="expected b"):  # a tensor of another dtype than the manifest's
        fresh.apply(2, {"b": torch.full((2,), 5.0)})
    got = load_file(str(tmp_path / "fresh" / "model.safetensors"))
    assert torch.equal(got["a"], torch.ones(3)) and torch.equal(got["b"], torch.ones(2, dtype=torch.bfloat16))
    assert fresh.committed_version() == 1
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["model.safetensors", "policy_version.json"]
