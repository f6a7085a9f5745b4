"""Block-level behaviour: packed segments, chunked vs dense output head, loop vs grouped MoE, aux loss, registries."""

from __future__ import annotations

import pytest
import torch

from trainer.models.config import ModelConfig
from trainer.models.moe import grouped_experts, loop_experts, route_tokens
from trainer.models.output_head import chunked_token_logprobs, dense_token_logprobs
from trainer.models.registry import ATTENTION_BLOCKS, BlockRegistry
from trainer.models.transformer import build_model, positions_from_segments

BASE = dict(vocab_size=80, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_hidden_dim=48)
CONFIGS = {
    "llama3": dict(family="llama3", rope_scaling=dict(original_max_seq_len=16)),
    "qwen3": dict(family="qwen3", qk_norm=True, tie_embeddings=True),
    "qwen3_moe": dict(family="qwen3_moe", qk_norm=True, moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_dim=16)),
}


def _cfg(family: str, **kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **CONFIGS[family], **kw})


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_segments_equal_separate_sequences(family, attention):
    torch.manual_seed(0)
    model = build_model(_cfg(family, attention=attention)).eval()
    lengths = [5, 9, 3, 7]
    seqs = [torch.randint(0, 80, (n,)) for n in lengths]
    tokens = torch.cat(seqs)[None]
    segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    assert torch.equal(positions_from_segments(segment_ids), positions)
    with torch.no_grad():
        packed = model(tokens, positions=positions, segment_ids=segment_ids)[0]
        packed_default_pos = model(tokens, segment_ids=segment_ids)[0]
        alone = torch.cat([model(s[None])[0] for s in seqs])
        unmasked = model(tokens)[0]
    assert (packed - alone).abs().max().item() < 1e-5
    assert torch.equal(packed, packed_default_pos)
    assert (unmasked - alone).abs().max().item() > 1e-3  # the mask matters


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_output_positions_equal_the_selected_rows_of_a_full_forward(family, attention):
    """The trimmed last block gives the same hidden states, gradients and MoE router loss as selecting afterwards."""
    torch.manual_seed(0)
    full_model = build_model(_cfg(family, attention=attention))
    trimmed_model = build_model(_cfg(family, attention=attention))
    trimmed_model.load_state_dict(full_model.state_dict())
    tokens = torch.randint(0, 80, (2, 12))
    segment_ids = torch.tensor([[0] * 5 + [1] * 7, [2] * 12])
    keep = torch.tensor([3, 4, 9, 10, 11, 12, 20, 23])
    weights = torch.randn(len(keep), BASE["dim"])
    full = full_model(tokens, segment_ids=segment_ids).reshape(-1, BASE["dim"])[keep]
    trimmed = trimmed_model(tokens, segment_ids=segment_ids, output_positions=keep)
    assert trimmed.shape == (len(keep), BASE["dim"])
    assert (full - trimmed).abs().max().item() < 1e-5
    losses = []
    for model, hidden in ((full_model, full), (trimmed_model, trimmed)):
        aux = model.moe_aux_loss()
        losses.append(aux)
        ((hidden * weights).sum() + (0 if aux is None else aux)).backward()
    if family == "qwen3_moe":
        assert torch.equal(losses[0], losses[1])
    trimmed_params = dict(trimmed_model.named_parameters())
    for name, p in full_model.named_parameters():
        if p.grad is None:  # the untied output head: no head call here
            assert trimmed_params[name].grad is None, name
            continue
        assert (p.grad - trimmed_params[name].grad).abs().max().item() < 1e-5, name
    # No kept position: still one connected graph (every rank of a sharded step runs the same backward).
    empty = trimmed_model(tokens, segment_ids=segment_ids, output_positions=torch.zeros(0, dtype=torch.long))
    trimmed_model.zero_grad()
    (empty.sum() + 0.0 * empty.sum()).backward()
    assert trimmed_model.layers[-1].attention.wk.weight.grad is not None


def _head_inputs(n=37, v=300, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1000])
def test_chunked_head_matches_dense_values_and_grads(chunk_size):
    g = torch.Generator().manual_seed(1)
    results = []
    for head in (dense_token_logprobs, chunked_token_logprobs):
        hidden, weight, targets = _head_inputs()
        lp, ent = head(hidden, weight, targets, chunk_size=chunk_size)
        # arbitrary upstream gradients through both outputs
        w_lp, w_ent = torch.randn(lp.shape, generator=g), torch.randn(ent.shape, generator=g)
        g = torch.Generator().manual_seed(1)
        (lp * w_lp + ent * w_ent).sum().backward()
        results.append((lp.detach(), ent.detach(), hidden.grad, weight.grad))
    for ref, got in zip(*results, strict=True):
        assert (ref - got).abs().max().item() < 1e-5
    assert results[0][3].abs().max().item() > 1e-3


def test_chunked_head_single_output_grad_and_bf16():
    hidden, weight, targets = _head_inputs()
    lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=5)
    lp.sum().backward()  # entropy unused: its grad arrives as None
    hd, wd, _ = _head_inputs()
    dense_token_logprobs(hd, wd, targets)[0].sum().backward()
    assert (hidden.grad - hd.grad).abs().max().item() < 1e-5
    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    lpb, entb = chunked_token_logprobs(hb, wb, targets, chunk_size=5)
    assert lpb.dtype == torch.float32 and (lpb - lp.detach()).abs().max().item() < 0.1
    (lpb + entb).sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16


def test_model_token_logprobs_uses_configured_head():
    torch.manual_seed(0)
    dense = build_model(_cfg("qwen3", output_head="dense"))
    chunked = build_model(_cfg("qwen3", output_head="chunked", output_chunk_size=7))
    chunked.load_state_dict(dense.state_dict())
    tokens = torch.randint(0, 80, (2, 11))
    targets = torch.roll(tokens, -1, dims=1)
    out = [m.token_logprobs(m(tokens), targets) for m in (dense, chunked)]
    assert out[0][0].shape == (2, 11)
    assert (out[0][0] - out[1][0]).abs().max() < 1e-5 and (out[0][1] - out[1][1]).abs().max() < 1e-5
    logp = torch.log_softmax(dense.logits(dense(tokens)), -1).gather(-1, targets[..., None])[..., 0]
    assert (logp - out[0][0]).abs().max() < 1e-5


@pytest.mark.parametrize(("dim", "hidden"), [(32, 16), (20, 10)])  # aligned rows (grouped_mm) and padded bmm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_loop(dim, hidden, dtype):
    g = torch.Generator().manual_seed(0)
    num_experts, top_k, n = 6, 2, 50
    logits = torch.randn(n, num_experts, generator=g)
    logits[:, 5] = -1e4  # one expert gets no tokens
    idx, weight, _ = route_tokens(logits, top_k, norm_topk_prob=True)
    base = [torch.randn(n, dim, generator=g)] + [
        torch.randn(shape, generator=g) * 0.3
        for shape in ((num_experts, hidden, dim), (num_experts, hidden, dim), (num_experts, dim, hidden))
    ]
    upstream = torch.randn(n, dim, generator=g)
    results = []
    for fn in (loop_experts, grouped_experts):
        leaves = [t.to(dtype).requires_grad_() for t in base]
        w = weight.to(dtype).requires_grad_()
        out = fn(leaves[0], idx, w, *leaves[1:])
        (out.float() * upstream).sum().backward()
        results.append([out.detach().float()] + [t.grad.float() for t in leaves] + [w.grad.float()])
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    for ref, got in zip(*results, strict=True):
        assert (ref - got).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    assert results[0][2][5].abs().max() == 0  # unused expert: zero gradient


def test_moe_model_loop_equals_grouped_and_aux_loss():
    torch.manual_seed(0)
    loop = build_model(_cfg("qwen3_moe", moe_experts="loop"))
    grouped = build_model(_cfg("qwen3_moe", moe_experts="grouped"))
    grouped.load_state_dict(loop.state_dict())
    tokens = torch.randint(0, 80, (2, 13))
    outs = []
    for m in (loop, grouped):
        h = m(tokens)
        aux = m.moe_aux_loss()
        logprobs, entropy = m.token_logprobs(h, torch.roll(tokens, -1, dims=1))
        (logprobs.mean() + 0.1 * entropy.mean() + aux).backward()
        outs.append((h.detach(), aux.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert (outs[0][0] - outs[1][0]).abs().max() < 1e-5
    assert torch.allclose(outs[0][1], outs[1][1])
    for name, grad in outs[0][2].items():
        assert (grad - outs[1][2][name]).abs().max() < 1e-5, name
    assert loop.layers[0].moe.router.weight.grad.abs().max() > 0  # aux loss and routing weights reach the router
    assert build_model(_cfg("qwen3")).moe_aux_loss() is None


def test_meta_build_then_init_and_bf16():
    cfg = _cfg("qwen3_moe")
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, 80, (2, 6))
    assert torch.isfinite(model(tokens)).all()
    bf16 = build_model(cfg, dtype=torch.bfloat16)
    hidden = bf16(tokens)
    logprobs, entropy = bf16.token_logprobs(hidden, tokens)
    assert hidden.dtype == torch.bfloat16 and logprobs.dtype == entropy.dtype == torch.float32
    assert not logprobs._is_view() and not entropy._is_view()  # FSDP root methods must not return views


def test_unknown_block_names_list_available_ones():
    # The Pallas kernel names are listed (imported on first use) without importing them.
    with pytest.raises(ValueError, match=r"unknown attention block 'flash'.*\['eager', 'sdpa', 'splash', 'varlen'\]"):
        build_model(_cfg("llama3", attention="flash"))
    with pytest.raises(ValueError, match=r"'moe_experts'.*\['gmm_pallas', 'grouped', 'loop'\]"):
        build_model(_cfg("llama3", moe_experts="megablocks"))
    with pytest.raises(ValueError, match="output_head"):
        build_model(_cfg("llama3", output_head="fused"))


def test_registering_a_block_swaps_it_in_without_model_changes():
    calls = []

    def counting_sdpa(q, k, v, *, segment_ids, scale):
        calls.append(q.shape)
        return ATTENTION_BLOCKS.get("sdpa")(q, k, v, segment_ids=segment_ids, scale=scale)

    ATTENTION_BLOCKS.register("test_counting", counting_sdpa)
    try:
        torch.manual_seed(0)
        model = build_model(_cfg("qwen3", attention="test_counting"))
        model(torch.randint(0, 80, (1, 6)))
        assert len(calls) == 2
        with pytest.raises(ValueError, match="already registered"):
            ATTENTION_BLOCKS.register("test_counting", lambda *a, **k: None)
    finally:
        ATTENTION_BLOCKS._impls.pop("test_counting")
    reg = BlockRegistry("demo", "demo_field")
    reg.register("a")(len)
    assert reg.names() == ["a"] and "a" in reg and reg["a"] is len
