"""Structured logging with privacy by construction.

Rule: log *facts about* a turn (ids, counts, durations, outcomes), never its *content*
(prompts, transcript text, tool arguments, secrets). Three helpers keep that rule cheap to
follow, and one structlog processor enforces the parts that can be enforced mechanically:

* :func:`get_logger` returns a :class:`ScrubbingLogger`: every field of every event is
  passed through :func:`redact_text`, which masks secret-shaped substrings (bearer tokens,
  ``sk-`` keys, ``KEY=value`` assignments) and any value registered with :func:`sensitive`,
  however the caller built the event.
* :func:`format_error` turns an exception into a short redacted string. Never log the
  exception object itself: its ``repr`` and traceback can carry request bodies.
* A field whose *name* is a credential key (``api_key=...``, ``headers={"Authorization":
  ...}``; :func:`codex_turn._secrets.is_secret_key`, the vocabulary projections use too) has a
  scalar value masked whole, at any depth. Our own counters (``estimated_tokens``,
  ``input_tokens``, ``token_budget`` ...) are not credential keys.
* :func:`mask_session_key` turns ``agent:main:telegram:12345`` into ``agent:…#1a2b3c4d`` so
  that log lines can be correlated per session without naming the user.

Error messages (decision, kept deliberately narrow). OpenClaw logs ``formatErrorMessage(err)``
and so do we: an error field carries the exception's type and message, because without the
message a failure cannot be diagnosed. Engine and Codex exceptions can echo transcript or
assistant text, so :func:`format_error`

1. masks registered sensitive values (the orchestrator registers the prompt) and secrets in
   the *raw* message, then once more after whitespace is collapsed (a multi-line prompt
   echoed in a message must not escape because its newlines became spaces);
2. replaces quoted prose, a quoted span of at least 20 characters and three words
   (``"please summarise my ..."``), by ``"[N chars]"``: quoted identifiers, keys and paths
   (``KeyError: 'messages'``, ``'/tmp/x.json'``) stay, as they are what makes an error
   message useful;
3. keeps one line of at most 200 characters of message, cut *after* redaction so a cut can
   never split a secret out of its pattern, or a registered prompt out of its match (those
   are matched in the whole message; secret patterns in its first 800 characters).

What it cannot do: recognise unquoted, unregistered conversation text. Such text reaches an
error message only if an engine puts it there; the registered prompt and the test-suite
privacy guard (``tests/conftest.py``) are the defence for that. We did not add a
per-exception ``sensitive_texts`` capability: the orchestrator already registers the prompt.

The ``transitions`` logger is pinned to WARNING here: at DEBUG every trigger costs 7x more.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import re
from collections.abc import Iterator
from typing import Any, Final

import structlog

from codex_turn._secrets import REDACTED, is_secret_key, redact_secrets

__all__ = [
    "ScrubbingLogger",
    "format_error",
    "get_logger",
    "mask_session_key",
    "redact_text",
    "sensitive",
]

logging.getLogger("transitions").setLevel(logging.WARNING)

_MAX_ERROR_CHARS: Final = 200
_QUOTED_PROSE_MIN_CHARS: Final = 20
_QUOTED_PROSE_MIN_SPACES: Final = 2  # three words: prose, not a path with one space in it
# A quoted span: "...", '...' (not an apostrophe: no word character outside the quotes), or
# typographic quotes; a quote still open at the end of the text counts as closed there (the
# engine may have cut its own message). Each alternative is one scan from its opening quote,
# over a text already cut to _SCAN_CHARS, so even a pathological message costs little. A
# secret that starts in the first 200 characters and runs past _SCAN_CHARS is still masked,
# as the patterns recognise a value by its start (a 600-character URL password would not be).
_QUOTED_SPAN: Final = re.compile(
    r"\"([^\"]*)(?:\"|$)"
    r"|(?<!\w)'([^']*)(?:'(?!\w)|$)"
    r"|\u201c([^\u201d]*)(?:\u201d|$)"
    r"|\u2018([^\u2019]*)(?:\u2019|$)"
)
_CLOSING_QUOTE: Final = {'"': '"', "'": "'", "\u201c": "\u201d", "\u2018": "\u2019"}
_SCAN_CHARS: Final = 4 * _MAX_ERROR_CHARS

_sensitive_values: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "codex_turn_sensitive_values", default=()
)
_MIN_SENSITIVE_CHARS = 4  # shorter values would mask ordinary words in log lines


def redact_text(text: str) -> str:
    """Mask secret-shaped substrings and registered sensitive values in ``text``."""
    return redact_secrets(_mask_sensitive(text))


def _mask_sensitive(text: str, *, collapsed: bool = False) -> str:
    """Mask registered values; with ``collapsed``, by their whitespace-collapsed form too."""
    for value in _sensitive_values.get():
        if value in text:
            text = text.replace(value, REDACTED)
        if collapsed:
            flat = " ".join(value.split())
            if len(flat) >= _MIN_SENSITIVE_CHARS and flat in text:
                text = text.replace(flat, REDACTED)
    return text


def _omit_quoted_prose(match: re.Match[str]) -> str:
    quoted = next(group for group in match.groups() if group is not None)
    if len(quoted) < _QUOTED_PROSE_MIN_CHARS or quoted.count(" ") < _QUOTED_PROSE_MIN_SPACES:
        return match.group()
    whole = match.group()
    closing = _CLOSING_QUOTE[whole[0]]
    return f"{whole[0]}[{len(quoted)} chars]{closing if whole.endswith(closing) else ''}"


def format_error(error: BaseException) -> str:
    """A short, redacted, single-line description of ``error`` that is safe to log.

    ``TypeName: message``: secrets and registered values masked, quoted prose omitted,
    whitespace collapsed, at most ``_MAX_ERROR_CHARS`` characters of message (see the module
    docstring for what this does and does not guarantee).
    """
    # Registered values first, in the whole raw message (a multi-line prompt as it is), then in
    # the collapsed one (the same prompt with its newlines made spaces).
    message = " ".join(_mask_sensitive(str(error)).split())
    message = _mask_sensitive(message, collapsed=True)
    # Secret patterns over a bounded prefix (ample for 200 characters), then quoted prose.
    message = redact_secrets(message[:_SCAN_CHARS])
    message = _QUOTED_SPAN.sub(_omit_quoted_prose, message) or "(no message)"
    if len(message) > _MAX_ERROR_CHARS:
        message = message[: _MAX_ERROR_CHARS - 1] + "…"
    return f"{type(error).__name__}: {message}"


def mask_session_key(session_key: str | None) -> str | None:
    """Correlatable but anonymous form of a session key (first segment + short digest)."""
    if session_key is None:
        return None
    digest = hashlib.sha256(session_key.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    head, sep, _ = session_key.partition(":")
    return f"{head}:…#{digest}" if sep else f"…#{digest}"


@contextlib.contextmanager
def sensitive(*values: str | None) -> Iterator[None]:
    """Within this context (task-local), mask each non-trivial value in every log field."""
    fresh = tuple(v for v in values if v and len(v.strip()) >= _MIN_SENSITIVE_CHARS)
    # Longest first, so a value containing another is masked whole.
    merged = tuple(sorted(set(_sensitive_values.get() + fresh), key=len, reverse=True))
    token = _sensitive_values.set(merged)
    try:
        yield
    finally:
        _sensitive_values.reset(token)


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, BaseException):
        return format_error(value)
    if isinstance(value, dict):
        return {k: _scrub_field(k, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_scrub(v) for v in value)
    return value


def _scrub_field(name: object, value: Any) -> Any:
    """A field's value, masked whole when its name is a credential key (as in projections)."""
    scalar = isinstance(value, str | int | float) and not isinstance(value, bool)
    if scalar and isinstance(name, str) and is_secret_key(name):
        return REDACTED
    return _scrub(value)


class ScrubbingLogger:
    """A thin facade over a structlog logger that redacts every field before it is emitted.

    It wraps ``structlog.get_logger`` (so the application's configuration, and test helpers
    such as ``structlog.testing.capture_logs``, still apply) instead of installing a global
    processor that an embedding application could configure away. There is deliberately no
    ``exception()``: tracebacks can carry request bodies.
    """

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def bind(self, **fields: Any) -> ScrubbingLogger:
        return ScrubbingLogger(self._inner.bind(**_scrub(fields)))

    def debug(self, event: str, **fields: Any) -> None:
        self._inner.debug(redact_text(event), **_scrub(fields))

    def info(self, event: str, **fields: Any) -> None:
        self._inner.info(redact_text(event), **_scrub(fields))

    def warning(self, event: str, **fields: Any) -> None:
        self._inner.warning(redact_text(event), **_scrub(fields))

    def error(self, event: str, **fields: Any) -> None:
        self._inner.error(redact_text(event), **_scrub(fields))


def get_logger(name: str) -> ScrubbingLogger:
    """The logger every codex-turn module uses: structlog, with every field scrubbed."""
    return ScrubbingLogger(structlog.get_logger(name))
