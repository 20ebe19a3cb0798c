"""Skipping a ``thread/resume`` that would change nothing, against the real binary.

A bound thread that this app-server process loaded with the very settings this turn sends,
and that Codex has neither compacted nor unloaded since, gets ``turn/start`` directly (the
resume table, :data:`codex_turn.fsm.thread.RESUME_RULES`). These tests prove on what the
model received that nothing is lost by it: the developer instructions reach the model on
every turn, also after an in-turn compaction; a change of instructions or runtime policy
still resumes, a change of tools still rotates, a new process resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from codex_turn import AppServer, AppServerConfig, TurnOutcome, TurnParams, run_codex_turn
from codex_turn.harness.appserver import tool
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

MARKER = "DEV-MARKER-6c1f"


@pytest.fixture
def params(tmp_path: Path, workspace: Path) -> Callable[..., TurnParams]:
    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "session-r",
            "session_key": "agent:main:session-r",
            "session_file": tmp_path / "session-r.jsonl",
            "workspace_dir": workspace,
            "prompt": "hello",
            "extra_developer_instructions": MARKER,
        }
        values.update(overrides)
        return TurnParams(**values)

    return make


def rpc_methods(server: AppServer, since: int) -> list[str]:
    return [m["method"] for m in server.sent[since:] if "id" in m and "method" in m]


def resume_reasons(records: list[dict[str, Any]]) -> list[str]:
    return [r["resume"] for r in records if r["event"] == "codex app-server thread resumed"]


def carries(request: Any, text: str) -> bool:
    return any(text in part for part in request.developer_parts)


async def test_a_loaded_thread_is_reused_and_instructions_reach_every_turn(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    with capture_logs() as records:
        first = await run_codex_turn(params(prompt="one"), app_server=appserver)
        mark = len(appserver.sent)
        later = [
            await run_codex_turn(params(prompt=f"turn {i}"), app_server=appserver)
            for i in range(2, 5)
        ]
    assert all(r.outcome is TurnOutcome.COMPLETED for r in [first, *later])
    assert {r.thread_id for r in later} == {first.thread_id}
    # Three turns, three turn/starts, no thread/resume.
    assert rpc_methods(appserver, mark) == ["turn/start"] * 3
    assert resume_reasons(records) == ["thread-loaded-unchanged"] * 3
    requests = offline_model.turn_requests()
    assert len(requests) == 4
    assert all(carries(r, MARKER) for r in requests)
    # The conversation is intact: the last request carries every earlier prompt.
    assert all(f"turn {i}" in "\n".join(requests[-1].user_messages) for i in (2, 3))
    assert "one" in requests[-1].user_messages


async def test_after_an_in_turn_compaction_the_next_turn_resumes_with_the_instructions(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    # Codex compacts on its own before a turn once usage passed the limit.
    config = make_appserver_config(auto_compact_token_limit=50)
    async with AppServer.start(config, record_sent=True) as server:
        with capture_logs() as records:
            results = [
                await run_codex_turn(params(prompt=f"step {i}"), app_server=server)
                for i in range(4)
            ]
    assert all(r.outcome is TurnOutcome.COMPLETED for r in results)
    assert results[1].native_compactions >= 1
    # Each turn that follows a compaction re-sends the instructions with thread/resume.
    reasons = resume_reasons(records)
    assert "compacted-since-loaded" in reasons
    # (turn k+1 resumes exactly when Codex compacted during turn k)
    expected = [
        "compacted-since-loaded" if r.native_compactions else "thread-loaded-unchanged"
        for r in results[:-1]
    ]
    assert reasons == expected
    # Every request the model answered as a turn (not a compaction) carried them.
    turns = offline_model.turn_requests()
    assert len(turns) >= 4
    assert all(carries(r, MARKER) for r in turns)
    assert offline_model.compaction_requests()


async def test_changed_instructions_or_policy_resume_as_before(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    with capture_logs() as records:
        await run_codex_turn(params(prompt="a"), app_server=appserver)
        mark = len(appserver.sent)
        await run_codex_turn(
            params(prompt="b", extra_developer_instructions="NEW-MARKER-9d2e"),
            app_server=appserver,
        )
        changed = rpc_methods(appserver, mark)
        resume = [m["params"] for m in appserver.sent[mark:] if m.get("method") == "thread/resume"]
        mark = len(appserver.sent)
        await run_codex_turn(
            params(prompt="c", extra_developer_instructions="NEW-MARKER-9d2e"),
            app_server=appserver,
        )
        same = rpc_methods(appserver, mark)
        mark = len(appserver.sent)
        await run_codex_turn(
            params(
                prompt="d", extra_developer_instructions="NEW-MARKER-9d2e", approval_policy="never"
            ),
            app_server=appserver,
        )
        policy = rpc_methods(appserver, mark)
        policy_start = [
            m["params"] for m in appserver.sent[mark:] if m.get("method") == "turn/start"
        ]
    assert changed == ["thread/resume", "turn/start"]
    assert "NEW-MARKER-9d2e" in resume[0]["developerInstructions"]
    assert same == ["turn/start"]  # once re-sent, the new settings are what Codex holds
    # A runtime policy is this turn's: it goes on turn/start (a resume of a loaded thread
    # would ignore it), so it needs no resume.
    assert policy == ["turn/start"]
    assert policy_start[0]["approvalPolicy"] == "never"
    assert resume_reasons(records) == [
        "thread-settings-changed",
        "thread-loaded-unchanged",
        "thread-loaded-unchanged",
    ]
    # Codex 0.163 builds a thread's developer message once (at its first turn, and again
    # only after a compaction): instructions re-sent on resume mid-thread do not reach the
    # model, with or without the skipped resumes. Pinned here so a binary that changes it
    # is noticed (the README's "Limits" says so).
    requests = offline_model.turn_requests()
    assert all(carries(r, MARKER) for r in requests)
    assert not any(carries(r, "NEW-MARKER-9d2e") for r in requests)


async def test_a_changed_tool_set_still_rotates(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    @tool("lookup", "first tool")
    async def lookup(args: Any) -> str:
        return "x"

    @tool("other", "second tool")
    async def other(args: Any) -> str:
        return "y"

    first = await run_codex_turn(params(prompt="a"), app_server=appserver, tools=[lookup])
    mark = len(appserver.sent)
    second = await run_codex_turn(params(prompt="b"), app_server=appserver, tools=[lookup, other])
    assert second.thread_id != first.thread_id
    assert rpc_methods(appserver, mark) == ["thread/start", "turn/start"]
    tool_names = {t.get("name") for t in offline_model.turn_requests()[-1].body.get("tools", [])}
    assert {"lookup", "other"} <= tool_names


async def test_a_new_process_resumes_the_thread(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    first = await run_codex_turn(params(prompt="before the crash"), app_server=appserver)
    process = appserver.current
    assert process is not None
    await process.retire("test kills the process", dead=True)
    with capture_logs() as records:
        second = await run_codex_turn(params(prompt="after the crash"), app_server=appserver)
    assert second.outcome is TurnOutcome.COMPLETED
    assert second.thread_id == first.thread_id
    assert resume_reasons(records) == ["thread-not-loaded-here"]
    last = offline_model.turn_requests()[-1]
    assert carries(last, MARKER)
    assert "before the crash" in last.user_messages


async def test_a_reused_thread_calls_this_turns_tool_handlers(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    """Same tool specs (no rotation, no resume), new handler closures: the model's tool
    call on the reused thread is answered by this turn's handler."""
    answered: list[str] = []

    def handler(label: str) -> Any:
        @tool("lookup", "look a thing up")
        async def lookup(args: Any) -> str:
            answered.append(label)
            return f"answer from {label}"

        return lookup

    await run_codex_turn(params(prompt="a"), app_server=appserver, tools=[handler("turn-1")])
    offline_model.script(Reply.function_call("lookup", {}), user_contains="b")
    mark = len(appserver.sent)
    second = await run_codex_turn(
        params(prompt="b"), app_server=appserver, tools=[handler("turn-2")]
    )
    assert second.outcome is TurnOutcome.COMPLETED
    assert rpc_methods(appserver, mark) == ["turn/start"]
    assert answered == ["turn-2"]
    outputs = [
        i
        for i in offline_model.turn_requests()[-1].body.get("input", [])
        if i.get("type") == "function_call_output"
    ]
    assert "answer from turn-2" in str(outputs)
