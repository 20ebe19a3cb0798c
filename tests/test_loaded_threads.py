"""The client's ledger of loaded threads and the settings key a kept fork is matched by
(fast; resuming against the real binary is tests/test_resume_e2e.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from support.fake_appserver import FakeAppServer
from support.turns import temporary_session_file, turn_params

from codex_turn import TurnOutcome, run_codex_turn
from codex_turn.harness.appserver import (
    AppServerClient,
    AppServerConfig,
    LoadedThread,
    Notification,
    ThreadSettings,
    tool,
)
from codex_turn.harness.appserver.types import ThreadInfo, ThreadResult

BASE: dict[str, Any] = {
    "developer_instructions": "be brief",
    "cwd": "/w",
    "model": "m",
    "approval_policy": "never",
    "sandbox": "read-only",
    "approvals_reviewer": None,
    "service_tier": None,
}


@tool("lookup", "look up")
async def _lookup(args: Any) -> str:
    return "x"


#: One changed value per setting.
KEY_CASES: list[tuple[str, Any]] = [
    ("developer_instructions", "be verbose"),
    ("cwd", "/elsewhere"),
    ("model", "m2"),
    ("approval_policy", "on-request"),
    ("sandbox", "workspace-write"),
    ("approvals_reviewer", "user"),
    ("service_tier", "flex"),
    ("tools", [_lookup]),
    ("base_instructions", "be someone"),
    ("model_provider", "other"),
    ("personality", "friendly"),
    ("project_docs", False),
    ("config", {"hooks": {}}),
]


@pytest.mark.parametrize(("field", "other"), KEY_CASES)
def test_settings_key_changes_with_every_setting(field: str, other: Any) -> None:
    assert ThreadSettings(**BASE).key == ThreadSettings(**BASE).key
    assert ThreadSettings(**{**BASE, field: other}).key != ThreadSettings(**BASE).key


def test_the_key_cases_cover_every_setting() -> None:
    covered = {field for field, _ in KEY_CASES}
    assert covered == {field.name for field in attrs.fields(ThreadSettings)}


def _loaded(thread_id: str) -> LoadedThread:
    return LoadedThread(ThreadResult(thread=ThreadInfo(id=thread_id)), ThreadSettings(**BASE).key)


FAKE_SERVER = r"""
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("method") == "initialize":
        sys.stdout.write(json.dumps({"id": msg["id"], "result": {"userAgent": "fake/1"}}) + "\n")
        sys.stdout.flush()
"""


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[AppServerClient]:
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    config = AppServerConfig(
        codex_home=tmp_path / "home",
        write_config=False,
        command=("python3", "-u", str(script)),
        request_timeout=5.0,
        shutdown_timeout=2.0,
    )
    async with AppServerClient.connect(config) as c:
        yield c


def _compaction_item(method: str, thread_id: str) -> Notification:
    return Notification(
        method, {"threadId": thread_id, "item": {"type": "contextCompaction", "id": "c"}}
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("notification", "after"),
    [
        (_compaction_item("item/started", "t1"), "compacted"),
        (_compaction_item("item/completed", "t1"), "compacted"),
        (Notification("thread/compacted", {"threadId": "t1"}), "compacted"),
        (
            Notification(
                "thread/status/changed", {"threadId": "t1", "status": {"type": "notLoaded"}}
            ),
            "gone",
        ),
        (
            Notification(
                "thread/status/changed", {"threadId": "t1", "status": {"type": "systemError"}}
            ),
            "gone",
        ),
        (Notification("thread/closed", {"threadId": "t1"}), "gone"),
        (Notification("thread/settings/updated", {"threadId": "t1"}), "gone"),
        (Notification("thread/reverted", {"threadId": "t1"}), "gone"),
        (
            Notification("thread/status/changed", {"threadId": "t1", "status": {"type": "idle"}}),
            "unchanged",
        ),
        (
            Notification("item/completed", {"threadId": "t1", "item": {"type": "agentMessage"}}),
            "unchanged",
        ),
        (_compaction_item("item/completed", "t2"), "unchanged"),
    ],
)
async def test_the_ledger_follows_what_codex_says(
    client: AppServerClient, notification: Notification, after: str
) -> None:
    client.threads._loaded["t1"] = _loaded("t1")
    client._route(notification)
    loaded = client.loaded_thread("t1")
    if after == "gone":
        assert loaded is None
        assert not client.is_loaded("t1")
    elif after == "compacted":
        assert loaded is not None
        assert loaded.compacted
    else:
        assert loaded == _loaded("t1")


# --------------------------------------------------------------------------------------------
# Through the orchestrator, with the in-process fake (its ledger switched on)


@pytest.mark.anyio
async def test_the_transition_observer_sees_every_step_and_cannot_break_the_turn() -> None:
    from codex_turn import TurnHooks

    seen: list[str] = []

    def observer(entry: Any) -> None:
        seen.append(entry.trigger)
        if entry.trigger == "history_read":
            raise RuntimeError("a broken progress line")

    fake = FakeAppServer()
    with temporary_session_file("observer-") as path:
        result = await run_codex_turn(
            turn_params(path, "hi"), app_server=fake, hooks=TurnHooks(on_transition=observer)
        )
    assert result.outcome is TurnOutcome.COMPLETED
    assert seen == [entry.trigger for entry in result.trace]
    assert "history_read" in seen
