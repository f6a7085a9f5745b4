"""Engine pieces that need no running engine: configs, sampling parameters, fused-group and coverage checks."""

from __future__ import annotations

import pytest

from common.config import ConfigError, validate_config
from rollout.config import RolloutConfig, SamplingConfig
from rollout.engine.transfer import check_fused_groups, expected_parameters
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


def test_sampling_params_carry_every_setting():
    pytest.importorskip("vllm")
    from rollout.sampling import to_vllm_sampling_params

    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_tokens=33, stop=["\n\n"], stop_token_ids=[3])
    params = to_vllm_sampling_params(sampling, n=4, seed=9)
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (
        4, 0.7, 0.9, 20, 33, 9)
    assert params.stop == ["\n\n"] and 3 in params.stop_token_ids and params.logprobs == 0
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


def test_expected_parameters_maps_checkpoint_names_onto_fused_ones():
    params = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", "model.norm.weight"}
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert expected_parameters(names, PACKED, params) == params
