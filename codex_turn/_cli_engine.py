"""``codex-turn engine ACTION SESSION_FILE``: an operator's action on the session's engine.

The engine's own ``control`` (:mod:`codex_turn.harness.engine.host`): ``status`` (read-only
facts), ``doctor`` (the engine's check; ``--repair`` fixes), ``rotate`` (the session's
conversation archived, the next turn starts a new one). The engine is chosen as ``inspect``
and ``compact`` choose it (``--engine``; by default the reference engine only when its store
is next to the session: without the flag no store is created; ``--engine sqlite`` opens, or
creates, the store next to the session). An action the engine does not declare
is a usage error (exit 2) that lists the ones it does; a result that is not ok exits 1.
Output is the engine's one-line summary (``--json``: the whole result), never message text.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import IO

from codex_turn._cli_support import (
    EXIT_NOT_OK,
    EXIT_OK,
    UsageError,
    close_engine,
    dump_json,
    engine_for_command,
    scrubbed,
    session_header,
    session_identity,
)

__all__ = ["add_engine_parser", "engine_command"]


def add_engine_parser(sub: object) -> None:
    from codex_turn.harness.engine.host import CONTROL_ACTIONS

    parser = sub(  # type: ignore[operator]
        "engine",
        "an operator's action on the session's engine: status, doctor, rotate",
        "Ask the session's context engine for one of its control actions: status (facts, "
        "read-only), doctor (its own check; --repair fixes what it can), rotate (archive the "
        "session's conversation: the next turn starts a new one). The engine must declare "
        "the action.",
    )
    parser.add_argument("action", choices=CONTROL_ACTIONS, metavar="ACTION")
    parser.add_argument("session_file", metavar="SESSION_FILE")
    parser.add_argument(
        "--engine",
        metavar="SPEC|sqlite",
        help="default: the reference engine when its store is next to the session",
    )
    parser.add_argument("--session-id", help="default: the transcript's")
    parser.add_argument("--session-key", help="default: the session id")
    parser.add_argument("--repair", action="store_true", help="doctor: repair what it finds")
    parser.add_argument("--json", action="store_true")


def engine_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import anyio

    from codex_turn.harness.engine import ControlRequest, resolve_engine
    from codex_turn.harness.session_lifecycle import engine_control

    session_file = os.fspath(args.session_file)
    header = session_header(session_file, must_exist=False)
    session_id, _ = session_identity(session_file, header, args.session_id)
    engine = engine_for_command(args.engine, session_file, create=False)
    if engine is None:
        raise UsageError(
            f"no engine for {session_file}: no store next to it (name one with --engine)"
        )
    try:
        resolve_engine(engine)
        request = ControlRequest(
            action=args.action,
            session_key=args.session_key or session_id,
            repair=bool(args.repair),
        )
        result = anyio.run(engine_control, engine, request)
    finally:
        close_engine(engine)
    if args.json:
        dump_json(
            {
                "ok": result.ok,
                "action": result.action,
                "summary": result.summary,
                "details": json.loads(json.dumps(result.details, default=str)),
            },
            out,
        )
    else:
        mark = "ok  " if result.ok else "FAIL"
        print(f"{mark}  {result.action}: {scrubbed(result.summary)}", file=out)
    return EXIT_OK if result.ok else EXIT_NOT_OK
