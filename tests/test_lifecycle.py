"""The harness-neutral lifecycle helpers: ports of OpenClaw's lifecycle tests (reference 3 D),
the checks of 3 E, every branch of bootstrap / assemble / finalize / maintenance, and log
privacy. Each async test runs on asyncio and on trio."""

from __future__ import annotations

import json
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from structlog.testing import capture_logs
from support.recording_engine import RecordingEngine

from codex_turn._log import mask_session_key
from codex_turn.fsm.turn import SkipReason, TurnTrigger
from codex_turn.harness.engine import (
    AssembleParams,
    AssembleResult,
    LegacyContextEngine,
    MaintainParams,
    MaintenanceResult,
)
from codex_turn.harness.lifecycle import (
    ASSEMBLE_FAILED_WARNING,
    BackgroundMaintenance,
    ScheduleResult,
    assemble_context_engine,
    bootstrap_context_engine,
    build_runtime_context,
    build_runtime_context_from_usage,
    dispose_context_engine,
    finalize_context_engine_turn,
    run_context_engine_maintenance,
    strip_runtime_context_messages,
)
from codex_turn.harness.usage import Usage

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

SESSION = {
    "session_id": "session-1",
    "session_key": "agent:main:session-1",
    "session_file": "/tmp/session-1.jsonl",
}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text, "timestamp": 1}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}], "timestamp": 2}


def hidden(text: str = "runtime facts") -> dict[str, Any]:
    return {
        "role": "custom",
        "customType": "openclaw.runtime-context",
        "content": text,
        "display": False,
    }


async def finalize(engine: Any, **overrides: Any) -> Any:
    params: dict[str, Any] = {
        **SESSION,
        "engine": engine,
        "messages_snapshot": [user("hello"), assistant("final answer")],
        "pre_prompt_message_count": 0,
        "prompt_error": False,
        "aborted": False,
        "yield_aborted": False,
    }
    params.update(overrides)
    return await finalize_context_engine_turn(**params)


def logged(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


# --- D: hidden runtime-context messages -----------------------------------------------------


async def test_d1_keeps_hidden_runtime_context_out_of_assemble() -> None:
    engine = RecordingEngine(engine_id="lossless-claw")
    outcome = await assemble_context_engine(
        engine=engine,
        session_id="session-1",
        session_key="agent:main:session-1",
        messages=[user("u"), hidden(), assistant("a")],
    )
    assert outcome.status == "assembled"
    assert engine.only_call("assemble").params.messages == [user("u"), assistant("a")]


async def test_d2_keeps_hidden_runtime_context_out_of_after_turn() -> None:
    engine = RecordingEngine(engine_id="lossless-claw")
    snapshot = [user("h1"), hidden(), assistant("h2"), user("t1"), hidden(), assistant("t2")]
    outcome = await finalize(engine, messages_snapshot=snapshot, pre_prompt_message_count=3)
    params = engine.only_call("after_turn").params
    assert params.messages == [user("h1"), assistant("h2"), user("t1"), assistant("t2")]
    assert params.pre_prompt_message_count == 2
    assert outcome.path == "after_turn"
    assert outcome.new_message_count == 2


async def test_d3_keeps_hidden_runtime_context_out_of_ingest_batch() -> None:
    engine = RecordingEngine(engine_id="lossless-claw", omit={"after_turn"})
    snapshot = [user("old"), hidden(), user("turn user"), hidden(), assistant("turn assistant")]
    await finalize(engine, messages_snapshot=snapshot, pre_prompt_message_count=2)
    params = engine.only_call("ingest_batch").params
    assert params.messages == [user("turn user"), assistant("turn assistant")]


def test_strip_keeps_other_custom_messages() -> None:
    other = {"role": "custom", "customType": "openclaw.note", "content": "x"}
    assert strip_runtime_context_messages([hidden(), other, user("u")]) == [other, user("u")]


# --- Bootstrap ------------------------------------------------------------------------------


async def test_bootstrap_is_skipped_without_a_session_file() -> None:
    engine = RecordingEngine()
    outcome = await bootstrap_context_engine(engine=engine, had_session_file=False, **SESSION)
    assert (outcome.status, outcome.skip_reason) == ("skipped", "no_session_file")
    assert outcome.trigger is TurnTrigger.BOOTSTRAP_SKIPPED
    assert engine.calls == []


async def test_bootstrap_runs_bootstrap_then_bootstrap_maintenance() -> None:
    engine = RecordingEngine(engine_id="lossless-claw")
    runtime = build_runtime_context(workspace_dir="/w", token_budget=321)
    outcome = await bootstrap_context_engine(
        engine=engine, had_session_file=True, runtime_context=runtime, **SESSION
    )
    assert engine.methods() == ["bootstrap", "maintain"]
    boot = engine.only_call("bootstrap").params
    assert (boot.session_id, boot.session_key, boot.session_file) == (
        "session-1",
        "agent:main:session-1",
        "/tmp/session-1.jsonl",
    )
    maintain = engine.only_call("maintain").params
    assert maintain.runtime_context == {"workspaceDir": "/w", "tokenBudget": 321}
    assert outcome.status == "bootstrapped"
    assert outcome.trigger is TurnTrigger.BOOTSTRAPPED
    assert outcome.result is not None
    assert outcome.result.bootstrapped
    assert outcome.maintenance is not None
    assert outcome.maintenance.reason == "bootstrap"
    assert outcome.maintenance.status == "ran"


async def test_bootstrap_maintenance_runs_for_a_maintain_only_engine() -> None:
    engine = RecordingEngine(omit={"bootstrap"})
    outcome = await bootstrap_context_engine(engine=engine, had_session_file=True, **SESSION)
    assert engine.methods() == ["maintain"]
    assert outcome.status == "bootstrapped"
    assert outcome.result is None


async def test_bootstrap_is_skipped_for_an_engine_without_bootstrap_or_maintain() -> None:
    engine = RecordingEngine(omit={"bootstrap", "maintain"})
    outcome = await bootstrap_context_engine(engine=engine, had_session_file=True, **SESSION)
    assert (outcome.status, outcome.skip_reason) == ("skipped", "no_bootstrap_or_maintain")
    assert engine.calls == []


@pytest.mark.parametrize(
    "failure",
    [{"failures": {"bootstrap": OSError("disk gone")}}, {"responses": {"bootstrap": 5}}],
    ids=["raises", "invalid-result"],
)
async def test_a_failed_bootstrap_warns_and_continues(failure: dict[str, Any]) -> None:
    engine = RecordingEngine(engine_id="lossless-claw", **failure)
    with capture_logs() as logs:
        outcome = await bootstrap_context_engine(engine=engine, had_session_file=True, **SESSION)
    assert outcome.status == "failed"
    assert outcome.trigger is TurnTrigger.BOOTSTRAP_FAILED
    assert engine.methods() == ["bootstrap"]
    (warning,) = logged(logs, "context engine bootstrap failed")
    assert warning["log_level"] == "warning"
    assert warning["engine"] == "lossless-claw"
    assert warning["error"] == outcome.error
    assert isinstance(warning["error"], str)


# --- Assemble -------------------------------------------------------------------------------


async def test_assemble_receives_budget_tools_citations_model_and_raw_prompt() -> None:
    engine = RecordingEngine(engine_id="lossless-claw")
    outcome = await assemble_context_engine(
        engine=engine,
        session_id="session-1",
        session_key="agent:main:session-1",
        messages=[assistant("earlier")],
        token_budget=321,
        available_tools=[],
        citations_mode="on",
        model="gpt-5.4-codex",
        prompt=" hello ",
    )
    params = engine.only_call("assemble").params
    assert params.token_budget == 321
    assert params.available_tools == frozenset()
    assert params.citations_mode == "on"
    assert params.model == "gpt-5.4-codex"
    assert params.prompt == " hello "
    assert [m["role"] for m in params.messages] == ["assistant"]
    assert outcome.status == "assembled"
    assert outcome.trigger is TurnTrigger.ASSEMBLED
    assert outcome.result == AssembleResult(messages=[assistant("earlier")], estimated_tokens=1)


async def test_assemble_passes_tool_names_and_drops_blank_optionals() -> None:
    engine = RecordingEngine()
    await assemble_context_engine(
        engine=engine,
        session_id="s",
        session_key=None,
        messages=[],
        available_tools=["exec", "", "read"],
        citations_mode="",
    )
    params = engine.only_call("assemble").params
    assert params.available_tools == frozenset({"exec", "read"})
    assert params.citations_mode is None
    assert params.prompt is None


@pytest.mark.parametrize(
    ("response", "problem"),
    [
        (None, 'expected an object with a "messages" array (got null)'),
        ({"messages": "oops"}, "(got messages of type string)"),
        (AssembleResult(messages=[1], estimated_tokens=0), "messages[0] must be an object"),  # type: ignore[list-item]
        ({"messages": [], "estimatedTokens": "many"}, "estimatedTokens"),
    ],
)
async def test_invalid_assemble_results_fall_back_to_the_baseline(
    response: object, problem: str
) -> None:
    engine = RecordingEngine(engine_id="lossless-claw", responses={"assemble": lambda _: response})
    with capture_logs() as logs:
        outcome = await assemble_context_engine(
            engine=engine, session_id="s", session_key="k:1", messages=[]
        )
    assert outcome.status == "failed"
    assert outcome.trigger is TurnTrigger.ASSEMBLE_FAILED
    assert outcome.result is None
    assert outcome.error is not None
    assert 'context engine "lossless-claw" assemble() returned an invalid result' in outcome.error
    assert problem in outcome.error
    (warning,) = logged(logs, ASSEMBLE_FAILED_WARNING)
    assert warning["error"] == outcome.error


async def test_assemble_failures_are_logged_redacted_never_raw() -> None:
    """A4: the warning carries a formatted string, without the bearer token or sk- key."""
    secret = "sk-abcdefghijklmnopqrstuv"
    engine = RecordingEngine(
        engine_id="lossless-claw",
        failures={"assemble": RuntimeError(f"Authorization: Bearer {secret}")},
    )
    session_key = "agent:main:telegram:12345"
    prompt = "my private question about the merger"
    with capture_logs() as logs:
        outcome = await assemble_context_engine(
            engine=engine,
            session_id="s",
            session_key=session_key,
            messages=[user("private transcript line")],
            prompt=prompt,
        )
    assert outcome.status == "failed"
    (warning,) = logged(logs, "context engine assemble failed; using Codex baseline prompt")
    assert warning["log_level"] == "warning"
    assert isinstance(warning["error"], str)
    assert warning["error"].startswith("RuntimeError: ")
    assert warning["session_key"] == mask_session_key(session_key)
    everything = json.dumps(logs, default=repr)
    for leaked in (secret, "Bearer sk-", prompt, "private transcript line", "telegram:12345"):
        assert leaked not in everything
    assert secret not in (outcome.error or "")


async def test_an_engine_without_assemble_fails_cleanly() -> None:
    engine = RecordingEngine(omit={"assemble"})
    outcome = await assemble_context_engine(
        engine=engine, session_id="s", session_key=None, messages=[]
    )
    assert outcome.status == "failed"
    assert "no assemble" in (outcome.error or "")


# --- Finalize -------------------------------------------------------------------------------


async def test_finalize_prefers_after_turn_then_runs_turn_maintenance() -> None:
    """A2: after_turn gets the mirrored transcript; maintain runs once, for the turn."""
    engine = RecordingEngine(engine_id="lossless-claw")
    runtime = build_runtime_context(token_budget=111)
    outcome = await finalize(engine, token_budget=111, runtime_context=runtime)
    assert engine.methods() == ["after_turn", "maintain"]
    params = engine.only_call("after_turn").params
    assert (params.session_id, params.session_key) == ("session-1", "agent:main:session-1")
    assert params.pre_prompt_message_count == 0
    assert params.token_budget == 111
    assert params.runtime_context == runtime
    assert {m["role"] for m in params.messages} == {"user", "assistant"}
    assert engine.only_call("maintain").params.runtime_context == {"tokenBudget": 111}
    assert outcome.succeeded
    assert outcome.path == "after_turn"
    assert outcome.trigger is TurnTrigger.FINALIZED
    assert outcome.maintenance is not None
    assert outcome.maintenance.status == "ran"
    assert outcome.maintenance.trigger is TurnTrigger.MAINTENANCE_RAN
    assert outcome.maintenance_skip_reason is None


async def test_a5_falls_back_to_ingest_batch_and_skips_maintenance_on_prompt_failure() -> None:
    engine = RecordingEngine(engine_id="lossless-claw", omit={"after_turn"})
    outcome = await finalize(
        engine,
        messages_snapshot=[user("old"), user("hello"), assistant("codex failed")],
        pre_prompt_message_count=1,
        prompt_error=True,
    )
    assert engine.methods() == ["ingest_batch"]
    assert engine.only_call("ingest_batch").params.messages == [
        user("hello"),
        assistant("codex failed"),
    ]
    assert outcome.path == "ingest_batch"
    assert outcome.succeeded
    assert outcome.maintenance is None
    assert outcome.maintenance_skip_reason is SkipReason.PROMPT_ERROR


async def test_per_message_ingest_continues_past_a_failing_message() -> None:
    def fail_second(params: Any) -> Exception | None:
        return ValueError("cannot store") if params.message["content"] == "two" else None

    engine = RecordingEngine(
        engine_id="lossless-claw",
        omit={"after_turn", "ingest_batch"},
        failures={"ingest": fail_second},
    )
    snapshot = [user("history"), user("one"), user("two"), assistant("three")]
    with capture_logs() as logs:
        outcome = await finalize(engine, messages_snapshot=snapshot, pre_prompt_message_count=1)
    ingested = [c.params.message for c in engine.calls_to("ingest")]
    assert ingested == [user("one"), user("two"), assistant("three")]
    assert engine.methods() == ["ingest", "ingest", "ingest"]  # no maintenance after a failure
    assert not outcome.succeeded
    assert outcome.trigger is TurnTrigger.FINALIZE_FAILED
    assert (outcome.path, outcome.failures, outcome.new_message_count) == ("ingest", 1, 3)
    assert outcome.maintenance_skip_reason is SkipReason.FINALIZE_FAILED
    (warning,) = logged(logs, "context engine ingest failed")
    assert warning["message_index"] == 1
    assert warning["error"] == "ValueError: cannot store"


@pytest.mark.parametrize(
    ("engine_kwargs", "event"),
    [
        ({"failures": {"after_turn": RuntimeError("x")}}, "context engine afterTurn failed"),
        (
            {"omit": {"after_turn"}, "failures": {"ingest_batch": RuntimeError("x")}},
            "context engine ingest failed",
        ),
    ],
    ids=["after_turn", "ingest_batch"],
)
async def test_a_failed_finalize_call_suppresses_maintenance(
    engine_kwargs: dict[str, Any], event: str
) -> None:
    engine = RecordingEngine(**engine_kwargs)
    with capture_logs() as logs:
        outcome = await finalize(engine)
    assert not outcome.succeeded
    assert outcome.failures == 1
    assert "maintain" not in engine.methods()
    assert outcome.maintenance_skip_reason is SkipReason.FINALIZE_FAILED
    assert len(logged(logs, event)) == 1


@pytest.mark.parametrize(
    ("engine_kwargs", "turn", "reason"),
    [
        ({"omit": {"maintain"}}, {}, SkipReason.NO_MAINTAIN),
        ({}, {"prompt_error": True}, SkipReason.PROMPT_ERROR),
        ({}, {"aborted": True}, SkipReason.ABORTED),
        ({}, {"aborted": True, "yield_aborted": True}, SkipReason.YIELD_ABORTED),
        ({}, {"yield_aborted": True}, SkipReason.YIELD_ABORTED),
        ({"failures": {"after_turn": RuntimeError("x")}}, {}, SkipReason.FINALIZE_FAILED),
    ],
    ids=lambda v: v.value if isinstance(v, SkipReason) else None,
)
async def test_each_skip_reason_skips_turn_maintenance(
    engine_kwargs: dict[str, Any], turn: dict[str, bool], reason: SkipReason
) -> None:
    engine = RecordingEngine(**engine_kwargs)
    outcome = await finalize(engine, **turn)
    assert "maintain" not in engine.methods()
    assert engine.calls_to("after_turn")  # finalize still ran: the engine sees every turn
    assert outcome.maintenance is None
    assert outcome.maintenance_skip_reason is reason


async def test_finalize_without_new_messages_calls_nothing_but_maintenance() -> None:
    engine = RecordingEngine(omit={"after_turn"})
    outcome = await finalize(engine, messages_snapshot=[user("old")], pre_prompt_message_count=1)
    assert engine.methods() == ["maintain"]
    assert (outcome.path, outcome.succeeded) == ("nothing_new", True)


async def test_finalize_can_leave_maintenance_to_the_caller() -> None:
    engine = RecordingEngine()
    outcome = await finalize(engine, run_maintenance=False)
    assert engine.methods() == ["after_turn"]
    assert outcome.maintenance is None
    assert outcome.maintenance_skip_reason is None


async def test_finalize_clamps_a_count_larger_than_the_snapshot() -> None:
    engine = RecordingEngine()
    await finalize(engine, pre_prompt_message_count=99)
    assert engine.only_call("after_turn").params.pre_prompt_message_count == 2


async def test_finalize_says_when_it_ingests_from_the_fallback_snapshot() -> None:
    engine = RecordingEngine()
    with capture_logs() as logs:
        await finalize(engine, snapshot_is_fallback=True)
    assert (
        len(logged(logs, "context engine finalizing from fallback snapshot (mirror failed)")) == 1
    )
    assert engine.calls_to("after_turn")


# --- No engine and the legacy engine --------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "legacy-id", "legacy-engine"])
async def test_no_engine_and_the_legacy_engine_get_no_lifecycle_calls(kind: str) -> None:
    recorder = RecordingEngine(engine_id="legacy")
    engine: Any = {"none": None, "legacy-id": recorder, "legacy-engine": LegacyContextEngine()}[
        kind
    ]
    boot = await bootstrap_context_engine(engine=engine, had_session_file=True, **SESSION)
    assembled = await assemble_context_engine(
        engine=engine, session_id="s", session_key=None, messages=[user("u")], prompt="hello"
    )
    final = await finalize(engine)
    maintained = await run_context_engine_maintenance(
        engine=engine,
        reason="turn",
        session_id="s",
        session_key=None,
        session_file="f",
    )
    assert (boot.status, boot.skip_reason) == ("skipped", "no_engine")
    assert assembled.status == "skipped"
    assert assembled.trigger is TurnTrigger.ASSEMBLE_SKIPPED
    assert (final.succeeded, final.path) == (True, "skipped")
    assert final.maintenance_skip_reason is SkipReason.NO_ENGINE
    assert maintained.status == "skipped"
    assert maintained.trigger is None
    assert recorder.calls == []


# --- Maintenance ----------------------------------------------------------------------------


async def test_maintenance_passes_the_rewriter_and_logs_changes_by_fact() -> None:
    async def rewriter(request: Any) -> MaintenanceResult:
        return MaintenanceResult(changed=False, bytes_freed=0, rewritten_entries=0)

    changed = MaintenanceResult(changed=True, bytes_freed=2048, rewritten_entries=3)
    engine = RecordingEngine(engine_id="lossless-claw", responses={"maintain": changed})
    with capture_logs() as logs:
        outcome = await run_context_engine_maintenance(
            engine=engine,
            reason="compaction",
            runtime_context={"cwd": "/w"},
            transcript_rewriter=rewriter,
            **SESSION,
        )
    context = engine.only_call("maintain").params.runtime_context
    assert context == {"cwd": "/w", "rewriteTranscriptEntries": rewriter}
    assert "allowDeferredCompactionExecution" not in context
    assert (outcome.status, outcome.reason, outcome.result) == ("ran", "compaction", changed)
    (info,) = logged(logs, "context engine maintenance changed transcript")
    assert (info["rewritten_entries"], info["bytes_freed"], info["reason"]) == (
        3,
        2048,
        "compaction",
    )
    assert info["session_key"] == mask_session_key("agent:main:session-1")


@pytest.mark.parametrize(
    ("engine_kwargs", "error"),
    [
        ({"failures": {"maintain": RuntimeError("token=hunter2hunter2")}}, "RuntimeError"),
        ({"responses": {"maintain": {"changed": "very"}}}, "maintain() returned an invalid result"),
    ],
    ids=["raises", "invalid"],
)
async def test_maintenance_failures_never_propagate(
    engine_kwargs: dict[str, Any], error: str
) -> None:
    engine = RecordingEngine(engine_id="lossless-claw", **engine_kwargs)
    with capture_logs() as logs:
        outcome = await run_context_engine_maintenance(engine=engine, reason="turn", **SESSION)
    assert outcome.status == "failed"
    assert outcome.trigger is TurnTrigger.MAINTENANCE_FAILED
    assert error in (outcome.error or "")
    (warning,) = logged(logs, "context engine maintain failed")
    assert warning["reason"] == "turn"
    assert "hunter2hunter2" not in json.dumps(logs, default=repr)


async def test_maintenance_accepts_a_none_result() -> None:
    engine = RecordingEngine(responses={"maintain": None})
    outcome = await run_context_engine_maintenance(engine=engine, reason="turn", **SESSION)
    assert (outcome.status, outcome.result) == ("ran", None)


# --- Background maintenance -----------------------------------------------------------------


def background_engine(**kwargs: Any) -> RecordingEngine:
    return RecordingEngine(engine_id="lossless-claw", turn_maintenance_mode="background", **kwargs)


async def test_background_mode_defers_turn_maintenance_to_the_scheduler() -> None:
    engine = background_engine()
    async with BackgroundMaintenance() as scheduler:
        outcome = await finalize(engine, scheduler=scheduler, runtime_context={"cwd": "/w"})
        assert outcome.maintenance is not None
        assert outcome.maintenance.status == "deferred"
        assert outcome.maintenance.trigger is TurnTrigger.MAINTENANCE_DEFERRED
        assert outcome.maintenance.schedule is ScheduleResult.STARTED
        assert "maintain" not in engine.methods()  # not awaited inline
        await scheduler.drain()
    params = engine.only_call("maintain").params
    assert params.runtime_context == {"cwd": "/w", "allowDeferredCompactionExecution": True}
    assert scheduler.runs == 1


async def test_background_scheduling_coalesces_two_requests_into_one_run() -> None:
    engine = background_engine()
    async with BackgroundMaintenance() as scheduler:
        first = await run_context_engine_maintenance(
            engine=engine, reason="turn", scheduler=scheduler, runtime_context={"n": 1}, **SESSION
        )
        second = await run_context_engine_maintenance(
            engine=engine, reason="turn", scheduler=scheduler, runtime_context={"n": 2}, **SESSION
        )
        assert (first.schedule, second.schedule) == (
            ScheduleResult.STARTED,
            ScheduleResult.COALESCED,
        )
        await scheduler.drain()
    (call,) = engine.calls_to("maintain")
    assert call.params.runtime_context["n"] == 2  # the newest request wins
    assert scheduler.runs == 1


async def test_requests_during_a_run_cause_exactly_one_rerun() -> None:
    release = anyio.Event()
    started = anyio.Event()
    running = 0
    overlap = False

    async def maintain(params: MaintainParams) -> None:
        nonlocal running, overlap
        running += 1
        overlap = overlap or running > 1
        started.set()
        await release.wait()
        running -= 1

    engine = background_engine(responses={"maintain": maintain})
    async with BackgroundMaintenance() as scheduler:
        schedule = scheduler.schedule
        schedule(engine=engine, runtime_context={"n": 0}, **SESSION)
        await started.wait()
        for n in (1, 2, 3):
            assert schedule(engine=engine, runtime_context={"n": n}, **SESSION) is (
                ScheduleResult.COALESCED
            )
        assert scheduler.coalesced == 2  # three requests merged into one pending rerun
        release.set()
        await scheduler.drain()
    assert [c.params.runtime_context["n"] for c in engine.calls_to("maintain")] == [0, 3]
    assert not overlap


async def test_different_sessions_run_concurrently_and_the_queue_is_bounded() -> None:
    release = anyio.Event()
    both = anyio.Event()
    active: set[str] = set()

    async def maintain(params: MaintainParams) -> None:
        active.add(params.session_key or "")
        if len(active) == 2:
            both.set()
        await release.wait()

    engine = background_engine(responses={"maintain": maintain})
    with capture_logs() as logs:
        async with BackgroundMaintenance(max_sessions=2) as scheduler:
            for key in ("agent:a", "agent:b"):
                result = scheduler.schedule(
                    engine=engine, session_id=key, session_key=key, session_file="f"
                )
                assert result is ScheduleResult.STARTED
            assert (
                scheduler.schedule(
                    engine=engine, session_id="c", session_key="agent:c", session_file="f"
                )
                is ScheduleResult.REJECTED
            )
            with anyio.fail_after(5):
                await both.wait()
            assert scheduler.pending_sessions() == 2
            release.set()
    assert scheduler.rejected == 1
    assert (
        len(
            logged(logs, "context engine background maintenance rejected; too many sessions queued")
        )
        == 1
    )


async def test_closing_the_scheduler_cancels_running_maintenance() -> None:
    started = anyio.Event()
    never = anyio.Event()

    async def maintain(params: MaintainParams) -> None:
        started.set()
        await never.wait()

    engine = background_engine(responses={"maintain": maintain})
    with anyio.fail_after(5):
        async with BackgroundMaintenance() as scheduler:
            scheduler.schedule(engine=engine, **SESSION)
            await started.wait()
    call = engine.only_call("maintain")
    assert call.finished
    assert isinstance(call.error, anyio.get_cancelled_exc_class())
    assert scheduler.closed
    assert scheduler.schedule(engine=engine, **SESSION) is ScheduleResult.CLOSED
    assert scheduler.pending_sessions() == 0


async def test_a_caller_provided_task_group_hosts_the_workers() -> None:
    engine = background_engine()
    async with anyio.create_task_group() as tg:
        scheduler = BackgroundMaintenance(task_group=tg)
        scheduler.schedule(engine=engine, **SESSION)
        await scheduler.drain()
        await scheduler.aclose()
    assert engine.methods() == ["maintain"]


async def test_a_run_that_exceeds_its_timeout_is_logged_as_failed() -> None:
    engine = background_engine(delays={"maintain": 10})
    with capture_logs() as logs, anyio.fail_after(5):
        async with BackgroundMaintenance(run_timeout=0.05) as scheduler:
            scheduler.schedule(engine=engine, **SESSION)
            await scheduler.drain()
    (warning,) = logged(logs, "context engine maintain failed")
    assert warning["error"].startswith("TimeoutError")
    assert warning["reason"] == "turn"


async def test_runs_wait_for_the_session_to_be_idle() -> None:
    polls = 0

    def busy(key: str) -> bool:
        nonlocal polls
        polls += 1
        assert key == "agent:main:session-1"
        return polls < 3

    engine = background_engine()
    async with BackgroundMaintenance(is_session_busy=busy, poll_interval=0.001) as scheduler:
        scheduler.schedule(engine=engine, runtime_context={"n": 1}, **SESSION)
        await anyio.lowlevel.checkpoint()
        scheduler.schedule(engine=engine, runtime_context={"n": 2}, **SESSION)
        await scheduler.drain()
    assert polls == 3
    assert [c.params.runtime_context["n"] for c in engine.calls_to("maintain")] == [2]


async def test_a_failing_busy_predicate_does_not_crash_the_task_group() -> None:
    def busy(key: str) -> bool:
        raise RuntimeError("lane registry gone")

    engine = background_engine()
    with capture_logs() as logs:
        async with BackgroundMaintenance(is_session_busy=busy) as scheduler:
            scheduler.schedule(engine=engine, **SESSION)
            await scheduler.drain()
    assert engine.calls == []
    assert len(logged(logs, "context engine background maintenance stopped")) == 1


async def test_background_mode_without_a_scheduler_runs_inline() -> None:
    engine = background_engine()
    outcome = await finalize(engine)
    assert outcome.maintenance is not None
    assert outcome.maintenance.status == "ran"
    context = engine.only_call("maintain").params.runtime_context
    assert "allowDeferredCompactionExecution" not in context


async def test_bootstrap_maintenance_is_never_deferred() -> None:
    engine = background_engine()
    async with BackgroundMaintenance() as scheduler:
        outcome = await run_context_engine_maintenance(
            engine=engine, reason="bootstrap", scheduler=scheduler, **SESSION
        )
    assert outcome.status == "ran"
    assert scheduler.runs == 0


async def test_a_scheduler_that_was_never_started_refuses_work() -> None:
    with pytest.raises(RuntimeError, match="not running"):
        BackgroundMaintenance().schedule(engine=background_engine(), **SESSION)
    with pytest.raises(ValueError, match="max_sessions"):
        BackgroundMaintenance(max_sessions=0)


# --- Dispose --------------------------------------------------------------------------------


async def test_dispose_is_optional_and_never_raises() -> None:
    assert await dispose_context_engine(None) is False
    assert await dispose_context_engine(RecordingEngine(omit={"dispose"})) is False
    engine = RecordingEngine(failures={"dispose": RuntimeError("x")})
    with capture_logs() as logs:
        assert await dispose_context_engine(engine) is False
    assert len(logged(logs, "context engine dispose failed")) == 1
    assert await dispose_context_engine(RecordingEngine()) is True


# --- Runtime context and token usage --------------------------------------------------------


def test_runtime_context_adds_only_positive_finite_token_counts() -> None:
    context = build_runtime_context(
        attempt={"sessionKey": "agent:main:main", "provider": "codex", "model": None},
        workspace_dir="/w",
        agent_dir="/a",
        token_budget=321.9,
        current_token_count=0,
    )
    assert context == {
        "sessionKey": "agent:main:main",
        "provider": "codex",
        "workspaceDir": "/w",
        "agentDir": "/a",
        "tokenBudget": 321,
    }
    for bad in (None, 0, -1, float("nan"), float("inf"), 0.5):
        assert "tokenBudget" not in build_runtime_context(token_budget=bad)
    assert "promptCache" not in build_runtime_context()
    assert build_runtime_context(prompt_cache={"retention": "short"})["promptCache"] == {
        "retention": "short"
    }


def test_usage_counts_cached_input_tokens_once() -> None:
    """Codex's inputTokens already includes cachedInputTokens: 100, not 180."""
    codex_last = {
        "totalTokens": 110,
        "inputTokens": 100,
        "cachedInputTokens": 80,
        "cacheWriteInputTokens": 0,
        "outputTokens": 10,
        "reasoningOutputTokens": 0,
    }
    context = build_runtime_context_from_usage(last_call_usage=codex_last, token_budget=1000)
    assert context["currentTokenCount"] == 100
    usage = Usage.from_codex(codex_last)
    assert usage.prompt_tokens == 100
    pi = usage.to_agent_usage()
    assert {k: pi[k] for k in ("input", "output", "cacheRead", "cacheWrite", "totalTokens")} == {
        "input": 20,
        "output": 10,
        "cacheRead": 80,
        "cacheWrite": 0,
        "totalTokens": 110,
    }
    assert pi["input"] + pi["cacheRead"] + pi["cacheWrite"] == 100
    assert build_runtime_context_from_usage(last_call_usage=usage)["currentTokenCount"] == 100


def test_usage_edge_cases() -> None:
    assert "currentTokenCount" not in build_runtime_context_from_usage(last_call_usage=None)
    assert "currentTokenCount" not in build_runtime_context_from_usage(
        last_call_usage={"inputTokens": 0}
    )
    snake = Usage.from_codex(
        {"input_tokens": 7.9, "cached_input_tokens": "x", "output_tokens": True}
    )
    assert (snake.input, snake.cache_read, snake.output) == (7, 0, 0)
    assert Usage.from_codex({"inputTokens": 5, "cachedInputTokens": 9}).prompt_tokens == 9
    assert Usage.from_codex({"inputTokens": float("inf")}).prompt_tokens == 0


async def test_assemble_outcome_result_feeds_the_projection_unchanged() -> None:
    messages = [user("u"), assistant("a")]
    engine = RecordingEngine(
        responses={
            "assemble": lambda p: AssembleResult(
                messages=[*p.messages, user("hello")],
                estimated_tokens=42,
                system_prompt_addition="context-engine system",
            )
        }
    )
    outcome = await assemble_context_engine(
        engine=engine, session_id="s", session_key=None, messages=messages, prompt="hello"
    )
    assert outcome.result is not None
    assert outcome.result.system_prompt_addition == "context-engine system"
    assert outcome.result.messages[-1] == user("hello")
    assert isinstance(engine.only_call("assemble").params, AssembleParams)


def test_a_stripped_list_is_marked_and_not_rescanned_but_still_copied() -> None:
    from codex_turn.harness.lifecycle import RuntimeContextFree, strip_runtime_context_messages

    hidden = {"role": "custom", "customType": "openclaw.runtime-context", "content": "x"}
    stripped = strip_runtime_context_messages([user("a"), hidden, assistant("b")])
    assert isinstance(stripped, RuntimeContextFree)
    assert stripped == [user("a"), assistant("b")]
    again = strip_runtime_context_messages(stripped)
    assert again == stripped
    assert again is not stripped  # an engine mutating its input cannot reach the caller's
    # The marker is a promise the caller makes: a marked list is trusted as is.
    assert strip_runtime_context_messages(RuntimeContextFree([hidden])) == [hidden]


async def test_finalize_splits_a_stripped_snapshot_without_rescanning() -> None:
    from codex_turn.harness.lifecycle import RuntimeContextFree

    engine = RecordingEngine()
    snapshot = RuntimeContextFree([user("old"), assistant("older"), user("new"), assistant("r")])
    await finalize_context_engine_turn(
        engine=engine,
        session_id="s",
        session_key=None,
        session_file="f",
        messages_snapshot=snapshot,
        pre_prompt_message_count=2,
        prompt_error=False,
        aborted=False,
        yield_aborted=False,
        run_maintenance=False,
    )
    params = engine.only_call("after_turn").params
    assert params.pre_prompt_message_count == 2
    assert params.messages == list(snapshot)
