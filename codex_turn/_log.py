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
* :func:`mask_session_key` turns ``agent:main:telegram:12345`` into ``agent:…#1a2b3c4d`` so
  that log lines can be correlated per session without naming the user.

The ``transitions`` logger is pinned to WARNING here: at DEBUG every trigger costs 7x more.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import structlog

from codex_turn._secrets import REDACTED, redact_secrets

__all__ = [
    "ScrubbingLogger",
    "format_error",
    "get_logger",
    "mask_session_key",
    "redact_text",
    "sensitive",
]

logging.getLogger("transitions").setLevel(logging.WARNING)

_MAX_ERROR_CHARS = 300

_sensitive_values: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "codex_turn_sensitive_values", default=()
)
_MIN_SENSITIVE_CHARS = 4  # shorter values would mask ordinary words in log lines


def redact_text(text: str) -> str:
    """Mask secret-shaped substrings and registered sensitive values in ``text``."""
    for value in _sensitive_values.get():
        if value in text:
            text = text.replace(value, REDACTED)
    return redact_secrets(text)


def format_error(error: BaseException) -> str:
    """A short, redacted, single-line description of ``error`` that is safe to log."""
    message = str(error).strip() or "(no message)"
    message = " ".join(message.split())
    if len(message) > _MAX_ERROR_CHARS:
        message = message[:_MAX_ERROR_CHARS] + "…"
    return f"{type(error).__name__}: {redact_text(message)}"


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
        return {k: _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_scrub(v) for v in value)
    return value


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
