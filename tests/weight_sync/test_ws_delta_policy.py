"""`delta = "auto"`: deltas only to receivers whose measured link is slower than the sender's compare."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ws_helpers import rank_shards

from weight_sync.config import WeightSyncConfig
from weight_sync.delta_policy import MARGIN, DeltaPolicy, LinkSample
from weight_sync.sender import WeightSender

GB = 1e9


def _sample(link_bps: float, delta: bool = False, effective_bps: float | None = None) -> LinkSample:
    wire = 1 << 30
    payload = wire * (10 if delta else 1)
    stream_s = payload / effective_bps if effective_bps else wire / link_bps
    return LinkSample(payload_bytes=payload, wire_bytes=wire, send_s=wire / link_bps, stream_s=stream_s, delta=delta)


def test_auto_sends_deltas_only_over_links_slower_than_the_compare():
    policy = DeltaPolicy("auto", compare_bps=1.5 * GB)
    assert not policy.use_delta("a")  # unmeasured: the first push is full
    policy.record("slow", _sample(0.12 * GB))  # 1 Gb/s
    policy.record("fast", _sample(3.0 * GB))  # loopback
    policy.record("edge", _sample(1.5 * GB / MARGIN * 1.01))  # not clearly slower than the compare
    assert policy.use_delta("slow") and not policy.use_delta("fast") and not policy.use_delta("edge")
    assert policy.keeps_base(["fast", "slow"]) and not policy.keeps_base(["fast", "edge"])


def test_a_measured_delta_push_replaces_the_estimate_both_ways():
    policy = DeltaPolicy("auto", compare_bps=1.2 * GB)
    policy.record("r", _sample(1.0 * GB))
    assert not policy.use_delta("r")  # the compare is not MARGIN x faster than the link: full
    policy.record("r", _sample(1.0 * GB, delta=True, effective_bps=4 * GB))  # deltas went faster than expected
    assert policy.use_delta("r")
    policy.record("r", _sample(50 * GB, delta=True, effective_bps=0.5 * GB))  # now slower than the link
    assert not policy.use_delta("r")  # (a delta's few bytes never wait for the link: they do not measure it)


@pytest.mark.parametrize("mode", [True, False])
def test_fixed_modes_ignore_measurements(mode):
    policy = DeltaPolicy(mode, compare_bps=1.0)
    policy.record("r", _sample(100 * GB))
    assert policy.use_delta("r") is mode and policy.keeps_base(["r"]) is mode and policy.enabled is mode


def test_calibration_times_the_compare_on_the_senders_own_values():
    policy = DeltaPolicy("auto")
    policy.calibrate([np.arange(1 << 20, dtype=np.uint16), np.zeros(1 << 21, dtype=np.uint32)])
    policy.record("r", _sample(1e3))  # a link of 1 kB/s: any real compare beats it
    assert policy.use_delta("r") and "next push delta" in policy.describe("r")


@pytest.mark.parametrize("compare_bps, expect_delta", [(1e15, True), (1.0, False)])
def test_the_sender_follows_the_policy_and_keeps_a_base_only_for_deltas(receivers, compare_bps, expect_delta):
    sd = {"w": torch.randn(64, 64).to(torch.bfloat16)}
    (receiver, sink), = receivers(1, sd=sd)
    with WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=1024, delta="auto")) as sender:
        sender._delta = DeltaPolicy("auto", compare_bps=compare_bps)  # what this host's compare would measure
        first = sender.push(1, rank_shards(sd, 0, 1))
        assert sender.commit(1) == {receiver.address: None} and first.delta_endpoints == []
        assert sender._delta.use_delta(receiver.address) is expect_delta  # the loopback link was measured
        assert bool(sender._base) is expect_delta  # no copy of the model kept for full pushes
        sd2 = {"w": sd["w"].clone()}
        sd2["w"][::8, ::8] += 1
        second = sender.push(2, rank_shards(sd2, 0, 1))
        assert sender.commit(2) == {receiver.address: None}
    assert second.delta_endpoints == ([receiver.address] if expect_delta else [])
    assert torch.equal(sink.state_dict["w"], sd2["w"])


def test_delta_takes_true_false_or_auto_and_nothing_else():
    assert WeightSyncConfig().delta == "auto"
    assert WeightSyncConfig(delta=False).delta is False
    with pytest.raises(ValueError, match="delta"):
        WeightSyncConfig(delta="sometimes")


@pytest.mark.parametrize("mode, bases_after", [(True, 2), (False, 1), ("auto", 1)])
def test_a_receiver_keeps_a_base_only_while_its_sender_may_send_deltas(receivers, mode, bases_after):
    sd = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    (receiver, _), = receivers(1, sd=sd)
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    with WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=1024, delta=mode)) as sender:
        sender._delta = DeltaPolicy(mode, compare_bps=1.0)  # "auto": this link is faster than the compare
        for version in (1, 2, 3):
            sender.push(version, rank_shards(sd, 0, 1))
            assert sender.commit(version) == {receiver.address: None}
            if version > 1:  # staging for this version plus, where kept, the base of the one before
                assert receiver.area.staging_bytes == bases_after * model_bytes, version
