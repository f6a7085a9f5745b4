"""Weight-sync bandwidth on loopback, all paths measured in one run and printed as one table.

    python benchmarks/weight_sync.py                 # ~1 GiB of bf16 parameters
    python benchmarks/weight_sync.py --size 256      # MiB; smaller for a quick look

Rows: memcpy into an existing buffer (the ceiling), a raw TCP socket into a preallocated buffer, a gloo broadcast
between two processes, our push to one receiver process (full version through the same-host shared-memory plane, over
the socket data plane and over gRPC Push streams, each plane with one sender kept across repeats as a trainer keeps
it; then a delta over the socket plane where ~3% of the bf16 values changed; rates are model bytes / wall time of
Begin + push + commit). memcpy, raw TCP and the three full pushes are timed back to back in every repeat, so each
repeat gives its own ratio (printed as median [range]); the benchmark warns when the load average says other jobs
share the cores. Then the receivers' peak memory over the model's bytes, and the bytes the trainer sends per version
with 8 receivers and relay on (counted, not timed: 8 receivers on 2 cores cannot show it in wall time). Receivers and
baselines run in their own processes so no two share a GIL. Links slower than loopback: `weight_sync_links.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import load_avg, machine_line, med_range  # noqa: E402
from common.net import free_port  # noqa: E402
from common.signals import wait_for_stop  # noqa: E402
from weight_sync.config import WeightSyncConfig  # noqa: E402

NUM_TENSORS = 16
QUIET_LOAD = 0.5  # 1-minute load average above which the benchmark warns that its ratios may mislead


def model_arrays(size_mib: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`size_mib` MiB of bf16 bit patterns (uint16) split into NUM_TENSORS 2-D tensors."""
    rng = np.random.default_rng(seed)
    per = size_mib * (1 << 20) // 2 // NUM_TENSORS
    cols = 1024
    rows = max(per // cols, 1)
    return {
        f"model.layers.{i}.mlp.weight": rng.integers(0, 2**16, (rows, cols), dtype=np.uint16)
        for i in range(NUM_TENSORS)
    }


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=env)


# -- baselines ------------------------------------------------------------------------------------------------------
def bench_delta_compare(arrays: dict[str, np.ndarray], chunk_bytes: int, repeats: int) -> float:
    """Rate of the compare alone that any delta encoding needs (new vs base, ~3% changed), chunk by chunk: the ceiling
    of a delta push's effective rate on one core, whatever the link."""
    from weight_sync.codec import sparse_encode

    rng = np.random.default_rng(3)
    bases = {k: v.copy() for k, v in arrays.items()}
    news = {k: v.copy() for k, v in arrays.items()}
    for v in news.values():
        v.reshape(-1)[rng.integers(0, v.size, int(0.03 * v.size))] ^= 1
    step = chunk_bytes // 2
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for k, v in news.items():
            flat, base = v.reshape(-1), bases[k].reshape(-1)
            for i in range(0, flat.size, step):
                sparse_encode(flat[i : i + step], base[i : i + step])
        times.append(time.perf_counter() - start)
    return gbps(sum(v.nbytes for v in arrays.values()), statistics.median(times[1:]))


def tcp_receiver(port: int, nbytes: int, repeats: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", port)) as server:
        print("ready", flush=True)
        for _ in range(repeats + 1):
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], min(nbytes - got, 8 << 20))
                    if n == 0:
                        raise ConnectionError("sender closed early")
                    got += n
                conn.sendall(b"k")


def send_tcp(arrays: dict[str, np.ndarray], port: int) -> float:
    """Seconds to send every array over one fresh connection to `tcp_receiver` and get its one-byte answer."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for v in arrays.values():
            conn.sendall(memoryview(v).cast("B"))
        assert conn.recv(1) == b"k"
    return time.perf_counter() - start


def gloo_rank(rank: int, port: int, nbytes: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(buf, src=0)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 1:
        print(json.dumps({"seconds": statistics.median(times[1:])}), flush=True)
    dist.destroy_process_group()


def bench_gloo(nbytes: int, repeats: int) -> float:
    port = free_port()
    procs = [spawn("--_role", "gloo", "--_rank", str(r), "--_port", str(port), "--_nbytes", str(nbytes),
                   "--_repeats", str(repeats)) for r in range(2)]
    out = procs[1].stdout.read()
    for p in procs:
        p.wait(timeout=300)
    return gbps(nbytes, json.loads(out.strip().splitlines()[-1])["seconds"])


# -- weight sync ----------------------------------------------------------------------------------------------------
def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class DiscardSink:
    """Accepts every update and keeps nothing: the receiver's own buffers are what is measured."""

    def __init__(self, manifest):
        self._manifest = manifest

    def manifest(self):
        return list(self._manifest)

    def apply(self, policy_version, tensors):
        pass

    def committed_version(self) -> int:
        return 0


def weight_receiver(size_mib: int, config_fields: dict) -> None:
    """A receiver of `model_arrays(size_mib)`'s shapes into a DiscardSink, with `WeightSyncConfig(**config_fields)`:
    prints its address, then (on SIGTERM) its peak memory above its idle RSS as JSON."""
    import gc

    from weight_sync.receiver import WeightReceiver
    from weight_sync.spec import TensorSpec

    specs = [TensorSpec(k, v.shape, "bfloat16") for k, v in model_arrays(size_mib).items()]  # shapes only
    gc.collect()
    receiver = WeightReceiver(DiscardSink(specs), WeightSyncConfig(**config_fields))
    receiver.start()
    baseline = _rss_bytes("VmRSS")
    print(receiver.address, flush=True)
    wait_for_stop()
    print(json.dumps({"peak_extra_bytes": _rss_bytes("VmHWM") - baseline}), flush=True)
    receiver.stop(0)


def shards_of(arrays: dict[str, np.ndarray]):
    import torch

    from weight_sync.sender import Shard

    for name, v in arrays.items():
        t = torch.from_numpy(v).view(torch.bfloat16)
        yield Shard(name, t, tuple(t.shape), (0, 0))


def bench_push(
    arrays: dict[str, np.ndarray], size_mib: int, chunk_bytes: int, repeats: int, ratios: dict[str, list[float]]
) -> dict[str, float]:
    """Rates of every path (GB/s) and receiver memory figures; per-repeat ratios of the interleaved paths go to
    `ratios`."""
    from weight_sync.sender import WeightSender

    nbytes = sum(v.nbytes for v in arrays.values())
    # One receiver per data plane: the socket-plane one ("auto") also takes the deltas; its memory is the one to watch.
    procs = {
        plane: spawn(
            "--_role", "receiver", "--size", str(size_mib),
            "--_config", json.dumps({"chunk_bytes": chunk_bytes, "data_plane": plane, "delta": True}),
        )
        for plane in ("auto", "grpc", "shm")
    }
    addresses = {plane: proc.stdout.readline().strip() for plane, proc in procs.items()}
    address = addresses["auto"]
    tcp_port = free_port()
    tcp = spawn("--_role", "tcp", "--_port", str(tcp_port), "--_nbytes", str(nbytes), "--_repeats", str(repeats))
    assert tcp.stdout.readline().strip() == "ready"
    version = 0

    def timed(sender, data) -> tuple[float, object]:
        nonlocal version
        version += 1
        start = time.perf_counter()
        report = sender.push(version, shards_of(data))
        committed = sender.commit(version)
        seconds = time.perf_counter() - start
        assert not report.failed and all(e is None for e in committed.values()), (report.failed, committed)
        return seconds, report

    out: dict[str, float] = {}
    receiver_of = {"shm": "shm", "tcp": "auto", "grpc": "grpc"}
    senders = {
        plane: WeightSender([addresses[receiver_of[plane]]], WeightSyncConfig(
            chunk_bytes=chunk_bytes, delta=False, data_plane=plane
        ))
        for plane in receiver_of
    }
    copies = {k: np.empty_like(v) for k, v in arrays.items()}
    times: dict[str, list[float]] = {"memcpy": [], "raw_tcp": [], **{plane: [] for plane in receiver_of}}
    try:
        # Interleaved: each repeat times every path back to back, so a load change hits all of them alike and each
        # repeat gives its own ratio to memcpy and to raw TCP.
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for k, v in arrays.items():
                np.copyto(copies[k], v)
            times["memcpy"].append(time.perf_counter() - start)
            times["raw_tcp"].append(send_tcp(arrays, tcp_port))
            for plane, sender in senders.items():
                seconds, report = timed(sender, arrays)
                target = [addresses[receiver_of[plane]]]
                assert report.shm_endpoints == (target if plane == "shm" else []), report
                assert report.socket_endpoints == (target if plane == "tcp" else []), report
                times[plane].append(seconds)
    finally:
        for sender in senders.values():
            sender.close()
    tcp.wait(timeout=60)
    for path, runs in times.items():
        out[f"full_{path}_gbps"] = gbps(nbytes, statistics.median(runs[1:]))
    ratios["socket plane / raw TCP"] = [t / p for t, p in zip(times["raw_tcp"][1:], times["tcp"][1:], strict=True)]
    ratios["shared memory / memcpy"] = [m / p for m, p in zip(times["memcpy"][1:], times["shm"][1:], strict=True)]
    rng = np.random.default_rng(1)
    delta = []
    with WeightSender([address], WeightSyncConfig(chunk_bytes=chunk_bytes, delta=True, data_plane="tcp")) as sender:
        timed(sender, arrays)  # establishes the delta base on both sides (the sender keeps its own copy)
        for _ in range(repeats + 1):  # the first delta also allocates the receiver's second buffer: warm-up
            for v in arrays.values():  # in place: flip the lowest mantissa bit of ~3% of the bf16 values
                v.reshape(-1)[rng.integers(0, v.size, int(0.03 * v.size))] ^= 1
            seconds, report = timed(sender, arrays)
            assert report.delta_endpoints == [address]
            delta.append(seconds)
    seconds = statistics.median(delta[1:])
    out["delta_gbps"] = gbps(nbytes, seconds)
    out["delta_wire_fraction"] = report.bytes_sent / nbytes
    for plane, proc in procs.items():
        proc.send_signal(signal.SIGTERM)
        stats = json.loads(proc.stdout.read().strip().splitlines()[-1])
        proc.wait(timeout=60)
        out[f"receiver_peak_over_model_{plane}"] = stats["peak_extra_bytes"] / nbytes
    return out


def bench_relay_bytes(size_mib: int, num_receivers: int, fanout: int) -> float:
    """Trainer bytes sent per version / model bytes, with in-process receivers (bytes are counted, not timed)."""
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sender import WeightSender
    from weight_sync.spec import TensorSpec

    arrays = model_arrays(size_mib, seed=2)
    specs = [TensorSpec(k, v.shape, "bfloat16") for k, v in arrays.items()]
    config = WeightSyncConfig(chunk_bytes=1 << 20, relay_fanout=fanout, delta=False)
    receivers = [WeightReceiver(DiscardSink(specs), config) for _ in range(num_receivers)]
    for r in receivers:
        r.start()
    try:
        with WeightSender([r.address for r in receivers], config) as sender:
            report = sender.push(1, shards_of(arrays))
            assert not report.failed and all(e is None for e in sender.commit(1).values())
        return report.bytes_sent / sum(v.nbytes for v in arrays.values())
    finally:
        for r in receivers:
            r.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="model size in MiB of bf16 (default 1024)")
    parser.add_argument(
        "--chunk-bytes", type=int, default=WeightSyncConfig.model_fields["chunk_bytes"].default,
        help="weight-sync chunk size in bytes (default: WeightSyncConfig's)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per path (median; one warm-up extra)")
    parser.add_argument("--relay-size", type=int, default=32, help="MiB pushed through the 8-receiver relay count")
    parser.add_argument("--_role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_nbytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_repeats", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_config", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._role == "tcp":
        return tcp_receiver(args._port, args._nbytes, args._repeats)
    if args._role == "gloo":
        return gloo_rank(args._rank, args._port, args._nbytes, args._repeats)
    if args._role == "receiver":
        return weight_receiver(args.size, json.loads(args._config))

    print(machine_line(), flush=True)
    if float(load_avg().split()[0]) > QUIET_LOAD:
        print(f"WARNING: 1-minute load average above {QUIET_LOAD}: other jobs share the cores and ratios taken now "
              "may mislead (see README); rerun on a quiet machine", flush=True)
    arrays = model_arrays(args.size)
    nbytes = sum(v.nbytes for v in arrays.values())
    print(f"model: {NUM_TENSORS} bf16 tensors, {nbytes / 2**20:.0f} MiB; chunk {args.chunk_bytes / 2**20:g} MiB; "
          f"{os.cpu_count()} cores; median of {args.repeats}", flush=True)
    ratios: dict[str, list[float]] = {}
    push = bench_push(arrays, args.size, args.chunk_bytes, args.repeats, ratios)
    rows = {
        "memcpy into an existing buffer": push["full_memcpy_gbps"],
        "raw TCP socket (loopback)": push["full_raw_tcp_gbps"],
        "gloo broadcast, 2 processes": bench_gloo(nbytes, args.repeats),
        "weight_sync push, 1 receiver, full, shared memory (same host)": push["full_shm_gbps"],
        "weight_sync push, 1 receiver, full, socket data plane (other hosts)": push["full_tcp_gbps"],
        "weight_sync push, 1 receiver, full, gRPC Push streams (TLS / relay path)": push["full_grpc_gbps"],
        "weight_sync push, 1 receiver, delta 3% changed (effective)": push["delta_gbps"],
        "delta compare alone, 1 core (ceiling of any delta push)": bench_delta_compare(
            arrays, args.chunk_bytes, args.repeats
        ),
    }
    tcp, mem = rows["raw TCP socket (loopback)"], rows["memcpy into an existing buffer"]
    print("\n| path | GB/s | / raw TCP | / memcpy |\n|---|---|---|---|")
    for name, rate in rows.items():
        print(f"| {name} | {rate:.2f} | {rate / tcp:.2f} | {rate / mem:.2f} |")
    print("\nper-repeat ratios (memcpy, raw TCP and the push planes back to back in each repeat), median [range]:")
    for name, values in ratios.items():
        print(f"  {name}: {med_range(values)}x")
    print(f"delta push / full push effective rate: {push['delta_gbps'] / push['full_tcp_gbps']:.1f}x "
          f"(delta bytes on the wire: {100 * push['delta_wire_fraction']:.2f}% of the model; links: "
          "benchmarks/weight_sync_links.py)")
    print(f"receiver peak memory above its idle RSS / model bytes: {push['receiver_peak_over_model_auto']:.2f}x "
          "(default receiver: full pushes then deltas over the socket plane: staging + delta base; the sink's own copy "
          f"not included); {push['receiver_peak_over_model_grpc']:.2f}x for the gRPC-only receiver, "
          f"{push['receiver_peak_over_model_shm']:.2f}x for the shared-memory one (full pushes only)")
    for fanout in (1, 2):
        ratio = bench_relay_bytes(args.relay_size, 8, fanout)
        print(f"trainer bytes sent per version / model bytes, 8 receivers, relay_fanout={fanout}: {ratio:.4f}x "
              f"({args.relay_size} MiB model)")


if __name__ == "__main__":
    main()
