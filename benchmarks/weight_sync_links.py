"""Full vs delta pushes over shaped links, and what `delta = "auto"` picks on each: one run, one table.

    sudo python benchmarks/weight_sync_links.py              # 256 MiB of bf16, links 1 Gb/s, 10 Gb/s, unshaped
    python benchmarks/weight_sync_links.py --size 64 --rates 1gbit

Needs root (network namespaces and `tc`, from iproute2). The receiver runs in a network namespace of this run's own,
joined to this one by a veth pair whose host end is shaped with a token bucket (`tc qdisc ... tbf rate R`; this kernel
has no `netem`, so no delay is added); the sender (this process) pushes to it over the socket data plane. The
namespace, the veth pair and the qdisc exist only for the run (removed also when it fails); traffic goes only between
the pair's two ends.

Per link, in one loop so that each repeat times every mode back to back: a full push (`delta = false`), a delta push
with ~3% of the bf16 values changed (`delta = true`), and `delta = "auto"` (the first push of each auto sender is full
and measures the link; the rows show the later ones and which kind auto sent). Rates are model bytes / wall time of
push + commit (the effective rate), medians over the repeats; the ratio column is delta / full. The unshaped row is
the veth pair without a qdisc (a fast same-host link).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine_line, med_range  # noqa: E402
from benchmarks.weight_sync import gbps, model_arrays, shards_of  # noqa: E402

HOST_IP, NS_IP = "10.213.7.1", "10.213.7.2"  # the two ends of this run's own veth pair (a /30 of its own)
CHANGED = 0.03


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def namespace_link() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace name, host end's device); removed after."""
    tag = f"rlws{os.getpid() % 100000}"
    ns, host_dev, ns_dev = tag, f"{tag}h", f"{tag}n"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
        _ip("link", "set", ns_dev, "netns", ns)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", host_dev)
        _ip("link", "set", host_dev, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{NS_IP}/30", "dev", ns_dev)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_dev, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_dev
    finally:
        subprocess.run(["ip", "link", "del", host_dev], capture_output=True)  # deletes its peer too
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def shape(dev: str, rate: str | None) -> None:
    """Shape `dev`'s egress (sender -> receiver) to `rate` (tc syntax, e.g. 1gbit); None: no qdisc."""
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate is None:
        return
    burst = max(int(_bits(rate) / 8 / 1000), 64 << 10)  # ~1 ms of traffic at the rate
    subprocess.run(
        ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"],
        check=True,
    )


def _bits(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 500mbit")


def spawn_receiver(ns: str, size_mib: int, chunk_bytes: int) -> tuple[subprocess.Popen, str]:
    """A receiver inside `ns` listening on NS_IP (plain sockets: a trusted test link), keeping delta bases."""
    config = {
        "bind_host": NS_IP, "allow_insecure_remote": True, "chunk_bytes": chunk_bytes, "delta": True,
        "data_plane": "tcp",
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--_role", "receiver",
         "--size", str(size_mib), "--_config", json.dumps(config)],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    return proc, proc.stdout.readline().strip()


def bench_link(
    arrays: dict[str, np.ndarray], addresses: dict[str, str], chunk_bytes: int, repeats: int, versions: Iterator[int]
) -> dict[str, object]:
    """Effective rates (GB/s) of full, delta and auto pushes, each mode to its own receiver (`addresses`: a delta
    needs the receiver to hold the sender's previous version), interleaved per repeat; what auto sent."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender

    nbytes = sum(v.nbytes for v in arrays.values())
    modes: dict[str, bool | str] = {"full": False, "delta": True, "auto": "auto"}
    senders = {
        m: WeightSender([addresses[m]], WeightSyncConfig(chunk_bytes=chunk_bytes, delta=d, data_plane="tcp"),
                        session_id="trainer")
        for m, d in modes.items()
    }
    rng = np.random.default_rng(5)
    times: dict[str, list[float]] = {m: [] for m in modes}
    kinds: list[str] = []
    wire: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for rep in range(repeats + 2):  # the first two set up bases (and auto's measurement): not timed
            for v in arrays.values():  # ~3% of the bf16 values change by one bit, as a small optimizer step does
                v.reshape(-1)[rng.integers(0, v.size, int(CHANGED * v.size))] ^= 1
            for mode, sender in senders.items():
                version = next(versions)
                start = time.perf_counter()
                report = sender.push(version, shards_of(arrays))
                committed = sender.commit(version)
                seconds = time.perf_counter() - start
                assert not report.failed and all(e is None for e in committed.values()), (report.failed, committed)
                if rep >= 2:
                    times[mode].append(seconds)
                    wire[mode].append(report.bytes_sent / nbytes)
                    if mode == "auto":
                        kinds.append("delta" if report.delta_endpoints else "full")
    finally:
        for sender in senders.values():
            sender.close()
    out: dict[str, object] = {f"{m}_gbps": gbps(nbytes, statistics.median(t)) for m, t in times.items()}
    out["ratios"] = [f / d for f, d in zip(times["full"], times["delta"], strict=True)]
    out["auto_kinds"] = kinds
    out["delta_wire"] = statistics.median(wire["delta"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256, help="model size in MiB of bf16 (default 256)")
    parser.add_argument("--rates", default="1gbit,10gbit,none", help="links to measure, tc rates; 'none': unshaped")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per mode (median)")
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20, help="weight-sync chunk size in bytes")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: network namespaces and tc qdiscs (run it with sudo)")
    print(machine_line(), flush=True)
    arrays = model_arrays(args.size)
    nbytes = sum(v.nbytes for v in arrays.values())
    print(f"model: {nbytes / 2**20:.0f} MiB of bf16; {100 * CHANGED:g}% of the values change per version; "
          f"chunk {args.chunk_bytes / 2**20:g} MiB; median of {args.repeats}", flush=True)
    rows = []
    versions = itertools.count(1)  # the same receivers for every link: versions only move forward
    with namespace_link() as (ns, dev):
        receivers = {mode: spawn_receiver(ns, args.size, args.chunk_bytes) for mode in ("full", "delta", "auto")}
        addresses = {mode: address for mode, (_, address) in receivers.items()}
        try:
            for rate in args.rates.split(","):
                shape(dev, None if rate == "none" else rate)
                result = bench_link(arrays, addresses, args.chunk_bytes, args.repeats, versions)
                rows.append((rate, result))
                print(f"{rate}: done", flush=True)
        finally:
            shape(dev, None)
            for proc, _ in receivers.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    print("\n| link | full GB/s | delta GB/s | delta / full, per repeat | auto GB/s | auto sent | delta wire bytes |")
    print("|---|---|---|---|---|---|---|")
    for rate, r in rows:
        kinds = r["auto_kinds"]
        sent = ", ".join(f"{kinds.count(k)} {k}" for k in ("delta", "full") if k in kinds)
        print(f"| {rate if rate != 'none' else 'unshaped veth'} | {r['full_gbps']:.3f} | {r['delta_gbps']:.3f} | "
              f"{med_range(r['ratios'])}x | {r['auto_gbps']:.3f} | {sent} | {100 * r['delta_wire']:.1f}% |")


if __name__ == "__main__":
    main()
