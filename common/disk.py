"""The space on a run's volumes: what is free, and whether an error says it ran out (checkpoints and metrics say so
when a write fails)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

__all__ = ["free_bytes", "is_no_space"]


def is_no_space(error: BaseException | None) -> bool:
    """Whether ``error`` or one it came from is an ``ENOSPC`` (disk full) or ``EDQUOT`` (quota) ``OSError``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` or of its nearest existing parent (None when none can be read)."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None
