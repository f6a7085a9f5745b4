"""Run model-written Python out of process, isolated and under hard limits, without blocking the event loop.

    result = await run_python("print(sum(range(10)))", SandboxLimits(wall_s=2.0))
    result.stdout                           # "45\\n"
    result.outcome, result.describe()       # "ok", "exited with status 0"

Every call starts a fresh interpreter (the base interpreter of this Python, ``-I``: no environment variables, no user
site; its ``site-packages`` hidden, so the stdlib only) through three processes:

- the *launcher* (:mod:`rollout.envs.sandbox_launcher`, run as a script, as root or as the caller) enters new mount,
  PID, network, IPC and UTS namespaces (``unshare``; a user namespace too when not root), builds the tool's root
  filesystem and ``pivot_root``s into it. The root is a size-capped tmpfs holding read-only binds of ``/usr``,
  ``/lib*``, the interpreter's prefix and a few ``/dev`` nodes, plus writable ``/sandbox`` (the cwd, holding
  ``main.py``), ``/tmp`` and ``/dev/shm``: the project tree, home directories and everything else on the host are not
  there at all. The new network namespace has only a downed loopback, so every connect fails (``network=True`` keeps
  the host's network).
- a *reaper*, PID 1 of the new PID namespace: it forks the tool, waits for it and reports its exit status and CPU
  time on a status pipe. When PID 1 exits the kernel kills everything left in the namespace, so no child of the tool
  (daemonized, ``setsid``'d or not) outlives the call.
- the *tool*, which sets its rlimits, drops to an unprivileged uid of its own (root mode: ``2_000_000_000 + the
  launcher's pid``, so ``RLIMIT_NPROC`` counts this tool's processes alone; it is not enforced for root) and execs.

The setup runs in the launcher rather than in a ``preexec_fn``: code between ``fork`` and ``exec`` of a multithreaded
parent (vLLM, Ray) can deadlock, and ``Popen``'s ``user=`` drops privileges before ``preexec_fn`` runs.

Limits (``SandboxLimits``) and how each ending is detected (``SandboxResult.outcome``):

- ``timeout``: ``wall_s`` passed; the supervisor asks the launcher to SIGKILL the reaper (so the whole namespace), and
  SIGKILLs the launcher's process group itself if that takes over 2 s.
- ``output_limit``: stdout+stderr passed ``4 * max_output_bytes``, killed the same way. Below that, output over the
  limit is only cut (``truncated``): the first and last halves of ``max_output_bytes`` of each stream are kept.
- ``cpu_limit``: ``RLIMIT_CPU`` (soft ``ceil(cpu_s)``: SIGXCPU; hard one second later: SIGKILL); detected from the
  tool's death by SIGXCPU, or by SIGKILL with its CPU time at the limit.
- ``memory_limit``: ``RLIMIT_AS``; detected from a non-zero exit whose stderr ends in ``MemoryError``.
- ``process_limit``: ``RLIMIT_NPROC``; detected from a non-zero exit with ``BlockingIOError: [Errno 11]`` (fork) or
  ``can't start new thread`` in stderr. Threads count as processes.
- ``killed``: died of any other signal (``signal`` says which); ``error``: any other non-zero exit; ``ok``: exit 0.

``disk_bytes`` caps the writable tmpfs and each file (``RLIMIT_FSIZE``); ``RLIMIT_CORE`` is 0. Limits apply per
process: a tool may hold ``max_processes * memory_bytes`` of address space at most. System V IPC (memory no rlimit
counts, which outlives its process) is bounded through the new IPC namespace's own settings where the launcher may
write them (root with a writable ``/proc/sys``; a mapped root in a user namespace from Linux 6.9): shared memory to
``memory_bytes`` in all, 16 message queues, 16 semaphore arrays of 32; where they cannot be written, System V IPC is
not bounded. Anonymous files, memory no rlimit counts either (``RLIMIT_FSIZE`` caps one, ``RLIMIT_NOFILE`` their
number: 16 GiB with the defaults), are refused: a seccomp filter makes ``memfd_create`` and ``memfd_secret`` fail with
EPERM (on x86_64, aarch64 and riscv64; it also refuses system calls of another ABI, such as 32-bit ones on x86_64).
The tool runs at niceness 10, so a busy tool yields the CPU to the engine (the launcher's own start-up runs before it
lowers its priority: how many start at once is bounded by the caller, :mod:`rollout.envs.tools`' slots).

Isolation needs root or unprivileged user namespaces. ``isolation="auto"`` picks root mode as root and user-namespace
mode otherwise (no uid of its own there: ``RLIMIT_NPROC`` then counts the caller's user in that namespace, which is
the launcher, the reaper and the tool); when the namespaces cannot be made, ``run_python`` raises
``SandboxUnavailableError`` naming what failed. ``isolation="none"`` is the explicit opt-in to run with rlimits and a
temporary cwd only (unsafe: the tool sees the host and runs as the caller, and children that call ``setsid`` escape
the final kill; one that keeps stdout open also holds up the return until it exits).

The classification reads the tool's stderr, so a tool can fake ``memory_limit`` or ``process_limit`` by printing those
lines and exiting non-zero; it cannot fake ``timeout``, ``output_limit`` or ``cpu_limit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Literal

from rollout.envs import sandbox_launcher
from rollout.envs.sandbox_launcher import TOOL_UID_BASE as _TOOL_UID_BASE

__all__ = ["Isolation", "Outcome", "SandboxLimits", "SandboxResult", "SandboxUnavailableError", "run_python"]

Outcome = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "process_limit", "killed"]
Isolation = Literal["auto", "userns", "none"]

_FLOOD_FACTOR = 4  # kill once this many times max_output_bytes have been printed
_NICENESS = 10  # a tool's compute yields to the engine's; a burst of start-ups is bounded by the tools' slots instead
_KILL_GRACE_S = 2.0  # how long the launcher may take to kill the namespace before its group is SIGKILLed


@dataclass(frozen=True)
class SandboxLimits:
    """Hard limits of one tool run; every one is enforced by the kernel or by the supervisor, none by the tool."""

    wall_s: float = 5.0
    """Wall-clock limit from start to exit; then every process of the run is killed (``timeout``)."""
    cpu_s: float = 5.0
    """CPU time of the tool's main process (``RLIMIT_CPU``, rounded up to whole seconds) (``cpu_limit``)."""
    memory_bytes: int = 512 << 20
    """Address space of each process (``RLIMIT_AS``) (``memory_limit``)."""
    max_output_bytes: int = 16 << 10
    """Bytes kept of stdout, and of stderr; printing ``4x`` that in all kills the run (``output_limit``)."""
    max_processes: int = 16
    """Processes and threads of the tool, itself included (``RLIMIT_NPROC``) (``process_limit``)."""
    disk_bytes: int = 64 << 20
    """Size of the writable tmpfs (in RAM) and of any one file the tool writes (``RLIMIT_FSIZE``)."""
    network: bool = False
    """Keep the host's network; by default the tool gets a network namespace of its own with no way out."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "max_output_bytes", "max_processes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        for name in ("memory_bytes", "max_output_bytes", "max_processes", "disk_bytes"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"SandboxLimits.{name} must be an int, got {getattr(self, name)!r}")
        if not math.isfinite(self.wall_s) or not math.isfinite(self.cpu_s):
            raise ValueError(f"SandboxLimits.wall_s and cpu_s must be finite, got {self.wall_s}, {self.cpu_s}")


@dataclass(frozen=True)
class SandboxResult:
    """How one tool run ended; ``describe()`` is the text the model sees when it did not end ``ok``."""

    stdout: str
    stderr: str
    outcome: Outcome
    exit_code: int | None
    """The tool's exit status; ``None`` when it was killed (by a signal or by the supervisor)."""
    signal: int | None
    """The signal that killed the tool, when one did (``None`` for ``timeout`` / ``output_limit``: the run was)."""
    truncated: bool
    """Some of stdout or stderr was cut (more than ``max_output_bytes`` of one of them)."""
    wall_s: float
    cpu_s: float
    """CPU time of the tool's main process (0.0 when it was killed by the supervisor)."""
    limits: SandboxLimits

    def describe(self) -> str:
        """A short sentence: how the run ended, with the limit it hit."""
        limits = self.limits
        text = {
            "ok": "exited with status 0",
            "error": f"exited with status {self.exit_code}",
            "timeout": f"timed out after {limits.wall_s:g} s",
            "cpu_limit": f"used up its CPU time limit of {math.ceil(limits.cpu_s)} s",
            "memory_limit": f"ran out of memory (limit {_size(limits.memory_bytes)})",
            "output_limit": f"was stopped for printing over {_size(_FLOOD_FACTOR * limits.max_output_bytes)}",
            "process_limit": f"hit the limit of {limits.max_processes} processes and threads",
            "killed": f"was killed by {_signal_name(self.signal)}",
        }[self.outcome]
        last = _last_line(self.stderr)
        if self.outcome == "error" and last:
            text += f": {last[:200]}"
        if self.truncated and self.outcome != "output_limit":
            text += f" (output cut to {_size(limits.max_output_bytes)} per stream)"
        return text


class SandboxUnavailableError(RuntimeError):
    """The sandbox could not be set up on this machine (a missing kernel feature or permission); nothing ran."""


async def run_python(
    code: str, limits: SandboxLimits | None = None, stdin: str = "", *, isolation: Isolation = "auto"
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed interpreter and return how it ended.

    Never raises for what the code does (errors, hangs, floods, bombs are outcomes); raises ``ValueError`` for bad
    arguments and ``SandboxUnavailableError`` when isolation cannot be set up. When it returns, no process of the run
    is alive; when it is cancelled, the kill is sent at once and lands moments later. ``stdin`` is fed to the tool's
    standard input. ``isolation``: ``"auto"`` (root mode or user-namespace mode, see the module docstring),
    ``"userns"`` (user-namespace mode even as root), ``"none"`` (rlimits and a temporary cwd only: unsafe, opt-in).
    """
    limits = SandboxLimits() if limits is None else limits
    if isolation not in ("auto", "userns", "none"):
        raise ValueError(f"isolation must be 'auto', 'userns' or 'none', got {isolation!r}")
    mode = _default_mode() if isolation == "auto" else isolation
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    host_dir = tempfile.mkdtemp(prefix="rl-align-sandbox-")
    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    out = _Output(limits.max_output_bytes)
    try:
        with open(os.path.join(host_dir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)  # a lone surrogate becomes a SyntaxError of the tool's, not an error here
        config = _launch_config(mode, limits, python, host_dir, status_w)
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                python, "-I", "-S", os.path.abspath(sandbox_launcher.__file__), json.dumps(config),
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(status_w,), start_new_session=True, env={}, cwd=host_dir,
            )  # fmt: skip
        finally:
            os.close(status_w)
        try:
            ending = await _supervise(proc, limits.wall_s, stdin.encode("utf-8", "surrogatepass"), out)
        finally:
            if proc.returncode is None:  # cancelled: the reaper dies with the launcher (parent-death signal)
                _kill_group(proc.pid)
        wall_s = time.monotonic() - start
        reports = _read_reports(status_r)
    finally:
        os.close(status_r)
        shutil.rmtree(host_dir, ignore_errors=True)
    return _classify(ending, reports, out, limits, wall_s)


def _default_mode() -> str:
    """``root`` for root with CAP_SYS_ADMIN whose user namespace maps the tools' uids, else ``userns``."""
    if os.geteuid() != 0:
        return "userns"
    with open("/proc/self/status") as f:
        cap_eff = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
    cap_sys_admin = 21
    with open("/proc/self/uid_map") as f:  # a rootless container's root maps a few uids only
        maps = [tuple(int(n) for n in line.split()) for line in f if line.strip()]
    pid_max = 1 << 22
    mapped = any(first <= _TOOL_UID_BASE and _TOOL_UID_BASE + pid_max <= first + count for first, _, count in maps)
    return "root" if int(cap_eff, 16) >> cap_sys_admin & 1 and mapped else "userns"


def _launch_config(mode: str, limits: SandboxLimits, python: str, host_dir: str, status_fd: int) -> dict[str, Any]:
    """Everything the launcher needs, as JSON-able data: limits, paths to bind into the tool's root, its argv."""
    prefixes = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)})
    binds = [p for p in prefixes if p != "/"]
    if not any(python.startswith(p + "/") for p in binds + ["/usr"]):
        binds.append(python)
    base_vars = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    hide = sorted({sysconfig.get_path(name, vars=base_vars) for name in ("purelib", "platlib")})
    etc = ["/etc/ld.so.cache", "/etc/localtime"]
    if limits.network:
        etc += ["/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl/certs"]
    # -S in "none" mode: site-packages are not hidden there, and site would run their .pth files.
    flags = ["-I", "-X", "utf8"] if mode != "none" else ["-I", "-S", "-X", "utf8"]
    return {
        "mode": mode,
        "parent_pid": os.getpid(),
        "status_fd": status_fd,
        "host_dir": host_dir,
        "network": limits.network,
        "binds": binds,
        "etc": etc,
        "hide": hide,
        "argv": [python, *flags, "main.py"],
        "rlimits": _rlimits(limits, mode),
        "disk_bytes": limits.disk_bytes,
        "ipc_bytes": limits.memory_bytes,
        "niceness": _NICENESS,
    }


def _rlimits(limits: SandboxLimits, mode: str) -> list[tuple[int, int, int]]:
    cpu = math.ceil(limits.cpu_s)
    # In a user namespace the launcher and the reaper share the tool's uid, so they count against its NPROC.
    nproc = limits.max_processes + (2 if mode == "userns" else 0)
    return [
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_FSIZE, limits.disk_bytes, limits.disk_bytes),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NOFILE, 256, 256),
    ]


# --- supervision (the caller's event loop) ----------------------------------------------------------------------


class _Capture:
    """One stream's kept bytes: the first and the last ``limit // 2``, with the count cut in between."""

    def __init__(self, limit: int) -> None:
        self.half = max(1, limit // 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.num_cut = 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        self.head += chunk[:room]
        self.tail += chunk[max(room, 0) :]
        if len(self.tail) > self.half:
            self.num_cut += len(self.tail) - self.half
            del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        cut = f"\n[... {self.num_cut} bytes cut ...]\n".encode() if self.num_cut else b""
        return bytes(self.head + cut + self.tail).decode("utf-8", errors="replace")


class _Output:
    def __init__(self, limit: int) -> None:
        self.stdout = _Capture(limit)
        self.stderr = _Capture(limit)
        self.flood_bytes = _FLOOD_FACTOR * limit
        self.num_bytes = 0


async def _supervise(proc: asyncio.subprocess.Process, wall_s: float, stdin: bytes, out: _Output) -> str:
    """Wait for the launcher while draining its pipes; returns ``"exited"``, ``"timeout"`` or ``"output"``."""
    assert proc.stdout is not None and proc.stderr is not None
    flood = asyncio.Event()
    pumps = [
        asyncio.create_task(_pump(proc.stdout, out.stdout, out, flood)),
        asyncio.create_task(_pump(proc.stderr, out.stderr, out, flood)),
    ]
    feeder = asyncio.create_task(_feed(proc.stdin, stdin)) if proc.stdin is not None else None
    exited = asyncio.create_task(proc.wait())
    flooded = asyncio.create_task(flood.wait())
    try:
        await asyncio.wait({exited, flooded}, timeout=wall_s, return_when=asyncio.FIRST_COMPLETED)
        ending = "exited" if exited.done() else "output" if flood.is_set() else "timeout"
        if ending != "exited":
            with contextlib.suppress(ProcessLookupError):  # it may have exited just now
                proc.send_signal(signal.SIGTERM)  # the launcher SIGKILLs the reaper, which ends the namespace
            try:
                await asyncio.wait_for(asyncio.shield(exited), _KILL_GRACE_S)
            except TimeoutError:
                _kill_group(proc.pid)
                await exited
        await asyncio.gather(*pumps)  # at EOF already: wait() returned, so the pipes are closed
        return ending
    finally:
        for task in [*pumps, flooded, exited] + ([feeder] if feeder else []):
            task.cancel()


async def _pump(stream: asyncio.StreamReader, capture: _Capture, out: _Output, flood: asyncio.Event) -> None:
    # Reads to EOF even past the flood (discarding): asyncio's Process.wait() returns only once the pipes are closed.
    while chunk := await stream.read(1 << 16):
        if not flood.is_set():
            capture.add(chunk)
        out.num_bytes += len(chunk)
        if out.num_bytes > out.flood_bytes:
            flood.set()


async def _feed(stream: asyncio.StreamWriter | None, data: bytes) -> None:
    assert stream is not None
    try:
        stream.write(data)
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the tool exited or closed stdin without reading it all


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_reports(fd: int) -> dict[str, Any]:
    """The launcher's, reaper's and tool's JSON lines from the status pipe, merged (non-blocking)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:  # a writer still alive (the backstop kill path): take what is there
            break
        if not chunk:
            break
        data += chunk
    reports: dict[str, Any] = {}
    for line in data.decode(errors="replace").splitlines():
        try:
            reports.update(json.loads(line))
        except ValueError:
            continue
    return reports


_PROCESS_LIMIT = re.compile(r"^(BlockingIOError: \[Errno 11\]|RuntimeError: can't start new thread)", re.MULTILINE)


def _classify(
    ending: str, reports: dict[str, Any], out: _Output, limits: SandboxLimits, wall_s: float
) -> SandboxResult:
    if "setup_error" in reports:
        raise SandboxUnavailableError(reports["setup_error"])
    stderr = out.stderr.text()
    status: int | None = reports.get("status")
    cpu_s = float(reports.get("cpu_s", 0.0))
    exit_code = sig = None
    outcome: Outcome
    if ending == "timeout":
        outcome = "timeout"
    elif ending == "output":
        outcome = "output_limit"
    elif status is None:  # the launcher died before the tool was reaped: something outside killed it
        outcome = "killed"
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        at_cpu_limit = sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= math.ceil(limits.cpu_s) - 0.05)
        outcome = "cpu_limit" if at_cpu_limit else "killed"
    else:
        exit_code = os.WEXITSTATUS(status)
        if exit_code == 0:
            outcome = "ok"
        elif _last_line(stderr).startswith("MemoryError"):
            outcome = "memory_limit"
        elif _PROCESS_LIMIT.search(stderr):
            outcome = "process_limit"
        else:
            outcome = "error"
    return SandboxResult(
        stdout=out.stdout.text(),
        stderr=stderr,
        outcome=outcome,
        exit_code=exit_code,
        signal=sig,
        truncated=bool(out.stdout.num_cut or out.stderr.num_cut),
        wall_s=wall_s,
        cpu_s=cpu_s,
        limits=limits,
    )


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _size(num_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):g} {unit}"
    return f"{num_bytes} B"


def _signal_name(sig: int | None) -> str:
    try:
        return signal.Signals(sig).name if sig is not None else "a signal"
    except ValueError:
        return f"signal {sig}"
