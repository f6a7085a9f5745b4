"""``driver.publisher.push_failures``: what the driver reports of a push from the trainer ranks' outcomes."""

from __future__ import annotations

from driver.publisher import push_failures


def test_every_rank_s_reason_is_kept_once_per_receiver() -> None:
    cut = "Push: CANCELLED: shared-memory stream cut before its end"
    refused = "Push: INVALID_ARGUMENT: model.norm.weight: shard at (0,) (128,) was pushed twice"
    outcomes = [
        {"push_errors": {"a:1": refused, "b:2": ""}, "commit_errors": {"c:3": "NOT_FOUND: no open update"}},
        {"push_errors": {"a:1": cut, "b:2": ""}},
        {"push_errors": {"a:1": cut}},
    ]
    assert push_failures(outcomes) == {"a:1": f"{refused}; {cut}", "c:3": "NOT_FOUND: no open update"}
    assert push_failures([{"push_errors": {"a:1": ""}, "commit_errors": {}}]) == {}


class _Trainer:
    """Two ranks whose first push finds ``b:2`` behind the base (a server restarted on its directory)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str] | None, bool]] = []

    def set_weight_endpoints(self, endpoints: list[str]) -> None:
        pass

    def push_weights(self, endpoints: list[str] | None = None, with_base: bool = False) -> list[dict]:
        self.calls.append((endpoints, with_base))
        if with_base:
            return [{"policy_version": 7, "push_errors": {}, "commit_errors": {}, "seconds": 2.0, "payload_bytes": 9,
                     "behind": {}}, {"policy_version": 7, "push_errors": {}, "seconds": 2.0, "payload_bytes": 9,
                                     "behind": {}}]  # fmt: skip
        why = "Begin: it holds policy_version 0, older than 3"
        rank = {"policy_version": 7, "push_errors": {"b:2": why}, "seconds": 1.0, "payload_bytes": 1,
                "behind": {"b:2": 0}}  # fmt: skip
        return [{**rank, "commit_errors": {"b:2": f"not committed: its push failed ({why})"}}, dict(rank)]


class _Pool:
    def __init__(self) -> None:
        self.held_back: list[str] | None = None

    def set_weight_publisher(self, push_to: object) -> None:
        pass

    def poll(self) -> None:
        pass

    def receiver_addresses(self) -> list[str]:
        return ["a:1"]

    def set_policy_version(self, version: int) -> None:
        pass

    def hold_back(self, addresses: list[str]) -> None:
        self.held_back = addresses


def test_receivers_behind_the_base_are_pushed_it_with_the_adapters_at_once() -> None:
    from driver.publisher import WeightPublisher

    trainer, pool = _Trainer(), _Pool()
    publisher = WeightPublisher(trainer, pool, external=["b:2"])
    metrics = publisher.publish()
    assert trainer.calls == [(None, False), (["b:2"], True)]
    assert metrics["push/num_failed_receivers"] == 0 and metrics["push/bytes"] == 20 and metrics["push/seconds"] == 3
    assert pool.held_back == [] and publisher.published_version == 7 and publisher.external_unserved == {}
    assert publisher.push_to(["b:2"]) == 7  # a catch-up push follows up the same way


class _DownThenUp:
    """A trainer whose pushes to the external ``b:2`` fail for ``down`` publishes, then succeed."""

    def __init__(self, down: int) -> None:
        self.down, self.version = down, 0

    def set_weight_endpoints(self, endpoints: list[str]) -> None:
        pass

    def push_weights(self, endpoints: list[str] | None = None, with_base: bool = False) -> list[dict]:
        self.version += 1
        errors = {"b:2": "UNAVAILABLE: connection refused"} if self.version <= self.down else {}
        return [{"policy_version": self.version, "push_errors": errors, "commit_errors": {}, "seconds": 1.0,
                 "payload_bytes": 1, "behind": {}}]  # fmt: skip


def test_a_receiver_down_for_many_steps_is_logged_when_it_fails_and_when_it_is_back(caplog, monkeypatch) -> None:
    """A receiver down an hour logged a warning at every step (3,600 lines at 1 s a step), each saying a pool worker
    would get no work, of an external server."""
    import driver.publisher
    from driver.publisher import WeightPublisher

    clock = [0.0]
    monkeypatch.setattr(driver.publisher.time, "monotonic", lambda: clock[0])
    publisher = WeightPublisher(_DownThenUp(down=30), _Pool(), external=["b:2"])
    with caplog.at_level("INFO", logger="rl_align"):
        for _ in range(40):
            clock[0] += 30.0  # 30 s a step: 15 min down
            publisher.publish()
    said = [r.getMessage() for r in caplog.records if "b:2" in r.getMessage()]
    assert len(said) == 3, said  # failing, still failing (10 min later), back
    assert "an external server: it keeps serving its old version" in said[0] and "pool worker" not in said[0]
    assert "(21 pushes in a row" in said[1]
    assert "succeeded again after 30 failed push(es): it serves version 31" in said[2]
