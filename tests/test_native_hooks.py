"""Native hooks in process: the trust hash, which events a thread gets, every answer the
table chooses (fail closed, no decision, allow-always, report mode), the relay client's
safe answers, and nothing of a call's content in the logs."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support.turns import turn_params

from codex_turn import InvalidTurnParams
from codex_turn.harness.appserver import hook_relay_client
from codex_turn.harness.appserver.native_hooks import (
    HookCall,
    HookEvent,
    HookVerdict,
    NativeHooks,
    serve_hook_relay,
    trusted_hash,
)

pytestmark = pytest.mark.anyio

SECRET = "tool-input-secret-91"


def test_the_trust_hash_is_the_one_codex_reported_for_the_same_hook() -> None:
    # hooks/list of codex 0.163 for {type: command, command: /tmp/rsprobe/hookrelay.sh,
    # timeout: 10} under PreToolUse, no matcher (the probe of tests/test_native_hooks_e2e.py).
    handler = {"type": "command", "command": "/tmp/rsprobe/hookrelay.sh", "timeout": 10}
    assert trusted_hash(HookEvent.PRE_TOOL_USE, {**handler, "async": False}) == (
        "sha256:5681b01bbc6acaf2daf85583ff975c778ad3097b3575535c13409156a5125f2e"
    )


async def _none(call: HookCall) -> HookVerdict | None:
    return None


ALL = dict.fromkeys(HookEvent, _none)


@pytest.mark.parametrize(
    ("policy", "listed", "permission_request"),
    [
        ("never", False, True),
        (None, False, False),
        ("on-request", False, False),
        ("on-request", True, True),
        ({"granular": {}}, False, False),
    ],
)
def test_permission_request_is_left_to_app_server_approvals_unless_asked_for(
    policy: Any, listed: bool, permission_request: bool
) -> None:
    events = NativeHooks(callbacks=ALL, permission_request=listed).events(policy)
    assert (HookEvent.PERMISSION_REQUEST in events) is permission_request
    assert HookEvent.PRE_TOOL_USE in events
    only = NativeHooks(callbacks={HookEvent.STOP: _none}).events("never")
    assert only == (HookEvent.STOP,)


def call(event: HookEvent, **extra: Any) -> HookCall:
    fields: dict[str, Any] = {
        "session_id": "s",
        "cwd": "/w",
        "tool_name": "Bash",
        "tool_input": {"command": SECRET},
        "tool_use_id": "call_1",
    }
    fields.update(extra)
    return HookCall(event=event, **fields)


async def answers(hooks: NativeHooks, *calls: HookCall) -> list[dict[str, Any]]:
    async with serve_hook_relay(hooks) as relay:
        return [await relay.answer(c) for c in calls]


async def test_a_failed_or_late_pre_tool_use_callback_blocks_the_tool() -> None:
    async def late(_: HookCall) -> HookVerdict:
        await anyio.sleep(5)
        return HookVerdict.allow()

    async def broken(_: HookCall) -> HookVerdict:
        raise RuntimeError(SECRET)

    for callback in (late, broken):
        hooks = NativeHooks(
            callbacks={HookEvent.PRE_TOOL_USE: callback, HookEvent.PERMISSION_REQUEST: callback},
            timeout=0.05,
        )
        with capture_logs() as logs:
            pre, permission = await answers(
                hooks, call(HookEvent.PRE_TOOL_USE), call(HookEvent.PERMISSION_REQUEST)
            )
        assert pre["hookSpecificOutput"]["permissionDecision"] == "deny"
        assert permission == {}  # no decision is never an allow
        assert SECRET not in json.dumps(logs, default=str)


async def test_only_an_explicit_verdict_decides() -> None:
    async def deny(_: HookCall) -> HookVerdict:
        return HookVerdict.deny("no")

    async def allow(_: HookCall) -> HookVerdict:
        return HookVerdict.allow()

    none = NativeHooks(callbacks=ALL)
    assert await answers(none, *(call(event) for event in HookEvent)) == [{}] * 4
    denying = NativeHooks(callbacks=dict.fromkeys(HookEvent, deny))
    pre, post, permission, stop = await answers(denying, *(call(e) for e in HookEvent))
    assert pre == {
        "hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": "no",
        }
    }
    assert post == {}
    assert permission == {
        "hookSpecificOutput": {
            "hookEventName": "PermissionRequest",
            "decision": {"behavior": "deny", "message": "no"},
        }
    }
    assert stop == {"decision": "block", "reason": "no"}
    allowing = NativeHooks(callbacks=dict.fromkeys(HookEvent, allow))
    pre, _, permission, _ = await answers(allowing, *(call(e) for e in HookEvent))
    assert pre == {}  # Codex takes no "allow" from a PreToolUse: the tool simply runs
    assert permission["hookSpecificOutput"]["decision"] == {"behavior": "allow"}


async def test_allow_always_holds_for_the_exact_fingerprint_within_its_window() -> None:
    asked: list[HookCall] = []

    async def allow_always(c: HookCall) -> HookVerdict:
        asked.append(c)
        return HookVerdict.allow(always=True)

    hooks = NativeHooks(callbacks={HookEvent.PERMISSION_REQUEST: allow_always})
    first = call(HookEvent.PERMISSION_REQUEST)
    results = await answers(
        hooks,
        first,
        call(HookEvent.PERMISSION_REQUEST, tool_use_id="call_2"),  # same fingerprint
        call(HookEvent.PERMISSION_REQUEST, cwd="/other"),
        call(HookEvent.PERMISSION_REQUEST, tool_input={"command": "other"}),
        call(HookEvent.PERMISSION_REQUEST, session_id="s2"),
    )
    assert all(r["hookSpecificOutput"]["decision"] == {"behavior": "allow"} for r in results)
    assert len(asked) == 4  # the repeat was not asked again; every change was
    expired = NativeHooks(
        callbacks={HookEvent.PERMISSION_REQUEST: allow_always}, allow_always_window=0
    )
    asked.clear()
    await answers(expired, first, first)
    assert len(asked) == 2


async def test_report_mode_defers_an_approval_to_the_app_server_request() -> None:
    async def ask(_: HookCall) -> HookVerdict:
        return HookVerdict.ask()

    hooks = NativeHooks(callbacks={HookEvent.PRE_TOOL_USE: ask}, report_mode=True)
    async with serve_hook_relay(hooks) as relay:
        assert await relay.answer(call(HookEvent.PRE_TOOL_USE)) == {}
        deferred = relay.deferred_approval("call_1")
        assert deferred is not None
        assert deferred.tool_input == {"command": SECRET}
        assert relay.deferred_approval("call_1") is None
    # Asked for approval with no approval to wait for (not in report mode, or a call that
    # names no tool use): the tool is blocked, never let through undecided.
    plain = NativeHooks(callbacks={HookEvent.PRE_TOOL_USE: ask})
    untraced = call(HookEvent.PRE_TOOL_USE, tool_use_id=None)
    for answer in [
        *await answers(plain, call(HookEvent.PRE_TOOL_USE)),
        *await answers(hooks, untraced),
    ]:
        assert answer["hookSpecificOutput"]["permissionDecision"] == "deny"
    # Report mode needs app-server approvals to hand the decision to.
    async with serve_hook_relay(hooks) as relay:
        with pytest.raises(InvalidTurnParams, match="report-mode native hooks"):
            turn_params("s.jsonl", "hi", native_hooks=relay, approval_policy="never")


def test_a_hook_timeout_is_finite() -> None:
    for bad in (float("inf"), float("nan"), 0.0, 1e9):
        with pytest.raises(ValueError, match="timeout"):
            NativeHooks(callbacks={}, timeout=bad)


def run_client(socket_path: str, payload: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-I", hook_relay_client.__file__, socket_path, "5"],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stderr == ""
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def test_the_relay_client_answers_safely_when_the_host_is_gone(tmp_path: Any) -> None:
    gone = str(tmp_path / "nobody.sock")
    blocked = run_client(gone, {"hook_event_name": "PreToolUse", "tool_input": {}})
    assert blocked["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert run_client(gone, {"hook_event_name": "PermissionRequest"}) == {}
    assert run_client(gone, {"hook_event_name": "Stop"}) == {}


async def test_the_relay_client_carries_a_call_to_the_callback_and_back() -> None:
    seen: list[HookCall] = []

    async def deny(c: HookCall) -> HookVerdict:
        seen.append(c)
        return HookVerdict.deny("host says no")

    payload = {
        "hook_event_name": "PreToolUse",
        "session_id": "s",
        "tool_name": "Bash",
        "tool_input": {"command": "rm -rf x"},
        "tool_use_id": "call_9",
        "cwd": "/w",
    }
    async with serve_hook_relay(NativeHooks(callbacks={HookEvent.PRE_TOOL_USE: deny})) as relay:
        answer = await anyio.to_thread.run_sync(run_client, relay.socket_path, payload)
        assert relay.command.split()[-2] == relay.socket_path
    assert answer["hookSpecificOutput"]["permissionDecisionReason"] == "host says no"
    assert seen[0].tool_input == {"command": "rm -rf x"}
    assert seen[0].tool_use_id == "call_9"


def test_hook_notifications_become_hook_run_events_without_their_text() -> None:
    from codex_turn.harness.appserver import Notification
    from codex_turn.harness.turn.streaming import HookRun, events_of

    run = {  # hook/completed as codex 0.163 sent it (tests/test_native_hooks_e2e.py)
        "id": "pre-tool-use:0:/<session-flags>/config.toml:call_1",
        "eventName": "preToolUse",
        "handlerType": "command",
        "executionMode": "sync",
        "scope": "turn",
        "source": "sessionFlags",
        "status": "blocked",
        "durationMs": 3,
        "entries": [{"kind": "feedback", "text": SECRET}],
    }
    note = Notification("hook/completed", {"threadId": "t", "turnId": "u", "run": run})
    [pending] = events_of(note)
    event = pending(7, 11)
    assert event == HookRun(
        seq=7,
        monotonic_ns=11,
        phase="completed",
        run_id=run["id"],
        event_name="preToolUse",
        status="blocked",
        source="sessionFlags",
        duration_ms=3,
        entries=1,
    )
    assert SECRET not in repr(event)
    assert events_of(Notification("hook/started", {"threadId": "t", "run": None})) == []
