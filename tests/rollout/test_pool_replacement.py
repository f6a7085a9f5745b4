"""RolloutPool's worker fleet (rollout.fleet), on Ray actors that stand in for RolloutWorker (no vLLM, so it runs in
seconds): a replacement serves the committed policy_version before it takes work, from the trainer (the weight
publisher, or else the trainer's next push), and a pool with no way to get it fails instead of hanging; a live worker
that missed a push (``hold_back``) is caught up the same way, and replaced when the publisher cannot reach it.

The real workers (vLLM engines, gRPC pulls) are covered by test_pool.py and tests/integration/test_faults.py.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rollout.config import RolloutConfig  # noqa: E402
from rollout.pool import RolloutPool  # noqa: E402
from rollout.tasks.problem import Problem  # noqa: E402
from rollout.types import RolloutBatch, Sample  # noqa: E402

PROBLEMS = [Problem(prompt=f"p{i}", answer=str(i), problem_id=f"p{i}") for i in range(6)]


class FakeWorker:
    """RolloutWorker's pool-facing methods over a version number: a 'push' sets it, samples record it."""

    def __init__(self, config, reward=None, weight_sync=None, environment=None, trainer_session=None):
        self.version = 0
        self.changed = threading.Condition()

    def receiver_address(self):
        return f"fake:{os.getpid()}"

    def placement_group_id(self):
        return ray.get_runtime_context().get_placement_group_id()

    def policy_version(self):
        return self.version

    def receive(self, version):
        """What a committed push through the worker's receiver does."""
        with self.changed:
            self.version = version
            self.changed.notify_all()

    def wait_for_version(self, policy_version, timeout_s=None):
        with self.changed:
            self.changed.wait_for(lambda: self.version >= policy_version, timeout=timeout_s)
        return self.version

    def generate_groups(self, problems, group_ids, group_size, sampling=None, min_group_size=1, request_episodes=None):
        version = self.version
        time.sleep(0.2)
        samples = [
            Sample(np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(1, np.float32), reward=1.0, group_id=g,
                   policy_version=version)
            for g in group_ids for _ in range(group_size)
        ]  # fmt: skip
        return RolloutBatch(samples, {"rollout/num_completion_tokens": float(len(samples))})


@pytest.fixture(scope="module", autouse=True)
def ray_session(tmp_path_factory):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors need not import this test module
    ray.init(address="local", _temp_dir=str(tmp_path_factory.mktemp("ray")), include_dashboard=False, num_cpus=2)
    yield
    ray.shutdown()


class FakeWorkerOnAnExport(FakeWorker):
    """Its model directory is an export that records version 5 (its engine starts there)."""

    def __init__(self, config, reward=None, weight_sync=None, environment=None, trainer_session=None):
        super().__init__(config)
        self.version = 5


def _pool(
    monkeypatch, num_workers: int, restarts: int = 3, cpus: float = 0.0, placement=None, worker=FakeWorker
) -> RolloutPool:
    monkeypatch.setattr("rollout.worker.RolloutWorker", worker)
    config = RolloutConfig(model_path="unused", num_workers=num_workers, num_cpus_per_worker=cpus,
                           max_groups_per_dispatch=2, num_worker_restarts=restarts)  # fmt: skip
    return RolloutPool(config, placement=placement)


def _push(pool: RolloutPool, version: int) -> None:
    """A trainer push of ``version`` to every address the pool lists, then the driver's report of it (as
    driver.publisher.WeightPublisher.publish does it)."""
    pool.poll()
    by_address = {ray.get(a.receiver_address.remote()): a for a in pool.workers}
    ray.get([by_address[address].receive.remote(version) for address in pool.receiver_addresses()])
    pool.set_policy_version(version)


def _publisher(pool: RolloutPool, version: int, calls: list):
    def publish(addresses: list[str]) -> int:
        calls.append(list(addresses))
        by_address = {ray.get(a.receiver_address.remote()): a for a in pool.workers}
        ray.get([by_address[address].receive.remote(version) for address in addresses])
        return version

    return publish


def _collect_after_kill(pool: RolloutPool, victim) -> RolloutBatch:
    handle = pool.submit(PROBLEMS, group_size=2)
    ray.kill(victim)
    return pool.collect(handle, timeout_s=60)


def _assert_complete(batch: RolloutBatch, version: int) -> None:
    first = batch.samples[0].group_id  # group ids are unique per pool: this batch's are consecutive
    assert sorted({s.group_id for s in batch.samples}) == list(range(first, first + len(PROBLEMS)))
    assert len(batch.samples) == 2 * len(PROBLEMS)
    assert {s.policy_version for s in batch.samples} == {version}
    assert batch.metrics["rollout/num_redispatched"] >= 1


def test_lone_replacement_gets_the_committed_version_from_the_publisher(monkeypatch, caplog):
    pool = _pool(monkeypatch, num_workers=1)
    try:
        _push(pool, 3)
        calls: list = []
        pool.set_weight_publisher(_publisher(pool, 3, calls))
        (old,) = pool.receiver_addresses()
        with caplog.at_level("WARNING", logger="rollout.fleet"):
            batch = _collect_after_kill(pool, pool.workers[0])
        _assert_complete(batch, 3)  # regenerated by the replacement, on the committed version, not the initial one
        (new,) = pool.receiver_addresses()
        assert new != old and calls == [[new]]
        # A worker that died while generating was replaced without a word in the log (only lifecycle deaths said so).
        assert f"rollout worker {old} died while generating" in caplog.text and "replacing it" in caplog.text
    finally:
        pool.shutdown()


def test_a_replacement_on_an_exported_model_serves_the_version_it_records_without_a_push(monkeypatch):
    """A run from an export starts at its version: a replacement was taken to be at 0 and pushed that version, which its
    receiver refused as not newer, so it was replaced again until the restarts ran out."""
    pool = _pool(monkeypatch, num_workers=1, worker=FakeWorkerOnAnExport)
    try:
        pool.set_policy_version(5)  # the trainer's start, as the driver tells the pool

        def refuses_what_it_holds(addresses: list[str]) -> int:
            raise RuntimeError(f"pushing the current policy to {addresses} failed: version 5 is not newer than 5")

        pool.set_weight_publisher(refuses_what_it_holds)
        batch = _collect_after_kill(pool, pool.workers[0])
        _assert_complete(batch, 5)
    finally:
        pool.shutdown()


def test_pool_learns_versions_its_workers_serve(monkeypatch):
    pool = _pool(monkeypatch, num_workers=2)
    try:
        by_address = {ray.get(a.receiver_address.remote()): a for a in pool.workers}
        ray.get([a.receive.remote(2) for a in by_address.values()])  # pushed, but the driver did not report it...
        pool.collect(pool.submit(PROBLEMS[:2], group_size=1), timeout_s=60)
        assert pool.policy_version == 2  # ...the pool learned it from what its workers serve
        calls: list = []
        pool.set_weight_publisher(_publisher(pool, 2, calls))
        _assert_complete(_collect_after_kill(pool, pool.workers[0]), 2)
        pool.wait_for_workers(timeout_s=60)
        assert pool.policy_versions() == [2, 2] and len(calls) == 1  # the replacement was pushed version 2
    finally:
        pool.shutdown()


def test_receiver_addresses_reads_without_advancing(monkeypatch):
    pool = _pool(monkeypatch, num_workers=2)  # no publisher: a worker that needs weights waits for the next push
    try:
        _push(pool, 1)
        first, second = pool.receiver_addresses()
        pool.set_policy_version(2)  # committed, but the push missed the second worker
        pool.hold_back([second])
        refs = pool.fleet.pending_refs()
        assert len(refs) == 1 and ray.wait(refs, timeout=60)[0] == refs  # its version answer is in, not taken in yet
        assert pool.receiver_addresses() == pool.receiver_addresses() == [first]
        pool.poll()  # now the fleet advances: it serves version 1 < 2, so it waits for the next push and is listed
        assert pool.receiver_addresses() == [first, second]
    finally:
        pool.shutdown()


def test_replacement_without_a_source_waits_for_the_next_push(monkeypatch):
    pool = _pool(monkeypatch, num_workers=2)  # no weight publisher registered
    try:
        _push(pool, 1)
        _assert_complete(_collect_after_kill(pool, pool.workers[0]), 1)  # the live peer ran every group
        deadline = time.monotonic() + 60
        while len(pool.receiver_addresses()) < 2 and time.monotonic() < deadline:  # the replacement is starting
            pool.poll()
            time.sleep(0.1)
        assert len(pool.receiver_addresses()) == 2, "the next push must reach the waiting replacement"
        assert len(pool.policy_versions()) == 1, "the replacement (version 0) must not serve yet"
        _push(pool, 2)
        pool.wait_for_workers(timeout_s=60)
        assert pool.policy_versions() == [2, 2]
    finally:
        pool.shutdown()


def test_no_worker_and_no_source_fails_instead_of_hanging(monkeypatch):
    pool = _pool(monkeypatch, num_workers=1)
    try:
        _push(pool, 1)
        with pytest.raises(RuntimeError, match="set_weight_publisher"):
            _collect_after_kill(pool, pool.workers[0])
    finally:
        pool.shutdown()


def _push_to(pool: RolloutPool, version: int, missed: set[int]) -> None:
    """A trainer push of ``version`` that fails at the workers numbered in ``missed``; the driver reports both."""
    actors = pool.workers
    addresses = ray.get([a.receiver_address.remote() for a in actors])
    ray.get([a.receive.remote(version) for i, a in enumerate(actors) if i not in missed])
    pool.hold_back([addresses[i] for i in missed] + ["external:1"])  # unknown addresses (external servers) are ignored
    pool.set_policy_version(version)


def test_live_worker_that_missed_a_push_serves_nothing_old(monkeypatch):
    pool = _pool(monkeypatch, num_workers=2)
    try:
        _push(pool, 1)
        _push_to(pool, 2, missed={1})
        batch = pool.collect(pool.submit(PROBLEMS, group_size=2), timeout_s=60)
        assert {s.policy_version for s in batch.samples} == {2}  # never version 1 from the worker that missed it
        assert pool.policy_versions() == [2]  # no publisher: it waits for the next push, serving nothing meanwhile
        _push(pool, 3)
        pool.wait_for_workers(timeout_s=60)
        assert pool.policy_versions() == [3, 3]
    finally:
        pool.shutdown()


def test_lone_worker_that_missed_a_push_is_caught_up_by_the_publisher(monkeypatch):
    pool = _pool(monkeypatch, num_workers=1)
    try:
        calls: list = []
        pool.set_weight_publisher(_publisher(pool, 3, calls))
        (address,) = pool.receiver_addresses()
        _push_to(pool, 3, missed={0})
        batch = pool.collect(pool.submit(PROBLEMS, group_size=2), timeout_s=60)
        assert {s.policy_version for s in batch.samples} == {3}
        assert calls == [[address]] and pool.receiver_addresses() == [address]  # the same worker, not replaced
    finally:
        pool.shutdown()


def _refusing_once(pool: RolloutPool, version: int, calls: list):
    """A weight publisher whose first push is refused; later ones push ``version``."""
    reach = _publisher(pool, version, calls)

    def publish(addresses: list[str]) -> int:
        if not calls:
            calls.append("refused")
            raise RuntimeError("push refused")
        return reach(addresses)

    return publish


def test_worker_the_publisher_cannot_reach_is_replaced(monkeypatch):
    pool = _pool(monkeypatch, num_workers=1)
    try:
        calls: list = []
        pool.set_weight_publisher(_refusing_once(pool, 3, calls))
        (old,) = pool.receiver_addresses()
        _push_to(pool, 3, missed={0})
        batch = pool.collect(pool.submit(PROBLEMS, group_size=2), timeout_s=60)
        assert {s.policy_version for s in batch.samples} == {3}
        (new,) = pool.receiver_addresses()
        assert new != old and calls == ["refused", [new]]
    finally:
        pool.shutdown()


def test_worker_replaced_while_generating_hands_its_pieces_on_once(monkeypatch):
    pool = _pool(monkeypatch, num_workers=2, restarts=1)  # a second replacement would raise
    try:
        calls: list = []
        pool.set_weight_publisher(_refusing_once(pool, 2, calls))
        _push(pool, 1)
        handle = pool.submit(PROBLEMS, group_size=2)  # pieces now run on both workers
        old = pool.receiver_addresses()[1]
        _push_to(pool, 2, missed={1})  # worker 1 misses the push mid-generation; the publisher cannot reach it
        batch = pool.collect(handle, timeout_s=60)
        first = batch.samples[0].group_id
        assert sorted({s.group_id for s in batch.samples}) == list(range(first, first + len(PROBLEMS)))
        assert len(batch.samples) == 2 * len(PROBLEMS) and batch.metrics["rollout/num_redispatched"] >= 1
        pool.wait_for_workers(timeout_s=60)
        new = pool.receiver_addresses()[1]
        assert new != old and calls == ["refused", [new]]
    finally:
        pool.shutdown()


def test_a_replacement_takes_its_slots_bundle(monkeypatch):
    """Workers of a reserved pool (driver.reservation) run in its placement group, and so do their replacements:
    each slot's options (its bundle) are kept across replacements."""
    from driver.reservation import Role, release, reserve

    held = reserve([Role("rollout", {"CPU": 0.5}, 2, "SPREAD")], shared=False, name="fleet", timeout_s=30,
                   can_grow=False)  # fmt: skip
    pool = _pool(monkeypatch, 2, cpus=0.5, placement=held["rollout"].actor_placement())
    try:
        group = held["rollout"].group.id.hex()
        assert ray.get([w.placement_group_id.remote() for w in pool.workers]) == [group, group]
        victim = pool.workers[1]
        batch = _collect_after_kill(pool, victim)
        _assert_complete(batch, 0)
        assert pool.workers[1] is not victim
        assert ray.get([w.placement_group_id.remote() for w in pool.workers]) == [group, group]
    finally:
        pool.shutdown()
        release(held)
