"""Regressions found in review: each test failed before its fix (see the commit history).

All run against the in-process fake app-server (tests/support/fake_appserver.py), whose turn
handle and projector are the product's own, on both anyio backends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.fake_appserver import CodexScript, FakeAppServer
from support.recording_engine import RecordingEngine
from support.transcripts import transcript_texts
from support.turns import temporary_session_file, turn_params

from codex_turn import (
    AssembleResult,
    ContextProjection,
    PromptBuildResult,
    TurnHooks,
    TurnOutcome,
    TurnParams,
    read_binding,
    run_codex_turn,
)
from codex_turn.harness.appserver import AppServerRpcError
from codex_turn.harness.maintenance import BackgroundMaintenance
from codex_turn.harness.orchestrator import TURN_START_TEXT_MAX_CHARS
from codex_turn.harness.session import mirror_turn

pytestmark = pytest.mark.anyio

CONTEXT_HEADER = "OpenClaw assembled context for this turn:"


@pytest.fixture
def session_file() -> Iterator[str]:
    with temporary_session_file("codex-turn-regressions-") as path:
        yield path


def params(session_file: str, prompt: str, **overrides: Any) -> TurnParams:
    return turn_params(session_file, prompt, **overrides)


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
    # Issue 17: it used to run the turn as plain Codex, with a warning only.
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
        assert server.turn_inputs()[-1] == "hello there"  # the baseline prompt


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
