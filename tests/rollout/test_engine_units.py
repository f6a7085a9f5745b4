"""Engine pieces that need no running engine: configs, sampling parameters, fused-group and coverage checks."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import ConfigError, validate_config
from rollout.config import RolloutConfig, SamplingConfig
from rollout.engine.transfer import check_fused_groups, check_whole_expert_layers, expected_parameters
from rollout.sampling import turn_seed

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_rollout_config_is_strict_and_documented():
    config = validate_config(
        RolloutConfig, {"model_path": "m", "engine": {"max_num_seqs": 8}, "sampling": {"top_k": 5}}
    )
    assert config.engine.max_num_seqs == 8 and config.sampling.top_k == 5
    with pytest.raises(ConfigError, match="engine.max_num_seq"):
        validate_config(RolloutConfig, {"model_path": "m", "engine": {"max_num_seq": 8}})
    with pytest.raises(ConfigError, match="min_tokens"):
        validate_config(RolloutConfig, {"model_path": "m", "sampling": {"min_tokens": 9, "max_tokens": 4}})
    assert all(f.description for f in RolloutConfig.model_fields.values())


def test_turn_seeds_are_distinct_and_reproducible():
    seeded = SamplingConfig(seed=100)
    seeds = {turn_seed(seeded, g, i, t) for g in range(4) for i in range(8) for t in range(3)}
    assert len(seeds) == 4 * 8 * 3 and all(0 <= s < 2**31 for s in seeds)
    assert turn_seed(seeded, 3, 2, 1) == turn_seed(SamplingConfig(seed=100), 3, 2, 1)
    assert turn_seed(SamplingConfig(seed=101), 3, 2, 1) != turn_seed(seeded, 3, 2, 1)
    assert turn_seed(SamplingConfig(), 7, 0, 0) is None
    # The samples of a group count up from one seed (what lets the engine run them as one vLLM request).
    assert [turn_seed(seeded, 3, i, 1) for i in range(8)] == [turn_seed(seeded, 3, 0, 1) + i for i in range(8)]
    # A turn of n > 1 choices takes n seeds from a start of its own, not its group neighbours' seeds.
    choices = {turn_seed(seeded, 3, i, 1, n=4) + j for i in range(8) for j in range(4)}
    assert len(choices) == 32 and not choices & seeds
    assert turn_seed(seeded, 3, 2, 1, n=4) == turn_seed(SamplingConfig(seed=100), 3, 2, 1, n=4)


def test_joiner_gathers_by_prompt_sampling_and_adapter_and_keeps_seed_runs():
    import asyncio

    from rollout.engine.joining import Joiner, Waiter

    loop = asyncio.new_event_loop()
    try:
        joiner = Joiner()

        def waiter(n=1, seed=None):
            return Waiter(loop.create_future(), n, seed)

        unseeded = [waiter(), waiter(2), waiter()]
        seeded = [waiter(seed=13), waiter(2, seed=10), waiter(seed=12), waiter(seed=20)]
        other_prompt, other_sampling = waiter(), waiter()
        for w in unseeded + seeded:
            joiner.add([1, 2, 3], "T=1", "T=1", None, w)
        joiner.add([1, 2], "T=1", "T=1", None, other_prompt)
        joiner.add([1, 2, 3], "T=0", "T=0", None, other_sampling)
        gone = waiter()
        joiner.add([1, 2, 3], "T=1", "T=1", None, gone)
        joiner.remove(gone)
        requests = joiner.take()
        assert not joiner
        layout = sorted((r.prompt, r.sampling, r.seed or -1, r.n, len(r.waiters)) for r in requests)
        assert layout == sorted([
            ([1, 2, 3], "T=1", -1, 4, 3),  # the unseeded callers, one request
            ([1, 2, 3], "T=1", 10, 4, 3),  # seeds 10-11, 12, 13: one run
            ([1, 2, 3], "T=1", 20, 1, 1),  # 20 does not continue it
            ([1, 2], "T=1", -1, 1, 1),
            ([1, 2, 3], "T=0", -1, 1, 1),
        ])  # fmt: skip
        run = next(r for r in requests if r.seed == 10)
        assert [w.seed for w in run.waiters] == [10, 12, 13]
        run.waiters[1].future.cancel()
        assert run.wanted()
        run.deliver(["a", "b", "c", "d"])
        assert [w.future.result() for w in (run.waiters[0], run.waiters[2])] == [["a", "b"], ["d"]]
        assert not run.wanted()
        short = next(r for r in requests if r.seed is None and r.n == 4)
        short.deliver(["x"])  # vLLM gave fewer completions than asked: every caller hears it
        assert all("1 completions" in str(w.future.exception()) for w in short.waiters)
    finally:
        loop.close()


def test_greedy_is_temperature_0_and_vllm_samples_every_other_temperature_as_asked():
    """vLLM 0.32 raises a temperature between 0 and 0.01 to 0.01 and samples: only 0 is greedy, and temperatures vLLM
    would not sample at are refused (1e-6 was taken for greedy, 1e-3 trained at 1e-3 on samples drawn at 0.01)."""
    from rollout.config import MIN_TEMPERATURE, SamplingConfig
    from rollout.sampling import is_greedy, to_vllm_sampling_params

    assert is_greedy(SamplingConfig(temperature=0.0)) and not is_greedy(SamplingConfig(temperature=MIN_TEMPERATURE))
    with pytest.raises(ValueError, match="vLLM samples at 0.01"):
        SamplingConfig(temperature=1e-6)
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingType

    for temperature in (0.0, MIN_TEMPERATURE, 0.7):
        params = to_vllm_sampling_params(SamplingConfig(temperature=temperature), n=1)
        assert params.temperature == temperature  # sampled as asked
        assert (params.sampling_type == SamplingType.GREEDY) == (temperature == 0)


def test_greedy_waiters_of_one_prompt_are_one_request_of_one_completion_handed_out_as_copies():
    import asyncio

    from rollout.engine.joining import Joiner, Waiter

    loop = asyncio.new_event_loop()
    try:
        joiner = Joiner()
        waiters = [Waiter(loop.create_future(), n, seed) for n, seed in ((1, None), (2, 7), (1, 3))]
        for w in waiters:
            joiner.add([1, 2], "T=0", "T=0", None, w, greedy=True)
        [request] = joiner.take()
        assert (request.n, request.num_sampled, request.greedy) == (4, 1, True)
        request.deliver([["argmax path"]])
        results = [w.future.result() for w in waiters]
        assert results == [[["argmax path"]], [["argmax path"]] * 2, [["argmax path"]]]
        assert results[1][0] is not results[1][1]  # copies: a caller may change its own
    finally:
        loop.close()


def test_sampled_token_logprobs_read_alike_from_flat_and_per_position_logprobs():
    pytest.importorskip("vllm")
    from vllm.logprobs import FlatLogprobs, Logprob

    from rollout.engine.vllm_engine import _sampled_logprobs

    ids = np.array([5, 9, 2], dtype=np.int64)
    per_position = [{5: Logprob(-0.5, 3, None)}, {9: Logprob(-1.25, 1, None), 4: Logprob(-0.1, 2, None)},
                    {2: Logprob(-2.0, 7, None)}]  # fmt: skip
    flat = FlatLogprobs()
    for position in per_position[:1] + [{9: per_position[1][9]}] + per_position[2:]:
        flat.append(position)
    expected = np.array([-0.5, -1.25, -2.0], dtype=np.float32)
    np.testing.assert_array_equal(_sampled_logprobs(per_position, ids), expected)
    np.testing.assert_array_equal(_sampled_logprobs(flat, ids), expected)
    with_alternatives = FlatLogprobs()
    for position in per_position:  # two entries at position 1: the flat lists are not one a token
        with_alternatives.append(position)
    np.testing.assert_array_equal(_sampled_logprobs(with_alternatives, ids), expected)


def test_sampling_params_carry_every_setting():
    pytest.importorskip("vllm")
    from rollout.sampling import to_vllm_sampling_params

    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_tokens=33, stop=["\n\n"], stop_token_ids=[3])
    params = to_vllm_sampling_params(sampling, n=4, seed=9)
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (
        4, 0.7, 0.9, 20, 33, 9)
    assert params.stop == ["\n\n"] and 3 in params.stop_token_ids and params.logprobs == 0 and params.flat_logprobs
    with pytest.raises(ValueError, match="group size"):
        to_vllm_sampling_params(sampling, n=0)


def test_partial_fused_groups_are_refused():
    layer = "model.layers.3.self_attn.{}.weight"
    check_fused_groups([layer.format(p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")], PACKED)
    check_fused_groups(["model.norm.weight"], PACKED)
    with pytest.raises(ValueError, match="k_proj.*v_proj|v_proj.*k_proj"):
        check_fused_groups([layer.format("q_proj")], PACKED)
    with pytest.raises(ValueError, match="up_proj"):
        check_fused_groups(["model.layers.0.mlp.gate_proj.weight"], PACKED)


def test_an_update_with_some_of_a_moe_layers_expert_weights_is_refused():
    experts = "model.layers.1.mlp.experts.{}.{}_proj.weight"
    whole = [experts.format(e, p) for e in range(4) for p in ("gate", "up", "down")]
    check_whole_expert_layers([*whole, "model.layers.0.mlp.gate.weight"], {"model.layers.1.mlp.experts": 4})
    check_whole_expert_layers(["model.layers.0.self_attn.q_proj.weight"], {"model.layers.1.mlp.experts": 4})
    with pytest.raises(ValueError, match=r"^rl_align refused: update has 11 of the 12 expert weights of "
                                         r"model\.layers\.1\.mlp\.experts"):  # fmt: skip
        check_whole_expert_layers(whole[:-1], {"model.layers.1.mlp.experts": 4})
    inside = {"model.layers.1.mlp.experts.routed_experts": 4}  # vLLM's stacked weights live in a submodule
    check_whole_expert_layers(whole, inside)
    with pytest.raises(ValueError, match="4 of the 12"):  # the down projections alone
        check_whole_expert_layers([n for n in whole if "down" in n], inside)


def test_expected_parameters_maps_checkpoint_names_onto_fused_ones():
    params = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", "model.norm.weight"}
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert expected_parameters(names, PACKED, params) == params


def test_expert_adapters_are_served_merged_on_cpu_and_refused_through_vllms_lora_path_there():
    from rollout.config import EngineConfig
    from rollout.engine.platform import lora_serving
    from rollout.engine.vllm_engine import vllm_engine_args
    from weight_sync.peft import EXPERT_TARGETS, AdapterSpec

    experts = AdapterSpec(target_modules=("q_proj",), target_parameters=EXPERT_TARGETS)
    assert lora_serving(EngineConfig(lora=experts)) == "merged"
    assert "enable_lora" not in vllm_engine_args(EngineConfig(lora=experts), "m")
    with pytest.raises(ValueError, match="lora_serving = 'adapter' with expert adapters.*use 'merged'"):
        vllm_engine_args(EngineConfig(lora=experts, lora_serving="adapter"), "m")
    on_attention = EngineConfig(lora=AdapterSpec(target_modules=("q_proj",)), lora_serving="adapter")
    attention = vllm_engine_args(on_attention, "m")
    assert attention["enable_lora"] and "enable_mixed_moe_lora_format" not in attention


def test_adapters_above_vllms_largest_lora_rank_are_served_merged_by_auto(monkeypatch):
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    import rollout.engine.platform as platform
    from rollout.config import MAX_SERVED_LORA_RANK, EngineConfig
    from weight_sync.peft import AdapterSpec

    assert max(get_args(MaxLoRARanks)) == MAX_SERVED_LORA_RANK  # the recipe checks' copy of vLLM's limit
    monkeypatch.setattr(platform, "is_cpu_platform", lambda: False)  # where 'auto' would pick vLLM's LoRA path
    assert platform.lora_serving(EngineConfig(lora=AdapterSpec(rank=MAX_SERVED_LORA_RANK))) == "adapter"
    assert platform.lora_serving(EngineConfig(lora=AdapterSpec(rank=MAX_SERVED_LORA_RANK + 1))) == "merged"


def test_a_bfloat16_engine_on_a_cpu_without_bfloat16_hardware_is_warned_about(monkeypatch, caplog):
    # On an AVX2-only host a bfloat16 engine took ~3.6x the CPU per token of float32, and nothing said so.
    import logging

    from rollout.config import EngineConfig
    from rollout.engine import platform

    monkeypatch.setattr(platform, "is_cpu_platform", lambda: True)
    for flags, dtype, warned in (({"avx2"}, "bfloat16", True), ({"avx2", "amx_bf16"}, "bfloat16", False),
                                 ({"asimd", "bf16"}, "bfloat16", False), ({"avx2"}, "float32", False),
                                 (None, "bfloat16", False)):  # fmt: skip
        monkeypatch.setattr(platform, "cpu_flags", lambda flags=flags: flags)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rollout.engine.platform"):
            platform.warn_slow_cpu_dtype(EngineConfig(dtype=dtype))
        assert ("rollout.engine.dtype = 'float32' is faster" in caplog.text) == warned, (flags, dtype)


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo(monkeypatch, tmp_path):
    from pathlib import Path

    from common import cpu

    real = Path.read_text
    for text, expected in (("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n", {"fpu", "avx2", "amx_bf16"}),
                           ("processor\t: 0\nFeatures\t: fp asimd bf16\n", {"fp", "asimd", "bf16"}),
                           ("processor\t: 0\n", None)):  # fmt: skip
        monkeypatch.setattr(Path, "read_text", lambda self, *a, text=text, **k: text if str(self) == "/proc/cpuinfo"
                            else real(self, *a, **k))  # fmt: skip
        assert cpu.cpu_flags() == expected
