"""codex-turn beyond one process: turns as DBOS durable workflows (extra ``scale``).

``pip install 'codex-turn[scale]'`` (DBOS, MIT: a library, not a server). One system
database holds the queue and every turn's outcome: a SQLite file embedded in one machine
(``sqlite:///path/turns.sqlite``, created owner-only), Postgres for workers on many
(``postgresql://...``), the same code, on DBOS's public API only.

* :class:`TurnQueue` submits a turn (:meth:`TurnQueue.submit`, idempotent by turn id: the
  workflow id) and returns a :class:`QueuedTurn`; any process reads its :class:`TurnStatus`
  and :class:`TurnRecord` later by the turn id (:meth:`TurnQueue.handle`).
* :class:`TurnWorker` (or ``codex-turn worker --db URL``) runs them. One DBOS queue,
  partitioned by session (``partition_concurrency=1``), runs a session's turns one at a time
  in submission order on any worker; a turn prefers the worker whose Codex home holds its
  session's thread, and ``TurnRecord.locality`` says where it ran
  (:mod:`codex_turn.scale._workflow`).
* A turn calls :func:`~codex_turn.run_codex_turn` with the turn id as its
  ``idempotency_key``, so a re-run after a crash writes nothing twice. A worker restarted
  under the same executor id recovers its turns (DBOS); a dead worker's turns are put back on
  the queue by a live peer within a fraction of a second (:mod:`codex_turn.scale._worker`).

``run_codex_turn`` stays the direct API; this package adds durability, not a second way to
run a turn.
"""

from __future__ import annotations

try:
    import dbos as _dbos  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError("codex_turn.scale needs DBOS: pip install 'codex-turn[scale]'") from error

from codex_turn.scale._locks import ExecutorIdInUse, ExecutorLockLost
from codex_turn.scale._queue import (
    InvalidQueueConfig,
    QueuedTurn,
    QueuedTurnState,
    TurnFailed,
    TurnQueue,
    TurnStatus,
)
from codex_turn.scale._wire import TurnRecord, params_from_wire, params_to_wire, session_lane
from codex_turn.scale._worker import TurnWorker
from codex_turn.scale._workflow import mirrored_turn

__all__ = [
    "ExecutorIdInUse",
    "ExecutorLockLost",
    "InvalidQueueConfig",
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
