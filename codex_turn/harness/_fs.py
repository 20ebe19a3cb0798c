"""Small filesystem and process facts shared by the transcript, the binding and the gates.

The rules that live here so that no caller re-derives them:

* **One name per session file.** :func:`session_path` is the canonical key of a transcript:
  the real path of its directory joined with its base name, which is how OpenClaw names the
  ``.lock`` file. Symlinked directories and relative paths collapse to one key, while the base
  name stays as given, so a transcript that is itself a symlink is locked under the name the
  caller uses. The in-process gates, the read cache, the write lock and the binding sidecar all
  key on it. A turn resolves the name once (:func:`pinned_session_path`): inside it, the
  gate, the lease, the preflight, the binding and the mirror all get the name resolved when
  the turn began, without resolving it again (each resolution is one ``lstat`` per directory
  component), and a directory symlink swapped mid-turn cannot move the turn's writes to a
  file its lease does not cover.
* **One way to replace a whole file.** :func:`atomic_write` writes a temp file beside the
  target, fsyncs it, renames it over the target (``os.replace``) and fsyncs the directory: a
  reader sees the old bytes or the new, never a mix. Replacements and removals of one path are
  serialised in-process by :func:`atomic_write_lock`. A writer killed before the rename leaves
  the old file intact plus ``<name>.<pid>.<hex>.tmp``, removed by the next write of that path
  once the pid is dead (:func:`is_write_temp` tells such a name). :func:`create_exclusive` is
  the sibling for files that must be created complete and never replaced (the transcript, a
  lock file, a fresh Codex home's config): the same temp file, then ``link``. Nothing else
  in the package renames a file over another.
* **What the library creates is owner-only, whatever the umask.** Files are created with
  :data:`PRIVATE_FILE_MODE` (``0600``: :func:`atomic_write`, :func:`create_exclusive`, the
  lock file) and directories with :data:`PRIVATE_DIR_MODE` (``0700``,
  :func:`make_private_dirs`); a mode given to ``open``/``mkdir`` is only narrowed by the
  umask, never widened, so no ``chmod`` is needed. SQLite gives a database's ``-wal`` and
  ``-shm`` the mode of the database file, so a store created here (empty, by
  :func:`create_exclusive`) keeps them private too. A file or directory that is wider
  already (an earlier version made it, or someone changed it) is not changed behind the
  owner's back: :func:`loose_permissions` reports it, and ``codex-turn doctor`` prints that.
* **Appends are not here.** Appending to a transcript is one ``O_APPEND`` write owned by the
  mirror; only :func:`write_all` (a full ``write`` loop) is shared, and its reading sibling
  :func:`pread_exact` (a full ``pread`` loop).
* **Only regular files are opened.** :func:`open_regular` is how the transcript and the
  sidecar are opened: without blocking (``O_NONBLOCK``, so a FIFO at the path cannot hang the
  worker thread, which no cancellation could reach) and refused with
  :class:`NotRegularFileError` unless ``fstat`` says it is a regular file (a directory, a
  FIFO, a socket or a device is never read or written).
* **A pid read from a file is only a claim.** :func:`pid_from_text` accepts ASCII digits
  alone, and :func:`pid_alive` answers ``False`` for a number no process can have (zero,
  negative, beyond the platform's ``pid_t``): a lock file or a leftover naming one is
  stale, never an ``OverflowError``.
* **File I/O leaves the event loop in one hop.** :func:`run_in_worker` runs a synchronous
  function in one of anyio's worker threads (``anyio.to_thread.run_sync``, in a copy of the
  caller's context: :func:`pinned_session_path` follows the hop) and waits for it,
  shielded: the work is never abandoned (a lease taken by a worker nobody waits for would
  never be given back), the caller's cancellation is raised once it is done. At most
  :data:`MAX_WORKERS` hops run at once per event loop (a ``CapacityLimiter``: the CPUs + 2,
  at most 32); more wait in line for a free slot. No hop waits for another hop, so a full
  limiter always drains. The harness's own pool (a ``queue.SimpleQueue``, two event-loop
  rounds a hop against anyio's four) and an fsync overlapping ``turn/start`` were measured
  and removed: +0.1 % and +0.3 % of a turn whose model answers after 1.5 s
  (``benchmarks/bench_mechanisms.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any, Final, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
from anyio.lowlevel import RunVar

from codex_turn._env import int_from_env

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "NotRegularFileError",
    "PermissionFinding",
    "atomic_write",
    "atomic_write_lock",
    "create_exclusive",
    "file_kind",
    "fsync_directory",
    "is_write_temp",
    "loose_permissions",
    "make_private_dirs",
    "open_regular",
    "pid_alive",
    "pid_from_text",
    "pinned_session_path",
    "pread_exact",
    "run_in_worker",
    "session_path",
    "write_all",
]

#: The mode of every file the library creates (the umask can only narrow it).
PRIVATE_FILE_MODE: Final = 0o600
#: The mode of every directory the library creates.
PRIVATE_DIR_MODE: Final = 0o700

_TEMP_SUFFIX = ".tmp"
_PREAD_CHUNK: Final = 16 << 20  # bytes per pread: a huge transcript is read in a few calls


#: The session file a turn pinned (:func:`pinned_session_path`): the spellings it was asked
#: for (as given, absolute, canonical) and its canonical name. Context-local: it follows the
#: turn into the tasks it starts and the worker threads it hops to (anyio copies the context).
_pinned: contextvars.ContextVar[tuple[frozenset[str], str] | None] = contextvars.ContextVar(
    "codex_turn_pinned_session_path", default=None
)


def session_path(path: str | os.PathLike[str]) -> str:
    """The canonical key of a session file: ``<realpath(dir)>/<basename>``.

    OpenClaw's lock key. The directory is resolved strictly; when it does not exist (or cannot
    be resolved) the absolute, normalised directory is used instead. Inside
    :func:`pinned_session_path` the pinned file's name is the one resolved on entry.
    """
    raw = os.fspath(path)
    pinned = _pinned.get()
    if pinned is not None and raw in pinned[0]:
        return pinned[1]
    return _resolve(raw)


def _resolve(raw: str) -> str:
    absolute = os.path.abspath(raw)
    directory, name = os.path.split(absolute)
    with suppress(OSError):
        directory = os.path.realpath(directory, strict=True)
    return os.path.join(directory, name)


@contextlib.contextmanager
def pinned_session_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Resolve ``path``'s :func:`session_path` once; yield it, and within this context (this
    task, the tasks it starts, the worker threads it hops to) answer it for ``path`` without
    resolving again. A turn holds its session under one name from start to end (see the
    module header). Nests; an inner pin of another file replaces the outer one meanwhile."""
    raw = os.fspath(path)
    key = _resolve(raw)
    token = _pinned.set((frozenset({raw, os.path.abspath(raw), key}), key))
    try:
        yield key
    finally:
        _pinned.reset(token)


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


def make_private_dirs(directory: str | os.PathLike[str]) -> None:
    """``os.makedirs(directory, exist_ok=True)``, every directory it creates owner-only
    (``makedirs`` gives its ``mode`` to the last one only). Existing ones are left as they
    are. Raises :class:`OSError` (:class:`FileExistsError` when a file is in the way)."""
    path = os.path.abspath(os.fspath(directory))
    missing: list[str] = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for name in reversed(missing):
        try:
            os.mkdir(name, PRIVATE_DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(name):  # made meanwhile by another writer: fine; a file: not
                raise


@attrs.frozen
class PermissionFinding:
    """A file or directory the library keeps owner-only that others may use (doctor's
    finding; see the module header). ``mode`` is what it has, ``expected`` what the library
    gives it."""

    path: str
    mode: int
    expected: int

    def __str__(self) -> str:
        return (
            f"{self.path} is {self.mode:04o}, wider than {self.expected:04o} "
            f"(chmod {self.expected:o} it)"
        )


def loose_permissions(paths: Iterable[str]) -> tuple[PermissionFinding, ...]:
    """The ones of ``paths`` that group or others may read, write or enter (a file wider
    than :data:`PRIVATE_FILE_MODE`, a directory wider than :data:`PRIVATE_DIR_MODE`).
    Missing paths, symbolic links (their own mode means nothing) and anything else are
    skipped; nothing is opened or changed."""
    found: list[PermissionFinding] = []
    for path in paths:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISREG(mode):
            expected = PRIVATE_FILE_MODE
        elif stat.S_ISDIR(mode):
            expected = PRIVATE_DIR_MODE
        else:
            continue
        if stat.S_IMODE(mode) & ~expected & 0o777:
            found.append(PermissionFinding(path, stat.S_IMODE(mode), expected))
    return tuple(found)


def pid_from_text(text: str) -> int | None:
    """The pid a file name spells (ASCII digits only, as the library writes them), or
    ``None``. Whether such a process can exist is :func:`pid_alive`'s business."""
    if not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (one owned by another user counts as alive).

    A pid no process can have (zero, negative, beyond ``pid_t``) is not alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


def write_all(fd: int, data: bytes) -> None:
    """``write`` until every byte of ``data`` is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes from ``offset`` (``pread`` until done); fewer only when the file
    ends first (truncated meanwhile: the caller's checks notice)."""
    chunks: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, min(length, _PREAD_CHUNK), offset)
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


_write_locks: dict[str, threading.Lock] = {}
_write_locks_guard = threading.Lock()


def atomic_write_lock(path: str | os.PathLike[str]) -> threading.Lock:
    """The in-process lock that serialises replacing and removing ``path`` (by its
    :func:`session_path`). :func:`atomic_write` takes it; hold it around an ``unlink`` of the
    same file. Not re-entrant; never evicted (one small lock per path ever written)."""
    key = session_path(path)
    with _write_locks_guard:
        return _write_locks.setdefault(key, threading.Lock())


def _write_temp(path: str, data: bytes, mode: int, *, durable: bool = True) -> str:
    """Write ``data`` to a new ``<path>.<pid>.<hex>.tmp`` and fsync it (when ``durable``);
    return its name. On failure the temp file is removed and the error re-raised."""
    temp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temp, flags, mode)
    try:
        try:
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(temp)
        raise
    return temp


def _temp_pid(candidate: str, name: str) -> int | None:
    """The writer's pid when ``candidate`` is a temp file of :func:`atomic_write` or
    :func:`create_exclusive` for the file named ``name`` (``<name>.<pid>.<hex>.tmp``)."""
    if not candidate.startswith(name + "."):
        return None
    parts = candidate[len(name) + 1 :].split(".")
    if len(parts) != 3 or parts[2] != _TEMP_SUFFIX[1:]:
        return None
    return pid_from_text(parts[0])


def is_write_temp(candidate: str, name: str) -> bool:
    """Whether the file name ``candidate`` is a temp file that a write of the file named
    ``name`` (in the same directory) makes, or left behind when its writer died."""
    return _temp_pid(candidate, name) is not None


def _remove_orphaned_temps(path: str) -> None:
    """Remove ``<path>.<pid>.<hex>.tmp`` files left by writers that died before the rename."""
    directory, name = os.path.split(path)
    prefix = name + "."
    try:
        candidates = [n for n in os.listdir(directory or ".") if n.startswith(prefix)]
    except OSError:
        return
    for candidate in candidates:
        pid = _temp_pid(candidate, name)
        if pid is not None and pid != os.getpid() and not pid_alive(pid):
            with suppress(OSError):
                os.unlink(os.path.join(directory, candidate))


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    mode: int = PRIVATE_FILE_MODE,
    durable: bool = True,
) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module header).

    ``durable=False`` skips both fsyncs, for a file whose meaning ends with its writer (a
    lock file's renewal: a crash ends the lease anyway, and an fsync under the lock would
    stall the writes waiting for it); readers still see the old bytes or the new.
    Creates the directory if needed (:func:`make_private_dirs`). Raises :class:`OSError`;
    the previous file is then unchanged and no temp file is left behind.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    with atomic_write_lock(target):
        make_private_dirs(directory)
        _remove_orphaned_temps(target)
        temp = _write_temp(target, data, mode, durable=durable)
        try:
            os.replace(temp, target)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp)
            raise
        if durable:
            fsync_directory(directory)


def create_exclusive(path: str, data: bytes, *, mode: int = PRIVATE_FILE_MODE) -> bool:
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


# --- the worker-thread hop -------------------------------------------------------------------

_T = TypeVar("_T")


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # this process's share, not the host's count
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Overrides :data:`MAX_WORKERS` (1 to 256), read once at import: for storage whose fsyncs
#: take long (each holds a slot while it waits), or a CPU quota the affinity mask does not
#: show. Anything else is ignored, with a warning.
ENV_WORKERS: Final = "CODEX_TURN_WORKER_THREADS"


def _max_workers() -> int:
    # A hop's job holds the GIL for most of its time (an fsync is the exception), so workers
    # beyond the CPUs only contend for it: with 32 turns at once on 2 CPUs, 4 workers against
    # 32 gave 0.96 against 0.91 of the bare protocol's throughput and 4.8 against 5.8 ms of
    # client CPU a turn (benchmarks/bench_floor.py, phase C, six runs each). Two more than the
    # CPUs let fsyncs overlap the rest.
    return int_from_env(
        ENV_WORKERS,
        default=min(32, _usable_cpus() + 2),
        low=1,
        high=256,
        what="worker thread count",
    )


#: At most this many hops at once per event loop (:func:`_max_workers`: the CPUs + 2, at
#: most 32, unless :data:`ENV_WORKERS` says otherwise); more wait for a free slot.
MAX_WORKERS: Final = _max_workers()

#: The limiter of :func:`run_in_worker`, one per event loop (an anyio limiter belongs to the
#: loop it is first used in, as anyio's own default thread limiter does).
_limiter: RunVar[anyio.CapacityLimiter] = RunVar("codex_turn_worker_limiter")


def _worker_limiter() -> anyio.CapacityLimiter:
    try:
        return _limiter.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(MAX_WORKERS)
        _limiter.set(limiter)
        return limiter


async def run_in_worker(func: Callable[..., _T], *args: Any) -> _T:
    """``func(*args)`` in a worker thread, waited for shielded (see the module header).

    A caller already cancelled does not start it; one cancelled meanwhile (waiting for a free
    slot, or for the work) gets the result, and the cancellation at its next checkpoint.
    Raises what ``func`` raised."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    # Shielded from here on, the wait for a slot included: a hop asked for is a hop done.
    with anyio.CancelScope(shield=True):
        result = await anyio.to_thread.run_sync(func, *args, limiter=_worker_limiter())
    return result
