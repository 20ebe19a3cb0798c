"""Observations (``after_tool_call``, ``llm_input``, ``llm_output``): what they carry, and
that an observer that raises or hangs neither blocks nor changes the turn (bounded, logged by
type only). In process on the fake app-server; the real binary's tool items are pinned in
``test_runtime_turn_e2e.py``.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support.fake_appserver import CodexScript, FakeAppServer
from support.turns import turn_params as params

from codex_turn import DynamicTool, TurnHooks, TurnOutcome, run_codex_turn
from codex_turn.harness.observations import (
    MAX_PENDING,
    LlmInputObserved,
    LlmOutputObserved,
    Observations,
    ToolCallObserved,
    tool_call_observed,
)

pytestmark = pytest.mark.anyio

SECRET = "SECRET_OBSERVED_2231"


async def lookup(arguments: dict[str, Any]) -> str:
    return "found"


LOOKUP = DynamicTool("lookup", "Look up.", {"type": "object", "properties": {}}, lookup)


def test_tool_items_become_observations_and_other_items_do_not() -> None:
    command = {"type": "commandExecution", "id": "c1", "status": "completed", "durationMs": 12}
    observed = tool_call_observed(command, thread_id="t", turn_id="u")
    assert observed is not None
    assert (observed.name, observed.native, observed.status, observed.duration_ms) == (
        "command",
        True,
        "completed",
        12,
    )
    mcp = tool_call_observed(
        {"type": "mcpToolCall", "server": "docs", "tool": "search"}, thread_id=None, turn_id=None
    )
    assert mcp is not None
    assert (mcp.name, mcp.native) == ("docs.search", True)
    dynamic = tool_call_observed(
        {"type": "dynamicToolCall", "namespace": "openclaw", "tool": "memory_get"},
        thread_id=None,
        turn_id=None,
    )
    assert dynamic is not None
    assert (dynamic.name, dynamic.native) == ("openclaw.memory_get", False)
    for other in ({"type": "agentMessage"}, {"type": "userMessage"}, {}):
        assert tool_call_observed(other, thread_id=None, turn_id=None) is None


async def test_observers_see_the_turn_and_cannot_change_it(session_file: str) -> None:
    server = FakeAppServer()
    tools: list[ToolCallObserved] = []
    inputs: list[LlmInputObserved] = []
    outputs: list[LlmOutputObserved] = []

    async def on_tool(observed: ToolCallObserved) -> None:
        tools.append(observed)

    server.scripts.append(CodexScript(reply="the answer", tool_calls=[("lookup", {})]))
    hooks = TurnHooks(after_tool_call=on_tool, llm_input=inputs.append, llm_output=outputs.append)
    result = await run_codex_turn(
        params(session_file, "what is it?"), app_server=server, tools=[LOOKUP], hooks=hooks
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert [(t.name, t.native, t.kind) for t in tools] == [("lookup", False, "dynamicToolCall")]
    assert tools[0].turn_id == result.turn_id
    (sent,) = inputs
    assert (sent.prompt, sent.thread_id, sent.tools, sent.history_messages) == (
        "what is it?",
        result.thread_id,
        ("lookup",),
        0,
    )
    (came,) = outputs
    assert (came.status, came.assistant_text, came.turn_id) == (
        "completed",
        "the answer",
        result.turn_id,
    )
    assert came.usage == result.usage


async def test_an_observer_that_raises_or_hangs_is_bounded_and_logged_without_content(
    session_file: str,
) -> None:
    server = FakeAppServer()
    server.scripts.append(CodexScript(reply="fine", tool_calls=[("lookup", {})]))

    async def raises(observed: Any) -> None:
        raise RuntimeError(SECRET)

    async def hangs(observed: Any) -> None:
        await anyio.sleep_forever()

    hooks = TurnHooks(after_tool_call=hangs, llm_input=raises, llm_output=hangs)
    with capture_logs() as logs:
        with anyio.fail_after(10):
            result = await run_codex_turn(
                params(session_file, "go", observer_timeout=0.05),
                app_server=server,
                tools=[LOOKUP],
                hooks=hooks,
            )
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "fine"
    failed = [e for e in logs if e["event"] == "observer failed"]
    assert [(e["observer"], e["error_type"]) for e in failed] == [("llm_input", "RuntimeError")]
    timed_out = sorted(e["observer"] for e in logs if e["event"] == "observer timed out")
    assert timed_out == ["after_tool_call", "llm_output"]
    assert SECRET not in repr(logs)


async def test_observations_beyond_the_bound_are_dropped_not_queued() -> None:
    calls: list[int] = []
    gate = anyio.Event()

    async def slow(n: int) -> None:
        calls.append(n)
        await gate.wait()

    observations = Observations(timeout=5)
    with capture_logs() as logs:
        async with observations.running():
            for n in range(MAX_PENDING + 3):
                observations.emit("llm_input", slow, n)  # returns at once
            await anyio.wait_all_tasks_blocked()
            gate.set()
    assert len(calls) == MAX_PENDING
    assert observations.dropped == 3
    assert [e["dropped"] for e in logs if e["event"] == "observations dropped"] == [3]
    observations.emit("llm_input", slow, 0)  # outside running(): nothing scheduled
    assert len(calls) == MAX_PENDING
