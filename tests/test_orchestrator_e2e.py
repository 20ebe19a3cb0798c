"""run_codex_turn against the real Codex app-server and the offline model.

Ports of OpenClaw's run-attempt.context-engine tests (reference section 3 A, A1-A9), asserting
on what the model actually received (recorded by the offline model) as well as on the engine
calls, plus the no-engine equivalence, cancellation, timeouts, a crash mid-turn, concurrent
turns on one session, and the snowball bound.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support.recording_engine import RecordingEngine
from support.transcripts import transcript_texts

from codex_turn import (
    AppServer,
    AppServerConfig,
    AssembleResult,
    ContextProjection,
    LegacyContextEngine,
    PromptBuildResult,
    SessionBusy,
    SkipReason,
    TurnHooks,
    TurnOutcome,
    TurnParams,
    TurnResult,
    read_binding,
    run_codex_turn,
)
from codex_turn.harness.appserver import AppServerProcess, ThreadSettings
from codex_turn.harness.session import mirror_turn
from codex_turn.harness.turn.orchestrator import TURN_START_TEXT_MAX_CHARS
from codex_turn.testing import OfflineModel, Reply

pytestmark = pytest.mark.anyio

FRAME_HEADER = "OpenClaw assembled context for this turn:"


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}], "timestamp": 1}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text, "timestamp": 1}


def seed_session(path: Path, *messages: dict[str, Any]) -> None:
    mirror_turn(
        path,
        list(messages),
        scope="seed",
        identities=[f"m{i}" for i in range(len(messages))],
        session_id="session-1",
        cwd=str(path.parent),
    )


def echo_engine(**kwargs: Any) -> RecordingEngine:
    """OpenClaw's A-fixture engine: assemble = input + the prompt, 42 tokens, an addition."""
    return RecordingEngine(
        engine_id="lossless-claw",
        name="Lossless Claw",
        owns_compaction=True,
        responses={
            "assemble": lambda p: AssembleResult(
                messages=[*p.messages, user(p.prompt)],
                estimated_tokens=42,
                system_prompt_addition="context-engine system",
            ),
            **kwargs.pop("responses", {}),
        },
        **kwargs,
    )


@pytest.fixture
def params(tmp_path: Path, workspace: Path, private_texts: set[str]) -> Callable[..., TurnParams]:
    """TurnParams for this test's session; every prompt is marked private (the conftest
    guard fails the test if one reaches a log record). OpenClaw's cases are about its text
    frame, so that is the form here (the structured form: test_structured_turn_e2e.py)."""

    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "session-1",
            "session_key": "agent:main:session-1",
            "session_file": tmp_path / "session-1.jsonl",
            "workspace_dir": workspace,
            "prompt": "hello",
            "projection_format": "text",
        }
        values.update(overrides)
        private_texts.add(values["prompt"][:200])
        return TurnParams(**values)

    return make


def sent_methods(server: AppServer) -> list[str]:
    return [m["method"] for m in server.sent if "method" in m and "id" in m]


def sent_params(server: AppServer, method: str) -> list[dict[str, Any]]:
    return [m["params"] for m in server.sent if m.get("method") == method]


# --- A1-A9 ---------------------------------------------------------------------------------


async def test_a1_bootstraps_and_assembles_before_the_codex_turn_starts(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    p = params(context_token_budget=321, citations_mode="on", model="gpt-5.4-codex")
    seed_session(Path(p.session_file), assistant("earlier answer"))
    engine = echo_engine()

    result = await run_codex_turn(p, app_server=appserver, engine=engine)

    assert result.outcome is TurnOutcome.COMPLETED
    bootstrap = engine.only_call("bootstrap").params
    assert (bootstrap.session_id, bootstrap.session_key) == ("session-1", "agent:main:session-1")
    assert bootstrap.session_file == str(p.session_file)
    assemble = engine.only_call("assemble").params
    assert assemble.token_budget == 321
    assert assemble.citations_mode == "on"
    assert assemble.model == "gpt-5.4-codex"
    assert assemble.prompt == "hello"
    assert [m["role"] for m in assemble.messages] == ["assistant"]
    assert set(assemble.available_tools or ()) == set()
    # Order: bootstrap and assemble before Codex saw anything.
    assert engine.methods()[:3] == ["bootstrap", "maintain", "assemble"]
    request = offline_model.turn_requests()[-1]
    assert any("context-engine system" in d for d in request.developer_parts)
    assert FRAME_HEADER in request.last_user_text
    assert "earlier answer" in request.last_user_text


async def test_a2_calls_after_turn_with_the_mirrored_transcript_and_maintains(
    appserver: AppServer, params: Callable[..., TurnParams]
) -> None:
    engine = echo_engine()
    result = await run_codex_turn(
        params(context_token_budget=111), app_server=appserver, engine=engine
    )

    assert result.outcome is TurnOutcome.COMPLETED
    assert engine.calls_to("bootstrap") == []  # no session file before the turn
    after = engine.only_call("after_turn").params
    assert (after.session_id, after.session_key) == ("session-1", "agent:main:session-1")
    assert after.pre_prompt_message_count == 0
    assert after.token_budget == 111
    roles = [m["role"] for m in after.messages]
    assert "user" in roles
    assert "assistant" in roles
    assert [c.params.session_id for c in engine.calls_to("maintain")] == ["session-1"]
    assert result.maintenance.status == "ran"


async def test_a3_reloads_history_after_bootstrap_mutates_the_transcript(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    p = params()
    seed_session(Path(p.session_file), assistant("first answer"))

    def bootstrap_writes(bp: Any) -> dict[str, Any]:
        mirror_turn(
            bp.session_file,
            [assistant("bootstrap context")],
            scope="boot",
            identities=["b"],
            session_id="session-1",
            cwd="/",
        )
        return {"bootstrapped": True}

    engine = echo_engine(responses={"bootstrap": bootstrap_writes})
    await run_codex_turn(p, app_server=appserver, engine=engine)

    assert [m["role"] for m in engine.only_call("assemble").params.messages] == [
        "assistant",
        "assistant",
    ]
    assert engine.only_call("after_turn").params.pre_prompt_message_count == 2
    assert "bootstrap context" in offline_model.turn_requests()[-1].last_user_text


async def test_a4_logs_assemble_failures_redacted_and_runs_the_baseline_turn(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    secret = "sk-abcdefghijklmnopqrstuv"
    engine = echo_engine(failures={"assemble": RuntimeError(f"Authorization: Bearer {secret}")})
    with capture_logs() as records:
        result = await run_codex_turn(params(), app_server=appserver, engine=engine)

    warnings = [
        r
        for r in records
        if r["event"] == "context engine assemble failed; using Codex baseline prompt"
    ]
    assert len(warnings) == 1
    assert isinstance(warnings[0]["error"], str)
    assert secret not in repr(records)
    assert result.outcome is TurnOutcome.COMPLETED
    assert offline_model.turn_requests()[-1].last_user_text == "hello"
    assert [e.trigger for e in result.trace][3] == "assemble_failed"


async def test_a5_falls_back_to_ingest_batch_and_skips_maintenance_on_prompt_failure(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    offline_model.script(Reply.http_error(400, "codex failed: bad request"))
    engine = echo_engine(omit={"after_turn"})
    result = await run_codex_turn(params(), app_server=appserver, engine=engine)

    assert result.outcome is TurnOutcome.FAILED
    assert result.prompt_error is not None
    assert "codex failed" in result.prompt_error
    assert len(engine.calls_to("ingest_batch")) == 1
    assert engine.calls_to("maintain") == []
    assert result.maintenance.skip_reason == SkipReason.PROMPT_ERROR.value


async def test_a6_engine_calls_are_bound_to_the_run_session_key(
    appserver: AppServer, params: Callable[..., TurnParams]
) -> None:
    p = params(
        session_key="agent:main:main",
        sandbox_session_key="agent:main:telegram:default:direct:12345",
    )
    seed_session(Path(p.session_file), assistant("x"))
    engine = echo_engine()
    await run_codex_turn(p, app_server=appserver, engine=engine)
    assert engine.only_call("bootstrap").params.session_key == "agent:main:main"
    assert engine.only_call("assemble").params.session_key == "agent:main:main"


async def test_a7_uses_the_runtime_token_budget_for_large_projections(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    p = params(context_token_budget=80_000)
    seed_session(Path(p.session_file), assistant("x" * 30_000 + " LARGE_CONTEXT_END"))
    await run_codex_turn(p, app_server=appserver, engine=echo_engine())
    text = offline_model.turn_requests()[-1].last_user_text
    assert len(text) > 30_000
    assert "LARGE_CONTEXT_END" in text
    assert "[truncated " not in text


def bootstrap_engine(epoch: str = "epoch-1", **kwargs: Any) -> RecordingEngine:
    return RecordingEngine(
        engine_id="lossless-claw",
        responses={
            "assemble": lambda p: AssembleResult(
                messages=[*p.messages, assistant("remembered fact ZEBRA-42")],
                estimated_tokens=7,
                system_prompt_addition="memory recall",
                context_projection=ContextProjection(mode="thread_bootstrap", epoch=epoch),
            )
        },
        **kwargs,
    )


async def test_a8_projects_thread_bootstrap_context_once_per_epoch(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    p = params()
    engine = bootstrap_engine()
    with capture_logs() as records:
        first = await run_codex_turn(p, app_server=appserver, engine=engine)
        binding = read_binding(p.session_file)
        assert binding is not None
        assert binding.context_engine is not None
        projection = binding.context_engine.projection
        assert projection is not None
        assert (projection.schema_version, projection.mode, projection.epoch) == (
            1,
            "thread_bootstrap",
            "epoch-1",
        )
        assert projection.fingerprint is None
        sidecar = anyio.Path(str(p.session_file) + ".codex-app-server.json")
        before = await sidecar.stat()
        mark = len(appserver.sent)
        second = await run_codex_turn(params(prompt="hello"), app_server=appserver, engine=engine)
        after = await sidecar.stat()

    assert first.projected
    assert not second.projected
    assert second.thread_id == first.thread_id
    # An unchanged binding is not rewritten on resume (no fsyncs per turn for nothing).
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # The bound thread is resumed with the raw prompt (it carries this epoch's context).
    methods = [m["method"] for m in appserver.sent[mark:] if "id" in m and "method" in m]
    assert methods == ["thread/resume", "turn/start"]
    turn_start = [m["params"] for m in appserver.sent[mark:] if m.get("method") == "turn/start"]
    assert [i["text"] for i in turn_start[0]["input"]] == ["hello"]
    decisions = [
        (r["reason"], r["projected"])
        for r in records
        if r["event"] == "codex app-server context-engine projection decision"
    ]
    assert decisions == [
        ("missing-thread-binding", True),
        ("matching-thread-bootstrap-binding", False),
    ]
    resumed = [r["reason"] for r in records if r["event"] == "codex app-server thread resumed"]
    assert resumed == ["matching-thread-bootstrap-binding"]
    # The developer instructions (with the engine's addition) reach the model on both turns.
    requests = offline_model.turn_requests()[-2:]
    assert all("memory recall" in "".join(r.developer_messages) for r in requests)
    # The model saw the projected context exactly once, in the thread's first user turn.
    last = offline_model.turn_requests()[-1]
    assert sum(FRAME_HEADER in u for u in last.user_messages) == 1


async def test_a8b_a_new_epoch_rotates_to_a_fresh_projected_thread(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    first = await run_codex_turn(params(), app_server=appserver, engine=bootstrap_engine("e1"))
    second = await run_codex_turn(params(), app_server=appserver, engine=bootstrap_engine("e2"))
    assert second.thread_id != first.thread_id
    assert second.thread_decision is not None
    assert second.thread_decision.reason == "thread-bootstrap-epoch-changed"
    assert second.projected
    assert [e.trigger for e in second.trace][6] == "thread_rotated"
    binding = read_binding(params().session_file)
    assert binding is not None
    assert binding.thread_id == second.thread_id
    assert binding.thread_decision is not None
    assert (binding.thread_decision.action, binding.thread_decision.reason) == (
        "rotate",
        "thread-bootstrap-epoch-changed",
    )
    assert binding.context_engine is not None
    assert binding.context_engine.projection is not None
    assert binding.context_engine.projection.epoch == "e2"
    assert FRAME_HEADER in offline_model.turn_requests()[-1].last_user_text


async def test_a9_bounds_turn_start_text_keeping_the_newest_context(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    async def huge_context(_: Any) -> PromptBuildResult:
        return PromptBuildResult(prepend_context="old " * 400_000 + "recent anchor")

    hooks = TurnHooks(before_prompt_build=[huge_context])
    p = params(prompt="what now?")
    seed_session(Path(p.session_file), assistant("x"))
    await run_codex_turn(p, app_server=appserver, engine=echo_engine(), hooks=hooks)
    text = offline_model.turn_requests()[-1].last_user_text
    assert TURN_START_TEXT_MAX_CHARS - 16 <= len(text) <= TURN_START_TEXT_MAX_CHARS
    assert "recent anchor" in text
    assert text.endswith("what now?")

    # Without an engine: the oversized hook context is cut, the current prompt survives.
    await run_codex_turn(params(prompt="still here?"), app_server=appserver, hooks=hooks)
    text = offline_model.turn_requests()[-1].last_user_text
    assert len(text) <= TURN_START_TEXT_MAX_CHARS
    assert text.endswith("still here?")


# --- no engine: exactly plain Codex -------------------------------------------------------


def request_shape(request: Any) -> dict[str, Any]:
    """What the model was sent, with each process's private CODEX_HOME path normalised (the
    skills section names it; everything else must be equal)."""

    def same_home(text: str) -> str:
        return re.sub(r"codex_home_\d+", "codex_home_N", text)

    return {
        "developer": [same_home(d) for d in request.developer_parts],
        "user": [same_home(u) for u in request.user_messages],
        "tools": request.tool_names,
    }


async def test_no_engine_and_legacy_engine_turns_are_plain_codex_turns(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    tmp_path: Path,
    workspace: Path,
) -> None:
    async with AppServer.start(make_appserver_config()) as server:
        thread = await server.start_thread(
            ThreadSettings(cwd=str(workspace), developer_instructions=None)
        )
        await server.run_turn(thread.thread_id, "hello")
    plain = request_shape(offline_model.turn_requests()[-1])

    for name, engine in (("none", None), ("legacy", LegacyContextEngine())):
        async with AppServer.start(make_appserver_config(), record_sent=True) as server:
            p = params(session_file=tmp_path / f"{name}.jsonl")
            result = await run_codex_turn(p, app_server=server, engine=engine)
            assert result.outcome is TurnOutcome.COMPLETED
            assert result.maintenance.skip_reason == "no_engine"
            start = sent_params(server, "thread/start")[0]
            assert "developerInstructions" not in start
            assert start["personality"] == "none"
        assert request_shape(offline_model.turn_requests()[-1]) == plain, name


# --- cancellation, timeouts, crash, concurrency ------------------------------------------


async def test_cancelling_the_caller_interrupts_codex_and_still_mirrors_and_finalizes(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    offline_model.script(Reply.fixed("too late", delay=10.0, partial_text="thinking"))
    engine = echo_engine()
    ended: list[TurnResult] = []

    async def on_end(result: TurnResult) -> None:
        ended.append(result)

    p = params(prompt="please be slow")
    with anyio.move_on_after(1.5) as scope:
        await run_codex_turn(p, app_server=appserver, engine=engine, on_turn_end=on_end)
    assert scope.cancelled_caught

    assert "turn/interrupt" in sent_methods(appserver)
    (result,) = ended
    assert result.outcome is TurnOutcome.ABORTED
    assert result.maintenance.skip_reason == "aborted"
    assert [e.trigger for e in result.trace][-3:] == ["turn_aborted", "mirrored", "finalized"]
    assert transcript_texts(p.session_file).count("please be slow") == 1
    assert len(engine.calls_to("after_turn")) == 1
    assert engine.calls_to("maintain") == []


@pytest.mark.parametrize(
    ("timeouts", "needle"), [({"turn_timeout": 1.0}, "timed out"), ({"idle_timeout": 0.7}, "idle")]
)
async def test_turn_and_idle_timeouts_interrupt_and_end_as_prompt_errors(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    timeouts: dict[str, float],
    needle: str,
) -> None:
    offline_model.script(Reply.fixed("too late", delay=10.0))
    engine = echo_engine()
    p = params(prompt="slow please", **timeouts)
    with anyio.fail_after(8):
        result = await run_codex_turn(p, app_server=appserver, engine=engine)
    assert result.outcome is TurnOutcome.TIMED_OUT
    assert result.prompt_error is not None
    assert needle in result.prompt_error
    assert result.maintenance.skip_reason == "prompt_error"
    assert "turn/interrupt" in sent_methods(appserver)
    assert transcript_texts(p.session_file).count("slow please") == 1


async def test_an_app_server_crash_mid_turn_fails_the_turn_and_the_next_turn_recovers(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    offline_model.script(Reply.fixed("never", delay=10.0))
    engine = echo_engine()

    async def kill_soon() -> None:
        await anyio.to_thread.run_sync(offline_model.wait_for_requests, 1)
        client = appserver.current
        assert client is not None
        process = client.transport
        assert isinstance(process, AppServerProcess)
        process.kill()

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_soon)
        with anyio.fail_after(8):
            crashed = await run_codex_turn(
                params(prompt="crash me"), app_server=appserver, engine=engine
            )
    assert crashed.outcome is TurnOutcome.FAILED
    assert crashed.prompt_error == "codex app-server closed"
    assert [e.trigger for e in crashed.trace][-3:] == ["turn_failed", "mirrored", "finalized"]

    recovered = await run_codex_turn(params(prompt="again"), app_server=appserver, engine=engine)
    assert recovered.outcome is TurnOutcome.COMPLETED
    texts = transcript_texts(params().session_file)
    assert texts.count("crash me") == 1
    assert texts.count("again") == 1


async def test_concurrent_turns_on_one_session_are_serialized_or_refused(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    offline_model.script(Reply.fixed("slow one", delay=1.0), user_contains="first")
    results: dict[str, TurnResult] = {}

    async def turn(prompt: str) -> None:
        results[prompt] = await run_codex_turn(params(prompt=prompt), app_server=appserver)

    async with anyio.create_task_group() as tg:
        tg.start_soon(turn, "first")
        await anyio.sleep(0.2)
        tg.start_soon(turn, "second")
        await anyio.sleep(0.2)
        with pytest.raises(SessionBusy):  # session contention, not an FSM re-entrancy
            await run_codex_turn(params(prompt="third", concurrency="reject"), app_server=appserver)
    first, second = results["first"], results["second"]
    assert first.outcome is second.outcome is TurnOutcome.COMPLETED
    # The second turn began only after the first had finished.
    assert second.trace[0].monotonic_ns > first.trace[-1].monotonic_ns
    texts = transcript_texts(params().session_file)
    assert (texts.count("first"), texts.count("second"), texts.count("third")) == (1, 1, 0)


# --- the snowball bound ----------------------------------------------------------------------


def growing_engine(mode: str | None) -> RecordingEngine:
    """An engine that assembles the WHOLE transcript every turn (the worst case)."""
    projection = ContextProjection(mode="thread_bootstrap", epoch="stable") if mode else None
    return RecordingEngine(
        engine_id="grower",
        responses={
            "assemble": lambda p: AssembleResult(
                messages=list(p.messages), estimated_tokens=0, context_projection=projection
            )
        },
    )


@pytest.mark.parametrize("mode", [None, "thread_bootstrap"])
async def test_what_codex_sends_the_model_stays_bounded_over_twenty_turns(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    mode: str | None,
) -> None:
    engine = growing_engine(mode)
    padding = "lorem ipsum " * 150  # ~1.8k chars of context per turn
    sizes = []
    for index in range(20):
        await run_codex_turn(
            params(prompt=f"turn {index} {padding}"), app_server=appserver, engine=engine
        )
        request = offline_model.turn_requests()[-1]
        users = request.user_messages
        # Projected context enters a thread once: never two framed copies in one request.
        assert sum(FRAME_HEADER in u for u in users) <= 1
        sizes.append(sum(len(u) for u in users))
    if mode is None:
        # Per-turn projection: a fresh thread every turn; each request holds one projection,
        # bounded by the projection cap (24k chars without a budget) plus the prompt.
        assert max(sizes) <= 24_000 + 2 * len(padding) + 4_000
    else:
        # Thread bootstrap: one projection, then raw prompts replayed natively: linear growth.
        # (Per-turn projection onto the resumed thread would add the whole history, i.e. a
        # growing multiple of the padding, to every request.)
        growth = [b - a for a, b in itertools.pairwise(sizes)][2:]
        assert max(growth) <= 2 * len(padding) + 2_000


async def test_binding_records_the_thread_and_tools_fingerprint(
    appserver: AppServer, params: Callable[..., TurnParams]
) -> None:
    result = await run_codex_turn(params(), app_server=appserver, engine=echo_engine())
    sidecar = anyio.Path(str(params().session_file) + ".codex-app-server.json")
    raw = json.loads(await sidecar.read_text())
    assert raw["threadId"] == result.thread_id
    assert raw["dynamicToolsFingerprint"] == "[]"
    assert raw["contextEngine"]["engineId"] == "lossless-claw"


# --- Codex's own compaction inside a turn --------------------------------------------------


async def test_native_compaction_inside_a_turn_runs_hooks_and_is_labelled_as_codex_s(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    events: list[tuple[str, str | None]] = []
    diagnostics: list[dict[str, Any]] = []

    async def before(event: Any) -> None:
        events.append(("before", event.item_id))

    async def after(event: Any) -> None:
        events.append(("after", event.item_id))

    async def sink(diagnostic: Any) -> None:
        diagnostics.append(dict(diagnostic))

    hooks = TurnHooks(
        before_compaction=[before], after_compaction=[after], on_compaction_event=sink
    )
    # Owns compaction, and resumes its thread (thread_bootstrap), so Codex's native history
    # grows past the limit.
    engine = bootstrap_engine(owns_compaction=True)
    # Codex compacts automatically before the next turn once usage passed the limit.
    async with AppServer.start(make_appserver_config(auto_compact_token_limit=50)) as server:
        first = await run_codex_turn(params(), app_server=server, engine=engine, hooks=hooks)
        second = await run_codex_turn(
            params(prompt="next"), app_server=server, engine=engine, hooks=hooks
        )

    assert first.native_compactions == 0
    assert second.native_compactions == 1
    triggers = [e.trigger for e in second.trace]
    assert (
        triggers.index("native_compaction_started")
        < triggers.index("native_compaction_completed")
        < triggers.index("turn_completed")
    )
    assert [kind for kind, _ in events] == ["before", "after"]
    assert events[0][1] is not None
    assert events[0][1] == events[1][1]
    assert len(offline_model.compaction_requests()) == 1
    assert engine.calls_to("compact") == []  # Codex's compaction is not the engine's
    phases = [(d["phase"], d.get("ownsCompaction")) for d in diagnostics]
    assert phases == [("start", None), ("start", True), ("end", None), ("end", True)]
    assert all(d["backend"] == "codex-app-server" for d in diagnostics)
    assert second.outcome is TurnOutcome.COMPLETED


async def test_lifecycle_log_events_carry_ids_and_counts_but_no_content(
    appserver: AppServer, params: Callable[..., TurnParams]
) -> None:
    p = params(prompt="tell me about the secret project Nightjar")
    seed_session(Path(p.session_file), assistant("the Nightjar budget is 4M"))
    with capture_logs() as records:
        result = await run_codex_turn(p, app_server=appserver, engine=echo_engine())
    by_event = {r["event"]: r for r in records}
    for name in (
        "codex context engine bootstrap completed",
        "codex context engine assemble applied",
        "codex app-server context-engine projection decision",
        "codex context engine finalize completed",
        "codex turn finished",
    ):
        assert name in by_event, name
        record = by_event[name]
        assert record["session_id"] == "session-1"
        assert record["session_key"] != "agent:main:session-1"
        assert record["session_key"].startswith("agent:")
        assert record["engine"] == "lossless-claw"
    assemble = by_event["codex context engine assemble applied"]
    assert (assemble["assembled_messages"], assemble["estimated_tokens"]) == (2, 42)
    assert assemble["has_system_prompt_addition"] is True
    finished = by_event["codex turn finished"]
    assert finished["thread_id"] == result.thread_id
    assert finished["turn_id"] == result.turn_id
    assert set(finished["durations_ms"]) >= {"ASSEMBLING", "RUNNING_TURN", "FINALIZING"}
    assert "Nightjar" not in repr(records)


# --- after an engine compaction --------------------------------------------------------------


async def test_after_an_engine_compaction_the_next_turn_rotates_and_reprojects(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session

    state = {"summary": "nothing yet"}

    def assemble(p: Any) -> AssembleResult:
        return AssembleResult(
            messages=[assistant(f"summary: {state['summary']}"), *p.messages[-2:]],
            estimated_tokens=10,
            context_projection=ContextProjection(mode="thread_bootstrap", epoch="epoch-1"),
        )

    def compact(_: Any) -> dict[str, Any]:
        # The epoch stays the same on purpose: the rotation below must come from the
        # compaction clearing the binding's projection, not from the engine.
        state["summary"] = "COMPACTED-SUMMARY-77"
        return {"ok": True, "compacted": True, "result": {"summary": "s", "tokensBefore": 9}}

    engine = RecordingEngine(
        engine_id="lossless-claw",
        owns_compaction=True,
        responses={"assemble": assemble, "compact": compact},
    )
    first = await run_codex_turn(params(prompt="turn one"), app_server=appserver, engine=engine)
    second = await run_codex_turn(params(prompt="turn two"), app_server=appserver, engine=engine)
    assert second.thread_id == first.thread_id
    assert not second.projected

    compacted = await compact_codex_session(
        CompactSessionParams(session_id="session-1", session_file=params().session_file),
        app_server=appserver,
        engine=engine,
    )
    assert compacted.ok
    assert compacted.compacted
    binding = read_binding(params().session_file)
    assert binding is not None
    assert binding.context_engine is not None
    assert binding.context_engine.projection is None  # cleared: the thread is stale

    third = await run_codex_turn(params(prompt="turn three"), app_server=appserver, engine=engine)
    assert third.thread_id != first.thread_id
    assert third.thread_decision is not None
    assert third.thread_decision.action.value == "rotate"
    assert third.projected
    text = offline_model.turn_requests()[-1].last_user_text
    assert "COMPACTED-SUMMARY-77" in text  # the compacted context reached the model
