"""The ``codex-turn`` command: ``diagrams``, ``demo`` and ``compact``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from codex_turn.fsm.diagrams import main as diagrams_main
from codex_turn.harness.appserver.defaults import INTERRUPT_GRACE_S, NATIVE_COMPACTION_TIMEOUT_S

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["diagrams"]:  # one implementation: the diagrams module's own command
        return diagrams_main(argv[1:])
    parser = argparse.ArgumentParser(prog="codex-turn")
    commands = parser.add_subparsers(dest="command", required=True)
    diagrams = commands.add_parser(
        "diagrams", help="render the state diagrams from the tables", add_help=False
    )
    diagrams.add_argument("args", nargs=argparse.REMAINDER)
    commands.add_parser(
        "demo", help="three turns through the real Codex app-server and a local stand-in model"
    )
    _add_compact_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "compact":
        return _compact(parser, args)
    from codex_turn.demo import run_demo  # imports the app-server stack only when needed

    return run_demo()


# --- compact --------------------------------------------------------------------------------


def _add_compact_parser(commands: Any) -> None:
    compact = commands.add_parser(
        "compact",
        help="compact one session (owning engine first, then Codex native); print JSON",
        description=(
            "Compact SESSION_FILE: an engine that owns compaction compacts first, then Codex "
            "compacts the bound thread natively (only Codex natively without such an engine). "
            "Prints the result as camelCase JSON; exit status 0 when ok, 1 when not, 2 on "
            "usage errors. Codex runs from your own CODEX_HOME and config unless "
            "--model-base-url points a private --codex-home at another Responses endpoint."
        ),
    )
    compact.add_argument("session_file", metavar="SESSION_FILE", help="the session transcript")
    compact.add_argument(
        "--engine",
        metavar="MODULE:ATTR|none",
        help="the context engine: a spec to load, or 'none' for Codex native only (default: "
        "the reference SqliteContextEngine when its store context.sqlite is next to the "
        "session, else none)",
    )
    compact.add_argument("--session-id", help="default: the transcript header's id")
    compact.add_argument("--session-key")
    compact.add_argument("--workspace", help="default: the transcript's cwd, else the current dir")
    compact.add_argument("--token-budget", type=int)
    compact.add_argument("--current-token-count", type=int)
    compact.add_argument("--instructions", help="custom compaction instructions for the engine")
    compact.add_argument("--auth-profile", help="must match the thread binding's auth profile")
    compact.add_argument(
        "--developer-instructions", help="re-sent when Codex must resume the thread first"
    )
    compact.add_argument("--trigger", choices=("manual", "budget"), default="manual")
    compact.add_argument("--provider", help="the provider named in the engine's runtime context")
    compact.add_argument(
        "--timeout",
        type=float,
        default=NATIVE_COMPACTION_TIMEOUT_S,
        help="native compaction bound (s)",
    )
    compact.add_argument(
        "--interrupt-grace",
        type=float,
        default=INTERRUPT_GRACE_S,
        help="seconds an interrupted compaction may take before Codex is restarted",
    )
    compact.add_argument("--codex-home", help="default: $CODEX_HOME, else ~/.codex")
    compact.add_argument(
        "--model-base-url",
        help="write a private, offline-safe config.toml into --codex-home using this "
        "Responses API base URL (e.g. the offline model)",
    )
    compact.add_argument("--model", help="the Codex model (default: your config's)")


def _compact(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import anyio
    import structlog

    from codex_turn.harness.appserver import AppServer, AppServerConfig
    from codex_turn.harness.binding import read_binding
    from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session
    from codex_turn.harness.engine import EngineLoadError, load_engine, to_json
    from codex_turn.harness.session import SessionError, read_session

    if args.model_base_url and not args.codex_home:
        parser.error("--model-base-url needs --codex-home (a private home gets a new config)")
    session_file = os.fspath(args.session_file)
    engine: object | None = None
    if args.engine and args.engine != "none":
        try:
            engine = load_engine(args.engine)
        except EngineLoadError as err:
            print(f"codex-turn compact: {err}", file=sys.stderr)
            return 2
    header: dict[str, Any] = {}
    try:
        header = dict(read_session(session_file).header or {})
    except SessionError as err:
        print(f"codex-turn compact: {err}", file=sys.stderr)
        return 2
    binding = read_binding(session_file)
    session_id = args.session_id or header.get("id") or Path(session_file).stem
    if args.engine is None:
        from codex_turn.engines import SqliteContextEngine

        # The embedded default, where its memory is: a store next to the session. Without
        # one, no engine ever held this session, and Codex compacts natively.
        if os.path.exists(SqliteContextEngine.store_next_to(session_file)):
            engine = SqliteContextEngine.next_to(session_file)
    workspace = (
        args.workspace
        or (header.get("cwd") if isinstance(header.get("cwd"), str) else None)
        or (binding.cwd if binding is not None and binding.cwd else None)
        or os.getcwd()
    )
    if args.model_base_url:
        config = AppServerConfig.offline(
            args.codex_home, args.model_base_url, model=args.model or "mock-model"
        )
    else:
        config = AppServerConfig.user(args.codex_home, model=args.model)
    params = CompactSessionParams(
        session_id=str(session_id),
        session_file=session_file,
        workspace_dir=workspace,
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
    )

    @contextlib.asynccontextmanager
    async def app_server(auth_profile_id: str | None) -> AsyncIterator[AppServer]:
        # Codex keeps its own credentials per CODEX_HOME; the profile was checked already.
        async with AppServer.start(config) as server:
            yield server

    async def run() -> Any:
        return await compact_codex_session(
            params, app_server=app_server, engine=engine, trigger=args.trigger
        )

    # stdout carries the JSON result only: logs go to stderr while the command runs.
    previous = structlog.get_config()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    try:
        result = anyio.run(run)
    finally:
        structlog.configure(**previous)
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    print(json.dumps(to_json(result), indent=2, ensure_ascii=False))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
