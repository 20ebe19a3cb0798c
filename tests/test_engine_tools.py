"""Engine-offered tools through a whole in-process turn (the fake app-server runs each call
through the thread's real ToolRegistry): registered beside the host's and counted in the tools
fingerprint, answered by the engine with the turn's session identity (never the model's),
redacted and bounded; a clash with a host tool is a typed refusal before anything is sent; a
failing ``tools()`` leaves the host's tools alone; the contract check pairs the two methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.fake_appserver import CodexScript, FakeAppServer
from support.turns import turn_params

from codex_turn import TurnOutcome, run_codex_turn
from codex_turn.harness.appserver import DynamicTool
from codex_turn.harness.appserver.types import unstructure
from codex_turn.harness.binding import read_binding
from codex_turn.harness.engine import (
    AssembleParams,
    AssembleResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    EngineContractError,
    EngineContractViolation,
    EngineTool,
    EngineToolConflict,
    IngestParams,
    IngestResult,
    ToolCallParams,
    ToolCallResult,
    ToolsParams,
    ToolsResult,
    check_engine,
)
from codex_turn.harness.turn.engine_tools import MAX_OUTPUT_CHARS
from codex_turn.projection import dynamic_tools_fingerprint

pytestmark = pytest.mark.anyio

SCHEMA = {
    "type": "object",
    "properties": {"q": {"type": "string"}, "session_key": {"type": "string"}},
    "required": ["q"],
}


class ToolEngine:
    """An engine offering one tool, ``lookup``, that answers with what it was asked."""

    info = ContextEngineInfo(id="tooly", name="Tooly")

    def __init__(self, *, name: str = "lookup", answer: str | None = None) -> None:
        self.name = name
        self.answer = answer
        self.calls: list[ToolCallParams] = []
        self.offers: list[ToolsParams] = []

    async def ingest(self, params: IngestParams) -> IngestResult:
        return IngestResult(ingested=False)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        return AssembleResult(messages=list(params.messages), estimated_tokens=0)

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(ok=True, compacted=False)

    async def tools(self, params: ToolsParams) -> ToolsResult:
        self.offers.append(params)
        return ToolsResult(tools=[EngineTool(self.name, "Look it up.", SCHEMA)])

    async def call_tool(self, params: ToolCallParams) -> ToolCallResult:
        self.calls.append(params)
        if self.answer is not None:
            return ToolCallResult(text=self.answer)
        return ToolCallResult(text=f"{params.session_key}/{params.arguments['q']}")


def fingerprint(tools: list[DynamicTool]) -> str:
    return dynamic_tools_fingerprint(unstructure(t.spec()) for t in tools)


def host_tool(name: str) -> DynamicTool:
    async def run(_args: dict[str, Any]) -> str:
        return "host"

    return DynamicTool(name, "The host's.", {"type": "object", "properties": {}}, run)


async def test_engine_tools_run_beside_the_hosts_with_the_turns_session(tmp_path: Path) -> None:
    engine = ToolEngine()
    server = FakeAppServer(
        scripts=[
            CodexScript(
                tool_calls=[
                    ("lookup", {"q": "alpha", "session_key": "agent:main:someone-else"}),
                    ("host_tool", {}),
                ]
            )
        ]
    )
    params = turn_params(str(tmp_path / "s.jsonl"), "hello")
    result = await run_codex_turn(
        params, app_server=server, engine=engine, tools=[host_tool("host_tool")]
    )
    assert result.outcome is TurnOutcome.COMPLETED
    started = server.calls_to("start_thread")[0].args
    assert started["tools"] == ["host_tool", "lookup"]
    assert engine.offers == [ToolsParams(session_id="s-1", session_key="agent:main:s-1")]
    # The model's "session_key" argument is an argument, never the identity of the call.
    assert [(c.session_id, c.session_key, c.name) for c in engine.calls] == [
        ("s-1", "agent:main:s-1", "lookup")
    ]
    assert server.tool_outputs == ["agent:main:s-1/alpha", "host"]
    # The engine's tool counts in the fingerprint the binding records.
    binding = read_binding(params.session_file, session_id="s-1")
    assert binding is not None
    offered = DynamicTool("lookup", "Look it up.", SCHEMA, host_tool("x").fn)
    with_engine = [host_tool("host_tool"), offered]
    assert binding.dynamic_tools_fingerprint == fingerprint(with_engine)
    assert binding.dynamic_tools_fingerprint != fingerprint(with_engine[:1])


async def test_engine_tool_answers_are_redacted_and_bounded(tmp_path: Path) -> None:
    secret = "sk-" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6"
    engine = ToolEngine(answer=f"key {secret} " + "x" * (2 * MAX_OUTPUT_CHARS))
    server = FakeAppServer(scripts=[CodexScript(tool_calls=[("lookup", {"q": "k"})])])
    params = turn_params(str(tmp_path / "s.jsonl"), "hello")
    await run_codex_turn(params, app_server=server, engine=engine)
    (answer,) = server.tool_outputs
    assert secret not in answer
    assert len(answer) <= MAX_OUTPUT_CHARS
    assert answer.endswith(f"[output cut at {MAX_OUTPUT_CHARS} characters]")


async def test_a_name_clash_with_a_host_tool_is_refused_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    server = FakeAppServer()
    params = turn_params(str(tmp_path / "s.jsonl"), "hello")
    with pytest.raises(EngineToolConflict) as raised:
        await run_codex_turn(
            params, app_server=server, engine=ToolEngine(), tools=[host_tool("lookup")]
        )
    assert raised.value.names == ("lookup",)
    assert server.calls == []
    assert not Path(params.session_file).exists()  # noqa: ASYNC240


async def test_a_failing_offer_leaves_the_hosts_tools_and_is_a_violation(tmp_path: Path) -> None:
    engine = ToolEngine(name="exec_command")  # shadows a Codex built-in: an invalid offer
    server = FakeAppServer()
    params = turn_params(str(tmp_path / "s.jsonl"), "hello", strict=True)
    with pytest.raises(EngineContractViolation) as raised:
        await run_codex_turn(
            params, app_server=server, engine=engine, tools=[host_tool("host_tool")]
        )
    assert raised.value.method == "tools"
    assert raised.value.result.outcome is TurnOutcome.COMPLETED
    assert server.calls_to("start_thread")[0].args["tools"] == ["host_tool"]


def test_tools_and_call_tool_come_together() -> None:
    class Half(ToolEngine):
        call_tool = None  # type: ignore[assignment]

    with pytest.raises(EngineContractError, match="tools is present without call_tool"):
        check_engine(Half())
    assert check_engine(ToolEngine()).id == "tooly"
