"""Fault injection over the whole turn orchestrator.

``run_codex_turn`` runs against the in-process :class:`~support.fake_appserver.FakeAppServer`
(real ``TurnHandle`` and ``TurnProjector``), a :class:`~support.recording_engine.RecordingEngine`
with a random capability set, and a real transcript in a fresh temp directory. Faults are
injected at every stage:

* engine: optional methods omitted, raising, or returning invalid results (``None``,
  ``{"messages": 5}`` ... for assemble); an engine without a required method is refused before
  the turn starts (``test_an_engine_without_a_required_method_is_refused_up_front``);
* Codex: ``turn/start`` failing, the turn failing, interrupted, yielding through
  ``sessions_yield``, hanging into the idle or the turn timeout, the app-server dying mid-turn,
  an in-turn native compaction (complete, started only, legacy ``thread/compacted``);
* threads: ``thread/start`` and ``thread/resume`` failing (resume exercised through a real
  binding left by an earlier turn);
* the transcript: none, empty, mirrored by hand, written by an earlier turn (with the same
  engine, or with none), or a foreign file whose first line is not a session header (the
  mirror refuses it); the mirror failing for real because the transcript's OpenClaw
  ``.lock`` path is taken by a directory (the lock can never be acquired);
* the caller: cancelling mid-turn, or before Codex is reached; hooks and ``on_turn_end``
  raising; background maintenance with or without a scheduler.

The invariants: the turn always returns a result (or, when the caller cancelled,
hands it to ``on_turn_end`` and lets the cancellation propagate); bootstrap only with a prior
session file and before assemble; exactly one finalize path per turn that ran; maintenance
only when allowed; the user prompt is in the transcript exactly once (when the mirror worked;
never otherwise); the FSM trace is a legal path (replayed on a fresh ``TurnModel`` and checked
step by step against the independent oracle in ``tests/fsm_oracle.py``).

The focused tests after the property pin the documented outcome of each failure kind; the
async scenarios at the end (both anyio backends) each pin one fault or race that once broke.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import anyio
import anyio.lowlevel
import attrs
import pytest
from fsm_oracle import INTERNAL, turn_oracle, turn_skip_reason
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.fake_appserver import CodexScript, FakeAppServer
from support.recording_engine import OPTIONAL_METHODS, RecordingEngine
from support.transcripts import transcript_texts
from support.turns import turn_params as params

from codex_turn.fsm import TurnFacts, TurnModel, TurnOutcome, TurnState, TurnTrigger
from codex_turn.fsm.thread import ThreadAction
from codex_turn.harness.appserver import (
    AppServerClosed,
    AppServerError,
    AppServerRpcError,
    AppServerStartError,
    AppServerTimeout,
    ThreadNotFound,
)
from codex_turn.harness.binding import read_binding
from codex_turn.harness.engine import AssembleResult, ContextProjection, LegacyContextEngine
from codex_turn.harness.hooks import (
    CompactionHookEvent,
    PromptBuildContext,
    PromptBuildResult,
    TurnHooks,
)
from codex_turn.harness.maintenance import BackgroundMaintenance
from codex_turn.harness.session import (
    TranscriptUnwritable,
    clear_session_cache,
    load_session_messages,
    mirror_turn,
)
from codex_turn.harness.turn import stages
from codex_turn.harness.turn.orchestrator import (
    TURN_START_TEXT_MAX_CHARS,
    TurnParams,
    TurnResult,
    run_codex_turn,
)

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]  # the async scenarios at the end

T = TurnTrigger

ADDITION = "ENGINE-ADDITION: remember the user's dog is called Rex."
BASE = "BASE INSTRUCTIONS for the agent."
REPLY = "Here is the answer."
PARTIAL = "PARTIAL-NEVER-MIRRORED"
RUN_EXITS = {
    T.TURN_COMPLETED: TurnOutcome.COMPLETED,
    T.TURN_FAILED: TurnOutcome.FAILED,
    T.TURN_ABORTED: TurnOutcome.ABORTED,
    T.TURN_YIELD_ABORTED: TurnOutcome.YIELD_ABORTED,
    T.TURN_TIMED_OUT: TurnOutcome.TIMED_OUT,
}
FINALIZE_METHODS = ("after_turn", "ingest_batch", "ingest")

EngineKind = Literal["none", "legacy", "legacy_recording", "recording"]
Prior = Literal["none", "empty_file", "transcript", "corrupt", "setup_same", "setup_no_engine"]
AssembleMode = Literal["passthrough", "addition", "bootstrap_epoch", "new_epoch", "weird"]
Ending = Literal["completed", "failed", "interrupted", "yield", "hang", "closed", "cancel"]

INVALID_RESULTS: dict[str, list[Any]] = {
    "bootstrap": [5, "yes", {"bootstrapped": "nope"}, [1]],
    "assemble": [
        None,
        5,
        {"messages": 5},
        {"messages": [1]},
        {"messages": [], "estimatedTokens": "many"},
        {"messages": [], "systemPromptAddition": 7},
    ],
    "maintain": ["nope", {"changed": "x"}, 7],
    # The harness ignores what these return (as OpenClaw does): "invalid" is harmless.
    "after_turn": ["garbage"],
    "ingest_batch": ["garbage", None],
    "ingest": [5],
}
ENGINE_ERRORS = [RuntimeError("engine exploded"), ValueError("bad state"), TimeoutError("slow")]


# --- one example --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Example:
    engine: EngineKind = "recording"
    omit: frozenset[str] = frozenset()
    maintenance_mode: Literal["foreground", "background"] = "foreground"
    scheduler: bool = False
    #: method -> "raise" or an invalid return value (wrapped as ("invalid", value)).
    faults: Mapping[str, Any] = attrs.field(factory=dict)
    assemble_mode: AssembleMode = "passthrough"
    prior: Prior = "none"
    mirror_fault: bool = False
    script: CodexScript = attrs.field(factory=lambda: CodexScript(reply=REPLY))
    timeout_kind: Literal["idle", "turn"] = "idle"
    start_error: AppServerError | None = None
    resume_error: AppServerError | None = None
    yield_tool: bool = False
    base_instructions: bool = True
    hooks_raise: bool = False
    cancel_before_codex: bool = False
    on_turn_end_raises: bool = False
    prompt_text: str = "What is the weather?"

    @property
    def engine_active(self) -> bool:
        return self.engine == "recording"

    @property
    def prior_exists(self) -> bool:
        return self.prior != "none"

    @property
    def maintains(self) -> bool:
        return self.engine_active and "maintain" not in self.omit

    @property
    def deferred(self) -> bool:
        return self.engine_active and self.maintenance_mode == "background" and self.scheduler

    @property
    def mirror_fails(self) -> bool:
        """The mirror cannot write this turn (a held lock, or a foreign transcript)."""
        return self.mirror_fault or self.prior == "corrupt"

    @property
    def bootstraps(self) -> bool:
        """The engine has bootstrap() or maintain() (else bootstrap is skipped by the table)."""
        return self.engine_active and not {"bootstrap", "maintain"} <= self.omit


@attrs.define
class Observed:
    example: Example
    prompt: str
    session_file: str
    server: FakeAppServer
    engine: Any
    result: TurnResult | None = None
    delivered: list[TurnResult] = attrs.Factory(list)
    raised: BaseException | None = None
    caller_cancelled: bool = False
    prior_messages: list[dict[str, Any]] = attrs.Factory(list)
    transcript: list[dict[str, Any]] = attrs.Factory(list)
    binding: Any = None
    hook_calls: list[str] = attrs.Factory(list)

    @property
    def final(self) -> TurnResult:
        """The turn's result: returned, or (after a cancellation) handed to on_turn_end."""
        if self.result is not None:
            return self.result
        assert self.delivered, "no result was returned nor delivered"
        return self.delivered[-1]


def _params(ex: Example, session_file: str, workdir: str, prompt: str) -> TurnParams:
    hang = ex.script.ending == "hang"
    return TurnParams(
        session_id="sess-faults",
        session_key="agent:main:faults",
        session_file=session_file,
        workspace_dir=workdir,
        prompt=prompt,
        model="gpt-test",
        context_token_budget=8000,
        base_developer_instructions=BASE if ex.base_instructions else None,
        yield_tool=ex.yield_tool,
        idle_timeout=0.05 if hang and ex.timeout_kind == "idle" else 120.0,
        turn_timeout=0.08 if hang and ex.timeout_kind == "turn" else 600.0,
        cleanup_timeout=10.0,
    )


def _assemble(mode: AssembleMode, *, setup: bool) -> Callable[[Any], AssembleResult] | None:
    def passthrough(**extra: Any) -> Callable[[Any], AssembleResult]:
        return lambda p: AssembleResult(
            messages=list(p.messages), estimated_tokens=len(p.messages), **extra
        )

    if mode == "passthrough":
        return None  # the RecordingEngine default (a new, equal list)
    if mode == "addition":
        return passthrough(system_prompt_addition=ADDITION)
    if mode in ("bootstrap_epoch", "new_epoch"):
        epoch = "epoch-2" if mode == "new_epoch" and not setup else "epoch-1"
        return passthrough(
            context_projection=ContextProjection(
                mode="thread_bootstrap", epoch=epoch, fingerprint=f"fp-{epoch}"
            )
        )
    # Valid per the contract (a list of objects) but odd: the projection must cope or fail.
    return lambda p: AssembleResult(
        messages=[
            {"role": "assistant"},
            {"role": "user", "content": [{"type": "image", "data": "x"}]},
            {"role": "toolResult", "content": {"weird": True}},
            {"content": 5},
        ],
        estimated_tokens=3,
    )


def _make_engine(ex: Example) -> Any:
    if ex.engine == "none":
        return None
    if ex.engine == "legacy":
        return LegacyContextEngine()
    if ex.engine == "legacy_recording":
        return RecordingEngine(engine_id="legacy", omit=ex.omit)
    return RecordingEngine(
        engine_id="lossless-test", omit=ex.omit, turn_maintenance_mode=ex.maintenance_mode
    )


def _apply_engine_faults(ex: Example, engine: RecordingEngine) -> None:
    engine.responses.clear()
    engine.failures.clear()
    assemble = _assemble(ex.assemble_mode, setup=False)
    if assemble is not None:
        engine.responses["assemble"] = assemble
    for index, (method, fault) in enumerate(sorted(ex.faults.items())):
        if fault == "raise":
            error = ENGINE_ERRORS[index % len(ENGINE_ERRORS)]
            if method == "ingest":
                # Fail only the user's message: the loop must go on with the others.
                engine.failures[method] = lambda p, e=error: (
                    e if p.message.get("role") == "user" else None
                )
            else:
                engine.failures[method] = error
        else:
            engine.responses[method] = fault[1]


def _disk_full(*_args: Any, **_kwargs: Any) -> Any:
    raise OSError(28, "No space left on device")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


async def run_example(ex: Example, workdir: str) -> Observed:
    sessions = os.path.join(workdir, "sessions")
    os.makedirs(sessions)
    session_file = os.path.join(sessions, "session.jsonl")
    prompt = f"{ex.prompt_text} [{uuid.uuid4().hex}]"
    server = FakeAppServer()
    engine = _make_engine(ex)
    obs = Observed(ex, prompt, session_file, server, engine)

    # The transcript (and binding) that exist before the turn.
    if ex.prior == "empty_file":
        _write(session_file, "")
    elif ex.prior == "corrupt":
        _write(session_file, '{"type":"message","id":"m1","message":{"role":"user"}}\n')
    elif ex.prior == "transcript":
        mirror_turn(
            session_file,
            [
                {"role": "user", "content": "an old question", "timestamp": 1},
                {"role": "assistant", "content": [{"type": "text", "text": "an old answer"}]},
            ],
            scope="codex-app-server:old-thread",
            identities=["old-turn:prompt", "old-turn:assistant"],
            session_id="sess-faults",
            cwd=workdir,
        )
    elif ex.prior in ("setup_same", "setup_no_engine"):
        setup_engine = engine if ex.prior == "setup_same" else None
        if isinstance(setup_engine, RecordingEngine):
            healthy = _assemble(ex.assemble_mode, setup=True)
            if healthy is not None:
                setup_engine.responses["assemble"] = healthy
        server.scripts.append(CodexScript(reply="an earlier answer"))
        setup = await run_codex_turn(
            _params(attrs.evolve(ex, script=CodexScript()), session_file, workdir, "earlier?"),
            app_server=server,
            engine=setup_engine,
        )
        assert setup.outcome is TurnOutcome.COMPLETED  # sanity: the setup turn is healthy
        if isinstance(engine, RecordingEngine):
            engine.reset()
        server.calls.clear()
    obs.prior_messages = [dict(m) for m in load_session_messages(session_file)]

    # The faults of this turn.
    if isinstance(engine, RecordingEngine) and ex.engine_active:
        _apply_engine_faults(ex, engine)
    server.start_error = ex.start_error
    server.resume_error = ex.resume_error
    server.scripts.append(ex.script)
    real_mirror = stages.mirror_turn
    if ex.mirror_fault:
        # The disk fails after the preflight passed (a held lock or a foreign file is refused
        # before Codex now): the turn's mirror raises; the prompt was made durable before.
        stages.mirror_turn = _disk_full  # type: ignore[assignment]

    async def on_turn_end(result: TurnResult) -> None:
        obs.delivered.append(result)
        if ex.on_turn_end_raises:
            raise RuntimeError("host callback broke")

    async with contextlib.AsyncExitStack() as stack:
        scheduler = (
            await stack.enter_async_context(BackgroundMaintenance()) if ex.scheduler else None
        )
        with anyio.CancelScope() as caller:
            server.cancel_caller = caller.cancel
            hooks = _hooks(ex, obs, caller)
            try:
                obs.result = await run_codex_turn(
                    _params(ex, session_file, workdir, prompt),
                    app_server=server,
                    engine=engine,
                    hooks=hooks,
                    maintenance_scheduler=scheduler,
                    on_turn_end=on_turn_end,
                )
            except Exception as error:  # checked by the property; kept for the report
                obs.raised = error
        obs.caller_cancelled = caller.cancelled_caught
        if scheduler is not None:
            with anyio.fail_after(10):
                await scheduler.drain()

    stages.mirror_turn = real_mirror  # type: ignore[assignment]
    obs.transcript = [dict(m) for m in load_session_messages(session_file)]
    obs.binding = read_binding(session_file)
    clear_session_cache(session_file)
    return obs


def _hooks(ex: Example, obs: Observed, caller: anyio.CancelScope) -> TurnHooks:
    async def before_prompt_build(ctx: PromptBuildContext) -> None:
        obs.hook_calls.append("before_prompt_build")
        if ex.cancel_before_codex:
            caller.cancel()
        if ex.hooks_raise:
            raise RuntimeError("prompt hook broke")

    def compaction(name: str) -> Callable[[CompactionHookEvent], Awaitable[None]]:
        async def hook(event: CompactionHookEvent) -> None:
            obs.hook_calls.append(name)
            if ex.hooks_raise:
                raise RuntimeError(f"{name} hook broke")

        return hook

    async def sink(diagnostic: Mapping[str, Any]) -> None:
        obs.hook_calls.append("diagnostic")
        if ex.hooks_raise:
            raise RuntimeError("sink broke")

    return TurnHooks(
        before_prompt_build=(before_prompt_build,),
        before_compaction=(compaction("before_compaction"),),
        after_compaction=(compaction("after_compaction"),),
        on_compaction_event=sink,
    )


def run_sync(ex: Example) -> Observed:
    workdir = tempfile.mkdtemp(prefix="codex-turn-faults-")
    try:
        return anyio.run(run_example, ex, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- the invariants -----------------------------------------------------------------------


def _is_prompt(message: Mapping[str, Any], prompt: str) -> bool:
    return message.get("role") == "user" and message.get("content") == prompt


def _texts(messages: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    return [(m.get("role"), m.get("content")) for m in messages]


def expected_outcome(ex: Example) -> TurnOutcome:
    """The outcome of a turn that reached Codex, from the script alone."""
    script = ex.script
    if script.turn_start_error is not None:
        return TurnOutcome.FAILED
    outcome = {
        "completed": TurnOutcome.COMPLETED,
        "failed": TurnOutcome.FAILED,
        "interrupted": TurnOutcome.ABORTED,
        "yield": TurnOutcome.YIELD_ABORTED if ex.yield_tool else TurnOutcome.COMPLETED,
        "hang": TurnOutcome.TIMED_OUT,
        "closed": TurnOutcome.FAILED,
        "cancel": TurnOutcome.ABORTED,
    }[script.ending]
    if outcome is TurnOutcome.COMPLETED and ex.mirror_fails:
        return TurnOutcome.UNSAVED  # a reply the transcript could not take
    return outcome


def check_trace_is_legal(ex: Example, result: TurnResult) -> None:
    trace = result.trace
    assert trace, "empty trace"
    assert trace[0].state == "IDLE"
    assert trace[0].trigger == T.STARTED
    for before, after in itertools.pairwise(trace):
        assert before.dest == after.state, f"trace is not a path: {before} -> {after}"
        assert before.monotonic_ns <= after.monotonic_ns
    assert trace[-1].dest in ("DONE", "FAILED"), f"turn stopped in {trace[-1].dest}"
    # Replay on a fresh model with the facts the example implies.
    facts = TurnFacts(
        engine_active=ex.engine_active,
        had_session_file=ex.prior_exists,
        engine_maintains=ex.maintains,
        background_maintenance=ex.deferred,
        engine_bootstraps=ex.bootstraps,
    )
    model = TurnModel.begin(facts)
    for entry in trace:
        model.fire(entry.trigger)
    assert model.state_name == trace[-1].dest
    assert model.outcome is result.outcome
    assert [(e.state, e.trigger, e.dest) for e in model.trace] == [
        (e.state, e.trigger, e.dest) for e in trace
    ]
    # And step by step against the hand-written oracle.
    outcome: str | None = None
    resume_failed = False
    overflowed = False
    for entry in trace:
        dest = turn_oracle(
            entry.state,
            entry.trigger,
            engine=ex.engine_active,
            session_file=ex.prior_exists,
            maintains=ex.maintains,
            background=ex.deferred,
            bootstraps=ex.bootstraps,
            outcome=outcome,
            resume_failed=resume_failed,
            overflowed=overflowed,
        )
        resume_failed = resume_failed or entry.trigger == "thread_resume_failed"
        overflowed = overflowed or entry.trigger == "turn_overflowed"
        expected = entry.state if dest == INTERNAL else dest
        assert expected == entry.dest, f"oracle disagrees on {entry}"
        if entry.trigger in RUN_EXITS:
            outcome = RUN_EXITS[T(entry.trigger)].value


def check_refused(obs: Observed) -> None:
    """A transcript that cannot take the turn (here: a foreign file) refuses it before anything
    reaches Codex: a typed error, the result delivered, nothing called, nothing written."""
    assert isinstance(obs.raised, TranscriptUnwritable), obs.raised
    assert obs.result is None
    (result,) = obs.delivered
    assert result.outcome is TurnOutcome.TRANSCRIPT_UNWRITABLE
    assert result.prompt_error
    assert [e.trigger for e in result.trace] == [T.STARTED, T.TRANSCRIPT_UNWRITABLE]
    assert obs.server.calls == []
    if isinstance(obs.engine, RecordingEngine):
        assert obs.engine.calls == []
    assert obs.transcript == []  # the foreign file is never written


def check(obs: Observed) -> None:
    ex = obs.example
    prompt = obs.prompt

    if ex.prior == "corrupt":
        check_refused(obs)
        return
    # 1. The turn always returns a result (a cancelled caller gets it through on_turn_end).
    assert obs.raised is None, f"run_codex_turn raised {obs.raised!r}"
    ran_codex_cancel = ex.script.ending == "cancel" and not ex.cancel_before_codex
    if obs.caller_cancelled:
        assert obs.result is None
        assert ex.cancel_before_codex or ran_codex_cancel
    else:
        assert obs.result is not None
        assert not ex.cancel_before_codex
    assert len(obs.delivered) == 1, "on_turn_end must see the result exactly once"
    result = obs.final
    if obs.result is not None:
        assert obs.delivered[0] is obs.result

    triggers = [e.trigger for e in result.trace]
    check_trace_is_legal(ex, result)
    ran = any(t in RUN_EXITS for t in triggers)
    starts = obs.server.calls_to("start_thread")
    resumes = obs.server.calls_to("resume_thread")

    # The documented outcome.
    if ex.cancel_before_codex:
        assert result.outcome is TurnOutcome.CANCELLED
        assert triggers[-1] == T.CANCELLED
        assert not obs.server.calls_to("turn")
    elif T.THREAD_START_FAILED in triggers and resumes and not starts:
        # A transient resume failure: the turn fails, the binding (the conversation) stays.
        assert isinstance(ex.resume_error, AppServerError)
        assert not isinstance(ex.resume_error, AppServerRpcError)  # timeouts, dead process
        assert result.outcome is TurnOutcome.THREAD_START_FAILED
        assert obs.binding is not None
        assert obs.binding.thread_id == resumes[0].args["thread_id"]
    elif T.THREAD_START_FAILED in triggers:
        assert ex.start_error is not None, "thread start failed without a cause"
        assert starts
        assert result.outcome is TurnOutcome.THREAD_START_FAILED
        assert result.prompt_error
        assert not obs.server.calls_to("turn")
    else:
        assert ran
        assert result.outcome is expected_outcome(ex)
        if ex.script.ending == "cancel" and ex.script.turn_start_error is None:
            assert obs.caller_cancelled
        if ex.start_error is not None:
            assert not starts, "a failing thread/start must end the turn"
    if ran and ex.script.ending == "cancel" and ex.script.turn_start_error is None:
        assert obs.caller_cancelled
    assert (result.prompt_error is not None) == (
        result.outcome
        in (TurnOutcome.FAILED, TurnOutcome.TIMED_OUT, TurnOutcome.THREAD_START_FAILED)
    )
    if result.outcome in (TurnOutcome.COMPLETED, TurnOutcome.UNSAVED):
        assert result.assistant_text == REPLY
    assert (result.mirror_error is not None) == (ran and ex.mirror_fails)
    assert result.assistant_text != PARTIAL

    # The thread decision against what the app-server saw.
    if not ex.cancel_before_codex:
        decision = result.thread_decision
        assert decision is not None
        if decision.action is ThreadAction.RESUME:
            assert len(resumes) == 1
            assert not starts
        else:
            assert len(starts) == 1
            assert len(resumes) == (1 if decision.reason == "resume-failed" else 0)
        if resumes and isinstance(ex.resume_error, AppServerRpcError):
            # Codex answered: no such thread, or a rollout it cannot read. Rotate.
            assert decision.reason == "resume-failed"
    if ran:
        assert obs.binding is not None
        transient = (
            result.thread_decision is not None
            and result.thread_decision.action is ThreadAction.TRANSIENT
        )
        # A transient (no-tools) thread never replaces the bound one.
        assert (obs.binding.thread_id == result.thread_id) is not transient

    # What Codex was asked: the baseline prompt unless the engine's projection applied.
    for call in [*starts, *resumes]:
        instructions = call.args["developer_instructions"] or ""
        if ex.base_instructions:
            assert instructions.startswith(BASE)
        assert (ADDITION in instructions) == (
            ex.assemble_mode == "addition" and T.PROJECTED in triggers
        )
        assert call.args["tools"] == (["sessions_yield"] if ex.yield_tool else [])
    turns = obs.server.calls_to("turn")
    thread_ok = {T.THREAD_STARTED, T.THREAD_RESUMED, T.THREAD_ROTATED} & set(triggers)
    assert len(turns) == (1 if thread_ok else 0)
    assert ran == bool(thread_ok)
    for call in turns:
        assert call.args["prompt"] == prompt  # the raw prompt is what gets mirrored
        if T.PROJECTED not in triggers:
            assert is_baseline_input(result, call.args["text"], prompt)
    codex_started = ran and ex.script.turn_start_error is None
    interrupts = obs.server.methods().count("interrupt")
    interrupting = ex.script.ending in ("hang", "cancel") or (
        ex.script.ending == "yield" and ex.yield_tool
    )
    assert interrupts == (1 if codex_started and interrupting else 0)

    # Native compaction inside the turn: internal transitions, hooks, count.
    started = triggers.count(T.NATIVE_COMPACTION_STARTED)
    completed = triggers.count(T.NATIVE_COMPACTION_COMPLETED)
    compaction = ex.script.compaction if codex_started else "none"
    assert started == (1 if compaction in ("completed", "started_only") else 0)
    assert completed == (1 if compaction in ("completed", "legacy") else 0)
    assert result.native_compactions == completed
    assert obs.hook_calls.count("before_compaction") == started
    assert obs.hook_calls.count("after_compaction") == completed

    # Mirror: exactly one outcome per turn that ran; the prompt in the transcript exactly once
    # (made durable before turn/start, so a failed mirror still keeps the user's words).
    mirror_ok = ran and not ex.mirror_fault
    assert triggers.count(T.MIRRORED) == (1 if mirror_ok else 0)
    assert triggers.count(T.MIRROR_FAILED) == (1 if ran and not mirror_ok else 0)
    in_transcript = sum(_is_prompt(m, prompt) for m in obs.transcript)
    assert in_transcript == (1 if ran else 0), f"prompt {in_transcript}x in transcript"
    assert _texts(obs.transcript[: len(obs.prior_messages)]) == _texts(obs.prior_messages)
    if mirror_ok:
        assert _texts(obs.transcript[len(obs.prior_messages) :]) == _texts(result.messages_snapshot)
    else:
        new = obs.transcript[len(obs.prior_messages) :]
        assert _texts(new) == (_texts(result.messages_snapshot[:1]) if ran else [])
    assert not any(PARTIAL in str(m.get("content")) for m in obs.transcript)

    # Finalize: exactly one path per turn that ran.
    assert triggers.count(T.FINALIZED) + triggers.count(T.FINALIZE_FAILED) == (1 if ran else 0)

    # Engine calls.
    engine = obs.engine
    if not isinstance(engine, RecordingEngine):
        assert not ex.engine_active
    elif not ex.engine_active:
        assert engine.calls == [], "an inactive (legacy) engine must never be called"
    else:
        check_engine_calls(obs, result, triggers, ran)

    # Maintenance only when allowed.
    allowed = (
        ran
        and ex.maintains
        # an unsaved reply is a completed turn the transcript could not take: not gated
        and result.outcome in (TurnOutcome.COMPLETED, TurnOutcome.UNSAVED)
        and T.FINALIZED in triggers
    )
    assert (TurnState.MAINTAINING.name in [e.dest for e in result.trace]) == allowed
    report = result.maintenance
    if allowed:
        assert report.skip_reason is None
        if ex.deferred:
            assert report.status == "deferred"
        else:
            maintain_fails = "maintain" in ex.faults
            assert report.status == ("failed" if maintain_fails else "ran")
    else:
        assert report.status == "skipped"
        if ran:
            assert report.skip_reason == turn_skip_reason(
                engine=ex.engine_active,
                maintains=ex.maintains,
                outcome=result.outcome.value,
                finalize_failed=T.FINALIZE_FAILED in triggers,
            )
        else:
            assert report.skip_reason is None


def check_engine_calls(obs: Observed, result: TurnResult, triggers: list[str], ran: bool) -> None:
    ex = obs.example
    engine: RecordingEngine = obs.engine
    methods = engine.methods()
    prompt = obs.prompt

    # Phases in order: bootstrap (+ its maintenance), assemble, one finalize path, maintenance.
    finalize_at = [i for i, m in enumerate(methods) if m in FINALIZE_METHODS]
    first_finalize = finalize_at[0] if finalize_at else len(methods)
    boot_phase = methods[:first_finalize]
    turn_phase = methods[first_finalize:]
    assemble_at = [i for i, m in enumerate(methods) if m == "assemble"]
    assert len(assemble_at) == (0 if "assemble" in ex.omit else 1)
    for index, method in enumerate(methods):
        if method == "bootstrap" or (method == "maintain" and index < first_finalize):
            assert all(index < a for a in assemble_at), f"{method} after assemble: {methods}"
    assert all(m in ("after_turn", "ingest_batch", "ingest", "maintain") for m in turn_phase)
    assert set(boot_phase) <= {"bootstrap", "maintain", "assemble"}

    # Bootstrap only with a prior session file (and before assemble, above), and only for an
    # engine with bootstrap() or maintain(): one decider, the table's may_bootstrap (an engine
    # with neither used to be traced "bootstrapped" although nothing was called).
    bootstrap_calls = engine.calls_to("bootstrap")
    may_bootstrap = ex.prior_exists and ex.bootstraps
    assert len(bootstrap_calls) == (1 if may_bootstrap and "bootstrap" not in ex.omit else 0)
    booted = T.BOOTSTRAPPED in triggers or T.BOOTSTRAP_FAILED in triggers
    assert booted == may_bootstrap
    assert (T.BOOTSTRAP_SKIPPED in triggers) == (not may_bootstrap)
    bootstrap_failed = bool(bootstrap_calls) and "bootstrap" in ex.faults
    assert (T.BOOTSTRAP_FAILED in triggers) == bootstrap_failed
    boot_maintain = boot_phase.count("maintain")
    assert boot_maintain == (1 if may_bootstrap and ex.maintains and not bootstrap_failed else 0)

    # Assemble sees the tool names; its failure means the baseline prompt.
    for call in engine.calls_to("assemble"):
        assert call.params.available_tools == (
            frozenset({"sessions_yield"}) if ex.yield_tool else frozenset()
        )
        assert call.params.prompt == prompt
        assert not any(_is_prompt(m, prompt) for m in call.params.messages)
    assemble_ok = bool(assemble_at) and "assemble" not in ex.faults
    assert (T.ASSEMBLED in triggers) == assemble_ok
    assert (T.ASSEMBLE_FAILED in triggers) == (not assemble_ok)

    # Exactly one finalize path for a turn that ran, none otherwise.
    after_turn = engine.calls_to("after_turn")
    batches = engine.calls_to("ingest_batch")
    ingests = engine.calls_to("ingest")
    if not ran:
        assert not after_turn
        assert not batches
        assert not ingests
        assert not turn_phase
        return
    new_messages: list[dict[str, Any]]
    if "after_turn" not in ex.omit:
        assert len(after_turn) == 1
        assert not batches
        assert not ingests
        params = after_turn[0].params
        assert params.pre_prompt_message_count == len(obs.prior_messages)
        assert _texts(params.messages[: params.pre_prompt_message_count]) == _texts(
            obs.prior_messages
        )
        new_messages = params.messages[params.pre_prompt_message_count :]
        path_failed = ex.faults.get("after_turn") == "raise"
    elif "ingest_batch" not in ex.omit:
        assert len(batches) == 1
        assert not ingests
        new_messages = batches[0].params.messages
        path_failed = ex.faults.get("ingest_batch") == "raise"
    else:
        new_messages = [call.params.message for call in ingests]
        path_failed = "ingest" in ex.omit or ex.faults.get("ingest") == "raise"
        if "ingest" in ex.omit:
            assert not ingests
    if new_messages or "ingest" not in ex.omit:
        # The engine is handed this turn exactly once: the raw prompt, then Codex's messages.
        assert sum(_is_prompt(m, prompt) for m in new_messages) == 1
        assert _texts(new_messages) == _texts(result.messages_snapshot)
    assert (T.FINALIZE_FAILED in triggers) == path_failed

    # Turn maintenance: only after a finalize, and only when the table allowed it.
    maintained = TurnState.MAINTAINING.name in [e.dest for e in result.trace]
    assert turn_phase.count("maintain") == (1 if maintained else 0)


# --- strategies ---------------------------------------------------------------------------

_prompt_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=20
).map(lambda s: f"{s} question")


@st.composite
def codex_scripts(draw: st.DrawFn) -> CodexScript:
    ending: Ending = draw(st.sampled_from(ENDINGS_WEIGHTED))
    turn_start_error = draw(
        st.sampled_from(
            [None] * 14
            + [
                AppServerRpcError(-32600, "turn/start refused"),
                AppServerTimeout("turn/start timed out", method="turn/start", seconds=1),
                AppServerClosed("codex app-server exited", returncode=1),
            ]
        )
    )
    return CodexScript(
        reply=REPLY,
        reasoning=draw(st.sampled_from([None, "Let me think."])),
        ending=ending,
        compaction=draw(st.sampled_from(["none", "none", "completed", "started_only", "legacy"])),
        partial=draw(st.sampled_from([None, PARTIAL])),
        usage=draw(st.sampled_from([None, CodexScript().usage])),
        turn_start_error=turn_start_error,
    )


ENDINGS_WEIGHTED: list[Ending] = [
    "completed",
    "completed",
    "completed",
    "failed",
    "interrupted",
    "yield",
    "yield",
    "hang",
    "closed",
    "cancel",
]


@st.composite
def faults_for(draw: st.DrawFn) -> dict[str, Any]:
    methods = draw(st.frozensets(st.sampled_from(sorted(INVALID_RESULTS)), max_size=3).map(sorted))
    faults: dict[str, Any] = {}
    for method in methods:
        if draw(st.sampled_from([True, True, False])):
            faults[method] = "raise"
        else:
            faults[method] = ("invalid", draw(st.sampled_from(INVALID_RESULTS[method])))
    return faults


@st.composite
def examples(draw: st.DrawFn) -> Example:
    engine: EngineKind = draw(
        st.sampled_from(["none", "legacy", "legacy_recording"] + ["recording"] * 5)
    )
    omit = draw(st.frozensets(st.sampled_from(sorted(OPTIONAL_METHODS))))
    faults = draw(faults_for()) if engine == "recording" else {}
    return Example(
        engine=engine,
        omit=omit,
        maintenance_mode=draw(st.sampled_from(["foreground", "foreground", "background"])),
        scheduler=draw(st.booleans()),
        faults=faults,
        assemble_mode=draw(
            st.sampled_from(["passthrough", "addition", "bootstrap_epoch", "new_epoch", "weird"])
        ),
        prior=draw(
            st.sampled_from(
                [
                    "none",
                    "empty_file",
                    "transcript",
                    "corrupt",
                    "setup_same",
                    "setup_same",
                    "setup_no_engine",
                ]
            )
        ),
        mirror_fault=draw(st.sampled_from([False, False, False, True])),
        script=draw(codex_scripts()),
        timeout_kind=draw(st.sampled_from(["idle", "turn"])),
        start_error=draw(
            st.sampled_from(
                [None] * 12
                + [
                    AppServerRpcError(-32603, "thread/start failed"),
                    AppServerClosed("codex app-server exited", returncode=1),
                    AppServerStartError("codex binary missing"),
                ]
            )
        ),
        resume_error=draw(
            st.sampled_from(
                [
                    None,
                    None,
                    ThreadNotFound(-32600, "no rollout found for thread id t"),
                    AppServerRpcError(-32603, "failed to read thread: bad rollout"),
                    AppServerTimeout("thread/resume timed out"),
                ]
            )
        ),
        yield_tool=draw(st.booleans()),
        base_instructions=draw(st.booleans()),
        hooks_raise=draw(st.booleans()),
        cancel_before_codex=draw(st.sampled_from([False] * 9 + [True])),
        on_turn_end_raises=draw(st.booleans()),
        prompt_text=draw(_prompt_text),
    )


def _max_examples() -> int:
    return min(settings().max_examples, 300)


def is_baseline_input(result: TurnResult, text: str, prompt: str) -> bool:
    """The turn input without an engine's context: the raw prompt, or, when the continuity
    table read the transcript for it (a fresh thread of a session with history, or a
    resumed one the transcript outgrew), the frame of it ending with the prompt."""
    decision = result.thread_decision
    if decision is not None and decision.from_transcript:
        return text.startswith(CONTEXT_HEADER) and text.endswith(prompt.strip())
    return text == prompt


@settings(
    max_examples=_max_examples(),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ex=examples())
def test_fault_injection_property(ex: Example) -> None:
    obs = run_sync(ex)
    check(obs)
    result = obs.final
    triggers = {e.trigger for e in result.trace}
    event(f"outcome={result.outcome.value}")
    event(f"engine={ex.engine}")
    event(f"prior={ex.prior}")
    event(f"maintenance={result.maintenance.status}")
    for trigger in (T.MIRROR_FAILED, T.FINALIZE_FAILED, T.BOOTSTRAP_FAILED, T.ASSEMBLE_FAILED):
        if trigger in triggers:
            event(f"trigger={trigger.value}")
    if result.thread_decision is not None:
        event(f"thread={result.thread_decision.reason}")


# --- focused regressions: one per failure kind ---------------------------------------------


def _run(**fields: Any) -> Observed:
    """Run one example with the general invariants checked, for the focused tests below."""
    obs = run_sync(Example(**fields))
    check(obs)
    return obs


def _triggers(obs: Observed) -> list[str]:
    return [e.trigger for e in obs.final.trace]


def _new_messages(obs: Observed) -> list[dict[str, Any]]:
    call = obs.engine.only_call("after_turn")
    return call.params.messages[call.params.pre_prompt_message_count :]


def test_healthy_turn_runs_every_stage_and_maintains() -> None:
    obs = _run(prior="transcript")
    result = obs.final
    assert result.outcome is TurnOutcome.COMPLETED
    assert obs.engine.methods() == ["bootstrap", "maintain", "assemble", "after_turn", "maintain"]
    assert result.maintenance.status == "ran"
    assert _texts(obs.transcript)[-2:] == [
        ("user", obs.prompt),
        ("assistant", [{"type": "text", "text": REPLY}]),
    ]


@pytest.mark.parametrize("fault", ["raise", ("invalid", 5), ("invalid", {"bootstrapped": "x"})])
def test_bootstrap_failure_continues_without_bootstrap_maintenance(fault: Any) -> None:
    obs = _run(prior="transcript", faults={"bootstrap": fault})
    assert T.BOOTSTRAP_FAILED in _triggers(obs)
    assert obs.engine.methods() == ["bootstrap", "assemble", "after_turn", "maintain"]
    assert obs.final.outcome is TurnOutcome.COMPLETED
    assert obs.final.maintenance.status == "ran"


def test_no_bootstrap_for_a_new_session_although_the_turn_creates_the_file() -> None:
    obs = _run(prior="none")
    assert T.BOOTSTRAP_SKIPPED in _triggers(obs)
    assert "bootstrap" not in obs.engine.methods()
    # The mirror created the file: read back from disk, it holds exactly this turn.
    assert _texts(obs.transcript) == [
        ("user", obs.prompt),
        ("assistant", [{"type": "text", "text": REPLY}]),
    ]
    assert sum(_is_prompt(m, obs.prompt) for m in obs.transcript) == 1


@pytest.mark.parametrize(
    "fault",
    ["raise", ("invalid", None), ("invalid", {"messages": 5}), ("invalid", {"messages": [1]})],
)
def test_assemble_failure_uses_the_baseline_prompt(fault: Any) -> None:
    obs = _run(prior="transcript", assemble_mode="addition", faults={"assemble": fault})
    triggers = _triggers(obs)
    assert T.ASSEMBLE_FAILED in triggers
    assert T.PROJECTED not in triggers
    # A fresh thread of a session with history: the baseline carries the transcript.
    (text,) = obs.server.turn_inputs()
    assert is_baseline_input(obs.final, text, obs.prompt)
    assert text != obs.prompt
    (call,) = obs.server.calls_to("start_thread")
    assert call.args["developer_instructions"] == BASE  # no engine addition
    assert obs.final.outcome is TurnOutcome.COMPLETED
    assert obs.final.maintenance.status == "ran"  # an assemble failure does not gate it


def test_assembled_addition_is_appended_to_the_base_instructions() -> None:
    obs = _run(prior="transcript", assemble_mode="addition")
    (call,) = obs.server.calls_to("start_thread")
    assert call.args["developer_instructions"].startswith(BASE)
    assert call.args["developer_instructions"].endswith(ADDITION)
    (text,) = obs.server.turn_inputs()
    assert obs.prompt in text
    assert text != obs.prompt  # the projected prompt frames history
    assert obs.final.projected


@pytest.mark.parametrize(
    ("omit", "method"),
    [(frozenset(), "after_turn"), (frozenset({"after_turn"}), "ingest_batch")],
)
def test_finalize_failure_skips_maintenance(omit: frozenset[str], method: str) -> None:
    obs = _run(omit=omit, faults={method: "raise"})
    assert T.FINALIZE_FAILED in _triggers(obs)
    assert obs.engine.methods() == ["assemble", method]
    assert obs.final.maintenance.status == "skipped"
    assert obs.final.maintenance.skip_reason == "finalize_failed"
    assert sum(_is_prompt(m, obs.prompt) for m in obs.transcript) == 1


def test_ingest_failure_continues_with_the_other_messages() -> None:
    obs = _run(
        omit=frozenset({"after_turn", "ingest_batch"}),
        faults={"ingest": "raise"},  # fails the user's message only
        script=CodexScript(reply=REPLY, reasoning="Let me think."),
    )
    ingests = obs.engine.calls_to("ingest")
    assert [c.params.message["role"] for c in ingests] == ["user", "assistant", "assistant"]
    assert [c.error is not None for c in ingests] == [True, False, False]
    assert obs.final.maintenance.skip_reason == "finalize_failed"


@pytest.mark.parametrize("required", ["assemble", "ingest"])
def test_an_engine_without_a_required_method_is_refused_up_front(required: str) -> None:
    # Such an engine used to run, failing its stage's edge with a warning only.
    from codex_turn.harness.engine import EngineContractError

    obs = run_sync(Example(omit=frozenset({"after_turn", "ingest_batch", required})))
    assert isinstance(obs.raised, EngineContractError)
    assert f"missing {required}" in str(obs.raised)
    assert obs.engine.calls == []
    assert obs.server.calls == []


@pytest.mark.parametrize("fault", ["raise", ("invalid", "nope")])
def test_maintenance_failure_never_fails_the_turn(fault: Any) -> None:
    obs = _run(faults={"maintain": fault})
    assert obs.final.outcome is TurnOutcome.COMPLETED
    assert obs.final.maintenance.status == "failed"
    assert _triggers(obs)[-1] == T.MAINTENANCE_FAILED


@pytest.mark.parametrize(
    ("script", "outcome", "skip", "error"),
    [
        (CodexScript(ending="failed", partial=PARTIAL), TurnOutcome.FAILED, "prompt_error", "no"),
        (CodexScript(ending="interrupted"), TurnOutcome.ABORTED, "aborted", None),
        (
            CodexScript(ending="closed", partial=PARTIAL),
            TurnOutcome.FAILED,
            "prompt_error",
            "closed",
        ),
        (
            CodexScript(turn_start_error=AppServerRpcError(-32600, "turn/start refused")),
            TurnOutcome.FAILED,
            "prompt_error",
            "refused",
        ),
    ],
)
def test_codex_failures_are_mirrored_and_finalized(
    script: CodexScript, outcome: TurnOutcome, skip: str, error: str | None
) -> None:
    obs = _run(script=script)
    result = obs.final
    assert result.outcome is outcome
    assert result.maintenance.skip_reason == skip
    if error is None:
        assert result.prompt_error is None
    else:
        assert result.prompt_error is not None
        assert error in result.prompt_error
    # The engine saw the turn exactly once, and the prompt is mirrored exactly once.
    assert sum(_is_prompt(m, obs.prompt) for m in _new_messages(obs)) == 1
    assert sum(_is_prompt(m, obs.prompt) for m in obs.transcript) == 1
    assert "maintain" not in obs.engine.methods()


def test_yield_tool_ends_the_run_as_yield_aborted() -> None:
    obs = _run(yield_tool=True, script=CodexScript(reply=REPLY, ending="yield"))
    assert obs.final.outcome is TurnOutcome.YIELD_ABORTED
    assert obs.final.maintenance.skip_reason == "yield_aborted"
    assert obs.server.methods().count("interrupt") == 1
    (tool_call,) = obs.server.calls_to("tool_call")
    assert tool_call.args == {"name": "sessions_yield", "success": True}


def test_yield_without_the_tool_offered_completes() -> None:
    obs = _run(yield_tool=False, script=CodexScript(reply=REPLY, ending="yield"))
    assert obs.final.outcome is TurnOutcome.COMPLETED
    (tool_call,) = obs.server.calls_to("tool_call")
    assert tool_call.args["success"] is False  # "unknown tool" for the model


@pytest.mark.parametrize(("kind", "words"), [("idle", "idle for"), ("turn", "timed out after")])
def test_timeouts_interrupt_and_end_as_prompt_errors(kind: str, words: str) -> None:
    obs = _run(script=CodexScript(ending="hang", partial=PARTIAL), timeout_kind=kind)
    result = obs.final
    assert result.outcome is TurnOutcome.TIMED_OUT
    assert result.prompt_error is not None
    assert words in result.prompt_error
    assert obs.server.methods().count("interrupt") == 1
    assert result.maintenance.skip_reason == "prompt_error"
    assert sum(_is_prompt(m, obs.prompt) for m in obs.transcript) == 1


@pytest.mark.parametrize(
    "error",
    [
        AppServerRpcError(-32603, "thread/start failed"),
        AppServerClosed("codex app-server exited"),
        AppServerStartError("codex binary missing"),
    ],
)
def test_thread_start_failure_is_terminal_and_nothing_is_mirrored(error: AppServerError) -> None:
    obs = _run(prior="transcript", start_error=error)
    result = obs.final
    assert result.outcome is TurnOutcome.THREAD_START_FAILED
    assert result.trace[-1].dest == "FAILED"
    assert result.prompt_error
    assert obs.engine.methods() == ["bootstrap", "maintain", "assemble"]  # no finalize
    assert not any(_is_prompt(m, obs.prompt) for m in obs.transcript)
    assert result.maintenance == attrs.evolve(result.maintenance, status="skipped")


def test_resume_failure_rotates_with_the_projected_context() -> None:
    obs = _run(
        prior="setup_same",
        assemble_mode="bootstrap_epoch",
        resume_error=ThreadNotFound(-32600, "no rollout found for thread id t"),
    )
    result = obs.final
    decision = result.thread_decision
    assert decision is not None
    assert (decision.action, decision.reason, decision.project) == (
        ThreadAction.ROTATE,
        "resume-failed",
        True,
    )
    assert obs.server.methods()[:2] == ["resume_thread", "start_thread"]
    (text,) = obs.server.turn_inputs()
    assert text != obs.prompt
    assert "earlier?" in text  # the fresh thread gets the history
    assert obs.binding.thread_id == result.thread_id != obs.server.calls[0].args["thread_id"]


def test_matching_epoch_resumes_with_the_raw_prompt() -> None:
    obs = _run(prior="setup_same", assemble_mode="bootstrap_epoch")
    assert obs.final.thread_decision.action is ThreadAction.RESUME
    assert obs.server.turn_inputs() == [obs.prompt.strip()]


def test_mirror_failure_finalizes_from_history_plus_snapshot() -> None:
    obs = _run(prior="transcript", mirror_fault=True)
    result = obs.final
    assert T.MIRROR_FAILED in _triggers(obs)
    # The reply could not be written; the user's words were made durable before the turn.
    assert _texts(obs.transcript) == _texts(obs.prior_messages + result.messages_snapshot[:1])
    params = obs.engine.only_call("after_turn").params
    assert _texts(params.messages) == _texts(obs.prior_messages + result.messages_snapshot)
    assert params.pre_prompt_message_count == len(obs.prior_messages)
    assert result.maintenance.status == "ran"  # a mirror failure does not gate maintenance


def test_foreign_transcript_is_never_written() -> None:
    # Refused before anything reaches Codex (it used to run the model, then fail to
    # mirror), with a typed error; the foreign file is untouched.
    obs = _run(prior="corrupt")
    assert obs.prior_messages == []
    assert obs.transcript == []
    assert isinstance(obs.raised, TranscriptUnwritable)
    assert _triggers(obs) == [T.STARTED, T.TRANSCRIPT_UNWRITABLE]
    assert obs.server.calls == []


def test_cancel_mid_turn_interrupts_mirrors_finalizes_and_propagates() -> None:
    obs = _run(prior="transcript", script=CodexScript(ending="cancel", partial=PARTIAL))
    assert obs.caller_cancelled
    assert obs.result is None
    result = obs.final
    assert result.outcome is TurnOutcome.ABORTED
    assert result.maintenance.skip_reason == "aborted"
    assert obs.server.methods().count("interrupt") == 1
    assert sum(_is_prompt(m, obs.prompt) for m in obs.transcript) == 1
    assert obs.engine.methods()[-1] == "after_turn"


def test_cancel_before_codex_ends_cancelled_without_finalize() -> None:
    obs = _run(prior="transcript", cancel_before_codex=True)
    assert obs.caller_cancelled
    assert obs.final.outcome is TurnOutcome.CANCELLED
    assert obs.engine.methods() == ["bootstrap", "maintain", "assemble"]
    assert not obs.server.calls_to("turn")


@pytest.mark.parametrize("compaction", ["completed", "started_only", "legacy"])
def test_native_compaction_is_internal_and_hook_failures_are_ignored(compaction: str) -> None:
    obs = _run(script=CodexScript(reply=REPLY, compaction=compaction), hooks_raise=True)
    result = obs.final
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.native_compactions == (0 if compaction == "started_only" else 1)
    assert obs.hook_calls.count("diagnostic") == (2 if compaction == "completed" else 1)
    assert result.maintenance.status == "ran"


def test_background_engine_without_scheduler_maintains_inline() -> None:
    # Regression: the turn table used to expect "deferred" and raised IllegalTransition.
    obs = _run(maintenance_mode="background", scheduler=False)
    assert obs.final.maintenance.status == "ran"
    assert obs.engine.methods() == ["assemble", "after_turn", "maintain"]


def test_background_engine_with_scheduler_defers() -> None:
    obs = _run(maintenance_mode="background", scheduler=True)
    assert obs.final.maintenance.status == "deferred"
    assert _triggers(obs)[-1] == T.MAINTENANCE_DEFERRED
    maintain = obs.engine.only_call("maintain")  # ran in the background, after the turn
    assert maintain.params.runtime_context["allowDeferredCompactionExecution"] is True


@pytest.mark.parametrize("engine", ["none", "legacy", "legacy_recording"])
def test_no_engine_is_plain_codex(engine: EngineKind) -> None:
    obs = _run(engine=engine, prior="transcript")
    triggers = _triggers(obs)
    assert T.ASSEMBLE_SKIPPED in triggers
    assert T.BOOTSTRAP_SKIPPED in triggers
    assert obs.final.maintenance.skip_reason == "no_engine"
    # Plain Codex, whose fresh thread carries the session's transcript (never empty).
    (text,) = obs.server.turn_inputs()
    assert is_baseline_input(obs.final, text, obs.prompt)
    assert text != obs.prompt
    assert obs.server.calls_to("start_thread")[0].args["developer_instructions"] == BASE


def test_engine_without_maintain_skips_as_no_maintain() -> None:
    obs = _run(omit=frozenset({"maintain"}))
    assert obs.final.maintenance.skip_reason == "no_maintain"


# --- a cancellation after Codex finished (regressions for the late-cancel fix) --------------


def _late_cancel(method: str, *, script: CodexScript | None = None) -> Observed:
    """Cancel the caller from inside ``engine.<method>`` (after Codex finished)."""
    ex = Example(script=script or CodexScript(reply=REPLY))
    workdir = tempfile.mkdtemp(prefix="codex-turn-faults-")

    async def main() -> Observed:
        session_file = os.path.join(workdir, "session.jsonl")
        server = FakeAppServer(scripts=[ex.script])
        obs = Observed(ex, "late cancel?", session_file, server, None)

        async def on_turn_end(result: TurnResult) -> None:
            obs.delivered.append(result)

        with anyio.CancelScope() as caller:
            server.cancel_caller = caller.cancel

            async def cancel_then_wait(params: Any) -> None:
                caller.cancel()
                await anyio.sleep(5)

            obs.engine = RecordingEngine(responses={method: cancel_then_wait})
            params = attrs.evolve(
                _params(ex, session_file, workdir, obs.prompt), cleanup_timeout=0.2
            )
            obs.result = await run_codex_turn(
                params, app_server=server, engine=obs.engine, on_turn_end=on_turn_end
            )
        obs.caller_cancelled = caller.cancelled_caught
        obs.transcript = [dict(m) for m in load_session_messages(session_file)]
        clear_session_cache(session_file)
        return obs

    try:
        return anyio.run(main)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize(
    ("method", "script", "outcome", "last", "maintenance"),
    [
        # cancelled during the Codex turn, then the cleanup deadline cuts after_turn
        (
            "after_turn",
            CodexScript(ending="cancel"),
            TurnOutcome.ABORTED,
            T.FINALIZE_FAILED,
            ("skipped", "aborted"),
        ),
        # the caller leaves while the engine finalizes a completed turn
        (
            "after_turn",
            None,
            TurnOutcome.COMPLETED,
            T.FINALIZE_FAILED,
            ("skipped", "finalize_failed"),
        ),
        # ... or while it maintains
        ("maintain", None, TurnOutcome.COMPLETED, T.MAINTENANCE_FAILED, ("cancelled", None)),
    ],
)
def test_cleanup_cut_short_is_delivered_with_a_complete_trace(
    method: str,
    script: CodexScript | None,
    outcome: TurnOutcome,
    last: TurnTrigger,
    maintenance: tuple[str, str | None],
) -> None:
    obs = _late_cancel(method, script=script)
    assert obs.caller_cancelled
    assert obs.result is None
    (result,) = obs.delivered
    assert result.outcome is outcome
    assert result.trace[-1].trigger == last
    assert result.trace[-1].dest == "DONE"
    check_trace_is_legal(attrs.evolve(obs.example, prior="none"), result)
    assert (result.maintenance.status, result.maintenance.skip_reason) == maintenance
    assert obs.engine.methods().count("after_turn") == 1  # never re-run after the cut
    assert sum(_is_prompt(m, obs.prompt) for m in obs.transcript) == 1


def test_a_cancellation_while_mirroring_still_lets_the_engine_see_the_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller leaves after Codex finished, while the transcript is being written: the
    mirror completes and finalize still runs (bounded), so the engine never misses a turn
    that reached the transcript (OpenClaw #121515), and the cancellation then propagates."""
    import codex_turn.harness.turn.stages as orchestrator  # where the mirror stage lives

    ex = Example(script=CodexScript(reply=REPLY))
    workdir = tempfile.mkdtemp(prefix="codex-turn-faults-")
    real_mirror = orchestrator.mirror_turn
    cancel: list[Any] = []  # the caller's cancel, and the loop's token

    def mirror_then_cancel(*args: Any, **kwargs: Any) -> Any:
        # Runs in a worker thread: the caller leaves (on the event loop) while it writes.
        anyio.from_thread.run_sync(cancel[0], token=cancel[1])
        return real_mirror(*args, **kwargs)

    monkeypatch.setattr(orchestrator, "mirror_turn", mirror_then_cancel)
    delivered: list[TurnResult] = []

    async def on_turn_end(result: TurnResult) -> None:
        delivered.append(result)

    async def main() -> tuple[bool, RecordingEngine, list[dict[str, Any]]]:
        session_file = os.path.join(workdir, "session.jsonl")
        engine = RecordingEngine()
        with anyio.CancelScope() as caller:
            cancel.extend([caller.cancel, anyio.lowlevel.current_token()])
            await run_codex_turn(
                _params(ex, session_file, workdir, "mirror me"),
                app_server=FakeAppServer(scripts=[ex.script]),
                engine=engine,
                on_turn_end=on_turn_end,
            )
        transcript = [dict(m) for m in load_session_messages(session_file)]
        clear_session_cache(session_file)
        return caller.cancelled_caught, engine, transcript

    try:
        cancelled, engine, transcript = anyio.run(main)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert cancelled
    (result,) = delivered
    triggers = [entry.trigger for entry in result.trace]
    assert triggers[-4:-1] == ["turn_completed", "mirrored", "finalized"]
    assert len(engine.calls_to("after_turn")) == 1
    assert engine.calls_to("maintain") == []  # the caller is gone: maintenance is cut
    assert sum(_is_prompt(m, "mirror me") for m in transcript) == 1


# --- single scenarios, async: each failed before its fix -------------------------------------
#
# Against the in-process fake app-server, whose turn handle and projector are the product's own.


CONTEXT_HEADER = "OpenClaw assembled context for this turn:"


def bootstrap_engine(epoch: str = "e1") -> RecordingEngine:
    return RecordingEngine(
        engine_id="memory",
        responses={
            "assemble": lambda p: AssembleResult(
                messages=[*p.messages, {"role": "assistant", "content": "MEMORY-FACT-314"}],
                estimated_tokens=1,
                context_projection=ContextProjection(mode="thread_bootstrap", epoch=epoch),
            )
        },
    )


def refused() -> AppServerRpcError:
    return AppServerRpcError(-32600, "turn/start refused")


async def test_two_turns_refused_by_codex_keep_both_prompts(session_file: str) -> None:
    # B1: both prompt-only results used to share the key "<thread>:unknown-turn:prompt".
    server = FakeAppServer(
        scripts=[
            CodexScript(),
            CodexScript(turn_start_error=refused()),
            CodexScript(turn_start_error=refused()),
        ]
    )
    for prompt in ("first prompt", "second prompt", "third prompt"):
        await run_codex_turn(params(session_file, prompt), app_server=server)
    assert [t for t in transcript_texts(session_file) if t.endswith("prompt")] == [
        "first prompt",
        "second prompt",
        "third prompt",
    ]


async def test_an_unreadable_transcript_is_a_history_read_failure_not_an_empty_history(
    session_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # B2: the read failure was swallowed into [] and finalize handed the engine nothing.
    import codex_turn.harness.history_cache as orchestrator  # where the stages read the transcript
    from codex_turn.harness.session import SessionError

    mirror_turn(
        session_file,
        [{"role": "user", "content": "old", "timestamp": 1}],
        scope="seed",
        identities=["a"],
        session_id="s-1",
        cwd="/",
    )
    real = orchestrator.load_session_context

    def failing(path: Any) -> Any:
        raise SessionError("disk on fire")

    monkeypatch.setattr(orchestrator, "load_session_context", failing)
    engine = RecordingEngine(omit={"after_turn", "ingest_batch"})
    result = await run_codex_turn(
        params(session_file, "new question"), app_server=FakeAppServer(), engine=engine
    )
    monkeypatch.setattr(orchestrator, "load_session_context", real)
    triggers = [e.trigger for e in result.trace]
    assert triggers[1] == "history_read_failed"
    # Finalize fell back to history + this turn's snapshot: the engine saw the new messages.
    ingested = [c.params.message for c in engine.calls_to("ingest")]
    assert ingested[0].get("content") == "new question"


async def test_a_bootstrap_epoch_is_recorded_only_after_codex_accepted_the_turn(
    session_file: str,
) -> None:
    # B3: the epoch was bound before turn/start; a refused turn/start then made the next
    # turn resume a thread that never received the context.
    server = FakeAppServer(scripts=[CodexScript(turn_start_error=refused()), CodexScript()])
    engine = bootstrap_engine()
    failed = await run_codex_turn(params(session_file, "first"), app_server=server, engine=engine)
    assert failed.outcome is TurnOutcome.FAILED
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.context_engine is not None
    assert binding.context_engine.projection is None
    second = await run_codex_turn(params(session_file, "second"), app_server=server, engine=engine)
    assert second.thread_decision is not None
    assert second.thread_decision.reason == "thread-bootstrap-epoch-changed"
    assert second.projected
    assert "MEMORY-FACT-314" in server.turn_inputs()[-1]
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.context_engine is not None
    assert binding.context_engine.projection is not None
    assert binding.context_engine.projection.epoch == "e1"


async def test_a_mapping_info_in_background_mode_is_honoured(session_file: str) -> None:
    # B4: the lifecycle read the mode with getattr (always foreground for a mapping) while
    # the turn's facts said background: IllegalTransition escaped after mirror and finalize.
    engine = RecordingEngine()
    object.__setattr__(
        engine, "info", {"id": "mapped", "name": "Mapped", "turnMaintenanceMode": "background"}
    )
    async with BackgroundMaintenance() as scheduler:
        result = await run_codex_turn(
            params(session_file, "hello there"),
            app_server=FakeAppServer(),
            engine=engine,
            maintenance_scheduler=scheduler,
        )
        await scheduler.drain()
    assert result.maintenance.status == "deferred"
    assert [e.trigger for e in result.trace][-1] == "maintenance_deferred"


async def test_an_engine_with_an_invalid_info_is_refused_before_the_turn_starts(
    session_file: str,
) -> None:
    # It used to run the turn as plain Codex, with a warning only.
    from codex_turn.harness.engine import EngineContractError

    engine = RecordingEngine()
    object.__setattr__(engine, "info", {"id": "broken"})  # no name
    server = FakeAppServer()
    with pytest.raises(EngineContractError, match="invalid info"):
        await run_codex_turn(params(session_file, "hello there"), app_server=server, engine=engine)
    assert engine.calls == []
    assert server.calls == []


@pytest.mark.parametrize(
    "bad",
    [{"prependContext": "x"}, PromptBuildResult(prepend_context=42)],  # type: ignore[arg-type]
    ids=["dict", "non-string-field"],
)
async def test_a_hook_returning_garbage_is_ignored_like_a_failing_hook(
    session_file: str, bad: Any
) -> None:
    # B5: the hook's result was used outside the try: AttributeError escaped the turn.
    async def garbage(_: Any) -> Any:
        return bad

    async def good(_: Any) -> PromptBuildResult:
        return PromptBuildResult(prepend_context="GOOD-HOOK-CONTEXT")

    server = FakeAppServer()
    result = await run_codex_turn(
        params(session_file, "hello there"),
        app_server=server,
        hooks=TurnHooks(before_prompt_build=[garbage, good]),
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert server.turn_inputs()[-1] == "GOOD-HOOK-CONTEXT\n\nhello there"


async def test_a_huge_projection_is_capped_inside_the_frame(session_file: str) -> None:
    # B7: the 1 MiB cut ran over the whole framed prompt and removed the frame's header.
    # Ten 120k-char messages (each under the 128k per-part cap): 1.2M chars of context.
    many = [{"role": "assistant", "content": f"{i}" + "y" * 120_000} for i in range(10)]
    engine = RecordingEngine(
        responses={"assemble": lambda p: AssembleResult(messages=many, estimated_tokens=1)}
    )
    prompt = "p" * 60_000
    server = FakeAppServer()
    await run_codex_turn(
        params(session_file, prompt, context_token_budget=400_000), app_server=server, engine=engine
    )
    text = server.turn_inputs()[-1]
    assert len(text) <= TURN_START_TEXT_MAX_CHARS
    assert text.startswith(CONTEXT_HEADER)
    assert "quoted reference data" in text
    assert text.endswith(prompt)


async def test_a_rotation_releases_the_old_thread_s_local_state(session_file: str) -> None:
    # B11: per-thread tool registries and memos were kept forever (one per rotated turn).
    server = FakeAppServer()
    first = await run_codex_turn(
        params(session_file, "one"), app_server=server, engine=bootstrap_engine("e1")
    )
    second = await run_codex_turn(
        params(session_file, "two"), app_server=server, engine=bootstrap_engine("e2")
    )
    assert second.thread_id != first.thread_id
    assert server.forgotten == [first.thread_id]


async def test_a_compaction_waits_for_the_running_turn_of_its_session(session_file: str) -> None:
    # B10: compaction did not take the session gate; a turn could undo its projection clear.
    import anyio

    from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session

    order: list[str] = []
    engine = RecordingEngine(
        owns_compaction=True,
        delays={"after_turn": 0.3},
        responses={
            "after_turn": lambda _: order.append("turn finalized"),
            "compact": lambda _: (
                order.append("engine compacts")
                or {"ok": True, "compacted": False, "reason": "below threshold"}
            ),
        },
    )
    server = FakeAppServer()

    async def turn() -> None:
        await run_codex_turn(params(session_file, "long turn"), app_server=server, engine=engine)

    async with anyio.create_task_group() as group:
        group.start_soon(turn)
        await anyio.sleep(0.1)  # the turn holds the gate while the engine finalizes
        result = await compact_codex_session(
            CompactSessionParams(session_id="s-1", session_file=session_file),
            app_server=no_app_server,
            engine=engine,
        )
    assert order == ["turn finalized", "engine compacts"]
    assert result.reason == "below threshold"


def no_app_server(_auth_profile: str | None) -> Any:
    """An app-server factory for tests whose native step must fail fast."""
    from codex_turn.harness.appserver import AppServerStartError

    raise AppServerStartError("no app-server in this test")


async def test_deferred_maintenance_waits_until_the_session_s_turn_is_over(
    session_file: str,
) -> None:
    # B12: background maintenance ran concurrently with the turn that scheduled it.
    from codex_turn.harness._gates import session_lane_busy

    seen: list[bool] = []

    def maintain(_: Any) -> dict[str, Any]:
        seen.append(session_lane_busy("agent:main:s-1"))
        return {"changed": False, "bytesFreed": 0, "rewrittenEntries": 0}

    async def linger(_: Any) -> None:
        # Still inside the turn (the session is held): the scheduler gets time to run.
        import anyio

        await anyio.sleep(0.1)

    engine = RecordingEngine(turn_maintenance_mode="background", responses={"maintain": maintain})
    async with BackgroundMaintenance(poll_interval=0.01) as scheduler:
        result = await run_codex_turn(
            params(session_file, "hello there"),
            app_server=FakeAppServer(),
            engine=engine,
            maintenance_scheduler=scheduler,
            on_turn_end=linger,
        )
        assert result.maintenance.status == "deferred"
        await scheduler.drain()
    assert seen == [False]  # it ran, and only once the turn had released its session


@pytest.mark.parametrize(
    ("method", "trigger"),
    [
        ("bootstrap", "bootstrap_failed"),
        ("assemble", "assemble_failed"),
        ("after_turn", "finalize_failed"),
        ("maintain", "maintenance_failed"),
    ],
)
async def test_a_hung_engine_call_takes_its_stage_s_failure_edge(
    session_file: str, method: str, trigger: str
) -> None:
    # A hung engine used to hold the session (and the caller) forever.
    mirror_turn(
        session_file,
        [{"role": "user", "content": "earlier", "timestamp": 1}],
        scope="seed",
        identities=["a"],
        session_id="s-1",
        cwd="/",
    )
    engine = RecordingEngine(delays={method: 30.0})
    server = FakeAppServer()
    result = await run_codex_turn(
        params(session_file, "hello there", engine_timeout=0.2), app_server=server, engine=engine
    )
    triggers = [e.trigger for e in result.trace]
    assert trigger in triggers
    assert result.trace[-1].dest == "DONE"
    assert result.outcome is TurnOutcome.COMPLETED
    assert transcript_texts(session_file).count("hello there") == 1
    if method == "assemble":
        # The baseline prompt, on a fresh thread with the transcript before it.
        assert is_baseline_input(result, server.turn_inputs()[-1], "hello there")
        assert server.turn_inputs()[-1] != "hello there"


async def test_a_turn_without_tools_gets_a_transient_thread_and_keeps_the_binding(
    session_file: str,
) -> None:
    # B16 (OpenClaw 2.11): a no-tools turn after tooled ones must not rotate the binding away.
    from codex_turn import DynamicTool

    async def lookup(_: dict[str, Any]) -> str:
        return "found"

    tools = [DynamicTool("lookup", "Look something up.", {"type": "object"}, lookup)]
    server = FakeAppServer()
    tooled = await run_codex_turn(
        params(session_file, "with tools"), app_server=server, tools=tools
    )
    bare = await run_codex_turn(params(session_file, "heartbeat"), app_server=server)
    assert bare.thread_decision is not None
    assert bare.thread_decision.action.value == "transient"
    assert bare.thread_id != tooled.thread_id
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.thread_id == tooled.thread_id  # kept
    assert server.forgotten == [bare.thread_id]
    again = await run_codex_turn(
        params(session_file, "tools again"), app_server=server, tools=tools
    )
    assert again.thread_id == tooled.thread_id
    assert again.thread_decision is not None
    assert again.thread_decision.action.value == "resume"
