"""Structured logging with privacy by construction.

Rule: log *facts about* a turn (ids, counts, durations, outcomes), never its *content*
(prompts, transcript text, tool arguments, secrets). Three helpers keep that rule cheap to
follow, and the logger itself enforces the parts that can be enforced mechanically:

* :func:`get_logger` returns a :class:`ScrubbingLogger`: every field of every emitted event
  is passed through :func:`redact_text`, which masks secret-shaped substrings (bearer tokens,
  ``sk-`` keys, ``KEY=value`` assignments) and any value registered with :func:`sensitive`,
  however the caller built the event. The level check comes first: a filtered-out event is
  neither built nor scrubbed.
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

Where logs go. A library is quiet until its host asks: events are standard-library
records of the ``codex_turn.*`` loggers, and ``codex_turn`` carries a ``NullHandler``, so an
unconfigured process prints nothing. :func:`configure_logging` (the CLI's ``-v``/``-q``/
``--log-format``) shows them as JSON lines or console lines on stderr; a host with its own
``logging`` handlers gets them there (a structlog ``ProcessorFormatter`` sees the structured
fields). structlog's global configuration is never touched, and does not route our events,
except that ``structlog.testing.capture_logs`` sees all of them (the test suite's privacy guard).

The ``transitions`` logger is pinned to WARNING here: at DEBUG every trigger costs 7x more.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import hashlib
import json
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any, Final, Literal, TextIO

import structlog
from structlog.testing import LogCapture
from structlog.typing import Processor

from codex_turn._secrets import REDACTED, is_secret_key, redact_secrets

__all__ = [
    "LogFormat",
    "ScrubbingLogger",
    "configure_logging",
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


# Tuples, not ``int | float`` unions: a union in isinstance() is built anew at every call.
_NUMBER: Final = (int, float)  # bool too: it is an int
_SCALAR: Final = (str, int, float)
_SEQUENCE: Final = (list, tuple)


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if value is None or isinstance(value, _NUMBER):
        return value
    if isinstance(value, BaseException):
        return format_error(value)
    if isinstance(value, dict):
        return {k: _scrub_field(k, v) for k, v in value.items()}
    if isinstance(value, _SEQUENCE):
        return type(value)(_scrub(v) for v in value)
    return value


def _scrub_field(name: object, value: Any) -> Any:
    """A field's value, masked whole when its name is a credential key (as in projections)."""
    if (
        isinstance(value, _SCALAR)
        and value is not True
        and value is not False
        and isinstance(name, str)
        and is_secret_key(name)
    ):
        return REDACTED
    return _scrub(value)


# --- where events go ---------------------------------------------------------------------------

_ROOT_LOGGER: Final = "codex_turn"
# A library is quiet until its host configures logging: the NullHandler keeps the standard
# library's last-resort handler (WARNING and up, to stderr) away from our records.
logging.getLogger(_ROOT_LOGGER).addHandler(logging.NullHandler())

# structlog.testing.capture_logs swaps the global processors for [..., LogCapture()], keeping
# the list object. Reading that list directly costs ~40 ns (structlog.get_config() ~250 ns),
# and this check runs on the filtered path.
_STRUCTLOG_CONFIG: Final[Any] = getattr(structlog._config, "_CONFIG", None)


def _capturing() -> bool:
    """Whether ``structlog.testing.capture_logs`` is active (it then sees every event)."""
    if _STRUCTLOG_CONFIG is not None:
        processors = _STRUCTLOG_CONFIG.default_processors
    else:  # pragma: no cover - a structlog without the module-level configuration object
        processors = structlog.get_config()["processors"]
    return (
        isinstance(processors, list) and bool(processors) and isinstance(processors[-1], LogCapture)
    )


class _Event(dict[str, Any]):
    """The scrubbed event dict, as the ``msg`` of a standard-library record.

    :func:`configure_logging`'s formatter reads its fields directly; a host's structlog
    ``ProcessorFormatter`` reads it as the event dict, fields and all (the record's ``_logger``
    and ``_name`` attributes say so, as ``ProcessorFormatter.wrap_for_formatter`` would). Any
    other formatter gets ``str(record.msg)``: ``event key=value ...``, values JSON-encoded.
    """

    __slots__ = ()

    def __str__(self) -> str:
        fields = " ".join(
            f"{key}={json.dumps(value, ensure_ascii=False, default=str)}"
            for key, value in self.items()
            if key != "event"
        )
        event = str(self.get("event", ""))
        return f"{event} {fields}" if fields else event


class ScrubbingLogger:
    """The logger of every codex-turn module: level check first, then scrub, then emit.

    An event is emitted to the standard-library logger of the same name (under
    ``codex_turn``), which carries a ``NullHandler``: nothing is printed until the host
    configures logging, with :func:`configure_logging` or its own handlers. The level check
    (``logging.Logger.isEnabledFor``, cached by the standard library) comes *before* anything
    else, so a filtered-out event builds nothing and scrubs nothing. An emitted event has every
    field passed through the scrubber (:func:`redact_text`, credential-named fields masked
    whole, exceptions through :func:`format_error`) before any handler, formatter or processor
    sees it.

    ``bind`` stores its fields as they are (treat them as immutable, as structlog does): they
    are scrubbed when the first event is emitted, with the sensitive values registered when
    they were bound (:func:`sensitive`) as well as those registered at that moment, and again
    only when that set of values changes.

    While ``structlog.testing.capture_logs`` is active, every event (any level) is scrubbed
    the same way and handed to structlog instead, so the capture sees it; nothing is emitted to
    the standard library meanwhile. There is deliberately no ``exception()``: tracebacks can
    carry request bodies.
    """

    __slots__ = ("_context", "_name", "_scrubbed", "_sensitive", "_stdlib", "_structlog")

    def __init__(
        self,
        name: str,
        context: dict[str, Any] | None = None,
        sensitive_values: tuple[str, ...] = (),
        *,
        _stdlib: logging.Logger | None = None,
        _structlog: Any = None,
    ) -> None:
        self._name = name
        self._context: dict[str, Any] = context or {}
        self._sensitive = sensitive_values
        self._scrubbed: tuple[tuple[str, ...], dict[str, Any]] | None = None
        self._stdlib = _stdlib if _stdlib is not None else logging.getLogger(name)
        self._structlog = _structlog if _structlog is not None else structlog.get_logger(name)

    def bind(self, **fields: Any) -> ScrubbingLogger:
        """A logger whose events carry ``fields`` too (scrubbed when an event is emitted)."""
        active = _sensitive_values.get()
        kept = self._sensitive if not active else _merge_sensitive(self._sensitive, active)
        return ScrubbingLogger(
            self._name,
            {**self._context, **fields},
            kept,
            _stdlib=self._stdlib,
            _structlog=self._structlog,
        )

    def _scrubbed_context(self, values: tuple[str, ...]) -> dict[str, Any]:
        """The bound fields, scrubbed once per set of sensitive values (not at bind time)."""
        cached = self._scrubbed
        if cached is None or cached[0] != values:
            context = _scrub(self._context)
            if "event" in context:  # a bound ``event`` never replaces the event's own name
                context[_free_name("event", context)] = context.pop("event")
            cached = self._scrubbed = (values, context)
        return cached[1]

    def is_enabled_for(self, level: int) -> bool:
        """Whether an event at ``level`` (``logging.INFO`` ...) would be emitted."""
        return self._stdlib.isEnabledFor(level) or _capturing()

    def debug(self, event: str, **fields: Any) -> None:
        if self._stdlib.isEnabledFor(logging.DEBUG) or _capturing():
            self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        if self._stdlib.isEnabledFor(logging.INFO) or _capturing():
            self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        if self._stdlib.isEnabledFor(logging.WARNING) or _capturing():
            self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        if self._stdlib.isEnabledFor(logging.ERROR) or _capturing():
            self._emit(logging.ERROR, "error", event, fields)

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        active = _sensitive_values.get()
        # The values registered when the context was bound count too.
        values = _merge_sensitive(self._sensitive, active) if self._sensitive else active
        token = _sensitive_values.set(values) if values is not active else None
        try:
            scrubbed = _Event(event=redact_text(event))
            if self._context:
                scrubbed.update(self._scrubbed_context(values))
            scrubbed.update(_scrub(fields))
        finally:
            if token is not None:
                _sensitive_values.reset(token)
        if _capturing():
            getattr(self._structlog, method)(**scrubbed)
            return
        # stacklevel 3: the record's caller is whoever called debug()/info()/...
        self._stdlib.log(
            level, scrubbed, extra={"_logger": self._stdlib, "_name": method}, stacklevel=3
        )


def _merge_sensitive(kept: tuple[str, ...], active: tuple[str, ...]) -> tuple[str, ...]:
    if kept is active or set(active) <= set(kept):
        return kept
    return tuple(sorted(set(kept + active), key=len, reverse=True))


def get_logger(name: str) -> ScrubbingLogger:
    """The logger every codex-turn module uses (``name`` under ``codex_turn``)."""
    return ScrubbingLogger(name)


# --- what a host or the CLI calls to see the logs ---------------------------------------------

LogFormat = Literal["json", "console"]


class _LibraryHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure_logging` installs (and replaces when called again)."""


class _LineFormatter(logging.Formatter):
    """One line per record: ``timestamp``, ``level``, ``logger``, then the event's fields.

    It reads our records' event dict directly (no copy of the record, no processor chain); the
    timestamp is the record's own creation time, in UTC.
    """

    def __init__(self, renderer: Processor) -> None:
        super().__init__()
        self._render = renderer

    def format(self, record: logging.LogRecord) -> str:
        msg = record.msg
        fields = msg if isinstance(msg, _Event) else {"event": record.getMessage()}
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        level = record.levelname.lower()
        event_dict: dict[str, Any] = {
            "timestamp": when.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": level,
            "logger": record.name,
        }
        for key, value in fields.items():
            if key in _FORMATTER_KEYS:
                key = _free_name(key, fields, event_dict)
            event_dict[key] = value
        return str(self._render(None, level, event_dict))


#: The keys the formatter writes itself (``event`` is the event's own, set by the logger).
_FORMATTER_KEYS: Final = frozenset({"timestamp", "level", "logger"})
#: What a field named like a reserved key is renamed with (``level`` -> ``field_level``).
_CLASH_PREFIX: Final = "field_"


def _free_name(key: str, *taken: dict[str, Any]) -> str:
    """``key`` prefixed with :data:`_CLASH_PREFIX` until no dict in ``taken`` holds it."""
    key = _CLASH_PREFIX + key
    while any(key in names for names in taken):
        key = _CLASH_PREFIX + key
    return key


def configure_logging(
    level: int | str = "INFO",
    format: LogFormat = "json",  # the CLI's --log-format, by its name
    stream: TextIO | None = None,
) -> None:
    """Show codex-turn's logs: events at ``level`` and up, one line each, on ``stream``.

    ``format="json"``: one JSON object per line (``timestamp``, ``level``, ``logger``,
    ``event`` and the event's structured fields; a field named like one of those four keeps
    its value as ``field_<name>``, never replacing them); ``"console"``: structlog's
    human-readable rendering (colours only on a terminal). ``level``: a name (``"DEBUG"``,
    ``"info"`` ...) or a number (``logging.WARNING``). ``stream`` defaults to ``sys.stderr``,
    so a host's stdout stays its own.

    It touches only the standard-library ``codex_turn`` logger (its level, and one handler,
    replaced by a second call): never structlog's global configuration nor the root logger.
    Records still propagate to the root logger, so a host with handlers of its own sees them
    there as well. Every emitted event is scrubbed (secrets, registered sensitive values,
    credential-named fields) before it reaches any handler.
    """
    if isinstance(level, str):
        number = logging.getLevelNamesMapping().get(level.upper())
        if number is None:
            raise ValueError(f"unknown log level {level!r}")
    else:
        number = level
    renderer: Processor
    target = sys.stderr if stream is None else stream
    if format == "json":
        renderer = structlog.processors.JSONRenderer()
    elif format == "console":
        isatty = getattr(target, "isatty", None)
        colors = bool(isatty()) if callable(isatty) else False
        renderer = structlog.dev.ConsoleRenderer(colors=colors)
    else:
        raise ValueError(f"unknown log format {format!r} (expected 'json' or 'console')")
    handler = _LibraryHandler(target)
    handler.setFormatter(_LineFormatter(renderer))
    library = logging.getLogger(_ROOT_LOGGER)
    for previous in [h for h in library.handlers if isinstance(h, _LibraryHandler)]:
        library.removeHandler(previous)
        previous.close()
    library.addHandler(handler)
    library.setLevel(number)
