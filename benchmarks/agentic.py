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
- agent endpoint: the same episodes written as an OpenAI-client agent (:func:`bench_agent`) run by
  ``rollout.agents.AgentRunner`` against the worker's endpoint on the same engine (HTTP, chat template over the whole
  conversation, recorded calls): model tokens/s against the in-process episodes, and samples per episode (a random
  model's text need not re-tokenise to its ids, so its conversations split).
- tokens per episode: first prompt, model and observation tokens (the last are work the episodes have and the
  single-turn batch has not: each turn's observation, chat markup included, is prefilled), the engine's prefill rate
  (``--num-episodes`` fresh prompts of an episode's observation length, at once), and from them the ratio's ceiling:
  the single-turn time of the model tokens plus the prefill time of the observations and of the context each later
  turn prefills again (a turn is a new request, and the prefix cache holds only whole KV blocks: the context's last,
  partial block is recomputed), with nothing else lost; and the ceiling were the context's KV kept between turns.
- pause per update with episodes in flight: a thread pushes the model's full weights into the engine every
  ``--update-every-s`` while an episode batch runs (``load_weights``: admission stops, turns in flight finish on the
  old version (``--update-mode wait``) or go on with the new weights (``keep``), reload, resume); the median and max
  of the engine's ``last_update_s`` (a drain wait included) and the batch's wall time against one without updates.
The CPU model and the load average before and after are printed: compare figures of one quiet run only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.engine_model import add_model_args, make_model
from benchmarks.machine import cpu_isa, cpu_model


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
    from rollout.tokenizer import PromptRenderer

    limits = EpisodeLimits(max_turns=args.turns)

    render = PromptRenderer(tokenizer)

    async def batch():
        return await asyncio.gather(*(
            run_episode(engine, render, ToolEnv(args.turns, args.tool_latency_ms / 1e3), p, sampling, limits,
                        lambda t, k=k: seed + 1000 * k + t)
            for k, p in enumerate(problems)
        ))  # fmt: skip

    start = time.perf_counter()
    episodes = engine.run(batch())
    return episodes, time.perf_counter() - start


async def bench_agent(ctx, turns: int, latency_s: float) -> None:
    """The episodes of :class:`ToolEnv` written as an OpenAI-client agent (for the endpoint row)."""
    import openai

    async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": ctx.problem.prompt}]
        for turn in range(1, turns + 1):
            reply = (await client.chat.completions.create(model=ctx.model, messages=messages)).choices[0].message
            if turn == turns:
                return
            messages.append(reply.model_dump(exclude_none=True))
            await asyncio.sleep(latency_s)
            messages.append({"role": "tool", "content": f"result {turn}: 12 * 34 = 408"})


def run_agents(runner, problems, sampling, seed: int):
    start = time.perf_counter()
    outcomes = runner.run([(p, seed, k) for k, p in enumerate(problems)], sampling.model_copy(update={"seed": seed}))
    seconds = time.perf_counter() - start
    tokens = sum(int(e.loss_mask.sum()) for o in outcomes for e in o.episodes)
    return tokens / seconds, sum(len(o.episodes) for o in outcomes) / len(outcomes)


def call_latency(runner, engine, tokenizer, sampling, num_calls: int = 40) -> tuple[float, float]:
    """Seconds per one-token call, one at a time, through the endpoint (openai client, HTTP, chat template) and
    straight into the engine with the same prompt ids: what the endpoint adds to every call."""
    import openai

    from rollout.envs import EpisodeLimits
    from rollout.tokenizer import render_prompt

    messages = [{"role": "user", "content": "Compute 3 times 7."}, {"role": "assistant", "content": "21"},
                {"role": "tool", "content": "result 1: 12 * 34 = 408"}]  # fmt: skip
    one = sampling.model_copy(update={"max_tokens": 1, "stop_token_ids": []})
    episode = engine.run(runner.endpoint.open(one, EpisodeLimits(max_turns=num_calls + 1), lambda t, n: None))

    async def through_endpoint():
        async with openai.AsyncOpenAI(base_url=episode.base_url, api_key="x", max_retries=0) as client:
            await client.chat.completions.create(model="policy", messages=messages)
            start = time.perf_counter()
            for _ in range(num_calls):
                await client.chat.completions.create(model="policy", messages=messages)
            return (time.perf_counter() - start) / num_calls

    async def direct():
        ids = render_prompt(tokenizer, messages, True)
        start = time.perf_counter()
        for _ in range(num_calls):
            await engine.generate_async(ids, one, 1, None)
        return (time.perf_counter() - start) / num_calls

    endpoint_s = asyncio.run(through_endpoint())
    engine.run(runner.endpoint.close(episode))
    return endpoint_s, engine.run(direct())


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


def recomputed_context_tokens(episodes, block_size: int) -> int:
    """Context tokens the later turns of ``episodes`` prefill again: each turn is a new request whose prompt is the
    whole episode so far, and vLLM's prefix cache holds only whole KV blocks of what was computed (everything but a
    turn's last sampled token), so the rest of the context is prefilled again with the new observation."""
    total = 0
    for e in episodes:
        mask = np.asarray(e.loss_mask)
        for start in np.flatnonzero((mask[1:] == 0) & (mask[:-1] == 1)) + 1:  # an observation after a model turn
            context = len(e.prompt_ids) + int(start)
            total += context - (context - 1) // block_size * block_size
    return total


def run_prefill(engine, num_prompts: int, prompt_len: int, sampling):
    """Tokens/s of prefilling ``num_prompts`` fresh prompts of ``prompt_len`` tokens at once (one token generated):
    the rate the episodes' observation tokens are paid at."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(300, 400, prompt_len).tolist() for _ in range(num_prompts)]
    one = sampling.model_copy(update={"max_tokens": 1, "stop_token_ids": []})

    async def batch():
        return await asyncio.gather(*(engine.generate_async(p, one, 1, k) for k, p in enumerate(prompts)))

    engine.run(batch())  # the same prompts again would hit the prefix cache: time fresh ones
    prompts = [rng.integers(300, 400, prompt_len).tolist() for _ in range(num_prompts)]
    start = time.perf_counter()
    engine.run(batch())
    return num_prompts * prompt_len / (time.perf_counter() - start)


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
    parser.add_argument("--block-size", type=int, default=None, help="KV-cache block size (default: vLLM's)")
    parser.add_argument("--update-mode", choices=("wait", "keep"), default="wait",
                        help="how updates meet turns in flight (EngineConfig.update_mode)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from rollout.agents import AgentRunner
    from rollout.config import EngineConfig, SamplingConfig
    from rollout.engine.vllm_engine import VLLMEngine
    from rollout.envs.config import AgentEnvConfig
    from rollout.tasks.problem import Problem
    from rollout.tokenizer import load_tokenizer
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        model_dir = make_model(args, Path(tmp) / "model")
        tokenizer = load_tokenizer(model_dir)
        engine = VLLMEngine(model_dir, EngineConfig(
            dtype=args.dtype, max_model_len=1024, block_size=args.block_size, max_num_seqs=args.num_episodes,
            kv_cache_gib=1.0, update_mode=args.update_mode,
        ))  # fmt: skip
        try:
            problems = [Problem(prompt=f"Compute {i} times {2 * i + 1}.", answer="0", problem_id=str(i))
                        for i in range(args.num_episodes)]  # fmt: skip
            sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens,
                                      stop_token_ids=list(range(100, 100 + args.num_stop_ids)))
            run_episodes(engine, tokenizer, problems[:4], sampling, args, seed=99)  # warm-up (compilation)
            runner = AgentRunner(AgentEnvConfig(function="benchmarks.agentic:bench_agent", max_turns=args.turns,
                                                options={"turns": args.turns, "latency_s": args.tool_latency_ms / 1e3}),
                                 engine, tokenizer)  # fmt: skip
            multi, single, eps, agents, segments = [], [], [], [], []
            for rep in range(args.reps):
                episodes, seconds = run_episodes(engine, tokenizer, problems, sampling, args, seed=rep)
                tokens = sum(int(e.loss_mask.sum()) for e in episodes)
                multi.append(tokens / seconds)
                eps.append(len(episodes) / seconds)
                single_tokens, single_s = run_single_turn(engine, episodes, sampling)
                assert single_tokens == tokens, (single_tokens, tokens)
                single.append(single_tokens / single_s)
                agent_rate, agent_segments = run_agents(runner, problems, sampling, seed=rep)
                agents.append(agent_rate)
                segments.append(agent_segments)
            endpoint_call_s, direct_call_s = call_latency(runner, engine, tokenizer, sampling)
            runner.shutdown()
            turns = statistics.mean(e.num_turns for e in episodes)
            per_turn = tokens / sum(e.num_turns for e in episodes)
            first = sum(len(e.prompt_ids) for e in episodes)
            observed = sum(int((e.loss_mask == 0).sum()) for e in episodes)
            block_size = engine.block_size
            recomputed = recomputed_context_tokens(episodes, block_size)
            prefill = run_prefill(engine, args.num_episodes, max(1, observed // len(episodes)), sampling)
            pauses, with_updates_s, plain_s = measure_update_pause(
                engine, tokenizer, problems, sampling, args, model_dir
            )
        finally:
            engine.shutdown()
    ratios = [m / s for m, s in zip(multi, single, strict=True)]
    agent_ratios = [a / m for a, m in zip(agents, multi, strict=True)]
    load_after = os.getloadavg()
    med = statistics.median
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores ({cpu_isa()}); load average before {load_before[0]:.2f}, "
          f"after {load_after[0]:.2f}")
    print(f"model: {args.hidden_size}x{args.num_layers} Qwen3 ({args.dtype}); {args.num_episodes} episodes x "
          f"{turns:.2f} turns (of {args.turns}) x {per_turn:.1f} tokens per turn; tool latency "
          f"{args.tool_latency_ms:.0f} ms; KV block size {block_size}; "
          f"{args.reps} reps, median [min-max]")
    print(f"{'':<34}{'median':>10}{'range':>22}")
    for name, values, fmt in (("episodes: episodes/s", eps, ".2f"), ("episodes: model tokens/s", multi, ".0f"),
                              ("single-turn: tokens/s", single, ".0f"), ("episodes / single-turn", ratios, ".2f"),
                              ("agent endpoint: model tokens/s", agents, ".0f"),
                              ("agent endpoint / episodes", agent_ratios, ".2f"),
                              ("agent endpoint: samples/episode", segments, ".2f")):
        print(f"{name:<34}{med(values):>10{fmt}}{f'[{min(values):{fmt}} - {max(values):{fmt}}]':>22}")
    print(f"one-token call, one at a time: {endpoint_call_s * 1e3:.1f} ms through the endpoint (openai client, HTTP, "
          f"template) vs {direct_call_s * 1e3:.1f} ms straight into the engine")
    # The episodes' least extra work: their observation tokens, prefilled once each at the engine's prefill rate; and
    # what a request per turn adds to it: the context's last, partial KV block (the prefix cache holds whole blocks).
    def bound(extra: int) -> float:
        return 1.0 / (1.0 + (extra / prefill) / (tokens / med(single)))

    print(f"tokens per episode: first prompt {first / len(episodes):.0f}, model {tokens / len(episodes):.0f}, "
          f"observations {observed / len(episodes):.0f} (prefilled by the episodes only), context re-prefilled "
          f"{recomputed / len(episodes):.0f} (each later turn's partial KV block); prefill {prefill:.0f} tok/s, so the "
          f"ratio cannot exceed {bound(observed + recomputed):.2f} on this engine ({bound(observed):.2f} with the "
          f"context's KV kept from turn to turn)")
    print(f"pause per update ({args.update_mode}), episodes in flight: median {med(pauses) * 1e3:.0f} ms, "
          f"max {max(pauses) * 1e3:.0f} ms "
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
