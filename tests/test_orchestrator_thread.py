"""A turn's thread and context through the orchestrator: the context-loss fallback (a policy or
tools change on a bound thread without context), resumes that are refused or time out, the
hooks' view of the projected prompt, and what the turn reports beside them (prompt cache,
runtime policy, diagnostics).

The fast ones run against the in-process fake app-server (whose turn handle and projector are
the product's own); the context-loss rule is proven end to end against the real binary: the
model request of the fallback turn contains the earlier turns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.fake_appserver import FakeAppServer
from support.recording_engine import RecordingEngine
from support.turns import turn_params as params

from codex_turn import (
    AppServer,
    AssembleResult,
    ContextProjection,
    DynamicTool,
    PromptBuildContext,
    PromptBuildResult,
    TurnHooks,
    TurnOutcome,
    TurnParams,
    read_binding,
    run_codex_turn,
)
from codex_turn.fsm.thread import ThreadAction
from codex_turn.harness.session import mirror_turn
from codex_turn.harness.turn import forms
from codex_turn.testing import OfflineModel

pytestmark = pytest.mark.anyio

HEADER = "OpenClaw assembled context for this turn:"


def memory_engine() -> RecordingEngine:
    return RecordingEngine(
        engine_id="memory",
        responses={
            "assemble": lambda p: AssembleResult(
                messages=[*p.messages, {"role": "assistant", "content": "MEMORY-FACT-271"}],
                estimated_tokens=1,
                system_prompt_addition="ENGINE-ADDITION",
            )
        },
    )


def failing_assemble_engine() -> RecordingEngine:
    def explode(_: Any) -> AssembleResult:
        raise RuntimeError("assemble exploded")

    return RecordingEngine(engine_id="memory", responses={"assemble": explode})


# --- the context-loss fallback -------------------------------------------------------------


async def test_a_policy_change_without_context_resumes_the_bound_thread(session_file: str) -> None:
    server = FakeAppServer()
    first = await run_codex_turn(params(session_file, "first"), app_server=server)
    assert first.outcome is TurnOutcome.COMPLETED
    # The binding predates the engine; the engine's assemble then fails: no context.
    second = await run_codex_turn(
        params(session_file, "second"), app_server=server, engine=failing_assemble_engine()
    )
    decision = second.thread_decision
    assert decision is not None
    assert (decision.action, decision.reason) == (
        ThreadAction.RESUME,
        "context-unavailable-keep-thread",
    )
    assert second.thread_id == first.thread_id
    assert server.methods()[-2:] == ["resume_thread", "turn"]
    assert server.turn_inputs()[-1] == "second"
    # The binding keeps its (absent) engine record: a later turn with context rotates.
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.context_engine is None
    third = await run_codex_turn(
        params(session_file, "third"), app_server=server, engine=memory_engine()
    )
    assert third.thread_decision is not None
    assert third.thread_decision.reason == "context-engine-policy-changed"
    assert third.projected
    assert "MEMORY-FACT-271" in server.turn_inputs()[-1]


async def test_the_model_keeps_the_conversation_when_the_engine_fails_after_a_policy_change(
    appserver: AppServer, offline_model: OfflineModel, tmp_path: Path, workspace: Path
) -> None:
    """End to end: the request of the fallback turn carries the earlier turn."""
    session = str(tmp_path / "session.jsonl")
    base = {"session_id": "s-1", "session_file": session, "workspace_dir": str(workspace)}
    first = await run_codex_turn(
        TurnParams(prompt="remember the code word PAPAYA-4417", **base), app_server=appserver
    )
    assert first.outcome is TurnOutcome.COMPLETED
    second = await run_codex_turn(
        TurnParams(prompt="what was the code word?", **base),
        app_server=appserver,
        engine=failing_assemble_engine(),
    )
    assert second.outcome is TurnOutcome.COMPLETED
    assert second.thread_id == first.thread_id
    request = offline_model.turn_requests()[-1]
    assert request.last_user_text == "what was the code word?"
    assert any("PAPAYA-4417" in text for text in request.user_messages), (
        "the model lost the conversation"
    )


# --- the hooks see what the engine built; a projection failure keeps the baseline ----------


async def test_before_prompt_build_sees_the_projected_prompt_and_the_engine_addition(
    session_file: str,
) -> None:
    seen: list[PromptBuildContext] = []

    async def hook(context: PromptBuildContext) -> PromptBuildResult:
        seen.append(context)
        return PromptBuildResult()

    server = FakeAppServer()
    result = await run_codex_turn(
        params(session_file, "question", base_developer_instructions="BASE"),
        app_server=server,
        engine=memory_engine(),
        hooks=TurnHooks(before_prompt_build=[hook]),
    )
    assert result.projected
    (context,) = seen
    assert context.prompt.startswith(HEADER)
    assert "MEMORY-FACT-271" in context.prompt
    assert context.developer_instructions == "BASE\n\nENGINE-ADDITION"
    assert server.turn_inputs() == [context.prompt]


async def test_a_projection_failure_keeps_the_baseline_prompt_and_instructions(
    session_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**_: Any) -> Any:
        raise ValueError("projection exploded")

    monkeypatch.setattr(forms, "project_context_engine_assembly", broken)
    server = FakeAppServer()
    result = await run_codex_turn(
        params(session_file, "  question  ", base_developer_instructions="BASE"),
        app_server=server,
        engine=memory_engine(),
    )
    assert [e.trigger for e in result.trace][4] == "projection_failed"
    assert not result.projected
    assert server.turn_inputs() == ["  question  "]
    (start,) = server.calls_to("start_thread")
    assert start.args["developer_instructions"] == "BASE"


# --- smaller contract fixes ----------------------------------------------------------------


async def test_engines_see_the_session_id_as_key_when_the_runner_gives_none(
    session_file: str,
) -> None:
    engine = memory_engine()
    await run_codex_turn(
        params(session_file, "hello", session_key=None), app_server=FakeAppServer(), engine=engine
    )
    (assemble,) = engine.calls_to("assemble")
    assert assemble.params.session_key == "s-1"
    (after,) = engine.calls_to("after_turn")
    assert after.params.session_key == "s-1"
    assert after.params.runtime_context["sessionKey"] == "s-1"


async def test_prompt_cache_comes_from_codex_cached_input_counts(session_file: str) -> None:
    from support.fake_appserver import CodexScript

    usage = {"inputTokens": 1200, "cachedInputTokens": 1000, "outputTokens": 7}
    engine = memory_engine()
    await run_codex_turn(
        params(session_file, "hello"),
        app_server=FakeAppServer(scripts=[CodexScript(usage=usage)]),
        engine=engine,
    )
    (after,) = engine.calls_to("after_turn")
    cache = after.params.runtime_context["promptCache"]
    assert cache["lastCallUsage"]["cacheRead"] == 1000
    assert cache["lastCallUsage"]["input"] == 200
    assert after.params.runtime_context["currentTokenCount"] == 1200


async def test_the_maintenance_skip_is_logged_with_the_spec_line(session_file: str) -> None:
    engine = RecordingEngine(engine_id="memory", omit={"maintain"})
    with capture_logs() as logs:
        result = await run_codex_turn(
            params(session_file, "hello"), app_server=FakeAppServer(), engine=engine
        )
    assert result.maintenance.skip_reason == "no_maintain"
    skipped = [e for e in logs if e["event"] == "codex context engine maintenance skipped"]
    assert [e["reason"] for e in skipped] == ["no_maintain"]


async def test_a_bound_thread_gets_and_records_the_runtime_policy(session_file: str) -> None:
    """A changed policy takes effect on a bound thread without rotating
    it. The service tier is re-sent on resume; the approval policy and sandbox are sent on
    the turn's turn/start (Codex ignores them on a resume of a loaded thread, and
    sent there they became the thread's sticky default). All are recorded in the binding."""
    server = FakeAppServer()
    await run_codex_turn(params(session_file, "one"), app_server=server)
    policy = {"approval_policy": "never", "sandbox": "read-only", "service_tier": "flex"}
    second = await run_codex_turn(params(session_file, "two", **policy), app_server=server)
    (resume,) = server.calls_to("resume_thread")
    assert resume.args["service_tier"] == "flex"
    assert len(server.calls_to("start_thread")) == 1  # the bound thread, not rotated
    assert second.thread_decision is not None
    assert second.thread_decision.action is ThreadAction.RESUME
    overrides = server.turn_overrides[-1]
    assert overrides["approvalPolicy"] == "never"
    assert overrides["sandboxPolicy"]["type"] == "readOnly"
    binding = read_binding(session_file)
    assert binding is not None
    assert (binding.approval_policy, binding.sandbox, binding.service_tier) == (
        "never",
        "read-only",
        "flex",
    )


# --- more thread and turn cases (each failed before its fix) ------------------------------


def _seed(session_file: str, *texts: str) -> None:
    mirror_turn(
        session_file,
        [{"role": "user", "content": text, "timestamp": 1} for text in texts],
        scope="seed",
        identities=[f"m{i}" for i in range(len(texts))],
        session_id="s-1",
        cwd=os.path.dirname(session_file),
    )


def bootstrap_engine() -> RecordingEngine:
    return RecordingEngine(
        engine_id="memory",
        responses={
            "assemble": lambda p: AssembleResult(
                messages=[*p.messages, {"role": "assistant", "content": "MEMORY-FACT-271"}],
                estimated_tokens=1,
                context_projection=ContextProjection(mode="thread_bootstrap", epoch="e1"),
            )
        },
    )


async def test_a_thread_started_without_the_projection_never_claims_its_epoch(
    session_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seed(session_file, "earlier question")
    engine = bootstrap_engine()
    server = FakeAppServer()

    def broken(**_: Any) -> Any:
        raise ValueError("projection exploded")

    with monkeypatch.context() as patch:
        patch.setattr(forms, "project_thread_bootstrap_assembly", broken)
        first = await run_codex_turn(params(session_file, "one"), app_server=server, engine=engine)
    # No engine context reached the thread: the transcript stood in for it (a fresh thread
    # never runs without the conversation).
    (text,) = server.turn_inputs()
    assert text.endswith("one")
    assert "earlier question" in text
    assert "MEMORY-FACT-271" not in text
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.context_engine is not None
    assert binding.context_engine.projection is None  # so no epoch is claimed
    second = await run_codex_turn(params(session_file, "two"), app_server=server, engine=engine)
    assert second.thread_decision is not None
    assert second.thread_decision.reason == "thread-bootstrap-epoch-changed"
    assert second.thread_id != first.thread_id
    assert "MEMORY-FACT-271" in server.turn_inputs()[-1]


def _tool(name: str) -> DynamicTool:
    async def call(_arguments: dict[str, Any]) -> str:
        return "ok"

    return DynamicTool(
        name=name, description="t", input_schema={"type": "object", "properties": {}}, fn=call
    )


async def test_a_tools_change_without_context_keeps_the_conversation_for_that_turn(
    session_file: str,
) -> None:
    server = FakeAppServer()
    first = await run_codex_turn(
        params(session_file, "one"), app_server=server, engine=memory_engine(), tools=[_tool("a")]
    )
    bound = read_binding(session_file)
    assert bound is not None
    second = await run_codex_turn(
        params(session_file, "two"),
        app_server=server,
        engine=failing_assemble_engine(),
        tools=[_tool("a"), _tool("b")],
    )
    assert second.thread_decision is not None
    assert (second.thread_decision.action, second.thread_decision.reason) == (
        ThreadAction.RESUME,
        "context-unavailable-keep-thread",
    )
    assert second.thread_id == first.thread_id
    after = read_binding(session_file)
    assert after is not None
    # The tools change is not recorded: the next turn with context still rotates.
    assert after.dynamic_tools_fingerprint == bound.dynamic_tools_fingerprint
    third = await run_codex_turn(
        params(session_file, "three"),
        app_server=server,
        engine=memory_engine(),
        tools=[_tool("a"), _tool("b")],
    )
    assert third.thread_decision is not None
    assert third.thread_decision.reason == "dynamic-tools-changed"
    assert third.projected


async def test_after_a_refused_resume_the_hooks_see_the_prompt_the_fresh_thread_gets(
    session_file: str,
) -> None:
    from codex_turn.harness.appserver import ThreadNotFound

    seen: list[str] = []

    async def hook(context: PromptBuildContext) -> PromptBuildResult:
        seen.append(context.prompt)
        return PromptBuildResult()

    engine = bootstrap_engine()
    server = FakeAppServer()
    await run_codex_turn(params(session_file, "one"), app_server=server, engine=engine)
    server.resume_error = ThreadNotFound(-32600, "no rollout found for thread id t")
    result = await run_codex_turn(
        params(session_file, "two"),
        app_server=server,
        engine=engine,
        hooks=TurnHooks(before_prompt_build=[hook]),
    )
    assert result.thread_decision is not None
    assert result.thread_decision.reason == "resume-failed"
    triggers = [e.trigger for e in result.trace]
    assert "thread_resume_failed" in triggers
    assert "reprojected" in triggers
    assert seen[0] == "two"  # the resume would have sent the raw prompt
    assert seen[-1].startswith(HEADER)  # the fresh thread gets the context, and so do hooks
    assert server.turn_inputs()[-1] == seen[-1]


async def test_prompt_cache_is_absent_when_codex_reports_no_cached_count(
    session_file: str,
) -> None:
    from support.fake_appserver import CodexScript

    engine = memory_engine()
    await run_codex_turn(
        params(session_file, "hello"),
        app_server=FakeAppServer(scripts=[CodexScript(usage={"inputTokens": 10})]),
        engine=engine,
    )
    (after,) = engine.calls_to("after_turn")
    assert "promptCache" not in after.params.runtime_context
    assert after.params.runtime_context["currentTokenCount"] == 10


async def test_a_hung_on_turn_end_cannot_hold_a_cancelled_turn(session_file: str) -> None:
    import anyio
    from support.fake_appserver import CodexScript

    async def hang(_result: Any) -> None:
        await anyio.sleep_forever()

    server = FakeAppServer(scripts=[CodexScript(ending="cancel")])
    with anyio.fail_after(10), anyio.CancelScope() as caller:
        server.cancel_caller = caller.cancel
        await run_codex_turn(
            params(session_file, "hello", cleanup_timeout=0.2), app_server=server, on_turn_end=hang
        )
    assert caller.cancelled_caught


async def test_a_resume_that_merely_times_out_keeps_the_binding(session_file: str) -> None:
    # Before its fix: any resume failure cleared the binding and the next turn
    # started a fresh thread; the model forgot the conversation.
    from codex_turn.harness.appserver import AppServerTimeout

    server = FakeAppServer()
    first = await run_codex_turn(params(session_file, "one"), app_server=server)
    server.resume_error = AppServerTimeout("thread/resume timed out")
    failed = await run_codex_turn(params(session_file, "two"), app_server=server)
    assert failed.outcome is TurnOutcome.THREAD_START_FAILED
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.thread_id == first.thread_id
    server.resume_error = None
    third = await run_codex_turn(params(session_file, "three"), app_server=server)
    assert third.thread_id == first.thread_id


async def test_the_in_turn_owns_compaction_diagnostic_is_logged_by_default(
    session_file: str,
) -> None:
    # Before: only sent to a host sink (none configured here: nothing was logged).
    from support.fake_appserver import CodexScript

    engine = RecordingEngine(engine_id="lossless-claw", owns_compaction=True)
    with capture_logs() as logs:
        result = await run_codex_turn(
            params(session_file, "hello"),
            app_server=FakeAppServer(scripts=[CodexScript(compaction="completed")]),
            engine=engine,
        )
    assert result.native_compactions == 1
    diagnostics = [e for e in logs if e["event"] == "codex native compaction diagnostic"]
    assert {(e["phase"], e["backend"], e["ownsCompaction"]) for e in diagnostics} == {
        ("start", "codex-app-server", True),
        ("end", "codex-app-server", True),
    }


async def test_a_rollout_codex_cannot_read_rotates_instead_of_blocking_the_session(
    session_file: str,
) -> None:
    # Before its fix: a corrupt rollout (-32603 "failed to read thread") was treated as
    # transient, the binding kept, and every later turn failed the same way.
    from codex_turn.harness.appserver import AppServerRpcError

    server = FakeAppServer()
    first = await run_codex_turn(params(session_file, "one"), app_server=server)
    server.resume_error = AppServerRpcError(-32603, "failed to read thread: bad metadata")
    second = await run_codex_turn(params(session_file, "two"), app_server=server)
    assert second.outcome is TurnOutcome.COMPLETED
    assert second.thread_decision is not None
    assert second.thread_decision.reason == "resume-failed"
    assert second.thread_id != first.thread_id


async def test_the_frame_is_rendered_only_when_the_thread_decision_can_send_it(
    session_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lazy projection: a resumed thread that carries this epoch's context gets
    the raw prompt, so the frame is not rendered; a refused resume renders it after all."""
    from codex_turn.harness.appserver import ThreadNotFound

    renders: list[int] = []
    real = forms.project_thread_bootstrap_assembly

    def counting(**kwargs: Any) -> Any:
        renders.append(len(kwargs["assembled_messages"]))
        return real(**kwargs)

    monkeypatch.setattr(forms, "project_thread_bootstrap_assembly", counting)
    _seed(session_file, "earlier question")
    engine = bootstrap_engine()
    server = FakeAppServer()
    await run_codex_turn(params(session_file, "one"), app_server=server, engine=engine)
    assert len(renders) == 1  # a new thread: the frame is sent
    second = await run_codex_turn(params(session_file, "two"), app_server=server, engine=engine)
    assert second.thread_decision is not None
    assert second.thread_decision.reason == "matching-thread-bootstrap-binding"
    assert not second.projected
    assert len(renders) == 1  # resumed with the raw prompt: nothing rendered
    assert server.turn_inputs()[-1] == "two"
    server.resume_error = ThreadNotFound(-32600, "no rollout found for thread id t")
    third = await run_codex_turn(params(session_file, "three"), app_server=server, engine=engine)
    assert third.projected
    assert len(renders) == 2  # the fresh thread needs the frame: rendered in reprojecting
    assert server.turn_inputs()[-1].startswith(HEADER)
    assert "MEMORY-FACT-271" in server.turn_inputs()[-1]
