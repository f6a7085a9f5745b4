"""The sandbox's launcher: run as a script (``python -I -S sandbox_launcher.py CONFIG_JSON``) between the caller of
:func:`rollout.envs.sandbox.run_python` and the tool. It enters the new namespaces, builds the tool's root filesystem,
forks the reaper (PID 1 of the new PID namespace) and execs the tool under its rlimits and uid, reporting setup
errors, the exit status and the CPU time on the status pipe (:mod:`rollout.envs.sandbox` describes the whole).

Standard library only and no package imports: the script runs isolated (``-I -S``), before every tool call, so its
start-up is part of every call's latency.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
from typing import Any

TOOL_UID_BASE = 2_000_000_000
"""Root mode: the tool runs as this + the launcher's pid, a uid no account uses, one per live tool."""
USERNS_UID = 1000
"""User-namespace mode: the tool's uid inside the namespace (mapped to the caller's)."""
LAUNCHER_FAILED = 125
"""The launcher's exit status when it could not set up or start the tool (the status pipe says why)."""

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 22, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
# Seccomp: (AUDIT_ARCH_*, [memfd_create, memfd_secret]) per machine; x86_64's x32 calls (nr >= 2**30) are refused too.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, [319, 447]), "aarch64": (0xC00000B7, [279, 447]),
                 "riscv64": (0xC00000F3, [279, 447])}  # fmt: skip
_SECCOMP_MODE_FILTER, _SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 2, 0x7FFF0000, 0x00050000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
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

    def refuse_anonymous_files(self) -> bool:
        """Install a seccomp filter under which ``memfd_create`` and ``memfd_secret`` fail with EPERM (and system calls
        of another ABI than this machine's with ENOSYS), for this process and all it execs or forks. Needs
        ``PR_SET_NO_NEW_PRIVS`` first. ``False`` on a machine whose numbers are not known here (nothing installed)."""
        known = _SECCOMP_ARCH.get(os.uname().machine)
        if known is None:
            return False
        import ctypes

        arch, numbers = known

        class Filter(ctypes.Structure):
            _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                        ("k", ctypes.c_uint32)]  # fmt: skip

        class Program(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

        enosys, eperm = _SECCOMP_RET_ERRNO | 38, _SECCOMP_RET_ERRNO | 1
        # (code, jump if true, jump if false, k); a jump skips that many instructions. The arch, then the number
        # (x32's have bit 30 set), then each listed number jumps to the EPERM at the end; the rest are allowed.
        code = [(_BPF_LD_W_ABS, 0, 0, 4), (_BPF_JEQ_K, 1, 0, arch), (_BPF_RET_K, 0, 0, enosys),
                (_BPF_LD_W_ABS, 0, 0, 0), (_BPF_JGE_K, 0, 1, 0x40000000), (_BPF_RET_K, 0, 0, enosys)]  # fmt: skip
        for i, number in enumerate(numbers):
            code.append((_BPF_JEQ_K, len(numbers) - i, 0, number))
        code += [(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW), (_BPF_RET_K, 0, 0, eperm)]
        filters = (Filter * len(code))(*[Filter(*c) for c in code])
        program = Program(len(code), filters)
        ret = self._libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0)
        self._check(ret, "prctl(PR_SET_SECCOMP)")
        return True


def _report(fd: int, **fields: Any) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _launcher_main(config_json: str) -> None:
    config = json.loads(config_json)
    os.nice(config["niceness"])  # the tool and all it starts yield the CPU to the engine that waits on no tool
    status_fd: int = config["status_fd"]
    os.set_inheritable(status_fd, False)  # the reaper inherits it by fork; the tool's exec closes it
    os.umask(0o022)
    libc = _Libc()
    try:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != config["parent_pid"]:  # the caller died before the line above
            os._exit(LAUNCHER_FAILED)
        with open(os.path.join(config["host_dir"], "main.py"), "rb") as f:
            code = f.read()
        uid = TOOL_UID_BASE + os.getpid() if config["mode"] == "root" else None
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
        os._exit(LAUNCHER_FAILED)
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
        for path, text in (("setgroups", "deny"), ("uid_map", f"{USERNS_UID} {uid} 1"),
                           ("gid_map", f"{USERNS_UID} {gid} 1")):  # fmt: skip
            try:
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
            except OSError as e:  # mapping uid 0 also needs CAP_SETFCAP
                raise OSError(e.errno, f"writing {text!r} to /proc/self/{path}: {e.strerror}") from e
    else:
        libc.unshare(flags, "|".join(names))
    _bound_ipc(config["ipc_bytes"])
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates back to the host


def _bound_ipc(total_bytes: int) -> None:
    """Bound System V shared memory, message queues and semaphores in the tool's new IPC namespace (its kernel.shm*,
    msgmni and sem sysctls are this namespace's own): they are memory no rlimit counts and outlive their process, so
    with the defaults a tool could hold host memory without limit. Shared memory in all: ``total_bytes``.

    Best effort: only a process privileged over the namespace may write them (root with a writable ``/proc/sys``; in a
    user namespace, from Linux 6.9 on, a mapped root), and the sandbox works without them as it did before."""
    page = os.sysconf("SC_PAGE_SIZE")
    for name, value in (("shmmax", total_bytes), ("shmall", max(1, total_bytes // page)), ("shmmni", 16),
                        ("msgmni", 16), ("sem", "32 512 32 16")):  # fmt: skip
        try:
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(str(value))
        except OSError:  # unprivileged user namespace, read-only /proc/sys (a container): the defaults stay
            return


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
        libc.refuse_anonymous_files()  # memory no rlimit counts (RLIMIT_FSIZE caps one file, not how many)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        os.execve(config["argv"][0], config["argv"], env)
    except OSError as e:
        _report(status_fd, setup_error=f"sandbox could not start the tool: {e}")
    finally:
        os._exit(LAUNCHER_FAILED)


if __name__ == "__main__":
    _launcher_main(sys.argv[1])
