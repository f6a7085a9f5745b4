"""One run of a recipe: build the rollout pool and the trainer group, warm start, run the RL loop, report, close.

    run(recipe)                 # embedded Ray unless RAY_ADDRESS / --address names a cluster
    run(recipe, resume="required")   # continue from the newest checkpoint under the run's output directory

Everything started here is stopped here, on success, error or Ctrl-C. The actors of each role run in Ray placement
groups (``driver.reservation``), placed before any of them starts. A trainer that dies (or whose node is lost) fails
the run with a clear message (``--resume`` continues from the last checkpoint); rollout workers that die are replaced
by the pool, in their slot's bundle, which Ray moves to a live node when theirs was lost; an external weight receiver
that fails a push is reported and retried at the next step without stopping training.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.run_dir import (
    ADAPTER_DIR,
    CURVES,
    FINAL_MODEL,
    LOCK,
    METRICS,
    WARM_START_MODEL,
    RunDirBusy,
    RunDirLock,
    earlier_runs_kept,
    set_aside_earlier_run,
)
from driver.preflight import CheckedRun, check_run, hold_checkpoint_dir, outputs_lost_with_the_job, with_run_defaults
from driver.resume import point_moved_adapters_at_their_base, point_moved_run_at_itself, resume_command, resume_hint
from recipe import Recipe, write_resolved

if TYPE_CHECKING:
    from rollout.tasks.dataset import PromptDataset
    from trainer.models.config import ModelConfig

__all__ = ["evaluations_on_record", "run"]

log = logging.getLogger("rl_align")


def run(recipe: Recipe, resume: str | None = None, address: str | None = None, moved_from: Path | None = None) -> int:
    """Run ``recipe`` to the end; return the process exit code (0 success, 1 failure, 2 bad input, 130 interrupted,
    143 stopped by SIGTERM).

    ``resume``: None starts fresh (an earlier run's outputs in the run directory are moved to its ``previous-<time>/``,
    never mixed in: ``common.run_dir``); "required" continues from the newest checkpoint and fails if there is none;
    "auto" continues when one exists. The run holds its directory and its checkpoint directory from before its checks
    to its end (``common.run_dir.RunDirLock``): a second run in either is refused. ``moved_from``: the directory the
    run's record was written for, when the run was moved or copied from there
    (:func:`driver.resume.record_in_its_directory`): its adapters are pointed at their base in the run's directory.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    out_dir = recipe.run.resolved_output_dir
    problem = outputs_lost_with_the_job(recipe)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    lock = RunDirLock(out_dir)  # before anything reads the directory (another run may be writing or pruning it)
    new_dir = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except (OSError, RunDirBusy) as e:
        cannot = "" if isinstance(e, RunDirBusy) else f"run.output_dir {str(out_dir)!r} cannot be the run's directory: "
        print(f"error: {cannot}{e}", file=sys.stderr)
        return 2
    try:
        return _checked_run(recipe, out_dir, resume, address, moved_from)
    finally:
        lock.release()
        if new_dir:
            _remove_if_only_locks(out_dir)


def _remove_if_only_locks(directory: Path) -> None:
    """Remove ``directory`` when all it holds is lock files (and directories of them): what a run refused before it
    wrote anything leaves in a run directory it created."""
    try:
        if all(p.is_dir() or p.name == LOCK for p in directory.rglob("*")):
            shutil.rmtree(directory)
    except OSError:
        pass  # a directory another process writes to meanwhile: it is theirs now


def _checked_run(
    recipe: Recipe, out_dir: Path, resume: str | None, address: str | None, moved_from: Path | None
) -> int:
    """:func:`run` while it holds the run directory: the checks that need no Ray (``driver.preflight``), holding the
    checkpoint directory too, then :func:`_start`."""
    recipe = with_run_defaults(recipe, out_dir)
    ckpt_dir = Path(recipe.trainer.checkpoint.dir)  # type: ignore[arg-type]  # with_run_defaults set it
    new_dir = not ckpt_dir.exists()
    try:
        ckpt_lock = hold_checkpoint_dir(ckpt_dir, out_dir)
    except (OSError, RunDirBusy, ValueError) as e:
        cannot = f"trainer.checkpoint.dir {str(ckpt_dir)!r} cannot hold checkpoints: " if isinstance(e, OSError) else ""
        print(f"error: {cannot}{e}", file=sys.stderr)
        return 2
    try:
        try:
            checked = check_run(recipe, out_dir, ckpt_dir, resume)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return _start(recipe, out_dir, checked, address, moved_from)
    finally:
        ckpt_lock.release()
        if new_dir:
            _remove_if_only_locks(ckpt_dir)


@contextlib.contextmanager
def _sigterm_stops_the_run(received: threading.Event) -> Iterator[None]:
    """Make SIGTERM (``ray job stop``, ``kill``, an orchestrator) stop the run as Ctrl-C does, while Ray runs: a
    ``KeyboardInterrupt`` in the main thread (this handler replaces ``ray.init``'s, which exits at once:
    ``sys.exit(15)`` past a native stack dump), so the actors are stopped and the operator told how to continue.
    ``received`` is set, which tells the two apart."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        from driver.session import note_sigterm

        received.set()
        note_sigterm()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start(recipe: Recipe, out_dir: Path, checked: CheckedRun, address: str | None, moved_from: Path | None) -> int:
    """:func:`run` once its checks passed and it holds the run directory: a moved or copied run's adapters pointed at
    their base in it, the earlier run's outputs set aside (fresh start), the resolved recipe written, Ray joined or
    started, the run executed."""
    from driver.warm_start import WarmStartError
    from rollout.envs import EpisodeFailed, PromptTooLong
    from rollout.fleet import WorkersExhausted
    from rollout.rewards.function import RewardFunctionError
    from trainer.checkpoint import CheckpointWriteError

    ckpt_dir = Path(recipe.trainer.checkpoint.dir)  # type: ignore[arg-type]  # with_run_defaults set it
    resume_from, model_cfg = checked.resume_from, checked.model_cfg
    if moved_from is not None:
        point_moved_adapters_at_their_base({moved_from: out_dir})
    if resume_from is None:
        inputs = [p for p in (recipe.model.path, recipe.rollout.tokenizer_path, recipe.rollout.model_path) if p]
        moved = set_aside_earlier_run(out_dir, ckpt_dir, keep=inputs)
        if moved:
            places = {str(t.parent) if t.parent.name.startswith("previous-") else str(t) for t in moved.values()}
            log.warning("fresh start: moved the earlier run's %s to %s", ", ".join(p.name for p in moved),
                        ", ".join(sorted(places)))  # fmt: skip
            point_moved_adapters_at_their_base(moved)
            earlier = point_moved_run_at_itself(moved, out_dir)
            if earlier is not None:
                log.warning("to continue the earlier run instead: %s", resume_command(earlier))
            count, size = earlier_runs_kept(out_dir, ckpt_dir)
            log.warning("%s now keeps %d earlier run(s) in previous-*/ (%s MB with moved checkpoints); nothing "
                        "deletes them: remove those you no longer need", out_dir, count,
                        f"{size / 1e6:,.1f}")  # fmt: skip
    write_resolved(recipe, out_dir)  # after the checks: a refused recipe leaves the run's record as it was

    import ray

    from driver.metrics import MetricsWriteError
    from driver.reservation import PlacementError
    from driver.session import ray_session

    sigterm = threading.Event()
    try:
        with ray_session(address, recipe.trainer.device) as where, _sigterm_stops_the_run(sigterm):
            log.info("Ray: %s; outputs in %s", where, out_dir.resolve())
            lora = ", LoRA adapters" if model_cfg.lora is not None else ""
            log.info("model: %s (%s, %.3g B parameters%s)", recipe.model.path, model_cfg.family,
                     model_cfg.num_params / 1e9, lora)  # fmt: skip
            resumed = resume_from is not None
            with _Run(recipe, model_cfg, checked.dataset, out_dir, resumed, can_grow=where != "embedded") as job:
                job.execute()
        return 0
    except KeyboardInterrupt:
        how = "stopped (SIGTERM)" if sigterm.is_set() else "interrupted"
        print(f"\n{how}: actors stopped; {resume_hint(out_dir, ckpt_dir, failed=False)}", file=sys.stderr)
        return 143 if sigterm.is_set() else 130
    except PlacementError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MetricsWriteError as e:
        print(f"error: {e}\n{resume_hint(out_dir, ckpt_dir, failed=True)}", file=sys.stderr)
        return 1
    except (ray.exceptions.RayTaskError, EpisodeFailed, PromptTooLong, WarmStartError) as e:
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
        if isinstance(cause, EpisodeFailed):  # its traceback, and each dropped episode's, are in the workers' log
            print(f"error: a rollout batch failed: {cause}\nfix the environment, or let environment."
                  f"max_failed_fraction drop more of its episodes; {resume_hint(out_dir, ckpt_dir, failed=True)}",
                  file=sys.stderr)  # fmt: skip
            return 1
        if not isinstance(cause, (CheckpointWriteError, PromptTooLong, RewardFunctionError, WarmStartError)):
            raise
        print(f"error: {cause}\n{resume_hint(out_dir, ckpt_dir, failed=True)}", file=sys.stderr)
        return 1
    except (ray.exceptions.RayActorError, WorkersExhausted) as e:
        if isinstance(e, WorkersExhausted):
            what = f"rollout workers could not be replaced any more: {e}"
        else:
            unreachable = isinstance(e, ray.exceptions.ActorUnavailableError)
            gone = "became unreachable (its process or node is gone)" if unreachable else "died"
            what = f"{_actor_role(str(e))} {gone} and could not be replaced; Ray's account of it follows.\n{e}"
        print(f"error: {what}\n{resume_hint(out_dir, ckpt_dir, failed=True)}", file=sys.stderr)
        return 1


def _actor_role(error: str) -> str:
    """Which of the run's actors a Ray actor error is about, read from the class name Ray's message carries."""
    found = re.search(r"class_name: (\w+)", error)
    roles = {"TrainerWorker": "a trainer rank", "RolloutWorker": "a rollout worker"}
    return roles.get(found.group(1), f"an actor ({found.group(1)})") if found else "a trainer or rollout actor"


def _with_env(env_vars: dict[str, str], py_executable: str | None = None) -> dict[str, Any] | None:
    """A Ray runtime environment that sets ``env_vars`` on top of the job's (Ray merges the two), and runs the actors
    with ``py_executable`` when given."""
    runtime_env: dict[str, Any] = {"env_vars": env_vars} if env_vars else {}
    if py_executable is not None:
        runtime_env["py_executable"] = str(Path(py_executable).absolute())
    return runtime_env or None


class _Run:
    """The actors and sinks of one run, as a context manager that always closes them."""

    def __init__(
        self, recipe: Recipe, model_cfg: ModelConfig, dataset: PromptDataset, out_dir: Path, resume: bool,
        can_grow: bool,
    ) -> None:
        """``model_cfg``: the trainer's view of the recipe's model directory; ``dataset``: the task's problems;
        ``can_grow``: the Ray cluster may add nodes (a joined cluster), so a placement may wait for them."""
        self.recipe, self.model_cfg, self.dataset, self.out_dir = recipe, model_cfg, dataset, out_dir
        self.resume, self.can_grow = resume, can_grow
        self.reservations: dict[str, Any] = {}
        self.pool: Any = None
        self.trainer: Any = None
        self.logger: Any = None
        self.tokenizer: Any = None

    @property
    def _runs_warm_start(self) -> bool:
        """Whether this run starts with the recipe's supervised warm start (a resumed run never does)."""
        return self.recipe.run.warm_start.num_steps > 0 and not self.resume

    def __enter__(self) -> _Run:
        from driver.metrics import MetricsLogger
        from driver.placement import cluster_node_cores, host_cores, plan_placement
        from driver.publisher import WeightPublisher
        from driver.reservation import Role, reserve
        from driver.sample_log import SampleLog
        from rollout.engine.vllm_plugin import lora_option
        from rollout.pool import RolloutPool, worker_resources
        from rollout.tokenizer import load_tokenizer
        from trainer.group import TrainerGroup, rank_resources

        r = self.recipe
        self.logger = MetricsLogger(
            self.out_dir, r.run.num_steps, tensorboard=r.run.logging.tensorboard, progress=r.run.logging.progress,
            prometheus_port=r.run.logging.prometheus_port, append=self.resume,
        )  # fmt: skip
        self.sample_log = SampleLog(self.out_dir, r.rollout.tokenizer_dir, r.run.logging.samples_per_step,
                                    append=self.resume)  # fmt: skip
        model_cfg = self.model_cfg
        cores = host_cores()
        if self.can_grow:  # a joined cluster: the actors' node, which need not be the driver's host
            import ray

            cores = cluster_node_cores(ray.nodes(), ray.get_runtime_context().get_node_id()) or cores
        self.placement = plan_placement(r, cores)
        log.info("placement: %s on %d core(s); trainer ranks run %s thread(s), engines %s", r.run.placement,
                 self.placement.num_cores, self.placement.trainer_env["OMP_NUM_THREADS"],
                 self.placement.rollout_env.get("OMP_NUM_THREADS", r.rollout.engine.cpu_threads_bind))  # fmt: skip
        if r.model.lora is not None:
            lora, serving = r.model.lora, r.rollout.engine.lora_serving
            log.info("LoRA: rank %d, alpha %g on %s; each version is pushed as adapters and served %s", lora.rank,
                     lora.alpha, ", ".join([*lora.target_modules, *lora.target_parameters]),
                     "'auto' (merged into the base on CPU, else through vLLM's LoRA path)" if serving == "auto"
                     else repr(serving))  # fmt: skip
            if r.weight_sync.endpoints:  # a receiver of another rank or alpha refuses the pushes: say how to serve them
                targets = "".join(f" --{flag} {' '.join(names)}" for flag, names in (
                    ("target_modules", lora.target_modules), ("target_parameters", lora.target_parameters)) if names)
                log.info("external receivers take these adapters when served as: python -m weight_sync serve --dir "
                         "DIR --adapter_of %s --rank %d --alpha %g%s (adapters go out in the engines' dtype, %s, and "
                         "a sink declares its base's: give it a base saved in %s)", r.lora_base, lora.rank, lora.alpha,
                         targets, r.rollout.engine.dtype, r.rollout.engine.dtype)  # fmt: skip
                log.info("a stock vllm serve with the rl_align plugin takes them with this in its \"rl_align\" "
                         "options, started on a copy of %s (deploy/OPERATIONS.md): %s", r.model.path,
                         lora_option(lora))  # fmt: skip
        # The publisher hands the trainer's ranks their receivers before every push.
        sync_cfg = r.weight_sync.model_copy(update={"endpoints": []})
        # A resumed run starts from the warm-started weights (its checkpoint then restores policy and reference). With
        # LoRA the checkpoint holds the adapters alone, over `Recipe.lora_base` (checked at resume): the model
        # directory, or the warm-started model when the warm start trained the base (the engines then start from it).
        warm, lora_base = self.out_dir / WARM_START_MODEL, r.lora_base
        init_path, rollout_cfg = r.model.path, self.placement.rollout
        if self.resume and lora_base is not None:
            init_path = str(lora_base)
            rollout_cfg = rollout_cfg.model_copy(update={"model_path": init_path})
        elif self.resume and (warm / "config.json").is_file():
            init_path = str(warm)

        plan = self.placement
        # The engines first: on accelerator clusters a rollout bundle is a whole host (deploy/*.yaml), and trainer
        # ranks placed before them could take a part of one.
        roles = [
            Role("rollout", worker_resources(rollout_cfg), plan.num_rollout_workers, plan.rollout_strategy),
            Role("trainer", rank_resources(r.trainer, plan.trainer_cpus), r.trainer.num_ranks, plan.trainer_strategy),
        ]  # fmt: skip
        try:  # every actor goes into a bundle of these groups; none starts before all are placed
            self.reservations = reserve(roles, plan.shared_group, f"{r.run.name}-{int(time.time())}",
                                        r.run.placement_groups.timeout_s, self.can_grow)  # fmt: skip
        except BaseException:
            self.__exit__(None, None, None)
            raise

        # The engines start from the base the trainer holds (`init_path`): their receivers report its session, so
        # that its adapters alone are taken from the first push (a receiver of unknown session is pushed the base).
        session = f"{r.run.name}-{int(time.time())}"

        def start_pool() -> Any:
            return RolloutPool(rollout_cfg, r.reward, self.placement.receiver_sync,
                               runtime_env=_with_env(self.placement.rollout_env), environment=r.environment,
                               placement=self.reservations["rollout"].actor_placement(),
                               trainer_session=session)  # fmt: skip

        def start_trainer() -> Any:
            return TrainerGroup(r.trainer, model_cfg, r.algorithm, init_path=init_path, weight_sync=sync_cfg,
                                session_id=session,
                                num_cpus_per_rank=self.placement.trainer_cpus,
                                runtime_env=_with_env(self.placement.trainer_env, r.run.trainer_python),
                                placement=self.reservations["trainer"].actor_placement(),
                                resume=self.resume)  # fmt: skip

        # Engines and trainer ranks start at once: each start is mostly its own process waiting on imports and loads.
        t0 = time.perf_counter()
        starting = concurrent.futures.ThreadPoolExecutor(2)
        failures: list[Exception] = []
        try:
            pool, trainer = starting.submit(start_pool), starting.submit(start_trainer)
            try:  # meanwhile, for the warm start only (transformers' import is seconds of a core the actors want)
                if self._runs_warm_start:
                    self.tokenizer = load_tokenizer(r.rollout.tokenizer_dir)
            except Exception as e:  # noqa: BLE001 (the actors still start and must be stopped)
                failures.append(e)
            for name, future in (("pool", pool), ("trainer", trainer)):
                try:
                    setattr(self, name, future.result())
                except Exception as e:  # noqa: BLE001 (the other part still starts and must be stopped)
                    failures.append(e)
        except BaseException:
            # Ctrl-C or SIGTERM while the actors start: their placement groups go now (Ray kills the actors in them,
            # so the starting threads fail at once), not once both parts are up (tens of seconds at size).
            starting.shutdown(wait=False, cancel_futures=True)
            self.__exit__(*sys.exc_info())
            raise
        starting.shutdown()
        if failures:
            self.__exit__(None, None, None)
            raise failures[0]
        log.info("rollout pool (%d worker(s), torch threads %s) and trainer (%d rank(s)) ready in %.1f s",
                 plan.num_rollout_workers, [h["num_threads"] for h in self.pool.health()], r.trainer.num_ranks,
                 time.perf_counter() - t0)  # fmt: skip
        self.publisher = WeightPublisher(self.trainer, self.pool, external=r.weight_sync.endpoints)
        return self

    def __exit__(self, *exc: object) -> None:
        from driver.reservation import release
        from driver.session import ray_reachable

        if exc[0] is None or ray_reachable():  # else nothing is left to stop: the actors went with Ray
            for part in (self.trainer, self.pool):
                if part is not None:
                    try:
                        part.shutdown()
                    except Exception as e:  # noqa: BLE001 (closing: report and keep closing the rest)
                        log.warning("while shutting down %s: %s", type(part).__name__, e)
            release(self.reservations)
        self.reservations = {}
        if self.logger is not None:
            self.logger.close()

    # -- the run ---------------------------------------------------------------------------------------------------
    def execute(self) -> None:
        from driver.evaluate import evaluate
        from driver.loop import RLLoop, checkpoint_due
        from driver.metrics import plot_curves, read_jsonl
        from driver.publisher import engines_behind
        from driver.warm_start import warm_start
        from rollout.envs import PromptTooLong
        from rollout.envs.config import SingleTurnEnvConfig

        r = self.recipe
        eval_problems = self.dataset.eval_problems()[: r.run.eval.num_problems]
        eval_sampling, term = r.eval_sampling, r.reward.accuracy_term
        do_eval = lambda: evaluate(self.pool, eval_problems, eval_sampling, term)  # noqa: E731
        if isinstance(r.environment, SingleTurnEnvConfig):  # before anything trains (not a row hours in)
            too_long = self.pool.prompts_too_long([*self.dataset.train_problems(), *eval_problems])
            if too_long is not None:
                raise PromptTooLong(too_long)

        start_step = 0
        if self.resume:
            state = self.trainer.restored  # the ranks restored the checkpoint as they started
            assert state is not None
            self.dataset.load_state_dict(state["data_cursor"])
            start_step = state["step"]
            num_dropped = self.logger.drop_from(start_step)
            self.sample_log.drop_from(start_step)
            log.info("resumed at step %d (policy version %d); dropped %d metric records past it", start_step,
                     state["policy_version"], num_dropped)  # fmt: skip
        elif self._runs_warm_start:
            t0 = time.perf_counter()

            def publish_and_evaluate() -> dict[str, float]:
                self.publisher.publish()
                return do_eval()

            self.trainer.begin_warm_start(r.run.warm_start.parameters == "all")
            num_sft = warm_start(self.trainer, self.dataset, self.tokenizer, r.run.warm_start,
                                 r.rollout.use_chat_template, lambda step, m: self.logger.log(step, m, phase="sft"),
                                 publish_and_evaluate, r.environment, r.rollout.engine.max_model_len)  # fmt: skip
            self.trainer.finish_warm_start()
            # Adapters a warm start of every weight did not train (the base took it all) are not exported with it.
            self.trainer.export_hf(str(self.out_dir / WARM_START_MODEL), r.model.path, r.run.export.dtype,
                                   adapter=r.run.warm_start.parameters != "all",
                                   use_chat_template=r.rollout.use_chat_template)  # fmt: skip
            log.info("warm start: %d SFT steps in %.1f s", num_sft, time.perf_counter() - t0)
            if r.trainer.checkpoint.every_num_steps:  # a stop before the first RL checkpoint keeps the warm start
                self.trainer.save_checkpoint(data_cursor=self.dataset.state_dict())
        # The engines start at the version their model directory records; the trainer at its checkpoint's, its warm
        # start's, or that same directory's. Engines behind it get it now (a warm start that stopped at an accuracy
        # check has already published its last version); engines already holding it (a resume at the checkpoint saved
        # right after a warm start whose export they loaded) would refuse it as not newer. External receivers take
        # the first step's push.
        version = self.trainer.policy_version()
        if self.publisher.published_version != version and engines_behind(self.pool.policy_versions(), version):
            self.publisher.publish()
        self.pool.set_policy_version(version)
        # A resumed run compares its end with the start of RL (the first run's eval before step 0). The checkpoint's
        # policy evaluated already (an extended run's final eval, or the in-run eval of the step before the resume
        # point) is not measured and logged a second time.
        evals = evaluations_on_record(read_jsonl(self.out_dir / METRICS)) if self.resume else {}
        if start_step - 1 not in evals:
            evals[start_step - 1] = do_eval()
            self.logger.log(start_step - 1, evals[start_step - 1], phase="eval")
        before = evals.get(-1, evals[start_step - 1])
        RLLoop(r, self.pool, self.trainer, self.dataset, self.publisher, self.logger.log, do_eval,
               num_cores=self.placement.num_cores, log_samples=self.sample_log.write).run(start_step)  # fmt: skip
        trained = start_step < r.run.num_steps  # else a finished run resumed again: its end is on record
        if trained:
            after = do_eval()
            self.logger.log(r.run.num_steps - 1, after, phase="eval")
        else:
            after = evals[start_step - 1]
        # The loop saved a step it was due at, and a finished run resumed again has its last step saved already.
        if trained and r.trainer.checkpoint.every_num_steps and not checkpoint_due(r, r.run.num_steps - 1):
            self.trainer.save_checkpoint(data_cursor=self.dataset.state_dict())
        final = self.out_dir / FINAL_MODEL
        self.trainer.export_hf(str(final), r.export_source_dir, r.run.export.dtype,
                               use_chat_template=r.rollout.use_chat_template)  # fmt: skip
        log.info("trained model: %s (from_pretrained-ready: weights, config, tokenizer, generation config)%s", final,
                 _export_dtype_note(r.export_source_dir, r.run.export.dtype))  # fmt: skip
        _print_report(before, after, self.out_dir, self.publisher.external_unserved if trained else None,
                      plotted=r.run.logging.plot)  # fmt: skip
        if r.run.logging.plot:
            self.logger.close()
            self.logger = None
            plot_curves(self.out_dir / METRICS, self.out_dir / CURVES)


def _export_dtype_note(source_dir: str, dtype: str | None) -> str:
    """A note for an export in float32 (``run.export.dtype`` unset) of a source model saved in another dtype: the
    user's bfloat16 model comes back twice its size."""
    if dtype is not None:
        return ""
    try:
        config = json.loads((Path(source_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    saved = config.get("dtype") or config.get("torch_dtype")
    if saved in (None, "float32"):
        return ""
    return f"; in float32, the trainer's, while {source_dir} holds {saved}: run.export.dtype = {saved!r} writes {saved}"


def evaluations_on_record(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The records holding a held-out evaluation of the policy after each step (step -1: before RL): ``eval`` records
    and the ``rl`` records of steps evaluated in the run (``run.eval.every_num_steps``)."""
    return {
        rec["step"]: rec for rec in records
        if rec["phase"] == "eval" or (rec["phase"] == "rl" and any(k.startswith("eval/") for k in rec))
    }  # fmt: skip


def _print_report(
    before: dict[str, float], after: dict[str, float], out_dir: Path, unserved: dict[str, str] | None = None,
    plotted: bool = True,
) -> None:
    """The end of a run: held-out accuracy before and after RL, where the outputs are (``plotted``: the curves
    too), and the external receivers (``weight_sync.endpoints``) that took no version of this run, with the last
    reason (``unserved``)."""
    rows = [k for k in ("eval/accuracy", "eval/greedy_accuracy", "eval/reward", "eval/greedy_reward")
            if before.get(k) is not None and after.get(k) is not None]  # a record's non-finite value is null
    lines = ["", "held-out problems      start of RL    end of RL    change", "-" * 58] if rows else []
    for key in rows:
        lines.append(f"{key[5:]:<22} {before[key]:>11.3f} {after[key]:>12.3f} {after[key] - before[key]:>+9.3f}")
    lines.append(f"\nmetrics: {out_dir / METRICS}" + (f"   curves: {out_dir / CURVES}" if plotted else ""))
    lines.append(f"trained model (AutoModelForCausalLM.from_pretrained): {out_dir / FINAL_MODEL}")
    adapter = out_dir / FINAL_MODEL / ADAPTER_DIR
    if adapter.is_dir():  # a LoRA run's: the same policy as its base plus these adapters
        lines.append(f"its LoRA adapters (peft.PeftModel.from_pretrained(base, DIR)): {adapter}")
    for address, reason in (unserved or {}).items():
        lines.append(f"warning: external receiver {address} took no version of this run; the last push: {reason}")
    print("\n".join(lines), flush=True)
