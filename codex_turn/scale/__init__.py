"""codex-turn beyond one process: turns as DBOS durable workflows (extra ``scale``).

``pip install 'codex-turn[scale]'`` (DBOS, MIT: a library, not a server). One system
database holds the queue and every turn's checkpoint: a SQLite file embedded in one machine
(``sqlite:///path/turns.sqlite``), Postgres for workers on many (``postgresql://...``), the
same code.

* :class:`TurnQueue` submits a turn (:meth:`TurnQueue.submit`, idempotent by turn id) and
  returns a :class:`QueuedTurn`; any process reads its :class:`TurnStatus` and
  :class:`TurnRecord` later by the turn id (:meth:`TurnQueue.handle`). A waiting handle is
  woken by the worker when the turn ends (on one machine; else it polls).
* :class:`TurnWorker` (or ``codex-turn worker --db URL``) runs them. Routing is sticky
  (:mod:`codex_turn.scale._routing`): a session's turns go to the worker whose Codex home
  holds the session's thread while that worker is alive and serving, to another live worker
  when it is dead or draining (a fresh thread there, the engine's context re-projected), and
  ``TurnRecord.locality`` says which (``"sticky"``, ``"moved"``, ``"first"``). Each worker
  dequeues a DBOS queue of its own, partitioned by session (``partition_concurrency=1``); a
  session's unfinished turns are always on one queue, so they run one at a time in submission
  order, across moves too; turns of different sessions run in parallel.
* A turn is a workflow that calls :func:`~codex_turn.run_codex_turn` with the turn id as its
  ``idempotency_key`` (see :mod:`codex_turn.scale._workflow` for why a re-run after a crash
  writes nothing twice). A worker that dies mid-turn leaves the turn pending; a live worker's
  watchdog moves it and the rest of the dead worker's queue to live workers within a fraction
  of a second (see :mod:`codex_turn.scale._watchdog`), or a worker restarted with the same
  executor id runs it again.

``run_codex_turn`` stays the direct API; this package adds durability, not a second way to
run a turn.
"""

from __future__ import annotations

try:
    import dbos as _dbos  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError("codex_turn.scale needs DBOS: pip install 'codex-turn[scale]'") from error

from codex_turn.scale._queue import (
    QueuedTurn,
    QueuedTurnState,
    TurnFailed,
    TurnQueue,
    TurnStatus,
    session_lane,
)
from codex_turn.scale._wire import TurnRecord, params_from_wire, params_to_wire
from codex_turn.scale._worker import TurnWorker
from codex_turn.scale._workflow import mirrored_turn

__all__ = [
    "QueuedTurn",
    "QueuedTurnState",
    "TurnFailed",
    "TurnQueue",
    "TurnRecord",
    "TurnStatus",
    "TurnWorker",
    "mirrored_turn",
    "params_from_wire",
    "params_to_wire",
    "session_lane",
]
