"""vLLM's two ways to serve a new LoRA adapter version, side by side in one engine: a fresh ``LoRARequest`` id per
version (what ``rollout.engine.adapters.ServedAdapters`` does: requests in flight keep the adapter they started with,
no drain) against reloading one id in place (``LoRARequest(load_inplace=True)``: requests in flight would switch
weights mid-completion, so an engine would have to drain before each update to keep versions unmixed).

    python -m benchmarks.lora_swap [--rank 16] [--num-layers 8] [--versions 8] [--threads 2]

One vLLM engine (float32, eager, the engine arguments a run uses with ``lora_serving = "adapter"``) on Qwen3-0.6B's
real layer shapes (``--num-layers`` of its 28 blocks). Each version is a random adapter of ``--rank`` on all seven
projections, written as a PEFT directory (``weight_sync.peft.write_peft_adapter``, as the sink stages it), then
served: fresh, ``add_lora`` of a new id and ``remove_lora`` of the previous one; in place, ``add_lora`` of the same id
with ``load_inplace``. A one-token request on the new adapter follows each swap, timed apart: vLLM copies an adapter
into its serving slots when a request first uses it, so part of a swap's cost lands there. The two ways alternate
version by version, so drift in the machine hits both. Printed: median and range of the swap (write + load +
retire), of the request after it, and of both, per way.

Measured (2-core "Intel(R) Xeon(R) Processor", AVX-512 + AMX; rank 16, 8 blocks, 11 MiB adapters; three runs, load
0.6-0.8 before, 0.8-0.9 after; medians): the swap itself 0.070-0.071 s either way; the request after it 0.071 vs
0.108-0.110 s (the first request on an adapter reloaded in place is the slower one); swap + request 0.140-0.142 vs
0.177-0.180 s: **in place 1.27x slower** in all three. The fresh id stays: faster, and it needs no drain.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.lora import ALL_PROJECTIONS
from benchmarks.machine import load_avg, machine_line, med_range


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=8, help="blocks of Qwen3-0.6B (it has 28)")
    parser.add_argument("--versions", type=int, default=8, help="adapter versions served each way (first not timed)")
    parser.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    args = parser.parse_args()
    print(machine_line(), flush=True)

    import torch
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from rollout.config import EngineConfig, SamplingConfig
    from rollout.engine.platform import configure_vllm_environment
    from rollout.engine.vllm_engine import vllm_engine_args
    from rollout.engine.vllm_plugin import register
    from rollout.sampling import to_vllm_sampling_params
    from tools.make_tiny_model import make_published_model
    from weight_sync.checkpoint import read_checkpoint_manifest
    from weight_sync.peft import AdapterSpec, adapter_manifest, write_peft_adapter

    torch.set_num_threads(args.threads)
    spec = AdapterSpec(rank=args.rank, alpha=2.0 * args.rank, target_modules=ALL_PROJECTIONS)
    config = EngineConfig(max_model_len=256, max_num_seqs=8, kv_cache_gib=0.25, enforce_eager=True,
                          cpu_threads_bind="nobind", lora=spec, lora_serving="adapter")  # fmt: skip
    params = to_vllm_sampling_params(SamplingConfig(temperature=1.0, max_tokens=1, ignore_eos=True), n=1, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_published_model(Path(tmp) / "model", "Qwen3-0.6B", dtype="float32",
                                             num_layers=args.num_layers))  # fmt: skip
        shapes = [(s.name, s.shape) for s in adapter_manifest(read_checkpoint_manifest(model_dir), spec)]
        configure_vllm_environment(config)
        register()
        llm = LLM(**vllm_engine_args(config, model_dir, None))
        engine = llm.llm_engine
        gen = torch.Generator().manual_seed(0)
        ids = iter(range(1, 10**6))
        current = {"fresh": None, "inplace": None}
        swap_s: dict[str, list[float]] = {"fresh": [], "inplace": []}
        request_s: dict[str, list[float]] = {"fresh": [], "inplace": []}
        adapter_bytes = 0
        for version in range(args.versions):
            for way in ("fresh", "inplace"):
                tensors = {name: 0.01 * torch.randn(shape, generator=gen) for name, shape in shapes}
                adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
                path = Path(tmp) / f"{way}-v{version}"
                old = current[way]
                start = time.perf_counter()
                write_peft_adapter(path, tensors, spec, model_dir)
                if way == "fresh" or old is None:
                    request = LoRARequest(f"{way}-v{version}", next(ids), str(path))
                else:
                    request = LoRARequest(old.lora_name, old.lora_int_id, str(path), load_inplace=True)
                if not engine.add_lora(request):
                    raise RuntimeError(f"vLLM refused adapter {request}")
                if way == "fresh" and old is not None:
                    engine.remove_lora(old.lora_int_id)
                swapped = time.perf_counter()
                llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, lora_request=request, use_tqdm=False)
                done = time.perf_counter()
                current[way] = request
                if version > 0:  # the first load of each way warms vLLM's LoRA path
                    swap_s[way].append(swapped - start)
                    request_s[way].append(done - swapped)
        del llm
    print(f"\nQwen3-0.6B shapes, {args.num_layers} blocks; adapters of rank {args.rank} on all projections "
          f"({adapter_bytes / 2**20:.1f} MiB float32); {args.versions - 1} timed versions each way, alternating")
    print(f"{'way':<30} {'swap s (write+load+retire)':>27} {'next request s':>22} {'both s':>22}")
    both = {way: [a + b for a, b in zip(swap_s[way], request_s[way], strict=True)] for way in swap_s}
    for way, label in (("fresh", "fresh id per version (ours)"), ("inplace", "one id, load_inplace")):
        print(f"{label:<30} {med_range(swap_s[way], '{:.4f}'):>27} {med_range(request_s[way], '{:.4f}'):>22} "
              f"{med_range(both[way], '{:.4f}'):>22}")
    ratio = statistics.median(both["inplace"]) / statistics.median(both["fresh"])
    print(f"in place / fresh (medians of swap + next request): {ratio:.2f}x; in place would also need a drain per "
          "update to keep versions unmixed")
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
