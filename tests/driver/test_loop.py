"""The RL loop's ordering, with hand-written fakes for the pool, trainer and dataset (the real ones are exercised by
tests/integration): sync trains on-policy, async keeps generation one batch ahead, dynamic sampling drops groups whose
rewards are all equal, each step checkpoints the dataset cursor of the batch it trained on when due, and the
publisher tells the pool every committed version and pushes to a replacement worker on the pool's request."""

import numpy as np
import pytest

from driver.loop import RLLoop
from driver.publisher import WeightPublisher, engines_behind
from recipe import load_recipe
from rollout.metrics import sample_metrics
from rollout.types import RolloutBatch, Sample


class FakeDataset:
    def __init__(self):
        self.position = 0

    def next_batch(self, n):
        out = list(range(self.position, self.position + n))
        self.position += n
        return out

    def state_dict(self):
        return {"position": self.position}

    @property
    def stream_position(self):
        return self.position


class FakePool:
    """Problem p's group scores 1,0,1,0.. when p is even and all 0 when p is odd (so odd groups are uninformative).

    ``replace_on_collect``: collecting that handle simulates a dead worker whose replacement (serving version 0) gets
    the committed version from the loop's weight publisher before it regenerates the batch, as the real pool does.
    """

    def __init__(self, events, replace_on_collect=None, bonus=0.0):
        self.events, self.version, self._handles, self._num_submitted = events, 0, {}, 0
        self.bonus = bonus  # a second reward term: the first sample of every group gets it
        self.replace_on_collect, self.publish, self.committed, self.held_back = replace_on_collect, None, [], []
        self.extra_metrics: dict[str, float] = {}  # added to every batch's metrics

    def set_weight_publisher(self, publish):
        self.publish = publish

    def poll(self):
        pass

    def receiver_addresses(self):
        return ["worker:1"]

    def set_policy_version(self, version):
        self.committed.append(version)

    def hold_back(self, addresses):
        self.held_back.append(list(addresses))

    def submit(self, problems, group_size, sampling=None, first_group_id=None, min_group_size=1, budget_of=0):
        self.budgets_of = [*getattr(self, "budgets_of", []), budget_of]
        handle, self._num_submitted = self._num_submitted, self._num_submitted + 1
        self._handles[handle] = (list(problems), group_size, self.version)
        self.events.append(("submit", handle, self.version))
        self.group_ids = [*getattr(self, "group_ids", []), (first_group_id, list(problems))]
        self.min_group_sizes = [*getattr(self, "min_group_sizes", []), min_group_size]
        return handle

    def collect(self, handle):
        problems, group_size, version = self._handles.pop(handle)
        if handle == self.replace_on_collect:
            version = self.publish(["replacement:1"])
            self.events.append(("published", version))
        def terms(p, k):
            return {"exact_match": float(p % 2 == 0 and k % 2 == 0), "format": self.bonus * (k == 0)}

        samples = [
            Sample(np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(1, np.float32),
                   reward=sum(terms(p, k).values()), group_id=p, policy_version=version, reward_terms=terms(p, k))
            for p in problems for k in range(group_size)
        ]  # fmt: skip
        counters = {"rollout/seconds": 0.5, "rollout/num_completion_tokens": float(len(samples))}
        return RolloutBatch(samples, {**counters, **sample_metrics(samples), **self.extra_metrics})


class FakeTrainer:
    """A TrainerGroup over a version number: a regular push makes the pool generate with it."""

    def __init__(self, events, pool, failing=()):
        self.events, self.pool, self.version, self.endpoints, self.failing = events, pool, 0, [], set(failing)

    def policy_version(self):
        return self.version

    def set_weight_endpoints(self, endpoints):
        self.endpoints = list(endpoints)

    def push_weights(self, endpoints=None):
        if endpoints is not None:
            self.events.append(("push_to", tuple(endpoints), self.version))
            return [{"policy_version": self.version, "push_errors": {}, "commit_errors": {}}]
        self.pool.version = self.version
        self.events.append(("push", self.version))
        errors = {a: ("refused" if a in self.failing else None) for a in self.endpoints}
        return [{"policy_version": self.version, "push_errors": errors, "commit_errors": {}, "seconds": 0.1,
                 "payload_bytes": 10}]  # fmt: skip

    def train_step(self, batch):
        self.events.append(("train", sorted(batch.groups())))
        self.version += 1
        return {"policy_version": float(self.version), "step_s": 0.0, "process_cpu_s": 0.0}

    def save_checkpoint(self, data_cursor):
        self.events.append(("checkpoint", self.version, data_cursor["position"]))

    def export_hf(self, path, source_dir, dtype=None, adapter=True, use_chat_template=None):
        self.events.append(("export", self.version, path.rsplit("/", 2)[-2:]))


def _run(overrides, num_steps=3, replace_on_collect=None, pool_out=None, failing=(), bonus=0.0, extra_metrics=None):
    recipe = load_recipe("recipes/grpo_tiny.toml", {"run.num_steps": num_steps, "run.num_prompts_per_step": 2,
                                                    "algorithm.group_size": 2, **overrides})  # fmt: skip
    events, logged = [], []
    pool = FakePool(events, replace_on_collect, bonus)
    pool.extra_metrics = extra_metrics or {}
    trainer = FakeTrainer(events, pool, failing)
    publisher = WeightPublisher(trainer, pool, external=["external:1"])

    def log(step, metrics):
        logged.append((step, metrics))
        events.append(("log", step))

    loop = RLLoop(recipe, pool, trainer, FakeDataset(), publisher, log, dict)
    loop.run(start_step=0)
    if pool_out is not None:
        pool_out.append(pool)
    return events, logged


def test_sync_mode_is_on_policy():
    events, logged = _run({})
    submits = [e for e in events if e[0] == "submit"]
    assert [v for _, _, v in submits] == [0, 1, 2]  # each batch generated by the latest pushed weights
    assert [e[0] for e in events] == ["submit"] + ["train", "push", "submit", "log"] * 2 + ["train", "push", "log"]
    assert [m["rollout/staleness_max"] for _, m in logged] == [0.0, 0.0, 0.0]


def test_a_group_relative_algorithm_asks_for_groups_that_keep_two_episodes():
    # A group left with one episode (the others failed) gives no group-relative advantage: the trainer refuses it.
    for algorithm, least in (("grpo", 2), ("ppo", 1)):
        pools: list = []
        _run({"algorithm.type": algorithm}, num_steps=1, pool_out=pools)
        assert pools[0].min_group_sizes == [least]


def test_async_mode_generates_the_next_batch_before_training():
    events, logged = _run({"run.mode": "async", "run.max_staleness": 1}, num_steps=4)
    assert [v for kind, _, v in (e for e in events if e[0] == "submit")] == [0, 0, 1, 2]
    kinds = [e[0] for e in events]
    assert kinds[:6] == ["submit", "submit", "train", "push", "log", "submit"]
    assert kinds.count("submit") == 4 and kinds.count("train") == 4
    assert [m["rollout/staleness_max"] for _, m in logged] == [0.0, 1.0, 1.0, 1.0]


def test_async_staleness_never_exceeds_the_bound():
    _, logged = _run({"run.mode": "async", "run.max_staleness": 2}, num_steps=6)
    assert max(m["rollout/staleness_max"] for _, m in logged) == 2.0


def test_checkpoints_when_due_with_the_cursor_of_the_trained_batch():
    events, _ = _run({"run.mode": "async", "run.max_staleness": 1, "trainer.checkpoint.every_num_steps": 2},
                     num_steps=4)  # fmt: skip
    assert [e for e in events if e[0] == "checkpoint"] == [("checkpoint", 2, 4), ("checkpoint", 4, 8)]
    # Batches 3 and 4 were already drawn when the checkpoint after step 2 was taken: the cursor is of step 2's batch.
    # It is taken once step 2's record is written (a job killed between the two resumes with every earlier step's
    # record) and before step 3 trains (it holds the weights after step 2).
    first = events.index(("checkpoint", 2, 4))
    assert events.index(("log", 1)) < first < [i for i, e in enumerate(events) if e[0] == "train"][2]
    assert events.index(("log", 3)) < events.index(("checkpoint", 4, 8))


def test_every_step_before_a_checkpoint_is_logged_and_exported_before_it_commits():
    events, _ = _run({"trainer.checkpoint.every_num_steps": 1, "run.export.every_num_steps": 2}, num_steps=4)
    for i, event in enumerate(events):
        if event[0] in ("checkpoint", "export"):
            steps_done = event[1]  # the trainer's version counts the steps trained
            logged = {e for e in events[:i] if e[0] == "log"}
            assert {("log", s) for s in range(steps_done)} <= logged, (event, events[:i])
        if event[0] == "checkpoint":
            exported = {e[1] for e in events[:i] if e[0] == "export"}
            assert {s for s in (2, 4) if s <= event[1]} <= exported, (event, events[:i])
    assert [e[:2] for e in events if e[0] == "export"] == [("export", 2), ("export", 4)]


def test_no_checkpoint_unless_asked():
    events, _ = _run({"trainer.checkpoint.every_num_steps": 0})
    assert not [e for e in events if e[0] == "checkpoint"]


def test_dynamic_sampling_keeps_only_informative_groups():
    pools: list = []
    events, logged = _run({"run.dynamic_sampling.enabled": True}, num_steps=1, pool_out=pools)
    (_, groups), = [e for e in events if e[0] == "train"]
    assert groups == [0, 2]  # problem 1 (all rewards 0) dropped, problem 2 drawn in a second round
    metrics = logged[0][1]
    assert metrics["rollout/dynamic_sampling_rounds"] == 2.0
    # The reward curve shows everything sampled (groups 0, 1 and 2: 1/6 of 6 samples... per group 1,0 | 0,0 | 1,0),
    # the batch trained on (groups 0 and 2) its own figure.
    assert metrics["reward/mean"] == 2 / 6 and metrics["rollout/num_samples"] == 6.0
    assert metrics["reward/filtered_mean"] == 2 / 4
    # So do the counters: both rounds' tokens and seconds (the first round's alone before).
    assert metrics["rollout/num_completion_tokens"] == 6.0 and metrics["rollout/seconds"] == 1.0
    assert metrics["rollout/tokens_per_s"] == 6.0
    # The refill (1 problem) may drop as many failed episodes as the step's batch (_run: 2 problems x 2 episodes).
    assert pools[0].budgets_of == [4, 4]


def test_pool_is_told_each_committed_version():
    pools = []
    _run({"run.mode": "async", "run.max_staleness": 1}, num_steps=3, pool_out=pools)
    assert pools[0].committed == [1, 2, 3]  # after every push


def test_failed_push_holds_back_pool_workers_and_reports_external_ones():
    pools = []
    _, logged = _run({}, num_steps=2, pool_out=pools, failing=("worker:1", "external:1"))
    assert pools[0].held_back == [["worker:1", "external:1"]] * 2  # the pool ignores addresses it does not own
    assert [m["push/num_failed_receivers"] for _, m in logged] == [2.0, 2.0]


def test_replacement_gets_the_committed_version_from_the_publisher():
    # Sync: batch 2 is submitted after the push of version 2; its worker dies and the replacement needs version 2.
    events, logged = _run({}, num_steps=3, replace_on_collect=2)
    assert ("push_to", ("replacement:1",), 2) in events and ("published", 2) in events
    assert events.index(("published", 2)) < [i for i, e in enumerate(events) if e[0] == "train"][2]
    assert [m["rollout/staleness_max"] for _, m in logged] == [0.0, 0.0, 0.0]  # on-policy, no batch regenerated


def test_dynamic_sampling_can_filter_on_the_correctness_term_alone():
    # A format bonus makes every group's rewards differ; only filtering on exact_match drops the all-wrong groups.
    events, _ = _run({"run.dynamic_sampling.enabled": True}, num_steps=1, bonus=0.1)
    assert [e for e in events if e[0] == "train"][0][1] == [0, 1]
    events, _ = _run({"run.dynamic_sampling.enabled": True, "run.dynamic_sampling.filter_term": "exact_match"},
                     num_steps=1, bonus=0.1)  # fmt: skip
    assert [e for e in events if e[0] == "train"][0][1] == [0, 2]


def test_dynamic_sampling_filter_term_must_be_a_reward_term():
    import pytest

    from common.config import ConfigError

    with pytest.raises(ConfigError, match="run.dynamic_sampling.filter_term.*not a reward term"):
        load_recipe("recipes/grpo_tiny.toml", {"run.dynamic_sampling.filter_term": "correct"})
    with pytest.raises(ConfigError, match="run.dynamic_sampling.filter_term.*not a reward term"):
        load_recipe("recipes/grpo_tiny.toml", {"run.dynamic_sampling.filter_term": "environment"})  # single-turn
    # A multi-turn episode's own reward (an agent's returned number) is a term every one of its samples carries.
    agent = load_recipe("recipes/agent_openai_tiny.toml", {"run.dynamic_sampling.enabled": True,
                                                           "run.dynamic_sampling.filter_term": "environment"})
    assert agent.run.dynamic_sampling.filter_term == "environment"


def test_exports_the_policy_every_k_steps_when_asked():
    events, _ = _run({"run.export.every_num_steps": 2}, num_steps=4)
    assert [e for e in events if e[0] == "export"] == [("export", 2, ["hf", "step_2"]), ("export", 4, ["hf", "step_4"])]
    events, _ = _run({}, num_steps=4)
    assert not [e for e in events if e[0] == "export"]  # the final model is the run's, not the loop's


def test_the_publisher_remembers_the_version_every_receiver_took():
    events = []
    pool = FakePool(events, None, 0.0)
    trainer = FakeTrainer(events, pool)
    publisher = WeightPublisher(trainer, pool, external=["external:1"])
    assert publisher.published_version is None
    trainer.version = 4
    publisher.publish()
    assert publisher.published_version == 4
    trainer.failing = {"external:1"}
    trainer.version = 5
    publisher.publish()
    assert publisher.published_version is None  # a receiver missed it: the next publish must go out


def test_the_publisher_knows_the_external_receivers_that_took_no_version():
    events = []
    pool = FakePool(events, None, 0.0)
    trainer = FakeTrainer(events, pool)
    publisher = WeightPublisher(trainer, pool, external=["took:1", "never:2"])
    trainer.failing = {"took:1", "never:2"}
    trainer.version = 1
    publisher.publish()
    assert publisher.external_unserved == {"took:1": "refused", "never:2": "refused"}
    trainer.failing = {"never:2"}
    trainer.version = 2
    publisher.publish()
    trainer.failing = {"took:1", "never:2"}  # a later failure does not undo a version it took
    trainer.version = 3
    publisher.publish()
    assert publisher.external_unserved == {"never:2": "refused"}


def test_training_groups_are_numbered_by_their_place_in_the_data_stream():
    """Group ids seed a seeded sampling's streams: numbered by the problems' stream positions (which a resume restores
    with the cursor), a resumed run samples its steps as the uninterrupted run would have; the pool's own counter
    (shared with evaluations, restarting at a resume) did not."""
    pools = []
    _run({"run.dynamic_sampling.enabled": True, "run.dynamic_sampling.max_num_rounds": 3}, num_steps=3,
         pool_out=pools)  # fmt: skip
    submitted = pools[0].group_ids
    assert len(submitted) > 3  # dynamic sampling drew extra rounds
    for first, problems in submitted:  # FakeDataset's problems are their own stream positions
        assert first == problems[0] and problems == list(range(first, first + len(problems)))


def test_engines_behind_the_trainer_are_pushed_its_weights_those_at_it_not_and_those_ahead_fail_the_run():
    assert engines_behind([3, 5], 5) and not engines_behind([5, 5], 5) and not engines_behind([], 5)
    with pytest.raises(RuntimeError, match=r"policy versions \[5, 40\], ahead of the trainer's 5"):
        engines_behind([40, 5], 5)


def test_cores_busy_leaves_out_the_steps_whose_cpu_laps_hold_an_evaluation():
    """The laps are each process's CPU since its previous report: a step after an evaluation read ~1.9 of 2 cores."""
    _, logged = _run({"run.eval.every_num_steps": 2}, num_steps=5)  # evaluations after steps 2 and 4 (1-based)
    assert ["perf/cores_busy" in metrics for _, metrics in logged] == [False, True, False, True, False]


def test_a_reward_term_failing_on_most_samples_is_warned_once(caplog):
    """With reward.on_error = 'zero' a reward function failing on every sample trained on zeros, said by a counter
    alone. The fake batch has 4 samples."""
    failing = {"reward/function/num_errors": 3.0, "reward/fine/num_errors": 2.0, "reward/num_errors": 5.0}
    with caplog.at_level("WARNING", logger="rl_align"):
        _run({}, num_steps=3, extra_metrics=failing)
    warned = [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert warned == ["step 0: reward term 'function' failed on 3 of 4 episodes, each scored 0 (reward.on_error = "
                      "'zero'): the run learns from zeros; the rollout workers' log has the first error of each type "
                      "with its traceback (this warning is given once per term)"]
