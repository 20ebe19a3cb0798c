"""Supervising a Codex home's native threads, against the real binary.

One Codex process writes a native thread (two turns, one of them a tool call and reasoning);
a second process on the same home supervises it: lists it passively, refuses to archive it
unconfirmed, continues it as a branch and archives the branch with confirmation. What Codex
answers to each method is pinned here (its shapes, its ``notLoaded`` status for a stored
thread, the fork's model and provider). An *active* source or descendant cannot be produced
offline between two requests; the fast tests cover those rows of the tables against the
recorded protocol.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn import TurnOutcome, TurnParams, cli, run_codex_turn
from codex_turn.fsm.supervision import ArchiveState, BranchState, NativeStatus
from codex_turn.harness.appserver import AppServer, AppServerConfig, ThreadSettings
from codex_turn.harness.binding import read_binding
from codex_turn.harness.supervision import (
    archive_native_thread,
    branch_native_thread,
    list_native_threads,
    read_native_thread,
)
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.codex]

#: What a passive look may send: nothing that loads, subscribes or answers.
PASSIVE = {"initialize", "initialized", "thread/list", "thread/read", "account/read"}


def requests(sent: list[dict[str, Any]], since: int = 0) -> list[dict[str, Any]]:
    return [m for m in sent[since:] if "method" in m]


async def _native_thread(config: AppServerConfig, model: OfflineModel, cwd: Path) -> str:
    """A thread of 'someone else's Codex': a plain turn, then a tool call with reasoning."""
    async with AppServer.start(config) as server:
        thread = await server.start_thread(ThreadSettings(cwd=str(cwd)))
        model.script(Reply.fixed("first answer"))
        await server.run_turn(thread.thread_id, "first question", idle_timeout=30)
        model.script(
            Reply.function_call(
                "exec_command", {"cmd": "echo tool-secret-7f", "yield_time_ms": 500}
            ),
            Reply.with_reasoning("private-reasoning-3a", "second answer"),
        )
        await server.run_turn(thread.thread_id, "second question", idle_timeout=30)
        return thread.thread_id


@pytest.mark.anyio
async def test_a_native_thread_is_listed_passively_branched_and_archived_safely(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    workspace: Path,
    codex_schema: Any,
) -> None:
    first = make_appserver_config()
    source_id = await _native_thread(first, offline_model, workspace)

    async with AppServer.start(
        make_appserver_config(codex_home=first.codex_home), record_sent=True
    ) as server:
        # Listing and reading are passive, and Codex says "notLoaded" for a stored thread.
        threads = await list_native_threads(server)
        listed = {t.thread_id: t for t in threads}
        assert source_id in listed
        source = listed[source_id]
        assert source.status is NativeStatus.NOT_LOADED
        assert (source.model, source.model_provider) == ("mock-model", "offline")
        assert source.preview == "first question"
        assert source.resume_command == f"codex resume {source_id}"
        read = await read_native_thread(server, source_id)
        assert read.session_id == source.session_id
        assert {m["method"] for m in requests(server.sent)} <= PASSIVE
        assert not [m for m in server.sent if "method" not in m]  # no server request answered
        loaded = await server.request("thread/loaded/list", {})
        assert source_id not in loaded["data"]

        # Unknown (notLoaded) is not idle: no archive without a confirmation.
        refused = await archive_native_thread(server, source_id)
        assert (refused.outcome, refused.reason) == (ArchiveState.REFUSED, "needs-confirmation")

        mark = len(server.sent)
        branch = await branch_native_thread(server, source_id)
        assert branch.outcome is BranchState.BRANCHED, branch
        assert (branch.model, branch.model_provider) == ("mock-model", "offline")
        assert branch.fork_archived
        assert branch.messages == 4
        sent = requests(server.sent, mark)
        methods = [m["method"] for m in sent]
        assert "thread/resume" not in methods  # the source is never resumed
        fork = next(m for m in sent if m["method"] == "thread/fork")
        assert fork["params"]["threadId"] == source_id
        assert not {"model", "modelProvider"} & set(fork["params"])
        start = next(m for m in sent if m["method"] == "thread/start")
        assert (start["params"]["model"], start["params"]["modelProvider"]) == (
            "mock-model",
            "offline",
        )
        injected = next(m for m in sent if m["method"] == "thread/inject_items")
        assert [(i["role"], i["content"][0]["text"]) for i in injected["params"]["items"]] == [
            ("user", "first question"),
            ("assistant", "first answer"),
            ("user", "second question"),
            ("assistant", "second answer"),
        ]
        counts = codex_schema.validate_sent(server.sent, {})
        assert counts["thread/fork"] == counts["thread/archive"] == 1
        loaded = await server.request("thread/loaded/list", {})
        assert source_id not in loaded["data"]
        # Codex lists a thread once it has a user turn: not the injected branch yet, and
        # never the archived fork.
        unarchived = {t.thread_id for t in await list_native_threads(server)}
        assert unarchived == {source_id}
        archived = await server.request("thread/list", {"archived": True})
        assert branch.fork_thread_id in {t["id"] for t in archived["data"]}

        # The branch continues with the visible history only: no reasoning, no tool call.
        assert branch.thread_id is not None
        before = len(offline_model.turn_requests())
        offline_model.script(Reply.fixed("third answer"))
        await server.run_turn(branch.thread_id, "third question", idle_timeout=30)
        request = offline_model.turn_requests()[before]
        assert request.user_messages[-3:] == ["first question", "second question", "third question"]
        assert request.assistant_messages == ["first answer", "second answer"]
        assert not request.function_calls
        body = str(request.input_items)
        assert "tool-secret-7f" not in body
        assert "private-reasoning-3a" not in body
        listed_now = {t.thread_id: t for t in await list_native_threads(server)}
        assert set(listed_now) == {source_id, branch.thread_id}
        assert listed_now[branch.thread_id].status is NativeStatus.IDLE

        # Archiving the idle branch with a confirmation: descendants are checked, then done.
        done = await archive_native_thread(server, branch.thread_id, confirm=True)
        assert (done.outcome, done.reason, done.descendants) == (
            ArchiveState.ARCHIVED,
            "archived",
            0,
        )
        query = next(
            m
            for m in requests(server.sent)
            if m["method"] == "thread/list" and m["params"].get("ancestorThreadId")
        )
        assert query["params"]["ancestorThreadId"] == branch.thread_id
        assert "subAgent" in query["params"]["sourceKinds"]
        assert branch.thread_id not in {t.thread_id for t in await list_native_threads(server)}


def test_the_threads_commands_and_a_supervised_session_keep_the_threads_model(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    workspace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = make_appserver_config()
    source_id = anyio.run(_native_thread, config, offline_model, workspace)
    home = ["--codex-home", str(config.codex_home), "--json"]

    assert cli.main(["threads", "list", *home]) == cli.EXIT_OK
    [row] = json.loads(capsys.readouterr().out)
    assert (row["threadId"], row["status"], row["resume"]) == (
        source_id,
        "notLoaded",
        f"codex resume {source_id}",
    )
    assert cli.main(["threads", "archive", source_id, *home]) == cli.EXIT_NOT_OK
    assert json.loads(capsys.readouterr().out)["reason"] == "needs-confirmation"

    session = tmp_path / "branch.jsonl"
    branch_args = ["threads", "branch", source_id, "--session", str(session)]
    assert cli.main([*branch_args, "--session-id", "session-b", *home]) == cli.EXIT_OK
    branched = json.loads(capsys.readouterr().out)
    assert (branched["outcome"], branched["model"], branched["messages"]) == (
        "branched",
        "mock-model",
        4,
    )
    binding = read_binding(session, session_id="session-b")
    assert binding is not None
    assert (binding.thread_id, binding.supervised) == (branched["threadId"], True)

    assert cli.main(["threads", "archive", source_id, "--yes", *home]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["outcome"] == "archived"
    assert cli.main(["threads", "list", *home]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out) == []  # the source is archived

    # The supervised session's next turn resumes the thread without a model of its own:
    # Codex runs it on the model the thread persisted, whatever the turn picked.
    params = TurnParams(
        session_id="session-b",
        session_key="agent:main:session-b",
        session_file=session,
        workspace_dir=workspace,
        prompt="continue please",
        model="picked-model",
    )

    async def next_turn() -> Any:
        async with AppServer.start(
            make_appserver_config(codex_home=config.codex_home), record_sent=True
        ) as server:
            result = await run_codex_turn(params, app_server=server)
            return result, requests(server.sent)

    result, sent = anyio.run(next_turn)
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.thread_id == branched["threadId"]
    resume = next(m for m in sent if m["method"] == "thread/resume")
    assert not {"model", "modelProvider"} & set(resume["params"])
    last = offline_model.turn_requests()[-1]
    assert last.body["model"] == "mock-model"
    assert last.user_messages[-1] == "continue please"
    assert "first question" in last.user_messages
