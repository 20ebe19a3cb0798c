"""codex_turn.scale's locality: a session's turns run on the worker whose Codex home holds its
thread while that worker is alive and serving, elsewhere (a fresh thread) when it is dead or
draining, in submission order across the move. Real ``codex-turn worker`` processes on
embedded SQLite, each with a Codex home of its own.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_scale import (
    _log_size,
    _messages,
    _params,
    _start_worker,
    _texts,
    _wait_for,
    _wait_log,
)

from codex_turn.scale import TurnQueue, TurnRecord
from codex_turn.scale._locks import liveness_for

pytestmark = pytest.mark.codex


class _Workers:
    """``codex-turn worker`` processes by executor id, stopped at the end of the test."""

    def __init__(self, tmp_path: Path, db_url: str) -> None:
        self.tmp_path, self.db_url = tmp_path, db_url
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, executor_id: str, *extra: str) -> subprocess.Popen[bytes]:
        log = self.log(executor_id)
        since = _log_size(log)  # a restart waits for its own start line
        proc = _start_worker(self.db_url, log, "--executor-id", executor_id, *extra)
        self.procs[executor_id] = proc
        _wait_log(log, f"executor {executor_id}", since=since)
        return proc

    def log(self, executor_id: str) -> Path:
        return self.tmp_path / f"{executor_id}.log"

    def kill(self, executor_id: str) -> None:
        proc = self.procs[executor_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)  # reaped: a zombie's pid would still hold the session lease

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a turn stuck in its model: no drain
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def workers(tmp_path: Path, db_url: str) -> Iterator[_Workers]:
    running = _Workers(tmp_path, db_url)
    try:
        yield running
    finally:
        running.stop()


def _run(queue: TurnQueue, tmp_path: Path, session: str, prompt: str, turn_id: str) -> TurnRecord:
    return queue.submit(_params(tmp_path, session, prompt), turn_id=turn_id).result(timeout=60)


def _assert_once_in_order(session_file: Path, prompts: list[str]) -> None:
    assert _texts(session_file, "user") == prompts  # each once, in submission order
    replies = _texts(session_file, "assistant")  # the echo model: a reply ends with its prompt
    assert len(replies) == len(prompts), replies
    assert all(r.endswith(p) for r, p in zip(replies, prompts, strict=True)), replies
    keys = [m.get("idempotencyKey") for m in _messages(session_file)]
    assert len(keys) == len(set(keys))


def test_a_session_sticks_to_its_worker_and_moves_with_its_context_when_it_dies(
    tmp_path: Path, queue: TurnQueue, workers: _Workers
) -> None:
    workers.start("w1")
    workers.start("w2")
    first = _run(queue, tmp_path, "s1", "turn one", "s1-1")
    home = first.executor_id
    assert (first.locality, first.previous_executor_id) == ("first", None)
    assert first.thread_action == "start"
    again = [_run(queue, tmp_path, "s1", f"turn {n}", f"s1-{n}") for n in ("two", "three")]
    for record in again:  # the thread lives in the home worker's Codex home: resumed there
        assert (record.executor_id, record.locality) == (home, "sticky"), record
        assert record.previous_executor_id == home
        assert record.thread_action == "resume", record.thread_reason
    assert {r.thread_id for r in [first, *again]} == {first.thread_id}

    workers.kill(home)  # idle: its sessions move on their next turn
    other = ({"w1", "w2"} - {home}).pop()
    handle = queue.submit(_params(tmp_path, "s1", "turn four"), turn_id="s1-4")
    moved = handle.result(timeout=60)
    assert (moved.executor_id, moved.locality) == (other, "moved")
    assert moved.previous_executor_id == home
    # The bound thread is in the dead worker's home: a fresh one here, the engine's context
    # re-projected into it.
    assert moved.thread_action == "rotate", moved.thread_reason
    assert moved.projected
    assert moved.thread_id != first.thread_id
    after = _run(queue, tmp_path, "s1", "turn five", "s1-5")
    assert (after.executor_id, after.locality, after.thread_action) == (other, "sticky", "resume")
    _assert_once_in_order(
        tmp_path / "s1.jsonl", ["turn one", "turn two", "turn three", "turn four", "turn five"]
    )


def test_a_draining_worker_sends_new_turns_elsewhere_and_its_queued_ones_after_its_last(
    tmp_path: Path, queue: TurnQueue, workers: _Workers
) -> None:
    """w1 drains while running s1's turn: s2's next turn runs on w2 meanwhile; s1's turn queued
    behind the running one moves to w2 once that one ended, in order."""
    workers.start("w1", "--offline-delay", "3")
    both = [
        queue.submit(_params(tmp_path, s, f"{s} turn one"), turn_id=f"{s}-1") for s in ("s1", "s2")
    ]
    assert [h.result(timeout=60).executor_id for h in both] == ["w1", "w1"]
    workers.start("w2")
    running = queue.submit(_params(tmp_path, "s1", "s1 turn two"), turn_id="s1-2")
    behind = queue.submit(_params(tmp_path, "s1", "s1 turn three"), turn_id="s1-3")
    _wait_for(lambda: "s1 turn two" in (tmp_path / "s1.jsonl").read_text())
    workers.procs["w1"].send_signal(signal.SIGTERM)
    # w1 says it drains (its serving lock goes): no turn is forwarded to it from now on
    _wait_for(lambda: not liveness_for(queue.database_url).serving("w1"), timeout=10)
    elsewhere = queue.submit(_params(tmp_path, "s2", "s2 turn two"), turn_id="s2-2")
    s2 = elsewhere.result(timeout=60)
    s1 = [running.result(timeout=60), behind.result(timeout=60)]
    assert workers.procs["w1"].wait(timeout=60) == 0, workers.log("w1").read_text()
    assert "drained" in workers.log("w1").read_text()
    assert (s2.executor_id, s2.locality, s2.thread_action) == ("w2", "moved", "rotate")
    assert s2.ended_at < s1[0].ended_at  # it did not wait for the draining worker
    assert [(r.executor_id, r.locality) for r in s1] == [("w1", "sticky"), ("w2", "moved")]
    assert s1[0].ended_at <= s1[1].started_at
    _assert_once_in_order(tmp_path / "s1.jsonl", ["s1 turn one", "s1 turn two", "s1 turn three"])
    _assert_once_in_order(tmp_path / "s2.jsonl", ["s2 turn one", "s2 turn two"])


def test_turns_submitted_while_their_worker_dies_run_once_in_order(
    tmp_path: Path, queue: TurnQueue, workers: _Workers
) -> None:
    """A session's turns keep arriving while the worker running them is SIGKILLed and the
    watchdog moves them: each runs once, in submission order, never two at a time."""
    workers.start("w1", "--offline-delay", "0.3")
    first = _run(queue, tmp_path, "s1", "turn 0", "m-0")
    assert first.executor_id == "w1"
    workers.start("w2")
    handles = []
    done = threading.Event()

    def submit_more() -> None:
        for n in range(1, 9):
            handles.append(queue.submit(_params(tmp_path, "s1", f"turn {n}"), turn_id=f"m-{n}"))
            time.sleep(0.1)
        done.set()

    submitter = threading.Thread(target=submit_more)
    submitter.start()
    _wait_for(lambda: "turn 2" in (tmp_path / "s1.jsonl").read_text())
    workers.kill("w1")
    submitter.join(timeout=30)
    assert done.is_set()
    records = [h.result(timeout=120) for h in handles]
    assert {r.outcome for r in records} == {"completed"}
    assert records[-1].executor_id == "w2"
    assert any(r.locality == "moved" for r in records)
    for earlier, later in itertools.pairwise([first, *records]):
        assert earlier.ended_at <= later.started_at  # never two turns of a session at once
    _assert_once_in_order(tmp_path / "s1.jsonl", [f"turn {n}" for n in range(9)])


def test_a_turn_submitted_with_no_live_worker_waits_for_one(
    tmp_path: Path, queue: TurnQueue, workers: _Workers
) -> None:
    handle = queue.submit(_params(tmp_path, "s1", "anyone?"), turn_id="i-1")
    assert handle.status().state == "enqueued"
    workers.start("w1")
    record = handle.result(timeout=60)
    assert (record.executor_id, record.locality) == ("w1", "first")


# --- what DBOS must keep doing for the routing to hold -----------------------------------------
