"""LoRA adapters on our models against PEFT on transformers' models, with the same base and adapter weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.memory import adapter_params
from trainer.models.config import LoRAConfig
from trainer.models.hf_config import model_config_from_hf
from trainer.models.hf_io import hf_manifest, load_hf_checkpoint, save_hf_checkpoint
from trainer.models.lora import LoRALinear, adapter_state_dict, adapters_disabled, is_adapter
from trainer.models.transformer import build_model
from weight_sync.peft import EXPERT_TARGETS, adapter_manifest, write_peft_adapter
from weight_sync.spec import TensorSpec

peft = pytest.importorskip("peft")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
CASES = [
    pytest.param("llama3_scaled", LoRAConfig(rank=4, alpha=8.0), id="llama3_scaled"),
    pytest.param("qwen3_tied", LoRAConfig(rank=8, alpha=4.0, target_modules=("q_proj", "v_proj", "down_proj")),
                 id="qwen3_tied"),
    pytest.param("qwen3_moe", LoRAConfig(rank=2, alpha=2.0, target_modules=ATTENTION), id="qwen3_moe"),
    pytest.param("qwen3_moe", LoRAConfig(rank=2, alpha=2.0, target_modules=ATTENTION, target_parameters=EXPERT_TARGETS),
                 id="qwen3_moe_experts"),
]  # fmt: skip
EXPERT_CASES = [
    pytest.param(("mlp.experts.gate_up_proj",), ("q_proj",), "grouped", id="gate_up-grouped"),
    pytest.param(("mlp.experts.down_proj",), (), "grouped", id="down_only-grouped"),
    pytest.param(EXPERT_TARGETS, (), "loop", id="both-loop"),
]


def _ours(path: Path, lora: LoRAConfig, seed: int = 3, **blocks: str):
    """Our model of the HF directory with ``lora`` adapters set to seeded random values (B != 0)."""
    model = build_model(model_config_from_hf(str(path), lora=lora, **blocks), dtype=torch.float32)
    load_hf_checkpoint(model, str(path))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _peft(path: Path, adapter_dir: Path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("name", "lora"), CASES)
def test_adapter_forward_equals_peft_and_off_equals_the_base(hf_dirs, tmp_path, name, lora):
    path, hf_base = hf_dirs[name]
    ours = _ours(path, lora)
    files = write_peft_adapter(tmp_path / "adapter", adapter_state_dict(ours, ours.cfg), lora, str(path))
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
    reference = _peft(path, tmp_path / "adapter")
    tokens = _tokens(ours.cfg.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        got = ours.logits(ours(tokens))
        with adapters_disabled(ours):
            base = ours.logits(ours(tokens))
        base_expected = hf_base(input_ids=tokens).logits
    assert (got - expected).abs().max().item() <= 1e-5
    assert (base - base_expected).abs().max().item() <= 1e-5
    assert (got - base).abs().max().item() > 1e-2  # the adapters do change the model
    adapted = {n for n, m in ours.named_modules() if isinstance(m, LoRALinear)}
    assert len(adapted) == ours.cfg.num_layers * len(lora.target_modules)


@pytest.mark.parametrize(("experts", "attention", "kernel"), EXPERT_CASES)
def test_expert_adapters_equal_peft_target_parameters(hf_dirs, tmp_path, experts, attention, kernel):
    """One adapter per expert on the fused gate/up and on the down weight, as PEFT's ``target_parameters`` puts
    them on transformers' Qwen3-MoE experts: same names (PEFT loads every tensor), same forward, in both kernels."""
    path, _ = hf_dirs["qwen3_moe"]
    lora = LoRAConfig(rank=3, alpha=6.0, target_modules=attention, target_parameters=experts)
    ours = _ours(path, lora, moe_experts=kernel)
    write_peft_adapter(tmp_path / "adapter", adapter_state_dict(ours, ours.cfg), lora, str(path))
    reference = _peft(path, tmp_path / "adapter")
    loaded = {n for n, _ in reference.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * (len(experts) + len(attention)) * ours.cfg.num_layers
    tokens = _tokens(ours.cfg.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        got = ours.logits(ours(tokens))
        with reference.disable_adapter():
            base = reference(input_ids=tokens).logits
    assert (got - expected).abs().max().item() <= 1e-5
    assert (got - base).abs().max().item() > 1e-2


@pytest.mark.parametrize(("name", "lora"), [CASES[0], CASES[1], CASES[3]])
def test_merged_export_equals_the_adapter_forward(hf_dirs, tmp_path, name, lora):
    from transformers import AutoModelForCausalLM

    path, _ = hf_dirs[name]
    ours = _ours(path, lora)
    save_hf_checkpoint(ours, str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    tokens = _tokens(ours.cfg.vocab_size)
    with torch.no_grad():
        assert (merged(input_ids=tokens).logits - ours.logits(ours(tokens))).abs().max().item() <= 1e-4
    # A merged checkpoint is a plain model: the manifest has no adapter tensors and matches the files.
    plain = model_config_from_hf(str(tmp_path / "merged"))
    assert [n for n, _, _ in hf_manifest(ours.cfg)] == [n for n, _, _ in hf_manifest(plain)]


def test_only_adapters_train_and_the_base_gets_no_gradient(hf_dirs):
    from trainer.config import OptimizerConfig
    from trainer.optim import build_optimizer

    path, _ = hf_dirs["qwen3_tied"]
    model = _ours(path, LoRAConfig(rank=4)).train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    tokens = _tokens(model.cfg.vocab_size)
    model.logits(model(tokens)).logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n in base)
    optimizer.step()
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_a_fresh_adapter_leaves_the_model_unchanged(hf_dirs):
    path, hf_base = hf_dirs["llama3_scaled"]
    model = build_model(model_config_from_hf(str(path), lora=LoRAConfig(rank=4, init="gaussian")))
    load_hf_checkpoint(model, str(path))
    tokens = _tokens(model.cfg.vocab_size)
    with torch.no_grad():
        assert (model.logits(model(tokens)) - hf_base(input_ids=tokens).logits).abs().max().item() <= 1e-5
    a = dict(model.named_parameters())["layers.0.attention.wq.lora_A"]
    assert a.abs().sum() > 0  # A is random; B = 0 is what keeps the model unchanged


def test_a_model_built_on_meta_then_initialised_has_fresh_adapters_everywhere(hf_dirs):
    """``to_empty`` leaves memory uninitialised: ``init_weights`` must reset every adapter, expert ones included."""
    path, _ = hf_dirs["qwen3_moe"]
    cfg = model_config_from_hf(str(path), lora=LoRAConfig(target_modules=ATTENTION, target_parameters=EXPERT_TARGETS))
    model = build_model(cfg, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    assert any(".experts.gate_up_lora." in n for n in adapters) and any(".experts.down_lora." in n for n in adapters)
    for name, p in adapters.items():
        assert torch.isfinite(p).all(), name
        if name.endswith("lora_B"):
            assert not p.any(), name


@pytest.mark.parametrize(("name", "lora"), CASES)
def test_a_receiver_derives_from_the_base_checkpoint_exactly_the_adapters_the_trainer_trains(hf_dirs, name, lora):
    """The receiver's manifest (from the base model's HF tensors alone) names and shapes every trained adapter."""
    from weight_sync.checkpoint import read_checkpoint_manifest

    path, _ = hf_dirs[name]
    ours = _ours(path, lora)
    trained = {n: tuple(t.shape) for n, t in adapter_state_dict(ours, ours.cfg)}
    derived = adapter_manifest(read_checkpoint_manifest(str(path)), lora)
    assert {s.name: s.shape for s in derived} == trained
    assert {s.dtype for s in derived} == {"float32"}
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert trained[f"{q}.lora_A.weight"] == (lora.rank, ours.cfg.dim)
    assert trained[f"{q}.lora_B.weight"] == (ours.cfg.num_heads * ours.cfg.head_dim, lora.rank)
    # Another base (wider projections) derives other shapes: its receiver refuses these adapters.
    wider = [TensorSpec(s.name, (2 * s.shape[0], *s.shape[1:]), s.dtype) for s in read_checkpoint_manifest(str(path))]
    assert {s.name: s.shape for s in adapter_manifest(wider, lora)} != trained


def test_lora_on_moe_experts_is_refused_with_the_alternative(hf_dirs):
    path, _ = hf_dirs["qwen3_moe"]
    with pytest.raises(ValueError, match=r"stacked experts.*q_proj, k_proj, v_proj, o_proj"):
        model_config_from_hf(str(path), lora=LoRAConfig(target_modules=("q_proj", "gate_proj")))


def test_expert_adapters_are_refused_where_they_are_not_built(hf_dirs):
    """Each refusal names the field and the way out: a dense model, dropout, the Pallas MoE kernel. Expert
    parallelism takes expert adapters (``tests/trainer/test_expert_parallel.py`` trains them)."""
    from trainer.config import TrainerConfig

    experts = LoRAConfig(target_modules=ATTENTION, target_parameters=EXPERT_TARGETS)
    with pytest.raises(ValueError, match="has none: use target_modules"):
        model_config_from_hf(str(hf_dirs["qwen3_tied"][0]), lora=experts)
    moe = str(hf_dirs["qwen3_moe"][0])
    with pytest.raises(ValueError, match="lora.dropout must be 0 with target_parameters"):
        model_config_from_hf(moe, lora=experts.model_copy(update={"dropout": 0.1}))
    with pytest.raises(ValueError, match="moe_experts = 'gmm_pallas'.*'grouped' and 'loop'"):
        model_config_from_hf(moe, lora=experts, moe_experts="gmm_pallas")
    model_cfg = model_config_from_hf(moe, lora=experts)
    ep = TrainerConfig(num_ranks=2, parallelism={"expert_parallel_degree": 2})
    ep.check_model(model_cfg)
    ep.check_model(model_config_from_hf(moe, lora=LoRAConfig(target_modules=ATTENTION)))
    assert adapter_params(model_cfg, experts) == sum(
        p.numel() for n, p in build_model(model_cfg, device="meta").named_parameters() if is_adapter(n)
    )


def test_a_rank_past_a_projection_width_is_warned_with_the_rank_that_fits(hf_dirs, caplog):
    """A projection's update has rank at most min(in, out): a larger LoRA rank adds parameters, not capacity."""
    path = str(hf_dirs["qwen3_tied"][0])
    model = model_config_from_hf(path)
    kv = model.num_kv_heads * model.head_dim
    with caplog.at_level("WARNING", logger="rl_align"):
        model_config_from_hf(path, lora=LoRAConfig(rank=kv, target_modules=("k_proj", "v_proj")))
    assert not caplog.records  # a rank equal to the width fits
    with caplog.at_level("WARNING", logger="rl_align"):
        model_config_from_hf(path, lora=LoRAConfig(rank=kv + 1, target_modules=("k_proj", "v_proj")))
    [record] = caplog.records
    assert f"k_proj ({kv}), v_proj ({kv})" in record.getMessage() and f"at most {kv} fits" in record.getMessage()
