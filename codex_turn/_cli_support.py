"""What every ``codex-turn`` command shares: errors and exit codes, logging, the progress line,
the observed engine, engine resolution, the Codex configuration, turn output.

Errors are mapped ONCE, in :func:`exit_code_for` (called by :func:`codex_turn.cli.main`): a
:class:`~codex_turn.CodexTurnError` becomes one line on stderr and the exit code of the first
class of its MRO listed in :data:`EXIT_CODES`; anything else is a defect (exit 70, traceback
only with ``-v``). Classes are matched by *name*, so an error family another module adds
later gets its code as soon as it exists, without this module importing it.

Live progress. The progress line shows each state of the turn machine as it is entered
(:func:`progress_hooks`: the turn's ``TurnHooks.on_transition`` observer); the full FSM trace
is printed after the turn. :class:`ObservedEngine` records the engine calls for the report.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import io
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, TextIO, cast

import attrs

from codex_turn.errors import CodexTurnError
from codex_turn.fsm import TraceEntry, TurnState
from codex_turn.harness.hooks import TurnHooks

if TYPE_CHECKING:
    from codex_turn.harness.appserver import AppServerConfig
    from codex_turn.harness.turn_api import TurnResult
    from codex_turn.testing import OfflineModel

__all__ = [
    "EXIT_CODES",
    "CliError",
    "EngineCall",
    "InputInvalid",
    "InputNotFound",
    "ObservedEngine",
    "Progress",
    "UsageError",
    "configure_cli_logging",
    "exit_code_for",
    "progress_hooks",
]

# --- errors and exit codes ------------------------------------------------------------------

EXIT_OK: Final = 0
EXIT_NOT_OK: Final = 1  # the command ran; its result is not ok (turn failed, problems found)
EXIT_USAGE: Final = 2
EXIT_NOT_FOUND: Final = 3
EXIT_LOGIN: Final = 4
EXIT_CODEX: Final = 5
EXIT_BUSY: Final = 6
EXIT_ENGINE: Final = 7
EXIT_SOFTWARE: Final = 70  # an unexpected exception: a defect (traceback with -v)
EXIT_INTERRUPTED: Final = 130  # Ctrl-C

#: Error class name -> exit code; the first class of an error's MRO listed here wins.
EXIT_CODES: Final[dict[str, int]] = {
    # 2: the command line is wrong (a flag, a value, an engine spec, turn params).
    "UsageError": EXIT_USAGE,
    "InvalidTurnParams": EXIT_USAGE,
    "EngineLoadError": EXIT_USAGE,
    "EngineContractError": EXIT_USAGE,  # the engine given is not a context engine
    "HostRequirementsUnmet": EXIT_USAGE,  # the engine given needs what this host lacks
    "ControlUnsupported": EXIT_USAGE,  # an action the engine does not offer
    "CodexHomeNotPrivate": EXIT_USAGE,  # --offline --codex-home names a user's home
    # 3: an input is missing or unreadable (the session file, its binding, a trace file).
    "InputNotFound": EXIT_NOT_FOUND,
    "InputInvalid": EXIT_NOT_FOUND,
    "SessionLockTimeout": EXIT_BUSY,
    "SessionError": EXIT_NOT_FOUND,
    "BindingError": EXIT_NOT_FOUND,
    # 4: Codex needs a login (``codex-turn login``) for the configured provider, or a login
    # did not complete.
    "CodexLoginRequired": EXIT_LOGIN,
    "LoginFailed": EXIT_LOGIN,
    # 5: Codex itself: the binary is missing or failed, the app-server closed or timed out
    # (a configuration the caller got wrong is a usage error).
    "InvalidAppServerConfig": EXIT_USAGE,
    "AppServerError": EXIT_CODEX,
    # 6: another turn or compaction holds the session.
    "SessionBusy": EXIT_BUSY,
    # 7: the engine broke its contract (strict mode) or failed.
    "EngineContractViolation": EXIT_ENGINE,
    "EngineError": EXIT_ENGINE,
    # 1: anything else codex-turn refused.
    "CodexTurnError": EXIT_NOT_OK,
}


class CliError(CodexTurnError):
    """An error the command line itself raises."""


class UsageError(CliError, ValueError):
    """A flag or value the command cannot use (exit 2)."""


class InputNotFound(CliError, FileNotFoundError):
    """A file the command reads does not exist or cannot be read (exit 3)."""


class InputInvalid(CliError, ValueError):
    """A file the command reads exists but is not what it must be (a malformed trace file;
    exit 3, as a missing one)."""


def exit_code_for(error: BaseException) -> int:
    """The exit code of ``error`` (see :data:`EXIT_CODES`); 70 for an unexpected one."""
    for cls in type(error).__mro__:
        code = EXIT_CODES.get(cls.__name__)
        if code is not None:
            return code
    return EXIT_SOFTWARE


# --- argparse types: every value checked where it enters -----------------------------------
#
# A value a command cannot use is a usage error (exit 2) at the command line, never an
# exception further in: numbers are finite and bounded (a 400-digit budget, 1e300 seconds),
# text is text (no NUL, no lone surrogate: what a non-UTF-8 argument decodes to), a path is
# one the OS can take (no NUL, no name longer than the file system allows).

#: The largest integer a flag takes: exact as a float, and in JSON (a budget beyond it means
#: nothing; a larger one overflowed a float further in).
MAX_INT: Final = 2**53
#: The longest duration a flag takes, in seconds (about 31 years; a longer one overflows the
#: thread and event-loop timers it reaches).
MAX_SECONDS: Final = 1e9
_NAME_MAX: Final = 255  # bytes of one path component (Linux, macOS)
_PATH_MAX: Final = 4096  # bytes of a whole path


def _seconds(text: str, *, zero: bool) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {_shown(text)}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        need = "must not be negative" if zero else "must be a positive number of seconds"
        raise argparse.ArgumentTypeError(f"{need}: {_shown(text)}")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SECONDS:g} seconds")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a positive number of seconds, at most :data:`MAX_SECONDS`."""
    return _seconds(text, zero=False)


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a number of seconds, zero allowed, at most :data:`MAX_SECONDS`."""
    return _seconds(text, zero=True)


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer from 0 to :data:`MAX_INT`."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {_shown(text)}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {_shown(text)}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INT}")
    return value


def text_arg(text: str) -> str:
    """An argparse ``type``: text, without NUL or a lone surrogate (a byte of the argument
    that is not UTF-8)."""
    import argparse

    if "\0" in text:
        raise argparse.ArgumentTypeError("contains a NUL byte")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not UTF-8 text") from None
    return text


def path_arg(text: str) -> str:
    """An argparse ``type``: a path the OS can take (any bytes but NUL, each name at most
    255 bytes, the whole at most 4096)."""
    import argparse

    if "\0" in text:
        raise argparse.ArgumentTypeError("contains a NUL byte")
    raw = os.fsencode(text)
    if len(raw) > _PATH_MAX or any(len(name) > _NAME_MAX for name in raw.split(b"/")):
        raise argparse.ArgumentTypeError("file name too long")
    return text


def user_path(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded, as the shell would; left as it is
    when there is no such user (pathlib's ``expanduser`` raises then)."""
    return Path(os.path.expanduser(os.fspath(path)))


def output_dir(flag: str, path: str | os.PathLike[str]) -> Path:
    """The directory ``flag`` names for the command's output, created when missing. One that
    cannot be (a file in the way, no permission, a dangling link) is a usage error."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{flag}: not a directory: {directory}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{flag}: cannot create {directory}: {error.strerror}") from None
    return directory


def _shown(text: str, limit: int = 40) -> str:
    """A value quoted in an error message: short (the rest elided), printable."""
    shown = text if len(text) <= limit else text[: limit - 1] + "…"
    return ascii(shown) if not shown.isprintable() else repr(shown)


# --- logging --------------------------------------------------------------------------------


def configure_cli_logging(verbosity: int, log_format: str, stream: IO[str]) -> None:
    """Library logs to ``stream`` (stderr, through the command's :class:`Console`):
    warnings by default, ``-v`` info, ``-vv`` debug, ``-q`` errors only."""
    from codex_turn._log import configure_logging

    level = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(
        max(-1, min(verbosity, 2)), logging.DEBUG
    )
    configure_logging(
        level=level,
        format="json" if log_format == "json" else "console",
        stream=cast(TextIO, stream),
    )


# --- the progress line ----------------------------------------------------------------------


#: The longest line of the command's own on stderr (a 100,000-character path in an error
#: message is cut, after the secrets in it were masked).
MAX_NOTE_CHARS: Final = 1_000


def scrubbed(text: str, limit: int = MAX_NOTE_CHARS) -> str:
    """``text`` as the command may print it: through the logs' scrubber
    (:func:`codex_turn._log.redact_text`: secret-shaped values and credential assignments
    masked), then cut to ``limit`` characters (after the masking, so a cut never splits a
    secret out of its pattern)."""
    from codex_turn._log import redact_text

    text = redact_text(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def stderr_note(
    err: IO[str],
    text: str,
    *,
    json_lines: bool,
    event: str = "note",
    level: str = "info",
    **fields: Any,
) -> None:
    """One line of the command's own on stderr: the text, or with ``--log-format json`` a
    JSON object shaped like the library's log lines (so stderr stays parseable line by line).
    Every text goes through :func:`scrubbed`, as the library's log fields do."""
    text = scrubbed(text)
    if json_lines:
        line = {
            "timestamp": datetime.datetime.now(datetime.UTC)
            .isoformat(timespec="microseconds")
            .replace("+00:00", "Z"),
            "level": level,
            "logger": "codex_turn.cli",
            "event": event,
            "message": text,
            **{k: scrubbed(v) if isinstance(v, str) else v for k, v in fields.items()},
        }
        err.write(json.dumps(line, ensure_ascii=False) + "\n")
    else:
        err.write(text + "\n")
    err.flush()


class Console:
    """The command's stdout and stderr, and the status line (the state being executed) on a
    terminal: whatever else is written (a log line, a warning, a note, the reply streaming
    on stdout) first clears the status line and starts on a line of its own; the status is
    drawn again below it once a line is complete. When stdout and stderr are the same
    terminal, a line one of them left unfinished (a reply still streaming) is ended before
    the other writes. Thread-safe: the library logs from worker threads too."""

    def __init__(self, out: IO[str], err: IO[str]) -> None:
        self._status_on = _isatty(err)
        self._shared = self._status_on and _isatty(out)  # one terminal for both
        self._lock = threading.RLock()
        self._status = ""
        self._shown = False
        self._unfinished: ConsoleStream | None = None  # the stream whose line is open
        self.out = ConsoleStream(self, out)
        self.err = ConsoleStream(self, err)

    @property
    def shows_status(self) -> bool:
        return self._status_on

    def status(self, text: str) -> None:
        """Show ``text`` as the status line (``""``: none)."""
        with self._lock:
            self._status = text
            if not text:
                self._hide()
            elif self._unfinished is None:
                self._draw()

    def line_ended(self) -> None:
        """The terminal's line was ended by someone else (the user's Enter after a prompt)."""
        with self._lock:
            self._unfinished = None

    def _write(self, stream: ConsoleStream, text: str) -> int:
        with self._lock:
            if not text:
                return 0
            self._hide()
            open_line = self._unfinished
            if self._shared and open_line is not None and open_line is not stream:
                open_line.raw.write("\n")
                open_line.raw.flush()
                self._unfinished = None
            written = stream.raw.write(text)
            if stream is self.err or self._shared:
                self._unfinished = None if text.endswith("\n") else stream
            if self._unfinished is None and self._status:
                stream.raw.flush()
                self._draw()
            return written

    def _hide(self) -> None:
        if self._shown:
            self.err.raw.write("\r\x1b[K")
            self.err.raw.flush()
            self._shown = False

    def _draw(self) -> None:
        if self._status_on and self._status:
            width = shutil.get_terminal_size((80, 24)).columns - 1
            self.err.raw.write("\r\x1b[K" + self._status[:width])
            self.err.raw.flush()
            self._shown = True


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (ValueError, OSError):  # closed, or not a file
        return False


class ConsoleStream(io.TextIOBase):
    """stdout or stderr through a :class:`Console` (a text stream like the one it wraps)."""

    def __init__(self, console: Console, raw: IO[str]) -> None:
        super().__init__()
        self.console = console
        self.raw = raw

    def write(self, text: str) -> int:
        return self.console._write(self, text)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return _isatty(self.raw)

    def fileno(self) -> int:
        return self.raw.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw, "encoding", "utf-8")


def console_of(stream: IO[str]) -> Console | None:
    """The :class:`Console` ``stream`` writes through, if any."""
    return stream.console if isinstance(stream, ConsoleStream) else None


class Progress:
    """The state being executed, on stderr: the status line on a terminal (through the
    command's :class:`Console`, so nothing else ever lands on it), plain lines otherwise (a
    log a test or a pipe can read), nothing when quiet. With ``json_lines`` (``--log-format
    json``) each state is a JSON line like the library's log lines, on a terminal too, so
    stderr stays parseable line by line."""

    def __init__(self, stream: IO[str], *, enabled: bool = True, json_lines: bool = False) -> None:
        self._stream = stream
        self._enabled = enabled
        self._json = json_lines
        console = console_of(stream)
        self._console = console if console is not None and console.shows_status else None
        self._tty = enabled and not json_lines and stream.isatty()
        self._label = ""
        self._shown = False

    def label(self, text: str) -> None:
        """What the following states belong to (``turn 2``, ``compaction``)."""
        self._label = text

    def state(self, state: str, detail: str = "") -> None:
        if not self._enabled:
            return
        text = scrubbed(f"[{self._label}] {state}" + (f" ({detail})" if detail else ""))
        if self._json:
            fields = {"label": self._label, "state": state}
            if detail:
                fields["detail"] = detail
            stderr_note(self._stream, text, json_lines=True, event="progress", **fields)
            return
        if self._tty and self._console is not None:
            self._console.status(text)
            self._shown = True
            return
        if self._tty:  # a terminal stream of its own (no console): rewrite the line
            width = shutil.get_terminal_size((80, 24)).columns - 1
            self._stream.write("\r\x1b[K" + text[:width])
            self._shown = True
        else:
            self._stream.write(f"progress: {text}\n")
        self._stream.flush()

    def clear(self) -> None:
        if not (self._tty and self._shown):
            return
        self._shown = False
        if self._console is not None:
            self._console.status("")
            return
        self._stream.write("\r\x1b[K")
        self._stream.flush()


# --- the observed engine and the progress hooks ---------------------------------------------

#: The engine's lifecycle methods that are recorded.
ENGINE_METHODS: Final = frozenset(
    {
        "bootstrap",
        "assemble",
        "after_turn",
        "commit_turn",
        "ingest_batch",
        "ingest",
        "maintain",
        "compact",
    }
)


@attrs.frozen
class EngineCall:
    method: str
    ms: float
    ok: bool


class ObservedEngine:
    """A transparent stand-in for an engine that records each lifecycle call (method, time,
    success) for the turn report. Methods the engine lacks stay absent (capabilities are
    unchanged)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.calls: list[EngineCall] = []

    @property
    def inner(self) -> object:
        return self._inner

    def take_calls(self) -> list[EngineCall]:
        calls, self.calls = self.calls, []
        return calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in ENGINE_METHODS or not callable(value):
            return value

        async def observed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            ok = False
            try:
                result = value(*args, **kwargs)
                if inspect.isawaitable(result):
                    result = await result
                ok = True
                return result
            finally:
                ms = (time.perf_counter() - started) * 1000
                self.calls.append(EngineCall(name, ms, ok))

        return observed


def progress_hooks(progress: Progress) -> TurnHooks:
    """Turn hooks that show each state of the turn machine as it is entered."""

    def on_transition(entry: TraceEntry) -> None:
        state = TurnState[entry.dest].value  # the trace names states by their enum name
        if entry.dest != entry.state:
            progress.state(state)
        else:  # an in-state event (Codex compacting during the turn, say)
            progress.state(state, entry.trigger)

    return TurnHooks(on_transition=on_transition)


# --- engines --------------------------------------------------------------------------------


def engine_for_command(spec: str | None, session_file: str, *, create: bool) -> object | None:
    """The engine a command uses. ``none``: no engine; ``sqlite``: the reference engine next to
    the session; ``module:attr``: loaded relative to the current directory. ``None`` (no
    flag): the reference engine when ``create`` or when its store already exists, else none."""
    from codex_turn.engines import SqliteContextEngine

    if spec is None:
        if create or os.path.exists(SqliteContextEngine.store_next_to(session_file)):
            return SqliteContextEngine.next_to(session_file)
        return None
    if spec == "none":
        return None
    if spec == "sqlite":
        return SqliteContextEngine.next_to(session_file)
    return load_engine_spec(spec, session_file)


def load_engine_spec(spec: str, session_file: str | None = None) -> object:
    """``module:attr``, found on ``sys.path`` or in the current directory (the library's
    :func:`~codex_turn.load_engine`: a class or factory that takes a parameter gets the
    directory of ``session_file``; a bad spec is an ``EngineLoadError``, exit 2)."""
    from codex_turn.harness.engine import load_engine

    where = None if session_file is None else os.path.dirname(os.path.abspath(session_file))
    return load_engine(spec, session_dir=where)


def close_engine(engine: object | None) -> None:
    inner = engine.inner if isinstance(engine, ObservedEngine) else engine
    close = getattr(inner, "close", None)
    if callable(close):
        close()


def engine_label(engine: object | None) -> str:
    if engine is None:
        return "none (plain Codex)"
    from codex_turn.harness.engine import engine_id

    inner = engine.inner if isinstance(engine, ObservedEngine) else engine
    path = getattr(inner, "path", None)
    return engine_id(inner) + (f" (store {path})" if isinstance(path, str) else "")


# --- the Codex configuration ----------------------------------------------------------------


def codex_binary(codex_bin: str | os.PathLike[str] | None = None) -> Path:
    """The Codex binary a command runs: ``--codex-bin`` when given, else the pinned one (the
    ``codex`` extra), else ``codex`` on ``PATH``; checked to be an executable file. Missing:
    one :class:`~codex_turn.harness.appserver.AppServerStartError` (exit 5) saying how to get
    one."""
    from codex_turn.harness.appserver import AppServerStartError, bundled_codex_path
    from codex_turn.harness.appserver.errors import CodexBinaryMissing

    if codex_bin is not None:
        path = user_path(codex_bin)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise AppServerStartError(f"--codex-bin: not an executable file: {path}")
        return path.absolute()
    try:
        path = bundled_codex_path()
    except CodexBinaryMissing as missing:
        found = shutil.which("codex")
        if found is None:
            raise AppServerStartError(
                f"{missing}; or put `codex` on PATH, or give --codex-bin PATH"
            ) from missing
        return Path(found).absolute()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise AppServerStartError(f"the Codex binary is missing or not executable: {path}")
    return path


def add_codex_bin_option(parser: Any) -> None:
    """``--codex-bin PATH``, on every command that starts Codex."""
    parser.add_argument(
        "--codex-bin",
        metavar="PATH",
        help="the Codex binary to run (default: the pinned one of the `codex` extra, else "
        "`codex` on PATH)",
    )


def user_codex_home(codex_home: str | None) -> Path:
    """The user's own Codex home: ``--codex-home`` (which must exist: a typo must not
    become a new, empty home), else ``$CODEX_HOME``, else ``~/.codex``."""
    if codex_home is not None:
        home = user_path(codex_home)
        if not home.is_dir():
            raise InputNotFound(f"--codex-home: no such directory: {home}")
        return home
    return Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")


def codex_version(binary: Path) -> str:
    """What ``binary --version`` says (``codex-cli 0.163.0``). Run with a throwaway
    CODEX_HOME: the binary creates helper links under the home it is given, and looking at
    it must not create the user's ``~/.codex``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="codex-turn-version-") as scratch:
        env = {**os.environ, "CODEX_HOME": scratch}
        try:
            done = subprocess.run(  # noqa: S603 - our own pinned binary, no shell
                [str(binary), "--version"],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=20,
                check=False,
                env=env,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"unknown ({type(error).__name__})"
    said = done.stdout.strip() or done.stderr.strip() or "unknown"
    return said.splitlines()[0]


def version_mismatch(said: str) -> str | None:
    """Why a binary that says ``said`` (``codex-cli 0.164.0``) is not the Codex this library
    speaks to (:data:`~codex_turn.harness.appserver.defaults.CODEX_VERSION`), or ``None``."""
    import re

    from codex_turn.harness.appserver.defaults import CODEX_VERSION

    found = re.search(r"\b(\d+\.\d+\.\d+\S*)", said)
    if found is None:
        return f"its version is unknown; this library speaks Codex {CODEX_VERSION}'s protocol"
    if found.group(1) != CODEX_VERSION:
        return (
            f"version {found.group(1)}, not {CODEX_VERSION}, whose protocol this library "
            f"speaks (pip install 'codex-turn[codex]' pins it)"
        )
    return None


@contextlib.contextmanager
def read_only_home(home: Path) -> Iterator[Path]:
    """A private, temporary CODEX_HOME that sees ``home``'s configuration and credentials
    (links to its ``*.toml`` files, ``auth.json`` and ``.credentials.json``) and nothing
    else: Codex started there reads the user's settings as a turn would, and writes its own
    state (databases, logs, helper links) into the temporary directory, removed afterwards.
    Looking at a home this way changes nothing in it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="codex-turn-home-") as scratch:
        shadow = Path(scratch)
        for entry in sorted(home.iterdir()) if home.is_dir() else ():
            wanted = entry.suffix == ".toml" or entry.name in {"auth.json", ".credentials.json"}
            if wanted and entry.is_file():
                (shadow / entry.name).symlink_to(entry.absolute())
        yield shadow


def login_hint(home: Path | None = None) -> str:
    """How to log in from the command line (the pinned binary is not on ``PATH``)."""
    default = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
    where = "" if home is None or home == default else f" --codex-home {home}"
    return (
        f"run `codex-turn login{where}` (ChatGPT, by a device code) or `codex-turn login"
        f"{where} --with-api-key` (an API key from stdin); with a Codex of your own on PATH, "
        "run `codex login`"
    )


def offline_home_for(session_file: str) -> Path:
    """The private Codex home ``--offline`` uses by default: next to the session, so the
    session's thread binding and the threads it names stay together."""
    return Path(os.path.abspath(session_file)).parent / ".codex-turn-offline"


@contextlib.contextmanager
def codex_config(
    *,
    offline: bool,
    codex_home: str | None,
    session_file: str,
    model: str | None,
    offline_delay: float = 0.0,
    codex_bin: str | None = None,
    model_base_url: str | None = None,
) -> Iterator[tuple[AppServerConfig, OfflineModel | None]]:
    """The app-server configuration of a command: the user's own Codex (``codex_home``, which
    must exist, or ``$CODEX_HOME`` or ``~/.codex``), with ``model_base_url`` a private
    ``codex_home`` configured for that Responses endpoint, or with ``offline`` a private home
    and the local stand-in model (started here, closed on exit)."""
    from codex_turn.harness.appserver import AppServerConfig

    binary = codex_binary(codex_bin)  # a missing binary: one typed error before anything
    if model_base_url is not None:
        assert codex_home is not None  # the command refused the flag without it
        yield (
            AppServerConfig.offline(
                codex_home, model_base_url, model=model or "mock-model", codex_bin=binary
            ),
            None,
        )
        return
    if not offline:
        home = user_codex_home(codex_home)
        yield AppServerConfig.user(home, model=model, codex_bin=binary), None
        return
    from codex_turn.testing import OfflineModel, Reply

    home = Path(codex_home) if codex_home else offline_home_for(session_file)
    with OfflineModel() as stand_in:
        if offline_delay > 0:
            stand_in.script(Reply.echo(delay=offline_delay), times=1_000_000)
        config = AppServerConfig.offline(
            home / "codex-home",
            stand_in.base_url,
            env=stand_in.proxy_env(),
            home=home,
            model=model or "mock-model",
            codex_bin=binary,
        )
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        yield config, stand_in


# --- sessions -------------------------------------------------------------------------------


def session_header(session_file: str, *, must_exist: bool) -> dict[str, Any]:
    """The transcript's header (``{}`` for a session that does not exist yet)."""
    from codex_turn.harness.session import read_session
    from codex_turn.harness.session._writable import check_session_format

    if not os.path.exists(session_file):
        if must_exist:
            raise InputNotFound(f"no such session file: {session_file}")
        directory = os.path.dirname(os.path.abspath(session_file))
        if not os.path.isdir(directory):
            # A typo in the path must not become a new directory tree.
            raise InputNotFound(f"no such directory: {directory} (for {session_file})")
        return {}
    if os.path.isdir(session_file):
        raise InputNotFound(f"not a session file (a directory): {session_file}")
    check_session_format(session_file)  # what the turn's preflight refuses, refused here
    return dict(read_session(session_file).header or {})


def session_identity(
    session_file: str, header: dict[str, Any], session_id: str | None
) -> tuple[str, str]:
    """(session id, workspace): the flag, else the transcript header, else the file name and
    the current directory."""
    from codex_turn.harness.binding import read_binding

    sid = session_id or header.get("id") or Path(session_file).stem
    binding = read_binding(session_file) if os.path.exists(session_file) else None
    cwd = header.get("cwd") if isinstance(header.get("cwd"), str) else None
    workspace = cwd or (binding.cwd if binding is not None and binding.cwd else None)
    return str(sid), workspace or os.getcwd()


# --- turn output ----------------------------------------------------------------------------

REASONS: Final[dict[str, str]] = {
    "missing-thread-binding": "no Codex thread is bound to this session yet",
    "resume-failed": "Codex could not resume the bound thread",
    "no-tools-transient-thread": "this turn has no tools; the tooled thread is kept",
    "context-unavailable-keep-thread": "no engine context this turn; the conversation is kept",
    "dynamic-tools-changed": "the dynamic tools changed (Codex freezes them per thread)",
    "context-engine-policy-changed": "the engine or its policy changed",
    "matching-thread-bootstrap-binding": "the thread already holds this epoch's context",
    "thread-bootstrap-epoch-changed": "the engine's context epoch changed (e.g. compaction)",
    "per-turn-projection-fresh-thread": "per-turn projection: a fresh thread per turn",
    "compatible-thread-binding": "the bound thread is compatible",
}


#: Why a turn whose thread wanted the context got none (the turn's trace says), in order.
FAILED_CONTEXT: Final[tuple[tuple[str, str], ...]] = (
    ("history_read_failed", "the transcript could not be read"),
    ("assemble_failed", "the engine's assemble() failed (see the warning; --strict: exit 7)"),
    ("projection_failed", "projecting the engine's context failed (see the warning)"),
    ("bootstrap_failed", "the engine's bootstrap() failed (see the warning; --strict: exit 7)"),
)


def projection_note(result: TurnResult) -> str:
    decision = result.thread_decision
    if result.projected:
        return "yes: the engine's context was framed into the prompt"
    if decision is None:
        return "no"
    if not decision.project:
        return "no: the thread already carries the conversation"
    triggers = {entry.trigger for entry in result.trace}
    for trigger, why in FAILED_CONTEXT:
        if trigger in triggers:
            return f"no: {why}; Codex got the prompt alone"
    return "no: there was no earlier conversation to project"


def trace_to_json(result: TurnResult) -> list[dict[str, Any]]:
    return [
        {"state": e.state, "trigger": e.trigger, "dest": e.dest, "monotonicNs": e.monotonic_ns}
        for e in result.trace
    ]


def turn_to_json(
    result: TurnResult, calls: Sequence[EngineCall], *, session_file: str
) -> dict[str, Any]:
    decision = result.thread_decision
    usage = result.usage
    return {
        "sessionFile": session_file,
        "outcome": result.outcome.value,
        "assistantText": result.assistant_text,
        "threadId": result.thread_id,
        "turnId": result.turn_id,
        "threadDecision": None
        if decision is None
        else {
            "action": decision.action.value,
            "reason": decision.reason,
            "project": decision.project,
        },
        "projected": result.projected,
        "maintenance": {
            "status": result.maintenance.status,
            "skipReason": result.maintenance.skip_reason,
        },
        "usage": None
        if usage is None
        else {
            "input": usage.input,
            "output": usage.output,
            "cacheRead": usage.cache_read,
            "cacheWrite": usage.cache_write,
            "reasoningOutput": usage.reasoning_output,
        },
        "nativeCompactions": result.native_compactions,
        "promptError": result.prompt_error,
        "mirrorError": result.mirror_error,
        "engineCalls": [{"method": c.method, "ms": round(c.ms, 3), "ok": c.ok} for c in calls],
        "durationsMs": {k: round(v, 3) for k, v in result.durations_ms.items()},
        "trace": trace_to_json(result),
    }


def print_turn(
    out: IO[str],
    title: str,
    result: TurnResult,
    calls: Iterable[EngineCall],
    *,
    timings: bool = True,
    reply: bool = True,
) -> None:
    """The human form of one turn: decision and why, projection, engine calls, timings, reply
    (``reply=False``: shown already, as it streamed)."""
    decision = result.thread_decision
    thread = result.thread_id or "-"
    print(f"\n{title}: outcome={result.outcome.value} thread={thread}", file=out)
    if decision is not None:
        why = REASONS.get(decision.reason, "")
        print(
            f"  thread decision: {decision.action.value} ({decision.reason})"
            + (f": {why}" if why else ""),
            file=out,
        )
    print(f"  context projected: {result.projected} ({projection_note(result)})", file=out)
    listed = [f"{c.method} {c.ms:.1f} ms" + ("" if c.ok else " FAILED") for c in calls]
    print(f"  engine calls: {', '.join(listed) if listed else 'none'}", file=out)
    maintenance = result.maintenance
    print(
        f"  maintenance: {maintenance.status}"
        + (f" ({maintenance.skip_reason})" if maintenance.skip_reason else ""),
        file=out,
    )
    if timings:
        path = " -> ".join(_path(result))
        print(f"  path: {path}", file=out)
        spent = result.durations_ms
        rows = [f"{state.lower()} {ms:.1f}" for state, ms in spent.items() if ms >= 0.05]
        print(f"  time per state (ms): {', '.join(rows)}", file=out)
    for problem in (result.prompt_error, result.mirror_error):
        if problem:
            print(f"  problem: {scrubbed(problem)}", file=out)
    if reply:
        print(f"  assistant: {result.assistant_text or '(no reply)'}", file=out)


def _path(result: TurnResult) -> list[str]:
    if not result.trace:
        return []
    states = [result.trace[0].state.lower()]
    for entry in result.trace:
        if entry.dest.lower() != states[-1]:
            states.append(entry.dest.lower())
    return states


def dump_json(data: object, out: IO[str]) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False), file=out)
