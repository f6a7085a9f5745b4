"""A push of LoRA adapters alone (``WeightSender.push(min_version=...)``) lands only on a receiver that holds the base
they apply to: one holding an older version (a server restarted on its directory) takes nothing and is reported
``behind``, to be pushed the base with them; an adapter sink (adapters alone) is never behind."""

from __future__ import annotations

import torch

from weight_sync.config import WeightSyncConfig
from weight_sync.peft import holds_base, peft_name
from weight_sync.receiver import WeightReceiver
from weight_sync.sender import Shard, WeightSender
from weight_sync.sink import StateDictSink

BASE = "model.layers.0.self_attn.q_proj"
A, B = peft_name(BASE, "lora_A"), peft_name(BASE, "lora_B")


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{BASE}.weight": torch.randn(8, 8, generator=g), A: torch.randn(2, 8, generator=g),
            B: torch.randn(8, 2, generator=g)}  # fmt: skip


def _serve(names: list[str], port: int = 0) -> tuple[WeightReceiver, dict[str, torch.Tensor]]:
    held = {name: torch.zeros_like(t) for name, t in _tensors(0).items() if name in names}
    receiver = WeightReceiver(StateDictSink(held), WeightSyncConfig(port=port))
    receiver.start()
    return receiver, held


def _push(sender: WeightSender, version: int, names: list[str], seed: int, min_version: int = -1):
    shards = [Shard(n, t, tuple(t.shape), (0,) * t.ndim) for n, t in _tensors(seed).items() if n in names]
    report = sender.push(version, shards, min_version=min_version)
    report.errors.update({a: e for a, e in sender.commit(version).items() if e})
    return report


def test_holds_base_tells_a_base_model_from_adapters_alone() -> None:
    assert holds_base([f"{BASE}.weight", A, B]) and not holds_base([A, B]) and not holds_base([])


def test_a_receiver_restarted_at_an_older_version_is_sent_no_adapters_alone_until_it_gets_the_base() -> None:
    everything, adapters = [f"{BASE}.weight", A, B], [A, B]
    server, held = _serve(everything)
    port = int(server.address.rpartition(":")[2])
    sink, sink_held = _serve(adapters)  # an adapter sink: adapters alone, no base to lack
    with WeightSender([server.address, sink.address], WeightSyncConfig(delta=False)) as sender:
        try:
            first = _push(sender, 3, everything, seed=1)  # the base trained at version 3 goes out with the adapters
            assert first.failed.keys() == {sink.address}  # the base is not an adapter sink's
            second = _push(sender, 4, adapters, seed=2, min_version=3)
            assert second.failed == {} and second.behind == {}
            assert torch.equal(held[f"{BASE}.weight"], _tensors(1)[f"{BASE}.weight"])
            assert torch.equal(held[A], _tensors(2)[A]) and torch.equal(sink_held[A], _tensors(2)[A])

            server.stop(grace_s=0)  # restarted on its directory: back at version 0, the base it started with
            server, held = _serve(everything, port)
            third = _push(sender, 5, adapters, seed=3, min_version=3)
            assert third.behind == {server.address: 0}
            assert "older than 3, the base model these adapters apply to" in third.failed[server.address]
            assert server.policy_version == 0 and not held[A].any()  # nothing landed on the wrong base
            assert sink.policy_version == 5  # adapters alone are all an adapter sink holds

            with WeightSender([server.address], WeightSyncConfig(delta=False)) as once:
                assert _push(once, 5, everything, seed=1).failed == {}  # the same version again, with the base
            assert server.policy_version == 5
            assert torch.equal(held[f"{BASE}.weight"], _tensors(1)[f"{BASE}.weight"])
            assert _push(sender, 6, adapters, seed=4, min_version=3).failed == {}
        finally:
            server.stop(grace_s=0)
            sink.stop(grace_s=0)


def test_a_receiver_at_a_version_this_session_did_not_commit_gets_the_base_with_the_adapters() -> None:
    """A server started on a copy of another run's model recording version 600 took this run's adapters alone from
    version 601 on, merged into that other base, because 600 is not below the base's version: version numbers alone
    cannot tell whose base a receiver holds. Since protocol 1.4 Begin says which session committed its version."""
    everything, adapters = [f"{BASE}.weight", A, B], [A, B]
    held = {name: torch.zeros_like(t) for name, t in _tensors(0).items()}
    sink = StateDictSink(held)
    sink.policy_version = 10  # another run's model, recorded at version 10
    server = WeightReceiver(sink, WeightSyncConfig())
    server.start()
    try:
        with WeightSender([server.address], WeightSyncConfig(delta=False), session_id="run-b") as sender:
            first = _push(sender, 11, adapters, seed=2, min_version=3)
            assert first.behind == {server.address: 10}
            assert "comes from no push since it started, not this run's" in first.failed[server.address]
            assert server.policy_version == 10 and not held[A].any()  # nothing landed on the other base
            assert _push(sender, 11, everything, seed=2).failed == {}  # the publisher's push with the base
            assert _push(sender, 12, adapters, seed=3, min_version=11).failed == {}  # now this session's base
            assert torch.equal(held[A], _tensors(3)[A])
            assert torch.equal(held[f"{BASE}.weight"], _tensors(2)[f"{BASE}.weight"])
        with WeightSender([server.address], WeightSyncConfig(delta=False), session_id="someone-else") as other:
            assert _push(other, 13, everything, seed=4).failed == {}  # another sender replaced the weights
        with WeightSender([server.address], WeightSyncConfig(delta=False), session_id="run-b") as sender:
            again = _push(sender, 14, adapters, seed=5, min_version=11)
            assert again.behind == {server.address: 13} and "comes from session 'someone-else'" in str(again.failed)
    finally:
        server.stop(grace_s=0)
