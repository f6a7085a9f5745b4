"""Run model-written Python out of process, isolated and under hard limits, without blocking the event loop.

    result = await run_python("print(sum(range(10)))", SandboxLimits(wall_s=2.0))
    result.stdout                           # "45\\n"
    result.outcome, result.describe()       # "ok", "exited with status 0"

Every call starts a fresh interpreter (the base interpreter of this Python, ``-I``: no environment variables, no user
site; its ``site-packages`` hidden, so the stdlib only) through three processes:

- the *launcher* (this file run as a script, as root or as the caller) enters new mount, PID, network, IPC and UTS
  namespaces (``unshare``; a user namespace too when not root), builds the tool's root filesystem and ``pivot_root``s
  into it. The root is a size-capped tmpfs holding read-only binds of ``/usr``, ``/lib*``, the interpreter's prefix
  and a few ``/dev`` nodes, plus writable ``/sandbox`` (the cwd, holding ``main.py``), ``/tmp`` and ``/dev/shm``: the
  project tree, home directories and everything else on the host are not there at all. The new network namespace
  has only a downed loopback, so every connect fails (``network=True`` keeps the host's network).
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
process: a tool may hold ``max_processes * memory_bytes`` of address space at most.

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
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import asyncio

# asyncio is imported inside the coroutines: this file is also the launcher script, run before every tool, and
# importing asyncio there would add ~40 ms of CPU to every call.

__all__ = ["Isolation", "Outcome", "SandboxLimits", "SandboxResult", "SandboxUnavailableError", "run_python"]

Outcome = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "process_limit", "killed"]
Isolation = Literal["auto", "userns", "none"]

_TOOL_UID_BASE = 2_000_000_000  # + the launcher's pid: a uid no account uses, one per live tool
_USERNS_UID = 1000  # the tool's uid inside a user namespace (mapped to the caller's)
_FLOOD_FACTOR = 4  # kill once this many times max_output_bytes have been printed
_KILL_GRACE_S = 2.0  # how long the launcher may take to kill the namespace before its group is SIGKILLed
_LAUNCHER_FAILED = 125


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
    import asyncio

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
                python, "-I", "-S", os.path.abspath(__file__), json.dumps(config),
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
    import asyncio

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


# --- the launcher (this file run as a script, between the caller and the tool) ----------------------------------

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
# Mount flags a bind remount must repeat (the kernel refuses to clear them in a user namespace).
_LOCKED_FLAGS = ((os.ST_NOEXEC, _MS_NOEXEC), (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME),
                 (os.ST_RELATIME, _MS_RELATIME))  # fmt: skip
_DEVICES = ("null", "zero", "full", "random", "urandom")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class _Libc:
    """The few libc calls Python 3.11 lacks (unshare, mount, pivot_root, prctl), raising ``OSError`` on failure."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def _check(self, ret: int, what: str) -> None:
        if ret != 0:
            errno = self._ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags: int, what: str) -> None:
        self._check(self._libc.unshare(flags), f"unshare({what})")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        args = [None if s is None else s.encode() for s in (source, target, fstype)]
        self._check(self._libc.mount(*args, flags, None if data is None else data.encode()), f"mount {target}")

    def pivot_root_here(self) -> None:
        """Make the cwd the root and detach the old root (the ``pivot_root(".", ".")`` idiom)."""
        number = _SYS_PIVOT_ROOT.get(os.uname().machine)
        if number is None:
            raise OSError(0, f"pivot_root: syscall number unknown on {os.uname().machine}")
        self._check(self._libc.syscall(number, b".", b"."), "pivot_root")
        self._check(self._libc.umount2(b".", _MNT_DETACH), "umount the old root")

    def prctl(self, option: int, value: int) -> None:
        self._check(self._libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


def _report(fd: int, **fields: Any) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _launcher_main(config_json: str) -> None:
    config = json.loads(config_json)
    status_fd: int = config["status_fd"]
    os.set_inheritable(status_fd, False)  # the reaper inherits it by fork; the tool's exec closes it
    os.umask(0o022)
    libc = _Libc()
    try:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != config["parent_pid"]:  # the caller died before the line above
            os._exit(_LAUNCHER_FAILED)
        with open(os.path.join(config["host_dir"], "main.py"), "rb") as f:
            code = f.read()
        uid = _TOOL_UID_BASE + os.getpid() if config["mode"] == "root" else None
        if config["mode"] != "none":
            _enter_namespaces(libc, config)
            _build_root(libc, config, code, uid)
    except OSError as e:
        mode = config["mode"]
        hint = (
            "needs root, or unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone = 1, no seccomp profile blocking unshare/mount)"
        )
        _report(status_fd, setup_error=f"sandbox isolation ({mode} mode) failed: {e}; it {hint}. "
                "isolation='none' runs without it (unsafe: the tool sees this machine).")  # fmt: skip
        os._exit(_LAUNCHER_FAILED)
    _run_reaper(libc, config, status_fd, uid)


def _enter_namespaces(libc: _Libc, config: dict[str, Any]) -> None:
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    names = ["NEWNS", "NEWPID", "NEWIPC", "NEWUTS"]
    if not config["network"]:
        flags, names = flags | _CLONE_NEWNET, names + ["NEWNET"]
    if config["mode"] == "userns":
        flags, names = flags | _CLONE_NEWUSER, names + ["NEWUSER"]
        uid, gid = os.geteuid(), os.getegid()
        libc.unshare(flags, "|".join(names))
        for path, text in (("setgroups", "deny"), ("uid_map", f"{_USERNS_UID} {uid} 1"),
                           ("gid_map", f"{_USERNS_UID} {gid} 1")):  # fmt: skip
            try:
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
            except OSError as e:  # mapping uid 0 also needs CAP_SETFCAP
                raise OSError(e.errno, f"writing {text!r} to /proc/self/{path}: {e.strerror}") from e
    else:
        libc.unshare(flags, "|".join(names))
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates back to the host


def _build_root(libc: _Libc, config: dict[str, Any], code: bytes, uid: int | None) -> None:
    """Mount the tool's root (a tmpfs over the host temp dir), fill it, and pivot into it."""
    root = config["host_dir"]
    libc.mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={config['disk_bytes']},nr_inodes=16384,mode=755")

    def inside(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), inside(path))
        elif os.path.isdir(path):
            _bind(libc, path, inside(path))
    for path in config["binds"] + [p for p in config["etc"] if os.path.exists(p)]:
        _bind(libc, path, inside(path))
    for path in config["hide"]:
        if os.path.isdir(path):
            libc.mount("tmpfs", inside(path), "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k,mode=755")
    for name in _DEVICES:
        _bind(libc, f"/dev/{name}", inside(f"/dev/{name}"), read_only=False)
    for path in ("/tmp", "/dev/shm"):
        os.makedirs(inside(path))
        os.chmod(inside(path), 0o1777)
    os.makedirs(inside("/sandbox"))
    with open(inside("/sandbox/main.py"), "wb") as f:
        f.write(code)
    if uid is not None:
        os.chown(inside("/sandbox"), uid, uid)
        os.chown(inside("/sandbox/main.py"), uid, uid)
    os.chdir(root)
    libc.pivot_root_here()
    os.chdir("/")


def _bind(libc: _Libc, source: str, target: str, read_only: bool = True) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    libc.mount(source, target, None, _MS_BIND | _MS_REC)
    if read_only:
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        host_flags = os.statvfs(source).f_flag
        flags |= sum(ms for st, ms in _LOCKED_FLAGS if host_flags & st)
        libc.mount(None, target, None, flags)


def _run_reaper(libc: _Libc, config: dict[str, Any], status_fd: int, uid: int | None) -> None:
    """Fork the reaper (PID 1 of the new PID namespace) and wait for it; SIGTERM makes it SIGKILL the reaper."""
    reaper = 0
    killed = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal killed
        killed = True
        if reaper:
            with contextlib.suppress(ProcessLookupError):  # reaped already
                os.kill(reaper, signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_term)
    reaper = os.fork()
    if reaper == 0:
        _reap(libc, config, status_fd, uid)
    if killed:
        os.kill(reaper, signal.SIGKILL)
    os.waitpid(reaper, 0)  # returns once every process of the namespace is gone
    if config["mode"] == "none":  # no namespace to end the tool's children: end the process group (this one too)
        os.killpg(0, signal.SIGKILL)
    os._exit(0)


def _reap(libc: _Libc, config: dict[str, Any], status_fd: int, uid: int | None) -> None:
    """PID 1: start the tool, reap every orphan, and report the tool's exit status and CPU time."""
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):  # as PID 1, the tool's signals then do nothing to it
            signal.signal(signum, signal.SIG_DFL)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        tool = os.fork()
        if tool == 0:
            _exec_tool(libc, config, status_fd, uid)
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid == tool:
                break
        _report(status_fd, status=status, cpu_s=usage.ru_utime + usage.ru_stime)
    except OSError as e:
        _report(status_fd, setup_error=f"sandbox could not start the tool: {e}")
    finally:
        os._exit(0)


def _exec_tool(libc: _Libc, config: dict[str, Any], status_fd: int, uid: int | None) -> None:
    try:
        os.chdir("/sandbox" if config["mode"] != "none" else config["host_dir"])
        for which, soft, hard in config["rlimits"]:
            resource.setrlimit(which, (soft, hard))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        os.execve(config["argv"][0], config["argv"], env)
    except OSError as e:
        _report(status_fd, setup_error=f"sandbox could not start the tool: {e}")
    finally:
        os._exit(_LAUNCHER_FAILED)


if __name__ == "__main__":
    _launcher_main(sys.argv[1])
