"""Small filesystem and process facts shared by the transcript, the binding and the gates.

Three rules live here so that no caller re-derives them:

* **One name per session file.** :func:`session_path` is the canonical key of a transcript:
  the real path of its directory joined with its base name, which is how OpenClaw names the
  ``.lock`` file. Symlinked directories and relative paths collapse to one key, while the base
  name stays as given, so a transcript that is itself a symlink is locked under the name the
  caller uses. The in-process gates, the read cache, the write lock and the binding sidecar all
  key on it.
* **One way to replace a whole file.** :func:`atomic_write` writes a temp file beside the
  target, fsyncs it, renames it over the target (``os.replace``) and fsyncs the directory: a
  reader sees the old bytes or the new, never a mix. Replacements and removals of one path are
  serialised in-process by :func:`atomic_write_lock`. A writer killed before the rename leaves
  the old file intact plus ``<name>.<pid>.<hex>.tmp``, removed by the next write of that path
  once the pid is dead. :func:`create_exclusive` is the sibling for files that must be created
  complete and never replaced (the transcript): the same temp file, then ``link``.
* **Appends are not here.** Appending to a transcript is one ``O_APPEND`` write owned by the
  mirror; only :func:`write_all` (a full ``write`` loop) is shared.
* **Only regular files are opened.** :func:`open_regular` is how the transcript and the
  sidecar are opened: without blocking (``O_NONBLOCK``, so a FIFO at the path cannot hang the
  worker thread, which no cancellation could reach) and refused with
  :class:`NotRegularFileError` unless ``fstat`` says it is a regular file (a directory, a
  FIFO, a socket or a device is never read or written).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from contextlib import suppress

__all__ = [
    "NotRegularFileError",
    "atomic_write",
    "atomic_write_lock",
    "create_exclusive",
    "file_kind",
    "fsync_directory",
    "open_regular",
    "pid_alive",
    "session_path",
    "write_all",
]

_TEMP_SUFFIX = ".tmp"


def session_path(path: str | os.PathLike[str]) -> str:
    """The canonical key of a session file: ``<realpath(dir)>/<basename>``.

    OpenClaw's lock key. The directory is resolved strictly; when it does not exist (or cannot
    be resolved) the absolute, normalised directory is used instead.
    """
    absolute = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(absolute)
    with suppress(OSError):
        directory = os.path.realpath(directory, strict=True)
    return os.path.join(directory, name)


class NotRegularFileError(OSError):
    """The path names a directory, a FIFO, a socket or a device, not a regular file."""


def file_kind(mode: int) -> str:
    """A short word for what ``st_mode`` is, for error messages (never file content)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def open_regular(path: str, flags: int) -> int:
    """``os.open`` that never blocks and only ever returns a regular file's descriptor.

    ``stat`` first, so a device is never opened (opening one can have effects); then the open
    is non-blocking (a FIFO swapped in meanwhile opens at once instead of waiting for a
    writer) and ``fstat`` confirms what was opened. Raises :class:`NotRegularFileError` (an
    :class:`OSError`) for anything else, and the usual :class:`OSError` kinds (a missing file
    or a dangling symbolic link: :class:`FileNotFoundError`).
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(errno.EINVAL, f"{file_kind(mode)}, not a regular file", path)
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"{file_kind(mode)}, not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


def write_all(fd: int, data: bytes) -> None:
    """``write`` until every byte of ``data`` is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


_write_locks: dict[str, threading.Lock] = {}
_write_locks_guard = threading.Lock()


def atomic_write_lock(path: str | os.PathLike[str]) -> threading.Lock:
    """The in-process lock that serialises replacing and removing ``path`` (by its
    :func:`session_path`). :func:`atomic_write` takes it; hold it around an ``unlink`` of the
    same file. Not re-entrant; never evicted (one small lock per path ever written)."""
    key = session_path(path)
    with _write_locks_guard:
        return _write_locks.setdefault(key, threading.Lock())


def _write_temp(path: str, data: bytes, mode: int) -> str:
    """Write ``data`` to a new ``<path>.<pid>.<hex>.tmp`` and fsync it; return its name.
    On failure the temp file is removed and the error re-raised."""
    temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temp, flags, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(temp)
        raise
    return temp


def _remove_orphaned_temps(path: str) -> None:
    """Remove ``<path>.<pid>.<hex>.tmp`` files left by writers that died before the rename."""
    directory, name = os.path.split(path)
    prefix = name + "."
    try:
        candidates = [n for n in os.listdir(directory or ".") if n.startswith(prefix)]
    except OSError:
        return
    for candidate in candidates:
        parts = candidate[len(prefix) :].split(".")
        if len(parts) != 3 or parts[2] != _TEMP_SUFFIX[1:] or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        if pid != os.getpid() and not pid_alive(pid):
            with suppress(OSError):
                os.unlink(os.path.join(directory, candidate))


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module header).

    Creates the directory if needed. Raises :class:`OSError`; the previous file is then
    unchanged and no temp file is left behind.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    with atomic_write_lock(target):
        os.makedirs(directory, exist_ok=True)
        _remove_orphaned_temps(target)
        temp = _write_temp(target, data, mode)
        try:
            os.replace(temp, target)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp)
            raise
        fsync_directory(directory)


def create_exclusive(path: str, data: bytes, *, mode: int = 0o600) -> bool:
    """Create ``path`` holding ``data`` iff it does not exist, never observable half-written.

    The bytes go to a temp file that is fsynced and then hard-linked to ``path``; ``link``
    fails when the name exists, so this is an exclusive create whose result is complete or
    absent. Falls back to ``O_EXCL`` + write where hard links are unsupported. Returns
    ``False`` when the file already existed. Raises :class:`OSError`.
    """
    directory = os.path.dirname(path)
    _remove_orphaned_temps(path)
    temp = _write_temp(path, data, mode)
    try:
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        except OSError:
            return _create_exclusive_plain(path, data, mode)
    finally:
        with suppress(OSError):
            os.unlink(temp)
    fsync_directory(directory)
    return True


def _create_exclusive_plain(path: str, data: bytes, mode: int) -> bool:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        return False
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(os.path.dirname(path))
    return True
