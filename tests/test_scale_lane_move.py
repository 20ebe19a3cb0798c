"""A session's move off a dead worker's queue is all or nothing (:meth:`Router.move_lane`).

The routing's invariant (:mod:`codex_turn.scale._routing`): all unfinished turns of a session
sit on one queue, the route's. A move that went turn by turn and pointed the route last could
be cut half-way by the mover's death: the early turns on the destination, the later ones on the
dead worker's queue under an unchanged route, and the dead worker, restarted, ran its queue's
later turn before the earlier one elsewhere (the chaos test saw a transcript with turns
1, 2, 4, 3, 5). Here a mover process running the watchdog's ``evacuate`` is SIGKILLed inside
its move, at each of its writes and at its commit: the session is found wholly where it was,
and the next mover moves it wholly, counting each takeover once. The move writes DBOS's own
table, so what it writes is pinned against DBOS's public ``resume_workflows``: a DBOS that
writes something else fails here (SQLite here, Postgres in ``tests/test_scale_postgres.py``).

No worker process and no Codex: turns are submitted to a DBOS queue and moved.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from test_scale import _params

from codex_turn.scale import TurnQueue
from codex_turn.scale._locks import executor_locks_for
from codex_turn.scale._routing import (
    INBOX,
    MAX_TAKEOVERS,
    TAKEOVERS,
    Router,
    statuses_of,
    worker_queue,
)

LANE = "agent:main:s1"
GHOST_QUEUE = worker_queue("ghost")


@pytest.fixture
def private_texts() -> set[str]:
    """A session key is logged masked (``tests/conftest.py`` checks every captured event)."""
    return {LANE}


#: What a move of a running turn must reset: set to something else first.
_RUNNING = {
    "status": "PENDING",
    "executor_id": "ghost",
    "owner_xid": "xid-1",
    "recovery_attempts": 3,
    "workflow_deadline_epoch_ms": 9_000_000_000_000,
    "deduplication_id": "dedup-1",
    "started_at_epoch_ms": 1_000,
    "completed_at": 2_000,
    # kept by both (the destination's dequeue filters on the version, orders by priority)
    "application_version": "v-pin",
    "priority": 7,
}


def _status_table(db_url: str) -> str:
    return "workflow_status" if db_url.startswith("sqlite") else "dbos.workflow_status"


def _rows(db_url: str, turn_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The turns' whole DBOS rows, as DBOS holds them."""
    engine = sa.create_engine(_sa_url(db_url))
    try:
        with engine.connect() as conn:
            result = conn.execute(
                sa.text(
                    f"SELECT * FROM {_status_table(db_url)} WHERE workflow_uuid IN :ids"
                ).bindparams(sa.bindparam("ids", expanding=True)),
                {"ids": turn_ids},
            )
            return {row["workflow_uuid"]: dict(row) for row in result.mappings()}
    finally:
        engine.dispose()


def _set(db_url: str, turn_id: str, values: dict[str, Any]) -> None:
    engine = sa.create_engine(_sa_url(db_url))
    assignments = ", ".join(f"{column} = :{column}" for column in values)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"UPDATE {_status_table(db_url)} SET {assignments} WHERE workflow_uuid = :id"
                ),
                {**values, "id": turn_id},
            )
    finally:
        engine.dispose()


def _sa_url(db_url: str) -> str:
    if db_url.startswith("sqlite"):
        return db_url
    return str(sa.make_url(db_url).set(drivername="postgresql+psycopg"))


@contextlib.contextmanager
def _peer(db_url: str) -> Iterator[tuple[Router, Any]]:
    """A live, serving worker "peer" (its lock held here) and a router and DBOS client."""
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=db_url, application_name="codex-turn")
    locks = executor_locks_for(db_url)
    locks.hold("peer", 1)
    router = Router(db_url, statuses=functools.partial(statuses_of, client), locks=locks)
    try:
        router.set_worker("peer", "serving")
        yield router, client
    finally:
        locks.release()
        router.close()
        client.destroy()


def _on_ghost(tmp_path: Path, db_url: str, queue: TurnQueue, count: int) -> list[str]:
    """``count`` turns of one session on the queue of "ghost", which then dies; its first
    turn was running (``PENDING``) when it did."""
    ghost = executor_locks_for(db_url)
    ghost.hold("ghost", 1)
    router = Router(db_url, statuses=lambda ids: {}, locks=ghost)
    try:
        router.set_worker("ghost", "serving")
        turn_ids = [f"g-{n}" for n in range(1, count + 1)]
        for turn_id in turn_ids:
            handle = queue.submit(_params(tmp_path, "s1", turn_id), turn_id=turn_id)
            assert handle.routed in ("first", "behind")  # behind the first, on its queue
        _set(db_url, turn_ids[0], {"status": "PENDING", "executor_id": "ghost"})
    finally:
        ghost.release()
        router.close()
    return turn_ids


def _route_queue(router: Router) -> str | None:
    with router.locked(LANE) as (_, route):
        return route.queue if route is not None else None


def _where(db_url: str, turn_ids: list[str]) -> list[tuple[str, str]]:
    rows = _rows(db_url, turn_ids)
    return [(rows[t]["status"], rows[t]["queue_name"]) for t in turn_ids]


#: The mover's writes, in the order it makes them, and its commit: it is killed at each.
_KILL_POINTS = (
    "INSERT INTO codex_turn_takeovers",
    "workflow_status SET",
    "UPDATE codex_turn_routes",
    "commit",
)

_MOVER = textwrap.dedent(
    """
    import os, signal, sys
    import sqlalchemy as sa
    from dbos import DBOSClient
    from codex_turn.scale._locks import executor_locks_for
    from codex_turn.scale._routing import Router, evacuate, worker_queue
    from codex_turn.scale._watchdog import DbosMoves

    db_url, point = sys.argv[1:3]
    client = DBOSClient(system_database_url=db_url, application_name="codex-turn")
    router = Router(db_url, statuses=lambda ids: {}, locks=executor_locks_for(db_url))

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # the mover dies inside its move

    if point == "commit":
        sa.event.listen(router.engine, "commit", lambda conn: die())
    else:
        @sa.event.listens_for(router.engine, "before_cursor_execute")
        def before(conn, cursor, statement, parameters, context, executemany):
            if point in statement:
                die()

    evacuate(router, DbosMoves(client), worker_queue("ghost"))
    sys.exit(3)  # not reached: the move makes every write it is killed at
    """
)


@pytest.mark.parametrize("point", _KILL_POINTS)
def test_a_mover_killed_inside_a_move_leaves_the_session_wholly_where_it_was(
    tmp_path: Path, db_url: str, queue: TurnQueue, point: str
) -> None:
    turn_ids = _on_ghost(tmp_path, db_url, queue, 3)
    before = _where(db_url, turn_ids)
    assert before == [
        ("PENDING", GHOST_QUEUE),
        ("ENQUEUED", GHOST_QUEUE),
        ("ENQUEUED", GHOST_QUEUE),
    ]
    with _peer(db_url) as (router, _client):
        mover = subprocess.run(
            [sys.executable, "-c", _MOVER, db_url, point],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            timeout=60,
        )
        assert mover.returncode == -signal.SIGKILL, mover.stderr.decode()[-2000:]
        # Nothing of the move took: every turn and the route where they were, nothing counted.
        assert _where(db_url, turn_ids) == before
        assert _route_queue(router) == GHOST_QUEUE
        assert router.takeovers(turn_ids) == {}

        # The next mover moves the session wholly, counting the running turn's takeover once.
        move = router.move_lane(LANE, GHOST_QUEUE)
        assert move is not None
        assert (move.destination, move.turn_ids, move.taken_over) == (
            worker_queue("peer"),
            tuple(turn_ids),
            ("g-1",),
        )
        assert _where(db_url, turn_ids) == [("ENQUEUED", worker_queue("peer"))] * 3
        assert _route_queue(router) == worker_queue("peer")
        assert router.takeovers(turn_ids) == {"g-1": 1}
        assert router.move_lane(LANE, GHOST_QUEUE) is None  # nothing of it is left there


def test_a_turn_submitted_after_a_move_goes_behind_the_moved_ones(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    turn_ids = _on_ghost(tmp_path, db_url, queue, 2)
    with _peer(db_url) as (router, _client):
        assert router.move_lane(LANE, GHOST_QUEUE) is not None
        late = queue.submit(_params(tmp_path, "s1", "late"), turn_id="g-late")
        assert late.routed == "behind"
        assert _where(db_url, [*turn_ids, "g-late"]) == [("ENQUEUED", worker_queue("peer"))] * 3


def test_a_session_with_no_live_destination_goes_to_the_inbox_and_stays_there(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    turn_ids = _on_ghost(tmp_path, db_url, queue, 2)
    router = Router(db_url, statuses=lambda ids: {}, locks=executor_locks_for(db_url))
    try:
        # No live worker: the destination is the inbox, which is not where the turns are...
        move = router.move_lane(LANE, GHOST_QUEUE)
        assert move is not None
        assert move.destination == INBOX
        assert _where(db_url, turn_ids) == [("ENQUEUED", INBOX)] * 2
        # ...and the inbox's own sweep finds no better place: they stay, not counted again.
        assert router.move_lane(LANE, INBOX) is None
        assert router.takeovers(turn_ids) == {"g-1": 1}
    finally:
        router.close()


def test_a_running_turn_past_its_takeovers_is_cancelled_and_the_rest_move(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    from codex_turn.scale._routing import evacuate
    from codex_turn.scale._watchdog import DbosMoves

    turn_ids = _on_ghost(tmp_path, db_url, queue, 2)
    with _peer(db_url) as (router, client):
        with router.engine.begin() as conn:
            conn.execute(sa.insert(TAKEOVERS).values(turn_id="g-1", count=MAX_TAKEOVERS))
        assert evacuate(router, DbosMoves(client), GHOST_QUEUE) == 1
        assert _where(db_url, turn_ids) == [
            ("CANCELLED", None),  # off every queue
            ("ENQUEUED", worker_queue("peer")),
        ]
        assert router.takeovers(turn_ids) == {"g-1": MAX_TAKEOVERS}


def test_the_inbox_keeps_a_session_whose_turn_runs_there(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """Only a worker of an earlier version dequeues the inbox: a session with a turn running
    there stays until it ends, decided in the move's own transaction (a claim made after the
    sweep listed the inbox is seen)."""
    from codex_turn.scale._routing import evacuate
    from codex_turn.scale._watchdog import DbosMoves

    handles = [queue.submit(_params(tmp_path, "s1", f"i-{n}"), turn_id=f"i-{n}") for n in (1, 2)]
    assert [h.routed for h in handles] == ["inbox", "behind"]
    _set(db_url, "i-1", {"status": "PENDING", "executor_id": "old-version"})
    with _peer(db_url) as (router, client):
        assert router.move_lane(LANE, INBOX, take_running=False) is None
        # The sweep's own list of busy lanes is stale (empty): the move still keeps it.
        assert evacuate(router, DbosMoves(client), INBOX, busy_lanes=lambda turns: set()) == 0
        assert _where(db_url, ["i-1", "i-2"]) == [("PENDING", INBOX), ("ENQUEUED", INBOX)]
        assert router.takeovers(["i-1"]) == {}


def test_turns_an_earlier_version_left_on_another_queue_rejoin_their_route(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """An earlier version's turn-by-turn move, cut half-way, left a session's later turn on
    the dead worker's queue while its route already named the destination: the later turn
    joins the others there, not wherever the session would go afresh."""
    turn_ids = _on_ghost(tmp_path, db_url, queue, 2)
    other = executor_locks_for(db_url)
    other.hold("other", 1)
    with _peer(db_url) as (router, client):
        router.set_worker("other", "serving")
        with router.engine.begin() as conn:  # where the session would go afresh...
            fresh = router.destination(conn, LANE, "ghost", exclude="ghost").queue
            # ...and the other live worker, which its route names
            named = ({worker_queue("peer"), worker_queue("other")} - {fresh}).pop()
            router._write(conn, LANE, queue=named, last_turn_id="g-2", ran_on="ghost")
        client.resume_workflows(["g-1"], queue_name=named)
        move = router.move_lane(LANE, GHOST_QUEUE)
        assert move is not None
        assert move.destination == named
        assert _where(db_url, turn_ids) == [("ENQUEUED", named)] * 2
    other.release()


# --- what DBOS must keep doing for the move to be DBOS's own ------------------------------------


def check_a_move_writes_what_dbos_resume_writes(tmp_path: Path, db_url: str) -> None:
    """Two running turns of two sessions on a dead worker's queue: one moved by DBOS's public
    ``resume_workflows(queue_name=...)``, the other by :meth:`Router.move_lane`. Their rows
    must come out the same, column for column, but for the ids, the session, the inputs and
    the clocks (the move keeps the partition key and the creation time: submission order)."""
    with TurnQueue(db_url) as queue:
        ghost = executor_locks_for(db_url)
        ghost.hold("ghost", 1)
        router = Router(db_url, statuses=lambda ids: {}, locks=ghost)
        try:
            router.set_worker("ghost", "serving")
            for session in ("s1", "s2"):
                queue.submit(_params(tmp_path, session, "hi"), turn_id=f"pin-{session}")
        finally:
            ghost.release()
            router.close()
    for turn_id in ("pin-s1", "pin-s2"):
        _set(db_url, turn_id, {**_RUNNING, "deduplication_id": f"dedup-{turn_id}"})
    before = _rows(db_url, ["pin-s1", "pin-s2"])
    with _peer(db_url) as (router, client):
        client.resume_workflows(["pin-s2"], queue_name=worker_queue("peer"))
        move = router.move_lane(LANE, GHOST_QUEUE)
        assert move is not None
        assert move.turn_ids == ("pin-s1",)
    after = _rows(db_url, ["pin-s1", "pin-s2"])
    own = {"workflow_uuid", "creator_xid", "queue_partition_key", "inputs"}
    own |= {"updated_at", "created_at"}
    moved, resumed = (
        {k: v for k, v in after[t].items() if k not in own} for t in ("pin-s1", "pin-s2")
    )
    assert moved == resumed
    assert moved["status"] == "ENQUEUED"
    assert moved["queue_name"] == worker_queue("peer")
    for column in _RUNNING:  # each was reset (or kept) the same way by both
        assert moved[column] == resumed[column]
    assert after["pin-s1"]["created_at"] == before["pin-s1"]["created_at"]
    assert after["pin-s1"]["queue_partition_key"] == LANE
    assert after["pin-s1"]["updated_at"] >= before["pin-s1"]["updated_at"]


def test_a_move_writes_what_dbos_resume_workflows_writes(tmp_path: Path, db_url: str) -> None:
    check_a_move_writes_what_dbos_resume_writes(tmp_path, db_url)
