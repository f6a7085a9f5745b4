"""The tool sandbox: each limit ends a run with its outcome, nothing of a run outlives it, the host is out of reach."""

import asyncio
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.envs.sandbox import SandboxLimits, SandboxResult, SandboxUnavailableError, run_python

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL_UID_BASE = 2_000_000_000  # root mode gives each tool the uid TOOL_UID_BASE + its launcher's pid


@pytest.fixture(scope="module", autouse=True)
def sandbox_available() -> None:
    try:
        asyncio.run(run_python("pass"))
    except SandboxUnavailableError as e:
        pytest.skip(f"no sandbox isolation on this machine: {e}")


def run(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> SandboxResult:
    return asyncio.run(run_python(code, limits, stdin))


_EARLIER: set[int] = set()
"""Descendants of this process from before the current test (e.g. a multiprocessing resource tracker an earlier test
of the session started): not the sandbox's."""


@pytest.fixture(autouse=True)
def _earlier_descendants() -> None:
    _EARLIER.clear()
    _EARLIER.update(_all_sandbox_candidates())


def sandbox_processes() -> list[int]:
    """Pids of this process's descendants (new since the test began) and of any process running as a tool uid."""
    return [pid for pid in _all_sandbox_candidates() if pid not in _EARLIER]


def _all_sandbox_candidates() -> list[int]:
    parents: dict[int, int] = {}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        parents[int(entry)] = int(fields["PPid"])
        if int(fields["Uid"].split()[0]) >= TOOL_UID_BASE:
            found.append(int(entry))
    me = os.getpid()
    for pid in parents:
        ancestor = parents.get(pid, 0)
        while ancestor > 1 and ancestor != me:
            ancestor = parents.get(ancestor, 0)
        if ancestor == me:
            found.append(pid)
    return found


def test_ok_run_returns_stdout_and_has_the_numeric_stdlib():
    code = "import math, fractions, decimal, itertools\nprint(math.comb(5, 2), fractions.Fraction(1, 3) * 3)\nexit(0)"
    result = run(code)
    assert (result.outcome, result.exit_code, result.stdout) == ("ok", 0, "10 1\n")
    assert result.describe() == "exited with status 0"


def test_syntax_error_is_an_error_with_the_traceback():
    result = run("def f(:\n    pass")
    assert (result.outcome, result.exit_code) == ("error", 1)
    assert "SyntaxError" in result.stderr and result.describe().startswith("exited with status 1: SyntaxError")


def test_stdin_reaches_the_tool():
    assert run("import sys; print(sys.stdin.read().upper())", stdin="hello").stdout == "HELLO\n"


def test_sleep_forever_times_out_within_the_wall_limit():
    start = time.monotonic()
    result = run("import time\ntime.sleep(1000)", SandboxLimits(wall_s=1.0))
    assert result.outcome == "timeout" and result.exit_code is None
    assert time.monotonic() - start < 1.0 + 1.5
    assert result.describe() == "timed out after 1 s"
    assert sandbox_processes() == []


def test_allocating_10_gb_is_memory_limit():
    result = run("x = bytearray(10 << 30)")
    assert result.outcome == "memory_limit", result.stderr
    assert result.describe() == "ran out of memory (limit 512 MiB)"


def test_cpu_spin_is_cpu_limit():
    result = run("while True:\n    pass", SandboxLimits(cpu_s=1.0, wall_s=10.0))
    assert result.outcome == "cpu_limit" and 0.9 <= result.cpu_s < 2.5
    assert result.wall_s < 5.0


def test_fork_bomb_ends_within_its_limits_and_leaves_no_process():
    start = time.monotonic()
    result = run("import os\nwhile True:\n    os.fork()", SandboxLimits(wall_s=3.0))
    assert result.outcome in ("process_limit", "timeout"), result.stderr[-500:]
    assert time.monotonic() - start < 3.0 + 1.5
    assert sandbox_processes() == []


def test_children_that_leave_the_session_die_with_the_run():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = run(code)
    assert (result.outcome, result.stdout) == ("ok", "parent done\n")
    assert sandbox_processes() == []


def test_printing_10_mb_is_output_limit_with_bounded_memory():
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    limits = SandboxLimits(max_output_bytes=16 << 10)
    result = run("import sys\nfor _ in range(10):\n    sys.stdout.write('x' * (1 << 20))", limits)
    assert result.outcome == "output_limit" and result.truncated
    assert len(result.stdout) <= limits.max_output_bytes + 100  # plus the "[... N bytes cut ...]" marker
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 32 << 10
    assert result.describe() == "was stopped for printing over 64 KiB"


def test_output_over_the_limit_is_cut_keeping_head_and_tail():
    result = run("print('a' * 20000)\nprint('END')")
    assert result.outcome == "ok" and result.truncated
    assert result.stdout.startswith("aaa") and result.stdout.endswith("END\n") and "bytes cut" in result.stdout


def test_network_is_unreachable_unless_asked_for():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = server.getsockname()
        code = f"import socket\nsocket.create_connection({address!r}, timeout=2)\nprint('ok')"
        closed = run(code)
        assert closed.outcome == "error" and "OSError" in closed.stderr and closed.stdout == ""
        assert run(code, SandboxLimits(network=True)).stdout == "ok\n"


def test_project_files_and_home_are_not_there():
    home = Path.home()
    # The interpreter's prefix is bound at its own path, which may be under home (pyenv): only that path is there.
    home_files = [str(p) for p in home.iterdir() if not Path(sys.base_prefix).is_relative_to(p)]
    paths = [str(REPO_ROOT / "README.md"), str(REPO_ROOT), *home_files]
    code = f"import os\nprint(sum(os.path.exists(p) for p in {paths!r}), os.getcwd(), os.getuid())"
    result = run(code)
    num_visible, cwd, uid = result.stdout.split()
    assert (num_visible, cwd) == ("0", "/sandbox") and int(uid) != 0


def test_eight_runs_overlap_and_the_event_loop_keeps_running():
    async def main() -> tuple[float, int, list[SandboxResult]]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        start = time.monotonic()
        results = await asyncio.gather(*(run_python("import time\ntime.sleep(0.5)") for _ in range(8)))
        elapsed = time.monotonic() - start
        ticking.cancel()
        return elapsed, ticks, results

    elapsed, ticks, results = asyncio.run(main())
    assert all(r.outcome == "ok" for r in results)
    assert elapsed < 4.0
    assert ticks >= 10 * elapsed  # a tick every 10 ms; a blocked loop would manage none while the tools ran


def test_cancelling_a_run_kills_it():
    async def main() -> None:
        task = asyncio.create_task(run_python("import time\ntime.sleep(1000)", SandboxLimits(wall_s=60.0)))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # the launcher's parent-death signal reaches the reaper, which ends the namespace

    asyncio.run(main())
    assert sandbox_processes() == []


def test_unisolated_run_is_an_explicit_opt_in_with_the_limits_still_on():
    result = asyncio.run(run_python("import os\nprint(os.getcwd())\nx = bytearray(10 << 30)", isolation="none"))
    assert result.outcome == "memory_limit" and "rl-align-sandbox-" in result.stdout


@pytest.mark.parametrize(
    ("field", "value"),
    [("wall_s", 0), ("cpu_s", -1.0), ("memory_bytes", 1.5), ("max_output_bytes", 0), ("max_processes", True),
     ("wall_s", float("inf"))],
)  # fmt: skip
def test_bad_limits_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field}"):
        SandboxLimits(**{field: value})


def run_in_user_namespace(*unshare_flags: str) -> subprocess.CompletedProcess[str]:
    """Run a small sandboxed program from a process inside ``unshare --user`` (not root on the host any more)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare")
    code = (
        f"import os, socket\nprint(os.getuid(), os.path.exists({str(REPO_ROOT)!r}))\n"
        "socket.create_connection(('127.0.0.1', 22), timeout=1)"
    )
    script = (
        f"import asyncio\nfrom rollout.envs.sandbox import run_python\nr = asyncio.run(run_python({code!r}))\n"
        "print(r.outcome, r.stdout.strip(), r.stderr.strip().splitlines()[-1])"
    )
    argv = ["unshare", "--user", *unshare_flags, sys.executable, "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, timeout=30)


def test_user_namespace_mode_isolates_without_host_root():
    proc = run_in_user_namespace("--map-root-user")
    if "unshare failed" in proc.stderr:
        pytest.skip(f"no user namespaces here: {proc.stderr.strip()}")
    assert proc.stdout.split(maxsplit=3)[:3] == ["error", "1000", "False"], proc.stderr
    assert "Network is unreachable" in proc.stdout


def test_missing_isolation_raises_naming_what_failed():
    proc = run_in_user_namespace()  # an unmapped user: it can make no namespace of its own
    if "unshare failed" in proc.stderr:
        pytest.skip(f"no user namespaces here: {proc.stderr.strip()}")
    assert "SandboxUnavailableError: sandbox isolation (userns mode) failed" in proc.stderr
    assert "unshare(" in proc.stderr and "isolation='none'" in proc.stderr


def test_the_python_tool_shows_stderr_after_stdout():
    from rollout.envs.config import PythonToolConfig
    from rollout.envs.tools import build_tool

    tool = build_tool("python", PythonToolConfig())
    logged = asyncio.run(tool.run({"code": 'import logging\nprint("partial", end="")\nlogging.warning("it is 42")'}))
    assert not logged.error and logged.text == "partial\n[stderr]\nWARNING:root:it is 42\n"  # was "partial" alone
    failed = asyncio.run(tool.run({"code": 'print("partial", end="")\n1 / 0'}))
    assert failed.error and "\npartial\nTraceback (most recent call last)" in failed.text  # was "partialTraceback"
    quiet = asyncio.run(tool.run({"code": "print(408)"}))
    assert quiet.text == "408\n" and not quiet.error


def test_system_v_shared_memory_counts_against_the_memory_limit():
    # A segment is memory no rlimit counts and outlives its process: with the IPC namespace's defaults eight 60 MiB
    # segments were filled under a 128 MiB limit (and the host held them until the namespace ended).
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
made = 0
for _ in range(8):
    sid = libc.shmget(0, 60 << 20, 0o1000 | 0o600)
    if sid < 0:
        break
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 1, 60 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
    made += 1
print(made, os.strerror(ctypes.get_errno()))
"""
    result = run(code, SandboxLimits(memory_bytes=128 << 20))
    assert result.outcome == "ok" and result.stdout.split(maxsplit=1) == ["2", "No space left on device\n"], result


def test_anonymous_files_are_refused_so_memory_stays_within_the_limits():
    # memfd_create memory counts against no rlimit: four 60 MiB files were held under a 128 MiB limit.
    code = """
import os
try:
    for i in range(4):
        fd = os.memfd_create(f"x{i}")
        os.write(fd, b"x" * (60 << 20))
    print("held 240 MiB")
except OSError as e:
    print(e.strerror)
"""
    result = run(code, SandboxLimits(memory_bytes=128 << 20))
    assert result.outcome == "ok" and result.stdout == "Operation not permitted\n", result
    # The ordinary ways to use memory and files still work: tmpfs files, threads, subprocesses, shared memory.
    ordinary = """
import multiprocessing.shared_memory, subprocess, sys, tempfile, threading
with tempfile.TemporaryFile() as f:
    f.write(b"x" * 1000)
t = threading.Thread(target=print, args=("thread",)); t.start(); t.join()
subprocess.run([sys.executable, "-c", "print('child')"], check=True)
m = multiprocessing.shared_memory.SharedMemory(create=True, size=4096); m.close(); m.unlink()
print("ok")
"""
    result = run(ordinary)
    assert result.outcome == "ok" and sorted(result.stdout.split()) == ["child", "ok", "thread"], result


def test_tools_run_below_the_callers_cpu_priority():
    result = run("import os\nprint(os.nice(0))")
    assert result.outcome == "ok" and int(result.stdout) >= os.nice(0) + 10, result


def test_the_python_tool_runs_at_most_max_concurrent_programs_at_once(monkeypatch):
    from rollout.envs import tools
    from rollout.envs.config import PythonToolConfig

    running, most = 0, 0

    async def counting_run_python(code, limits):  # the real sandbox's concurrency is what is under test elsewhere
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        return SandboxResult("", "", "ok", 0, None, False, 0.01, 0.0, limits)

    monkeypatch.setattr("rollout.envs.sandbox.run_python", counting_run_python)
    tool = tools.build_tool("python", PythonToolConfig(max_concurrent=3))
    other = tools.build_tool("python", PythonToolConfig(max_concurrent=3))  # another episode's: the same slots

    async def calls() -> None:
        await asyncio.gather(*[t.run({"code": "pass"}) for t in [tool, other] * 5])
        larger = tools.build_tool("python", PythonToolConfig(max_concurrent=5))
        with pytest.raises(ValueError, match="already run 3 at a time"):  # not 5 more beside the first 3
            await larger.run({"code": "pass"})

    asyncio.run(calls())
    assert most == 3
