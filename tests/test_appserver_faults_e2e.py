"""App-server faults end to end against the REAL ``codex app-server`` 0.163.0.

* A wedged (SIGSTOPped) process is declared dead after a missed deadline and a silent
  liveness probe, killed and replaced; the same thread then continues with its history.
* Lone UTF-16 surrogates in instructions, prompts and tool results never reach Codex (which
  would never answer): they arrive as U+FFFD, and the turn completes at once.
* Resuming a thread Codex does not have raises :class:`ThreadNotFound`; every other resume
  failure keeps its own type.
* A private CODEX_HOME, and everything Codex writes into it, is owner-only.
* Dynamic tool arguments that violate the tool's schema never reach the host function.

The same faults under exact control, without the binary: test_appserver_faults.py.
"""

from __future__ import annotations

import os
import signal
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn.harness.appserver import (
    AppServer,
    AppServerConfig,
    AppServerError,
    AppServerProcess,
    AppServerRpcError,
    AppServerTimeout,
    CodexTurnStatus,
    DynamicTool,
    Notification,
    ThreadNotFound,
    ThreadSettings,
)
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex, pytest.mark.both_backends]

ConfigFactory = Callable[..., AppServerConfig]

DEV = "DEV_MARKER_c41f: answer tersely."
# Small deadlines: Codex answers requests in milliseconds, the probe in under one.
FAST = {"request_timeout": 2.0, "interrupt_grace": 0.5, "liveness_timeout": 1.0}


def process_of(server: AppServer) -> AppServerProcess:
    client = server.current
    assert client is not None
    assert isinstance(client.transport, AppServerProcess)
    return client.transport


# Rollout files, touched from the tests' async bodies through these (plain, blocking) helpers.


def rollout_exists(path: str | None) -> bool:
    return path is not None and Path(path).is_file()


def delete_rollout(path: str | None) -> None:
    assert path is not None
    Path(path).unlink()


def corrupt_rollout(path: str | None) -> None:
    assert path is not None
    Path(path).write_text("garbage\n")


async def wait_for_model_requests(model: OfflineModel, count: int) -> None:
    with anyio.fail_after(10):
        while len(model.requests) < count:  # noqa: ASYNC110 - the model records from threads
            await anyio.sleep(0.01)


# --- 1. a wedged process is replaced ---------------------------------------------------------


@pytest.mark.parametrize("stopped", ["mid_turn", "before_turn"])
async def test_a_stopped_process_is_declared_dead_replaced_and_the_thread_goes_on(
    make_appserver_config: ConfigFactory,
    offline_model: OfflineModel,
    workspace: Path,
    stopped: str,
) -> None:
    async with AppServer.start(make_appserver_config(**FAST)) as server:
        thread = await server.start_thread(
            ThreadSettings(cwd=str(workspace), developer_instructions=DEV)
        )
        tid = thread.thread_id
        first = await server.run_turn(tid, "first words 7d2e")
        assert first.final_text == "ECHO: first words 7d2e"
        wedged = process_of(server)
        wedged_client = server.current
        assert wedged_client is not None
        stuck_started = time.monotonic()
        if stopped == "mid_turn":
            offline_model.script(Reply.fixed("never sent", delay=30))
            outcome: list[CodexTurnStatus] = []

            async def stuck_turn() -> None:
                result = await server.run_turn(tid, "stuck turn", idle_timeout=1.0)
                outcome.append(result.outcome)

            async with anyio.create_task_group() as tg:
                tg.start_soon(stuck_turn)
                await wait_for_model_requests(offline_model, 2)
                os.kill(wedged.pid, signal.SIGSTOP)
                stuck_started = time.monotonic()
            assert outcome == [CodexTurnStatus.TIMED_OUT]
        else:
            os.kill(wedged.pid, signal.SIGSTOP)
            with pytest.raises(AppServerTimeout):
                await server.run_turn(tid, "never started")
        detected = time.monotonic() - stuck_started
        # idle 1 s (or request 2 s) + interrupt grace 0.5 s + liveness 1 s, and some slack.
        assert detected < 6.0, f"took {detected:.1f}s to give up on the wedged process"
        assert wedged_client.closed  # declared dead ...
        with anyio.fail_after(5):
            while wedged.returncode is None:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert wedged.returncode == -signal.SIGKILL  # ... and killed, although stopped
        assert server.restarts == 0  # replaced on the next call, like a crashed one
        assert rollout_exists(thread.thread.path)  # nothing on disk was destroyed

        after = await server.run_turn(tid, "after the wedge")
        assert server.restarts == 1
        assert after.outcome is CodexTurnStatus.COMPLETED
        assert after.final_text == "ECHO: after the wedge"
        last = offline_model.requests[-1]
        # The same thread, auto-resumed in the new process: the earlier conversation is there.
        assert "first words 7d2e" in last.user_messages
        assert "ECHO: first words 7d2e" in last.assistant_messages
        assert last.developer_parts.count(DEV) == 1
    assert offline_model.proxy_attempts == []


async def test_a_slow_but_live_process_is_never_declared_dead(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    """A timed-out turn whose process answers the probe keeps its process."""
    async with AppServer.start(make_appserver_config(**FAST)) as server:
        tid = (await server.start_thread(ThreadSettings(cwd=str(workspace)))).thread_id
        offline_model.script(Reply.fixed("too late", delay=5))
        slow = await server.run_turn(tid, "slow model", idle_timeout=0.5)
        assert slow.outcome is CodexTurnStatus.TIMED_OUT  # interrupted, answered
        fast = await server.run_turn(tid, "next")
        assert fast.outcome is CodexTurnStatus.COMPLETED
        assert server.restarts == 0


# --- 2. lone surrogates ------------------------------------------------------------------------


async def test_lone_surrogates_arrive_as_replacement_characters_and_the_turn_completes(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    async def lookup(args: dict[str, Any]) -> str:
        return "tool says \udc00 bye"

    tool = DynamicTool("lookup", "Look up.", {"type": "object"}, lookup)
    offline_model.script(Reply.function_call("lookup", {}, call_id="c_S1"))
    started = time.monotonic()
    async with AppServer.start(make_appserver_config(request_timeout=5.0)) as server:
        thread = await server.start_thread(
            ThreadSettings(
                cwd=str(workspace), developer_instructions="DEV \ud800 lone", tools=[tool]
            )
        )
        result = await server.run_turn(
            thread.thread_id, "hi \udfff there, a pair \ud83d\ude00 stays", idle_timeout=5.0
        )
        client = server.current
        assert client is not None
        assert client.repaired_surrogates == 3
    elapsed = time.monotonic() - started
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert elapsed < 5.0, f"the turn took {elapsed:.1f}s"
    first, second = offline_model.requests
    assert "DEV \ufffd lone" in first.developer_parts
    assert first.last_user_text == "hi \ufffd there, a pair \U0001f600 stays"
    (output,) = second.function_call_outputs
    assert output["output"] == "tool says \ufffd bye"


# --- 3. definitive versus transient resume failures -------------------------------------------


async def test_resume_raises_thread_not_found_only_for_a_thread_codex_does_not_have(
    make_appserver_config: ConfigFactory, workspace: Path
) -> None:
    config = make_appserver_config(**FAST)
    async with AppServer.start(config) as server:
        gone = await server.start_thread(ThreadSettings(cwd=str(workspace)))
        await server.run_turn(gone.thread_id, "soon gone")
        corrupt = await server.start_thread(ThreadSettings(cwd=str(workspace)))
        await server.run_turn(corrupt.thread_id, "soon corrupt")
    delete_rollout(gone.thread.path)
    corrupt_rollout(corrupt.thread.path)
    async with AppServer.start(make_appserver_config(codex_home=config.codex_home, **FAST)) as s:
        for unknown in (str(uuid.uuid4()), gone.thread_id, "not-a-thread-id"):
            with pytest.raises(ThreadNotFound) as found:
                await s.resume_thread(unknown, ThreadSettings(developer_instructions=None))
            assert isinstance(found.value, AppServerRpcError)
            assert found.value.code == -32600
            assert found.value.thread_id == unknown
        # A rollout that exists but cannot be read is not "no such thread".
        with pytest.raises(AppServerRpcError) as unreadable:
            await s.resume_thread(corrupt.thread_id, ThreadSettings(developer_instructions=None))
        assert not isinstance(unreadable.value, ThreadNotFound)
        # Nor is a process that does not answer (transient: the thread may well exist).
        stopped = s.current
        assert stopped is not None
        os.kill(process_of(s).pid, signal.SIGSTOP)
        with pytest.raises(AppServerError) as stuck:
            await s.resume_thread(str(uuid.uuid4()), ThreadSettings(developer_instructions=None))
        assert isinstance(stuck.value, AppServerTimeout)
        assert not isinstance(stuck.value, ThreadNotFound)
        assert stopped.closed  # declared dead meanwhile, and replaced on the next call
        with pytest.raises(ThreadNotFound):
            await s.resume_thread(gone.thread_id, ThreadSettings(developer_instructions=None))
        assert s.restarts == 1


# --- 4. owner-only private homes ----------------------------------------------------------------


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """The common default umask, whatever the test runner's (so the check means something)."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def check_owner_only(home: Path, rollout: Path) -> None:
    assert rollout.is_relative_to(home)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "config.toml").stat().st_mode) == 0o600
    assert list(home.glob("state_*.sqlite"))
    assert group_or_world_accessible(home) == []


def group_or_world_accessible(root: Path) -> list[str]:
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        if stat.S_IMODE(mode) & 0o077:
            found.append(f"{oct(stat.S_IMODE(mode))} {path.relative_to(root)}")
    return found


@pytest.mark.usefixtures("permissive_umask")
async def test_a_private_home_and_everything_codex_writes_there_are_owner_only(
    make_appserver_config: ConfigFactory, workspace: Path, tmp_path: Path
) -> None:
    config = make_appserver_config()
    async with AppServer.start(config) as server:
        thread = await server.start_thread(
            ThreadSettings(cwd=str(workspace), developer_instructions=DEV)
        )
        await server.run_turn(thread.thread_id, "private words")
    assert rollout_exists(thread.thread.path)
    check_owner_only(config.codex_home, Path(str(thread.thread.path)))

    # An existing private home is tightened too; the user's own home is left as it is.
    loose = tmp_path / "loose_home"
    loose.mkdir(mode=0o755)
    AppServerConfig.offline(loose, "http://127.0.0.1:9/v1").write()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    users = tmp_path / "users_codex"
    users.mkdir(mode=0o755)
    user_config = AppServerConfig.user(users)
    assert user_config.write() is None
    assert stat.S_IMODE(users.stat().st_mode) == 0o755
    assert user_config.umask is None


# --- 5. dynamic tool arguments are checked against the schema ----------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
ARG_VALUE = "ARGVALUE_never_logged_93b1"
INVALID_CALLS: list[tuple[dict[str, Any] | str, str]] = [
    ({"city": 5}, '$.city: expected type "string"'),
    ({}, '$: missing required ["city"]'),
    ({"city": ARG_VALUE, "extra": True}, "$: has properties the schema does not declare"),
    ({"city": ARG_VALUE, "days": 0}, "$.days: fails minimum 1"),
    ("[1, 2]", '$: expected type "object"'),
]


@pytest.fixture
def private_texts() -> set[str]:
    return {ARG_VALUE}


async def test_schema_violating_tool_calls_never_reach_the_host_function(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    calls: list[dict[str, Any]] = []

    async def weather(args: dict[str, Any]) -> str:
        calls.append(args)
        return f"Sunny in {args['city']}"

    thread = await appserver.start_thread(
        ThreadSettings(
            cwd=str(workspace), tools=[DynamicTool("lookup_weather", "Weather.", SCHEMA, weather)]
        )
    )
    replies = [
        Reply.function_call("lookup_weather", arguments, call_id=f"c_{i}")
        for i, (arguments, _) in enumerate(INVALID_CALLS)
    ]
    offline_model.script(
        *replies, Reply.function_call("lookup_weather", {"city": "Paris"}, call_id="c_ok")
    )
    items: list[dict[str, Any]] = []

    async def on_event(n: Notification) -> None:
        if n.method == "item/completed" and n.item_type == "dynamicToolCall" and n.item:
            items.append(n.item)

    result = await appserver.run_turn(thread.thread_id, "weather please", on_event=on_event)
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert calls == [{"city": "Paris"}]  # only the valid call ran
    outputs = {o["call_id"]: o["output"] for o in offline_model.requests[-1].function_call_outputs}
    for i, (_, problem) in enumerate(INVALID_CALLS):
        assert outputs[f"c_{i}"] == (
            f"invalid arguments for tool lookup_weather: {problem}; it was not run"
        )
        assert ARG_VALUE not in outputs[f"c_{i}"]
    assert outputs["c_ok"] == "Sunny in Paris"
    assert [item["success"] for item in items] == [False] * len(INVALID_CALLS) + [True]
