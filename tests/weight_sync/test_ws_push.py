"""End to end on loopback: 2 sender ranks x 3 receivers, sharded assembly, deltas, versions, late joiners."""

import pytest
import torch
from ws_helpers import rank_shards, run_ranks, shard_rows, tiny_state_dict

from weight_sync.config import WeightSyncConfig
from weight_sync.sender import Shard, WeightSender

CFG = WeightSyncConfig(chunk_bytes=4096)


def push_all(senders, version, sd):
    reports = run_ranks(lambda r: senders[r].push(version, rank_shards(sd, r, len(senders))), len(senders))
    committed = senders[0].commit(version)
    return reports, committed


def assert_holds(sinks, sd):
    for sink in sinks:
        for name, tensor in sd.items():
            assert sink.state_dict[name].dtype == tensor.dtype
            assert torch.equal(sink.state_dict[name], tensor), name


def test_two_ranks_three_receivers_assemble_every_tensor_exactly(receivers):
    pairs = receivers(3)
    endpoints = [r.address for r, _ in pairs]
    sd = tiny_state_dict(1)
    senders = [WeightSender(endpoints, CFG, rank=r, num_ranks=2, session_id="run") for r in range(2)]
    reports, committed = push_all(senders, 1, sd)
    assert all(not rep.failed for rep in reports) and all(e is None for e in committed.values())
    assert [r.policy_version for r, _ in pairs] == [1, 1, 1]
    assert_holds([s for _, s in pairs], sd)
    assert sum(rep.payload_bytes for rep in reports) == sum(t.numel() * t.element_size() for t in sd.values())
    for s in senders:
        s.close()


def test_tensor_parallel_column_shards_and_2d_blocks(receivers):
    sd = {"w": torch.randn(6, 10), "e": torch.randn(5, 7, dtype=torch.float64).to(torch.bfloat16)}
    (receiver, sink), = receivers(1, sd=sd)
    shards = [
        [shard_rows("w", sd["w"], 0, 2, dim=1), Shard("e", sd["e"][:3, :4].clone(), (5, 7), (0, 0)),
         Shard("e", sd["e"][3:, :4].clone(), (5, 7), (3, 0))],
        [shard_rows("w", sd["w"], 1, 2, dim=1), Shard("e", sd["e"][:, 4:].clone(), (5, 7), (0, 4))],
    ]
    senders = [
        WeightSender([receiver.address], WeightSyncConfig(chunk_bytes=64), rank=r, num_ranks=2) for r in range(2)
    ]
    run_ranks(lambda r: senders[r].push(3, shards[r]), 2)
    assert senders[0].commit(3) == {receiver.address: None}
    assert_holds([sink], sd)


@pytest.mark.parametrize("encoding", ["sparse", "xor_zstd"])
def test_delta_after_full_sends_fewer_bytes_and_a_late_joiner_gets_a_full_push(receivers, encoding):
    config = WeightSyncConfig(chunk_bytes=4096, delta=True, delta_encoding=encoding)
    sd = {"w": torch.randn(64, 64).to(torch.bfloat16), "b": torch.randn(64)}
    pairs = receivers(3, sd=sd)
    first, late = pairs[:2], pairs[2]
    senders = [WeightSender([r.address for r, _ in first], config, rank=r, num_ranks=2) for r in range(2)]
    full, _ = push_all(senders, 1, sd)
    sd2 = {k: v.clone() for k, v in sd.items()}
    sd2["w"][::16, ::8] += 1  # ~0.8% of the values change
    for s in senders:
        s.add_endpoint(late[0].address)
    delta, committed = push_all(senders, 2, sd2)
    assert all(e is None for e in committed.values())
    for rep in delta:
        assert sorted(rep.delta_endpoints) == sorted(r.address for r, _ in first)  # the late joiner is at version 0
    assert_holds([s for _, s in (*first, late)], sd2)
    sd3 = {k: v.clone() for k, v in sd2.items()}
    sd3["w"][1, :4] -= 2
    third, committed = push_all(senders, 3, sd3)
    assert all(e is None for e in committed.values())
    assert all(len(rep.delta_endpoints) == 3 for rep in third)
    assert sum(rep.bytes_sent for rep in third) < sum(rep.bytes_sent for rep in full) / 2  # 3 receivers vs 2
    assert_holds([s for _, s in (*first, late)], sd3)


def test_version_regression_and_equal_versions_are_refused(receivers):
    pairs = receivers(2)
    sd = tiny_state_dict(2)
    sender = WeightSender([r.address for r, _ in pairs], CFG)
    report = sender.push(5, rank_shards(sd, 0, 1))
    assert not report.failed and all(e is None for e in sender.commit(5).values())
    for version in (5, 4):
        report = sender.push(version, rank_shards(tiny_state_dict(3), 0, 1))
        assert len(report.failed) == 2
        assert all("FAILED_PRECONDITION" in e and "not newer" in e for e in report.failed.values())
    assert [r.policy_version for r, _ in pairs] == [5, 5]
    assert_holds([s for _, s in pairs], sd)


def test_mismatched_model_fails_fast(receivers):
    (receiver, _), = receivers(1)
    sender = WeightSender([receiver.address], CFG)
    try:
        sender.push(1, [Shard("model.norm.weight", torch.zeros(17), (17,), (0,))])
    except ValueError as e:
        assert "same model" in str(e)
    else:
        raise AssertionError("a shape mismatch must fail before streaming")


def test_a_receiver_of_another_model_is_reported_each_push_and_the_others_take_it(receivers):
    """One external server started on the wrong model stopped every push, and the run with it."""
    (good, sink), = receivers(1)
    (other, other_sink), = receivers(1, sd={"model.norm.weight": torch.zeros(17)})
    sender = WeightSender([good.address, other.address], CFG)
    for version in (1, 2):
        sd = tiny_state_dict(version)
        report = sender.push(version, rank_shards(sd, 0, 1))
        assert report.ok == [good.address]
        assert "does not accept" in report.failed[other.address] and "same model" in report.failed[other.address]
        committed = sender.commit(version)
        assert committed[good.address] is None and "its push failed" in committed[other.address]
        assert_holds([sink], sd)
    assert other.policy_version == 0 and not other_sink.state_dict["model.norm.weight"].any()


def test_unreachable_receiver_is_reported_left_out_for_a_while_and_the_others_commit(receivers):
    (receiver, sink), = receivers(1)
    dead = "127.0.0.1:1"
    config = WeightSyncConfig(chunk_bytes=4096, num_retries=0, rpc_timeout_s=2)
    sender = WeightSender([receiver.address, dead], config)
    for version in (1, 2):
        sd = tiny_state_dict(3 + version)
        report = sender.push(version, rank_shards(sd, 0, 1))
        assert report.ok == [receiver.address] and "UNAVAILABLE" in report.failed[dead]
        committed = sender.commit(version)
        assert committed[receiver.address] is None and "its push failed" in committed[dead]
        assert_holds([sink], sd)
    # The second push did not try it again (each try cost its Describe and Begin retries): it is left out a while.
    assert report.failed[dead].startswith("left out for ") and "its last try failed" in report.failed[dead]


def test_a_receiver_restarted_on_another_data_port_gets_socket_streams_again(receivers):
    """The sender kept the data port a receiver had before its restart, and sent it every later version over gRPC."""
    from ws_helpers import zeros_like_dict

    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import StateDictSink

    (receiver, _), = receivers(1)
    port = int(receiver.address.rpartition(":")[2])
    sender = WeightSender([receiver.address], CFG)
    assert sender.push(1, rank_shards(tiny_state_dict(1), 0, 1)).socket_endpoints == [receiver.address]
    assert not any(sender.commit(1).values())
    receiver.stop(grace_s=0)
    sink = StateDictSink(zeros_like_dict(tiny_state_dict()))
    restarted = WeightReceiver(sink, WeightSyncConfig(chunk_bytes=4096, port=port))
    restarted.start()
    try:
        reports = [sender.push(v, rank_shards(tiny_state_dict(v), 0, 1)) for v in (2, 3)]
        assert not any(r.failed for r in reports), [r.failed for r in reports]
        assert reports[1].socket_endpoints == [restarted.address] and not reports[1].grpc_fallback
    finally:
        restarted.stop(grace_s=0)


def test_receivers_of_two_dtypes_get_the_wider_and_the_narrower_one_is_told_what_to_change(receivers):
    """A float32 engine beside a directory sink of the bfloat16 file: the engine gets exact values, the sink a clear
    per-push refusal (the run failed at its first push before, or the engine served rounded weights)."""
    sd = {"w": torch.randn(8, 8), "b": torch.randn(8)}
    (wide, wide_sink), = receivers(1, sd=sd)
    (narrow, _), = receivers(1, sd={k: v.to(torch.bfloat16) for k, v in sd.items()})
    sender = WeightSender([narrow.address, wide.address], CFG)
    dtypes = sender.declared_dtypes()
    assert dtypes == {"w": "float32", "b": "float32"}
    report = sender.push(1, [Shard(n, t.to(getattr(torch, dtypes[n])), tuple(t.shape), (0,) * t.dim())
                             for n, t in sd.items()])  # fmt: skip
    assert report.ok == [wide.address]
    assert "declares w as bfloat16, and this push sends it as float32" in report.failed[narrow.address]
    assert sender.commit(1)[wide.address] is None
    assert_holds([wide_sink], sd)


def test_refusals_are_this_pushs_and_a_receiver_that_is_down_may_still_be_the_one_that_takes_them(receivers):
    """The refusal of a receiver now down, counted against the one receiver that answered, made a push raise and end
    the run; so did every answering receiver refusing while the one that takes the shards was away."""
    sd = {"w": torch.randn(8, 8), "b": torch.randn(8)}
    (wide, wide_sink), = receivers(1, sd=sd)
    (narrow, _), = receivers(1, sd={k: v.to(torch.bfloat16) for k, v in sd.items()})
    (other, _), = receivers(1, sd={"w": torch.zeros(3, 3)})
    config = WeightSyncConfig(chunk_bytes=4096, num_retries=0, rpc_timeout_s=2)
    sender = WeightSender([wide.address, narrow.address, other.address], config)

    def push(version: int):
        dtypes = sender.declared_dtypes()
        return sender.push(version, [Shard(n, t.to(getattr(torch, dtypes.get(n, "float32"))), tuple(t.shape),
                                           (0,) * t.dim()) for n, t in sd.items()])  # fmt: skip

    first = push(1)
    assert first.ok == [wide.address] and "same model" in first.failed[other.address]
    assert "declares w as bfloat16" in first.failed[narrow.address]
    assert sender.commit(1)[wide.address] is None
    other.stop(grace_s=0)  # refused before; now down
    assert push(2).ok == [wide.address]
    assert sender.commit(2)[wide.address] is None
    wide.stop(grace_s=0)  # the one that takes float32 is away: the bfloat16 one answering alone is no setup error
    third = push(3)
    assert not third.ok and "declares w as bfloat16" in third.failed[narrow.address]
    assert_holds([wide_sink], sd)
