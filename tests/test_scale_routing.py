"""codex_turn.scale's sticky routing: a session's turns run on the worker whose Codex home holds
its thread while that worker is alive and serving, elsewhere (the context re-projected into a
fresh thread) when it is dead or draining, in submission order across the move. Real
``codex-turn worker`` processes on embedded SQLite, each with a Codex home of its own; plus the
DBOS behaviours the routing relies on, pinned so that a DBOS that changes them fails here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
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

from codex_turn import AppServer, AppServerConfig
from codex_turn.scale import TurnQueue, TurnRecord, TurnWorker, session_lane
from codex_turn.scale._routing import INBOX, Router, statuses_of, worker_queue
from codex_turn.scale._wake import Wakes, announce, wake_directory
from codex_turn.scale._worker import dequeuers_of
from codex_turn.testing import OfflineModel, Reply

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
    assert handle.routed == "moved"
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


def test_a_turn_submitted_while_a_peer_cleans_up_after_its_dead_worker_moves(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """A live peer's watchdog holds a dead worker's lock while it cleans up after it: a turn
    submitted meanwhile must not take that for the worker being alive (and go to its queue,
    ``sticky``): it moves."""
    from codex_turn.scale._locks import FileExecutorLocks, executor_locks_for

    lane = session_lane(_params(tmp_path, "s1", "-"))
    home, other, watchdog = (executor_locks_for(db_url) for _ in range(3))
    assert isinstance(home, FileExecutorLocks)
    router = Router(db_url, statuses=lambda ids: {})
    try:
        home.hold("w1", 1)
        other.hold("w2", 1)
        router.set_worker("w1", "serving")
        router.set_worker("w2", "serving")
        router.note_run(lane, "w1")  # s1's thread lives in w1's home
        fd, home._fd, home._path = home._fd, None, None  # w1 dies: its lock goes, its file
        assert fd is not None  # and record stay
        os.close(fd)
        with watchdog.claim("w1") as dead:  # w2's watchdog, cleaning up after w1
            assert dead
            handle = queue.submit(_params(tmp_path, "s1", "turn two"), turn_id="s1-2")
        assert handle.routed == "moved"
        with router.locked(lane) as (_, route):
            assert route is not None
            assert route.queue == worker_queue("w2")
    finally:
        other.release()
        router.close()


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
    assert running.routed == "sticky"
    behind = queue.submit(_params(tmp_path, "s1", "s1 turn three"), turn_id="s1-3")
    assert behind.routed == "sticky"  # behind turn two, on w1
    _wait_for(lambda: "s1 turn two" in (tmp_path / "s1.jsonl").read_text())
    workers.procs["w1"].send_signal(signal.SIGTERM)
    router = Router(queue.database_url, statuses=lambda ids: {})
    try:  # w1 says it drains: no submit routes a session to it from now on
        _wait_for(lambda: router.workers().get("w1") == "draining", timeout=10)
    finally:
        router.close()
    elsewhere = queue.submit(_params(tmp_path, "s2", "s2 turn two"), turn_id="s2-2")
    assert elsewhere.routed == "moved"
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


def test_a_turn_submitted_with_no_live_worker_waits_in_the_inbox(
    tmp_path: Path, queue: TurnQueue, workers: _Workers
) -> None:
    handle = queue.submit(_params(tmp_path, "s1", "anyone?"), turn_id="i-1")
    assert handle.routed == "inbox"
    assert handle.status().state == "enqueued"
    workers.start("w1")
    record = handle.result(timeout=60)
    assert (record.executor_id, record.locality) == ("w1", "first")


def test_a_sessions_turns_on_a_dead_workers_queue_move_together_and_in_order(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """The invariant, without processes: a turn submitted after its session's worker died goes
    behind the session's unfinished turn on that worker's queue, and a live peer's sweep moves
    them together, in order; the dead worker is forgotten once nothing can reach its queue."""
    import functools

    from dbos import DBOSClient

    from codex_turn.scale._locks import executor_locks_for
    from codex_turn.scale._watchdog import DbosMoves, Watchdog

    ghost = executor_locks_for(db_url)
    ghost.hold("ghost", 1)
    client = DBOSClient(system_database_url=db_url, application_name="codex-turn")
    peer = executor_locks_for(db_url)
    router = Router(db_url, statuses=functools.partial(statuses_of, client), locks=peer)
    try:
        router.set_worker("ghost", "serving")
        first = queue.submit(_params(tmp_path, "s1", "one"), turn_id="g-1")
        assert first.routed == "first"
        ghost.release()  # it dies before running it
        second = queue.submit(_params(tmp_path, "s1", "two"), turn_id="g-2")
        assert second.routed == "behind"
        peer.hold("peer", 1)
        router.set_worker("peer", "serving")
        assert Watchdog(router, DbosMoves(client), "peer").sweep() == 2
        moved = client.list_workflows(workflow_ids=["g-1", "g-2"], load_input=False)
        assert [(t.workflow_id, t.status, t.queue_name) for t in moved] == [
            ("g-1", "ENQUEUED", worker_queue("peer")),
            ("g-2", "ENQUEUED", worker_queue("peer")),
        ]
        assert router.workers() == {"peer": "serving"}  # the ghost is forgotten
        third = queue.submit(_params(tmp_path, "s1", "three"), turn_id="g-3")
        assert third.routed == "behind"  # behind the moved ones, on the peer
        (placed,) = client.list_workflows(workflow_ids=["g-3"], load_input=False)
        assert placed.queue_name == worker_queue("peer")
        assert queue.submit(_params(tmp_path, "s1", "again"), turn_id="g-3").routed == "existing"
    finally:
        peer.release()
        router.close()
        client.destroy()


def test_a_turn_whose_worker_died_under_it_too_often_is_cancelled_not_moved(
    tmp_path: Path, db_url: str, queue: TurnQueue, workers: _Workers
) -> None:
    """DBOS's own recovery limit restarts at every move: the takeovers are counted instead."""
    import functools

    import sqlalchemy as sa
    from dbos import DBOSClient

    from codex_turn.scale import TurnFailed
    from codex_turn.scale._locks import executor_locks_for
    from codex_turn.scale._routing import MAX_TAKEOVERS, TAKEOVERS
    from codex_turn.scale._watchdog import DbosMoves, Watchdog

    workers.start("ghost", "--offline-delay", "60")
    poison = queue.submit(_params(tmp_path, "s1", "poison"), turn_id="x-1")
    after = queue.submit(_params(tmp_path, "s1", "next"), turn_id="x-2")
    session = tmp_path / "s1.jsonl"
    _wait_for(lambda: session.exists() and "poison" in session.read_text())
    workers.kill("ghost")
    client = DBOSClient(system_database_url=db_url, application_name="codex-turn")
    peer = executor_locks_for(db_url)
    peer.hold("peer", 1)
    router = Router(db_url, statuses=functools.partial(statuses_of, client), locks=peer)
    try:
        with router.engine.begin() as conn:  # as if it had killed that many workers already
            conn.execute(sa.insert(TAKEOVERS).values(turn_id="x-1", count=MAX_TAKEOVERS))
        router.set_worker("peer", "serving")
        assert Watchdog(router, DbosMoves(client), "peer").sweep() == 1  # x-2 moved
        with pytest.raises(TurnFailed, match="cancelled"):
            poison.result(timeout=10)
        (moved,) = client.list_workflows(workflow_ids=["x-2"], load_input=False)
        assert (moved.status, moved.queue_name) == ("ENQUEUED", worker_queue("peer"))
    finally:
        peer.release()
        router.close()
        client.destroy()
    assert after.status().state == "enqueued"


# --- what DBOS must keep doing for the routing to hold -----------------------------------------


def test_statuses_of_reads_the_turns_that_exist_in_one_call(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """What a submit reads to place a turn behind an unfinished one. (What a move writes is
    pinned against DBOS's own ``resume_workflows`` in ``tests/test_scale_lane_move.py``.)"""
    from dbos import DBOSClient

    assert queue.submit(_params(tmp_path, "s1", "hi"), turn_id="r-1").routed == "inbox"
    client = DBOSClient(system_database_url=db_url, application_name="codex-turn")
    try:
        assert statuses_of(client, ["r-1", "r-none"]) == {"r-1": "ENQUEUED"}
        assert statuses_of(client, []) == {}
    finally:
        client.destroy()


@pytest.mark.anyio
async def test_a_worker_dequeues_its_own_queue_on_one_named_thread_that_stops_on_drain(
    tmp_path: Path,
    db_url: str,
    queue: TurnQueue,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
) -> None:
    """A draining worker moves its queued turns once no thread of its own dequeues its queue
    (:func:`codex_turn.scale._worker.dequeuers_of`, DBOS's ``queue-worker-<queue>``)."""
    offline_model.script(Reply.fixed("ok"), times=10)
    async with AppServer.start(make_appserver_config()) as server:
        worker = TurnWorker(db_url, app_server=server, executor_id="w1", watchdog_interval=None)
        async with worker:
            with anyio.fail_after(10):
                while not dequeuers_of(worker_queue("w1")):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert len(dequeuers_of(worker_queue("w1"))) == 1
            assert not dequeuers_of(INBOX)  # nobody dequeues the inbox
            # The other DBOS internals a worker reads: the workflows whose outcome is not
            # written yet (its drain waits for them) and its background threads' stop events.
            dbos = worker._dbos
            assert dbos is not None
            assert dbos._active_workflows_set.activeList() == []
            assert dbos.background_thread_stop_events
            record = await (
                await queue.submit_async(_params(tmp_path, "s1", "hi"), turn_id="d-1")
            ).result_async()
            assert record.executor_id == "w1"
            worker.stop_taking_turns()
            with anyio.fail_after(5):
                while dequeuers_of(worker_queue("w1")):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert worker.router.workers() == {"w1": "serving"}
            await worker.wait_idle(5)
            assert worker.router.workers() == {"w1": "draining"}


def test_routes_pick_the_live_serving_worker_with_the_highest_score(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """Rendezvous hashing over live serving workers: a dead or draining worker is skipped, and
    a session's pick does not change when another worker goes away."""
    from codex_turn.scale._locks import executor_locks_for

    router = Router(db_url, statuses=lambda ids: {})
    held = {name: executor_locks_for(db_url) for name in ("a", "b", "c")}
    try:
        for name, locks in held.items():
            locks.hold(name, 1)
            router.set_worker(name, "serving")
        with router.engine.begin() as conn:
            picks = {f"s{n}": router.destination(conn, f"s{n}", None).queue for n in range(30)}
        assert set(picks.values()) == {worker_queue(n) for n in "abc"}  # spread out
        held["b"].release()  # b dies
        router.set_worker("c", "draining")
        with router.engine.begin() as conn:
            after = {lane: router.destination(conn, lane, None).queue for lane in picks}
            assert router.destination(conn, "s0", "a").reason == "sticky"
            assert router.destination(conn, "s0", "b").reason == "moved"
        assert set(after.values()) == {worker_queue("a")}
        assert all(after[lane] == q for lane, q in picks.items() if q == worker_queue("a"))
    finally:
        for locks in held.values():
            with contextlib.suppress(Exception):
                locks.release()
        router.close()


def test_a_wake_up_reaches_every_waiting_process_and_stale_sockets_go(tmp_path: Path) -> None:
    directory = wake_directory(f"sqlite:///{tmp_path}/turns.sqlite")
    assert directory is not None
    wakes = Wakes(directory)
    assert wakes.available
    with wakes.waiter("t-1") as waiter, wakes.waiter("t-2") as other:
        Path(directory, "999999-dead.sock").touch()  # not a socket: a sender drops it
        assert announce(directory, "t-1") == 1
        assert waiter.wait(5)
        assert not other.wait(0.05)
    assert not Path(directory, "999999-dead.sock").exists()
    wakes.close()
    assert announce(directory, "t-1") == 0
    assert wake_directory("postgresql://localhost/db") is None
    long = wake_directory("sqlite:///" + "/x" * 60 + "/turns.sqlite")
    assert long is not None
    assert len(long) < 80
