"""The offline demo: a conversation through the real Codex app-server, with a compaction.

Everything is real except the model: the pinned ``codex app-server`` binary runs the loop and
talks to the offline Responses-API server on 127.0.0.1, with every proxy variable pointed at
that server's 403 trap, so any attempt to reach the internet would be counted (and the demo
prints the count). The context engine is the embedded default, the reference
:class:`~codex_turn.engines.SqliteContextEngine` with its store next to the transcript (with
small budgets, so that a compaction of a short conversation has something to summarise).

Three turns, then a compaction of the session (the engine compacts its memory, which starts
a new context epoch; Codex compacts the thread natively), then a fourth turn: it rotates to a
fresh thread that receives the compacted context (``context projected: True``), and the demo
prints an excerpt of what Codex sent the model on it: the engine's summary, framed before the
prompt. From turn 2 on, each turn shows the memory the model was sent: on turns 2 and 3 the
earlier prompts (and replies) that Codex's thread carries (nothing is projected: the thread
already holds the conversation), on turn 4 the engine's compacted context. Nothing the
stand-in model says pretends to understand: it echoes turns 1 and 2, quotes the earlier
prompts its request carries when asked to summarise (turn 3), and on turn 4 reports which
facts its request carries and where (in the engine's summary or in the recent messages).
Then a second host runs one more turn on the session and is SIGKILLed between the model's
reply and the engine's commit (a real child process; :mod:`codex_turn._demo_durable`): the
next start recovers the turn from the outbox, and the engine holds it exactly once.
Per turn the demo prints the thread decision and why, whether context was projected, the
engine calls, the time per state and the reply, with the state being executed live on
stderr. It ends by printing where the transcript, the engine store and the rendered
diagrams are (kept in ``--out DIR``, else a new temporary directory).

The demo's turns register no dynamic tools, as ``codex-turn run`` and ``chat`` register none:
the conversation goes on from the command line (``codex-turn chat SESSION --offline``) on the
same thread (Codex freezes a thread's dynamic tools, so a tool-less turn on a tooled thread
would take a transient thread instead).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import anyio

from codex_turn._cli_support import (
    ObservedEngine,
    Progress,
    codex_binary,
    dump_json,
    offline_home_for,
    output_dir,
    print_turn,
    progress_hooks,
    turn_to_json,
)
from codex_turn._demo_durable import crash_between_reply_and_commit, describe
from codex_turn.engines import EngineSettings, SqliteContextEngine
from codex_turn.harness.appserver import AppServer, AppServerConfig
from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session_traced
from codex_turn.harness.engine import to_json
from codex_turn.harness.turn.orchestrator import TurnParams, TurnResult, run_codex_turn
from codex_turn.testing import OfflineModel, Reply

__all__ = ["DEMO_SETTINGS", "PROMPTS", "run_demo"]


PROMPTS: Sequence[str] = (
    "Lisbon is my favourite city, and I travel there in May. Please remember that.",
    "I would like to ride the old trams and see the castle there.",
    "Thanks. Summarise what we talked about.",
)
AFTER_COMPACTION = "Which city did I say was my favourite, and when do I travel?"

#: Small budgets: a forced compaction of a few turns summarises all but the newest two
#: messages (the defaults would keep a 32-message fresh tail and compact nothing).
DEMO_SETTINGS = EngineSettings(
    fresh_tail_count=2,
    fresh_tail_max_fraction=0.35,
    leaf_chunk_tokens=400,
    min_leaf_chunk_tokens=8,
    leaf_target_tokens=40,
    condensed_target_tokens=40,
)
COMPACTION_BUDGET = 120  # tokens


FRAME_LINES = 18  # the excerpt of a projected turn input the demo prints
LINE_CHARS = 96


def _model_line(request: Any) -> str:
    return (
        f"  model was sent: {len(request.developer_parts)} developer parts, "
        f"{len(request.user_messages)} user messages"
    )


def _received_excerpt(request: Any) -> list[str]:
    """The turn input Codex sent the model (its last user message: the engine's context
    framed before the prompt), shortened for the terminal."""
    lines = [line for line in request.last_user_text.splitlines() if line.strip()]
    shown = [
        "    | " + (line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 1] + "\u2026")
        for line in lines[:FRAME_LINES]
    ]
    if len(lines) > FRAME_LINES:
        shown.append(f"    | ... {len(lines) - FRAME_LINES} more lines")
    return [
        "  Codex received (the turn input it sent the model, an excerpt): the engine's "
        "compacted context, framed before the prompt",
        *shown,
    ]


def earlier_prompts(request: Any, prompt: str) -> list[str]:
    """The demo's earlier prompts that the model was sent again with this turn's (Codex's
    thread carries the conversation): what the model remembers, read off its request."""
    sent = request.user_messages
    return [p for p in (*PROMPTS, AFTER_COMPACTION) if p != prompt and p in sent]


def _memory_line(request: Any, prompt: str) -> str:
    earlier = earlier_prompts(request, prompt)
    if not earlier:
        return "  memory: the model was sent this prompt alone (nothing earlier yet)"
    shown = "; ".join(_quoted(text, 40) for text in earlier)
    replies = len(request.assistant_messages)
    return (
        f"  memory: with this prompt the model was sent {len(earlier)} earlier "
        f"prompt{'s' if len(earlier) > 1 else ''} of this conversation and {replies} "
        f"repl{'ies' if replies != 1 else 'y'}, from Codex's thread: {shown}"
    )


def _quoted(text: str, limit: int) -> str:
    return repr(text if len(text) <= limit else text[: limit - 1] + "\u2026")


def recap_from_request(request: Any) -> str:
    """The stand-in model's answer to "summarise": no summary (it understands nothing), but
    the earlier prompts its request carries, quoted, so what the demo shows is what the
    model was sent."""
    earlier = [p for p in request.user_messages[:-1] if p in PROMPTS]
    if not earlier:
        return "(stand-in model) my request carries no earlier message of ours."
    quoted = "; ".join(_quoted(text, 60) for text in earlier)
    return f"(stand-in model, quoting its request) earlier you wrote: {quoted}"


def answer_from_request(request: Any) -> str:
    """The stand-in model's answer to the last turn, computed from what it was sent: which
    facts of turn 1 the engine's summaries in its request carry, and which the rest does."""
    sent = request.last_user_text
    summaries = re.findall(r"<summary\b.*?</summary>", sent, flags=re.DOTALL)
    summarised = " ".join(summaries)
    rest = re.sub(r"<summary\b.*?</summary>", "", sent, flags=re.DOTALL)
    found = [
        f"{word} (in {'the engine summary' if word in summarised else 'the recent messages'})"
        for word in ("Lisbon", "May")
        if word in summarised or word in rest
    ]
    if not found:
        return "(stand-in model) my request carries neither the city nor the month."
    held = f"{len(summaries)} engine summar{'y' if len(summaries) == 1 else 'ies'}"
    return (
        f"(stand-in model, answering from its request: {held}, {len(sent)} characters) "
        + ", ".join(found)
    )


async def _main(
    workdir: Path, out: IO[str], progress: Progress, as_json: bool, codex_bin: Path
) -> tuple[int, dict[str, Any]]:
    report: dict[str, Any] = {"directory": str(workdir), "turns": []}
    model = OfflineModel().start()
    try:
        # Nothing the model says pretends to understand: it echoes, quotes its request, or
        # (turn 4) reports which facts its request carries and where.
        model.script(Reply.echo(), Reply.echo())
        model.script(Reply.computed(recap_from_request))
        model.script(Reply.computed(answer_from_request))
        session_file = workdir / "session.jsonl"
        # The private Codex home `run --offline` and `chat --offline` use for this session:
        # the conversation can go on from the command line, on the same thread.
        home = offline_home_for(str(session_file))
        home.mkdir(mode=0o700, exist_ok=True)
        config = AppServerConfig.offline(
            home / "codex-home",
            model.base_url,
            env=model.proxy_env(),
            home=home,
            codex_bin=codex_bin,
        )
        workspace = workdir / "workspace"
        workspace.mkdir(exist_ok=True)
        store = SqliteContextEngine.next_to(session_file, settings=DEMO_SETTINGS)
        engine = ObservedEngine(store)
        if not as_json:
            print(f"offline model on {model.base_url}; session {session_file}", file=out)
        results: list[TurnResult] = []

        def params(prompt: str) -> TurnParams:
            return TurnParams(
                session_id="demo-session",
                session_file=session_file,
                workspace_dir=workspace,
                prompt=prompt,
                base_developer_instructions="You are a concise assistant.",
            )

        async def turn(server: AppServer, index: int, prompt: str) -> None:
            progress.label(f"turn {index}")
            progress.state("starting")
            try:
                result = await run_codex_turn(
                    params(prompt),
                    app_server=server,
                    engine=engine,
                    hooks=progress_hooks(progress),
                )
            finally:
                progress.clear()
            results.append(result)
            calls = engine.take_calls()
            request = model.turn_requests()[-1]
            report["turns"].append(
                {
                    "prompt": prompt,
                    **turn_to_json(result, calls, session_file=str(session_file)),
                    "modelReceived": request.last_user_text,
                    "modelReceivedEarlier": earlier_prompts(request, prompt),
                }
            )
            if not as_json:
                print(f"\nyou: {prompt}", file=out)
                print_turn(out, f"turn {index}", result, calls)
                print(_model_line(request), file=out, flush=True)
                if result.projected:
                    print("\n".join(_received_excerpt(request)), file=out, flush=True)
                else:
                    print(_memory_line(request, prompt), file=out, flush=True)

        progress.label("codex")
        progress.state("starting", "codex app-server")
        async with AppServer.start(config) as server:
            progress.clear()
            for index, prompt in enumerate(PROMPTS, start=1):
                await turn(server, index, prompt)

            progress.label("compaction")
            progress.state("compacting", "engine, then Codex native")
            try:
                run = await compact_codex_session_traced(
                    CompactSessionParams(
                        session_id="demo-session",
                        session_file=str(session_file),
                        workspace_dir=str(workspace),
                        token_budget=COMPACTION_BUDGET,
                    ),
                    app_server=server,
                    engine=engine,
                )
            finally:
                progress.clear()
            compaction = to_json(run.result)
            report["compaction"] = {
                **compaction,
                "path": list(run.path),
                "projectionCleared": run.projection_cleared,
                "engineCalls": [c.method for c in engine.take_calls()],
            }
            if not as_json:
                _print_compaction(out, run)

            await turn(server, len(PROMPTS) + 1, AFTER_COMPACTION)

        # A second host on this session (its own app-server on the same home, once this one
        # has ended) is killed between the reply and the commit; the next start recovers.
        progress.label("durable turn")
        progress.state("running", "a second host, killed before its commit")
        try:
            durable = await crash_between_reply_and_commit(
                spec={
                    "home": str(home),
                    "baseUrl": model.base_url,
                    "env": model.proxy_env(),
                    "codexBin": str(codex_bin),
                    "sessionFile": str(session_file),
                    "sessionId": "demo-session",
                    "workspace": str(workspace),
                },
                engine=engine,
                store=store,
            )
        finally:
            progress.clear()
        report["durableTurn"] = {**durable, "engineCalls": [c.method for c in engine.take_calls()]}

        doctor = await store.doctor(repair=False)
        store.close()
        lines = session_file.read_text(encoding="utf-8").splitlines()
        diagrams = _render_diagrams(workdir / "diagrams", results)
        report.update(
            transcript=str(session_file),
            transcriptLines=len(lines),
            store=store.path,
            storeMessages=doctor.messages,
            storeSummaries=doctor.summaries,
            storeHealthy=doctor.ok,
            diagrams=[str(p) for p in diagrams],
            modelRequests=len(model.requests),
            internetAttempts=len(model.proxy_attempts),
        )
        if not as_json:
            print(
                f"\nmodel requests: {len(model.requests)}; internet attempts (proxy CONNECTs): "
                f"{len(model.proxy_attempts)}",
                file=out,
            )
            print("\n".join(describe(durable)), file=out)
            print("\nwhere everything is:", file=out)
            transcript = f"{session_file} ({len(lines)} lines, OpenClaw JSONL v3)"
            print(f"  transcript:   {transcript}", file=out)
            print(
                f"  engine store: {store.path} ({doctor.messages} messages, "
                f"{doctor.summaries} summaries, "
                f"{'healthy' if doctor.ok else 'problems: ' + ', '.join(doctor.problems)})",
                file=out,
            )
            print(f"  diagrams:     {workdir / 'diagrams'}", file=out)
            for path in diagrams:
                print(f"                {path.name}", file=out)
            print(f"  codex home:   {home} (private, offline)", file=out)
            print(
                f"  inspect it:   codex-turn inspect {session_file}\n"
                f"  go on:        codex-turn chat {session_file} --offline",
                file=out,
            )
        ok = (
            not model.proxy_attempts
            and all(r.outcome.value == "completed" for r in results)
            and results[-1].projected
            and durable["exactlyOnce"]
        )
        return (0 if ok else 1), report
    finally:
        model.close()


def _print_compaction(out: IO[str], run: Any) -> None:
    result = run.result
    details = result.result
    print("\ncompaction:", file=out)
    print(f"  path: {' -> '.join(s.lower() for s in run.path)}", file=out)
    before = details.tokens_before if details is not None else None
    after = details.tokens_after if details is not None else None
    print(
        f"  engine: ok={result.ok} compacted={result.compacted} tokens {before} -> {after}"
        + (f" ({result.reason})" if result.reason else ""),
        file=out,
    )
    native = run.native
    if native is not None:
        print(
            f"  codex native: {native.status}"
            + (f" (proved by {native.signal})" if native.signal else ""),
            file=out,
        )
    print(
        "  the binding's projection epoch was "
        + ("cleared: the next turn rotates and re-projects" if run.projection_cleared else "kept"),
        file=out,
        flush=True,
    )


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """File descriptor 2 to /dev/null meanwhile (C libraries write there directly)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _render_diagrams(directory: Path, results: Sequence[TurnResult]) -> list[Path]:
    """The machines' diagrams, and each turn's path over the turn diagram."""
    from codex_turn._cli_inspect import path_mermaid, trace_steps
    from codex_turn._cli_support import trace_to_json
    from codex_turn.diagrams import write_diagrams

    with _quiet_stderr_fd():  # Graphviz's fontconfig warns on stderr on some systems
        written = write_diagrams(directory, svg=True)
    for index, result in enumerate(results, start=1):
        path = directory / f"turn-{index}-path.mmd"
        path.write_text(path_mermaid(trace_steps(trace_to_json(result))), encoding="utf-8")
        written.append(path)
    return written


def run_demo(
    *,
    out_dir: Path | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    progress: bool = True,
    as_json: bool = False,
    codex_bin: str | None = None,
    json_lines: bool = False,
) -> int:
    """Run the demo in ``out_dir`` (default: a new temporary directory, kept)."""
    out = out or sys.stdout
    err = err or sys.stderr
    binary = codex_binary(codex_bin)  # no binary: one typed error, before anything starts
    if out_dir is None:
        workdir = Path(tempfile.mkdtemp(prefix="codex-turn-demo-"))
    else:
        workdir = out_dir.resolve()
        if (workdir / "session.jsonl").exists():
            from codex_turn._cli_support import UsageError

            raise UsageError(f"--out {out_dir}: it already holds a demo (session.jsonl)")
        output_dir("--out", workdir)
    shown = Progress(err, enabled=progress, json_lines=json_lines)
    code, report = anyio.run(_main, workdir, out, shown, as_json, binary)
    if as_json:
        dump_json(report, out)
    return code
