"""The test process's own ending (``tests/conftest.py``): its exit status is the session's, whatever native teardown
at interpreter shutdown would do."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

# A crash during interpreter finalization, as native teardown would cause one: an atexit handler that aborts.
SESSION = '''
import atexit, os
atexit.register(os.abort)

def test_passes():
    assert True

def test_maybe_fails():
    assert os.environ.get("HARNESS_FAIL") != "1"
'''


def _run_session(directory: Path, fail: bool) -> subprocess.CompletedProcess:
    """Run :data:`SESSION` as its own pytest process in ``directory`` (with whatever conftest lies there)."""
    (directory / "test_session.py").write_text(SESSION)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(directory)],
                          cwd=directory, env={"PATH": "/usr/bin:/bin", "HARNESS_FAIL": "1" if fail else "0"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(("fail", "expected"), [(False, 0), (True, 1)])
def test_the_session_status_is_the_exit_status_despite_a_crash_at_shutdown(tmp_path, fail, expected):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    done = _run_session(tmp_path, fail)
    assert done.returncode == expected, done.stdout + done.stderr
    assert ("1 failed, 1 passed" if fail else "2 passed") in done.stdout  # pytest reported before the process ended


def test_without_the_hook_the_crash_at_shutdown_decides_the_exit_status(tmp_path):
    """The scenario the hook guards against is real: the same session without our conftest dies in the abort."""
    done = _run_session(tmp_path, fail=False)
    assert "2 passed" in done.stdout
    assert done.returncode < 0, done.returncode  # killed by SIGABRT after reporting success
