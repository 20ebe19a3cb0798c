"""The dynamic-tool catalog: flat (each tool on its own, as before) or namespaced (the host's
tools searchable in ``openclaw``, direct-only ones in ``openclaw_direct``): the specs declared,
the fingerprint that rotates a thread whose catalog changed. The model request the real binary
builds from them is pinned in ``test_runtime_turn_e2e.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.fake_appserver import FakeAppServer
from support.turns import turn_params as params

from codex_turn import DynamicTool, TurnOutcome, run_codex_turn
from codex_turn.harness.appserver import ThreadSettings, ToolRegistry
from codex_turn.harness.appserver.tools import DIRECT_NAMESPACE, SEARCHABLE_NAMESPACE
from codex_turn.harness.appserver.types import unstructure
from codex_turn.harness.turn.context import YieldSwitch, yield_tool
from codex_turn.harness.turn_api import InvalidTurnParams

SCHEMA = {"type": "object", "properties": {}}


async def _noop(arguments: dict[str, Any]) -> str:
    return "ok"


SEARCHABLE = DynamicTool("memory_search", "Search memory.", SCHEMA, _noop)
DIRECT = DynamicTool("message", "Send a message.", SCHEMA, _noop, direct=True)


def test_the_flat_catalog_declares_each_tool_as_before() -> None:
    specs = unstructure(ToolRegistry([SEARCHABLE, DIRECT]).specs())
    assert specs == [
        {
            "name": "memory_search",
            "description": "Search memory.",
            "inputSchema": SCHEMA,
            "type": "function",
        },
        {
            "name": "message",
            "description": "Send a message.",
            "inputSchema": SCHEMA,
            "type": "function",
        },
    ]


def test_the_namespaced_catalog_defers_host_tools_and_keeps_direct_ones_visible() -> None:
    specs = unstructure(ToolRegistry([SEARCHABLE, DIRECT], catalog="namespaced").specs())
    assert [(s["type"], s["name"]) for s in specs] == [
        ("namespace", SEARCHABLE_NAMESPACE),
        ("namespace", DIRECT_NAMESPACE),
    ]
    searchable, direct = specs
    assert searchable["tools"] == [
        {
            "name": "memory_search",
            "description": "Search memory.",
            "inputSchema": SCHEMA,
            "type": "function",
            "deferLoading": True,
        }
    ]
    assert [t["name"] for t in direct["tools"]] == ["message"]
    assert "deferLoading" not in direct["tools"][0]
    # An empty namespace is not declared.
    only_direct = ToolRegistry([DIRECT], catalog="namespaced").specs()
    assert [s.name for s in only_direct] == [DIRECT_NAMESPACE]
    # The sessions_yield control is always visible.
    assert yield_tool(YieldSwitch()).namespace("namespaced") == DIRECT_NAMESPACE
    with pytest.raises(ValueError, match="tool catalog"):
        ToolRegistry([], catalog="nested")  # type: ignore[arg-type]


def test_a_catalog_change_is_a_tool_change() -> None:
    flat = ThreadSettings(tools=ToolRegistry([SEARCHABLE]))
    namespaced = ThreadSettings(tools=ToolRegistry([SEARCHABLE], catalog="namespaced"))
    assert flat.key != namespaced.key
    assert SEARCHABLE.catalog_entry("flat") == unstructure(SEARCHABLE.spec())
    assert SEARCHABLE.catalog_entry("namespaced")["namespace"] == SEARCHABLE_NAMESPACE
    with pytest.raises(InvalidTurnParams, match="tool_catalog"):
        params("/tmp/s.jsonl", "hi", tool_catalog="deferred")


@pytest.mark.anyio
async def test_a_thread_bound_under_the_flat_catalog_rotates_for_the_namespaced_one(
    session_file: str,
) -> None:
    server = FakeAppServer()
    first = await run_codex_turn(params(session_file, "one"), app_server=server, tools=[SEARCHABLE])
    again = await run_codex_turn(params(session_file, "two"), app_server=server, tools=[SEARCHABLE])
    assert again.thread_id == first.thread_id
    moved = await run_codex_turn(
        params(session_file, "three", tool_catalog="namespaced"),
        app_server=server,
        tools=[SEARCHABLE],
    )
    assert moved.outcome is TurnOutcome.COMPLETED
    assert moved.thread_decision is not None
    assert moved.thread_decision.reason == "dynamic-tools-changed"
    assert moved.thread_id != first.thread_id
