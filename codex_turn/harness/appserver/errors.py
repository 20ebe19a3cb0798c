"""The app-server error family, mapped once at the client boundary.

Everything that can go wrong below the client (a dead pipe, an OS error while spawning, a
JSON-RPC error object, a deadline) is translated into exactly one of these where it enters the
client, so callers never see ``BrokenResourceError``, ``EndOfStream``, ``TimeoutError`` or a raw
error dict. The tree is small on purpose::

    CodexTurnError
    └── AppServerError            code: int | None, message: str
        ├── AppServerRpcError     the server answered a request with a JSON-RPC error
        ├── AppServerClosed       the process is gone (crash, kill, shutdown); every pending
        │                         request fails with it, nothing hangs
        ├── AppServerTimeout      a request (or a turn, a compaction) missed its deadline
        └── AppServerStartError   the binary could not be spawned or initialised

Messages are short and never carry prompts or model text; they are safe for
:func:`codex_turn._log.format_error`.
"""

from __future__ import annotations

from codex_turn.errors import CodexTurnError

__all__ = [
    "AppServerClosed",
    "AppServerError",
    "AppServerRpcError",
    "AppServerStartError",
    "AppServerTimeout",
]


class AppServerError(CodexTurnError):
    """Base of every app-server failure. ``code`` is the JSON-RPC code when there is one."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message if code is None else f"[{code}] {message}")
        self.code = code
        self.message = message


class AppServerRpcError(AppServerError):
    """A JSON-RPC error response (``-32600`` invalid request, ``-32601`` unknown method, …)."""

    def __init__(self, code: int, message: str, *, method: str | None = None) -> None:
        super().__init__(message, code=code)
        self.method = method


class AppServerClosed(AppServerError):
    """The app-server process exited or its pipes broke. ``returncode`` when known."""

    def __init__(
        self, message: str = "codex app-server is closed", *, returncode: int | None = None
    ) -> None:
        super().__init__(message)
        self.returncode = returncode


class AppServerTimeout(AppServerError):
    """A deadline passed: a request, an idle turn, a whole turn or a compaction."""

    def __init__(
        self, message: str, *, method: str | None = None, seconds: float | None = None
    ) -> None:
        super().__init__(message)
        self.method = method
        self.seconds = seconds


class AppServerStartError(AppServerError):
    """The binary is missing, failed to spawn, or failed ``initialize``."""
