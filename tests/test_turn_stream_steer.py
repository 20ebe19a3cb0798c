"""Steering a running turn, files Codex saved, the turn's event stream.

End-to-end tests (marker ``codex``) run the real ``codex app-server`` against the offline
model: a message steered during a slow reply reaches the model in the same turn and is
mirrored in order (the engine's finalize sees it); ``queue`` and ``reject`` modes; the event
stream delivers every event in order, and a slow consumer does not slow the turn (measured).
The media path is driven here through the in-process fake app-server with the item Codex's
schema defines; ``tests/test_media_e2e.py`` drives it end to end (Codex 0.163 offers its image
tool to a provider with an ``x-openai-actor-authorization`` header and saves what the offline
model's Images API returns). Every prompt and steered text is private: the conftest guard
fails a test whose logs carry one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from structlog.testing import capture_logs
from support import fake_appserver
from support.fake_appserver import CodexScript, FakeAppServer
from support.transcripts import transcript_texts
from support.turns import temporary_session_file, turn_params

from codex_turn import AppServer, InvalidTurnParams, TurnParams, TurnResult, run_codex_turn
from codex_turn.fsm import SteerState
from codex_turn.harness.appserver import (
    AppServerRpcError,
    DynamicTool,
    Notification,
    TurnNotRunning,
)
from codex_turn.harness.turn.steering import (
    LiveTurn,
    SteerMode,
    SteerReceipt,
    SteerStatus,
    codex_turn_running,
    steer_codex_turn,
)
from codex_turn.harness.turn.streaming import (
    AgentMessageCompleted,
    AgentMessageDelta,
    CompactionEvent,
    FileSaved,
    MessagesSteered,
    PlanUpdated,
    ReasoningSummaryDelta,
    StateChanged,
    ToolCall,
    TurnEvent,
    TurnEventStream,
    TurnFile,
    events_of,
)
from codex_turn.testing import OfflineModel, RecordingEngine, Reply

pytestmark = pytest.mark.anyio


@pytest.fixture
def params(tmp_path: Path, workspace: Path, private_texts: set[str]) -> Callable[..., TurnParams]:
    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "s-16",
            "session_key": "agent:main:s-16",
            "session_file": tmp_path / "s-16.jsonl",
            "workspace_dir": workspace,
            "prompt": "Summarise the release notes please",
        }
        values.update(overrides)
        private_texts.add(values["prompt"])
        return TurnParams(**values)

    return make


def triggers(result: TurnResult) -> list[str]:
    return [entry.trigger for entry in result.trace]


async def collect(events: TurnEventStream, into: list[TurnEvent]) -> None:
    async for event in events:
        into.append(event)


async def wait_for(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    with anyio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110 - a test helper polling shared state
            await anyio.sleep(0.01)


# --- steering, end to end ---------------------------------------------------------------------


@pytest.mark.codex
async def test_a_steer_during_a_long_turn_reaches_the_model_in_that_turn_and_is_mirrored_in_order(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    private_texts: set[str],
) -> None:
    first, second = "Also mention the bug fixes", "And keep it under 50 words"
    private_texts.update({first, second})
    # A slow first reply (its start streams, then it stalls for 8 s), then the answer.
    offline_model.script(
        Reply.fixed("Working on the summary now", delay=8.0, partial_text="Working"),
        Reply.fixed("Summary with bug fixes, short."),
    )
    engine = RecordingEngine()
    events = TurnEventStream(max_buffered=math.inf)
    seen: list[TurnEvent] = []
    receipts: dict[str, SteerReceipt] = {}
    turn_params_ = params()

    async def steer(text: str) -> None:
        receipts[text] = await steer_codex_turn(turn_params_.session_file, text)

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, events, seen)

        async def runner() -> None:
            await wait_for(lambda: any(isinstance(e, AgentMessageDelta) for e in seen))
            tg.start_soon(steer, first)
            await anyio.sleep(0.02)  # inside the quiet interval: one batch, in arrival order
            tg.start_soon(steer, second)

        tg.start_soon(runner)
        result = await run_codex_turn(
            turn_params_, app_server=appserver, engine=engine, events=events
        )
    elapsed = time.monotonic() - started

    assert result.outcome.value == "completed"
    assert result.assistant_text == "Summary with bug fixes, short."
    assert elapsed < 8.0  # the steer ended the stalled reply early: it did not wait for it
    # One batch, one internal transition inside running_turn.
    assert result.steered == (first, second)
    assert triggers(result).count("steered") == 1
    steered_at = triggers(result).index("steered")
    assert result.trace[steered_at].state == result.trace[steered_at].dest == "RUNNING_TURN"
    assert triggers(result)[steered_at + 1] == "turn_completed"
    assert {r.status for r in receipts.values()} == {SteerStatus.STEERED}
    assert {r.turn_id for r in receipts.values()} == {result.turn_id}
    # The model saw the steer in the same Codex turn, after the prompt, in arrival order.
    requests = offline_model.turn_requests()
    assert len(requests) == 2
    assert requests[0].turn_metadata.get("turn_id") == requests[1].turn_metadata.get("turn_id")
    assert requests[1].last_user_text == f"{first}\n{second}"
    assert requests[1].user_messages[-2] == turn_params_.prompt
    # Mirrored in order: prompt, the steered messages, the reply (once each).
    texts = transcript_texts(turn_params_.session_file)
    assert texts == [turn_params_.prompt, first, second, "Summary with bug fixes, short."]
    # The engine's finalize sees them.
    (after_turn,) = engine.calls_to("after_turn")
    finalized = [m.get("content") for m in after_turn.params.messages]
    assert finalized[:3] == [turn_params_.prompt, first, second]
    # The stream told the runner, and its state changes are the trace.
    assert [e.trigger for e in seen if isinstance(e, StateChanged)] == triggers(result)
    (told,) = [e for e in seen if isinstance(e, MessagesSteered)]
    assert told.texts == (first, second)
    assert told.turn_id == result.turn_id
    assert not codex_turn_running(turn_params_.session_file)


@pytest.mark.codex
async def test_a_steer_that_arrives_before_the_codex_turn_starts_is_delivered_to_it(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    private_texts: set[str],
) -> None:
    # The delivery task starts only when a message arrives; one that arrived while the turn
    # was still assembling starts it as soon as the Codex turn runs.
    early = "Mention the release date too"
    private_texts.add(early)
    offline_model.script(
        Reply.fixed("Working on it", delay=5.0, partial_text="Working"),
        Reply.fixed("Summary with the date."),
    )
    engine = RecordingEngine(delays={"assemble": 0.5})
    events = TurnEventStream(max_buffered=math.inf)
    seen: list[TurnEvent] = []
    receipts: list[SteerReceipt] = []
    turn_params_ = params()

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, events, seen)

        async def runner() -> None:
            await wait_for(
                lambda: any(isinstance(e, StateChanged) and e.dest == "ASSEMBLING" for e in seen)
            )
            receipts.append(await steer_codex_turn(turn_params_.session_file, early))

        tg.start_soon(runner)
        result = await run_codex_turn(
            turn_params_, app_server=appserver, engine=engine, events=events
        )
    assert result.outcome.value == "completed"
    assert [r.status for r in receipts] == [SteerStatus.STEERED]
    assert result.steered == (early,)
    assert transcript_texts(turn_params_.session_file) == [
        turn_params_.prompt,
        early,
        "Summary with the date.",
    ]


@pytest.mark.codex
async def test_queue_and_reject_modes_leave_the_running_turn_alone(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    private_texts: set[str],
) -> None:
    queued, refused = "Then translate it to French", "Stop everything"
    private_texts.update({queued, refused})
    offline_model.script(
        Reply.fixed("Summary.", delay=1.0, partial_text="Sum"), Reply.fixed("Résumé.")
    )
    events = TurnEventStream(max_buffered=math.inf)
    seen: list[TurnEvent] = []
    first_params = params(steering="queue")
    results: list[TurnResult] = []
    receipts: list[SteerReceipt] = []

    async def first_turn() -> None:
        results.append(await run_codex_turn(first_params, app_server=appserver, events=events))

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, events, seen)
        tg.start_soon(first_turn)
        await wait_for(lambda: any(isinstance(e, AgentMessageDelta) for e in seen))
        receipts.append(await steer_codex_turn(first_params.session_file, queued))
        receipts.append(
            await steer_codex_turn(first_params.session_file, refused, mode=SteerMode.REJECT)
        )
        assert codex_turn_running(first_params.session_file)
        # The runner runs the queued message as the next turn: it waits for the running one.
        results.append(
            await run_codex_turn(params(prompt=queued, steering="queue"), app_server=appserver)
        )

    assert receipts == [
        SteerReceipt(status=SteerStatus.QUEUED, reason="queue"),
        SteerReceipt(status=SteerStatus.REJECTED, reason="reject"),
    ]
    before, after = results
    assert before.assistant_text == "Summary."
    assert before.steered == ()
    assert "steered" not in triggers(before)
    assert after.assistant_text == "Résumé."
    requests = offline_model.turn_requests()
    assert [r.last_user_text for r in requests] == [first_params.prompt, queued]
    assert refused not in "\n".join(transcript_texts(first_params.session_file))
    assert await steer_codex_turn(first_params.session_file, queued) == SteerReceipt(
        status=SteerStatus.NO_TURN
    )


# --- the event stream, end to end -------------------------------------------------------------


@pytest.mark.codex
async def test_the_stream_delivers_every_event_of_a_turn_in_order(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    async def lookup(arguments: dict[str, Any]) -> str:
        return f"found {arguments.get('q')}"

    tool = DynamicTool(
        name="lookup",
        description="Look a term up.",
        input_schema={"type": "object", "properties": {"q": {"type": "string"}}},
        fn=lookup,
    )
    offline_model.script(
        Reply.function_call("lookup", {"q": "release"}),
        Reply.with_reasoning("Checking what the lookup found.", "The release is on Friday."),
    )
    events = TurnEventStream(max_buffered=math.inf)
    seen: list[TurnEvent] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, events, seen)
        result = await run_codex_turn(params(), app_server=appserver, tools=[tool], events=events)

    assert result.assistant_text == "The release is on Friday."
    assert events.dropped == 0
    assert [e.seq for e in seen] == list(range(events.published))
    assert [e.monotonic_ns for e in seen] == sorted(e.monotonic_ns for e in seen)
    assert [e.trigger for e in seen if isinstance(e, StateChanged)] == triggers(result)
    kinds = [type(e).__name__ for e in seen]
    # Codex's events all come while the machine is in running_turn.
    entered = next(
        i for i, e in enumerate(seen) if isinstance(e, StateChanged) and e.dest == "RUNNING_TURN"
    )
    left = next(
        i
        for i, e in enumerate(seen)
        if isinstance(e, StateChanged) and e.trigger == "turn_completed"
    )
    assert all(isinstance(e, StateChanged) for e in seen[:entered] + seen[left:])
    codex_events = seen[entered + 1 : left]
    tool_calls = [e for e in codex_events if isinstance(e, ToolCall)]
    assert [(c.phase, c.kind, c.name) for c in tool_calls] == [
        ("started", "dynamicToolCall", "lookup"),
        ("completed", "dynamicToolCall", "lookup"),
    ]
    assert tool_calls[0].arguments == {"q": "release"}
    reasoning = [e for e in codex_events if isinstance(e, ReasoningSummaryDelta)]
    assert "".join(r.delta for r in reasoning) == "Checking what the lookup found."
    deltas = [e for e in codex_events if isinstance(e, AgentMessageDelta)]
    assert "".join(d.delta for d in deltas) == "The release is on Friday."
    (completed,) = [e for e in codex_events if isinstance(e, AgentMessageCompleted)]
    assert completed.text == "The release is on Friday."
    # Order: the tool call, then the reasoning, then the reply streams and completes.
    assert kinds.index("ToolCall") < kinds.index("ReasoningSummaryDelta")
    assert kinds.index("ReasoningSummaryDelta") < kinds.index("AgentMessageDelta")
    assert kinds.index("AgentMessageDelta") < kinds.index("AgentMessageCompleted")


@pytest.mark.codex
async def test_a_slow_consumer_does_not_stall_the_turn(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    await run_codex_turn(params(prompt="warm up the thread"), app_server=appserver)

    started = time.monotonic()
    await run_codex_turn(params(prompt="baseline turn"), app_server=appserver)
    baseline = time.monotonic() - started

    events = TurnEventStream(max_buffered=2)
    seen: list[TurnEvent] = []

    async def slow(stream: TurnEventStream) -> None:
        async for event in stream:
            seen.append(event)
            await anyio.sleep(0.3)  # far slower than the turn publishes

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow, events)
        started = time.monotonic()
        result = await run_codex_turn(
            params(prompt="slow consumer turn"), app_server=appserver, events=events
        )
        with_slow = time.monotonic() - started

    assert result.outcome.value == "completed"
    # ~20 events at 0.3 s each would be 6 s if publishing waited for the consumer.
    assert with_slow < baseline + 1.5, (baseline, with_slow)
    assert events.dropped > 0
    assert len(seen) + events.dropped == events.published
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)  # in order, with gaps


# --- media: a file Codex saved, even without assistant text (in-process fake) -----------------


@pytest.fixture
def image_item(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """The fake Codex emits an ``imageGeneration`` item with a ``savedPath`` (the item Codex
    0.163's schema defines; offline the real binary never emits one) before the turn ends."""
    saved = str(tmp_path / "generated_images" / "ig_1.png")
    original = fake_appserver._steps

    def steps(script: CodexScript, thread_id: str, turn_id: str) -> list[Any]:
        out = original(script, thread_id, turn_id)
        item = {
            "type": "imageGeneration",
            "id": "ig_1",
            "status": "completed",
            "result": "iVBORw0KGgo=",
            "revisedPrompt": "a red dot",
            "savedPath": saved,
        }
        for method in ("item/started", "item/completed"):
            out.insert(
                len(out) - 1,
                Notification(method, {"threadId": thread_id, "turnId": turn_id, "item": item}),
            )
        return out

    monkeypatch.setattr(fake_appserver, "_steps", steps)
    return saved


async def test_a_saved_image_is_returned_as_a_file_even_without_assistant_text(
    image_item: str,
) -> None:
    server = FakeAppServer(scripts=[CodexScript(reply=None)])
    events = TurnEventStream(max_buffered=math.inf)
    seen: list[TurnEvent] = []
    with temporary_session_file("media-") as session_file:
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, events, seen)
            result = await run_codex_turn(
                turn_params(session_file, "draw a red dot"), app_server=server, events=events
            )
    assert result.assistant_text is None
    assert result.files == (
        TurnFile(
            path=image_item,
            kind="generated_image",
            item_id="ig_1",
            mime_type="image/png",
            revised_prompt="a red dot",
        ),
    )
    (saved,) = [e for e in seen if isinstance(e, FileSaved)]
    assert saved.file == result.files[0]
    assert [(e.phase, e.kind) for e in seen if isinstance(e, ToolCall)] == [
        ("started", "imageGeneration"),
        ("completed", "imageGeneration"),
    ]


# --- steering refused, without the binary -----------------------------------------------------


async def test_a_steer_codex_refuses_is_queued_and_nothing_is_mirrored(
    private_texts: set[str],
) -> None:
    # The fake's client cannot send turn/steer: the handle raises, as Codex refusing would.
    server = FakeAppServer(scripts=[CodexScript(ending="hang")])
    late = "one more thing about the release"
    private_texts.add(late)
    with temporary_session_file("refused-") as session_file:
        params = turn_params(session_file, "start the release", idle_timeout=1.0)
        receipts: list[SteerReceipt] = []

        async def steer() -> None:
            await wait_for(lambda: codex_turn_running(session_file))
            receipts.append(await steer_codex_turn(session_file, late))

        async with anyio.create_task_group() as tg:
            tg.start_soon(steer)
            result = await run_codex_turn(params, app_server=server)
        texts = transcript_texts(session_file)
    assert receipts == [SteerReceipt(status=SteerStatus.QUEUED, reason="refused")]
    assert result.steered == ()
    assert "steered" not in triggers(result)
    assert late not in texts


# --- the pieces -------------------------------------------------------------------------------


def _note(method: str, **params: Any) -> Notification:
    return Notification(method, {"threadId": "t", "turnId": "u", **params})


def test_codex_notifications_become_typed_events() -> None:
    def one(note: Notification) -> TurnEvent:
        (pending,) = events_of(note)
        return pending(7, 1)

    plan = one(
        _note(
            "turn/plan/updated",
            explanation="why",
            plan=[{"step": "read", "status": "completed"}, {"step": "write", "status": "pending"}],
        )
    )
    assert isinstance(plan, PlanUpdated)
    assert plan.explanation == "why"
    assert [(s.step, s.status) for s in plan.steps] == [("read", "completed"), ("write", "pending")]
    compaction = one(_note("item/started", item={"type": "contextCompaction", "id": "c1"}))
    assert compaction == CompactionEvent(seq=7, monotonic_ns=1, phase="started", item_id="c1")
    mcp = one(
        _note(
            "item/completed",
            item={
                "type": "mcpToolCall",
                "id": "m1",
                "server": "docs",
                "tool": "search",
                "status": "completed",
                "arguments": {"q": "x"},
            },
        )
    )
    assert isinstance(mcp, ToolCall)
    assert (mcp.name, mcp.status) == ("docs.search", "completed")
    command = one(
        _note(
            "item/started",
            item={"type": "commandExecution", "id": "x1", "command": "ls", "status": "inProgress"},
        )
    )
    assert isinstance(command, ToolCall)
    assert command.name == "ls"
    assert events_of(_note("thread/tokenUsage/updated", tokenUsage={})) == []
    assert events_of(_note("item/completed", item={"type": "userMessage", "id": "u1"})) == []
    # An image generation without a saved path is a tool call, not a file.
    (only,) = events_of(
        _note("item/completed", item={"type": "imageGeneration", "id": "i", "result": ""})
    )
    assert isinstance(only(0, 0), ToolCall)


async def test_a_full_buffer_drops_and_counts_and_never_blocks() -> None:
    stream = TurnEventStream(max_buffered=3)
    live = LiveTurn(events=stream)
    for index in range(10):
        live.on_notification(_note("item/agentMessage/delta", itemId="m", delta=str(index)))
    assert (stream.published, stream.dropped) == (10, 7)
    stream.close()
    got = [e async for e in stream]
    assert [e.seq for e in got] == [0, 1, 2]
    assert [e.delta for e in got if isinstance(e, AgentMessageDelta)] == ["0", "1", "2"]
    stream.publish(lambda seq, ns: TurnEvent(seq=seq, monotonic_ns=ns))  # after close: ignored
    assert stream.published == 10
    with pytest.raises(ValueError, match="one turn"):
        LiveTurn(events=stream)
    with pytest.raises(ValueError, match="max_buffered"):
        TurnEventStream(max_buffered=0)


async def test_a_consumer_that_stopped_reading_costs_the_turn_nothing() -> None:
    stream = TurnEventStream(max_buffered=math.inf)
    await stream.aclose()
    LiveTurn(events=stream).on_notification(_note("item/agentMessage/delta", itemId="m", delta="x"))
    assert (stream.published, stream.dropped) == (1, 1)


async def test_steering_needs_a_running_turn_and_text(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    assert await steer_codex_turn(session, "hello") == SteerReceipt(status=SteerStatus.NO_TURN)
    with pytest.raises(ValueError, match="text"):
        await steer_codex_turn(session, "  ")
    with pytest.raises(ValueError, match="later"):
        await steer_codex_turn(session, "hello", mode="later")
    live = LiveTurn(mode="steer")
    with live.serving(str(session)):
        assert codex_turn_running(session)
        # No Codex turn yet: a steered message waits for it; the turn ending queues it.
        async with anyio.create_task_group() as tg:
            got: list[SteerReceipt] = []

            async def send() -> None:
                got.append(await steer_codex_turn(session, "hello"))

            tg.start_soon(send)
            await anyio.sleep(0.05)
            assert got == []
            live._end()
    assert got == [SteerReceipt(status=SteerStatus.QUEUED, reason="turn_ended")]
    assert not codex_turn_running(session)
    assert await steer_codex_turn(session, "hello") == SteerReceipt(status=SteerStatus.NO_TURN)


async def test_a_steered_message_that_could_not_be_a_prompt_is_refused_before_it_is_sent(
    tmp_path: Path,
) -> None:
    # Before: a lone surrogate was steered (Codex repaired it), answered, and reported
    # UNANSWERED; now it is refused as the same text would be as a prompt.
    session = tmp_path / "s.jsonl"
    live = LiveTurn(mode="steer")
    with live.serving(str(session)):
        texts: list[Any] = ["bad \ud800 text", "x" * ((1 << 20) + 1), "  ", None]
        for text in texts:
            with anyio.fail_after(5), pytest.raises(InvalidTurnParams, match="steered message"):
                await steer_codex_turn(session, text)
            with pytest.raises(InvalidTurnParams, match="prompt"):
                TurnParams(session_id="s", session_file=session, workspace_dir=".", prompt=text)
        live._end()


@pytest.mark.anyio
async def test_the_event_stream_ends_when_the_turn_is_refused_before_it_starts(
    tmp_path: Path,
) -> None:
    """A refusal before any I/O (an engine spec that does not load) still closes the stream,
    so a consumer elsewhere never waits forever."""
    from support.fake_appserver import FakeAppServer
    from support.turns import turn_params

    from codex_turn import EngineLoadError, run_codex_turn
    from codex_turn.harness.turn.streaming import TurnEventStream

    events = TurnEventStream()
    with pytest.raises(EngineLoadError):
        await run_codex_turn(
            turn_params(str(tmp_path / "s.jsonl"), "hi"),
            app_server=FakeAppServer(),
            engine="no_such_module_xyz:Engine",
            events=events,
        )
    with anyio.fail_after(2):
        received = [event async for event in events]
    assert received == []


# --- what became of a steer: answered, unanswered, timed out ------------------------------------


class _SteerHandle:
    """A turn handle whose ``turn/steer`` answers, refuses or never answers, as scripted."""

    def __init__(self, answer: str | BaseException | None) -> None:
        self.answer = answer
        self.sent: list[list[str]] = []

    async def steer(self, input: Any, *, timeout: float | None = None) -> str:  # noqa: ASYNC109
        self.sent.append([part.text for part in input])
        if self.answer is None:
            await anyio.sleep_forever()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return str(self.answer)


class _Ctx:
    """What the steering inbox needs of a turn context."""

    def __init__(self, tmp_path: Path) -> None:
        self.emitted: list[str] = []
        self.log = structlog.get_logger("test")
        self.prompt_identity = "run-x:prompt"
        self.session_file = str(tmp_path / "s.jsonl")
        self.thread_id = "t"
        self.params = type("P", (), {"session_id": "s", "workspace_dir": tmp_path})()

    def emit(self, trigger: Any) -> None:
        self.emitted.append(str(trigger))


def _user_item(item_id: str, *texts: str) -> list[Notification]:
    item = {
        "type": "userMessage",
        "id": item_id,
        "content": [{"type": "text", "text": t, "text_elements": []} for t in texts],
    }
    return [_note(method, item=item) for method in ("item/started", "item/completed")]


def _reply(item_id: str) -> list[Notification]:
    item = {"type": "agentMessage", "id": item_id, "text": "final"}
    return [
        _note("item/started", item=item),
        _note("item/agentMessage/delta", itemId=item_id, delta="fin"),
        _note("item/completed", item=item),
    ]


def _codex_result() -> Any:
    from codex_turn.harness.appserver import CodexTurnResult, CodexTurnStatus

    return CodexTurnResult(
        thread_id="t",
        turn_id="u",
        outcome=CodexTurnStatus.COMPLETED,
        prompt_error=None,
        final_text="final",
        reasoning_text=None,
        plan_text=None,
        usage=None,
        context_window=None,
        messages_snapshot=[
            {"role": "user", "content": "prompt"},
            {"role": "assistant", "content": "final"},
        ],
        mirror_identities=["run-x:prompt", "run-x:reply"],
        idempotency_scope="codex-app-server:t",
        compaction_item_ids=[],
        item_ids=[],
        dangling_item_ids=[],
        partial_text=None,
    )


async def _steer_during(
    live: LiveTurn, ctx: _Ctx, handle: _SteerHandle, notes: list[Notification], text: str
) -> SteerReceipt:
    """Steer ``text`` once the turn's reply completed, replay ``notes`` (what Codex sent after
    the steer), then end the Codex turn; the receipt."""
    receipts: list[SteerReceipt] = []

    async def steer() -> None:
        receipts.append(await steer_codex_turn(ctx.session_file, text))

    async with anyio.create_task_group() as tg:
        with live.serving(ctx.session_file):
            async with live.delivering(ctx, handle):  # type: ignore[arg-type]
                for note in [*_user_item("p", "prompt"), *_reply("m1")]:
                    live.on_notification(note)
                tg.start_soon(steer)
                await wait_for(lambda: bool(handle.sent))
                for note in notes:
                    live.on_notification(note)
                await anyio.sleep(0.05)
    (receipt,) = receipts
    return receipt


async def test_a_steer_codex_takes_as_the_turn_ends_is_unanswered_and_mirrored_after_the_reply(
    tmp_path: Path,
) -> None:
    # Codex 0.163, steered 2-4 ms after the final reply completed (3 in ~200 trials against
    # the binary): turn/steer answered, the steer's userMessage item, then turn/completed
    # without another model request. The notifications here are that recorded sequence.
    late = "one more thing"
    ctx, handle = _Ctx(tmp_path), _SteerHandle("u")
    live = LiveTurn(quiet_interval=0)
    ending = [
        _note("thread/tokenUsage/updated"),
        *_user_item("s1", late),
        _note("thread/status/changed"),
        _note("turn/completed", turn={"id": "u", "status": "completed"}),
    ]
    receipt = await _steer_during(live, ctx, handle, ending, late)
    assert receipt == SteerReceipt(status=SteerStatus.UNANSWERED, turn_id="u")
    assert live.steered == []
    assert ctx.emitted == []  # no "steered" step: nothing answered it
    # Mirrored after the reply: the user's words stay, in the order things happened.
    mirrored = live.with_steered(_codex_result())
    assert [m["content"] for m in mirrored.messages_snapshot] == ["prompt", "final", late]
    assert mirrored.mirror_identities[-1] == "run-x:steer-0"


async def test_a_steer_the_model_works_after_is_steered(tmp_path: Path) -> None:
    text = "and the bug fixes"
    ctx, handle = _Ctx(tmp_path), _SteerHandle("u")
    live = LiveTurn(quiet_interval=0)
    receipt = await _steer_during(live, ctx, handle, [*_user_item("s1", text), *_reply("m2")], text)
    assert receipt == SteerReceipt(status=SteerStatus.STEERED, turn_id="u")
    assert [m.text for m in live.steered] == [text]
    assert ctx.emitted == ["steered"]
    mirrored = live.with_steered(_codex_result())
    assert [m["content"] for m in mirrored.messages_snapshot] == ["prompt", text, "final"]


async def test_a_timed_out_steer_that_lands_later_is_steered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # turn/steer never answered in time (Codex stalled), but its userMessage item arrives.
    from codex_turn.harness.turn import steering

    monkeypatch.setattr(steering, "INTERRUPT_GRACE_S", 0.01)
    text = "late but applied"
    ctx, handle = _Ctx(tmp_path), _SteerHandle(None)
    live = LiveTurn(quiet_interval=0)

    async def landed() -> list[Notification]:
        return [*_user_item("s1", text), *_reply("m2")]

    receipt = await _steer_during(live, ctx, handle, [], text)
    # Nothing showed up before the turn ended: unknown, never "queued", not mirrored.
    assert receipt == SteerReceipt(status=SteerStatus.UNKNOWN, reason="timed_out")
    assert live.steered == []
    assert live.unanswered == []

    live = LiveTurn(quiet_interval=0)
    receipts: list[SteerReceipt] = []

    async def steer() -> None:
        receipts.append(await steer_codex_turn(ctx.session_file, text))

    async with anyio.create_task_group() as tg:
        with live.serving(ctx.session_file):
            async with live.delivering(ctx, _SteerHandle(None)):  # type: ignore[arg-type]
                live.on_notification(_user_item("p", "prompt")[0])
                tg.start_soon(steer)
                await anyio.sleep(0.2)  # the request timed out meanwhile
                assert not receipts
                for note in await landed():
                    live.on_notification(note)
    assert receipts == [SteerReceipt(status=SteerStatus.STEERED, turn_id="u")]
    assert [m.text for m in live.steered] == [text]


async def test_no_active_turn_to_steer_is_queued_as_turn_ended(tmp_path: Path) -> None:
    # Codex's "no active turn to steer", as the turn handle raises it (typed at the boundary).
    from codex_turn.harness.appserver import NoActiveTurn

    ctx = _Ctx(tmp_path)
    live = LiveTurn(quiet_interval=0)
    refused = NoActiveTurn(-32600, "no active turn to steer", method="turn/steer")
    with capture_logs() as logs:
        receipt = await _steer_during(live, ctx, _SteerHandle(refused), [], "too late")
    assert receipt == SteerReceipt(status=SteerStatus.QUEUED, reason="turn_ended")
    assert [r["log_level"] for r in logs if "steer" in r["event"]] == ["info"]


@pytest.mark.parametrize(
    ("refusal", "reason", "level"),
    [
        # The turn handle knew without asking: the turn is not running any more.
        (
            TurnNotRunning("cannot steer a turn that is completed", phase="completed"),
            "turn_ended",
            "info",
        ),
        # Codex refused otherwise: its wording is never read here, only the error's type.
        (
            AppServerRpcError(-32600, "no active turn, yet untyped", method="turn/steer"),
            "refused",
            "warning",
        ),
    ],
)
async def test_a_refused_steer_is_queued_by_the_type_of_its_refusal(
    tmp_path: Path, refusal: Exception, reason: str, level: str
) -> None:
    ctx = _Ctx(tmp_path)
    live = LiveTurn(quiet_interval=0)
    with capture_logs() as logs:
        receipt = await _steer_during(live, ctx, _SteerHandle(refusal), [], "too late")
    assert receipt == SteerReceipt(status=SteerStatus.QUEUED, reason=reason)
    assert [r["log_level"] for r in logs if "steer" in r["event"]] == [level]
    assert live.steered == live.unanswered == []


async def test_a_message_after_steering_ended_is_queued_at_once(tmp_path: Path) -> None:
    ctx, handle = _Ctx(tmp_path), _SteerHandle("u")
    live = LiveTurn(quiet_interval=0)
    with live.serving(ctx.session_file):
        async with live.delivering(ctx, handle):  # type: ignore[arg-type]
            pass
        # The Codex turn is over; the turn is still mirrored and finalized.
        with anyio.fail_after(1):
            receipt = await steer_codex_turn(ctx.session_file, "after the reply")
    assert receipt == SteerReceipt(status=SteerStatus.QUEUED, reason="turn_ended")
    assert handle.sent == []


def test_every_state_of_the_steering_table_has_its_effect() -> None:
    from codex_turn.harness.turn import steering

    assert set(steering._ON_ENTERING) == set(SteerState)


async def test_steady_arrivals_are_still_delivered(tmp_path: Path) -> None:
    # A message every 0.03 s with a 0.05 s quiet interval: the batch closes after 4 intervals.
    ctx, handle = _Ctx(tmp_path), _SteerHandle("u")
    live = LiveTurn(quiet_interval=0.05)
    with live.serving(ctx.session_file):
        async with (
            live.delivering(ctx, handle),  # type: ignore[arg-type]
            anyio.create_task_group() as tg,
        ):
            for index in range(20):
                tg.start_soon(steer_codex_turn, ctx.session_file, f"m{index}")
                await anyio.sleep(0.03)
                if handle.sent:
                    break
            assert handle.sent, "a steady stream of messages was never delivered"
            tg.cancel_scope.cancel()
    assert 4 <= len(handle.sent[0]) <= 9


@pytest.mark.codex
async def test_a_steer_whose_request_times_out_but_codex_applies_is_steered(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    private_texts: set[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Codex stalls (SIGSTOP) while the steer is sent: the request times out here, then Codex
    # resumes, takes the steer and the model answers it. Once "queued (refused)": now steered.
    import os
    import signal

    from codex_turn.harness.appserver.process import AppServerProcess
    from codex_turn.harness.turn import steering

    monkeypatch.setattr(steering, "INTERRUPT_GRACE_S", 0.25)  # the steer times out in 0.5 s
    text = "Also cover the migration"
    private_texts.add(text)
    offline_model.script(Reply.fixed("slow", partial_text="sl", delay=20), Reply.echo())
    client = appserver.current
    assert client is not None
    process = client.transport
    assert isinstance(process, AppServerProcess)
    turn_params_ = params(steer_quiet_interval=0)
    events = TurnEventStream(max_buffered=math.inf)
    seen: list[TurnEvent] = []
    receipts: list[SteerReceipt] = []

    async def stall_and_steer() -> None:
        await wait_for(lambda: any(isinstance(e, AgentMessageDelta) for e in seen))
        os.kill(process.pid, signal.SIGSTOP)
        try:
            async with anyio.create_task_group() as inner:

                async def steer() -> None:
                    receipts.append(await steer_codex_turn(turn_params_.session_file, text))

                inner.start_soon(steer)
                await anyio.sleep(1.0)
                assert not receipts  # timed out, not yet known: not "queued"
                os.kill(process.pid, signal.SIGCONT)
        finally:
            os.kill(process.pid, signal.SIGCONT)

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, events, seen)
        tg.start_soon(stall_and_steer)
        result = await run_codex_turn(turn_params_, app_server=appserver, events=events)
    assert result.assistant_text == f"ECHO: {text}"
    assert receipts == [SteerReceipt(status=SteerStatus.STEERED, turn_id=result.turn_id)]
    assert result.steered == (text,)
    assert "steered" in triggers(result)
    assert transcript_texts(turn_params_.session_file) == [
        turn_params_.prompt,
        text,
        f"ECHO: {text}",
    ]


@pytest.mark.codex
async def test_a_consumer_that_never_reads_still_gets_every_state_change_and_the_reply(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    # Before its fix: a full buffer dropped the newest events, so the terminal ones were lost.
    offline_model.script(Reply.fixed("x" * 40, partial_text="xxxx"))
    events = TurnEventStream(max_buffered=2)
    result = await run_codex_turn(params(), app_server=appserver, events=events)
    late = [e async for e in events]
    assert [e.trigger for e in late if isinstance(e, StateChanged)] == triggers(result)
    last = late[-1]
    assert isinstance(last, StateChanged)
    assert last.dest == result.trace[-1].dest
    (reply,) = [e for e in late if isinstance(e, AgentMessageCompleted)]
    assert reply.text == "x" * 40
    assert not any(isinstance(e, AgentMessageDelta) for e in late)  # the deltas were dropped
    assert events.dropped == events.published - len(late) >= 1


async def test_deltas_are_dropped_before_anything_else() -> None:
    stream = TurnEventStream(max_buffered=2)
    live = LiveTurn(events=stream)
    for index in range(5):
        live.on_notification(_note("item/agentMessage/delta", itemId="m", delta=str(index)))
    item = {"type": "agentMessage", "id": "m", "text": "01234"}
    live.on_notification(_note("item/completed", item=item))
    stream.close()
    got = [e async for e in stream]
    assert [type(e).__name__ for e in got] == [
        "AgentMessageDelta",
        "AgentMessageDelta",
        "AgentMessageCompleted",
    ]
    assert (stream.published, stream.dropped) == (6, 3)
