"""Sticky routing: a session's turns run on the worker whose Codex home holds its thread.

A Codex thread lives in one worker's ``CODEX_HOME``. A turn that runs on another worker does
not find it, so the harness starts a fresh thread there with the engine's context projected
into it (the binding's thread is "not found": ``thread_action`` ``rotate``): correct, but the
model loses Codex's own history and the turn pays for a re-projection. So a session's turns go
to the worker that ran its last turn while that worker is alive and serving, and elsewhere
only when it is dead or draining; every :class:`~codex_turn.scale.TurnRecord` says which
happened (``locality``: ``"sticky"``, ``"moved"`` or ``"first"``).

Built from DBOS primitives plus small tables of ours in the same system database:

* **A queue per worker.** Worker ``W`` dequeues only ``codex_turn_turns@W``
  (:func:`worker_queue`, ``DBOS.listen_queues``), partitioned by session lane with
  ``partition_concurrency=1`` like the single queue before it. The inbox
  (:data:`INBOX`, the old shared queue) holds turns no live worker could take yet; nobody
  dequeues it: a live worker's watchdog moves its turns to a worker queue.
* **Routes** (``codex_turn_routes``, one row per lane): the queue that holds the lane's turns
  (``queue``), the last turn submitted to it (``last_turn_id``) and the worker that last
  started one of its turns (``ran_on``: where its thread lives).
* **Workers** (``codex_turn_workers``): each worker's state, ``serving`` or ``draining``;
  whether it is alive is its executor lock (:mod:`codex_turn.scale._locks`).
* **Takeovers** (``codex_turn_takeovers``): how often each turn was taken over from a dead
  worker while it ran; past :data:`MAX_TAKEOVERS` it is cancelled, not moved again.

**The invariant: all unfinished turns of a lane sit on one queue, ``route.queue``**, so the
queue's partition runs them one at a time in submission order, as before. It holds because:

* a submit (:meth:`Router.submit`) holds the lane's route (SQLite: the database's write lock;
  Postgres: the route row ``FOR UPDATE``) while it decides and enqueues: if the lane's last
  turn is unfinished, the new turn goes behind it on the same queue, whoever's it is;
  otherwise to ``ran_on``'s queue if that worker is alive and serving (sticky), else to a live
  serving worker chosen by rendezvous hashing of the lane (moved, or first), else the inbox;
* a lane leaves a queue only when nobody dequeues that queue (its worker is dead and its lock
  is held by the mover, or it is draining with its queue threads stopped, or it is the inbox)
  and none of the lane's turns runs there; the mover (one per queue: it holds that queue's
  lock) moves **all** the lane's unfinished turns on it and points the route at the
  destination **in one transaction**, holding the lane's route (:meth:`Router.move_lane`), so
  no submit interleaves and a mover killed at any moment leaves the lane either wholly where
  it was or wholly moved. A turn-by-turn move (one ``resume_workflow`` each, the route last)
  could be cut half-way: the early turns on the destination, the later ones on the old queue
  with the route unchanged, and a restarted worker then ran its queue's later turn before the
  earlier one elsewhere (a partition's limit holds per queue only). The move writes what
  DBOS's ``resume_workflows(queue_name=...)`` writes (:data:`_RESUMED`, pinned against DBOS
  by ``tests/test_scale_lane_move.py``), with the partition key and creation time kept, so the
  destination runs them in submission order.

A dead worker's row is deleted only when no lane with an unfinished turn routes to its queue
(:meth:`Router.close_worker`), under its lock; until then every live watchdog keeps moving
what lands there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Literal, Protocol

import attrs
import sqlalchemy as sa
from dbos import DBOSClient
from sqlalchemy.dialects import postgresql, sqlite

from codex_turn._log import get_logger, mask_session_key
from codex_turn.scale._locks import ExecutorLocks, executor_locks_for
from codex_turn.scale._workflow import QUEUE_NAME

__all__ = [
    "INBOX",
    "INBOX_LOCK",
    "MAX_TAKEOVERS",
    "LaneMove",
    "Locality",
    "Placement",
    "Route",
    "Router",
    "TurnMoves",
    "evacuate",
    "queue_owner",
    "statuses_of",
    "worker_queue",
]

_log = get_logger(__name__)

#: Turns that no live worker could take when they were submitted (and any left on the single
#: queue of earlier versions): moved to a worker's queue by a live worker's watchdog.
INBOX: Final = QUEUE_NAME
#: The lock its mover holds (a name no worker may take as its executor id).
INBOX_LOCK: Final = "codex-turn:inbox"
_QUEUE_SEPARATOR: Final = "@"

Locality = Literal["sticky", "moved", "first"]
#: DBOS states of a turn that has not ended.
OPEN_STATUSES: Final = frozenset({"ENQUEUED", "DELAYED", "PENDING"})
#: The unfinished turns a mover takes: queued, or running on a worker that is gone.
MOVABLE_STATUSES: Final = ("ENQUEUED", "PENDING")

_metadata = sa.MetaData()
ROUTES: Final = sa.Table(
    "codex_turn_routes",
    _metadata,
    sa.Column("lane", sa.Text, primary_key=True),
    # "": no queue yet (a row just created to be locked, or a lane that only ran).
    sa.Column("queue", sa.Text, nullable=False),
    sa.Column("last_turn_id", sa.Text, nullable=True),
    sa.Column("ran_on", sa.Text, nullable=True),
)
WORKERS: Final = sa.Table(
    "codex_turn_workers",
    _metadata,
    sa.Column("executor_id", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=True),
    sa.Column("host", sa.Text, nullable=True),
    sa.Column("updated_at", sa.Float, nullable=False),
)
_queue_index = sa.Index("codex_turn_routes_queue", ROUTES.c.queue)
#: How many times each turn was taken over from a dead worker while it ran.
TAKEOVERS: Final = sa.Table(
    "codex_turn_takeovers",
    _metadata,
    sa.Column("turn_id", sa.Text, primary_key=True),
    sa.Column("count", sa.Integer, nullable=False),
)
#: DBOS's ``workflow_status``: the columns a move reads and writes (DBOS 3.x), in the schema
#: DBOS's system database uses (``Router._dbos_options`` names it).
_DBOS_PLACEHOLDER: Final = "codex_turn_dbos_schema"
WORKFLOW_STATUS: Final = sa.Table(
    "workflow_status",
    sa.MetaData(schema=_DBOS_PLACEHOLDER),
    sa.Column("workflow_uuid", sa.Text, primary_key=True),
    sa.Column("status", sa.Text),
    sa.Column("queue_name", sa.Text),
    sa.Column("queue_partition_key", sa.Text),
    sa.Column("created_at", sa.BigInteger),
    sa.Column("owner_xid", sa.Text),
    sa.Column("recovery_attempts", sa.BigInteger),
    sa.Column("workflow_deadline_epoch_ms", sa.BigInteger),
    sa.Column("deduplication_id", sa.Text),
    sa.Column("started_at_epoch_ms", sa.BigInteger),
    sa.Column("updated_at", sa.BigInteger),
    sa.Column("completed_at", sa.BigInteger),
)
#: What DBOS's ``resume_workflows(ids, queue_name=q)`` sets on a turn that has not ended,
#: besides ``queue_name`` and ``updated_at``: back to ``ENQUEUED``, no owner, no start time,
#: DBOS's recovery attempts from zero (:data:`MAX_TAKEOVERS` bounds the moves instead).
_RESUMED: Final[dict[str, Any]] = {
    "status": "ENQUEUED",
    "owner_xid": None,
    "recovery_attempts": 0,
    "workflow_deadline_epoch_ms": None,
    "deduplication_id": None,
    "started_at_epoch_ms": None,
    "completed_at": None,
}
#: A turn whose worker died under it this many times is cancelled instead of moved again:
#: it is likely what kills them (DBOS's own ``max_recovery_attempts`` restarts from zero at
#: every move, :data:`_RESUMED`). Counted in the move's own transaction: once per death.
MAX_TAKEOVERS: Final = 5


def worker_queue(executor_id: str) -> str:
    """The queue only ``executor_id`` dequeues."""
    return f"{QUEUE_NAME}{_QUEUE_SEPARATOR}{executor_id}"


def queue_owner(queue: str) -> str | None:
    """The worker that dequeues ``queue`` (``None``: the inbox)."""
    prefix = QUEUE_NAME + _QUEUE_SEPARATOR
    return queue[len(prefix) :] if queue.startswith(prefix) else None


@attrs.frozen
class Route:
    """Where a lane's turns go (see the module's invariant)."""

    lane: str
    #: ``None`` for a lane with no queue yet (created by its first submit or start).
    queue: str | None
    last_turn_id: str | None
    ran_on: str | None


@attrs.frozen
class Placement:
    """A submit's decision: the queue, and why: ``sticky`` on the live, serving worker that
    holds the lane's thread (behind its unfinished turns there, if any); ``behind`` the lane's
    unfinished turns on a queue that is not (they move together later); ``moved`` to another
    worker, the thread's being dead or draining; ``first`` for a lane no worker ran yet;
    ``inbox`` when no worker is alive."""

    queue: str
    reason: Literal["behind", "sticky", "moved", "first", "inbox"]


@attrs.frozen
class LaneMove:
    """What :meth:`Router.move_lane` moved: the lane's turns (oldest first) and those of them
    that were running when their worker died (one more takeover each)."""

    lane: str = attrs.field(repr=lambda lane: repr(mask_session_key(lane)))
    destination: str
    turn_ids: tuple[str, ...]
    taken_over: tuple[str, ...]


class TurnMoves(Protocol):
    """The DBOS side of a move that is not the move itself (:meth:`Router.move_lane`): a
    queue's unfinished turns, cancelling one, reading statuses."""

    def unfinished(self, queue: str) -> Sequence[Any]:
        """The queue's ``ENQUEUED`` and ``PENDING`` turns (DBOS ``WorkflowStatus``), oldest
        first."""

    def cancel(self, turn_id: str) -> None:
        """End the turn as cancelled."""

    def statuses(self, turn_ids: Sequence[str]) -> dict[str, str]:
        """The DBOS status of each turn that exists."""


def statuses_of(client: DBOSClient, turn_ids: Sequence[str]) -> dict[str, str]:
    """The DBOS status of each of ``turn_ids`` that exists (one read)."""
    if not turn_ids:
        return {}
    found = client.list_workflows(workflow_ids=list(turn_ids), load_input=False, load_output=False)
    return {status.workflow_id: str(status.status) for status in found}


def _score(lane: str, executor_id: str) -> bytes:
    return hashlib.blake2b(f"{lane}\0{executor_id}".encode(), digest_size=8).digest()


class Router:
    """The routes and workers of one system database (SQLAlchemy, its own connections)."""

    def __init__(
        self,
        database_url: str,
        *,
        statuses: Callable[[Sequence[str]], dict[str, str]],
        locks: ExecutorLocks | None = None,
    ) -> None:
        self.database_url = database_url
        self._statuses = statuses
        self._locks = locks
        self._own_locks = locks is None
        self.postgres = not database_url.startswith("sqlite")
        #: Where DBOS keeps its tables: its default schema on Postgres, none on SQLite.
        self._dbos_options = {
            "schema_translate_map": {_DBOS_PLACEHOLDER: "dbos" if self.postgres else None}
        }
        #: The database's clock in ms, as DBOS stamps ``updated_at`` (SQLite's before Python
        #: 3.12 to the second, as DBOS's there).
        if self.postgres:
            now: Any = sa.func.extract("epoch", sa.func.now())
        elif sys.version_info >= (3, 12):
            now = sa.func.unixepoch("subsec")
        else:
            now = sa.func.strftime("%s", "now")
        self._now_ms = sa.cast(now * 1000, sa.BigInteger)
        if self.postgres:
            url = sa.make_url(database_url).set(drivername="postgresql+psycopg")
            self.engine = sa.create_engine(url, pool_pre_ping=True)
            #: Plain reads (no lock taken).
            self.reader = self.engine
            self._insert: Any = postgresql.insert
        else:
            self.engine = sa.create_engine(database_url)
            sa.event.listen(self.engine, "connect", _sqlite_connect)
            # Every transaction of ours takes the database's write lock first: a route is
            # read and written under it (pysqlite would defer BEGIN to the first write).
            sa.event.listen(self.engine, "begin", _sqlite_begin)
            self.reader = sa.create_engine(database_url)
            sa.event.listen(self.reader, "connect", _sqlite_connect)
            self._insert = sqlite.insert
        self._ensure_tables()

    def _ensure_tables(self) -> None:
        for attempt in range(3):
            try:
                _metadata.create_all(self.engine, checkfirst=True)
                return
            except sa.exc.DBAPIError:  # two processes creating them at once
                if attempt == 2:
                    raise
                time.sleep(0.05)

    @property
    def locks(self) -> ExecutorLocks:
        if self._locks is None:
            self._locks = executor_locks_for(self.database_url)
        return self._locks

    def close(self) -> None:
        self.engine.dispose()
        self.reader.dispose()
        if self._own_locks and self._locks is not None:
            self._locks.release()  # holds none: closes its connection (Postgres)

    # --- liveness ---------------------------------------------------------------------------

    def alive(self, executor_id: str) -> bool:
        """Whether ``executor_id`` lives: its own process holds its lock (a peer's claim,
        cleaning up after it, says it is dead)."""
        return self.locks.alive(executor_id)

    def _serving(self, conn: sa.Connection, executor_id: str) -> bool:
        """``executor_id`` says it is serving (its row locked against deletion meanwhile)."""
        query = sa.select(WORKERS.c.state).where(WORKERS.c.executor_id == executor_id)
        if self.postgres:
            query = query.with_for_update(read=True)
        return conn.execute(query).scalar_one_or_none() == "serving"

    def _pick(self, conn: sa.Connection, lane: str, exclude: str | None) -> str | None:
        """A live serving worker for ``lane``: the highest rendezvous score of the lane and
        the worker (stable and spread out; a worker that goes away moves only its lanes)."""
        rows = conn.execute(sa.select(WORKERS.c.executor_id).where(WORKERS.c.state == "serving"))
        for executor_id in sorted(
            (row[0] for row in rows), key=lambda e: _score(lane, e), reverse=True
        ):
            if executor_id == exclude:
                continue
            if self._serving(conn, executor_id) and self.alive(executor_id):
                return str(executor_id)
        return None

    def destination(
        self, conn: sa.Connection, lane: str, ran_on: str | None, exclude: str | None = None
    ) -> Placement:
        """Where a lane with no unfinished turn goes now (never to ``exclude``: a worker
        whose turns are being moved away)."""
        if (
            ran_on is not None
            and ran_on != exclude
            and self._serving(conn, ran_on)
            and self.alive(ran_on)
        ):
            return Placement(worker_queue(ran_on), "sticky")
        picked = self._pick(conn, lane, exclude)
        if picked is None:
            return Placement(INBOX, "inbox")
        return Placement(worker_queue(picked), "first" if ran_on is None else "moved")

    # --- routes -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, lane: str) -> Iterator[tuple[sa.Connection, Route | None]]:
        """The lane's route, held until the block ends (then committed)."""
        with self.engine.begin() as conn:
            if self.postgres:
                conn.execute(
                    self._insert(ROUTES)
                    .values(lane=lane, queue="", last_turn_id=None, ran_on=None)
                    .on_conflict_do_nothing(index_elements=[ROUTES.c.lane])
                )
                query = sa.select(ROUTES).where(ROUTES.c.lane == lane).with_for_update()
            else:
                query = sa.select(ROUTES).where(ROUTES.c.lane == lane)
            row = conn.execute(query).first()
            route = None
            if row is not None and (row.queue or row.ran_on):
                route = Route(row.lane, row.queue or None, row.last_turn_id, row.ran_on)
            yield conn, route

    def _write(
        self,
        conn: sa.Connection,
        lane: str,
        *,
        queue: str | None,
        last_turn_id: str | None,
        ran_on: str | None,
    ) -> None:
        values = {"queue": queue or "", "last_turn_id": last_turn_id, "ran_on": ran_on}
        conn.execute(
            self._insert(ROUTES)
            .values(lane=lane, **values)
            .on_conflict_do_update(index_elements=[ROUTES.c.lane], set_=values)
        )

    def submit(
        self,
        lane: str,
        turn_id: str,
        enqueue: Callable[[sa.Connection, str], None],
    ) -> Placement | None:
        """Place and enqueue a new turn of ``lane`` (``enqueue(conn, queue)`` inserts it in
        this transaction, refusing a turn id that exists); ``None`` when ``turn_id`` exists
        already (nothing is written)."""
        with self.locked(lane) as (conn, route):
            if (
                route is not None
                and route.queue is not None
                and route.ran_on is not None
                and route.queue == worker_queue(route.ran_on)
                and self._serving(conn, route.ran_on)
                and self.alive(route.ran_on)
            ):
                # The common case: the lane's queue is its thread's live, serving worker's.
                # Behind an unfinished turn or not, the turn goes there: no status to read.
                placement = Placement(route.queue, "sticky")
            else:
                last = route.last_turn_id if route is not None else None
                statuses = self._statuses([turn_id] + ([last] if last else []))
                if turn_id in statuses:
                    return None
                if route is not None and route.queue and statuses.get(last or "") in OPEN_STATUSES:
                    placement = Placement(route.queue, "behind")
                else:
                    placement = self.destination(conn, lane, route.ran_on if route else None)
            enqueue(conn, placement.queue)
            self._write(
                conn,
                lane,
                queue=placement.queue,
                last_turn_id=turn_id,
                ran_on=route.ran_on if route is not None else None,
            )
        return placement

    def note_run(self, lane: str, executor_id: str) -> tuple[Locality, str | None]:
        """A turn of ``lane`` starts on ``executor_id``: whether the lane's previous turn
        started there too (its thread is here), and where it started."""
        if self.ran_on(lane) == executor_id:  # a plain read first: the common, sticky case
            return "sticky", executor_id
        with self.locked(lane) as (conn, route):
            previous = route.ran_on if route is not None else None
            self._write(
                conn,
                lane,
                queue=route.queue if route is not None else None,
                last_turn_id=route.last_turn_id if route is not None else None,
                ran_on=executor_id,
            )
        if previous == executor_id:
            return "sticky", previous
        return ("first" if previous is None else "moved"), previous

    def ran_on(self, lane: str) -> str | None:
        """The worker that last started a turn of ``lane``."""
        with self.reader.connect() as conn:
            value = conn.execute(
                sa.select(ROUTES.c.ran_on).where(ROUTES.c.lane == lane)
            ).scalar_one_or_none()
        return None if value is None else str(value)

    def takeovers(self, turn_ids: Sequence[str]) -> dict[str, int]:
        """How often each of ``turn_ids`` was taken over from a dead worker so far (those
        never taken over are left out)."""
        if not turn_ids:
            return {}
        with self.reader.connect() as conn:
            rows = conn.execute(
                sa.select(TAKEOVERS.c.turn_id, TAKEOVERS.c.count).where(
                    TAKEOVERS.c.turn_id.in_(list(turn_ids))
                )
            )
            return {str(row[0]): int(row[1]) for row in rows}

    def move_lane(self, lane: str, source: str, *, take_running: bool = True) -> LaneMove | None:
        """Move every unfinished turn of ``lane`` on ``source`` to the lane's destination and
        point its route there, in one transaction holding the route (the module's
        invariant): a mover killed at any moment leaves the lane wholly on ``source`` or
        wholly moved. Each turn that was running (its worker died under it) counts one more
        takeover in the same transaction. ``take_running=False`` (a queue whose worker may
        still run a turn of it: the inbox, a draining worker): a lane with a running turn
        there stays, decided in the transaction. ``None``: the lane stays (its destination is
        ``source``, it has a running turn it may not take, or none of its turns is left
        there). The caller is ``source``'s only mover."""
        status = WORKFLOW_STATUS
        on_source = sa.and_(
            status.c.queue_name == source,
            # Literal, so that SQLite's planner uses DBOS's partial index of unfinished turns
            # (bound values would scan every turn ever run, under the write lock).
            status.c.status.in_([sa.literal_column(f"'{value}'") for value in MOVABLE_STATUSES]),
            sa.or_(
                status.c.queue_partition_key == lane,
                # a turn of an earlier version, with no partition key: a lane of its own
                sa.and_(status.c.queue_partition_key.is_(None), status.c.workflow_uuid == lane),
            ),
        )
        with self.locked(lane) as (conn, route):
            ran_on = route.ran_on if route is not None else None
            target = (
                self._rejoined(conn, route, source)
                or self.destination(conn, lane, ran_on, exclude=queue_owner(source)).queue
            )
            if target == source:
                return None
            query = (
                sa.select(status.c.workflow_uuid, status.c.status)
                .where(on_source)
                .order_by(status.c.created_at, status.c.workflow_uuid)
            )
            if self.postgres:  # against DBOS's claim of one of them (it skips locked rows)
                query = query.with_for_update()
            rows = conn.execute(query, execution_options=self._dbos_options).all()
            running = tuple(str(row[0]) for row in rows if row[1] == "PENDING")
            if not rows or (running and not take_running):
                return None
            turn_ids = tuple(str(row[0]) for row in rows)
            for turn_id in running:
                conn.execute(
                    self._insert(TAKEOVERS)
                    .values(turn_id=turn_id, count=1)
                    .on_conflict_do_update(
                        index_elements=[TAKEOVERS.c.turn_id],
                        set_={"count": TAKEOVERS.c.count + 1},
                    )
                )
            conn.execute(
                sa.update(status)
                .where(on_source, status.c.workflow_uuid.in_(turn_ids))
                .values(queue_name=target, updated_at=self._now_ms, **_RESUMED),
                execution_options=self._dbos_options,
            )
            if route is None or route.queue is None:  # turns with no route (an older version)
                self._write(conn, lane, queue=target, last_turn_id=turn_ids[-1], ran_on=ran_on)
            elif route.queue == source:
                conn.execute(sa.update(ROUTES).where(ROUTES.c.lane == lane).values(queue=target))
        return LaneMove(lane, target, turn_ids, running)

    def _rejoined(self, conn: sa.Connection, route: Route | None, source: str) -> str | None:
        """The route's queue, for turns of a lane that an earlier version's turn-by-turn move
        left behind on ``source`` (with this version the route names the queue of all the
        lane's unfinished turns): they join the others there, while its worker serves."""
        if route is None or route.queue is None or route.queue == source:
            return None
        queue, owner = route.queue, queue_owner(route.queue)
        if owner is None or owner == queue_owner(source):
            return None
        if not (self._serving(conn, owner) and self.alive(owner)):
            return None
        _log.warning(
            "rejoined a session's turns left on another queue",
            lane=mask_session_key(route.lane),
            source=source,
            destination=queue,
        )
        return queue

    # --- workers ----------------------------------------------------------------------------

    def set_worker(self, executor_id: str, state: Literal["serving", "draining"]) -> None:
        values = {
            "state": state,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "updated_at": time.time(),
        }
        with self.engine.begin() as conn:
            conn.execute(
                self._insert(WORKERS)
                .values(executor_id=executor_id, **values)
                .on_conflict_do_update(index_elements=[WORKERS.c.executor_id], set_=values)
            )

    def workers(self) -> dict[str, str]:
        """Every registered worker and its state (dead ones included until closed)."""
        with self.reader.connect() as conn:
            rows = conn.execute(sa.select(WORKERS.c.executor_id, WORKERS.c.state))
            return {str(row[0]): str(row[1]) for row in rows}

    def close_worker(self, executor_id: str, moves: TurnMoves) -> bool:
        """Forget a dead worker (its lock held by the caller) once nothing can reach its
        queue: no turn left on it, and no lane routed to it with an unfinished turn (a
        submit behind such a turn would land where nobody looks). False: not yet."""
        queue = worker_queue(executor_id)
        with self.engine.begin() as conn:
            routes = sa.select(ROUTES.c.last_turn_id).where(ROUTES.c.queue == queue)
            worker = sa.select(WORKERS.c.executor_id).where(WORKERS.c.executor_id == executor_id)
            if self.postgres:  # against a submit going behind on it or choosing it; routes
                # first, the worker's row second: the order a submit takes them in
                routes, worker = routes.with_for_update(), worker.with_for_update()
            last_ids = [row[0] for row in conn.execute(routes) if row[0]]
            conn.execute(worker)
            if moves.unfinished(queue):
                return False
            statuses = self._statuses(last_ids) if last_ids else {}
            if any(status in OPEN_STATUSES for status in statuses.values()):
                return False
            conn.execute(sa.delete(WORKERS).where(WORKERS.c.executor_id == executor_id))
        return True


def evacuate(
    router: Router,
    moves: TurnMoves,
    source: str,
    *,
    busy_lanes: Callable[[Sequence[Any]], set[str]] | None = None,
    rounds: int = 20,
) -> int:
    """Move every lane on ``source`` to its destination (see the module's invariant); how
    many turns moved. The caller is ``source``'s only mover and nothing dequeues it.
    ``busy_lanes`` names lanes that must stay (a draining worker's running turns)."""
    total = 0
    for _ in range(rounds):
        turns = moves.unfinished(source)
        if not turns:
            return total
        lanes: dict[str, list[Any]] = {}
        for turn in turns:
            lanes.setdefault(turn.queue_partition_key or turn.workflow_id, []).append(turn)
        staying = busy_lanes(turns) if busy_lanes is not None else set()
        progressed = False
        for lane, lane_turns in lanes.items():
            if lane in staying:
                continue
            running = [turn.workflow_id for turn in lane_turns if turn.status == "PENDING"]
            for turn_id, taken in router.takeovers(running).items():
                if taken >= MAX_TAKEOVERS:  # it dies with its worker once more: not again
                    moves.cancel(turn_id)
                    _log.error(
                        "cancelled a turn whose worker died under it too often",
                        turn_id=turn_id,
                        lane=mask_session_key(lane),
                        takeovers=taken,
                    )
            # A queue with its own busy lanes (the inbox, a draining worker) may still run a
            # turn of any lane: the move itself checks, in its transaction.
            move = router.move_lane(lane, source, take_running=busy_lanes is None)
            if move is None:
                continue
            total += len(move.turn_ids)
            progressed = True
            _log.info(
                "moved a session's turns",
                lane=mask_session_key(lane),
                turns=len(move.turn_ids),
                source=source,
                destination=move.destination,
            )
        if not progressed:
            return total
    return total


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # BEGIN is ours (_sqlite_begin)
    dbapi_connection.execute("PRAGMA busy_timeout=30000")


def _sqlite_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")
