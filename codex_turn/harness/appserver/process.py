"""The app-server process and its stdio line transport.

:class:`AppServerProcess` owns one ``codex app-server`` child and exposes exactly what the
JSON-RPC client needs, as a :class:`LineTransport`: send one line, receive one line, and a
background job (draining stderr). Everything OS-level is mapped here, once:

* a failed spawn (missing binary, bad permissions, a CODEX_HOME that cannot be prepared, a
  config value TOML cannot hold) becomes :class:`AppServerStartError`; a CODEX_HOME that
  holds a user's configuration is refused before anything is written there
  (:class:`~.errors.CodexHomeNotPrivate`, see :mod:`.config`);
* end of stdout, a broken pipe, or a closed stream becomes :class:`AppServerClosed` with the
  exit code when the process has one. EOF on stdout is the *immediate* death signal: a killed
  process closes its pipes at once, so the client notices within milliseconds instead of
  waiting for ``wait()``.

On asyncio (POSIX) stdout is a plain pipe that the event loop itself reads
(:class:`_StdoutLines`): each line is handed to the client from the loop's read callback
(:meth:`AppServerProcess.serve_lines`), without a reader task woken per line or stream buffers
in between; on trio it is read through anyio's streams.

stderr is a pipe too, and a full pipe would block the server, so it is drained continuously.
Its text is *not* logged by default: with ``RUST_LOG`` set, Codex traces request and tool
content there, and the drain runs outside any turn's redaction context. Each line becomes an
``appserver.stderr`` debug event with the line's tracing level as ``codex_level`` (``ERROR``,
``WARN``, ..., parsed from the line; ``None`` when it has none; not ``level``, which is the
record's own) and its length in ``chars``; the text itself is logged (secret-scrubbed,
truncated) only when :attr:`~.config.AppServerConfig.log_stderr_text` opts in. Either way at
a bounded rate (a token bucket); excess lines are counted and reported as one summary line.
The last few lines are kept in memory for diagnostics. One of them reaches an exception
message only when the process fails to *start* (:meth:`AppServerProcess.startup_reason`:
Codex's own fatal or error line, ANSI and tracing prefix stripped, secrets scrubbed, cut):
before the first request nothing of a conversation exists to be quoted, and without it a
broken ``config.toml`` says only "exited (exit code 1)"; later lines never do (they may
quote content).

The child starts with :attr:`~.config.AppServerConfig.umask` (``0o077`` for a private home:
what Codex writes there is owner-only), in a session of its own: the terminal's signals
(Ctrl-C, Ctrl-Z, a hang-up) reach the host, which decides, and not Codex behind its back.

Shutdown is graceful first: close stdin (the app-server exits 0 on EOF), wait, then terminate,
then kill. It is shielded from cancellation so a cancelled caller never leaks a process. A
process declared dead (see :mod:`.connection`) is :meth:`AppServerProcess.kill` ed first: SIGKILL
also ends a stopped process, which would never act on stdin EOF or SIGTERM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from codex_turn._log import format_error, get_logger, redact_text

from .config import AppServerConfig
from .errors import AppServerClosed, AppServerStartError

_sniffio: Any
try:  # anyio names the async library through sniffio when it is installed
    import sniffio as _sniffio
except ImportError:  # pragma: no cover - anyio then assumes asyncio wherever a loop runs
    _sniffio = None

__all__ = ["AppServerProcess", "LineTransport", "startup_reason"]

log = get_logger(__name__)

MAX_LINE_BYTES = 256 * 1024 * 1024  # a resumed thread's full history can be large
MAX_STDERR_LINE = 64 * 1024
_LOGGED_STDERR_CHARS = 400
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# ``2026-01-01T00:00:00.000000Z  WARN codex_core::...: text`` (tracing's format), or an
# ``Error: ...`` line (a fatal error printed by main). Only the head of the line is searched.
_STDERR_LEVEL = re.compile(r"\b(TRACE|DEBUG|INFO|WARN|WARNING|ERROR)\b")
_STDERR_FATAL = re.compile(r"^(?:Error|error)\b")
_LEVEL_HEAD_CHARS = 64


_TRACING_HEAD = re.compile(r"^\S+Z\s+(?:TRACE|DEBUG|INFO|WARN|WARNING|ERROR)\s+[\w:]+:\s*")
_STARTUP_REASON_CHARS = 300


def startup_reason(lines: Iterable[str], *, config_only: bool = False) -> str | None:
    """Codex's own reason among ``lines`` of its stderr, as an error message may quote it:
    its fatal line (``Error: ...``), else its last ``ERROR`` line, without colours and the
    tracing prefix, secrets scrubbed (:func:`codex_turn._log.redact_text`), cut. With
    ``config_only``, only a line about its configuration (Codex falls back to its defaults
    on an invalid ``config.toml``, and the defaults may need a login the user's own
    configuration did not). ``None`` when there is none."""
    fatal: str | None = None
    error: str | None = None
    for raw in lines:
        line = _ANSI_ESCAPE.sub("", raw).strip()
        if config_only and "configuration" not in line:
            continue
        if _STDERR_FATAL.match(line):
            fatal = fatal or line
        elif stderr_level(line) == "ERROR":
            error = line
    chosen = fatal or error
    if chosen is None:
        return None
    text = redact_text(_TRACING_HEAD.sub("", chosen))
    return text if len(text) <= _STARTUP_REASON_CHARS else text[: _STARTUP_REASON_CHARS - 1] + "…"


def stderr_level(line: str) -> str | None:
    """The tracing level of one stderr line (``ERROR``, ``WARN``, ...), or ``None``."""
    head = _ANSI_ESCAPE.sub("", line)[:_LEVEL_HEAD_CHARS]
    if _STDERR_FATAL.match(head):
        return "ERROR"
    match = _STDERR_LEVEL.search(head)
    if match is None:
        return None
    level = match.group(1)
    return "WARN" if level == "WARNING" else level


class LineTransport(Protocol):
    """What the client needs from a transport (the process, or a test double).

    A transport may also offer ``async serve_lines(on_line)``: hand every line to ``on_line``
    as it arrives, in order, until it ends as :meth:`receive_line` would (raising
    :class:`AppServerClosed`); an exception from ``on_line`` ends it and propagates. The
    client reads that way when it can (:meth:`AppServerProcess.serve_lines`)."""

    async def send_line(self, line: bytes) -> None: ...

    async def receive_line(self) -> bytes: ...

    async def run_background(self) -> None: ...

    async def aclose(self) -> None: ...

    def kill(self) -> None:
        """End the other side at once (a process: SIGKILL, also when it is stopped)."""
        ...

    @property
    def returncode(self) -> int | None: ...


class _TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.capacity = float(burst)
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class _StdoutLines(asyncio.Protocol):
    """The child's stdout on asyncio, read by the loop's own pipe transport: each complete
    line goes to the sink from the read callback itself, so a line costs no reader-task round
    and no stream buffers in between. Lines that arrive while no sink is attached wait in
    :attr:`queued` (:meth:`AppServerProcess.receive_line`)."""

    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None
        self.sink: Callable[[bytes], None] | None = None
        self.queued: collections.deque[bytes] = collections.deque()
        #: Why no more lines come ("exited", "stdout is closed", "sent an oversized line").
        self.ended: str | None = None
        #: What the sink raised (it ends the reading; re-raised by ``serve_lines``). Any
        #: BaseException: the loop does not guard ``data_received``, and a line after a failed
        #: one must never be handed over nor silently dropped with the client left open.
        self.sink_error: BaseException | None = None
        self.changed = asyncio.Event()  # a line queued, the end, or a sink error
        self._partial = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.ended is not None or self.sink_error is not None:
            return
        partial = self._partial
        if b"\n" not in data:
            partial += data
            if len(partial) >= MAX_LINE_BYTES:
                self.end("sent an oversized line")
            return
        lines = data.split(b"\n")
        if partial:
            lines[0] = bytes(partial) + lines[0]
            partial.clear()
        partial += lines.pop()  # the unterminated rest (usually empty)
        sink = self.sink
        for line in lines:
            if sink is None:
                self.queued.append(line)
                self.changed.set()
                continue
            try:
                sink(line)
            except BaseException as exc:
                self.sink_error = exc
                self.sink = None
                self.changed.set()
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise  # recorded for serve_lines, and still the loop's to handle
                return
            if self.sink is not sink:  # detached meanwhile
                sink = self.sink
        if len(partial) >= MAX_LINE_BYTES:
            self.end("sent an oversized line")

    def eof_received(self) -> bool:
        self.end("exited")
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.end("exited" if exc is None else "stdout is closed")

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
            self.changed.set()


def _in_task_context(on_line: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """``on_line`` as the loop's read callback calls it: in the calling task's context, with
    the async library named (sniffio's variable, which anyio reads outside a task), so that
    what it does with anyio (set an event, start a task in a task group) works as it did in
    the task."""
    context = contextvars.copy_context()
    if _sniffio is not None:
        context.run(_sniffio.current_async_library_cvar.set, "asyncio")

    def in_context(line: bytes) -> None:
        context.run(on_line, line)

    return in_context


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running event loop when the current task runs on anyio's asyncio backend; ``None``
    elsewhere (trio). The package's one test of the backend: its fast paths are asyncio's."""
    if anyio.get_cancelled_exc_class() is asyncio.CancelledError:
        return asyncio.get_running_loop()
    return None


def _on_asyncio() -> bool:
    """Whether the current task runs on anyio's asyncio backend (not trio), on POSIX (where
    the event loop reads a plain pipe)."""
    return os.name == "posix" and running_asyncio_loop() is not None


class AppServerProcess:
    """One spawned ``codex app-server`` speaking newline-delimited JSON over stdio.

    On asyncio its stdout is a pipe read by the event loop itself (:class:`_StdoutLines`):
    :meth:`serve_lines` then hands each line to the client from the read callback. Elsewhere
    (trio) lines are read through anyio's streams."""

    def __init__(
        self,
        process: anyio.abc.Process,
        config: AppServerConfig,
        *,
        stdout_lines: _StdoutLines | None = None,
    ) -> None:
        self._process = process
        self._config = config
        assert process.stdin is not None
        assert process.stdout is not None or stdout_lines is not None
        self._stdin = process.stdin
        self._lines = stdout_lines
        self._stdout = (
            BufferedByteReceiveStream(process.stdout) if process.stdout is not None else None
        )
        self._stderr = BufferedByteReceiveStream(process.stderr) if process.stderr else None
        # The send checks for cancellation (and yields when the pipe is full); the lock need
        # not yield again when it is free.
        self._send_lock = anyio.Lock(fast_acquire=True)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self.stderr_lines = 0
        self.stderr_dropped = 0
        self._stderr_drained = anyio.Event()
        self._closed = False

    @classmethod
    async def spawn(cls, config: AppServerConfig) -> AppServerProcess:
        try:
            config.write()
            argv = config.argv()
        except (OSError, TypeError, ValueError) as exc:
            # OS errors, and a config value TOML cannot hold (the message names its key,
            # never the value). A foreign CODEX_HOME is already typed (CodexHomeNotPrivate).
            raise AppServerStartError(
                f"cannot prepare CODEX_HOME for codex app-server: {format_error(exc)}"
            ) from exc
        lines: _StdoutLines | None = None
        stdout: int = subprocess.PIPE
        read_end: int | None = None
        try:
            if _on_asyncio():
                read_end, stdout = os.pipe()  # the child's stdout; our end goes to the loop
            try:
                process = await anyio.open_process(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=stdout,
                    stderr=subprocess.PIPE,
                    env=config.environment(),
                    cwd=str(config.codex_home),
                    umask=-1 if config.umask is None else config.umask,
                    # A session of its own: a terminal's Ctrl-C (SIGINT to the foreground
                    # process group) is the host's to handle (interrupt a turn, say), and
                    # must not kill the Codex its next turn needs. The child still ends
                    # with its host: stdin EOF, then terminate (aclose).
                    start_new_session=True,
                )
            finally:
                if read_end is not None:
                    os.close(stdout)  # the child holds its own copy: EOF comes when it exits
            if read_end is not None:
                pipe = os.fdopen(read_end, "rb", buffering=0)
                read_end = None  # the file object owns it now
                try:
                    _, lines = await asyncio.get_running_loop().connect_read_pipe(
                        _StdoutLines, pipe
                    )
                except BaseException:
                    pipe.close()
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()  # nobody could ever read it
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await process.aclose()  # reaped, its other pipes closed
                    raise
        except OSError as exc:
            raise AppServerStartError(
                f"cannot start codex app-server: {format_error(exc)}"
            ) from exc
        finally:
            if read_end is not None:
                os.close(read_end)
        log.info("appserver.spawned", pid=process.pid)
        return cls(process, config, stdout_lines=lines)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def _closed_error(self, why: str) -> AppServerClosed:
        code = self._process.returncode
        suffix = f" (exit code {code})" if code is not None else ""
        return AppServerClosed(f"codex app-server {why}{suffix}", returncode=code)

    async def send_line(self, line: bytes) -> None:
        try:
            async with self._send_lock:
                await self._stdin.send(line + b"\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise self._closed_error("stdin is closed") from exc

    async def receive_line(self) -> bytes:
        lines = self._lines
        if lines is not None:
            while not lines.queued:
                if lines.ended is not None:
                    raise await self._ended(lines.ended)
                lines.changed.clear()
                await lines.changed.wait()
            return lines.queued.popleft()
        assert self._stdout is not None
        try:
            return await self._stdout.receive_until(b"\n", MAX_LINE_BYTES)
        except (anyio.IncompleteRead, anyio.EndOfStream) as exc:
            raise await self._ended("exited") from exc
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise self._closed_error("stdout is closed") from exc
        except anyio.DelimiterNotFound as exc:
            raise self._closed_error("sent an oversized line") from exc

    async def serve_lines(self, on_line: Callable[[bytes], None]) -> None:
        """Hand every line to ``on_line`` as it arrives, in order; raises
        :class:`AppServerClosed` when stdout ends (as :meth:`receive_line` does) and whatever
        ``on_line`` raised (no line is handed over after that). On asyncio the lines are
        handed over from the event loop's read callback (see :class:`_StdoutLines`)."""
        lines = self._lines
        if lines is None:
            while True:
                on_line(await self.receive_line())
        while lines.queued:  # arrived before anyone listened
            on_line(lines.queued.popleft())
        lines.sink = _in_task_context(on_line)
        try:
            while True:
                if lines.sink_error is not None:
                    raise lines.sink_error
                if lines.ended is not None:
                    raise await self._ended(lines.ended)
                lines.changed.clear()
                await lines.changed.wait()
        finally:
            lines.sink = None

    async def _ended(self, why: str) -> AppServerClosed:
        if why == "exited":
            # EOF: give the OS a moment to reap so the exit code can be reported.
            with anyio.move_on_after(0.2):
                await self._process.wait()
        return self._closed_error(why)

    async def startup_reason(self, *, wait: float = 1.0) -> str | None:
        """Why the process failed to start, in Codex's own words (:func:`startup_reason`),
        once its stderr is drained (at most ``wait`` seconds: a process that exited has
        closed it)."""
        with anyio.move_on_after(wait):
            await self._stderr_drained.wait()
        return startup_reason(self.stderr_tail)

    async def run_background(self) -> None:
        """Drain stderr into the log until EOF, at a bounded rate."""
        try:
            await self._drain_stderr()
        finally:
            self._stderr_drained.set()

    async def _drain_stderr(self) -> None:
        if self._stderr is None:
            return
        bucket = _TokenBucket(self._config.stderr_lines_per_second, self._config.stderr_burst)
        while True:
            try:
                raw = await self._stderr.receive_until(b"\n", MAX_STDERR_LINE)
            except anyio.DelimiterNotFound:
                raw = await self._stderr.receive(MAX_STDERR_LINE)
            except (
                anyio.IncompleteRead,
                anyio.EndOfStream,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                OSError,
            ):
                break
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            self.stderr_lines += 1
            self.stderr_tail.append(line[:_LOGGED_STDERR_CHARS])
            if bucket.take():
                if self.stderr_dropped:
                    log.warning("appserver.stderr.dropped", lines=self.stderr_dropped)
                    self.stderr_dropped = 0
                self._log_stderr(line)
            else:
                self.stderr_dropped += 1
        if self.stderr_dropped:
            log.warning("appserver.stderr.dropped", lines=self.stderr_dropped)

    def _log_stderr(self, line: str) -> None:
        level = stderr_level(line)
        if not self._config.log_stderr_text:
            # Facts only: the text can quote prompts, tool arguments and model output.
            log.debug("appserver.stderr", pid=self.pid, codex_level=level, chars=len(line))
            return
        emit = log.warning if level == "ERROR" else log.info
        emit(
            "appserver.stderr",
            pid=self.pid,
            codex_level=level,
            chars=len(line),
            line=line[:_LOGGED_STDERR_CHARS],
        )

    def kill(self) -> None:
        """Immediate SIGKILL (a process declared dead, tests, last-resort shutdown)."""
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # raced with exit
                self._process.kill()

    async def aclose(self) -> None:
        """Close stdin, wait, terminate, kill. Shielded: always completes."""
        if self._closed:
            return
        self._closed = True
        timeout = self._config.shutdown_timeout
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await self._stdin.aclose()
            with anyio.move_on_after(timeout):
                await self._process.wait()
            if self._process.returncode is None:
                log.warning("appserver.terminate", pid=self.pid)
                with contextlib.suppress(ProcessLookupError):
                    self._process.terminate()
                with anyio.move_on_after(2.0):
                    await self._process.wait()
            if self._process.returncode is None:
                log.warning("appserver.kill", pid=self.pid)
                self.kill()
                await self._process.wait()
            await self._process.aclose()
            if self._lines is not None and self._lines.transport is not None:
                self._lines.end("stdout is closed")
                self._lines.transport.close()
            log.info("appserver.exited", pid=self.pid, returncode=self._process.returncode)
