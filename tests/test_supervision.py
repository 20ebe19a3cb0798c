"""Supervision and diagnostics against a recorded-protocol fake: the rows the offline binary
cannot show (an active source or descendant, a cycle, an exhausted limit, a failed step, an
approved upload) and the bounds of the branch's history."""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn.fsm.supervision import (
    ArchiveState,
    BranchState,
    DiagnosticsState,
    NativeStatus,
    native_status,
)
from codex_turn.harness.appserver import AppServerRpcError, ThreadSettings
from codex_turn.harness.appserver.types import ThreadInfo, ThreadResult
from codex_turn.harness.binding import read_binding
from codex_turn.harness.diagnostics import (
    DiagnosticsDecision,
    DiagnosticsRequest,
    upload_diagnostics,
)
from codex_turn.harness.supervision import (
    ArchiveLimits,
    BranchLimits,
    archive_native_thread,
    bind_branch,
    branch_native_thread,
    visible_history,
)
from codex_turn.harness.turn.executors import thread_settings

pytestmark = pytest.mark.anyio


def thread(thread_id: str, status: str = "notLoaded", **extra: Any) -> dict[str, Any]:
    return {
        "id": thread_id,
        "sessionId": f"session-{thread_id}",
        "status": {"type": status, **({"activeFlags": []} if status == "active" else {})},
        "model": "gpt-x",
        "modelProvider": "prov",
        "cwd": "/work",
        "preview": "hi",
        **extra,
    }


def turn(turn_id: str, status: str, *items: dict[str, Any]) -> dict[str, Any]:
    return {"id": turn_id, "status": status, "items": list(items)}


def user(text: str) -> dict[str, Any]:
    return {"type": "userMessage", "content": [{"type": "text", "text": text}]}


def agent(text: str) -> dict[str, Any]:
    return {"type": "agentMessage", "text": text}


class FakePort:
    """Answers as Codex 0.163 did in the recorded sessions (tests/test_supervision_e2e.py)."""

    def __init__(
        self,
        threads: Mapping[str, dict[str, Any]],
        *,
        descendants: Sequence[Sequence[dict[str, Any]]] = ((),),
        turns: Sequence[dict[str, Any]] = (),
        fail: Mapping[str, str] | None = None,
    ) -> None:
        self.threads = dict(threads)
        self.descendant_pages = list(descendants)
        self.turns = list(turns)
        self.fail = dict(fail or {})
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.forgotten: list[str] = []

    def _maybe_fail(self, method: str) -> None:
        if method in self.fail:
            raise AppServerRpcError(-32600, self.fail[method], method=method)

    async def request(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        params = dict(params or {})
        self.sent.append((method, params))
        self._maybe_fail(method)
        if method == "thread/read":
            return {"thread": self.threads[params["threadId"]]}
        if method == "thread/list":
            page = int(params.get("cursor") or 0)
            rows = self.descendant_pages[page] if params.get("ancestorThreadId") else []
            more = page + 1 < len(self.descendant_pages) and params.get("ancestorThreadId")
            return {"data": list(rows), "nextCursor": str(page + 1) if more else None}
        if method == "thread/turns/list":
            return {"data": self.turns, "nextCursor": None}
        if method == "thread/fork":
            return {"thread": thread("fork-1", "idle"), "model": "gpt-x", "modelProvider": "prov"}
        if method in ("thread/archive", "feedback/upload"):
            return {} if method == "thread/archive" else {"threadId": params["threadId"]}
        raise AssertionError(method)

    async def start_thread(self, settings: ThreadSettings) -> ThreadResult:
        self.sent.append(("thread/start", {"settings": settings}))
        self._maybe_fail("thread/start")
        return ThreadResult(thread=ThreadInfo(id="new-1"), model=settings.model)

    async def inject_items(self, thread_id: str, items: Sequence[Mapping[str, Any]]) -> None:
        self.sent.append(("thread/inject_items", {"threadId": thread_id, "items": list(items)}))
        self._maybe_fail("thread/inject_items")

    def forget_thread(self, thread_id: str) -> None:
        self.forgotten.append(thread_id)

    def methods(self) -> list[str]:
        return [method for method, _ in self.sent]


# --- statuses ---------------------------------------------------------------------------------


def test_a_status_codex_does_not_name_is_unknown_never_idle() -> None:
    assert native_status({"type": "idle"}) is NativeStatus.IDLE
    assert native_status({"type": "active", "activeFlags": []}) is NativeStatus.ACTIVE
    assert native_status({"type": "notLoaded"}) is NativeStatus.NOT_LOADED
    assert native_status({"type": "sleeping"}) is NativeStatus.UNKNOWN
    assert native_status(None) is NativeStatus.UNKNOWN


# --- archive ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "confirm", "reason"),
    [
        ("active", True, "target-active"),
        ("active", False, "target-active"),
        ("idle", False, "needs-confirmation"),
        ("notLoaded", False, "needs-confirmation"),
        ("systemError", False, "needs-confirmation"),
    ],
)
async def test_archive_refuses_an_active_or_unconfirmed_target_before_anything_else(
    status: str, confirm: bool, reason: str
) -> None:
    port = FakePort({"t": thread("t", status)})
    result = await archive_native_thread(port, "t", confirm=confirm)
    assert (result.outcome, result.reason) == (ArchiveState.REFUSED, reason)
    assert port.methods() == ["thread/read"]


async def test_archive_checks_every_page_of_descendants_and_an_active_one_blocks() -> None:
    pages = [[thread("d1", "idle")], [thread("d2", "active")]]
    port = FakePort({"t": thread("t", "idle")}, descendants=pages)
    result = await archive_native_thread(port, "t", confirm=True)
    assert (result.outcome, result.reason, result.descendants) == (
        ArchiveState.REFUSED,
        "descendant-active",
        2,
    )
    assert "thread/archive" not in port.methods()
    cursors = [p.get("cursor") for m, p in port.sent if m == "thread/list"]
    assert cursors == [None, "1"]


@pytest.mark.parametrize(
    ("pages", "limits", "reason"),
    [
        ([[thread("t", "idle")]], ArchiveLimits(), "cycle"),
        ([[thread("d1")], [thread("d1")]], ArchiveLimits(), "cycle"),
        ([[thread("d1"), thread("d2")]], ArchiveLimits(max_descendants=1), "safety-limit"),
        (
            [[thread("d1")], [thread("d2")], [thread("d3")]],
            ArchiveLimits(max_pages=2),
            "safety-limit",
        ),
    ],
)
async def test_archive_fails_closed_on_a_cycle_or_an_exhausted_limit(
    pages: list[list[dict[str, Any]]], limits: ArchiveLimits, reason: str
) -> None:
    port = FakePort({"t": thread("t", "idle")}, descendants=pages)
    result = await archive_native_thread(port, "t", confirm=True, limits=limits)
    assert (result.outcome, result.reason) == (ArchiveState.FAILED, reason)
    assert "thread/archive" not in port.methods()


async def test_archive_fails_closed_when_a_thread_cannot_be_read_or_listed() -> None:
    unreadable = FakePort({"t": thread("t", "idle")}, fail={"thread/read": "boom"})
    result = await archive_native_thread(unreadable, "t", confirm=True)
    assert (result.outcome, result.reason) == (ArchiveState.FAILED, "target-unreadable")
    unlistable = FakePort({"t": thread("t", "idle")}, fail={"thread/list": "boom"})
    result = await archive_native_thread(unlistable, "t", confirm=True)
    assert (result.outcome, result.reason) == (ArchiveState.FAILED, "enumeration-failed")
    assert "thread/archive" not in unlistable.methods()


async def test_archive_with_confirmation_and_quiet_descendants_archives() -> None:
    port = FakePort({"t": thread("t", "idle")}, descendants=[[thread("d1", "notLoaded")]])
    result = await archive_native_thread(port, "t", confirm=True)
    assert (result.outcome, result.descendants) == (ArchiveState.ARCHIVED, 1)
    assert port.sent[-1] == ("thread/archive", {"threadId": "t"})


# --- branch -----------------------------------------------------------------------------------


def test_the_visible_history_stops_at_the_last_terminal_turn_and_keeps_the_newest() -> None:
    turns = [
        turn("1", "completed", user("a"), {"type": "reasoning", "summary": ["r"]}, agent("A")),
        turn("2", "interrupted", user("b"), {"type": "commandExecution", "command": "x"}),
        turn("3", "completed", user("c"), agent("C")),
        turn("4", "inProgress", user("d")),
    ]
    last, messages = visible_history(turns, BranchLimits())
    assert last == "3"
    assert [(m.role, m.text) for m in messages] == [
        ("user", "a"),
        ("assistant", "A"),
        ("user", "b"),
        ("user", "c"),
        ("assistant", "C"),
    ]
    _, bounded = visible_history(turns, BranchLimits(max_messages=2))
    assert [m.text for m in bounded] == ["c", "C"]
    _, by_chars = visible_history(
        [turn("1", "completed", user("x" * 10), agent("y" * 10))], BranchLimits(max_chars=15)
    )
    assert [m.text for m in by_chars] == ["y" * 10]
    assert visible_history([turn("1", "inProgress", user("d"))], BranchLimits()) == (None, [])


async def test_an_active_source_is_never_forked_nor_resumed() -> None:
    port = FakePort({"s": thread("s", "active")}, turns=[turn("1", "completed", user("a"))])
    result = await branch_native_thread(port, "s")
    assert (result.outcome, result.reason) == (BranchState.REFUSED, "source-active")
    assert port.methods() == ["thread/read", "thread/turns/list"]


async def test_a_source_without_a_terminal_turn_is_refused() -> None:
    port = FakePort({"s": thread("s", "idle")}, turns=[turn("1", "inProgress", user("a"))])
    result = await branch_native_thread(port, "s")
    assert (result.outcome, result.reason) == (BranchState.REFUSED, "no-terminal-turn")
    assert "thread/fork" not in port.methods()


@pytest.mark.parametrize(
    ("failing", "reason"),
    [("thread/start", "start-failed"), ("thread/inject_items", "inject-failed")],
)
async def test_a_failed_branch_still_archives_its_temporary_fork(failing: str, reason: str) -> None:
    port = FakePort(
        {"s": thread("s", "idle")},
        turns=[turn("1", "completed", user("a"), agent("A"))],
        fail={failing: "refused"},
    )
    result = await branch_native_thread(port, "s")
    assert (result.outcome, result.reason) == (BranchState.FAILED, reason)
    assert result.fork_archived
    assert result.fork_thread_id == "fork-1"
    assert ("thread/archive", {"threadId": "fork-1"}) in port.sent
    assert port.forgotten == ["fork-1"]
    assert result.error is not None
    assert "refused" in result.error


async def test_the_branch_pins_the_fork_model_and_binds_a_supervised_session(
    tmp_path: Path,
) -> None:
    port = FakePort({"s": thread("s", "idle")}, turns=[turn("t1", "completed", user("a"))])
    result = await branch_native_thread(port, "s", cwd="/elsewhere")
    assert result.branched
    fork = dict(port.sent)["thread/fork"]
    assert fork == {"threadId": "s", "lastTurnId": "t1", "excludeTurns": True}
    settings = dict(port.sent)["thread/start"]["settings"]
    assert (settings.model, settings.model_provider, settings.cwd) == (
        "gpt-x",
        "prov",
        "/elsewhere",
    )
    session = tmp_path / "s.jsonl"
    bind_branch(session, result, session_id="sess")
    binding = read_binding(session, session_id="sess")
    assert binding is not None
    assert binding.supervised is True
    assert (binding.thread_id, binding.model, binding.model_provider) == ("new-1", "gpt-x", "prov")


def test_a_supervised_binding_resumes_without_a_model_of_its_own(tmp_path: Path) -> None:
    from codex_turn.harness.binding import ThreadBinding

    def ctx(binding: ThreadBinding | None) -> Any:
        params = types.SimpleNamespace(
            workspace_dir=tmp_path,
            model="picked-model",
            approvals_reviewer=None,
            service_tier=None,
            native_hooks=None,
            approval_policy=None,
            tool_catalog="flat",
            lightweight=False,
        )
        plan = types.SimpleNamespace(instructions="i")
        return types.SimpleNamespace(params=params, plan=plan, tools=(), binding=binding)

    supervised = ThreadBinding(thread_id="t", supervised=True, model="gpt-x")
    assert thread_settings(ctx(supervised)).model is None
    assert "model" not in thread_settings(ctx(supervised)).wire("thread/resume")
    assert thread_settings(ctx(ThreadBinding(thread_id="t"))).model == "picked-model"
    assert thread_settings(ctx(None)).model == "picked-model"


# --- diagnostics ------------------------------------------------------------------------------


async def _deny(_: DiagnosticsRequest) -> DiagnosticsDecision:
    return DiagnosticsDecision.DENY


async def _silent(_: DiagnosticsRequest) -> None:
    return None


async def _broken(_: DiagnosticsRequest) -> DiagnosticsDecision:
    raise RuntimeError("the host's dialog crashed")


async def _slow(_: DiagnosticsRequest) -> DiagnosticsDecision:
    await anyio.sleep(10)
    return DiagnosticsDecision.APPROVE


@pytest.mark.parametrize(
    ("approve", "reason"),
    [(_deny, "denied"), (_silent, "ignored"), (_broken, "ignored"), (_slow, "ignored")],
)
async def test_diagnostics_without_an_explicit_approval_upload_nothing_and_show_no_ids(
    approve: Any, reason: str
) -> None:
    port = FakePort({"t": thread("t", "idle")}, descendants=[[thread("sub", "idle")]])
    result = await upload_diagnostics(port, ["t"], approve=approve, approval_timeout=0.05)
    assert (result.outcome, result.reason, result.uploads) == (
        DiagnosticsState.WITHHELD,
        reason,
        (),
    )
    assert "feedback/upload" not in port.methods()


async def test_approved_diagnostics_upload_each_thread_and_its_subthreads() -> None:
    asked: list[DiagnosticsRequest] = []

    async def approve(request: DiagnosticsRequest) -> DiagnosticsDecision:
        asked.append(request)
        return DiagnosticsDecision.APPROVE

    port = FakePort({"t": thread("t", "idle")}, descendants=[[thread("sub", "idle")]])
    result = await upload_diagnostics(port, ["t"], approve=approve, reason="it broke")
    assert asked == [DiagnosticsRequest(2, False, True, "bug")]
    assert result.outcome is DiagnosticsState.UPLOADED
    assert [(u.thread_id, u.session_id, u.resume_command) for u in result.uploads] == [
        ("t", "session-t", "codex resume t"),
        ("sub", "session-sub", "codex resume sub"),
    ]
    uploads = [p for m, p in port.sent if m == "feedback/upload"]
    assert uploads[0] == {
        "classification": "bug",
        "threadId": "t",
        "includeLogs": True,
        "reason": "it broke",
    }


async def test_thread_only_diagnostics_upload_the_current_thread_alone() -> None:
    async def approve(request: DiagnosticsRequest) -> DiagnosticsDecision:
        assert request.threads == 1
        assert request.thread_only
        return DiagnosticsDecision.APPROVE

    port = FakePort({"t": thread("t"), "u": thread("u")}, descendants=[[thread("sub")]])
    result = await upload_diagnostics(port, ["t", "u"], approve=approve, thread_only=True)
    assert [u.thread_id for u in result.uploads] == ["t"]
    assert "thread/list" not in port.methods()


async def test_a_refused_upload_surfaces_codexs_error() -> None:
    async def approve(_: DiagnosticsRequest) -> DiagnosticsDecision:
        return DiagnosticsDecision.APPROVE

    port = FakePort(
        {"t": thread("t")},
        fail={"feedback/upload": "sending feedback is disabled by configuration"},
    )
    result = await upload_diagnostics(port, ["t"], approve=approve)
    assert (result.outcome, result.reason, result.uploads) == (
        DiagnosticsState.FAILED,
        "upload-failed",
        (),
    )
    assert result.error is not None
    assert "disabled by configuration" in result.error
