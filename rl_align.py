"""rl-align: RL post-training (GRPO or PPO) of a language model from one recipe file.

    python rl_align.py --recipe recipes/grpo_tiny.toml                 # embedded Ray on this machine
    python rl_align.py --recipe recipes/grpo_tiny.toml --trainer.optimizer.lr 1e-5 --run.num_steps 50
    ray job submit --working-dir . -- python rl_align.py --recipe recipes/ppo_tiny.toml \
        --run.output_dir /shared/runs/ppo_tiny                          # on a cluster: outputs at an absolute path
    python rl_align.py --recipe recipes/grpo_tiny.toml --resume        # continue from the last checkpoint
    python rl_align.py --recipe recipes/grpo_tiny.toml --resume auto   # ... or start fresh if there is none

Each step: the vLLM rollout pool samples ``group_size`` completions per prompt and scores them; the trainer ranks
compute advantages and update the policy; every rank pushes its own parameter shards over gRPC into every engine (and
every external server the recipe lists). Metrics, the resolved recipe and checkpoints go to ``run.output_dir``.

This module only parses the command line and the recipe; heavy imports (torch, Ray, vLLM) happen after validation,
so ``--help`` and a bad recipe answer at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl_align.py",
        description=__doc__.split("\n\n")[0],
        epilog="Any '--section.field VALUE' overrides that field of the recipe (values parse as TOML).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--recipe", required=True, help="recipe TOML file (see recipes/)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="required",
        choices=("required", "auto"),
        help="continue from the newest checkpoint of the run; '--resume auto' starts fresh when there is none "
        "(for job retries)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join; default: the cluster of `ray job submit` (RAY_ADDRESS), else an embedded instance",
    )
    parser.add_argument(
        "--check", action="store_true",
        help="validate the recipe, the task's data and (for a model directory that exists) its tokenizer, print the "
        "recipe resolved, exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse, validate, then run; returns the process exit code."""
    args, rest = _parser().parse_known_args(argv)
    from common.config import ConfigError, parse_overrides, to_toml
    from driver.resume import record_in_its_directory
    from recipe import load_recipe

    try:
        overrides = parse_overrides(rest)
        recipe, moved_from = record_in_its_directory(Path(args.recipe), load_recipe(args.recipe, overrides), overrides)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        from driver.preflight import check_offline

        try:
            dataset = check_offline(recipe)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(to_toml(recipe), end="")
        # On stderr: stdout stays the resolved recipe alone, for a script to keep.
        later = ""
        if not recipe.policy_config_known:  # a tiny model the run creates (the load refused any other missing one)
            later = (f"; the tiny model for {recipe.model.path} does not exist yet: it is checked against the "
                     "trainer's sharding and the tokenizer once a run creates it, before any actor starts")  # fmt: skip
        print(f"ok: {args.recipe} with {len(dataset)} training and {len(dataset.eval_problems())} held-out problems "
              f"(nothing was started){later}", file=sys.stderr)  # fmt: skip
        return 0
    from driver.run import run

    return run(recipe, resume=args.resume, address=args.address, moved_from=moved_from)


if __name__ == "__main__":
    from driver.session import exit_process

    exit_process(main())
