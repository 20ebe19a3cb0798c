"""What replaced lane moves, killed at each step: a takeover, a forward and a take-back.

A turn never leaves the queue of every turn (partitioned by session): recovering a dead
worker's turn is DBOS's public ``resume_workflow`` of that turn alone, under the dead worker's
alive lock (:func:`codex_turn.scale._worker.take_over`); a turn forwarded to its session's
home is a second workflow its first one awaits, and one taken back from a dead home is that
workflow cancelled. A process doing any of these is SIGKILLed right after each of its writes:
whatever it left, the next live worker finishes, and every turn runs once, in order.

Workers here run the in-process fake app-server (no Codex): the state a step leaves is the
point, not what Codex does with the turn.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.fake_appserver import CodexScript, FakeAppServer
from test_scale import _messages, _params, _texts, _wait_for

from codex_turn.scale import (
    QueuedTurn,
    TurnFailed,
    TurnQueue,
    TurnRecord,
    TurnWorker,
    session_lane,
)
from codex_turn.scale._locks import liveness_for
from codex_turn.scale._queue import dbos_client
from codex_turn.scale._worker import MAX_TAKEOVERS, take_over
from codex_turn.scale._workflow import Homes

ROOT = Path(__file__).resolve().parents[1]

#: A worker (argv: db, executor id, what its turns do, where it dies) or a sweeper of dead
#: workers' turns (executor id ``mover``), SIGKILLing itself right after the named write.
_PROCESS = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, "tests")
    import anyio
    from dbos import DBOSClient
    from support.fake_appserver import CodexScript, FakeAppServer
    from codex_turn.scale import TurnWorker
    from codex_turn.scale._locks import liveness_for
    from codex_turn.scale._queue import dbos_client
    from codex_turn.scale._worker import take_over
    from codex_turn.scale._workflow import FORWARDED_NAME

    db_url, executor_id, ending, point = sys.argv[1:5]

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def dying(name, when):
        original = getattr(DBOSClient, name)
        def call(self, *args, **kwargs):
            if when(args, kwargs) and name == "list_workflows":
                die()  # holding the dead worker's lock, nothing written yet
            result = original(self, *args, **kwargs)
            if when(args, kwargs):
                die()  # right after the write
            return result
        setattr(DBOSClient, name, call)

    conditions = {
        "list_workflows": lambda args, kwargs: "executor_id" in kwargs,  # under the claim
        "enqueue": lambda args, kwargs: args[0]["workflow_name"] == FORWARDED_NAME,
        "cancel_workflow": lambda args, kwargs: True,
        "update_workflow_attributes": lambda args, kwargs: True,
        "resume_workflow": lambda args, kwargs: True,
    }
    if point:
        dying(point, conditions[point])
    if executor_id == "mover":
        take_over(dbos_client(db_url), liveness_for(db_url), "mover")
        sys.exit(3)  # not reached: the sweep makes the write it dies at

    async def main():
        server = FakeAppServer(default=CodexScript(reply="done", ending=ending))
        async with TurnWorker(db_url, app_server=server, executor_id=executor_id):
            print("up", flush=True)
            await anyio.sleep(3600)

    anyio.run(main, backend="asyncio")
    """
)


def _spawn(
    db_url: str, executor_id: str, ending: str = "completed", point: str = ""
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _PROCESS, db_url, executor_id, ending, point],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _assert_killed_itself(process: subprocess.Popen[str]) -> None:
    _, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, err[-2000:]


def _run_worker(db_url: str, executor_id: str, handles: list[QueuedTurn]) -> list[TurnRecord]:
    """A live worker (in this process) until every handle's turn ended: their records."""
    server = FakeAppServer(default=CodexScript(reply="done"))

    async def run() -> list[TurnRecord]:
        async with TurnWorker(db_url, app_server=server, executor_id=executor_id):
            with anyio.fail_after(60):
                return [await handle.result_async() for handle in handles]

    records = anyio.run(run, backend="asyncio")
    assert server.methods().count("turn") == len(handles)  # each turn reached Codex once
    return records


def _takeovers(db_url: str, turn_ids: list[str]) -> dict[str, object]:
    client = dbos_client(db_url)
    try:
        found = client.list_workflows(workflow_ids=turn_ids, load_input=False, load_output=False)
        return {t.workflow_id: (t.attributes or {}).get("takeovers") for t in found}
    finally:
        client.destroy()


def _assert_once_in_order(tmp_path: Path, session: str, count: int) -> None:
    prompts = [f"{session} turn {n}" for n in range(1, count + 1)]
    assert _texts(tmp_path / f"{session}.jsonl", "user") == prompts
    assert _texts(tmp_path / f"{session}.jsonl", "assistant") == ["done"] * count
    keys = [m.get("idempotencyKey") for m in _messages(tmp_path / f"{session}.jsonl")]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    "point", ["list_workflows", "update_workflow_attributes", "resume_workflow"]
)
def test_a_sweeper_killed_inside_a_takeover_leaves_the_rest_to_the_next(
    tmp_path: Path, db_url: str, queue: TurnQueue, point: str
) -> None:
    """Killed holding the dead worker's lock with nothing written, after counting a turn's
    takeover, and after putting the first of two turns back on the queue."""
    order = [("s1", 1), ("s2", 1), ("s1", 2)]
    handles = [
        queue.submit(_params(tmp_path, s, f"{s} turn {n}"), turn_id=f"{s}-{n}") for s, n in order
    ]
    ghost = _spawn(db_url, "ghost", ending="hang")  # runs s1-1 and s2-1 until it dies
    try:
        _wait_for(lambda: [h.status().state for h in handles] == ["running", "running", "enqueued"])
    finally:
        ghost.kill()
        ghost.communicate(timeout=10)
    mover = _spawn(db_url, "mover", point=point)
    _assert_killed_itself(mover)
    states = [(h.status().state, h.status().executor_id) for h in handles[:2]]
    assert all(state in (("running", "ghost"), ("enqueued", "ghost")) for state in states)
    assert handles[2].status().state == "enqueued"  # behind s1-1, wherever it is
    assert set(_takeovers(db_url, ["s1-1", "s2-1"]).values()) <= {None, 1}

    records = _run_worker(db_url, "peer", handles)
    assert [(r.outcome, r.executor_id) for r in records] == [("completed", "peer")] * 3
    assert records[0].ended_at <= records[2].started_at  # s1's turns, one at a time, in order
    _assert_once_in_order(tmp_path, "s1", 2)
    _assert_once_in_order(tmp_path, "s2", 1)
    # Counted once per takeover (once more for the one a killed sweeper counted, not moved).
    assert set(_takeovers(db_url, ["s1-1", "s2-1"]).values()) <= {1, 2}


def _forwarding(
    tmp_path: Path, db_url: str, queue: TurnQueue, point: str
) -> tuple[Any, QueuedTurn, subprocess.Popen[str]]:
    """s1's home is "home" (alive and serving: its locks held here); worker "w" dequeues s1's
    turn, forwards it there, and dies at ``point``."""
    home = liveness_for(db_url)
    home.hold("home", 1)
    homes = Homes(db_url)
    homes.set(session_lane(_params(tmp_path, "s1", "-")), "home")
    homes.close()
    handle = queue.submit(_params(tmp_path, "s1", "s1 turn 1"), turn_id="f-1")
    return home, handle, _spawn(db_url, "w", point=point)


def test_a_turn_forwarded_by_a_worker_killed_right_after_runs_once_at_its_home(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    home, handle, w = _forwarding(tmp_path, db_url, queue, "enqueue")
    _assert_killed_itself(w)
    forward = queue.handle("f-1:home").status()
    assert (forward.state, handle.status().state) == ("enqueued", "running")
    home.release()  # the home (re)starts: it runs the forward and takes w's turn over,
    (record,) = _run_worker(db_url, "home", [handle])  # which waits for the forward
    assert (record.executor_id, record.locality, record.previous_executor_id) == (
        "home",
        "sticky",
        "home",
    )
    _assert_once_in_order(tmp_path, "s1", 1)


def test_a_turn_taken_back_by_a_worker_killed_right_after_runs_once_elsewhere(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    home, handle, w = _forwarding(tmp_path, db_url, queue, "cancel_workflow")
    try:
        _wait_for(lambda: _exists(queue, "f-1:home"))
    finally:
        home.release()  # the home dies before running it: w takes it back, and dies
    _assert_killed_itself(w)
    assert queue.handle("f-1:home").status().state == "cancelled"
    assert handle.status().state == "running"
    (record,) = _run_worker(db_url, "peer", [handle])
    assert (record.executor_id, record.locality, record.previous_executor_id) == (
        "peer",
        "moved",
        "home",
    )
    _assert_once_in_order(tmp_path, "s1", 1)


def _exists(queue: TurnQueue, turn_id: str) -> bool:
    try:
        queue.handle(turn_id)
    except KeyError:
        return False
    return True


def test_a_turn_whose_worker_died_under_it_too_often_is_cancelled_not_taken_over(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """DBOS's own recovery limit restarts at every ``resume_workflow``: takeovers are counted
    on the turn instead (an attribute of its workflow)."""
    poison = queue.submit(_params(tmp_path, "s1", "s1 turn 1"), turn_id="x-1")
    after = queue.submit(_params(tmp_path, "s1", "s1 turn 2"), turn_id="x-2")
    ghost = _spawn(db_url, "ghost", ending="hang")
    try:
        _wait_for(lambda: poison.status().state == "running")
    finally:
        ghost.kill()
        ghost.communicate(timeout=10)
    client = dbos_client(db_url)
    try:  # as if it had killed that many workers already
        client.update_workflow_attributes("x-1", {"takeovers": MAX_TAKEOVERS}, merge=True)
        assert take_over(client, liveness_for(db_url), "peer") == 0
    finally:
        client.destroy()
    with pytest.raises(TurnFailed, match="cancelled"):
        poison.result(timeout=10)
    assert after.status().state == "enqueued"  # next in its session, for the next worker


def test_a_session_whose_dead_home_is_being_taken_over_runs_elsewhere(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """A peer holds a dead home's alive lock while it takes its turns over: no live home to
    forward the session's turn to (its serving lock went with it)."""
    homes = Homes(db_url)
    homes.set(session_lane(_params(tmp_path, "s1", "-")), "w1")
    homes.close()
    with liveness_for(db_url).claim("w1") as dead:
        assert dead
        handle = queue.submit(_params(tmp_path, "s1", "s1 turn 1"), turn_id="c-1")
        (record,) = _run_worker(db_url, "w2", [handle])
    assert (record.executor_id, record.locality, record.previous_executor_id) == (
        "w2",
        "moved",
        "w1",
    )
