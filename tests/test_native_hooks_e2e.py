"""Native hooks against the real binary: per-thread hook config relayed to host callbacks.

One session pins what Codex does with the config a thread is started with: ``hooks/list``
does not show the session-flags layer (it lists the home's), an untrusted hook never runs
(the trust hash :func:`trusted_hash` computes is Codex's: it runs), each call reaches the
typed callback, a deny blocks the tool (the model is told why), PostToolUse and Stop are
seen, ``hook/started`` / ``hook/completed`` become :class:`HookRun` events; with app-server
approvals on, PermissionRequest is injected only when asked for, and an explicit allow or
deny answers the permission without the app-server approval being asked; in report mode a
PreToolUse that wants the host's approval gets no native decision and the app-server
approval for the same tool use finds it recorded; a session's turn carries the relay
(``TurnParams.native_hooks``) and streams the runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from codex_turn import TurnEventStream, TurnOutcome, TurnParams, run_codex_turn
from codex_turn.harness.appserver import (
    ApprovalDecision,
    ApprovalRequest,
    AppServer,
    AppServerConfig,
    ThreadSettings,
    TurnRequestHandlers,
)
from codex_turn.harness.appserver.native_hooks import (
    HookCall,
    HookEvent,
    HookVerdict,
    NativeHooks,
    serve_hook_relay,
)
from codex_turn.harness.turn.streaming import HookRun, events_of
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]


def exec_call(cmd: str, **extra: Any) -> Reply:
    return Reply.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 500, **extra})


async def test_hooks_are_injected_per_thread_relayed_and_answered_explicitly(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    workspace: Path,
    tmp_path: Path,
) -> None:
    calls: list[HookCall] = []

    async def pre_tool_use(call: HookCall) -> HookVerdict | None:
        calls.append(call)
        if "forbidden" in str(call.tool_input):
            return HookVerdict.deny("the host forbids it")
        return None

    async def permission(call: HookCall) -> HookVerdict | None:
        calls.append(call)
        if "allowed_file" in str(call.tool_input):
            return HookVerdict.allow()
        return HookVerdict.deny("no writes here")

    async def observe(call: HookCall) -> HookVerdict | None:
        calls.append(call)
        return None

    hooks = NativeHooks(
        callbacks={
            HookEvent.PRE_TOOL_USE: pre_tool_use,
            HookEvent.POST_TOOL_USE: observe,
            HookEvent.PERMISSION_REQUEST: permission,
            HookEvent.STOP: observe,
        },
        timeout=20,
    )
    notes: list[Any] = []
    async with (
        serve_hook_relay(hooks) as relay,
        AppServer.start(make_appserver_config(), record_sent=True) as server,
    ):
        server.add_listener(notes.append)
        # With approvals on, PermissionRequest is left out unless asked for.
        assert "PermissionRequest" not in relay.thread_config("on-request")["hooks"]
        config = relay.thread_config("never")
        thread = await server.start_thread(ThreadSettings(cwd=str(workspace)), config=config)
        listed = await server.request("hooks/list", {"cwds": [str(workspace)]})
        assert listed["data"][0]["hooks"] == []  # the session-flags layer is not listed

        offline_model.script(exec_call("echo hooked-ok"), Reply.fixed("ran it"))
        await server.run_turn(thread.thread_id, "run a tool", idle_timeout=30)
        offline_model.script(exec_call("echo forbidden-thing"), Reply.fixed("blocked"))
        await server.run_turn(thread.thread_id, "run another", idle_timeout=30)

        seen = [(c.event, c.tool_name, c.tool_input) for c in calls]
        assert seen == [
            (HookEvent.PRE_TOOL_USE, "Bash", {"command": "echo hooked-ok"}),
            (HookEvent.POST_TOOL_USE, "Bash", {"command": "echo hooked-ok"}),
            (HookEvent.STOP, None, None),
            (HookEvent.PRE_TOOL_USE, "Bash", {"command": "echo forbidden-thing"}),
            (HookEvent.STOP, None, None),
        ]
        assert calls[1].tool_response == "hooked-ok\n"
        assert calls[0].session_id == thread.thread_id
        assert calls[2].last_assistant_message == "ran it"
        outputs = offline_model.turn_requests()[-1].function_call_outputs
        assert "the host forbids it" in str(outputs[-1])
        runs = [
            event(0, 0)
            for note in notes
            if note.method.startswith("hook/")
            for event in events_of(note)
        ]
        assert all(isinstance(run, HookRun) for run in runs)
        completed = [(r.event_name, r.status) for r in runs if r.phase == "completed"]
        assert completed == [
            ("preToolUse", "completed"),
            ("postToolUse", "completed"),
            ("stop", "completed"),
            ("preToolUse", "blocked"),
            ("stop", "completed"),
        ]
        assert {r.source for r in runs} == {"sessionFlags"}

        # Without its trust state the same config runs nothing: Codex checks the hash.
        calls.clear()
        untrusted = {"hooks": {k: v for k, v in config["hooks"].items() if k != "state"}}
        bare = await server.start_thread(ThreadSettings(cwd=str(workspace)), config=untrusted)
        offline_model.script(exec_call("echo untrusted"), Reply.fixed("ok"))
        await server.run_turn(bare.thread_id, "run a tool", idle_timeout=30)
        assert calls == []

        # Approvals on, PermissionRequest asked for: an explicit allow or deny answers it,
        # and the app-server approval is never asked.
        calls.clear()
        asked = NativeHooks(callbacks=hooks.callbacks, timeout=20, permission_request=True)
        relay.hooks = asked
        on_request = relay.thread_config("on-request")
        assert "PermissionRequest" in on_request["hooks"]
        guarded = await server.start_thread(
            ThreadSettings(cwd=str(workspace), approval_policy="on-request"), config=on_request
        )
        escalate = {"sandbox_permissions": "require_escalated", "justification": "write?"}
        offline_model.script(
            exec_call("touch allowed_file && echo wrote", **escalate),
            exec_call("touch denied_file", **escalate),
            Reply.fixed("done"),
        )
        await server.run_turn(guarded.thread_id, "write two files", idle_timeout=30)
        permissions = [c for c in calls if c.event is HookEvent.PERMISSION_REQUEST]
        assert len(permissions) == 2
        assert (workspace / "allowed_file").exists()
        assert not (workspace / "denied_file").exists()
        assert "no writes here" in str(offline_model.turn_requests()[-1].function_call_outputs)
        assert server.server_requests == {}  # no app-server approval was asked

        # Report mode: a PreToolUse the host wants approved gets no native decision; the
        # app-server approval Codex then sends for the same tool use finds it recorded.
        async def wants_approval(call: HookCall) -> HookVerdict:
            calls.append(call)
            return HookVerdict.ask()

        approvals: list[tuple[str | None, HookCall | None]] = []

        async def on_approval(request: ApprovalRequest) -> ApprovalDecision:
            approvals.append((request.item_id, relay.deferred_approval(request.item_id or "")))
            return ApprovalDecision.APPROVE

        calls.clear()
        relay.hooks = NativeHooks(
            callbacks={HookEvent.PRE_TOOL_USE: wants_approval}, timeout=20, report_mode=True
        )
        reported = await server.start_thread(
            ThreadSettings(cwd=str(workspace), approval_policy="on-request"),
            config=relay.thread_config("on-request"),
        )
        offline_model.script(exec_call("touch reported_file", **escalate), Reply.fixed("ok"))
        async with server.turn(
            reported.thread_id,
            "write it",
            handlers=TurnRequestHandlers(on_approval=on_approval),
        ) as handle:
            await handle.collect(idle_timeout=30)
        [(item_id, deferred)] = approvals
        assert deferred is not None
        assert deferred.tool_use_id == item_id
        assert deferred.tool_input == {"command": "touch reported_file"}
        assert (workspace / "reported_file").exists()

        # A turn of a session: the relay rides on TurnParams, the hook runs on its stream.
        calls.clear()
        relay.hooks = hooks
        events = TurnEventStream()
        params = TurnParams(
            session_id="hooked",
            session_file=tmp_path / "hooked.jsonl",
            workspace_dir=workspace,
            prompt="one more tool",
            approval_policy="never",
            native_hooks=relay,
        )
        offline_model.script(exec_call("echo via-turn"), Reply.fixed("turn done"))
        result = await run_codex_turn(params, app_server=server, events=events)
        streamed = [event async for event in events]
        assert result.outcome is TurnOutcome.COMPLETED
        assert [c.event for c in calls] == [
            HookEvent.PRE_TOOL_USE,
            HookEvent.POST_TOOL_USE,
            HookEvent.STOP,
        ]
        hook_runs = [e for e in streamed if isinstance(e, HookRun) and e.phase == "completed"]
        assert [r.event_name for r in hook_runs] == ["preToolUse", "postToolUse", "stop"]


async def test_a_thread_resumed_in_a_new_process_gets_its_hooks_back(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    workspace: Path,
) -> None:
    """Codex keeps no session flags across processes: ``thread/resume`` takes the config
    again (what a turn's resume sends, ``ThreadSettings.config``)."""
    seen: list[HookEvent] = []

    async def observe(call: HookCall) -> HookVerdict | None:
        seen.append(call.event)
        return None

    config = make_appserver_config()
    async with serve_hook_relay(NativeHooks(callbacks={HookEvent.PRE_TOOL_USE: observe})) as relay:
        async with AppServer.start(config) as server:
            thread = await server.start_thread(ThreadSettings(cwd=str(workspace)))
            await server.run_turn(thread.thread_id, "hello", idle_timeout=30)
        async with AppServer.start(make_appserver_config(codex_home=config.codex_home)) as server:
            settings = ThreadSettings(cwd=str(workspace), config=relay.thread_config("never"))
            await server.resume_thread(thread.thread_id, settings)
            offline_model.script(exec_call("echo resumed"), Reply.fixed("ok"))
            await server.run_turn(thread.thread_id, "a tool", idle_timeout=30)
    assert seen == [HookEvent.PRE_TOOL_USE]
