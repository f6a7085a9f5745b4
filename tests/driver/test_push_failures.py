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
