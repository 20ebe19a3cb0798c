"""``codex-turn run`` and ``codex-turn chat``: turns of one session from the command line.

Both start one app-server (the user's own Codex, or with ``--offline`` a private home and the
local stand-in model) and run each turn through :func:`codex_turn.run_codex_turn` with the
chosen engine. Ctrl-C is a signal handler, not a ``KeyboardInterrupt``: during a turn it
cancels the turn, which the API guarantees to interrupt Codex, mirror and finalize (the result
still arrives through ``on_turn_end``); a second Ctrl-C, or one at the prompt, leaves.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import IO, TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import attrs

from codex_turn._cli_support import (
    EXIT_INTERRUPTED,
    EXIT_NOT_OK,
    EXIT_OK,
    ObservedEngine,
    Progress,
    UsageError,
    add_codex_bin_option,
    close_engine,
    codex_binary,
    codex_config,
    console_of,
    dump_json,
    engine_label,
    load_engine_spec,
    print_turn,
    progress_hooks,
    scrubbed,
    session_header,
    session_identity,
    stderr_note,
    turn_to_json,
    user_codex_home,
)
from codex_turn.harness.hooks import TurnHooks
from codex_turn.harness.turn.streaming import (
    AgentMessageCompleted,
    AgentMessageDelta,
    ToolCall,
    TurnEvent,
    TurnEventStream,
)

if TYPE_CHECKING:
    from codex_turn.harness.appserver import AppServer
    from codex_turn.harness.appserver.server_requests import ApprovalCallback
    from codex_turn.harness.runtime_controls import ApprovalDecision, ApprovalRequest

__all__ = ["add_turn_options", "chat_command", "run_command"]


def add_turn_options(parser: argparse.ArgumentParser) -> None:
    """The options ``run`` and ``chat`` share."""
    from codex_turn._cli_support import non_negative_float, non_negative_int, positive_float

    parser.add_argument("session_file", metavar="SESSION_FILE", help="the session transcript")
    parser.add_argument(
        "--engine",
        metavar="SPEC|sqlite|none",
        default="sqlite",
        help="the context engine: 'sqlite' (default: the reference engine, its store "
        "context.sqlite next to the session), 'none' (plain Codex), or MODULE:ATTR "
        "(loaded relative to the current directory)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--offline",
        action="store_true",
        help="a private Codex home (.codex-turn-offline/ next to the session) and the local "
        "stand-in model; nothing leaves the machine",
    )
    where.add_argument(
        "--codex-home",
        metavar="DIR",
        help="your Codex home, an existing directory (default: $CODEX_HOME, else ~/.codex); "
        "used as it is",
    )
    add_codex_bin_option(parser)
    parser.add_argument(
        "--strict",
        action="store_true",
        help="engine contract violations are errors (exit 7), not logged fallbacks",
    )
    parser.add_argument("--session-id", help="default: the transcript header's id, else its name")
    parser.add_argument("--session-key", help="the key engines bind the session to")
    parser.add_argument("--workspace", metavar="DIR", help="default: the transcript's cwd")
    parser.add_argument(
        "--model-base-url",
        metavar="URL",
        help="a Responses API endpoint of your own (a local model server): a private "
        "config.toml is written into --codex-home (a new or empty directory, or one prepared "
        "this way before)",
    )
    parser.add_argument("--model", help="the Codex model (default: your config's)")
    parser.add_argument(
        "--effort",
        choices=EFFORTS,
        help="the model's reasoning effort (default: your config's; chat: /effort)",
    )
    parser.add_argument(
        "--sandbox",
        choices=("read-only", "workspace-write", "danger-full-access"),
        help="where Codex's commands may write (default: your config's)",
    )
    parser.add_argument(
        "--approval-policy",
        choices=("untrusted", "on-request", "never"),
        help="when Codex asks before running a command (default: your config's; chat asks "
        "you, run declines)",
    )
    parser.add_argument("--instructions", help="base developer instructions")
    parser.add_argument("--token-budget", type=non_negative_int, metavar="TOKENS")
    parser.add_argument(
        "--projection",
        choices=("structured", "text"),
        default="structured",
        help="how a per-turn engine's context reaches Codex: Responses items in a fork of the "
        "session's base thread (default), or the text frame",
    )
    parser.add_argument(
        "--turn-timeout", type=positive_float, default=600.0, metavar="S", help="default: 600"
    )
    parser.add_argument(
        "--offline-delay",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="with --offline: the stand-in model stalls each reply S seconds (try Ctrl-C)",
    )


#: The reasoning efforts Codex 0.163 takes (``turn/start``'s ``effort``).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

#: How long chat waits for your answer to an approval before Codex is told "declined".
CHAT_APPROVAL_TIMEOUT_S = 600.0


# --- one turn, cancellable ------------------------------------------------------------------


@attrs.define(eq=False)
class _Turns:
    """The turns of one command: the params they share, the server, the engine."""

    args: argparse.Namespace
    session_file: str
    session_id: str
    workspace: str
    port: AppServer
    engine: ObservedEngine | None
    progress: Progress
    count: int = 0
    #: The running turn's scope (Ctrl-C cancels it), and whether it was cancelled already.
    scope: anyio.CancelScope | None = None
    interrupting: bool = False
    #: The model and reasoning effort of the next turns (chat's /model and /effort).
    model: str | None = None
    effort: str | None = None
    #: chat: who answers Codex's approval requests, and what shows the turn as it runs.
    approver: ApprovalCallback | None = None
    display: TurnDisplay | None = None

    def __attrs_post_init__(self) -> None:
        self.model = self.args.model
        self.effort = self.args.effort

    def params(self, prompt: str) -> Any:
        from codex_turn.harness.turn_api import TurnParams

        return TurnParams(
            session_id=self.session_id,
            session_key=self.args.session_key,
            session_file=self.session_file,
            workspace_dir=self.workspace,
            prompt=prompt,
            model=self.model,
            reasoning_effort=self.effort,
            sandbox=self.args.sandbox,
            approval_policy=self.args.approval_policy,
            approval_timeout=CHAT_APPROVAL_TIMEOUT_S if self.approver is not None else 60.0,
            base_developer_instructions=self.args.instructions,
            context_token_budget=self.args.token_budget,
            turn_timeout=self.args.turn_timeout,
            strict=self.args.strict,
            projection_format=self.args.projection,
        )

    def hooks(self) -> TurnHooks:
        observer = progress_hooks(self.progress).on_transition
        return TurnHooks(on_transition=observer, on_approval=self.approver)

    async def run(self, prompt: str) -> tuple[Any, bool]:
        """(result, interrupted): the result is ``None`` only when the turn never began."""
        from codex_turn.harness.turn.orchestrator import run_codex_turn

        params = self.params(prompt)
        self.count += 1
        self.progress.label(f"turn {self.count}")
        self.progress.state("starting")
        delivered: list[Any] = []

        async def on_turn_end(result: Any) -> None:
            delivered.append(result)

        self.interrupting = False
        result: Any = None
        display = self.display
        events = TurnEventStream() if display is not None else None
        try:
            async with anyio.create_task_group() as shows:
                if display is not None and events is not None:
                    shows.start_soon(display.show, events)
                try:
                    with anyio.CancelScope() as scope:
                        self.scope = scope
                        result = await run_codex_turn(
                            params,
                            app_server=self.port,
                            engine=self.engine,
                            hooks=self.hooks(),
                            on_turn_end=on_turn_end,
                            events=events,
                        )
                finally:
                    if events is not None:
                        events.close()  # the display reads what is left, then ends
        finally:
            self.scope = None
            self.progress.clear()
        interrupted = scope.cancelled_caught
        if result is None and delivered:
            result = delivered[-1]
        return result, interrupted

    def interrupt(self) -> bool:
        """Cancel the running turn (first Ctrl-C); ``False`` when there is none to cancel."""
        if self.scope is None or self.interrupting:
            return False
        self.interrupting = True
        self.progress.state("interrupting", "Ctrl-C: the turn is interrupted, then saved")
        self.scope.cancel()
        return True


@attrs.frozen
class _Prepared:
    """A command's inputs, checked before anything is created or started."""

    args: argparse.Namespace
    session_file: str
    session_id: str
    workspace: str
    #: A loaded ``module:attr`` engine; ``None`` with ``sqlite`` (created on start) or ``none``.
    loaded_engine: object | None


def _prepare(args: argparse.Namespace) -> _Prepared:
    """Every check that needs no side effect: the session file and its directory, the
    workspace, the flags, the engine spec, the Codex binary and home. Nothing is created."""
    session_file = os.fspath(args.session_file)
    header = session_header(session_file, must_exist=False)
    session_id, workspace = session_identity(session_file, header, args.session_id)
    workspace = args.workspace or workspace
    if not os.path.isdir(workspace):
        raise UsageError(f"--workspace: not a directory: {workspace}")
    if args.offline_delay and not args.offline:
        raise UsageError("--offline-delay needs --offline")
    if args.model_base_url and (args.offline or not args.codex_home):
        raise UsageError("--model-base-url needs --codex-home (a private home gets a new config)")
    loaded = (
        None if args.engine in {"sqlite", "none"} else load_engine_spec(args.engine, session_file)
    )
    codex_binary(args.codex_bin)
    if not args.offline and not args.model_base_url:
        user_codex_home(args.codex_home)
    return _Prepared(args, session_file, session_id, workspace, loaded)


def _engine_label(prepared: _Prepared) -> str:
    """The engine's label before it exists (the reference engine's store is not created
    until the first turn)."""
    from codex_turn.engines import ENGINE_ID, SqliteContextEngine

    if prepared.args.engine == "sqlite":
        return f"{ENGINE_ID} (store {SqliteContextEngine.store_next_to(prepared.session_file)})"
    return engine_label(prepared.loaded_engine)


@asynccontextmanager
async def _session(prepared: _Prepared, progress: Progress) -> AsyncIterator[_Turns]:
    """The engine (the reference engine's store is created here) and the started Codex."""
    from codex_turn.engines import SqliteContextEngine
    from codex_turn.harness.appserver import AppServer

    args = prepared.args
    engine = (
        SqliteContextEngine.next_to(prepared.session_file)
        if args.engine == "sqlite"
        else prepared.loaded_engine
    )
    observed = ObservedEngine(engine) if engine is not None else None
    try:
        with codex_config(
            offline=args.offline,
            codex_home=args.codex_home,
            session_file=prepared.session_file,
            model=args.model,
            offline_delay=args.offline_delay,
            codex_bin=args.codex_bin,
            model_base_url=args.model_base_url,
        ) as (config, _model):
            progress.label("codex")
            progress.state("starting", "codex app-server")
            async with AppServer.start(config) as server:
                progress.clear()
                yield _Turns(
                    args=args,
                    session_file=prepared.session_file,
                    session_id=prepared.session_id,
                    workspace=prepared.workspace,
                    port=server,
                    engine=observed,
                    progress=progress,
                )
    finally:
        progress.clear()
        close_engine(engine)


async def _watch_interrupts(on_interrupt: Callable[[], None]) -> None:
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            on_interrupt()


# --- what chat shows while a turn runs ------------------------------------------------------


class TurnDisplay:
    """The reply as Codex writes it and each tool call as it starts and ends, on stdout
    (chat): the reply is the conversation's own text, printed as it is; a tool line says
    what runs (through the scrubber, as it is Codex's doing, not the user's words)."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._item: str | None = None  # the agent message being streamed
        self.shown_reply = False

    async def show(self, events: TurnEventStream) -> None:
        self.shown_reply = False
        self._item = None
        async for event in events:
            self.on_event(event)
        self._end_line()

    def on_event(self, event: TurnEvent) -> None:
        if isinstance(event, AgentMessageDelta):
            if event.item_id != self._item:
                self._end_line()
                self._item = event.item_id
                self._out.write("  assistant: ")
            self._out.write(event.delta)
            self.shown_reply = True
        elif isinstance(event, AgentMessageCompleted):
            if event.item_id != self._item:  # its deltas were dropped: the whole text
                self._end_line()
                self._out.write(f"  assistant: {event.text}")
                self.shown_reply = True
            self._end_line()
        elif isinstance(event, ToolCall):
            self._end_line()
            what = scrubbed(" ".join((event.name or "").split()), limit=200)
            status = event.phase if event.status is None else f"{event.phase}: {event.status}"
            self._out.write(f"  tool {event.kind}: {what} ({status})\n")
        else:
            return
        self._out.flush()

    def _end_line(self) -> None:
        if self._item is not None:
            self._out.write("\n")
            self._out.flush()
            self._item = None


def _approval_question(request: ApprovalRequest) -> str:
    """What Codex asks to do, in one line (scrubbed: a command can carry a key)."""
    kind = request.kind.value
    if request.command:
        what = f"run `{' '.join(request.command.split())}`"
    elif request.tool_name:
        what = f"call the MCP tool {request.server_name}.{request.tool_name}"
    else:
        what = f"make a {kind.replace('_', ' ')}"
    why = f" ({' '.join(request.reason.split())})" if request.reason else ""
    return scrubbed(f"Codex asks to {what}{why}", limit=500)


#: The answers to an approval question, by the first letter of the line typed.
APPROVAL_ANSWERS: dict[str, str] = {
    "y": "approve",
    "s": "approve_for_session",
    "n": "decline",
    "c": "cancel",
}


def approver(receive: anyio.abc.ObjectReceiveStream[str], out: IO[str]) -> ApprovalCallback:
    """Chat's answer to Codex's approval requests: the question on stdout, the answer the
    next line of stdin (y: approve, s: approve for the session, n or an empty line or the end
    of input: decline, c: decline and stop the turn)."""
    from codex_turn.harness.runtime_controls import ApprovalDecision

    async def ask(request: ApprovalRequest) -> ApprovalDecision:
        offer = ", [s] yes for this session" if request.session_approval_offered else ""
        print(_approval_question(request), file=out)
        print(f"  approve? [y] yes{offer}, [n] no (default), [c] no and stop: ", end="", file=out)
        out.flush()
        try:
            line = await receive.receive()
        except anyio.EndOfStream:
            line = ""
        _line_ended(out)
        answer = APPROVAL_ANSWERS.get(line.strip()[:1].lower(), "decline")
        if answer == "approve_for_session" and not request.session_approval_offered:
            answer = "approve"
        decision = ApprovalDecision(answer)
        print(f"  ({decision.value.replace('_', ' ')})", file=out, flush=True)
        return decision

    return ask


def _line_ended(out: IO[str]) -> None:
    """The user's Enter ended the terminal's line (after a question or the prompt)."""
    console = console_of(out)
    if console is not None:
        console.line_ended()


# --- run ------------------------------------------------------------------------------------


def run_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    """One turn; prints it (or its JSON with ``--json``). Exit 0 when completed. A strict
    turn whose engine broke the contract is still printed, then fails (exit 7)."""
    if not args.prompt.strip():
        raise UsageError("--prompt must not be empty")
    json_lines = args.log_format == "json"
    prepared = _prepare(args)
    progress = Progress(err, enabled=not args.quiet, json_lines=json_lines)
    outcome: dict[str, Any] = {}

    async def main() -> None:
        async with _session(prepared, progress) as turns, anyio.create_task_group() as group:
            outcome["turns"] = turns

            def interrupt() -> None:
                if not turns.interrupt():
                    group.cancel_scope.cancel()

            group.start_soon(_watch_interrupts, interrupt)
            result, interrupted = await turns.run(args.prompt)
            outcome.update(result=result, interrupted=interrupted)
            group.cancel_scope.cancel()

    try:
        anyio.run(main)
    except BaseException as error:
        from codex_turn.harness.engine import EngineContractViolation

        violation = _unwrap(error)
        turns_: _Turns | None = outcome.get("turns")
        if isinstance(violation, EngineContractViolation) and turns_ is not None:
            if violation.result is not None:
                _print_run(args, out, turns_, violation.result, violation)
            raise violation from None
        raise
    result = outcome.get("result")
    turns: _Turns | None = outcome.get("turns")
    if result is None or turns is None:
        stderr_note(
            err,
            "codex-turn run: interrupted before the turn began",
            json_lines=json_lines,
            event="interrupted",
        )
        return EXIT_INTERRUPTED
    _print_run(args, out, turns, result, None)
    if outcome.get("interrupted"):
        return EXIT_INTERRUPTED
    return EXIT_OK if result.outcome.value == "completed" else EXIT_NOT_OK


def _print_run(
    args: argparse.Namespace, out: IO[str], turns: _Turns, result: Any, violation: Any
) -> None:
    calls = turns.engine.take_calls() if turns.engine is not None else []
    if args.json:
        data = turn_to_json(result, calls, session_file=turns.session_file)
        if violation is not None:
            data["contractViolation"] = {
                "engineId": violation.engine_id,
                "method": violation.method,
                "problem": violation.problem,
                "later": violation.later,
            }
        dump_json(data, out)
    else:
        print(f"session {turns.session_file} (engine: {engine_label(turns.engine)})", file=out)
        print_turn(out, "turn", result, calls)
    out.flush()


def _unwrap(error: BaseException) -> BaseException:
    """The one error inside task-group exception groups."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


# --- chat -----------------------------------------------------------------------------------


def _stdin_lines(token: anyio.lowlevel.EventLoopToken, send: Any) -> None:
    """A daemon thread: lines of stdin into ``send``; EOF closes it. Reads the file
    descriptor itself (never ``sys.stdin``'s buffer, whose lock a blocked daemon thread would
    hold at interpreter exit)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    fd = sys.stdin.fileno()
    try:
        while True:
            chunk = os.read(fd, 65536)
            pending += decoder.decode(chunk, final=not chunk)
            *lines, pending = pending.split("\n")
            for line in lines:
                anyio.from_thread.run_sync(send.send_nowait, line, token=token)
            if not chunk:
                if pending:
                    anyio.from_thread.run_sync(send.send_nowait, pending, token=token)
                break
    except (OSError, RuntimeError, anyio.ClosedResourceError, anyio.BrokenResourceError):
        return
    try:
        anyio.from_thread.run_sync(send.close, token=token)
    except RuntimeError:
        return


CHAT_HELP = (
    "/model NAME, /effort LEVEL: the next turns' model and reasoning effort (alone: back to "
    "the default); /quit or end of input leaves; Ctrl-C interrupts a turn"
)


async def _next_prompt(
    receive: anyio.abc.ObjectReceiveStream[str],
    out: IO[str],
    *,
    interactive: bool,
    settings: _Settings,
) -> str | None:
    """The next prompt on stdin; ``None`` at EOF or ``/quit``. Empty lines are skipped and
    chat's own commands (``/model``, ``/effort``, ``/help``) carried out."""
    while True:
        if interactive:
            print("you> ", end="", file=out, flush=True)
        try:
            line = await receive.receive()
        except anyio.EndOfStream:
            return None
        _line_ended(out)
        prompt = line.strip()
        if prompt in {"/quit", "/exit"}:
            return None
        if prompt.startswith("/") and prompt.split()[0] in CHAT_COMMANDS:
            print(f"  ({chat_command_line(prompt, settings)})", file=out, flush=True)
            continue
        if prompt:
            return prompt


@attrs.define
class _Settings:
    """What chat's commands change: the next turns' model and reasoning effort."""

    model: str | None
    effort: str | None


CHAT_COMMANDS = ("/model", "/effort", "/help")


def chat_command_line(line: str, settings: _Settings) -> str:
    """Carry out one of chat's commands on ``settings``; what it did, in a few words."""
    name, _, value = line.partition(" ")
    value = value.strip()
    if name == "/model":
        settings.model = value or None
        return f"model for the next turns: {settings.model or 'the configured one'}"
    if name == "/effort":
        if value and value not in EFFORTS:
            return f"unknown effort {value!r}: one of {', '.join(EFFORTS)}"
        settings.effort = value or None
        return f"reasoning effort for the next turns: {settings.effort or 'the default'}"
    return CHAT_HELP


def chat_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    """Turns from stdin lines until EOF, ``/quit``, or Ctrl-C at the prompt (or twice).
    Nothing is created (engine store, private Codex home) and Codex is not started until
    the first prompt arrives: a chat that runs no turn leaves nothing behind."""
    json_lines = args.log_format == "json"
    prepared = _prepare(args)
    progress = Progress(err, enabled=not args.quiet, json_lines=json_lines)
    interactive = sys.stdin.isatty()
    state: dict[str, Any] = {"left": False, "turns": None}
    settings = _Settings(model=args.model, effort=args.effort)

    async def main() -> None:
        send, receive = anyio.create_memory_object_stream[str](64)
        async with anyio.create_task_group() as group:

            def interrupt() -> None:
                turns: _Turns | None = state["turns"]
                if turns is not None and turns.interrupt():
                    stderr_note(
                        err,
                        "(interrupting the turn; Ctrl-C again to leave)",
                        json_lines=json_lines,
                        event="interrupting",
                    )
                    return
                state["left"] = True
                group.cancel_scope.cancel()

            group.start_soon(_watch_interrupts, interrupt)
            reader = threading.Thread(
                target=_stdin_lines,
                args=(anyio.lowlevel.current_token(), send),
                name="codex-turn stdin",
                daemon=True,
            )
            reader.start()
            print(
                f"chat with {prepared.session_file} (engine: {_engine_label(prepared)}); "
                "empty line ignored, /quit or EOF leaves, Ctrl-C interrupts a turn, /help",
                file=out,
                flush=True,
            )
            async with receive:
                ask = functools.partial(_next_prompt, receive, out, interactive=interactive)
                prompt = await ask(settings=settings)
                if prompt is not None:
                    async with _session(prepared, progress) as turns:
                        turns.approver = approver(receive, out)
                        turns.display = TurnDisplay(out)
                        state["turns"] = turns
                        while prompt is not None:
                            turns.model, turns.effort = settings.model, settings.effort
                            await _chat_turn(turns, prompt, out)
                            if turns.scope is None and state["left"]:
                                break
                            prompt = await ask(settings=settings)
            group.cancel_scope.cancel()

    anyio.run(main)
    if state["left"]:
        stderr_note(err, "(left)", json_lines=json_lines, event="left")
        return EXIT_INTERRUPTED
    return EXIT_OK


async def _chat_turn(turns: _Turns, prompt: str, out: IO[str]) -> None:
    result, interrupted = await turns.run(prompt)
    calls = turns.engine.take_calls() if turns.engine is not None else []
    if result is not None:
        streamed = turns.display is not None and turns.display.shown_reply
        print_turn(
            out,
            f"turn {turns.count}",
            result,
            calls,
            timings=turns.args.verbose > 0,
            reply=not streamed,  # already shown as Codex wrote it
        )
    if interrupted:
        print(
            f"(turn {turns.count} interrupted and saved; type the next prompt, or Ctrl-C to leave)",
            file=out,
            flush=True,
        )
    out.flush()
