"""Lightweight runs, turn-scoped collaboration-mode instructions and heartbeat turns, in
process: the plan of what goes where, the client's completion of the collaboration mode (and
its return to Codex's default mode), the thread settings of a lightweight run, and heartbeat
turns through the orchestrator on the fake app-server (the tool, its typed answer, the
transient thread, the engine told). What the real binary makes of them is pinned in
``test_runtime_turn_e2e.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest
from support.fake_appserver import CodexScript, FakeAppServer
from support.recording_engine import RecordingEngine
from support.turns import turn_params as params

from codex_turn import TurnOutcome, read_binding, run_codex_turn
from codex_turn.fsm.thread import ThreadAction
from codex_turn.harness.appserver import ThreadSettings
from codex_turn.harness.appserver.threads import LoadedThread, Threads
from codex_turn.harness.appserver.types import ThreadResult, structure
from codex_turn.harness.collaboration import (
    HEARTBEAT_GUIDANCE,
    HEARTBEAT_TOOL,
    CollaborationInstructions,
    HeartbeatResponse,
    collaboration_mode,
    collaboration_plan,
)
from codex_turn.harness.turn_api import InvalidTurnParams

MEMORY = CollaborationInstructions(
    skills_catalog="SKILLS: deploy -> skills/deploy.md",
    memory_pointers="MEMORY.md: see memory_search",
    memory_context="BOOTSTRAP and MEMORY text",
)


def test_memory_pointers_need_a_memory_tool_else_the_plain_text_goes_as_input() -> None:
    with_tool = collaboration_plan(MEMORY, tool_names=["memory_search", "other"])
    assert with_tool.instructions == (
        "SKILLS: deploy -> skills/deploy.md\n\nMEMORY.md: see memory_search"
    )
    assert with_tool.input_context is None
    without = collaboration_plan(MEMORY, tool_names=["other"])
    assert without.instructions == "SKILLS: deploy -> skills/deploy.md"
    assert without.input_context == "BOOTSTRAP and MEMORY text"
    # Nothing given, or only blanks: nothing is sent (an ordinary turn stays in default mode).
    assert collaboration_plan(None, tool_names=()).instructions is None
    blank = CollaborationInstructions(skills_catalog="  ", memory_context="")
    assert collaboration_plan(blank, tool_names=()) == collaboration_plan(None, tool_names=())


def test_heartbeat_guidance_names_the_file_by_path_and_comes_first() -> None:
    plan = collaboration_plan(
        MEMORY, tool_names=[], heartbeat=True, heartbeat_file="/srv/agent/HEARTBEAT.md"
    )
    assert plan.instructions is not None
    assert plan.instructions.startswith(HEARTBEAT_GUIDANCE)
    assert "/srv/agent/HEARTBEAT.md" in plan.instructions
    assert plan.instructions.endswith("SKILLS: deploy -> skills/deploy.md")
    unnamed = collaboration_plan(None, tool_names=[], heartbeat=True)
    assert unnamed.instructions == HEARTBEAT_GUIDANCE


def test_the_client_completes_the_mode_and_goes_back_to_the_default_once() -> None:
    threads = Threads(cast(Any, None))  # only the local state is used here
    plain = {"threadId": "t", "input": []}
    assert threads.collaboration("t", plain, model="m") == plain  # nothing of its own: unsent
    custom = threads.collaboration(
        "t", {**plain, "effort": "high", "collaborationMode": collaboration_mode("X")}, model="m"
    )
    assert custom["collaborationMode"] == {
        "mode": "default",
        # Codex lets these win over the turn's own (a null effort would clear it).
        "settings": {"developer_instructions": "X", "model": "m", "reasoning_effort": "high"},
    }
    threads.note_collaboration("t", custom)
    back = threads.collaboration("t", plain, model="m")
    assert back["collaborationMode"] == {
        "mode": "default",
        "settings": {"developer_instructions": None, "model": "m", "reasoning_effort": None},
    }
    threads.note_collaboration("t", back)
    assert threads.collaboration("t", plain, model="m") == plain  # once
    # A mode whose model nobody knows is not sent (Codex requires one).
    assert "collaborationMode" not in threads.collaboration(
        "u", {**plain, "collaborationMode": collaboration_mode("X")}, model=None
    )
    # Without a turn model, the thread's own (as Codex reported it) wins over the client's
    # default: a mode must not switch a resumed thread to another model.
    held = structure({"thread": {"id": "h"}, "model": "held-model"}, ThreadResult)
    threads._loaded["h"] = LoadedThread(held, "key", defaults={"effort": "low"})
    completed = threads.collaboration(
        "h", {**plain, "collaborationMode": collaboration_mode("X")}, model=None, default_model="d"
    )
    assert completed["collaborationMode"]["settings"]["model"] == "held-model"
    assert completed["collaborationMode"]["settings"]["reasoning_effort"] == "low"


def test_a_lightweight_thread_starts_without_project_docs() -> None:
    light = ThreadSettings(cwd="/w", project_docs=False)
    assert light.wire("thread/start")["config"] == {"project_doc_max_bytes": 0}
    assert "config" not in ThreadSettings(cwd="/w").wire("thread/start")
    assert "config" not in light.wire("thread/resume")
    assert light.key != ThreadSettings(cwd="/w").key
    # Per-thread hook config and the lightweight override travel in the one ``config``.
    hooked = ThreadSettings(cwd="/w", project_docs=False, config={"hooks": {"Stop": []}})
    assert hooked.wire("thread/start")["config"] == {
        "project_doc_max_bytes": 0,
        "hooks": {"Stop": []},
    }
    assert hooked.wire("thread/resume")["config"] == {"hooks": {"Stop": []}}


def test_collaboration_params_are_checked() -> None:
    with pytest.raises(InvalidTurnParams, match="heartbeat_file is for a heartbeat turn"):
        params("/tmp/s.jsonl", "hi", heartbeat_file="HEARTBEAT.md")
    with pytest.raises(InvalidTurnParams, match="collaboration must be"):
        params("/tmp/s.jsonl", "hi", collaboration="skills")
    with pytest.raises(InvalidTurnParams, match="lightweight must be a bool"):
        params("/tmp/s.jsonl", "hi", lightweight="yes")


@pytest.mark.anyio
async def test_a_heartbeat_runs_apart_records_its_answer_and_tells_the_engine(
    session_file: str,
) -> None:
    server = FakeAppServer()
    engine = RecordingEngine(engine_id="memory")
    first = await run_codex_turn(params(session_file, "hello"), app_server=server, engine=engine)
    assert first.outcome is TurnOutcome.COMPLETED
    bound = read_binding(session_file)
    assert bound is not None
    server.scripts.append(
        CodexScript(tool_calls=[(HEARTBEAT_TOOL, {"decision": "notify", "text": "Standup in 5"})])
    )
    beat = await run_codex_turn(
        params(session_file, "heartbeat", heartbeat=True), app_server=server, engine=engine
    )
    assert beat.outcome is TurnOutcome.COMPLETED
    assert beat.heartbeat == HeartbeatResponse("notify", "Standup in 5")
    assert beat.heartbeat.notify
    decision = beat.thread_decision
    assert decision is not None
    assert (decision.action, decision.reason) == (ThreadAction.TRANSIENT, "own-transient-thread")
    assert beat.thread_id != first.thread_id
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.thread_id == bound.thread_id  # the session's thread stays bound
    assert HEARTBEAT_TOOL in server.calls_to("start_thread")[-1].args["tools"]
    mode = server.turn_overrides[-1]["collaborationMode"]
    assert mode["settings"]["developer_instructions"] == HEARTBEAT_GUIDANCE
    assert "collaborationMode" not in server.turn_overrides[0]  # an ordinary turn: nothing
    heartbeat_flags = [
        (call.method, call.params.is_heartbeat)
        for call in engine.calls
        if call.method in ("assemble", "after_turn")
    ]
    assert heartbeat_flags == [
        ("assemble", False),
        ("after_turn", False),
        ("assemble", True),
        ("after_turn", True),
    ]
    # A heartbeat the model answered silently, then one it did not answer at all.
    server.scripts.append(CodexScript(tool_calls=[(HEARTBEAT_TOOL, {"decision": "silent"})]))
    quiet = await run_codex_turn(
        params(session_file, "heartbeat", heartbeat=True), app_server=server
    )
    assert quiet.heartbeat == HeartbeatResponse("silent")
    unanswered = await run_codex_turn(
        params(session_file, "heartbeat", heartbeat=True), app_server=server
    )
    assert unanswered.heartbeat is None
    # notify without text is refused to the model (nothing recorded).
    server.scripts.append(CodexScript(tool_calls=[(HEARTBEAT_TOOL, {"decision": "notify"})]))
    textless = await run_codex_turn(
        params(session_file, "heartbeat", heartbeat=True), app_server=server
    )
    assert textless.heartbeat is None
    assert "needs the text" in server.tool_outputs[-1]


@pytest.mark.anyio
async def test_a_lightweight_run_starts_its_own_thread_without_project_docs(
    session_file: str,
) -> None:
    server = FakeAppServer()
    first = await run_codex_turn(params(session_file, "hello"), app_server=server)
    light = await run_codex_turn(params(session_file, "cron", lightweight=True), app_server=server)
    assert light.thread_decision is not None
    assert light.thread_decision.action is ThreadAction.TRANSIENT
    assert light.thread_id != first.thread_id
    assert server.calls_to("start_thread")[-1].args["project_docs"] is False
    assert server.calls_to("start_thread")[0].args["project_docs"] is True
    third = await run_codex_turn(params(session_file, "again"), app_server=server)
    assert third.thread_id == first.thread_id  # the session's thread, with its docs


@pytest.mark.anyio
async def test_a_heartbeat_names_its_checklist_only_when_it_holds_something(
    session_file: str,
) -> None:
    server = FakeAppServer()
    checklist = Path(os.path.dirname(session_file), "HEARTBEAT.md")
    for content, named in (("- water the plants", True), ("", False)):
        checklist.write_text(content)  # noqa: ASYNC240 - a test's fixture file
        # Relative: the workspace's (where the model reads it).
        beat = params(session_file, "beat", heartbeat=True, heartbeat_file="HEARTBEAT.md")
        await run_codex_turn(beat, app_server=server)
        instructions = server.turn_overrides[-1]["collaborationMode"]["settings"][
            "developer_instructions"
        ]
        assert ("HEARTBEAT.md" in instructions) is named
        assert "water the plants" not in instructions


@pytest.mark.anyio
async def test_a_first_turn_that_is_a_heartbeat_binds_nothing(session_file: str) -> None:
    server = FakeAppServer()
    beat = await run_codex_turn(params(session_file, "beat", heartbeat=True), app_server=server)
    assert beat.outcome is TurnOutcome.COMPLETED
    assert beat.thread_decision is not None
    assert beat.thread_decision.action is ThreadAction.TRANSIENT
    assert read_binding(session_file) is None
    first = await run_codex_turn(params(session_file, "hello"), app_server=server)
    assert first.thread_decision is not None
    assert first.thread_decision.action is ThreadAction.START
    assert first.thread_id != beat.thread_id
    assert HEARTBEAT_TOOL not in server.calls_to("start_thread")[-1].args["tools"]
