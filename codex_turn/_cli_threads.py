"""``codex-turn threads list|branch|archive`` and ``codex-turn diagnostics``.

The commands of :mod:`codex_turn.harness.supervision` and :mod:`codex_turn.harness.diagnostics`
on a Codex home (``--codex-home``, else ``$CODEX_HOME``, else ``~/.codex``), each through an
app-server of its own that loads nothing it is not asked to:

* ``threads list``: the home's unarchived native threads (passive: nothing resumed);
* ``threads branch THREAD``: continue a thread as a new one (``--session FILE`` binds a
  session to it, supervised: its turns keep the thread's model and provider);
* ``threads archive THREAD``: under the safety rules; ``--yes`` is the explicit
  confirmation an idle or unknown thread needs (an active one is never archived);
* ``diagnostics [SESSION_FILE] [--thread ID ...]``: ``feedback/upload`` of the session's
  bound thread (or the named ones) and their sub-threads (``--thread-only``: the first
  alone), only on approval: ``--yes``, or ``y`` at the prompt on a terminal; anything else
  uploads nothing and prints no ids.

A result that is not what was asked (refused, failed, withheld) exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from typing import IO, Any

from codex_turn._cli_support import (
    EXIT_NOT_OK,
    EXIT_OK,
    UsageError,
    add_codex_bin_option,
    codex_binary,
    dump_json,
    user_codex_home,
)

__all__ = ["add_supervision_parsers", "diagnostics_command", "threads_command"]


def add_supervision_parsers(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``threads`` and ``diagnostics`` commands (``sub`` makes a command's parser,
    ``common`` adds -v/-q/--log-format to a nested one)."""
    threads = sub(
        "threads",
        "a Codex home's native threads: list, continue as a branch, archive",
        "Look at the native threads of a Codex home without taking them over: list them "
        "(nothing is resumed), continue one as a new thread (the source is never resumed; "
        "its visible history up to its last finished turn is carried), archive one (an "
        "active thread never; an idle or unknown one with --yes).",
    )
    actions = threads.add_subparsers(dest="threads_action", required=True, metavar="ACTION")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = actions.add_parser(name, help=help, description=help)
        common(parser)
        _home_options(parser)
        parser.add_argument("--json", action="store_true")
        return parser

    listing = action("list", "the home's unarchived native threads (passive)")
    listing.add_argument("--cwd", metavar="DIR", help="only the threads of this directory")
    branch = action("branch", "continue a native thread as a new thread")
    branch.add_argument("thread_id", metavar="THREAD")
    branch.add_argument("--cwd", metavar="DIR", help="the new thread's (default: the source's)")
    branch.add_argument(
        "--session", metavar="FILE", help="bind this session to the new thread (supervised)"
    )
    branch.add_argument("--session-id", help="the session's id (default: from the transcript)")
    branch.add_argument("--max-messages", type=int, default=40, metavar="N")
    archive = action("archive", "archive a native thread under the safety rules")
    archive.add_argument("thread_id", metavar="THREAD")
    archive.add_argument(
        "--yes", action="store_true", help="confirm: archive an idle or unknown thread"
    )

    diagnostics = sub(
        "diagnostics",
        "upload Codex diagnostics (feedback/upload) for a session's thread, on approval",
        "Upload the logs of the session's bound Codex thread (or --thread IDs) and the "
        "sub-threads it spawned to OpenAI with Codex's feedback/upload, only on an explicit "
        "approval (--yes, or y at the prompt). Prints, per uploaded thread, its session id, "
        "thread id and the `codex resume` command. Denied or unanswered: nothing is uploaded.",
    )
    diagnostics.add_argument("session_file", metavar="SESSION_FILE", nargs="?")
    diagnostics.add_argument("--thread", action="append", default=[], metavar="ID")
    diagnostics.add_argument(
        "--thread-only", action="store_true", help="the thread alone, without sub-threads"
    )
    diagnostics.add_argument("--yes", action="store_true", help="approve the upload")
    diagnostics.add_argument("--classification", default="bug")
    diagnostics.add_argument("--reason", help="a note sent with the upload")
    _home_options(diagnostics)
    diagnostics.add_argument("--json", action="store_true")


def _home_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--codex-home", metavar="DIR", help="default: $CODEX_HOME, else ~/.codex")
    add_codex_bin_option(parser)


def _run(args: argparse.Namespace, work: Callable[[Any], Awaitable[Any]]) -> Any:
    """``work(server)`` on an app-server of the Codex home (no login needed: no model runs)."""
    import anyio

    from codex_turn.harness.appserver import AppServer, AppServerConfig

    config = AppServerConfig.user(
        user_codex_home(args.codex_home), codex_bin=codex_binary(args.codex_bin), login_check=False
    )

    async def main() -> Any:
        async with AppServer.start(config) as server:
            return await work(server)

    return anyio.run(main)


def threads_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn.harness import supervision as sv

    if args.threads_action == "list":
        threads = _run(args, lambda server: sv.list_native_threads(server, cwd=args.cwd))
        rows = [
            {
                "threadId": t.thread_id,
                "sessionId": t.session_id,
                "status": t.status.value,
                "model": t.model,
                "modelProvider": t.model_provider,
                "cwd": t.cwd,
                "preview": t.preview,
                "resume": t.resume_command,
            }
            for t in threads
        ]
        if args.json:
            dump_json(rows, out)
        else:
            for row in rows:
                print(
                    f"{row['threadId']}  {row['status']:<10} {row['model']}  {row['cwd']}", file=out
                )
        return EXIT_OK
    if args.threads_action == "branch":
        if args.max_messages < 0:
            raise UsageError("--max-messages must be 0 or more")
        limits = sv.BranchLimits(max_messages=args.max_messages)
        result = _run(
            args,
            lambda server: sv.branch_native_thread(
                server, args.thread_id, cwd=args.cwd, limits=limits
            ),
        )
        if result.branched and args.session:
            sv.bind_branch(args.session, result, session_id=args.session_id)
        report = {
            "outcome": result.outcome.value,
            "reason": result.reason,
            "source": args.thread_id,
            "threadId": result.thread_id,
            "model": result.model,
            "modelProvider": result.model_provider,
            "messages": result.messages,
            "forkArchived": result.fork_archived,
            "session": os.fspath(args.session) if args.session and result.branched else None,
            "error": result.error,
        }
        _report(report, args.json, out)
        return EXIT_OK if result.branched else EXIT_NOT_OK
    result = _run(
        args, lambda server: sv.archive_native_thread(server, args.thread_id, confirm=args.yes)
    )
    report = {
        "outcome": result.outcome.value,
        "reason": result.reason,
        "threadId": result.thread_id,
        "status": result.status.value,
        "descendants": result.descendants,
        "error": result.error,
    }
    _report(report, args.json, out)
    return EXIT_OK if result.archived else EXIT_NOT_OK


def _report(report: dict[str, Any], as_json: bool, out: IO[str]) -> None:
    if as_json:
        dump_json(report, out)
        return
    for key, value in report.items():
        if value is not None:
            print(f"{key}: {value}", file=out)


def diagnostics_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from codex_turn.harness.diagnostics import (
        DiagnosticsDecision,
        DiagnosticsRequest,
        upload_diagnostics,
    )

    thread_ids = list(args.thread)
    if args.session_file is not None:
        from codex_turn.harness.binding import read_binding

        binding = read_binding(os.fspath(args.session_file))
        if binding is None:
            raise UsageError("the session has no Codex thread bound (give --thread ID)")
        thread_ids.insert(0, binding.thread_id)
    if not thread_ids:
        raise UsageError("give SESSION_FILE or --thread ID")

    async def approve(request: DiagnosticsRequest) -> DiagnosticsDecision | None:
        if args.yes:
            return DiagnosticsDecision.APPROVE
        if not sys.stdin.isatty():
            return None  # nobody to ask: nothing is uploaded
        import anyio

        question = (
            f"Upload the logs of {request.threads} Codex thread(s) to OpenAI "
            f"(classification {request.classification})? [y/N] "
        )
        answer = await anyio.to_thread.run_sync(input, question, abandon_on_cancel=True)
        return (
            DiagnosticsDecision.APPROVE
            if answer.strip().lower() in ("y", "yes")
            else (DiagnosticsDecision.DENY)
        )

    result = _run(
        args,
        lambda server: upload_diagnostics(
            server,
            thread_ids,
            approve=approve,
            thread_only=args.thread_only,
            classification=args.classification,
            reason=args.reason,
        ),
    )
    report = {
        "outcome": result.outcome.value,
        "reason": result.reason,
        "uploads": [
            {"sessionId": u.session_id, "threadId": u.thread_id, "resume": u.resume_command}
            for u in result.uploads
        ],
        "error": result.error,
    }
    if args.json:
        dump_json(report, out)
    else:
        print(f"{result.outcome.value}: {result.reason}", file=out)
        for upload in result.uploads:
            print(f"session {upload.session_id}  thread {upload.thread_id}", file=out)
            print(f"  {upload.resume_command}", file=out)
        if result.error:
            print(f"Codex said: {result.error}", file=out)
    return EXIT_OK if result.uploaded else EXIT_NOT_OK
