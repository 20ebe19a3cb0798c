"""One turn of a session, from a plain script: :func:`run_turn`, a blocking call.

    from codex_turn import run_turn

    result = run_turn("notes/s-1.jsonl", "What did we decide on Friday?")
    print(result.assistant_text)

Everything :func:`~codex_turn.run_codex_turn` needs is chosen for a script: the reference
engine (:class:`~codex_turn.engines.SqliteContextEngine`, its store ``context.sqlite`` next to
the session), the user's own Codex (``AppServerConfig.user()``: ``$CODEX_HOME`` or
``~/.codex``, used as it is; a missing login is :class:`~codex_turn.CodexLoginRequired` at
once, ``codex-turn login`` gives one), the session's id from its file name and the current
directory as the workspace. Each call starts Codex, runs the turn and stops Codex again (about
a second of start-up): the session, its thread and the engine's memory live on disk, so the
next call goes on with the same conversation. A program that runs many turns, or runs inside
an event loop (this call starts its own), uses ``run_codex_turn`` with a started
:class:`~codex_turn.AppServer` instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio

from codex_turn.harness.appserver import AppServer, AppServerConfig
from codex_turn.harness.turn_api import TurnParams, TurnResult

__all__ = ["run_turn"]


def run_turn(
    session_file: str | os.PathLike[str],
    prompt: str,
    *,
    engine: object | str | None = "sqlite",
    config: AppServerConfig | None = None,
    **params: Any,
) -> TurnResult:
    """Run one turn of ``session_file`` (created when missing) and return its result.

    ``engine``: ``"sqlite"`` (the reference engine next to the session; closed afterwards),
    ``None`` (plain Codex), an engine object (used as it is, not closed) or a spec
    ``"package.module:attr"`` (a factory in it that takes a parameter gets the session's
    directory). ``config``: the app-server's (default: the user's own Codex,
    ``AppServerConfig.user()``). ``params``: any other :class:`~codex_turn.TurnParams` field
    (``model``, ``reasoning_effort``, ``sandbox``, ``session_id``, ``workspace_dir``, ...).
    Raises what ``run_codex_turn`` raises (``InvalidTurnParams``, ``CodexLoginRequired``,
    ``AppServerError``, ...); a turn Codex did not complete is a result, not an error."""
    path = Path(session_file)
    params.setdefault("session_id", path.stem)
    params.setdefault("workspace_dir", os.getcwd())
    turn = TurnParams(session_file=path, prompt=prompt, **params)  # refused before anything
    owned = engine == "sqlite"
    if owned:
        from codex_turn.engines import SqliteContextEngine

        engine = SqliteContextEngine.next_to(path)
    elif isinstance(engine, str):
        from codex_turn.harness.engine import load_engine

        engine = load_engine(engine, session_dir=path.absolute().parent)
    server_config = config if config is not None else AppServerConfig.user()

    async def run() -> TurnResult:
        from codex_turn.harness.turn.orchestrator import run_codex_turn

        async with AppServer.start(server_config) as server:
            return await run_codex_turn(turn, app_server=server, engine=engine)

    try:
        return anyio.run(run)
    finally:
        close = getattr(engine, "close", None) if owned else None
        if callable(close):
            close()
