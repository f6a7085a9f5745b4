"""An evaluator independent of rl-align: HF transformers on the exported model, the held-out JSONL, exact match.

    python examples/own_task/evaluate.py runs/own_task/final_model examples/own_task/data/eval.jsonl [--sample]

Greedy by default (comparable with the run's ``eval/greedy_accuracy``); ``--sample`` draws at temperature 1 (the
run's ``eval/accuracy``, within sampling noise). Uses nothing of this repository: only the exported directory.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("--sample", action="store_true", help="sample at temperature 1 instead of greedy decoding")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="torch seed of --sample")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    problems = [json.loads(line) for line in open(args.data)]
    correct = 0
    for p in problems:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.sample, temperature=1.0,
                                 top_k=0, top_p=1.0)  # fmt: skip
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        correct += answer == str(p["answer"]).strip()
    print(f"{'sampled' if args.sample else 'greedy'} exact-match accuracy: {correct / len(problems):.3f} "
          f"({correct}/{len(problems)})")


if __name__ == "__main__":
    main()
