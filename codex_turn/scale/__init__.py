"""codex-turn beyond one process: turns as DBOS durable workflows (extra ``scale``).

``pip install 'codex-turn[scale]'`` (DBOS, MIT: a library, not a server). One system
database holds the queue and every turn's checkpoint: a SQLite file embedded in one machine
(``sqlite:///path/turns.sqlite``), Postgres for workers on many (``postgresql://...``), the
same code.

* :class:`TurnQueue` submits a turn (:meth:`TurnQueue.submit`, idempotent by turn id) and
  returns a :class:`TurnHandle`; any process reads its :class:`TurnStatus` and
  :class:`TurnRecord` later by the turn id (:meth:`TurnQueue.handle`).
* :class:`TurnWorker` (or ``codex-turn worker --db URL``) runs them: one DBOS queue
  partitioned by session (``partition_concurrency=1``): the turns of a session run one at a
  time in submission order across all workers; turns of different sessions run in parallel.
* A turn is a workflow with one durable step that calls :func:`~codex_turn.run_codex_turn`
  with the turn id as its ``idempotency_key`` (see :mod:`codex_turn.scale._workflow` for why
  a re-run after a crash writes nothing twice). A worker that dies mid-turn leaves the turn
  pending; a live worker's watchdog re-enqueues it within a fraction of a second (see
  :mod:`codex_turn.scale._watchdog`), or a worker restarted with the same executor id does.

``run_codex_turn`` stays the direct API; this package adds durability, not a second way to
run a turn.
"""

from __future__ import annotations

try:
    import dbos as _dbos  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError("codex_turn.scale needs DBOS: pip install 'codex-turn[scale]'") from error

from codex_turn.scale._queue import (
    TurnFailed,
    TurnHandle,
    TurnQueue,
    TurnState,
    TurnStatus,
    session_lane,
)
from codex_turn.scale._wire import TurnRecord, params_from_wire, params_to_wire
from codex_turn.scale._worker import TurnWorker
from codex_turn.scale._workflow import mirrored_turn

__all__ = [
    "TurnFailed",
    "TurnHandle",
    "TurnQueue",
    "TurnRecord",
    "TurnState",
    "TurnStatus",
    "TurnWorker",
    "mirrored_turn",
    "params_from_wire",
    "params_to_wire",
    "session_lane",
]
