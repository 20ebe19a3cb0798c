"""Diagnostics (``feedback/upload``) against the real binary.

The offline binary cannot upload: a private home writes ``[feedback] enabled = false`` and
Codex answers ``-32600 sending feedback is disabled by configuration``. So this pins the
approval path (a denied or unanswered approval sends no ``feedback/upload`` and shows no
ids), the request Codex receives (valid against its schema) and the error surfaced when
feedback is disabled, through the Python API and ``codex-turn diagnostics``. A successful
upload's result shape is covered against the recorded protocol in tests/test_supervision.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn import cli
from codex_turn.fsm.supervision import DiagnosticsState
from codex_turn.harness.appserver import AppServer, AppServerConfig, ThreadSettings
from codex_turn.harness.diagnostics import (
    DiagnosticsDecision,
    DiagnosticsRequest,
    upload_diagnostics,
)
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.codex]

DISABLED = "sending feedback is disabled by configuration"


def feedback_requests(server: AppServer) -> list[dict[str, Any]]:
    return [m for m in server.sent if m.get("method") == "feedback/upload"]


def test_diagnostics_upload_only_on_approval_and_surface_codexs_refusal(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    workspace: Path,
    codex_schema: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = make_appserver_config()
    asked: list[DiagnosticsRequest] = []

    async def deny(request: DiagnosticsRequest) -> DiagnosticsDecision:
        asked.append(request)
        return DiagnosticsDecision.DENY

    async def approve(request: DiagnosticsRequest) -> DiagnosticsDecision:
        asked.append(request)
        return DiagnosticsDecision.APPROVE

    async def scenario() -> str:
        async with AppServer.start(config, record_sent=True) as server:
            thread = await server.start_thread(ThreadSettings(cwd=str(workspace)))
            offline_model.script(Reply.fixed("ok"))
            await server.run_turn(thread.thread_id, "hello", idle_timeout=30)

            denied = await upload_diagnostics(server, [thread.thread_id], approve=deny)
            assert (denied.outcome, denied.reason, denied.uploads) == (
                DiagnosticsState.WITHHELD,
                "denied",
                (),
            )
            assert asked == [DiagnosticsRequest(1, False, True, "bug")]
            assert feedback_requests(server) == []

            refused = await upload_diagnostics(
                server, [thread.thread_id], approve=approve, thread_only=True, reason="probe"
            )
            assert (refused.outcome, refused.reason, refused.uploads) == (
                DiagnosticsState.FAILED,
                "upload-failed",
                (),
            )
            assert refused.error is not None
            assert DISABLED in refused.error
            [sent] = feedback_requests(server)
            assert sent["params"] == {
                "classification": "bug",
                "threadId": thread.thread_id,
                "includeLogs": True,
                "reason": "probe",
            }
            counts = codex_schema.validate_sent(server.sent, {})
            assert counts["feedback/upload"] == 1
            return thread.thread_id

    thread_id = anyio.run(scenario)

    home = str(config.codex_home)
    base = ["diagnostics", "--thread", thread_id, "--codex-home", home, "--json"]
    assert cli.main(base) == cli.EXIT_NOT_OK  # no terminal to ask, no --yes: withheld
    withheld = json.loads(capsys.readouterr().out)
    assert withheld == {"outcome": "withheld", "reason": "ignored", "uploads": [], "error": None}
    assert cli.main([*base, "--yes"]) == cli.EXIT_NOT_OK
    failed = json.loads(capsys.readouterr().out)
    assert (failed["outcome"], failed["reason"], failed["uploads"]) == (
        "failed",
        "upload-failed",
        [],
    )
    assert DISABLED in failed["error"]
