"""The prompt's fsync overlaps the model's turn, and the worker pool behind it.

A turn writes the user's prompt to the transcript before ``turn/start`` (a host that dies
mid-turn keeps the user's words), and the ``fsync`` that only an OS crash needs runs in the
worker that wrote it while ``turn/start`` is already on its way; the turn does not return
before it ended. Checked here against the real binary (the model receives the request while
the prompt's fsync is held), and underneath: ``mirror_prompt(sync=False)`` /
``sync_appended``, ``run_in_worker_then`` and the ``SimpleQueue`` worker pool's accounting.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from structlog.testing import capture_logs
from support.transcripts import transcript_texts
from support.turns import turn_params

from codex_turn import AppServer, TurnOutcome, TurnResult, run_codex_turn
from codex_turn.harness import _fs
from codex_turn.harness._fs import run_in_worker, run_in_worker_then
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
async def test_the_model_gets_the_turn_while_the_prompts_fsync_is_still_running(
    appserver: AppServer,
    offline_model: OfflineModel,
    session: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prompt's fsync is held until the model has the request: a turn that waited for it
    before ``turn/start`` would never send the request (the hold would time out)."""
    await run_codex_turn(_params(session, "first"), app_server=appserver)  # creates the file
    seen: dict[str, Any] = {}

    def hold() -> None:
        # In the worker thread that wrote the prompt: the bytes are the kernel's already.
        seen["written"] = "second prompt" in session.read_text()
        try:
            offline_model.wait_for_requests(2, timeout=20)
            seen["request_arrived"] = True
        except TimeoutError:
            seen["request_arrived"] = False

    fsyncs = _TranscriptFsyncs(session, hold)
    monkeypatch.setattr(os, "fsync", fsyncs)
    result = await run_codex_turn(_params(session, "second prompt"), app_server=appserver)
    returned = time.monotonic()
    assert result.outcome.value == "completed"
    assert seen == {"written": True, "request_arrived": True}
    # Two fsyncs of the transcript: the prompt's (in a worker, overlapping the turn), then the
    # mirror's; both ended before the turn returned.
    assert len(fsyncs.calls) == 2, fsyncs.calls
    assert all(name == "codex-turn-worker" for _, _, name in fsyncs.calls)
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
    """A prompt fsync slower than the whole turn (the echo model answers at once) is still
    waited for: the result comes after it, and the mirror's fsync after that."""
    await run_codex_turn(_params(session, "first"), app_server=appserver)

    def hold() -> None:
        offline_model.wait_for_requests(2, timeout=20)
        time.sleep(0.4)  # the model's reply is in by now: the turn would be done without us

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
    """The caller is cancelled mid-turn while the prompt's fsync is still held: the turn
    waits for it (shielded), then mirrors and hands the aborted result to ``on_turn_end``;
    the cancellation still reaches the caller."""
    await run_codex_turn(_params(session, "first"), app_server=appserver)
    offline_model.script(Reply.fixed("too late", delay=10.0, partial_text="thinking"))
    released = threading.Event()

    def hold() -> None:
        offline_model.wait_for_requests(2, timeout=20)
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


# --- run_in_worker_then ----------------------------------------------------------------------


def test_the_caller_resumes_before_the_follow_up_runs_in_the_same_worker() -> None:
    follow_up_may_go = threading.Event()
    ran: dict[str, Any] = {}

    def work() -> str:
        ran["work"] = threading.current_thread()
        return "written"

    def then(result: str) -> None:
        assert follow_up_may_go.wait(10)  # only once the caller has resumed
        ran["then"] = (threading.current_thread(), result)

    async def main() -> None:
        assert await run_in_worker_then(work, then) == "written"
        assert "then" not in ran
        follow_up_may_go.set()
        await run_in_worker(lambda: None)  # any later hop: the follow-up is done by then
        for _ in range(100):
            if "then" in ran:
                break
            await anyio.sleep(0.01)

    anyio.run(main, backend="asyncio")
    assert ran["then"] == (ran["work"], "written")


@pytest.mark.parametrize("error", [ValueError("secret detail"), SystemExit(3)])
def test_a_failing_follow_up_is_logged_by_type_and_the_worker_goes_on(
    error: BaseException,
) -> None:
    def then(_: object) -> None:
        raise error

    async def main() -> list[int]:
        results = [await run_in_worker_then(lambda: 1, then)]
        results.append(await run_in_worker(lambda: 2))
        return results

    threads = _fs._workers._threads
    with capture_logs() as logs:
        assert anyio.run(main, backend="asyncio") == [1, 2]
        deadline = time.monotonic() + 5
        while not logs and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [(e["event"], e["error"]) for e in logs] == [
        ("worker follow-up failed", type(error).__name__)
    ]
    assert "secret" not in repr(logs)
    # The worker that ran it lives on (a thread that died would hold its slot forever).
    deadline = time.monotonic() + 5
    while _fs._workers._idle < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _fs._workers._idle >= 1
    assert _fs._workers._threads <= max(threads, 1) + 1


def test_no_follow_up_when_the_work_raised() -> None:
    called: list[object] = []

    def work() -> None:
        raise OSError("disk")

    async def main() -> None:
        with pytest.raises(OSError, match="disk"):
            await run_in_worker_then(work, called.append)

    anyio.run(main, backend="asyncio")
    time.sleep(0.05)
    assert called == []


def test_on_trio_the_follow_up_runs_before_the_caller_resumes() -> None:
    pytest.importorskip("trio")
    order: list[str] = []

    async def main() -> None:
        await run_in_worker_then(lambda: order.append("work"), lambda _: order.append("then"))
        order.append("caller")

    anyio.run(main, backend="trio")
    assert order == ["work", "then", "caller"]


# --- the worker pool ---------------------------------------------------------------------------


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> _fs._Workers:
    """A fresh pool of at most 3 workers that end after 50 ms idle."""
    workers = _fs._Workers()
    monkeypatch.setattr(_fs, "_workers", workers)
    monkeypatch.setattr(_fs, "MAX_WORKERS", 3)
    monkeypatch.setattr(_fs, "WORKER_IDLE_SECONDS", 0.05)
    return workers


def _settled(pool: _fs._Workers, *, threads: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with pool._lock:
            if pool._threads == threads and pool._idle == threads and pool._backlog == 0:
                return True
        time.sleep(0.005)
    return False


def test_bursts_beyond_the_limit_all_run_and_the_accounting_returns_to_idle(
    pool: _fs._Workers,
) -> None:
    """Random bursts of blocking hops, more than the 3 workers, with workers ending and
    starting between bursts: every hop runs, never more than 3 at once, and afterwards every
    thread counts as idle and then ends (an idle count off by one would leave a job waiting
    behind a busy worker while a thread could start)."""
    rng = random.Random(13)
    running = 0
    most = 0
    lock = threading.Lock()

    def job(pause: float) -> float:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(pause)
        with lock:
            running -= 1
        return pause

    async def burst(size: int) -> list[float]:
        pauses = [rng.random() * 0.01 for _ in range(size)]
        results: list[float] = []

        async def one(pause: float) -> None:
            results.append(await run_in_worker(job, pause))

        async with anyio.create_task_group() as tg:
            for pause in pauses:
                tg.start_soon(one, pause)
        assert sorted(results) == sorted(pauses)
        return results

    async def main() -> None:
        for size in (1, 7, 2, 12, 3, 1, 9):
            await burst(size)
            if rng.random() < 0.5:
                await anyio.sleep(0.08)  # let some workers end

    anyio.run(main, backend="asyncio")
    assert most <= 3
    assert _settled(pool, threads=pool._threads)
    assert _settled(pool, threads=0)  # all of them end once idle


def test_a_job_queued_behind_busy_workers_is_taken_by_the_first_to_finish(
    pool: _fs._Workers,
) -> None:
    """With all 3 workers blocked, a 4th hop waits in the backlog; the first worker to finish
    takes it, and then the pool counts exactly its threads as idle."""
    gates = [threading.Event() for _ in range(3)]
    started = threading.Semaphore(0)

    def blocked(gate: threading.Event) -> str:
        started.release()
        assert gate.wait(10)
        return "blocked"

    async def main() -> list[str]:
        results: list[str] = []

        async def one(func: Callable[..., str], *args: Any) -> None:
            results.append(await run_in_worker(func, *args))

        async with anyio.create_task_group() as tg:
            for gate in gates:
                tg.start_soon(one, blocked, gate)
            for _ in gates:
                await anyio.to_thread.run_sync(started.acquire)
            tg.start_soon(one, lambda: "queued")
            await anyio.sleep(0.05)
            assert results == []  # every worker busy: it waits
            with pool._lock:
                assert (pool._threads, pool._backlog) == (3, 1)
            gates[0].set()
            await anyio.sleep(0.2)
            assert sorted(results) == ["blocked", "queued"]
            for gate in gates[1:]:
                gate.set()
        return results

    assert sorted(anyio.run(main, backend="asyncio")) == ["blocked"] * 3 + ["queued"]
    assert _settled(pool, threads=pool._threads)


def test_many_turns_waiting_for_their_prompts_fsync_drain_a_pool_of_two(
    pool: _fs._Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool is small (CPUs + 2), and a turn waits for its prompt's fsync in a worker of
    its own: that never starves, because the fsync runs as the follow-up of the worker that
    wrote the prompt, never as a job queued behind the waiters. 16 turns on 2 workers, each
    fsync still running when its turn hands its wait to the pool (the fsync ends only after
    the turn moved on to it; the waiters queue behind the busy workers)."""
    monkeypatch.setattr(_fs, "MAX_WORKERS", 2)
    done: list[int] = []

    async def turn(i: int) -> None:
        synced, waiting = threading.Event(), threading.Event()

        def fsync_later(_: None) -> None:
            assert waiting.wait(5)  # the turn is on its way to wait for this fsync
            time.sleep(0.005)  # the prompt's fsync
            synced.set()

        await run_in_worker_then(lambda: None, fsync_later)  # the prompt's write
        waiting.set()
        assert await run_in_worker(synced.wait, 5)  # _PromptSync.wait, as run_turn ends
        done.append(i)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(turn, i)

    anyio.run(main, backend="asyncio")
    assert sorted(done) == list(range(16))
    assert _settled(pool, threads=0)  # and the pool ends idle
