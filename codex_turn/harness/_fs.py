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
  once the pid is dead. :func:`create_exclusive` is the sibling for files that must be created
  complete and never replaced (the transcript): the same temp file, then ``link``.
* **Appends are not here.** Appending to a transcript is one ``O_APPEND`` write owned by the
  mirror; only :func:`write_all` (a full ``write`` loop) is shared, and its reading sibling
  :func:`pread_exact` (a full ``pread`` loop).
* **Only regular files are opened.** :func:`open_regular` is how the transcript and the
  sidecar are opened: without blocking (``O_NONBLOCK``, so a FIFO at the path cannot hang the
  worker thread, which no cancellation could reach) and refused with
  :class:`NotRegularFileError` unless ``fstat`` says it is a regular file (a directory, a
  FIFO, a socket or a device is never read or written).
* **File I/O leaves the event loop in one hop.** :func:`run_in_worker` runs a synchronous
  function in a worker thread and waits for it, shielded: the work is never abandoned (a lease
  taken by a worker nobody waits for would never be given back), the caller's cancellation is
  raised once it is done. On asyncio it is two event-loop rounds (the worker's wake-up and
  the waiting task's), where ``anyio.to_thread.run_sync`` takes four: its checkpoint and its
  capacity limiter's each cost a round, and a turn makes several hops (issue 13). The workers
  are this module's own (at most :data:`MAX_WORKERS`, each gone after
  :data:`WORKER_IDLE_SECONDS` without work; a forked child starts afresh; jobs reach them
  through a ``queue.SimpleQueue``, whose C ``put``/``get`` halve a hop's CPU against a
  ``threading.Condition``); the function runs in a copy of the caller's context, as with
  anyio. Elsewhere (trio) it is anyio's. :func:`run_in_worker_then` lets the worker go on
  with a follow-up after handing the result back: the prompt's ``fsync`` overlaps
  ``turn/start`` that way, for no extra hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import os
import queue
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any, Final, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from codex_turn._env import int_from_env
from codex_turn._log import get_logger

try:
    import sniffio as _sniffio
except ImportError:  # pragma: no cover - anyio depends on it
    _sniffio = None  # type: ignore[assignment]

__all__ = [
    "NotRegularFileError",
    "atomic_write",
    "atomic_write_lock",
    "create_exclusive",
    "file_kind",
    "fsync_directory",
    "open_regular",
    "pid_alive",
    "pinned_session_path",
    "pread_exact",
    "run_in_worker",
    "run_in_worker_then",
    "session_path",
    "write_all",
]

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


# --- the worker-thread hop -------------------------------------------------------------------

_T = TypeVar("_T")

_log = get_logger(__name__)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # this process's share, not the host's count
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Overrides :data:`MAX_WORKERS` (1 to 256), read once at import: for storage whose fsyncs
#: take long (each holds a worker while it waits), or a CPU quota the affinity mask does
#: not show. Anything else is ignored, with a warning.
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


#: At most this many worker threads (:func:`_max_workers`: the CPUs + 2, at most 32, unless
#: :data:`ENV_WORKERS` says otherwise); more concurrent hops wait in line for the next free
#: worker. No job waits for a job queued behind it (a prompt's fsync runs in the worker that
#: wrote it, as a follow-up), so a full pool always drains.
MAX_WORKERS: Final = _max_workers()
#: A worker with nothing to do for this long ends (anyio's own workers: 10 s).
WORKER_IDLE_SECONDS: Final = 10.0

_Job = tuple[
    contextvars.Context,
    Callable[..., Any],
    tuple[Any, ...],
    asyncio.AbstractEventLoop,
    "asyncio.Future[Any]",
    "Callable[[Any], None] | None",
]


class _Workers:
    """The threads :func:`run_in_worker` hands its jobs to: started on demand up to
    :data:`MAX_WORKERS`, ending after :data:`WORKER_IDLE_SECONDS` idle.

    Jobs go through a ``queue.SimpleQueue`` (its ``put``/``get`` are C code: half the cost of
    a hop through a ``threading.Condition``, which runs in Python and allocates a lock per
    wait). Every queued job is accounted for, so that a job never waits while fewer than
    :data:`MAX_WORKERS` threads exist: it either *claims* an idle worker (``_idle``, workers
    that will take a job without being started) or, with every thread busy, is counted in
    ``_backlog`` and taken by the next worker to finish, which then does not count itself
    idle. A worker whose ``get`` timed out ends only if no job claimed it meanwhile (``_idle``
    still counts it); otherwise a job is in the queue for it, and it goes back for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0  # workers free for a job and not claimed by one
        self._backlog = 0  # jobs queued while every worker was busy

    def submit(self, job: _Job) -> None:
        with self._lock:
            self._jobs.put(job)
            if self._idle:
                self._idle -= 1  # that worker takes it
                return
            if self._threads >= MAX_WORKERS:
                self._backlog += 1  # the next worker to finish takes it
                return
            self._threads += 1
        threading.Thread(target=self._work, name="codex-turn-worker", daemon=True).start()

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            try:
                context, func, args, loop, future, then = jobs.get(timeout=WORKER_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # unclaimed: nobody queued a job for this worker
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue  # claimed just as the wait ended: its job is in the queue
            try:
                result = context.run(func, *args)
            except BaseException as error:
                _deliver(loop, future, None, error)
            else:
                _deliver(loop, future, result, None)
                if then is not None:
                    _run_then(context, then, result)
            with self._lock:
                if self._backlog:
                    self._backlog -= 1
                else:
                    self._idle += 1


def _run_then(context: contextvars.Context, then: Callable[[Any], None], result: Any) -> None:
    try:
        context.run(then, result)
    except BaseException as error:  # nobody waits for it: said here; the worker lives on
        _log.warning("worker follow-up failed", error=type(error).__name__)


def _deliver(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    with suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_workers = _Workers()


def _reset_workers() -> None:
    # A forked child inherits the bookkeeping but none of the threads (nor maybe a free lock).
    global _workers
    _workers = _Workers()


os.register_at_fork(after_in_child=_reset_workers)


async def run_in_worker(func: Callable[..., _T], *args: Any) -> _T:
    """``func(*args)`` in a worker thread, waited for shielded (see the module header).

    As ``anyio.to_thread.run_sync``: a caller already cancelled does not start it; one
    cancelled meanwhile gets the result, and the cancellation at its next checkpoint. Raises
    what ``func`` raised. Unlike anyio's, the worker is not an AnyIO worker thread:
    ``anyio.from_thread`` in ``func`` needs the loop's token
    (``anyio.lowlevel.current_token()``), which the hop's file I/O never does."""
    return await _hop(func, args, None)


async def run_in_worker_then(func: Callable[..., _T], then: Callable[[_T], None], *args: Any) -> _T:
    """:func:`run_in_worker`, and then ``then(result)`` in the same worker thread *after* the
    caller has resumed with ``result``: work the caller must not wait for (an ``fsync`` that
    may overlap what the caller does next). ``then`` runs only when ``func`` returned, and
    reports its own outcome (an exception it lets out is logged by type, never raised); the
    caller waits for it through whatever ``then`` signals. On trio both run before the caller
    resumes (anyio's workers have no follow-up)."""
    return await _hop(func, args, then)


async def _hop(
    func: Callable[..., _T], args: tuple[Any, ...], then: Callable[[_T], None] | None
) -> _T:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio): anyio's workers, with the same shielding
        return await anyio.to_thread.run_sync(_with_then, func, args, then)
    await anyio.lowlevel.checkpoint_if_cancelled()  # no event-loop round unless cancelled
    context = contextvars.copy_context()
    if _sniffio is not None:
        # As in anyio's workers: code in the worker is not in the event loop's thread.
        context.run(_sniffio.current_async_library_cvar.set, None)
    future: asyncio.Future[_T] = loop.create_future()
    _workers.submit((context, func, args, loop, future, then))
    with anyio.CancelScope(shield=True):
        result = await future
    return result


def _with_then(
    func: Callable[..., _T], args: tuple[Any, ...], then: Callable[[_T], None] | None
) -> _T:
    result = func(*args)
    if then is not None:
        _run_then(contextvars.copy_context(), then, result)
    return result
