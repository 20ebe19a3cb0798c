"""``codex-turn inspect`` (what the next turn would see and decide, and the path a recorded
turn took) and ``codex-turn doctor`` (the binary, the Codex home, the engine store, the lock).

Inspect runs the library's own pre-Codex stages (:data:`codex_turn.harness.turn.orchestrator.
STAGES`) on a real turn context, up to the thread decision, and stops before anything reaches
Codex: the engine sees the messages a turn would hand it, the thread table
(:func:`codex_turn.fsm.thread.decide_thread`, through the build_prompt stage) decides, and the
projection is the one Codex would receive. Two differences from a turn: the transcript's
writability check is skipped (it may repair a torn header) and no hook runs. The engine does
bootstrap and assemble, as the next turn would; the reference engine's store is used only
when it exists, never created (``--engine sqlite`` without one inspects with no engine, and
says so), and read-only: the engine catches up with the transcript in a private in-memory
copy of the store, which is dropped at the end.
Doctor checks the login as a turn does: ``account/read`` on a started app-server of the
user's configuration (:func:`codex_turn.harness.appserver.account.check_login`).

Traces are not persisted by the library: ``run --json`` prints a turn's trace, and ``inspect
--trace FILE`` reads that output back and checks every step against the turn table.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import IO, Any

from codex_turn._cli_support import (
    EXIT_NOT_OK,
    EXIT_OK,
    REASONS,
    InputInvalid,
    InputNotFound,
    UsageError,
    close_engine,
    codex_binary,
    codex_version,
    dump_json,
    engine_for_command,
    engine_label,
    login_hint,
    offline_home_for,
    output_dir,
    read_only_home,
    scrubbed,
    session_header,
    session_identity,
    user_path,
    version_mismatch,
)

__all__ = ["doctor_command", "inspect_command", "read_trace", "trace_steps"]

PREVIEW_CHARS = 2_000
MAX_DETAIL_CHARS = 2_000  # a doctor line


# --- inspect --------------------------------------------------------------------------------


def inspect_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    if args.trace is not None:
        return _inspect_trace(args, out)
    if args.session_file is None:
        raise UsageError("inspect needs SESSION_FILE (or --trace FILE)")
    import anyio

    report = anyio.run(_preview, args)
    if args.json:
        dump_json(report, out)
    else:
        _print_preview(report, out, full=args.full)
    return EXIT_OK


def _inspect_engine(spec: str | None, session_file: str) -> tuple[object | None, str | None]:
    """The engine an inspection uses, and a note when the one asked for is not used. The
    reference engine's store is used only when it exists, and read-only: the engine works on
    a private copy of it (:meth:`SqliteContextEngine.copy_of`), so inspect never creates nor
    changes a store."""
    from codex_turn.engines import SqliteContextEngine

    if spec in (None, "sqlite"):
        store = SqliteContextEngine.store_next_to(session_file)
        if os.path.exists(store):
            return SqliteContextEngine.copy_of(store), None
        if spec == "sqlite":
            return None, f"no engine store at {store} (inspect creates none; a turn does)"
        return None, None
    return engine_for_command(spec, session_file, create=False), None


class _NoCodex:
    """The app-server of an inspection: a Codex process just started by this command, as a
    turn in a new process would meet it. It has loaded no thread and keeps no fork, so the
    questions the stages ask of a live process (``loaded_thread``, ``kept_fork``) get the
    answers a fresh process gives; the stages stop before anything would be sent. It can fork
    and inject, as the real one can, so the preview shows the form a turn would use
    (``codex_turn.harness.turn.structured.supports_structured``). Anything else is absent
    (``getattr`` with a default sees no such capability), and a request raises: reaching it
    is a defect of the inspection."""

    can_fork = True

    def loaded_thread(self, thread_id: str) -> None:
        return None

    def kept_fork(self, base_thread_id: str) -> None:
        return None

    def take_kept_fork(self, base_thread_id: str) -> None:
        return None

    def forget_thread(self, thread_id: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)

    async def _request(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("inspect never talks to Codex")

    start_thread = resume_thread = fork_thread = inject_items = compact_thread = _request


async def _preview(args: argparse.Namespace) -> dict[str, Any]:
    from codex_turn.fsm import TurnState, TurnTrigger
    from codex_turn.harness.binding import binding_to_json, read_binding
    from codex_turn.harness.hooks import TurnHooks
    from codex_turn.harness.turn import orchestrator
    from codex_turn.harness.turn.context import HistoryRead, read_history_sync
    from codex_turn.harness.turn_api import TurnParams

    session_file = os.fspath(args.session_file)
    header = session_header(session_file, must_exist=True)
    session_id, workspace = session_identity(session_file, header, args.session_id)
    engine, engine_note = _inspect_engine(args.engine, session_file)
    params = TurnParams(
        session_id=session_id,
        session_key=args.session_key,
        session_file=session_file,
        workspace_dir=workspace,
        prompt=args.prompt,
        context_token_budget=args.token_budget,
    )
    binding = read_binding(session_file, session_id=session_id)
    try:
        # The turn's own context and machine, as run_codex_turn prepares them; the stages
        # below run as the turn would, up to the first one that would reach Codex.
        ctx, turn = await orchestrator.prepare_turn(
            params,
            session_file=session_file,
            app_server=_NoCodex(),
            engine=engine,
            tools=(),
            hooks=TurnHooks(),
            scheduler=None,
        )
        with turn:
            turn.fire(TurnTrigger.STARTED)
            history = read_history_sync(ctx)
            ctx.history = HistoryRead(messages=history or [], binding=binding)
            read = (
                TurnTrigger.HISTORY_READ if history is not None else TurnTrigger.HISTORY_READ_FAILED
            )
            turn.fire(read)
            while turn.state is not TurnState.STARTING_THREAD and not turn.is_terminal:
                turn.fire(await orchestrator.STAGES[turn.state](ctx))
            path = turn.path()
    finally:
        close_engine(engine)
    plan = ctx.plan
    projected = ctx.projected.projection if ctx.projected is not None else None
    assembled = ctx.assembled.result if ctx.assembled is not None else None
    decision = plan.decision if plan is not None else None
    return {
        "sessionFile": session_file,
        "sessionId": session_id,
        "workspace": workspace,
        "engine": engine_label(engine),
        "engineNote": engine_note,
        "messages": list(ctx.messages),
        "binding": json.loads(binding_to_json(binding)) if binding is not None else None,
        "assembled": None
        if assembled is None
        else {
            "messages": len(assembled.messages),
            "estimatedTokens": assembled.estimated_tokens,
            "contextProjection": None
            if assembled.context_projection is None
            else {
                "mode": assembled.context_projection.mode,
                "epoch": assembled.context_projection.epoch,
            },
        },
        "threadDecision": None
        if decision is None
        else {
            "action": decision.action.value,
            "reason": decision.reason,
            "project": decision.project,
            "rebind": decision.rebind,
        },
        "projected": plan.projected if plan is not None else False,
        "developerInstructions": plan.instructions if plan is not None else None,
        "prompt": plan.prompt if plan is not None else args.prompt,
        "truncatedChars": projected.truncated_chars if projected is not None else 0,
        # The structured form: how many Responses items the fork would get (None: text).
        "projectedItems": len(ctx.projected.items.items)
        if ctx.projected is not None and ctx.projected.items is not None
        else None,
        "path": path,
    }


def _text_of(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        kinds = [p.get("type", "?") for p in content if isinstance(p, dict) and "text" not in p]
        return " ".join(part for part in parts if part) or f"[{', '.join(kinds)}]"
    return ""


def _short(text: str, limit: int = 100) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _block(text: str | None, *, full: bool) -> str:
    if not text:
        return "    (none)"
    shown = text if full or len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS]
    lines = ["    " + line for line in shown.splitlines()]
    if len(shown) < len(text):
        lines.append(f"    … {len(text) - len(shown)} more characters (--full shows all)")
    return "\n".join(lines)


def _print_preview(report: dict[str, Any], out: IO[str], *, full: bool) -> None:
    def p(text: str = "") -> None:
        print(text, file=out)

    p(f"session {report['sessionFile']} (id {report['sessionId']})")
    p(f"workspace: {report['workspace']}")
    p(f"engine: {report['engine']}")
    if report.get("engineNote"):
        p(f"  ({report['engineNote']})")
    messages = report["messages"]
    p(f"\nmessages the engine would see: {len(messages)}")
    for index, message in enumerate(messages, start=1):
        role = message.get("role", "?") if isinstance(message, dict) else "?"
        p(f"  {index:>3} {role:<10} {_short(_text_of(message))}")
    binding = report["binding"]
    p("\nthread binding: " + ("none" if binding is None else binding.get("threadId", "?")))
    if binding is not None:
        engine = binding.get("contextEngine") or {}
        projection = engine.get("projection") or {}
        p(f"  model: {binding.get('model')}, tools: {binding.get('dynamicToolsFingerprint')}")
        p(
            f"  engine: {engine.get('engineId', 'none')}, projection epoch: "
            f"{projection.get('epoch', 'none')}"
        )
    assembled = report["assembled"]
    if assembled is not None:
        mode = assembled["contextProjection"] or {}
        p(
            f"\nengine assembly: {assembled['messages']} messages, ~{assembled['estimatedTokens']}"
            f" tokens, projection mode {mode.get('mode', 'per-turn')}, epoch {mode.get('epoch')}"
        )
    decision = report["threadDecision"]
    if decision is not None:
        why = REASONS.get(decision["reason"], "")
        p(
            f"\nnext turn's thread decision: {decision['action']} ({decision['reason']})"
            + (f": {why}" if why else "")
        )
    p(f"context projected: {report['projected']}")
    p(f"path so far: {' -> '.join(s.lower() for s in report['path'])}")
    p("\nCodex would receive, developer instructions:")
    p(_block(report["developerInstructions"], full=full))
    p("and the turn input:")
    p(_block(report["prompt"], full=full))


# --- traces ---------------------------------------------------------------------------------


def read_trace(path: str) -> list[dict[str, Any]]:
    """The trace entries in ``path``: ``run --json`` output, or a JSON list of entries."""
    if os.path.exists(path) and not os.path.isfile(path):
        # A directory, a FIFO (reading one would wait for a writer forever), a device.
        raise InputInvalid(f"trace file {path} is not a regular file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise InputNotFound(f"cannot read trace file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise InputInvalid(f"trace file {path} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}"
        raise InputInvalid(f"trace file {path} is not JSON: {error.msg} ({where})") from None
    entries = data.get("trace") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and {"state", "trigger", "dest"} <= e.keys() for e in entries
    ):
        raise InputInvalid(
            f"trace file {path} has no trace (expected `codex-turn run --json` output)"
        )
    if not entries:
        raise InputInvalid(f"trace file {path} has an empty trace (a turn takes steps)")
    return entries


def trace_steps(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step with the turn table's verdict: is there such an edge, to that state."""
    from codex_turn.fsm.turn import TURN_MACHINE

    steps = []
    for entry in entries:
        state, trigger, dest = str(entry["state"]), str(entry["trigger"]), str(entry["dest"])
        edges = TURN_MACHINE.edges.get((state, trigger), ())
        targets = {state if e.dest is None else e.dest.name for e in edges}
        steps.append({"state": state, "trigger": trigger, "dest": dest, "inTable": dest in targets})
    return steps


def check_path(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step with every problem it has (``problems``, empty when none): not an edge of
    the turn table, not starting where the previous step ended, the first not starting at
    the initial state, the last not ending in a final state, a step after a final state."""
    from codex_turn.fsm.turn import TURN_MACHINE

    initial, finals = str(TURN_MACHINE.initial), TURN_MACHINE.final_states
    checked = []
    for index, step in enumerate(steps):
        problems = []
        if not step["inTable"]:
            problems.append("not an edge of the turn table")
        if index == 0 and step["state"] != initial:
            problems.append(f"the path does not start at {initial}")
        if index > 0:
            before = steps[index - 1]["dest"]
            if step["state"] != before:
                problems.append(f"starts at {step['state']}, the previous step ended at {before}")
            elif before in finals:
                problems.append(f"follows the final state {before}")
        if index == len(steps) - 1 and step["dest"] not in finals:
            problems.append(f"the path ends at {step['dest']}, not a final state")
        checked.append({**step, "problems": problems})
    return checked


def path_mermaid(steps: list[dict[str, Any]]) -> str:
    """The turn diagram (:func:`codex_turn.diagrams.render_mermaid`) with the states a
    recorded turn visited marked, the last one as current; the path as a comment."""
    from codex_turn.diagrams import render_mermaid

    source = render_mermaid("turn")
    if not steps:
        return source
    order = [steps[0]["state"], *(step["dest"] for step in steps)]
    last = order[-1]
    visited = sorted({state for state in order if state != last})
    lines = [
        "  %% the recorded path: " + " -> ".join(state.lower() for state in order),
        "  classDef visited fill:#dbeafe,stroke:#1d4ed8,stroke-width:3px,color:#111",
        "  classDef current fill:#fde68a,stroke:#b45309,stroke-width:3px,color:#111",
    ]
    if visited:
        lines.append(f"  class {','.join(visited)} visited")
    lines.append(f"  class {last} current")
    return source + "\n".join(lines) + "\n"


def _inspect_trace(args: argparse.Namespace, out: IO[str]) -> int:
    steps = check_path(trace_steps(read_trace(args.trace)))
    written = None
    if args.out is not None:
        written = output_dir("--out", args.out) / "turn-path.mmd"
        written.write_text(path_mermaid(steps), encoding="utf-8")
    bad = sum(1 for step in steps if step["problems"])
    legal = bad == 0
    if args.json:
        diagram = str(written) if written else None
        dump_json({"steps": steps, "legal": legal, "diagram": diagram}, out)
    else:
        for step in steps:
            verdict = f"   <- {'; '.join(step['problems']).upper()}" if step["problems"] else ""
            arrow = f"--{step['trigger']:<24}--> {step['dest']}"
            print(f"  {step['state']:<16} {arrow}{verdict}", file=out)
        summary = (
            "a complete path of the turn table, every step an edge from where the last ended"
            if legal
            else f"ILLEGAL: {bad} bad steps"
        )
        print(f"{len(steps)} steps; {summary}", file=out)
        if written is not None:
            print(f"diagram: {written}", file=out)
    return EXIT_OK if legal else EXIT_NOT_OK


# --- doctor ---------------------------------------------------------------------------------


def doctor_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    import anyio

    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool | None, detail: str, **data: Any) -> None:
        checks.append({"check": name, "ok": ok, "detail": detail, **data})

    binary: Path | None = None
    try:
        binary = codex_binary(args.codex_bin)
    except Exception as error:  # reported, not raised
        check("codex binary", False, str(error))
    if binary is not None:
        said = codex_version(binary)
        mismatch = version_mismatch(said)
        detail = f"{said} at {binary}" + (f": {mismatch}" if mismatch else "")
        check("codex binary", mismatch is None, detail, path=str(binary), version=said)
    if args.offline:
        if args.session_file is None:
            raise UsageError("doctor --offline needs SESSION_FILE (its private home is next to it)")
        home = offline_home_for(os.fspath(args.session_file)) / "codex-home"
    else:
        home = user_path(args.codex_home or os.environ.get("CODEX_HOME") or Path.home() / ".codex")
    config = home / "config.toml"
    check(
        "codex home",
        home.is_dir(),
        f"{home} "
        + (
            ("(config.toml present)" if config.is_file() else "(no config.toml)")
            if home.is_dir()
            else "does not exist"
        ),
        path=str(home),
    )
    if args.offline:
        check("codex login", None, "not needed: --offline runs the local stand-in model")
    elif binary is not None and home.is_dir():
        ok, detail = anyio.run(_login_status, binary, home)
        check("codex login", ok, detail)
    elif binary is not None:
        check("codex login", False, f"no Codex home at {home}: {login_hint(home)}")
    if args.session_file is not None:
        session_file = os.fspath(args.session_file)
        exists, detail = _session_file_report(session_file)
        check("session file", exists, detail)
        store = anyio.run(_store_report, session_file, args.repair)
        checks.append(store)
        checks.append(_lock_report(session_file))
        from codex_turn.engines._doctor import private_file_findings

        loose = private_file_findings(session_file)
        check("private files", not loose, "; ".join(map(str, loose)) or "owner-only")
        from codex_turn.harness.binding import binding_path, read_binding

        binding = read_binding(session_file) if exists else None
        check(
            "thread binding",
            None,
            f"thread {binding.thread_id}"
            if binding is not None
            else "none (the next turn starts a thread)",
            path=binding_path(session_file),
        )
    healthy = all(c["ok"] is not False for c in checks)
    for c in checks:  # what a check quotes (an error, a path) through the logs' scrubber
        c["detail"] = scrubbed(c["detail"], limit=MAX_DETAIL_CHARS)
    if args.json:
        dump_json({"ok": healthy, "checks": checks}, out)
    else:
        for c in checks:
            mark = {True: "ok  ", False: "FAIL", None: "info"}[c["ok"]]
            print(f"{mark}  {c['check']}: {c['detail']}", file=out)
    return EXIT_OK if healthy else EXIT_NOT_OK


async def _login_status(binary: Path, home: Path) -> tuple[bool | None, str]:
    """The login check a turn makes (:func:`codex_turn.harness.appserver.account.
    check_login`: ``account/read`` on a started app-server of the user's configuration),
    so doctor and the runtime never disagree. Nothing is sent to a model, and nothing is
    written into ``home``: Codex runs in a temporary home that reads its configuration and
    credentials (:func:`~codex_turn._cli_support.read_only_home`)."""
    from codex_turn.harness.appserver import AppServer, AppServerConfig
    from codex_turn.harness.appserver.account import check_login
    from codex_turn.harness.appserver.errors import AppServerError, CodexLoginRequired

    with read_only_home(home) as shadow:
        config = AppServerConfig.user(shadow, codex_bin=binary, login_check=False)
        try:
            async with AppServer.start(config) as server:
                state = await check_login(await server.client(), config)
        except CodexLoginRequired:
            return False, f"not logged in ({home} needs an OpenAI login): {login_hint(home)}"
        except (AppServerError, OSError) as error:
            from codex_turn._log import format_error

            why = format_error(error).replace(str(shadow), str(home))
            return False, f"the app-server did not start: {why}"
    if state is None:
        return None, "unknown (the binary does not answer account/read)"
    if not state.requires_openai_auth:
        return True, "not needed: the configured model provider needs no OpenAI login"
    return True, f"logged in ({state.account_type})"


def _session_file_report(session_file: str) -> tuple[bool, str]:
    """Whether the session file exists and is a transcript the next turn accepts."""
    from codex_turn.errors import CodexTurnError

    if not os.path.isfile(session_file):
        return False, f"no such file: {session_file}"
    try:
        session_header(session_file, must_exist=True)
    except CodexTurnError as error:
        return False, str(error)
    return True, session_file


async def _store_report(session_file: str, repair: bool) -> dict[str, Any]:
    import anyio

    from codex_turn.engines import SqliteContextEngine

    path = SqliteContextEngine.store_next_to(session_file)
    if not await anyio.Path(path).exists():
        detail = f"no store yet ({path})"
        return {"check": "engine store", "ok": None, "detail": detail, "path": path}
    engine = SqliteContextEngine(path)
    try:
        report = await engine.doctor(repair=repair)
    except Exception as error:  # reported, not raised
        from codex_turn._log import format_error

        return {"check": "engine store", "ok": False, "detail": f"{path}: {format_error(error)}"}
    finally:
        engine.close()
    detail = (
        f"{path}: {report.conversations} conversations, {report.messages} messages, "
        f"{report.summaries} summaries"
    )
    if report.problems:
        detail += f"; problems: {', '.join(report.problems)}"
        if report.repaired:
            detail += f" (repaired: {', '.join(report.repaired)})"
    return {
        "check": "engine store",
        "ok": report.problems == report.repaired,
        "detail": detail,
        "path": path,
        "problems": list(report.problems),
        "repaired": list(report.repaired),
    }


def _lock_report(session_file: str) -> dict[str, Any]:
    from codex_turn.harness._fs import pid_alive, session_path
    from codex_turn.harness.session._lockfile import read_lock

    lock = session_path(session_file) + ".lock"
    try:
        raw = read_lock(lock)  # as a turn reads it: a FIFO is refused at once, never waited on
    except FileNotFoundError:
        return {"check": "session lock", "ok": True, "detail": "free", "path": lock}
    except OSError as error:
        return {"check": "session lock", "ok": False, "detail": f"{lock}: {error.strerror}"}
    try:
        pid = int(json.loads(raw).get("pid"))
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError):
        detail = f"{lock}: unreadable (being written?)"
        return {"check": "session lock", "ok": None, "detail": detail}
    if pid_alive(pid):
        return {"check": "session lock", "ok": True, "detail": f"held by pid {pid}", "pid": pid}
    return {
        "check": "session lock",
        "ok": None,
        "detail": f"stale (pid {pid} is gone); the next writer breaks it",
        "pid": pid,
    }
