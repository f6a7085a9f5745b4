"""Subprocess helper of test_vllm_load.py: load a checkpoint directory in vLLM (CPU) and print prompt logprobs.

Usage: python vllm_prompt_logprobs.py DIR DTYPE TOKEN_IDS_JSON  -> prints one JSON list (logprob of tokens 1..T-1).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    path, dtype, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, max_model_len=64, enforce_eager=True)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0].prompt_logprobs
    print("LOGPROBS " + json.dumps([out[i][ids[i]].logprob for i in range(1, len(ids))]))
