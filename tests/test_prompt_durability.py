"""The user's prompt is durable before the model sees it, and the turn goes on when its fsync fails.

A turn writes the user's prompt to the transcript and fsyncs it, in one worker hop, before
``turn/start`` (a host, or an OS, that dies mid-turn keeps the user's words). Checked here
against the real binary: the model gets the request only once the prompt's fsync ended, a
slow fsync is waited for, a failed one is said and the turn still lands, and a caller
cancelled meanwhile still gets its turn mirrored. Underneath: ``mirror_prompt(sync=False)``
and ``sync_appended``, which tell a failed fsync apart from a failed write.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support.transcripts import transcript_texts
from support.turns import turn_params

from codex_turn import AppServer, TurnOutcome, TurnResult, run_codex_turn
from codex_turn.harness.session import mirror_prompt, sync_appended
from codex_turn.testing import OfflineModel, Reply

# --- the real binary --------------------------------------------------------------------------


class _TranscriptFsyncs:
    """``os.fsync`` seen through the transcript's inode: what each call did, and a hook that
    may hold the first one of a turn (the prompt's)."""

    def __init__(self, transcript: Path, hold: Callable[[], None] | None = None) -> None:
        self.inode = transcript.stat().st_ino
        self.hold = hold
        self.calls: list[tuple[float, float, str]] = []  # completed: (start, end, thread)
        self._real = os.fsync
        self._first = True

    def __call__(self, fd: int) -> None:
        if os.fstat(fd).st_ino != self.inode:
            self._real(fd)
            return
        started = time.monotonic()
        first, self._first = self._first, False
        if self.hold is not None and first:
            self.hold()
        self._real(fd)
        self.calls.append((started, time.monotonic(), threading.current_thread().name))


@pytest.fixture
def session(tmp_path: Path) -> Path:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    return tmp_path / "session.jsonl"


def _params(session: Path, prompt: str) -> Any:
    return turn_params(str(session), prompt, workspace_dir=str(session.parent / "workspace"))


@pytest.mark.anyio
async def test_the_model_gets_the_turn_only_once_the_prompt_is_written_and_synced(
    appserver: AppServer,
    offline_model: OfflineModel,
    session: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prompt's fsync is held for a while: no request reaches the model meanwhile."""
    await run_codex_turn(_params(session, "first"), app_server=appserver)  # creates the file
    before = len(offline_model.requests)
    seen: dict[str, Any] = {}
    loop_thread = threading.current_thread().name

    def hold() -> None:
        seen["written"] = "second prompt" in session.read_text()
        time.sleep(0.3)  # time enough for turn/start to reach the model, were it sent
        seen["requests_meanwhile"] = len(offline_model.requests) - before

    fsyncs = _TranscriptFsyncs(session, hold)
    monkeypatch.setattr(os, "fsync", fsyncs)
    result = await run_codex_turn(_params(session, "second prompt"), app_server=appserver)
    returned = time.monotonic()
    assert result.outcome.value == "completed"
    assert seen == {"written": True, "requests_meanwhile": 0}
    assert len(offline_model.requests) > before
    # Two fsyncs of the transcript, off the event loop: the prompt's, then the mirror's; both
    # ended before the turn returned.
    assert len(fsyncs.calls) == 2, fsyncs.calls
    assert all(name != loop_thread for _, _, name in fsyncs.calls)
    assert fsyncs.calls[0][1] <= fsyncs.calls[1][0]
    assert fsyncs.calls[1][1] <= returned
    texts = transcript_texts(session)
    assert texts.count("second prompt") == 1
    assert "ECHO: second prompt" in texts


@pytest.mark.anyio
async def test_a_turn_does_not_return_before_its_prompts_fsync_ended(
    appserver: AppServer,
    offline_model: OfflineModel,
    session: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt fsync slower than the whole turn (the echo model answers at once) is waited
    for: the result comes after it, and the mirror's fsync after that."""
    await run_codex_turn(_params(session, "first"), app_server=appserver)

    def hold() -> None:
        time.sleep(0.4)  # longer than the rest of the turn takes

    fsyncs = _TranscriptFsyncs(session, hold)
    monkeypatch.setattr(os, "fsync", fsyncs)
    result = await run_codex_turn(_params(session, "slow disk"), app_server=appserver)
    returned = time.monotonic()
    assert result.outcome.value == "completed"
    assert len(fsyncs.calls) == 2
    (_, prompt_synced, _), (mirror_started, _, _) = fsyncs.calls
    assert prompt_synced <= mirror_started
    assert prompt_synced <= returned
    durations = {state.lower(): ms for state, ms in result.durations_ms.items()}
    assert durations["running_turn"] >= 350, durations  # the stage waited for the prompt fsync


@pytest.mark.anyio
async def test_a_failed_prompt_fsync_is_said_and_the_turn_still_lands_in_the_transcript(
    appserver: AppServer,
    offline_model: OfflineModel,
    session: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await run_codex_turn(_params(session, "first"), app_server=appserver)

    def fail() -> None:
        raise OSError(5, "Input/output error")

    fsyncs = _TranscriptFsyncs(session, fail)
    monkeypatch.setattr(os, "fsync", fsyncs)
    with capture_logs() as logs:
        result = await run_codex_turn(_params(session, "flaky disk"), app_server=appserver)
    assert result.outcome.value == "completed"
    warned = [e for e in logs if e["event"] == "failed to sync the prompt to the transcript"]
    assert len(warned) == 1
    assert warned[0]["log_level"] == "warning"
    assert "flaky disk" not in repr(warned)
    assert len(fsyncs.calls) == 1  # the mirror's: it synced the prompt's bytes too
    texts = transcript_texts(session)
    assert texts.count("flaky disk") == 1
    assert "ECHO: flaky disk" in texts


@pytest.mark.anyio
async def test_a_caller_cancelled_while_the_prompts_fsync_runs_still_gets_its_turn_mirrored(
    appserver: AppServer,
    offline_model: OfflineModel,
    session: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller is cancelled while the prompt's fsync is still held: the hop is not
    abandoned, the turn ends as aborted before ``turn/start``, mirrors and hands the aborted
    result to ``on_turn_end``; the cancellation still reaches the caller."""
    await run_codex_turn(_params(session, "first"), app_server=appserver)
    # Were turn/start sent, the model would still be thinking at the cancellation.
    offline_model.script(Reply.fixed("too late", delay=10.0, partial_text="thinking"))
    before = len(offline_model.requests)
    released = threading.Event()

    def hold() -> None:
        released.wait(20)  # held past the caller's cancellation

    fsyncs = _TranscriptFsyncs(session, hold)
    monkeypatch.setattr(os, "fsync", fsyncs)
    ended: list[TurnResult] = []
    ended_at: list[float] = []

    async def on_end(result: TurnResult) -> None:
        ended.append(result)
        ended_at.append(time.monotonic())

    async def release_later() -> None:
        await anyio.sleep(1.0)  # after the cancellation below
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_later)
        with anyio.move_on_after(0.5) as scope:
            await run_codex_turn(
                _params(session, "cancel me"), app_server=appserver, on_turn_end=on_end
            )
    assert scope.cancelled_caught
    (result,) = ended
    assert result.outcome is TurnOutcome.ABORTED
    assert [e.trigger for e in result.trace][-3:] == ["turn_aborted", "mirrored", "finalized"]
    # The prompt's fsync (released a second after the start) was waited for before the turn
    # ended; the aborted turn added nothing to sync after it.
    (_, prompt_synced, _), *_ = fsyncs.calls
    assert prompt_synced <= ended_at[0]
    assert transcript_texts(session).count("cancel me") == 1
    assert len(offline_model.requests) == before  # cancelled before turn/start went


# --- the mirror underneath --------------------------------------------------------------------


def _prompt(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1}


def _mirror(path: Path, text: str, identity: str, *, sync: bool) -> Any:
    return mirror_prompt(
        str(path),
        _prompt(text),
        scope="codex-app-server:t-1",
        identity=identity,
        session_id="s-1",
        cwd=str(path.parent),
        sync=sync,
    )


def test_an_unsynced_prompt_is_written_and_sync_appended_fsyncs_exactly_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.jsonl"
    created = _mirror(path, "one", "r-1:prompt", sync=False)
    assert created.created  # a new file is durable as it is created: nothing left to sync
    inode = path.stat().st_ino
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd)))

    sync_appended(created)
    assert synced == []
    appended = _mirror(path, "two", "r-2:prompt", sync=False)
    assert synced == []  # written, not synced
    assert "two" in path.read_text()
    sync_appended(appended)
    assert synced == [inode]
    again = _mirror(path, "two", "r-2:prompt", sync=False)  # already there: nothing appended
    assert again.bytes_written == 0
    sync_appended(again)
    assert synced == [inode]
    _mirror(path, "three", "r-3:prompt", sync=True)  # the default syncs in the append
    assert synced == [inode, inode]
