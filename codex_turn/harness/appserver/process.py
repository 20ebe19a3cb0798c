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

stderr is a pipe too, and a full pipe would block the server, so it is drained continuously.
Its text is *not* logged by default: with ``RUST_LOG`` set, Codex traces request and tool
content there, and the drain runs outside any turn's redaction context. Each line becomes an
``appserver.stderr`` debug event with the line's tracing level as ``codex_level`` (``ERROR``,
``WARN``, ..., parsed from the line; ``None`` when it has none; not ``level``, which is the
record's own) and its length in ``chars``; the text itself is logged (secret-scrubbed,
truncated) only when :attr:`~.config.AppServerConfig.log_stderr_text` opts in. Either way at
a bounded rate (a token bucket); excess lines are counted and reported as one summary line.
The last few lines are kept in memory for diagnostics but never put into exception messages
(they may quote content).

The child starts with :attr:`~.config.AppServerConfig.umask` (``0o077`` for a private home:
what Codex writes there is owner-only).

Shutdown is graceful first: close stdin (the app-server exits 0 on EOF), wait, then terminate,
then kill. It is shielded from cancellation so a cancelled caller never leaks a process. A
process declared dead (see :mod:`.client`) is :meth:`AppServerProcess.kill` ed first: SIGKILL
also ends a stopped process, which would never act on stdin EOF or SIGTERM.
"""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import time
from typing import Protocol

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from codex_turn._log import format_error, get_logger

from .config import AppServerConfig
from .errors import AppServerClosed, AppServerStartError

__all__ = ["AppServerProcess", "LineTransport"]

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
    """What the client needs from a transport (the process, or a test double)."""

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


class AppServerProcess:
    """One spawned ``codex app-server`` speaking newline-delimited JSON over stdio."""

    def __init__(self, process: anyio.abc.Process, config: AppServerConfig) -> None:
        self._process = process
        self._config = config
        assert process.stdin is not None
        assert process.stdout is not None
        self._stdin = process.stdin
        self._stdout = BufferedByteReceiveStream(process.stdout)
        self._stderr = BufferedByteReceiveStream(process.stderr) if process.stderr else None
        self._send_lock = anyio.Lock()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self.stderr_lines = 0
        self.stderr_dropped = 0
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
        try:
            process = await anyio.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=config.environment(),
                cwd=str(config.codex_home),
                umask=-1 if config.umask is None else config.umask,
            )
        except OSError as exc:
            raise AppServerStartError(
                f"cannot start codex app-server: {format_error(exc)}"
            ) from exc
        log.info("appserver.spawned", pid=process.pid)
        return cls(process, config)

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
        try:
            return await self._stdout.receive_until(b"\n", MAX_LINE_BYTES)
        except (anyio.IncompleteRead, anyio.EndOfStream) as exc:
            # EOF: give the OS a moment to reap so the exit code can be reported.
            with anyio.move_on_after(0.2):
                await self._process.wait()
            raise self._closed_error("exited") from exc
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise self._closed_error("stdout is closed") from exc
        except anyio.DelimiterNotFound as exc:
            raise self._closed_error("sent an oversized line") from exc

    async def run_background(self) -> None:
        """Drain stderr into the log until EOF, at a bounded rate."""
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
            log.info("appserver.exited", pid=self.pid, returncode=self._process.returncode)
