"""The ``codex-turn`` command: every command of the project in one place.

    codex-turn demo                      an offline multi-turn conversation, compaction included
    codex-turn run SESSION --prompt TEXT one turn (your Codex, or --offline)
    codex-turn chat SESSION              turns from stdin; Ctrl-C interrupts a turn, twice leaves
    codex-turn inspect SESSION           what the next turn would see, decide and send
    codex-turn inspect --trace FILE      the path a recorded turn (run --json) took
    codex-turn doctor [SESSION]          binary, Codex home and login, engine store, lock
    codex-turn compact SESSION           engine compaction, then Codex native; JSON
    codex-turn engine ACTION SESSION     the engine's control: status, doctor, rotate
    codex-turn login [--with-api-key]    log Codex in (the pinned binary's login); logout
    codex-turn diagrams [--out DIR]      render the state diagrams from the tables
    codex-turn threads list|branch|archive   a Codex home's native threads (supervision)
    codex-turn diagnostics [SESSION]     feedback/upload of a session's thread, on approval

Every command takes ``-v``/``-q`` and ``--log-format``; ``--json`` where the output is data.
Errors are mapped once, in :func:`main` (see :data:`codex_turn._cli_support.EXIT_CODES`): a
codex-turn error is one line on stderr and its exit code; anything else is a defect (exit 70,
traceback with ``-v``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from codex_turn._cli_support import (
    EXIT_INTERRUPTED,
    EXIT_NOT_OK,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_USAGE,
    Console,
    UsageError,
    add_codex_bin_option,
    close_engine,
    configure_cli_logging,
    engine_for_command,
    exit_code_for,
    login_hint,
    non_negative_float,
    non_negative_int,
    output_dir,
    path_arg,
    positive_float,
    scrubbed,
    session_header,
    session_identity,
    stderr_note,
    text_arg,
)

if TYPE_CHECKING:
    from codex_turn.harness.compaction import CompactionRun

__all__ = ["main"]

Command = Callable[[argparse.Namespace, IO[str], IO[str]], int]

EPILOG = """exit status: 0 ok; 1 the command ran but its result is not ok (a turn that did not
complete, a compaction that failed, doctor problems); 2 usage (a flag, a value, an engine
spec); 3 an input is missing, unreadable or malformed (a session file that is not a
transcript, a trace file, the session's directory, --codex-home); 4 Codex needs a login
(`codex-turn login`), or a login failed; 5 Codex failed (binary missing, app-server start,
crash, timeout); 6 the session is busy (another turn, compaction or lock holder); 7 the
engine broke its contract (--strict); 70 an unexpected error (a defect; -v shows the
traceback); 130 Ctrl-C."""


def _version() -> str:
    from codex_turn import __version__

    return __version__


class _ParserExit(SystemExit):
    """argparse's exit (a usage error, ``--help``, ``--version``), its message not yet
    printed: :func:`main` prints it as every other line of the command's own (scrubbed; a
    JSON line under ``--log-format json``)."""

    def __init__(self, status: int, message: str | None) -> None:
        super().__init__(status)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (``codex-turn run: error: ...``), exit 2, printed
    by :func:`main`."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)")

    def exit(self, status: int = 0, message: str | None = None) -> Any:
        raise _ParserExit(status, message)


def _common(parser: argparse.ArgumentParser) -> None:
    """-v/-q/--log-format on every (sub)command; SUPPRESS so either position works."""
    group = parser.add_argument_group("output")
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="more detail: library logs at info (-vv debug), tracebacks of unexpected errors",
    )
    group.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress line; library errors only",
    )
    group.add_argument(
        "--log-format",
        choices=("console", "json"),
        default=argparse.SUPPRESS,
        help="library logs on stderr as text (default) or JSON lines",
    )


def build_parser() -> argparse.ArgumentParser:
    from codex_turn._cli_turns import add_turn_options

    parser = _Parser(
        prog="codex-turn",
        description="Run each turn of a Codex agent session as an explicit state machine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"codex-turn {_version()}")
    _common(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def sub(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        child: argparse.ArgumentParser = commands.add_parser(
            name,
            help=help,
            description=description or help,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _common(child)
        return child

    demo = sub(
        "demo",
        "an offline conversation through the real Codex app-server, with a compaction",
        "Four turns and a compaction of one session, through the real codex app-server and "
        "a local stand-in model (nothing leaves the machine), with the reference engine. "
        "Prints each turn's thread decision, projection, engine calls and timings.",
    )
    demo.add_argument(
        "--out",
        metavar="DIR",
        help="where to keep the transcript, store and diagrams "
        "(default: a new directory under the system's temp dir)",
    )
    demo.add_argument("--json", action="store_true", help="print the turns as JSON")
    add_codex_bin_option(demo)

    run = sub(
        "run",
        "run one turn of a session",
        "Run one turn of SESSION_FILE (created when missing) against your own Codex "
        "configuration, or with --offline against the local stand-in model.",
    )
    add_turn_options(run)
    run.add_argument("--prompt", required=True, help="the user's message")
    run.add_argument("--json", action="store_true", help="print the result (and trace) as JSON")

    chat = sub(
        "chat",
        "an interactive loop of turns (prompts from stdin)",
        "Each line of stdin is one turn of SESSION_FILE. Ctrl-C interrupts the running turn "
        "(Codex is interrupted; the turn is still saved and the engine told); Ctrl-C at the "
        "prompt, or twice, leaves. /quit or end of input leaves.",
    )
    add_turn_options(chat)

    inspect = sub(
        "inspect",
        "what the next turn would see, decide and send (or a recorded trace's path)",
        "Without running a turn: the messages an engine would see, the thread binding, the "
        "thread decision the next turn would take and the projection Codex would receive. "
        "The engine bootstraps and assembles as the next turn would (so the reference "
        "engine's store may catch up with the transcript); its store is used only when it "
        "exists: inspect never creates one. "
        "With --trace FILE (the output of `run --json`): the path that turn took through "
        "the turn machine, each step checked against the table.",
    )
    inspect.add_argument("session_file", metavar="SESSION_FILE", nargs="?")
    inspect.add_argument(
        "--engine",
        metavar="SPEC|sqlite|none",
        help="default: the reference engine when its store is next to the session, else none "
        "('sqlite' too uses only an existing store: inspect creates none)",
    )
    inspect.add_argument("--prompt", default="(your next prompt)", help="the next prompt")
    inspect.add_argument("--session-id")
    inspect.add_argument("--session-key")
    inspect.add_argument("--token-budget", type=non_negative_int, metavar="TOKENS")
    inspect.add_argument("--full", action="store_true", help="do not shorten long texts")
    inspect.add_argument("--trace", metavar="FILE", help="a `run --json` output to replay")
    inspect.add_argument("--out", metavar="DIR", help="with --trace: write turn-path.mmd here")
    inspect.add_argument("--json", action="store_true")

    doctor = sub(
        "doctor",
        "check the Codex binary, home and login, the engine store and the session lock",
    )
    doctor.add_argument("session_file", metavar="SESSION_FILE", nargs="?")
    where = doctor.add_mutually_exclusive_group()
    where.add_argument("--codex-home", metavar="DIR", help="default: $CODEX_HOME, else ~/.codex")
    where.add_argument(
        "--offline", action="store_true", help="check the private home `--offline` uses"
    )
    doctor.add_argument("--repair", action="store_true", help="repair the engine store")
    add_codex_bin_option(doctor)
    doctor.add_argument("--json", action="store_true")

    _add_compact_parser(sub)
    from codex_turn._cli_engine import add_engine_parser

    add_engine_parser(sub)
    from codex_turn._cli_login import add_login_parsers

    add_login_parsers(sub)
    from codex_turn._cli_threads import add_supervision_parsers

    add_supervision_parsers(sub, _common)

    worker = sub(
        "worker",
        "run queued turns (codex_turn.scale, extra `scale`) until SIGTERM, then drain",
        "Run the turns queued in the DBOS system database URL (sqlite:///FILE or "
        "postgresql://...; codex_turn.scale.TurnQueue submits them), one app-server per "
        "worker. SIGTERM or Ctrl-C: no new turn is taken, the turns in flight finish (at "
        "most --drain-timeout s), exit 0; a second signal leaves at once.",
    )
    worker.add_argument("--db", required=True, metavar="URL", help="the DBOS system database")
    worker.add_argument("--codex-home", help="default: $CODEX_HOME, else ~/.codex")
    worker.add_argument(
        "--offline", action="store_true", help="a private home next to the database, local model"
    )
    worker.add_argument("--offline-delay", type=non_negative_float, default=0.0, metavar="S")
    worker.add_argument("--engine", metavar="SPEC|sqlite|none", help="default: sqlite")
    worker.add_argument("--model", help="the Codex model (default: your config's)")
    worker.add_argument("--executor-id", default="local", help="this worker's name in the db")
    worker.add_argument("--drain-timeout", type=non_negative_float, default=60.0, metavar="S")
    add_codex_bin_option(worker)

    diagrams = sub("diagrams", "render the state diagrams from the tables")
    diagrams.add_argument(
        "--out",
        metavar="DIR",
        help="default: the diagrams/ directory of the source checkout; required otherwise",
    )
    diagrams.add_argument("--no-svg", action="store_true", help="write only the Mermaid sources")
    diagrams.add_argument("directory", nargs="?", help=argparse.SUPPRESS)  # the old form
    _check_values(parser)
    return parser


#: The flags (and positionals) that name a file or directory, by ``dest``: checked as paths
#: (:func:`~codex_turn._cli_support.path_arg`); every other value given as text is checked as
#: text (:func:`~codex_turn._cli_support.text_arg`).
PATH_VALUES: frozenset[str] = frozenset(
    {
        "session_file",
        "codex_home",
        "codex_bin",
        "workspace",
        "out",
        "trace",
        "directory",
        "cwd",
        "session",
    }
)


def _check_values(parser: argparse.ArgumentParser) -> None:
    """Give every value that has no type of its own (numbers and choices have theirs) the
    path or the text check, in every command: a NUL, a lone surrogate or a name the OS
    refuses is a usage error where it enters, never an exception further in."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _check_values(child)
        elif (
            isinstance(action, argparse._StoreAction)
            and action.type is None
            and action.choices is None
            and action.nargs in (None, "?")
        ):
            action.type = path_arg if action.dest in PATH_VALUES else text_arg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _tolerant_streams()
    console = Console(sys.stdout, sys.stderr)  # the status line never shares a line
    out, err = cast(IO[str], console.out), cast(IO[str], console.err)
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            # Point at the help of the command the flag was given to, not the top level's.
            _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    except _ParserExit as exit_:
        if exit_.message:
            stderr_note(
                err,
                exit_.message.strip(),
                json_lines=_json_lines_asked(argv),
                event="usage" if exit_.code == EXIT_USAGE else "exit",
                level="error",
                exitCode=exit_.code,
            )
        raise SystemExit(exit_.code) from None  # as argparse itself exits (--help, usage)
    args.verbose = getattr(args, "verbose", 0) or 0
    args.quiet = bool(getattr(args, "quiet", False))
    args.log_format = getattr(args, "log_format", "console")
    json_lines = args.log_format == "json"
    configure_cli_logging(-1 if args.quiet else args.verbose, args.log_format, err)
    command: Command = COMMANDS[args.command]
    try:
        return command(args, out, err)
    except KeyboardInterrupt:
        stderr_note(
            err,
            f"codex-turn {args.command}: interrupted",
            json_lines=json_lines,
            event="interrupted",
        )
        return EXIT_INTERRUPTED
    except BaseException as error:
        from codex_turn.errors import CodexTurnError

        if isinstance(error, SystemExit | GeneratorExit):
            raise
        error = _unwrap(error)
        expected = isinstance(error, CodexTurnError)
        code = exit_code_for(error) if expected else EXIT_SOFTWARE
        text = cli_message(error)
        if not expected:
            hint = "" if args.verbose else " (-v shows the traceback)"
            text = f"unexpected error: {type(error).__name__}: {text}{hint}"
        stderr_note(
            err,
            f"codex-turn {args.command}: {text}",
            json_lines=json_lines,
            event="error",
            level="error",
            error=type(error).__name__,
            exitCode=code,
        )
        if args.verbose > (1 if expected else 0):
            _print_traceback(error, err)
        return code


def _tolerant_streams() -> None:
    """Text that cannot be encoded (a lone surrogate: a non-UTF-8 byte of an argument or a
    file name) is printed escaped, never a UnicodeEncodeError in the middle of the output."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if callable(reconfigure):
            # A stream that cannot change (closed, replaced) is left as it is.
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="backslashreplace")


def _json_lines_asked(argv: list[str]) -> bool:
    """Whether ``argv`` asks for ``--log-format json`` (read before argparse, whose own
    errors must be JSON lines then too; the last one given wins, as for argparse)."""
    wanted = None
    for index, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if len(name) < len("--log") or not "--log-format".startswith(name):
            continue
        if not sep:
            value = argv[index + 1] if index + 1 < len(argv) else ""
        wanted = value
    return wanted == "json"


def _print_traceback(error: BaseException, err: IO[str]) -> None:
    """The traceback (-v), each line through the same scrubber as every other line."""
    for chunk in traceback.format_exception(error):
        for line in chunk.rstrip("\n").split("\n"):
            err.write(scrubbed(line) + "\n")
    err.flush()


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            child = action.choices.get(command)
            if isinstance(child, argparse.ArgumentParser):
                return child
    return parser


def _unwrap(error: BaseException) -> BaseException:
    """The one error inside task-group exception groups."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def cli_message(error: BaseException) -> str:
    """What the command line says of ``error``: its message on one line, except where the
    library's advice does not fit a command-line user (the pinned binary, which the library's
    login advice names as ``codex``, is not on PATH: ``codex-turn login`` runs it)."""
    from codex_turn.harness.appserver.errors import CodexLoginRequired

    if isinstance(error, CodexLoginRequired):
        said = f" (Codex said: {error.codex_said})" if error.codex_said else ""
        return (
            f"Codex needs an OpenAI login and {error.codex_home} has none{said}: "
            f"{login_hint(error.codex_home)}; or configure a model provider that needs none"
        )
    return _one_line(error)


# --- demo -----------------------------------------------------------------------------------


def _demo(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn.demo import run_demo

    return run_demo(
        out_dir=Path(args.out) if args.out else None,
        out=out,
        err=err,
        progress=not args.quiet,
        as_json=args.json,
        codex_bin=args.codex_bin,
        json_lines=args.log_format == "json",
    )


def _run(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_turns import run_command

    return run_command(args, out, err)


def _chat(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_turns import chat_command

    return chat_command(args, out, err)


def _inspect(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_inspect import inspect_command

    return inspect_command(args, out, err)


def _doctor(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_inspect import doctor_command

    return doctor_command(args, out, err)


def _engine(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_engine import engine_command

    return engine_command(args, out, err)


def _worker(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    try:
        from codex_turn.scale._cli import worker_command
    except ImportError as error:
        raise UsageError(str(error)) from error  # the `scale` extra is not installed
    return worker_command(args, out, err)


# --- diagrams -------------------------------------------------------------------------------


def source_diagrams_dir() -> Path | None:
    """``diagrams/`` of the source checkout this package runs from (an editable install)."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "diagrams").is_dir():
        return root / "diagrams"
    return None


def _diagrams(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn.diagrams import write_diagrams

    if args.out and args.directory:
        raise UsageError("give the directory once, with --out")
    target = args.out or args.directory
    directory = Path(target) if target else source_diagrams_dir()
    if directory is None:
        raise UsageError("--out DIR is required (this is not a source checkout)")
    try:
        written = write_diagrams(output_dir("--out", directory), svg=not args.no_svg)
    except OSError as error:
        raise UsageError(f"--out: cannot write into {directory}: {error.strerror}") from None
    for path in written:
        print(path, file=out)
    return EXIT_OK


# --- compact --------------------------------------------------------------------------------


def _add_compact_parser(sub: Callable[..., argparse.ArgumentParser]) -> None:
    from codex_turn.harness.appserver.defaults import INTERRUPT_GRACE_S, NATIVE_COMPACTION_TIMEOUT_S

    compact = sub(
        "compact",
        "compact one session (owning engine first, then Codex native); print JSON",
        "Compact SESSION_FILE: an engine that owns compaction compacts first, then Codex "
        "compacts the bound thread natively (only Codex natively without such an engine). "
        "Prints the result as camelCase JSON: each part's outcome in `parts`, and at the top "
        "what happened to the whole request (ok when every part that ran succeeded, compacted "
        "when any part compacted); exit status 0 when ok, 1 when not. Codex runs "
        "from your own Codex home unless --offline (the private home `run --offline` uses, "
        "and the local stand-in model) or --model-base-url (a private --codex-home pointed "
        "at another Responses endpoint).",
    )
    compact.add_argument("session_file", metavar="SESSION_FILE", help="the session transcript")
    compact.add_argument(
        "--engine",
        metavar="SPEC|sqlite|none",
        help="the context engine: 'sqlite', 'none' (Codex native only) or MODULE:ATTR (default: "
        "the reference engine when its store context.sqlite is next to the session, else none)",
    )
    compact.add_argument("--session-id", help="default: the transcript header's id")
    compact.add_argument("--session-key")
    compact.add_argument("--workspace", help="default: the transcript's cwd, else the current dir")
    compact.add_argument("--token-budget", type=non_negative_int, metavar="TOKENS")
    compact.add_argument("--current-token-count", type=non_negative_int, metavar="TOKENS")
    compact.add_argument("--instructions", help="custom compaction instructions for the engine")
    compact.add_argument("--auth-profile", help="must match the thread binding's auth profile")
    compact.add_argument(
        "--developer-instructions", help="re-sent when Codex must resume the thread first"
    )
    compact.add_argument("--trigger", choices=("manual", "budget"), default="manual")
    compact.add_argument("--provider", help="the provider named in the engine's runtime context")
    compact.add_argument(
        "--timeout",
        type=positive_float,
        default=NATIVE_COMPACTION_TIMEOUT_S,
        metavar="S",
        help="native compaction bound (s)",
    )
    compact.add_argument(
        "--interrupt-grace",
        type=non_negative_float,
        default=INTERRUPT_GRACE_S,
        metavar="S",
        help="seconds an interrupted compaction may take before Codex is restarted",
    )
    where = compact.add_mutually_exclusive_group()
    where.add_argument("--offline", action="store_true", help="as `run --offline`")
    where.add_argument(
        "--model-base-url",
        help="write a private, offline-safe config.toml into --codex-home (a new or empty "
        "directory, or one prepared this way before) using this Responses API base URL",
    )
    compact.add_argument("--codex-home", help="default: $CODEX_HOME, else ~/.codex")
    compact.add_argument("--model", help="the Codex model (default: your config's)")
    compact.add_argument(
        "--strict",
        action="store_true",
        help="engine contract violations are errors (exit 7), not logged fallbacks",
    )
    compact.add_argument(
        "--json", action="store_true", help="print the result as JSON (always the case)"
    )
    add_codex_bin_option(compact)


def _compact(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import contextlib
    from collections.abc import AsyncIterator

    import anyio

    from codex_turn._cli_support import codex_binary, codex_config, dump_json, user_codex_home
    from codex_turn.harness.appserver import AppServer, AppServerStartError
    from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session_traced

    if args.model_base_url and not args.codex_home:
        raise UsageError("--model-base-url needs --codex-home (a private home gets a new config)")
    session_file = os.fspath(args.session_file)
    header = session_header(session_file, must_exist=True)
    session_id, workspace = session_identity(session_file, header, args.session_id)
    params = CompactSessionParams(
        session_id=session_id,
        session_file=session_file,
        workspace_dir=args.workspace or workspace,
        session_key=args.session_key,
        token_budget=args.token_budget,
        current_token_count=args.current_token_count,
        custom_instructions=args.instructions,
        auth_profile_id=args.auth_profile,
        developer_instructions=args.developer_instructions,
        native_timeout=args.timeout,
        interrupt_grace=args.interrupt_grace,
        provider=args.provider,
        model=args.model,
        strict=args.strict,
    )
    if args.codex_home and not args.offline and not args.model_base_url:
        user_codex_home(args.codex_home)  # a typo is refused before the engine compacts
    engine = engine_for_command(args.engine, session_file, create=False)
    #: Codex could not be run when native compaction needed it (a missing binary): the
    #: compaction reports it, and the command fails with it (exit 5) even when the engine's
    #: part succeeded.
    unavailable: list[BaseException] = []

    @contextlib.asynccontextmanager
    async def app_server(auth_profile_id: str | None) -> AsyncIterator[AppServer]:
        # Started only when native compaction really runs (a binding exists).
        try:
            codex_binary(args.codex_bin)
        except AppServerStartError as error:
            unavailable.append(error)
            raise
        with codex_config(
            offline=args.offline,
            codex_home=args.codex_home,
            session_file=session_file,
            model=args.model,
            codex_bin=args.codex_bin,
            model_base_url=args.model_base_url,
        ) as (config, _model):
            async with AppServer.start(config) as server:
                yield server

    async def run() -> CompactionRun:
        return await compact_codex_session_traced(
            params, app_server=app_server, engine=engine, trigger=args.trigger
        )

    try:
        done = anyio.run(run)
    finally:
        close_engine(engine)
    report = compaction_report(done)
    dump_json(report, out)
    if unavailable:
        raise unavailable[0]
    return EXIT_OK if report["ok"] else EXIT_NOT_OK


#: What each step of the compaction machine that ran says of its part: by the trigger it
#: left with, (part, ok, compacted).
PART_OUTCOMES: dict[str, tuple[str, bool, bool]] = {
    "engine_compacted": ("engine", True, True),
    "engine_declined": ("engine", True, False),
    "engine_failed": ("engine", False, False),
    "native_compacted": ("codexNative", True, True),
    "native_skipped": ("codexNative", True, False),
    "native_failed": ("codexNative", False, False),
    "native_timed_out": ("codexNative", False, False),
}


def compaction_report(run: CompactionRun) -> dict[str, Any]:
    """What ``codex-turn compact`` prints: the library's result (OpenClaw's shape, where the
    owning engine's result is primary) with its top saying what happened to the whole
    request: ``ok`` when every part that ran succeeded, ``compacted`` when any part compacted,
    the ``reason`` of the first part that failed; and ``parts``, each part's own outcome
    (``ran`` false: the table did not run it, e.g. no Codex thread to compact natively) and
    the compaction machine's ``path``. With no part run (nothing was asked of anyone), the
    library's result stands alone."""
    from codex_turn.harness.engine import to_json

    result = run.result
    data: dict[str, Any] = to_json(result)
    details = result.result.details if result.result is not None else None
    native = details.get("codexNativeCompaction") if isinstance(details, dict) else None
    outcomes = [PART_OUTCOMES[e.trigger] for e in run.trace if e.trigger in PART_OUTCOMES]
    owns = any(name == "engine" for name, _, _ in outcomes)  # the engine's result is primary
    parts: dict[str, dict[str, Any]] = {
        name: {"ran": False, "ok": None, "compacted": False, "reason": None}
        for name in ("engine", "codexNative")
    }
    for name, ok, compacted in outcomes:
        if name == "codexNative" and owns:
            reason = native.get("reason") if isinstance(native, dict) else None
        else:
            reason = result.reason
        parts[name] = {"ran": True, "ok": ok, "compacted": compacted, "reason": reason}
    ran = [part for part in parts.values() if part["ran"]]
    if not ran:
        return data  # nothing was asked of anyone: the library's result says it all
    failed = [name for name, part in parts.items() if part["ran"] and not part["ok"]]
    data["ok"] = not failed
    data["compacted"] = any(part["compacted"] for part in ran)
    if failed:
        data["reason"] = parts[failed[0]]["reason"] or f"{failed[0]} compaction failed"
    data["parts"] = parts
    data["path"] = list(run.path)
    return data


def _login(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_login import login_command

    return login_command(args, out, err)


def _logout(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_login import logout_command

    return logout_command(args, out, err)


def _threads(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_threads import threads_command

    return threads_command(args, out, err)


def _diagnostics(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn._cli_threads import diagnostics_command

    return diagnostics_command(args, out, err)


COMMANDS: dict[str, Command] = {
    "demo": _demo,
    "run": _run,
    "chat": _chat,
    "inspect": _inspect,
    "doctor": _doctor,
    "compact": _compact,
    "engine": _engine,
    "diagrams": _diagrams,
    "worker": _worker,
    "login": _login,
    "logout": _logout,
    "threads": _threads,
    "diagnostics": _diagnostics,
}

if __name__ == "__main__":
    sys.exit(main())
