"""Relay: receivers forward chunks to each other, so the sender's bytes per version do not grow with the fleet."""

import pytest
import torch
from ws_helpers import rank_shards, run_ranks

from weight_sync.config import WeightSyncConfig
from weight_sync.relay import split_tree
from weight_sync.sender import WeightSender

SD = {"w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(32), "e": torch.randn(16, 8, 4)}
MODEL_BYTES = sum(t.numel() * t.element_size() for t in SD.values())


def test_split_tree_covers_every_target_once():
    targets = [f"h:{i}" for i in range(8)]
    for fanout in (1, 2, 3, 8):
        groups = split_tree(targets, fanout)
        assert len(groups) == min(fanout, 8)
        assert sorted(t for head, rest in groups for t in (head, *rest)) == sorted(targets)
    assert split_tree(targets, 0) == [(t, []) for t in targets]


@pytest.mark.parametrize("plane", ["auto", "grpc"])  # auto: the relay tree rides the socket data plane
def test_eight_receivers_get_exact_weights_while_the_sender_sends_at_most_fanout_times_the_model(receivers, plane):
    for fanout in (2, 1):
        config = WeightSyncConfig(chunk_bytes=1024, relay_fanout=fanout, delta=False, data_plane=plane)
        pairs = receivers(8, config=config, sd=SD)
        senders = [WeightSender([r.address for r, _ in pairs], config, rank=k, num_ranks=2) for k in range(2)]
        reports = run_ranks(lambda k, senders=senders: senders[k].push(1, rank_shards(SD, k, 2)), 2)
        assert all(not rep.failed and len(rep.ok) == 8 for rep in reports)
        assert all(len(rep.socket_endpoints) == (fanout if plane == "auto" else 0) for rep in reports)
        assert all(e is None for e in senders[0].commit(1).values())
        for receiver, sink in pairs:
            assert receiver.policy_version == 1
            assert all(torch.equal(sink.state_dict[k], v) for k, v in SD.items())
        sent = sum(rep.bytes_sent for rep in reports)
        overhead = sum(rep.bytes_sent - fanout * rep.payload_bytes for rep in reports)
        assert sent <= fanout * MODEL_BYTES + overhead and overhead < 0.1 * MODEL_BYTES  # headers only
        for s in senders:
            s.close()


@pytest.mark.parametrize("plane", ["auto", "grpc"])
def test_a_dead_leaf_is_reported_and_the_rest_of_the_tree_commits(receivers, plane):
    config = WeightSyncConfig(chunk_bytes=1024, relay_fanout=2, num_retries=0, rpc_timeout_s=3, data_plane=plane)
    pairs = receivers(4, config=config, sd=SD)
    dead = "127.0.0.1:1"
    endpoints = [pairs[0][0].address, dead, *[r.address for r, _ in pairs[1:]]]  # dead is a leaf under pairs[0]
    sender = WeightSender(endpoints, config)
    report = sender.push(1, rank_shards(SD, 0, 1))
    assert set(report.failed) == {dead}
    committed = sender.commit(1)
    assert committed[dead] and all(committed[r.address] is None for r, _ in pairs)
    assert all(torch.equal(sink.state_dict["w"], SD["w"]) for _, sink in pairs)


@pytest.mark.parametrize("plane", ["auto", "grpc"])
def test_deltas_travel_through_the_relay_with_several_streams_per_rank(receivers, plane):
    config = WeightSyncConfig(chunk_bytes=512, relay_fanout=2, num_streams=3, data_plane=plane, delta=True)
    pairs = receivers(5, config=config, sd=SD)
    senders = [WeightSender([r.address for r, _ in pairs], config, rank=k, num_ranks=2) for k in range(2)]
    sd = {k: v.clone() for k, v in SD.items()}
    for version in (1, 2, 3):
        if version > 1:
            sd["w"][version, :5] += 1
            sd["e"][:, 1, 2] -= 1
        reports = run_ranks(lambda k, version=version: senders[k].push(version, rank_shards(sd, k, 2)), 2)
        assert all(not rep.failed for rep in reports)
        assert all(len(rep.delta_endpoints) == (0 if version == 1 else 5) for rep in reports)
        assert all(e is None for e in senders[0].commit(version).values())
        for receiver, sink in pairs:
            assert receiver.policy_version == version
            assert all(torch.equal(sink.state_dict[k], v) for k, v in sd.items())
