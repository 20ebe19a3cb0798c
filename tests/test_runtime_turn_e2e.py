"""The runtime contract around a turn, against the REAL ``codex app-server`` 0.163.0: what the
model request holds for a lightweight run, turn-scoped collaboration-mode instructions and a
heartbeat turn, what the observers are told and what queue mode collect gathers (one session,
several turns, checked against what the offline model recorded); then the namespaced tool
catalog (a second app-server, whose model declares tool search).

Protocol facts pinned here (probed against the binary before building on them):

* ``thread/start`` with ``config: {"project_doc_max_bytes": 0}`` reads no AGENTS.md: the
  answer's ``instructionSources`` is empty, and no "# AGENTS.md instructions" user message
  reaches the model; without it, the AGENTS.md in cwd is listed and sent.
* ``turn/start`` ``collaborationMode`` (mode ``default``, ``settings.developer_instructions``)
  becomes one ``<collaboration_mode>...</collaboration_mode>`` developer message of that turn's
  request; the mode is sticky and the message is written only on a change, and
  ``developer_instructions: null`` writes the default mode's built-in text
  ("# Collaboration Mode: Default").
* ``dynamicTools`` namespaces: a namespace whose tools all have ``deferLoading`` is left out
  of the model's tool list, and ``tool_search`` is offered, only when the model's metadata
  declares ``supports_search_tool`` (a ``model_catalog_json``); without it the deferred tools
  are simply absent and no ``tool_search`` appears. A namespace without ``deferLoading`` is
  a ``namespace`` tool in the list; the model calls its tools with ``namespace`` apart.
* ``thread/queue/add`` on an idle thread starts the queued input as a turn at once (the queue
  lists nothing right after): Codex's queue bypasses the harness, so queue modes are kept
  host-side.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn import (
    AppServer,
    AppServerConfig,
    CollaborationInstructions,
    DynamicTool,
    HeartbeatResponse,
    TurnHooks,
    TurnOutcome,
    TurnParams,
    TurnResult,
    codex_turn_running,
    read_binding,
    run_codex_turn,
    steer_codex_turn,
)
from codex_turn.fsm.steering import SteerStatus
from codex_turn.fsm.thread import ThreadAction
from codex_turn.harness.appserver.tools import DIRECT_NAMESPACE, SEARCHABLE_NAMESPACE
from codex_turn.harness.collaboration import HEARTBEAT_GUIDANCE, HEARTBEAT_TOOL
from codex_turn.harness.observations import LlmInputObserved, LlmOutputObserved, ToolCallObserved
from codex_turn.harness.turn.steering import SteerReceipt
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

AGENTS = "AGENTS_RULE_5521: answer in haiku"
AGENTS_HEADER = "# AGENTS.md instructions for"
CHECKLIST = "CHECKLIST_BODY_8812: water the plants"
COLLABORATION = "<collaboration_mode>"
DEFAULT_MODE = "<collaboration_mode># Collaboration Mode: Default"


async def wait_for_model_request(model: OfflineModel, text: str) -> None:
    with anyio.fail_after(10):
        while not any(r.last_user_text == text for r in model.turn_requests()):  # noqa: ASYNC110
            await anyio.sleep(0.01)


def has(texts: list[str], needle: str) -> bool:
    return any(needle in text for text in texts)


def turn_start(server: AppServer, index: int) -> dict[str, Any]:
    """The params of the ``index``-th ``turn/start`` this test sent."""
    sent = [m for m in server.sent if m.get("method") == "turn/start"]
    return dict(sent[index]["params"])


async def test_lightweight_heartbeat_and_collaboration_turns_in_the_model_request(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    (workspace / "AGENTS.md").write_text(AGENTS)
    checklist = workspace / "HEARTBEAT.md"
    checklist.write_text(CHECKLIST)
    session = str(tmp_path / "session.jsonl")

    def turn(prompt: str, **fields: Any) -> TurnParams:
        return TurnParams(
            session_id="s-1",
            session_file=session,
            workspace_dir=str(workspace),
            prompt=prompt,
            **fields,
        )

    # 1. An ordinary turn: the project docs reach the model; no collaboration mode is sent.
    # Its observers see what went to the model, the native command Codex ran (a sandbox
    # that lets it write: a read-only one reports no commandExecution item) and the reply.
    tools: list[ToolCallObserved] = []
    inputs: list[LlmInputObserved] = []
    outputs: list[LlmOutputObserved] = []
    observers = TurnHooks(
        after_tool_call=tools.append, llm_input=inputs.append, llm_output=outputs.append
    )
    offline_model.script(
        Reply.function_call("exec_command", {"cmd": "echo observed", "yield_time_ms": 2000}),
        Reply.fixed("FIRST_DONE"),
    )
    first = await run_codex_turn(
        turn("first turn", sandbox="workspace-write"), app_server=appserver, hooks=observers
    )
    assert first.outcome is TurnOutcome.COMPLETED
    assert [(t.kind, t.name, t.native, t.status) for t in tools] == [
        ("commandExecution", "command", True, "completed")
    ]
    assert "echo observed" in str(tools[0].item.get("command"))
    assert tools[0].turn_id == first.turn_id
    assert [(i.prompt, i.thread_id) for i in inputs] == [("first turn", first.thread_id)]
    assert [(o.status, o.assistant_text, o.turn_id) for o in outputs] == [
        ("completed", "FIRST_DONE", first.turn_id)
    ]
    request = offline_model.turn_requests()[-1]
    assert has(request.user_messages, AGENTS_HEADER)
    assert has(request.user_messages, AGENTS)
    assert not has(request.developer_messages, COLLABORATION)
    assert "collaborationMode" not in turn_start(appserver, 0)

    # 2. A lightweight run: a transient thread started without them (the conversation goes
    # with it, from the transcript); the session's thread stays bound.
    light = await run_codex_turn(turn("cron job", lightweight=True), app_server=appserver)
    assert light.outcome is TurnOutcome.COMPLETED
    decision = light.thread_decision
    assert decision is not None
    assert (decision.action, decision.reason) == (ThreadAction.TRANSIENT, "own-transient-thread")
    request = offline_model.turn_requests()[-1]
    assert not has(request.user_messages, AGENTS_HEADER)
    assert not has(request.user_messages, AGENTS)
    assert has(request.user_messages, "first turn")  # the transcript went with it
    starts = [m["params"] for m in appserver.sent if m.get("method") == "thread/start"]
    assert starts[-1]["config"] == {"project_doc_max_bytes": 0}
    assert "config" not in starts[0]
    binding = read_binding(session)
    assert binding is not None
    assert binding.thread_id == first.thread_id

    # 3. A heartbeat: heartbeat_respond offered, its answer typed in the result; the guidance
    # as the turn's collaboration mode; the checklist named by path, never inlined.
    offline_model.script(
        Reply.function_call(HEARTBEAT_TOOL, {"decision": "notify", "text": "Plants need water"}),
        Reply.fixed("HEARTBEAT_DONE"),
    )
    beat = await run_codex_turn(
        turn("heartbeat wake", heartbeat=True, heartbeat_file=checklist), app_server=appserver
    )
    assert beat.outcome is TurnOutcome.COMPLETED
    assert beat.heartbeat == HeartbeatResponse("notify", "Plants need water")
    assert beat.thread_decision is not None
    assert beat.thread_decision.action is ThreadAction.TRANSIENT
    request = offline_model.turn_requests()[-1]  # the model's call after the tool's answer
    assert HEARTBEAT_TOOL in request.tool_names
    assert has(request.developer_messages, COLLABORATION + HEARTBEAT_GUIDANCE)
    assert has(request.developer_messages, str(checklist))
    every_text = [*request.developer_messages, *request.user_messages]
    assert not has(every_text, CHECKLIST)
    assert has(request.user_messages, AGENTS)  # not lightweight: the project docs are there

    # 4. On the session's thread: a skills catalog as this turn's collaboration mode; without
    # a memory tool the memory pointers are dropped and the plain-text memory is input.
    skills = CollaborationInstructions(
        skills_catalog="SKILLS_CATALOG_3307",
        memory_pointers="MEMORY_POINTER_4410",
        memory_context="MEMORY_TEXT_9051",
    )
    skilled = await run_codex_turn(turn("with skills", collaboration=skills), app_server=appserver)
    assert skilled.thread_id == first.thread_id
    request = offline_model.turn_requests()[-1]
    assert has(request.developer_messages, COLLABORATION + "SKILLS_CATALOG_3307")
    assert not has(request.developer_messages, "MEMORY_POINTER_4410")
    assert has(request.user_messages, "MEMORY_TEXT_9051")
    assert not has(request.developer_messages, HEARTBEAT_GUIDANCE)  # the heartbeat ran apart
    mode = turn_start(appserver, -1)["collaborationMode"]
    assert mode["settings"]["model"] == "mock-model"

    # 5. The next ordinary turn goes back to Codex's default mode (sent once).
    await run_codex_turn(turn("plain again"), app_server=appserver)
    request = offline_model.turn_requests()[-1]
    assert request.developer_messages[-1].startswith(DEFAULT_MODE)
    assert turn_start(appserver, -1)["collaborationMode"]["settings"] == {
        "developer_instructions": None,
        "model": "mock-model",
        "reasoning_effort": None,
    }
    await run_codex_turn(turn("and again"), app_server=appserver)
    assert "collaborationMode" not in turn_start(appserver, -1)

    # 6. Queue mode collect: messages that arrive while a turn runs are gathered for one next
    # turn; the running turn's model never sees them.
    offline_model.script(Reply.fixed("SLOW_DONE", delay=0.5))
    collected = ("COLLECTED_ONE_71", "COLLECTED_TWO_72")
    receipts: list[SteerReceipt] = []
    outcome: list[TurnResult] = []

    async def slow_turn() -> None:
        outcome.append(await run_codex_turn(turn("slow", steering="collect"), app_server=appserver))

    async with anyio.create_task_group() as group:
        group.start_soon(slow_turn)
        with anyio.fail_after(10):
            while not codex_turn_running(session):  # noqa: ASYNC110 - polls shared state
                await anyio.sleep(0.01)
        for text in collected:
            receipts.append(await steer_codex_turn(session, text))
    assert [(r.status, r.reason) for r in receipts] == [(SteerStatus.COLLECTED, "collect")] * 2
    (slow,) = outcome
    assert (slow.assistant_text, slow.collected, slow.steered) == ("SLOW_DONE", collected, ())
    assert not any(has(r.user_messages, collected[0]) for r in offline_model.turn_requests())
    await run_codex_turn(turn("\n\n".join(slow.collected)), app_server=appserver)
    assert offline_model.turn_requests()[-1].last_user_text == "\n\n".join(collected)
    assert offline_model.proxy_attempts == []


#: A model catalog for the offline model that declares Codex's tool search (every current
#: OpenAI model's metadata does; the offline ``mock-model`` has none, and without it Codex
#: leaves deferred tools out and offers no ``tool_search``: probed).
SEARCHING_MODEL = {
    "models": [
        {
            "slug": "mock-model",
            "display_name": "mock",
            "supported_in_api": True,
            "visibility": "list",
            "priority": 1,
            "shell_type": "unified_exec",
            "supported_reasoning_levels": [],
            "default_reasoning_level": None,
            "supports_search_tool": True,
            "context_window": 272000,
            "truncation_policy": {"mode": "tokens", "limit": 10000},
            "base_instructions": "You are the offline stand-in.",
            "input_modalities": ["text"],
            "experimental_supported_tools": [],
            "supports_parallel_tool_calls": False,
            "supports_reasoning_summaries": False,
            "apply_patch_tool_type": None,
            "web_search_tool_type": "text",
            "effective_context_window_percent": 95,
            "support_verbosity": False,
            "default_verbosity": None,
        }
    ]
}


async def test_namespaced_catalog_keeps_host_tools_searchable_and_direct_ones_visible(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    workspace: Path,
    tmp_path: Path,
) -> None:
    catalog = tmp_path / "models.json"
    catalog.write_text(json.dumps(SEARCHING_MODEL))
    config = make_appserver_config(extra_config={"model_catalog_json": str(catalog)})
    sent: list[str] = []

    async def send(arguments: dict[str, Any]) -> str:
        sent.append(str(arguments.get("text")))
        return "sent"

    async def recall(arguments: dict[str, Any]) -> str:
        return "nothing"

    schema = {"type": "object", "properties": {"text": {"type": "string"}}}
    message = DynamicTool("message", "Send a message.", schema, send, direct=True)
    memory = DynamicTool("memory_search", "Search memory.", schema, recall)
    observed: list[ToolCallObserved] = []
    offline_model.script(
        Reply.function_call("message", {"text": "hello"}, namespace=DIRECT_NAMESPACE),
        Reply.fixed("DONE"),
    )
    async with AppServer.start(config, record_sent=True) as server:
        result = await run_codex_turn(
            TurnParams(
                session_id="s-2",
                session_file=str(tmp_path / "s-2.jsonl"),
                workspace_dir=str(workspace),
                prompt="beat",
                heartbeat=True,
                tool_catalog="namespaced",
            ),
            app_server=server,
            tools=[message, memory],
            hooks=TurnHooks(after_tool_call=observed.append),
        )
        # Codex's own queue (thread/queue/add) starts a turn on an idle thread at once, with
        # no engine, no mirror and no turn machine around it: why the queue modes are the
        # host's (the queued message ran as a turn; the queue is empty right after).
        thread = await server.request("thread/start", {"cwd": str(workspace)})
        queued = {"type": "text", "text": "NATIVE_QUEUE_5150"}
        added = await server.request(
            "thread/queue/add",
            {"threadId": thread["thread"]["id"], "input": [queued], "clientUserMessageId": "q-1"},
        )
        assert added["queuedSubmission"]["input"][0]["text"] == "NATIVE_QUEUE_5150"
        listed = await server.request("thread/queue/list", {"threadId": thread["thread"]["id"]})
        assert listed["data"] == []
        await wait_for_model_request(offline_model, "NATIVE_QUEUE_5150")
    assert result.outcome is TurnOutcome.COMPLETED
    first = offline_model.turn_requests()[0]
    # The direct namespace is in the model's list; the searchable one (the host's tools and
    # heartbeat_respond) is behind tool_search.
    assert DIRECT_NAMESPACE in first.tool_names
    assert "tool_search" in first.tool_names
    assert SEARCHABLE_NAMESPACE not in first.tool_names
    direct = next(t for t in first.tools if t.get("name") == DIRECT_NAMESPACE)
    assert [t["name"] for t in direct["tools"]] == ["message"]
    start = next(m for m in server.sent if m.get("method") == "thread/start")
    declared = {spec["name"]: spec for spec in start["params"]["dynamicTools"]}
    assert [t["name"] for t in declared[SEARCHABLE_NAMESPACE]["tools"]] == [
        "memory_search",
        HEARTBEAT_TOOL,
    ]
    assert all(t["deferLoading"] for t in declared[SEARCHABLE_NAMESPACE]["tools"])
    # A direct tool called by its namespace runs the host's tool; the observer sees it.
    assert sent == ["hello"]
    assert [(o.name, o.native, o.status) for o in observed] == [
        (f"{DIRECT_NAMESPACE}.message", False, "completed")
    ]
    assert offline_model.proxy_attempts == []
