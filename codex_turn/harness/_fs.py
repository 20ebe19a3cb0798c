"""Small filesystem and process facts shared by the transcript and the binding writers."""

from __future__ import annotations

import os
from contextlib import suppress

__all__ = ["fsync_directory", "pid_alive"]


def fsync_directory(directory: str) -> None:
    """Make a rename or a create in ``directory`` durable (best effort: not every platform
    or filesystem lets a directory be opened and synced)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (one owned by another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True
