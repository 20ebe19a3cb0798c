"""Compaction end to end: the REAL ``codex app-server`` 0.163.0 against the offline model.

Every assertion is about what the binary did, what it sent to the model, or what the CLI
printed: native compaction completes and Codex's next model request carries the summary; an
owning engine compacts first and native compaction then runs in a fresh process that has to
resume the thread; a slow compaction times out and is interrupted; an interrupt that is not
acknowledged in time retires the process; ``codex-turn compact`` prints the JSON result.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.recording_engine import RecordingEngine

from codex_turn.cli import main as cli_main
from codex_turn.harness.appserver import AppServer, AppServerConfig, CodexTurnStatus, ThreadSettings
from codex_turn.harness.binding import (
    ContextEngineBinding,
    ProjectionBinding,
    ThreadBinding,
    read_binding,
    write_binding,
)
from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session_traced
from codex_turn.harness.engine import CompactDetails, CompactResult
from codex_turn.harness.session import mirror_turn
from codex_turn.testing import OfflineModel, Reply

pytestmark = pytest.mark.both_backends

ConfigFactory = Callable[..., AppServerConfig]
DEV = "DEV_INSTR_MARKER_c0mp: keep answers short."
SUMMARY_PREFIX = "Another language model started to solve this problem"


def params(session_file: Path, workspace: Path, **overrides: Any) -> CompactSessionParams:
    values: dict[str, Any] = {
        "session_id": "session-e2e",
        "session_file": str(session_file),
        "workspace_dir": str(workspace),
        "current_token_count": 321,
        "developer_instructions": DEV,
        "native_timeout": 30.0,
    }
    values.update(overrides)
    return CompactSessionParams(**values)


async def first_turn(server: AppServer, workspace: Path, session_file: Path) -> str:
    thread = await server.start_thread(
        ThreadSettings(cwd=str(workspace), developer_instructions=DEV)
    )
    result = await server.run_turn(thread.thread_id, "first turn")
    assert result.outcome is CodexTurnStatus.COMPLETED
    write_binding(session_file, ThreadBinding(thread_id=thread.thread_id, cwd=str(workspace)))
    return thread.thread_id


@pytest.mark.anyio
async def test_native_compaction_completes_and_the_next_request_carries_the_summary(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    session = tmp_path / "session.jsonl"
    tid = await first_turn(appserver, workspace, session)
    run = await compact_codex_session_traced(params(session, workspace), app_server=appserver)

    assert run.result.ok
    assert run.result.compacted
    assert run.result.result is not None
    details = run.result.result.details
    assert details["backend"] == "codex-app-server"
    assert details["threadId"] == tid
    assert details["signal"] == "item/completed"  # 0.163 emits no thread/compacted
    assert run.native is not None
    assert details["turnId"] == run.native.turn_id
    assert isinstance(details["itemId"], str)
    assert run.result.result.tokens_before == 321
    assert run.path == ("IDLE", "NATIVE_COMPACTING", "REPORTED")
    assert len(offline_model.compaction_requests()) == 1

    after = await appserver.run_turn(tid, "after compaction")
    assert after.outcome is CodexTurnStatus.COMPLETED
    last = offline_model.requests[-1]
    assert not last.is_compaction
    summaries = [u for u in last.user_messages if u.startswith(SUMMARY_PREFIX)]
    assert len(summaries) == 1
    assert summaries[0].endswith("LOCAL_COMPACTED_SUMMARY_1")
    assert "ECHO: first turn" not in last.assistant_messages  # replaced by the summary
    assert last.developer_parts.count(DEV) == 1
    assert offline_model.proxy_attempts == []


def _engine_summary(_params: Any) -> CompactResult:
    return CompactResult(
        ok=True,
        compacted=True,
        result=CompactDetails(
            summary="engine summary",
            first_kept_entry_id="entry-9",
            tokens_before=900,
            tokens_after=90,
            details={"engine": "e2e"},
        ),
    )


def owning_engine() -> RecordingEngine:
    """Also the CLI's ``--engine`` target (a zero-argument factory)."""
    return RecordingEngine(
        engine_id="e2e-engine", owns_compaction=True, responses={"compact": _engine_summary}
    )


@pytest.mark.anyio
async def test_owning_engine_first_then_native_in_a_fresh_process_that_resumes(
    make_appserver_config: ConfigFactory,
    offline_model: OfflineModel,
    workspace: Path,
    tmp_path: Path,
) -> None:
    session = tmp_path / "session.jsonl"
    first = make_appserver_config()
    async with AppServer.start(first) as server:
        tid = await first_turn(server, workspace, session)
    projection = ProjectionBinding(mode="thread_bootstrap", epoch="epoch-1")
    binding = read_binding(session)
    assert binding is not None
    write_binding(
        session,
        ThreadBinding(
            thread_id=tid,
            cwd=str(workspace),
            context_engine=ContextEngineBinding(
                engine_id="e2e-engine", policy_fingerprint="p", projection=projection
            ),
        ),
    )
    engine = owning_engine()
    async with AppServer.start(
        make_appserver_config(codex_home=first.codex_home), record_sent=True
    ) as server:
        run = await compact_codex_session_traced(
            params(session, workspace), app_server=server, engine=engine
        )
        resume = next(m for m in server.sent if m.get("method") == "thread/resume")
        after = await server.run_turn(tid, "after engine compaction")
    assert resume["params"]["developerInstructions"] == DEV
    assert resume["params"]["excludeTurns"] is True
    assert run.path == (
        "IDLE",
        "ENGINE_COMPACTING",
        "COMPACTION_MAINTENANCE",
        "NATIVE_COMPACTING",
        "REPORTED",
    )
    assert engine.methods() == ["compact", "maintain"]
    result = run.result
    assert (result.ok, result.compacted) == (True, True)
    assert result.result is not None
    assert (result.result.summary, result.result.tokens_after) == ("engine summary", 90)
    native = result.result.details["codexNativeCompaction"]
    assert native["ok"] is True
    assert native["details"]["ownsCompaction"] is True
    assert native["details"]["threadId"] == tid
    cleared = read_binding(session)
    assert cleared is not None
    assert cleared.thread_id == tid
    assert cleared.context_engine is not None
    assert cleared.context_engine.projection is None
    # Codex itself compacted too, and kept the re-sent developer instructions.
    assert after.outcome is CodexTurnStatus.COMPLETED
    last = offline_model.requests[-1]
    assert any(u.endswith("LOCAL_COMPACTED_SUMMARY_1") for u in last.user_messages)
    assert last.developer_parts.count(DEV) == 1


async def _wait_disconnect(model: OfflineModel) -> None:
    with anyio.fail_after(5):
        while model.disconnects == 0:  # noqa: ASYNC110
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_a_slow_compaction_hits_the_timeout_and_is_interrupted(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    session = tmp_path / "session.jsonl"
    tid = await first_turn(appserver, workspace, session)
    offline_model.script(Reply.fixed("TOO LATE", delay=20), kind="compaction")
    process = appserver.current
    started = anyio.current_time()
    run = await compact_codex_session_traced(
        params(session, workspace, native_timeout=1.0, interrupt_grace=10.0),
        app_server=appserver,
    )
    elapsed = anyio.current_time() - started
    assert run.result.ok is False
    assert run.result.reason == f"timed out waiting for codex app-server compaction for {tid}"
    assert run.triggers == ("started", "native_timed_out")
    assert run.native is not None
    assert (run.native.interrupted, run.native.retired) == (True, False)
    assert 1.0 <= elapsed < 5.0  # the interrupt was acknowledged well within the grace
    interrupts = [m for m in appserver.sent if m.get("method") == "turn/interrupt"]
    assert [m["params"] for m in interrupts] == [{"threadId": tid, "turnId": run.native.turn_id}]
    await _wait_disconnect(offline_model)  # Codex dropped the model stream
    # Same process, thread still usable; the compaction was never retried as a prompt.
    assert appserver.current is process
    assert appserver.restarts == 0
    assert len(offline_model.compaction_requests()) == 1
    assert len(offline_model.turn_requests()) == 1
    again = await appserver.run_turn(tid, "still there?")
    assert again.final_text == "ECHO: still there?"


@pytest.mark.anyio
async def test_an_unacknowledged_interrupt_retires_the_process(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    session = tmp_path / "session.jsonl"
    tid = await first_turn(appserver, workspace, session)
    offline_model.script(Reply.fixed("TOO LATE", delay=20), kind="compaction")
    process = appserver.current
    assert process is not None
    run = await compact_codex_session_traced(
        params(session, workspace, native_timeout=0.5, interrupt_grace=0.0),
        app_server=appserver,
    )
    assert run.native is not None
    assert (run.native.interrupted, run.native.retired) == (True, True)
    assert run.result.reason == f"timed out waiting for codex app-server compaction for {tid}"
    # Retired before compact returned (so before the compaction lock was released): the
    # connection is closed and the process has exited.
    assert process.closed
    assert process.transport.returncode is not None
    assert [m["method"] for m in appserver.sent if m.get("method") == "turn/interrupt"] == [
        "turn/interrupt"
    ]
    again = await appserver.run_turn(tid, "after the restart")
    assert again.final_text == "ECHO: after the restart"
    assert appserver.restarts == 1
    assert appserver.current is not process


def test_cli_compact_prints_json_for_a_real_session(
    make_appserver_config: ConfigFactory,
    offline_model: OfflineModel,
    workspace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    session = tmp_path / "session.jsonl"
    session.write_text(
        json.dumps(
            {
                "type": "session",
                "version": 3,
                "id": "cli-session",
                "timestamp": "2026-01-01T00:00:00.000Z",
                "cwd": str(workspace),
            }
        )
        + "\n"
    )
    config = make_appserver_config()

    async def prepare() -> str:
        async with AppServer.start(config) as server:
            return await first_turn(server, workspace, session)

    tid = anyio.run(prepare)
    for name, value in offline_model.proxy_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(config.home))
    capsys.readouterr()
    code = cli_main(
        [
            "compact",
            str(session),
            "--engine",
            "test_compaction_e2e:owning_engine",
            "--codex-home",
            str(config.codex_home),
            "--model-base-url",
            offline_model.base_url,
            "--developer-instructions",
            DEV,
            "--current-token-count",
            "42",
            "--timeout",
            "30",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    printed = json.loads(out)  # stdout is the JSON alone (logs go to stderr)
    assert printed["ok"] is True
    assert printed["compacted"] is True
    assert printed["result"]["summary"] == "engine summary"
    assert printed["result"]["firstKeptEntryId"] == "entry-9"
    assert printed["result"]["tokensBefore"] == 900
    native = printed["result"]["details"]["codexNativeCompaction"]
    assert native["ok"] is True
    assert native["details"]["threadId"] == tid
    assert native["details"]["signal"] == "item/completed"
    assert native["details"]["ownsCompaction"] is True
    assert len(offline_model.compaction_requests()) == 1
    assert offline_model.proxy_attempts == []


def test_cli_compact_without_a_binding_reports_and_starts_no_codex(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    session = tmp_path / "nothing.jsonl"
    # A session with a header and no binding (a missing file is exit 3, tests/test_cli.py).
    mirror_turn(
        session,
        [{"role": "user", "content": "hi", "timestamp": 1}],
        scope="seed",
        identities=["m0"],
        session_id="s-1",
        cwd=str(tmp_path),
    )
    home = tmp_path / "never-created-codex-home"
    code = cli_main(
        ["compact", str(session), "--codex-home", str(home), "--model-base-url", "http://x/v1"]
    )
    assert code == 1
    assert json.loads(capsys.readouterr().out) == {
        "ok": False,
        "compacted": False,
        "reason": "no codex app-server thread binding",
    }
    assert not home.exists()  # no app-server was started
