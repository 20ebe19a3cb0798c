"""The app-server error family, mapped once at the client boundary.

Everything that can go wrong below the client (a dead pipe, an OS error while spawning, a
JSON-RPC error object, a deadline) is translated into exactly one of these where it enters the
client, so callers never see ``BrokenResourceError``, ``EndOfStream``, ``TimeoutError`` or a raw
error dict. The tree is small on purpose::

    CodexTurnError
    └── AppServerError            code: int | None, message: str
        ├── AppServerRpcError     the server answered a request with a JSON-RPC error
        │   ├── ThreadNotFound    ... and the error says the thread does not exist
        │   │   └── NoRollout     ... because it has no rollout (a loaded thread without a
        │   │                     turn or an injection has none yet: it cannot be forked)
        │   └── NoActiveTurn      ... and the error says the turn is over (also a
        │                         TurnNotRunning)
        ├── TurnNotRunning        a ``turn/steer`` for a turn that is not running (not yet
        │                         started, interrupted, given up on, or over)
        ├── AppServerClosed       the process is gone (crash, kill, shutdown, or declared
        │                         dead after missing its deadlines); every pending request
        │                         fails with it, nothing hangs
        ├── AppServerTimeout      a request (or a turn, a compaction) missed its deadline
        ├── InvalidAppServerConfig  an AppServerConfig / ModelProviderConfig field is wrong
        │                         (raised when it is built; a ValueError and TypeError too)
        └── AppServerStartError   the binary could not be spawned or initialised
            ├── CodexHomeNotPrivate   a private home (``offline()``) would have to overwrite
            │                         or write into a user's Codex configuration: refused
            └── CodexLoginRequired    the configuration needs an OpenAI login and the
                                      CODEX_HOME has none (checked at start, in seconds)

Definitive versus transient. :class:`ThreadNotFound` is the one *definitive* answer about a
thread: Codex looked and there is no such thread, so a binding to it is worthless and may be
dropped. Everything else (a timeout, a closed or replaced process, an internal error while
reading a rollout that exists) says nothing about the thread and must never cost a caller its
binding. :meth:`ThreadNotFound.match` is the one place that reads Codex 0.163's wording:
``-32600 "no rollout found for thread id <id>"`` (a well-formed id with no rollout on disk:
:class:`NoRollout`) and ``-32600 "invalid session id: ..."`` (an id that cannot name any
thread).

A steer too late. ``turn/steer`` can only join a running turn. :class:`TurnNotRunning` says the
turn is not running (any more): the turn handle knows it without asking (its phase), or Codex
answers so (``-32600 "no active turn to steer"``, read by :meth:`NoActiveTurn.match` alone).
Any other refusal (``expectedTurnId`` not the active turn, a review or compaction turn that
cannot be steered) stays an :class:`AppServerRpcError`: a refusal, not a turn that is over.

Messages are short and never carry prompts or model text; they are safe for
:func:`codex_turn._log.format_error`. Text that comes from Codex is capped
(:data:`MAX_MESSAGE_CHARS`): it can quote an identifier of any size.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from codex_turn.errors import CodexTurnError

from .defaults import CODEX_VERSION
from .logsafe import capped

__all__ = [
    "MAX_MESSAGE_CHARS",
    "AppServerClosed",
    "AppServerError",
    "AppServerRpcError",
    "AppServerStartError",
    "AppServerTimeout",
    "CodexHomeNotPrivate",
    "CodexLoginRequired",
    "InvalidAppServerConfig",
    "NoActiveTurn",
    "NoRollout",
    "ThreadNotFound",
    "TurnNotRunning",
]

MAX_MESSAGE_CHARS: Final = 1000
"""The longest JSON-RPC error message kept from Codex (the rest is cut, with a marker)."""

_INVALID_REQUEST: Final = -32600
# Codex 0.163.0's answers to thread/resume for a thread that cannot be found (checked against
# the real binary by tests/test_appserver_faults_e2e.py); the first is thread/fork's answer for
# a base without a rollout too.
_NO_ROLLOUT: Final = "no rollout found for thread id"
_INVALID_ID: Final = "invalid session id:"
# Codex 0.163.0's answer to turn/steer once the turn is over (and for any expectedTurnId then).
_NO_ACTIVE_TURN: Final = "no active turn"


class AppServerError(CodexTurnError):
    """Base of every app-server failure. ``code`` is the JSON-RPC code when there is one."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message if code is None else f"[{code}] {message}")
        self.code = code
        self.message = message


class AppServerRpcError(AppServerError):
    """A JSON-RPC error response (``-32600`` invalid request, ``-32601`` unknown method, …)."""

    def __init__(self, code: int, message: str, *, method: str | None = None) -> None:
        super().__init__(capped(message, MAX_MESSAGE_CHARS) or "", code=code)
        self.method = method


class ThreadNotFound(AppServerRpcError):
    """Codex says, definitively, that ``thread_id`` does not exist (no rollout, or an id that
    cannot name a thread). The only resume failure that justifies dropping a binding."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        method: str | None = "thread/resume",
        thread_id: str | None = None,
    ) -> None:
        super().__init__(code, message, method=method)
        self.thread_id = thread_id

    @staticmethod
    def match(error: AppServerRpcError, thread_id: str) -> ThreadNotFound | None:
        """``error`` as a :class:`ThreadNotFound` when it is Codex's "no such thread" (a
        :class:`NoRollout` when Codex found no rollout for it), else ``None``."""
        if error.code != _INVALID_REQUEST:
            return None
        found = {_NO_ROLLOUT: NoRollout, _INVALID_ID: ThreadNotFound}
        for prefix, kind in found.items():
            if error.message.startswith(prefix):
                return kind(error.code, error.message, method=error.method, thread_id=thread_id)
        return None


class NoRollout(ThreadNotFound):
    """Codex found no rollout for ``thread_id``. On ``thread/resume``: no such thread. On
    ``thread/fork``: a base loaded in this process that has had neither a turn nor an
    injection has no rollout yet (anchoring it gives it one)."""


class TurnNotRunning(AppServerError):
    """``turn/steer`` for a turn that is not running: not started within the interrupt grace,
    interrupted, given up on, or over. ``phase``: the turn handle's phase when it knew without
    asking Codex (then no request was sent); ``None`` when Codex answered
    (:class:`NoActiveTurn`). Whatever was steered did not reach the turn."""

    def __init__(self, message: str, *, code: int | None = None, phase: str | None = None) -> None:
        super().__init__(message, code=code)
        self.phase = phase


class NoActiveTurn(AppServerRpcError, TurnNotRunning):
    """Codex answered a ``turn/steer`` that the thread has no active turn: the turn ended
    before the request reached it."""

    @classmethod
    def match(cls, error: AppServerRpcError) -> NoActiveTurn | None:
        """``error`` as a :class:`NoActiveTurn` when it is Codex's "no active turn"."""
        if error.code == _INVALID_REQUEST and error.message.startswith(_NO_ACTIVE_TURN):
            return cls(error.code, error.message, method=error.method)
        return None


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


class InvalidAppServerConfig(AppServerError, ValueError, TypeError):
    """An :class:`~.config.AppServerConfig` or :class:`~.config.ModelProviderConfig` field has
    a wrong type or value, refused when the config is built (before anything is written or
    spawned). ``problems``: one message per bad field, ``Class.field: what it must be``; never
    the value itself (a URL or an environment value can hold a secret). A ``ValueError`` and a
    ``TypeError`` too."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


class AppServerStartError(AppServerError):
    """The binary is missing, failed to spawn, or failed ``initialize``."""


class CodexBinaryMissing(AppServerStartError, FileNotFoundError):
    """The pinned Codex binary (the ``codex`` extra: ``openai-codex-cli-bin``) is not
    installed. Also a ``FileNotFoundError``, for callers that caught that before."""

    def __init__(self) -> None:
        super().__init__(
            "the Codex binary is not installed: pip install 'codex-turn[codex]' "
            f"(openai-codex-cli-bin=={CODEX_VERSION})"
        )


class CodexHomeNotPrivate(AppServerStartError):
    """``AppServerConfig.offline()`` was pointed at a CODEX_HOME it does not own.

    A private home is a new or empty directory, or one whose config.toml codex-turn wrote
    (it starts with :data:`~.config.CONFIG_MARKER`). Anything else (a config.toml with the
    user's settings, ``mcp_servers`` and all; a home holding ``auth.json``) is left exactly as
    it is: nothing is overwritten, merged, written into or re-permissioned. ``reason`` names
    what was found (file names only, never content)."""

    def __init__(self, codex_home: Path, reason: str) -> None:
        super().__init__(
            f"CODEX_HOME {codex_home} is not a private codex-turn home: {reason}. "
            "AppServerConfig.offline() writes its own config.toml and never overwrites or "
            "merges a user's configuration: give it a new or empty directory, or use "
            f"AppServerConfig.user({str(codex_home)!r}) to run on that configuration unchanged"
        )
        self.codex_home = codex_home
        self.reason = reason


class CodexLoginRequired(AppServerStartError):
    """The configuration needs an OpenAI login (``account/read`` says
    ``requiresOpenaiAuth``) and the CODEX_HOME in use holds none, so every turn would
    only retry until its timeout. Raised when the process starts; the message says how to
    log in. A model provider that needs no OpenAI login (``AppServerConfig.offline()``, any
    custom ``model_providers`` entry, with or without ``env_key``) is never refused."""

    def __init__(self, codex_home: Path, *, codex_said: str | None = None) -> None:
        home = shlex.quote(str(codex_home))
        super().__init__(
            f"codex app-server needs an OpenAI login and CODEX_HOME {codex_home} has none. "
            f"Log in with `CODEX_HOME={home} codex login` (ChatGPT), or with an API key: "
            f"`printenv OPENAI_API_KEY | CODEX_HOME={home} codex login --with-api-key` "
            "(codex app-server does not read OPENAI_API_KEY from the environment); or "
            "configure a model provider that needs no OpenAI login"
            + (f" (Codex said: {codex_said})" if codex_said else "")
        )
        self.codex_home = codex_home
        #: Codex's own line about its configuration, when it fell back to its defaults (an
        #: invalid config.toml): the reason the login is needed at all (scrubbed).
        self.codex_said = codex_said
