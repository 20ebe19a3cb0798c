"""End-to-end: our client driving the REAL ``codex app-server`` 0.163.0 against the offline
model. Every assertion is about what the binary did or what it sent to the model."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from codex_fixtures import CodexSchema

from codex_turn.harness.appserver import (
    AppServer,
    AppServerClosed,
    AppServerConfig,
    AppServerProcess,
    CodexTurnStatus,
    DynamicTool,
    Notification,
    ThreadSettings,
)
from codex_turn.testing import OfflineModel, RecordedRequest, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

ConfigFactory = Callable[..., AppServerConfig]

DEV = (
    "DEV_INSTR_MARKER_7f3a: answer tersely.\n"
    '  Keep <tags>, & "quotes" and trailing spaces   intact.\n'
    "Second paragraph: ünïcödé ✓"
)
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
# A valid 1x1 PNG, as OpenClaw passes images: a data URL.
PNG_1X1 = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de"
        "0000000c49444154789c63f8cfc0000003010100c9fe92ef0000000049454e44ae426082"
    )
).decode()


def dev_count(request: RecordedRequest, text: str = DEV) -> int:
    return request.developer_parts.count(text)


async def wait_for_model_request(model: OfflineModel, count: int) -> None:
    """Poll: the model records from its own HTTP threads, there is no anyio event to await."""
    with anyio.fail_after(10):
        while len(model.requests) < count:  # noqa: ASYNC110
            await anyio.sleep(0.01)


# --- protocol conformance ---------------------------------------------------------------


async def test_every_sent_message_conforms_to_the_binary_schema(
    make_appserver_config: ConfigFactory,
    offline_model: OfflineModel,
    codex_schema: CodexSchema,
    workspace: Path,
) -> None:
    async def weather(args: dict[str, Any]) -> str:
        return f"Sunny in {args['city']}"

    tools = [DynamicTool("lookup_weather", "Look up the weather.", WEATHER_SCHEMA, weather)]
    async with AppServer.start(make_appserver_config(), record_sent=True) as server:
        thread = await server.start_thread(
            ThreadSettings(
                cwd=str(workspace), developer_instructions=DEV, tools=tools, model="mock-model"
            )
        )
        tid = thread.thread_id
        result = await server.run_turn(tid, "look", images=[f"data:image/png;base64,{PNG_1X1}"])
        assert result.outcome is CodexTurnStatus.COMPLETED
        offline_model.script(Reply.function_call("lookup_weather", {"city": "Oslo"}))
        assert (await server.run_turn(tid, "weather")).final_text == "TOOL RESULT: Sunny in Oslo"
        offline_model.script(Reply.fixed("late", delay=10))
        async with server.turn(tid, "slow") as handle:
            await wait_for_model_request(offline_model, 4)
            await handle.interrupt()
            assert (await handle.collect()).outcome is CodexTurnStatus.INTERRUPTED
        await server.resume_thread(
            tid, ThreadSettings(developer_instructions=DEV, cwd=str(workspace))
        )
        assert (await server.compact_thread(tid)).completed

    counts = codex_schema.validate_sent(server.sent, server.server_requests)
    assert set(counts) >= {
        "initialize",
        "notify:initialized",
        "thread/start",
        "turn/start",
        "respond:item/tool/call",
        "turn/interrupt",
        "thread/resume",
        "thread/compact/start",
    }
    start = next(m for m in server.sent if m.get("method") == "thread/start")
    assert start["params"]["personality"] == "none"
    assert start["params"]["dynamicTools"][0]["inputSchema"] == WEATHER_SCHEMA
    resume = next(m for m in server.sent if m.get("method") == "thread/resume")
    assert resume["params"]["excludeTurns"] is True
    assert resume["params"]["developerInstructions"] == DEV
    # The image reached the model.
    first = offline_model.turn_requests()[0]
    parts = [p for i in first.input_items if i.get("role") == "user" for p in i["content"]]
    assert any(p.get("type") == "input_image" for p in parts)
    assert offline_model.proxy_attempts == []


# --- developer instructions, resume, compaction ----------------------------------------


async def test_developer_instructions_reach_the_model_verbatim(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    thread = await appserver.start_thread(
        ThreadSettings(cwd=str(workspace), developer_instructions=DEV)
    )
    result = await appserver.run_turn(thread.thread_id, "hello there")
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert result.final_text == "ECHO: hello there"
    (request,) = offline_model.requests
    assert dev_count(request) == 1
    assert request.last_user_text == "hello there"
    assert result.usage is not None
    assert result.usage.input == 100
    assert result.usage.output == 10
    assert result.messages_snapshot[0]["content"] == "hello there"
    assert result.messages_snapshot[-1]["provider"] == "offline"
    # Nothing tried to reach the internet (the proxy variables point at the 403 trap).
    assert offline_model.proxy_attempts == []


async def _first_process(
    config: AppServerConfig, workspace: Path, *, text: str = "first turn"
) -> str:
    async with AppServer.start(config) as server:
        thread = await server.start_thread(
            ThreadSettings(cwd=str(workspace), developer_instructions=DEV)
        )
        result = await server.run_turn(thread.thread_id, text)
        assert result.outcome is CodexTurnStatus.COMPLETED
        return thread.thread_id


async def test_resume_in_a_fresh_process_continues_the_thread(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    first = make_appserver_config()
    tid = await _first_process(first, workspace)
    # Same (already initialised) CODEX_HOME, new process.
    async with AppServer.start(make_appserver_config(codex_home=first.codex_home)) as server:
        resumed = await server.resume_thread(
            tid, ThreadSettings(developer_instructions=DEV, cwd=str(workspace))
        )
        assert resumed.thread_id == tid
        assert resumed.thread.turns in (None, [])  # excludeTurns
        result = await server.run_turn(tid, "second turn")
    assert result.final_text == "ECHO: second turn"
    last = offline_model.requests[-1]
    assert "first turn" in last.user_messages
    assert "ECHO: first turn" in last.assistant_messages
    assert dev_count(last) == 1


async def _resume_compact_turn(
    make_config: ConfigFactory,
    model: OfflineModel,
    workspace: Path,
    instructions: str | None,
) -> RecordedRequest:
    first = make_config()
    tid = await _first_process(first, workspace)
    async with AppServer.start(make_config(codex_home=first.codex_home)) as server:
        await server.resume_thread(
            tid, ThreadSettings(developer_instructions=instructions, cwd=str(workspace))
        )
        compaction = await server.compact_thread(tid, timeout=30)
        assert compaction.completed
        result = await server.run_turn(tid, "after compaction")
        assert result.outcome is CodexTurnStatus.COMPLETED
    assert len(model.compaction_requests()) == 1
    last = model.requests[-1]
    assert not last.is_compaction
    assert any("LOCAL_COMPACTED_SUMMARY_1" in u for u in last.user_messages)
    assert "first turn" in last.user_messages  # user messages survive compaction
    return last


async def test_instructions_resent_on_resume_survive_a_manual_compaction(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    last = await _resume_compact_turn(make_appserver_config, offline_model, workspace, DEV)
    assert dev_count(last) == 1


async def test_control_without_resent_instructions_compaction_loses_them(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    """The Codex gotcha the previous test guards against (so that test can fail)."""
    last = await _resume_compact_turn(make_appserver_config, offline_model, workspace, None)
    assert dev_count(last) == 0


@pytest.mark.codex
async def test_resume_re_sends_a_different_runtime_policy_and_codex_applies_it(
    make_appserver_config: ConfigFactory,
    offline_model: OfflineModel,
    codex_schema: CodexSchema,
    workspace: Path,
) -> None:
    first = make_appserver_config()
    async with AppServer.start(first, record_sent=True) as server:
        thread = await server.start_thread(
            ThreadSettings(
                cwd=str(workspace),
                developer_instructions=DEV,
                approval_policy="never",
                sandbox="read-only",
                approvals_reviewer="user",
            )
        )
        tid = thread.thread_id
        assert (thread.approval_policy, thread.sandbox_mode, thread.approvals_reviewer) == (
            "never",
            "read-only",
            "user",
        )
        assert thread.sandbox == {"type": "readOnly", "networkAccess": False}
        assert thread.service_tier is None
        assert (await server.run_turn(tid, "first turn")).outcome is CodexTurnStatus.COMPLETED
    started = codex_schema.validate_sent(server.sent, server.server_requests)
    start = next(m for m in server.sent if m.get("method") == "thread/start")
    assert start["params"]["approvalPolicy"] == "never"
    assert start["params"]["sandbox"] == "read-only"
    assert start["params"]["approvalsReviewer"] == "user"
    assert "serviceTier" not in start["params"]  # None is not sent

    # A new process loads the thread with a different policy: Codex applies what is re-sent.
    second = make_appserver_config(codex_home=first.codex_home)
    async with AppServer.start(second, record_sent=True) as server:
        resumed = await server.resume_thread(
            tid,
            ThreadSettings(
                developer_instructions=DEV,
                cwd=str(workspace),
                approval_policy="on-request",
                sandbox="workspace-write",
                approvals_reviewer="auto_review",
                service_tier="flex",
            ),
        )
        # Resuming the thread that is now loaded reports the effective policy (raw response,
        # validated against the binary's own response schema).
        raw = await server.request("thread/resume", {"threadId": tid, "excludeTurns": True})
        result = await server.run_turn(tid, "second turn")
    counts = codex_schema.validate_sent(server.sent, server.server_requests)
    assert counts["thread/resume"] == 2
    resume = next(m for m in server.sent if m.get("method") == "thread/resume")
    assert {k: resume["params"][k] for k in ("approvalPolicy", "sandbox")} == {
        "approvalPolicy": "on-request",
        "sandbox": "workspace-write",
    }
    assert resume["params"]["approvalsReviewer"] == "auto_review"
    assert resume["params"]["serviceTier"] == "flex"
    assert resumed.thread_id == tid
    assert (resumed.approval_policy, resumed.sandbox_mode) == ("on-request", "workspace-write")
    assert resumed.sandbox["type"] == "workspaceWrite"
    assert (resumed.approvals_reviewer, resumed.service_tier) == ("auto_review", "flex")
    codex_schema.validator("ThreadResumeResponse").validate(raw)
    assert (raw["approvalPolicy"], raw["sandbox"]["type"]) == ("on-request", "workspaceWrite")
    assert (raw["approvalsReviewer"], raw["serviceTier"]) == ("auto_review", "flex")
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert result.final_text == "ECHO: second turn"
    assert started["thread/start"] == 1
    assert offline_model.proxy_attempts == []


# --- dynamic tools ----------------------------------------------------------------------


async def test_dynamic_tool_round_trip(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    calls: list[dict[str, Any]] = []

    async def weather(args: dict[str, Any]) -> str:
        calls.append(args)
        return f"Sunny, 21C in {args['city']}"

    thread = await appserver.start_thread(
        ThreadSettings(
            cwd=str(workspace),
            developer_instructions=DEV,
            tools=[DynamicTool("lookup_weather", "Look up the weather.", WEATHER_SCHEMA, weather)],
        )
    )
    offline_model.script(Reply.function_call("lookup_weather", {"city": "Paris"}, call_id="c_A1"))
    result = await appserver.run_turn(thread.thread_id, "weather in Paris?")
    assert calls == [{"city": "Paris"}]
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert result.final_text == "TOOL RESULT: Sunny, 21C in Paris"
    first, second = offline_model.requests
    assert "lookup_weather" in first.tool_names
    spec = next(t for t in first.tools if t.get("name") == "lookup_weather")
    assert spec["parameters"] == WEATHER_SCHEMA
    (output,) = second.function_call_outputs
    assert output["call_id"] == "c_A1"
    assert output["output"] == "Sunny, 21C in Paris"
    assert "c_A1" in result.item_ids


async def test_raising_tool_yields_an_error_result_and_the_turn_completes(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    async def broken(args: dict[str, Any]) -> str:
        raise RuntimeError("database unavailable")

    thread = await appserver.start_thread(
        ThreadSettings(
            cwd=str(workspace),
            tools=[DynamicTool("broken_tool", "Always fails.", {"type": "object"}, broken)],
        )
    )
    offline_model.script(Reply.function_call("broken_tool", {}, call_id="c_B1"))
    seen: list[Notification] = []

    async def on_event(n: Notification) -> None:
        seen.append(n)

    result = await appserver.run_turn(thread.thread_id, "use the tool", on_event=on_event)
    assert result.outcome is CodexTurnStatus.COMPLETED
    (output,) = offline_model.requests[-1].function_call_outputs
    assert "broken_tool failed" in output["output"]
    assert "database unavailable" in output["output"]
    tool_item = next(
        n.item for n in seen if n.method == "item/completed" and n.item_type == "dynamicToolCall"
    )
    assert tool_item is not None
    assert tool_item["success"] is False
    assert tool_item["status"] == "failed"
    assert result.final_text is not None
    assert result.final_text.startswith("TOOL RESULT: ")


# --- failure modes ----------------------------------------------------------------------


async def test_model_http_400_fails_the_turn_with_its_message(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    thread = await appserver.start_thread(ThreadSettings(cwd=str(workspace)))
    offline_model.script(Reply.http_error(400, '{"error":{"message":"prompt too spicy 4711"}}'))
    result = await appserver.run_turn(thread.thread_id, "hi")
    assert result.outcome is CodexTurnStatus.FAILED
    assert result.prompt_error is not None
    assert "prompt too spicy 4711" in result.prompt_error
    assert len(offline_model.requests) == 1  # retries are off
    # The thread is still usable.
    again = await appserver.run_turn(thread.thread_id, "again")
    assert again.outcome is CodexTurnStatus.COMPLETED
    assert again.final_text == "ECHO: again"


async def test_slow_model_and_interrupt_gives_interrupted(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    thread = await appserver.start_thread(ThreadSettings(cwd=str(workspace)))
    offline_model.script(Reply.fixed("too late", delay=10, partial_text="PARTIAL "))
    started = time.monotonic()
    async with appserver.turn(thread.thread_id, "be slow") as handle:
        async for n in handle:
            if n.method == "item/agentMessage/delta":
                await handle.interrupt()
                await handle.interrupt()  # a second call is a no-op, never a hang
        result = handle.result
    assert result is not None
    assert time.monotonic() - started < 5
    assert result.outcome is CodexTurnStatus.INTERRUPTED
    assert result.aborted
    assert result.partial_text == "PARTIAL "
    assert result.final_text is None
    with anyio.fail_after(5):
        while offline_model.disconnects == 0:  # Codex closed the model stream  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_cancellation_and_idle_timeout_interrupt_the_turn(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    thread = await appserver.start_thread(ThreadSettings(cwd=str(workspace)))
    tid = thread.thread_id
    offline_model.script(Reply.fixed("never", delay=10))
    with anyio.move_on_after(1.0) as scope:
        await appserver.run_turn(tid, "cancel me")
    assert scope.cancelled_caught
    offline_model.script(Reply.fixed("never", delay=10))
    started = time.monotonic()
    timed_out = await appserver.run_turn(tid, "idle me", idle_timeout=0.5)
    assert time.monotonic() - started < 5
    assert timed_out.outcome is CodexTurnStatus.TIMED_OUT
    assert timed_out.prompt_error is not None
    assert "idle" in timed_out.prompt_error
    after = await appserver.run_turn(tid, "next")
    assert after.final_text == "ECHO: next"
    # Both abandoned turns were interrupted in Codex (it tells the model so).
    aborted = [u for u in offline_model.requests[-1].user_messages if "<turn_aborted>" in u]
    assert len(aborted) == 2


class CancelAfterTurnStart:
    """The real process as transport, cancelling ``scope`` the moment a ``turn/start`` line
    has been written: the request is out, its response cannot have been dispatched yet."""

    def __init__(self, process: AppServerProcess) -> None:
        self.process = process
        self.scope: anyio.CancelScope | None = None

    async def send_line(self, line: bytes) -> None:
        await self.process.send_line(line)
        if self.scope is not None and json.loads(line).get("method") == "turn/start":
            self.scope.cancel()
            self.scope = None

    async def receive_line(self) -> bytes:
        return await self.process.receive_line()

    async def run_background(self) -> None:
        await self.process.run_background()

    async def aclose(self) -> None:
        await self.process.aclose()

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


async def test_cancelled_turn_start_interrupts_the_turn_codex_started(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    transports: list[CancelAfterTurnStart] = []

    async def spawn(config: AppServerConfig) -> CancelAfterTurnStart:
        transports.append(CancelAfterTurnStart(await AppServerProcess.spawn(config)))
        return transports[-1]

    ended: dict[str, str] = {}  # turn id -> final status, from every turn/completed

    def on_completed(n: Notification) -> None:
        if n.method == "turn/completed" and n.turn_id is not None:
            ended[n.turn_id] = str((n.params.get("turn") or {}).get("status"))

    config = make_appserver_config()
    async with AppServer.start(config, record_sent=True, transport_factory=spawn) as server:
        server.add_listener(on_completed)
        tid = (await server.start_thread(ThreadSettings(cwd=str(workspace)))).thread_id
        # Left alone, the orphan would run for 10 s (only its own prompt gets the slow reply).
        offline_model.script(Reply.fixed("never", delay=10), user_contains="orphan me")
        with anyio.CancelScope() as scope:
            transports[-1].scope = scope
            await server.run_turn(tid, "orphan me")
        assert scope.cancelled_caught  # the cancellation propagated...
        interrupts = [m for m in server.sent if m.get("method") == "turn/interrupt"]
        assert len(interrupts) == 1  # ...after the started turn was interrupted, once
        orphan = interrupts[0]["params"]["turnId"]
        assert ended == {orphan: "interrupted"}  # Codex accepted it: the orphan is over
        after = await server.run_turn(tid, "next")
    # A turn of its own (not steered into a still running orphan), answered at once.
    assert after.turn_id not in (None, orphan)
    assert after.outcome is CodexTurnStatus.COMPLETED
    assert after.final_text == "ECHO: next"
    assert interrupts[0]["params"]["threadId"] == tid
    assert server.restarts == 0


async def test_leaving_a_turn_before_codex_activated_it_still_interrupts_it(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    """Codex answers turn/start ~20 ms before the turn is active and refuses an interrupt in
    that window (the turn then runs on): the interrupt must wait for turn/started."""
    ended: dict[str, str] = {}

    def on_completed(n: Notification) -> None:
        if n.method == "turn/completed" and n.turn_id is not None:
            ended[n.turn_id] = str((n.params.get("turn") or {}).get("status"))

    appserver.add_listener(on_completed)
    tid = (await appserver.start_thread(ThreadSettings(cwd=str(workspace)))).thread_id
    offline_model.script(Reply.fixed("never", delay=10), user_contains="leave at once")
    with anyio.CancelScope() as scope:
        async with appserver.turn(tid, "leave at once") as handle:
            scope.cancel()  # right after the turn/start response
            await anyio.sleep_forever()
    assert ended == {handle.turn_id: "interrupted"}
    assert len([m for m in appserver.sent if m.get("method") == "turn/interrupt"]) == 1
    assert (await appserver.run_turn(tid, "next")).final_text == "ECHO: next"


async def test_sigkill_mid_turn_raises_closed_quickly_and_the_next_turn_restarts(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    thread = await appserver.start_thread(
        ThreadSettings(cwd=str(workspace), developer_instructions=DEV)
    )
    tid = thread.thread_id
    offline_model.script(Reply.fixed("never", delay=30))
    client = appserver.current
    assert client is not None
    process = client.transport
    assert isinstance(process, AppServerProcess)
    failure: list[BaseException] = []
    killed_at = 0.0
    failed_at = 0.0

    async def turn() -> None:
        nonlocal failed_at
        try:
            await appserver.run_turn(tid, "before crash")
        except AppServerClosed as exc:
            failed_at = time.monotonic()
            failure.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(turn)
        await wait_for_model_request(offline_model, 1)
        killed_at = time.monotonic()
        process.kill()
    assert failure, "the turn did not fail with AppServerClosed"
    assert failed_at - killed_at < 1.0
    assert client.closed
    result = await appserver.run_turn(tid, "after crash")
    assert appserver.restarts == 1
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert result.final_text == "ECHO: after crash"
    assert dev_count(offline_model.requests[-1]) == 1  # auto-resume re-sent the instructions


# --- many threads over one process ------------------------------------------------------


async def test_sixteen_concurrent_turns_on_distinct_threads(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    n = 16
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        thread = await appserver.start_thread(
            ThreadSettings(cwd=str(workspace), developer_instructions=f"{DEV} #{i}")
        )
        results[i] = (thread.thread_id, await appserver.run_turn(thread.thread_id, f"[t{i}] hi"))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    assert len({tid for tid, _ in results.values()}) == n
    for i, (tid, result) in results.items():
        assert result.thread_id == tid
        assert result.outcome is CodexTurnStatus.COMPLETED
        assert result.final_text == f"ECHO: [t{i}] hi"
    assert appserver.restarts == 0
    assert len(offline_model.requests) == n
