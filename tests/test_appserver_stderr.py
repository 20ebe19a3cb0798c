"""Codex's stderr reaches the logs as facts (level, length), its text only on opt-in (P1).

With ``RUST_LOG`` set, Codex traces request and tool content on stderr, and the drain runs
outside any turn's redaction context: by default no stderr text may reach a log record."""

from __future__ import annotations

import json
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from codex_turn.harness.appserver import AppServerClient, AppServerConfig, AppServerProcess

pytestmark = pytest.mark.anyio

STDERR_LINES = [
    "2026-05-01T10:00:00.123456Z ERROR codex_core::client: request failed PRIVATE_PROMPT_91",
    "\x1b[2m2026-05-01T10:00:00Z\x1b[0m \x1b[33m WARN\x1b[0m codex_core::tools: PRIVATE_TOOL_44",
    "2026-05-01T10:00:00Z TRACE codex_core: body PRIVATE_BODY_7 sk-abcdefghijklmnopqrstuvwx",
    "Error: fatal PRIVATE_FATAL_3",
    "a line without a level PRIVATE_PLAIN_5",
]
EXPECTED_LEVELS = ["ERROR", "WARN", "TRACE", "ERROR", None]

SERVER = r"""
import json, sys
lines = json.loads(sys.argv[1])
for raw in sys.stdin:
    msg = json.loads(raw)
    if msg.get("method") == "initialize":
        for text in lines:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
        result = {"userAgent": "fake/1", "codexHome": "/x"}
        sys.stdout.write(json.dumps({"id": msg["id"], "result": result}) + "\n")
        sys.stdout.flush()
"""


async def _drained_stderr_records(tmp_path: Path, **config: Any) -> list[MutableMapping[str, Any]]:
    script = tmp_path / "stderr_server.py"
    script.write_text(SERVER)
    cfg = AppServerConfig(
        codex_home=tmp_path / "home",
        write_config=False,
        command=(sys.executable, "-u", str(script), json.dumps(STDERR_LINES)),
        shutdown_timeout=2.0,
        **config,
    )
    with capture_logs() as records:
        async with AppServerClient.connect(cfg) as client:
            process = client.transport
            assert isinstance(process, AppServerProcess)
            with anyio.fail_after(5):  # the drain runs in the background: wait for it
                while process.stderr_lines < len(STDERR_LINES):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
    return [r for r in records if r["event"] == "appserver.stderr"]


async def test_stderr_text_is_not_logged_by_default(tmp_path: Path) -> None:
    with capture_logs() as everything:
        records = await _drained_stderr_records(tmp_path)
    assert [r["codex_level"] for r in records] == EXPECTED_LEVELS
    assert [r["chars"] for r in records] == [len(line) for line in STDERR_LINES]
    assert {r["log_level"] for r in records} == {"debug"}
    assert all("line" not in r for r in records)
    assert "PRIVATE" not in repr(everything)


async def test_stderr_text_is_logged_redacted_on_opt_in(tmp_path: Path) -> None:
    records = await _drained_stderr_records(tmp_path, log_stderr_text=True)
    assert [r["codex_level"] for r in records] == EXPECTED_LEVELS
    assert [r["log_level"] for r in records] == ["warning", "info", "info", "warning", "info"]
    lines = [r["line"] for r in records]
    assert "PRIVATE_PROMPT_91" in lines[0]
    assert "PRIVATE_BODY_7" in lines[2]
    assert "sk-abcdefghijklmnopqrstuvwx" not in repr(records)  # secrets are still scrubbed


FAILING_SERVER = r"""
import sys
sys.stderr.write("\x1b[2m2026-05-01T10:00:00.1Z\x1b[0m \x1b[31mERROR\x1b[0m codex_app_server: "
                 "Codex could not find bubblewrap on PATH\n")
sys.stderr.write("Error: failed to load config: api_key = sk-abcdefghijklmnopqrstuvwx\n")
sys.stderr.write("Stack backtrace:\n   0: <unknown>\n")
sys.exit(1)
"""


async def test_a_process_that_fails_to_start_says_why_in_its_own_words(tmp_path: Path) -> None:
    # Before its fix: "codex app-server failed to initialize: ... exited (exit code 1)", and
    # nothing of why, even with -vv.
    from codex_turn.harness.appserver import AppServerStartError

    script = tmp_path / "failing_server.py"
    script.write_text(FAILING_SERVER)
    cfg = AppServerConfig(
        codex_home=tmp_path / "home",
        write_config=False,
        command=(sys.executable, "-u", str(script)),
        shutdown_timeout=2.0,
    )
    with pytest.raises(AppServerStartError) as failed:
        async with AppServerClient.connect(cfg):
            pass
    message = str(failed.value)
    assert "exited (exit code 1); Codex said: Error: failed to load config: api_key = " in message
    assert "sk-abcdefghijklmnopqrstuvwx" not in message  # scrubbed
    assert "bubblewrap" not in message  # the fatal line, not the last error


def test_the_startup_reason_is_the_fatal_line_else_the_last_error_without_decoration() -> None:
    from codex_turn.harness.appserver.process import startup_reason

    lines = [
        "\x1b[2m2026-12-03T20:54:25.619113Z\x1b[0m \x1b[31mERROR\x1b[0m \x1b[2mcodex_app_server"
        "\x1b[0m\x1b[2m:\x1b[0m Invalid configuration; using defaults. config.toml:1:11: bad",
        "2026-12-03T20:54:25.619156Z ERROR codex_app_server: Codex could not find bubblewrap",
        "a line without a level",
    ]
    assert startup_reason(lines) == "Codex could not find bubblewrap"
    assert startup_reason(lines, config_only=True) == (
        "Invalid configuration; using defaults. config.toml:1:11: bad"
    )
    assert startup_reason(["INFO only", "x" * 999]) is None
    assert len(startup_reason(["Error: " + "y" * 999]) or "") == 300
