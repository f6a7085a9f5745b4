"""Multi-turn, tool-using episodes on the rollout engine against the same engine generating the same tokens single-turn.

    python -m benchmarks.agentic                      # 64 episodes x 4 turns, 50 ms tools, ~40M Qwen3 (bf16), 3 reps

What it measures, in one run on one in-process engine (``rollout.engine.vllm_engine.VLLMEngine``, production
``EngineConfig`` defaults unless a flag says otherwise), repetitions interleaved:
- episodes: ``--num-episodes`` concurrent episodes (``rollout.envs.run_episode``) of ``--turns`` model turns, each turn
  answered by a tool that takes ``--tool-latency-ms`` (an ``asyncio`` sleep: the engine must keep generating the other
  episodes meanwhile); turns end on one of a set of stop ids (a random model writes no end-of-turn token), so their
  lengths vary. Episodes/s and generated (model) tokens/s.
- single-turn: the same first prompts, each generating exactly as many tokens as its episode's model turns did, all at
  once: the tokens/s the engine gives the same work without turns or tools. Target: episodes >= 0.8x of it.
- pause per update with episodes in flight: a thread pushes the model's full weights into the engine every
  ``--update-every-s`` while an episode batch runs (``load_weights``: admission stops, turns in flight finish on the
  old version, reload, resume); the median and max of the engine's ``last_update_s`` (the drain wait included) and the
  batch's wall time against one without updates.
The CPU model and the load average before and after are printed: compare figures of one quiet run only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.engine_model import add_model_args, make_model


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class ToolEnv:
    """Four-turn episodes whose tool answers after a fixed latency (an ``rollout.envs.Environment``)."""

    tools = None

    def __init__(self, turns: int, latency_s: float) -> None:
        self._turns, self._latency_s, self._turn = turns, latency_s, 0

    async def reset(self, problem):
        return [{"role": "user", "content": problem.prompt}]

    async def step(self, text: str):
        from rollout.envs import StepResult

        self._turn += 1
        if self._turn >= self._turns:
            return StepResult(done=True)
        await asyncio.sleep(self._latency_s)
        return StepResult(observation=[{"role": "tool", "content": f"result {self._turn}: 12 * 34 = 408"}])

    async def close(self) -> None:
        pass


def run_episodes(engine, tokenizer, problems, sampling, args, seed: int):
    from rollout.envs import EpisodeLimits, run_episode

    limits = EpisodeLimits(max_turns=args.turns)

    async def batch():
        return await asyncio.gather(*(
            run_episode(engine, tokenizer, ToolEnv(args.turns, args.tool_latency_ms / 1e3), p, sampling, limits,
                        lambda t, k=k: seed + 1000 * k + t)
            for k, p in enumerate(problems)
        ))  # fmt: skip

    start = time.perf_counter()
    episodes = engine.run(batch())
    return episodes, time.perf_counter() - start


def run_single_turn(engine, episodes, sampling):
    async def batch():
        return await asyncio.gather(*(
            engine.generate_async(e.prompt_ids, sampling.model_copy(update={
                "max_tokens": int(e.loss_mask.sum()), "ignore_eos": True, "stop_token_ids": []}), 1, 7 + k)
            for k, e in enumerate(episodes)
        ))  # fmt: skip

    start = time.perf_counter()
    outs = engine.run(batch())
    return sum(len(o[0].token_ids) for o in outs), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tool-latency-ms", type=float, default=50.0)
    parser.add_argument("--num-stop-ids", type=int, default=24, help="stop ids ending a turn (mean ~512/N tokens)")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per turn")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--update-every-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from rollout.config import EngineConfig, SamplingConfig
    from rollout.engine.vllm_engine import VLLMEngine
    from rollout.tasks.problem import Problem
    from rollout.tokenizer import load_tokenizer
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        model_dir = make_model(args, Path(tmp) / "model")
        tokenizer = load_tokenizer(model_dir)
        engine = VLLMEngine(model_dir, EngineConfig(dtype=args.dtype, max_model_len=1024,
                                                    max_num_seqs=args.num_episodes, kv_cache_gib=1.0))
        try:
            problems = [Problem(prompt=f"Compute {i} times {2 * i + 1}.", answer="0", problem_id=str(i))
                        for i in range(args.num_episodes)]  # fmt: skip
            sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens,
                                      stop_token_ids=list(range(100, 100 + args.num_stop_ids)))
            run_episodes(engine, tokenizer, problems[:4], sampling, args, seed=99)  # warm-up (compilation)
            multi, single, eps = [], [], []
            for rep in range(args.reps):
                episodes, seconds = run_episodes(engine, tokenizer, problems, sampling, args, seed=rep)
                tokens = sum(int(e.loss_mask.sum()) for e in episodes)
                multi.append(tokens / seconds)
                eps.append(len(episodes) / seconds)
                single_tokens, single_s = run_single_turn(engine, episodes, sampling)
                assert single_tokens == tokens, (single_tokens, tokens)
                single.append(single_tokens / single_s)
            turns = statistics.mean(e.num_turns for e in episodes)
            per_turn = tokens / sum(e.num_turns for e in episodes)
            pauses, with_updates_s, plain_s = measure_update_pause(
                engine, tokenizer, problems, sampling, args, model_dir
            )
        finally:
            engine.shutdown()
    ratios = [m / s for m, s in zip(multi, single, strict=True)]
    load_after = os.getloadavg()
    med = statistics.median
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average before {load_before[0]:.2f}, "
          f"after {load_after[0]:.2f}")
    print(f"model: {args.hidden_size}x{args.num_layers} Qwen3 ({args.dtype}); {args.num_episodes} episodes x "
          f"{turns:.2f} turns (of {args.turns}) x {per_turn:.1f} tokens per turn; tool latency "
          f"{args.tool_latency_ms:.0f} ms; {args.reps} reps, median [min-max]")
    print(f"{'':<34}{'median':>10}{'range':>22}")
    for name, values, fmt in (("episodes: episodes/s", eps, ".2f"), ("episodes: model tokens/s", multi, ".0f"),
                              ("single-turn: tokens/s", single, ".0f"), ("episodes / single-turn", ratios, ".2f")):
        print(f"{name:<34}{med(values):>10{fmt}}{f'[{min(values):{fmt}} - {max(values):{fmt}}]':>22}")
    print(f"pause per update, episodes in flight: median {med(pauses) * 1e3:.0f} ms, max {max(pauses) * 1e3:.0f} ms "
          f"({len(pauses)} updates); batch {with_updates_s:.2f} s with them vs {plain_s:.2f} s without "
          f"(target for the ratio: >= 0.8x)")


def measure_update_pause(engine, tokenizer, problems, sampling, args, model_dir: str):
    """Pauses of full-weight updates pushed while an episode batch runs, and the batch's wall time with and without."""
    from safetensors.torch import load_file

    state = {}
    for file in Path(model_dir).glob("*.safetensors"):
        state.update(load_file(file))
    _, plain_s = run_episodes(engine, tokenizer, problems, sampling, args, seed=50)
    pauses: list[float] = []
    done = threading.Event()

    def push() -> None:
        version = engine.policy_version
        while not done.wait(args.update_every_s):
            version += 1
            engine.load_weights(version, state, full=True)
            pauses.append(engine.last_update_s)

    pusher = threading.Thread(target=push)
    pusher.start()
    try:
        _, with_updates_s = run_episodes(engine, tokenizer, problems, sampling, args, seed=50)
    finally:
        done.set()
        pusher.join()
    return pauses or [float("nan")], with_updates_s, plain_s


if __name__ == "__main__":
    main()
