"""The SQLite file: schema, connections and transactions. Synchronous; runs in worker threads.

Theory
------
*One file, many writers, short transactions.* The store is one SQLite database in WAL mode
(readers never block the writer, the writer never blocks readers) with
``synchronous=NORMAL`` (a commit survives the process being killed; only an OS crash can
lose the newest commits, never corrupt older ones). Every write is a ``BEGIN IMMEDIATE``
transaction: it takes the write lock up front, so it either waits (``busy_timeout``) or
proceeds, and can never deadlock half-way through as a deferred transaction upgrading to a
writer can (``SQLITE_BUSY_SNAPSHOT``). Transactions hold no model call and no file I/O other
than SQLite's own: callers prepare rows before ``BEGIN`` and summarise between transactions.

*The one asynchronous piece* is :class:`StoreAccess`: it opens the store lazily, on first use,
in a worker thread (opening migrates, and may wait up to ``busy_timeout`` for the write lock:
never on the event loop, never in a constructor), runs each unit of work in a worker thread
(``anyio.to_thread``) and turns a database error (not lock contention) into "the store is
unhealthy", which is what ``info.owns_compaction`` reports. A store that cannot be opened
(not a database, a newer schema, a file that is not this engine's, an unwritable place) is
remembered as such: every later use raises :class:`StoreError` at once, until ``doctor``
(an operator's act) tries again. Lock contention while opening is not remembered.

*Connections are pooled, not shared.* A :class:`Pool` hands each worker thread a connection
of its own for the duration of one operation (``check_same_thread=False``, so a connection
may move between pool threads, but never serves two at once). There is no process-wide lock
around I/O: SQLite's file lock is the only writer serialisation, across threads and processes
alike.

*The schema* (``user_version`` 2; a version-1 store is migrated in place when opened):

``conversations``  one per session key while active (a partial unique index); the counters
                   a transaction needs (``next_seq``, ``next_ordinal``, ``context_tokens``),
                   the projection ``epoch``, the path sync checkpoint (``synced_len``,
                   ``synced_anchor``) and the transcript checkpoint (``boot_*``). ``uid`` is
                   derived from the session key and its generation (``lineages``), so two
                   stores fed alike name their conversations (and epochs, summaries) alike;
                   conversations migrated from version 1 keep their random uid.
``lineages``       per session key, how many conversations it ever started here (a reset
                   starts the next generation); kept when retention deletes conversations,
                   so a generation, hence a uid, is never reused in one store.
``messages``       every message, never deleted by compaction (ids are never reused, not even
                   after retention: ``AUTOINCREMENT``): ``source_id`` is unique per
                   conversation (``_messages.py``), ``content`` the message's JSON (zlib'd
                   when large), ``calls``/``results`` its tool-call links; indexed by
                   ``(conversation, seq)`` for ingest's alignment (``_store.deliver``).
``summaries``      the DAG's nodes, ids derived from their sources (deterministic), linked to
                   their sources by ``summary_sources`` (a message *or* a child summary).
``context_items``  the ordered projection: ``(conversation, ordinal)`` -> one message or one
                   summary, with its token count. Ordinals are sparse: compaction replaces a
                   run of items by one summary at the run's first ordinal, so nothing is
                   ever renumbered.
``turns``          the per-turn ledger (idempotency of ``after_turn``).
``maintenance``    one coalesced compaction-debt row per conversation, with backoff.

Foreign keys are declared (``PRAGMA foreign_key_check`` verifies them in ``doctor``) but not
enforced per statement: every write path keeps them by construction, and retention deletes
whole conversations table by table.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final, ParamSpec, TypeVar

import anyio
import anyio.to_thread

from codex_turn._log import format_error, get_logger

__all__ = ["SCHEMA_VERSION", "Pool", "StoreAccess", "StoreError", "read_tx", "write_tx"]

SCHEMA_VERSION: Final = 2

_log = get_logger("codex_turn.engines.sqlite")
T = TypeVar("T")
P = ParamSpec("P")

_TABLES: Final = (
    """CREATE TABLE conversations(
        id INTEGER PRIMARY KEY,
        uid TEXT NOT NULL,
        session_key TEXT NOT NULL,
        created_at REAL NOT NULL,
        archived_at REAL,
        next_seq INTEGER NOT NULL DEFAULT 0,
        next_ordinal INTEGER NOT NULL DEFAULT 0,
        context_tokens INTEGER NOT NULL DEFAULT 0,
        epoch TEXT NOT NULL,
        synced_len INTEGER NOT NULL DEFAULT 0,
        synced_anchor TEXT,
        boot_path TEXT,
        boot_dev INTEGER,
        boot_ino INTEGER,
        boot_size INTEGER,
        boot_mtime_ns INTEGER)""",
    """CREATE UNIQUE INDEX conversations_active ON conversations(session_key)
        WHERE archived_at IS NULL""",
    """CREATE TABLE messages(
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        seq INTEGER NOT NULL,
        source_id TEXT NOT NULL,
        role TEXT NOT NULL,
        tokens INTEGER NOT NULL,
        ts INTEGER,
        calls TEXT,
        results TEXT,
        content BLOB NOT NULL,
        UNIQUE(conversation_id, source_id))""",
    "CREATE INDEX messages_order ON messages(conversation_id, seq)",
    """CREATE TABLE lineages(
        session_key TEXT PRIMARY KEY,
        started INTEGER NOT NULL) WITHOUT ROWID""",
    """CREATE TABLE summaries(
        id TEXT PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        kind TEXT NOT NULL CHECK (kind IN ('leaf', 'condensed')),
        depth INTEGER NOT NULL,
        content TEXT NOT NULL,
        tokens INTEGER NOT NULL,
        source_tokens INTEGER NOT NULL,
        descendant_count INTEGER NOT NULL,
        earliest_ts INTEGER,
        latest_ts INTEGER,
        summarizer TEXT NOT NULL,
        created_at REAL NOT NULL)""",
    "CREATE INDEX summaries_conversation ON summaries(conversation_id)",
    """CREATE TABLE summary_sources(
        summary_id TEXT NOT NULL REFERENCES summaries(id),
        position INTEGER NOT NULL,
        message_id INTEGER REFERENCES messages(id),
        child_id TEXT REFERENCES summaries(id),
        PRIMARY KEY (summary_id, position),
        CHECK ((message_id IS NULL) <> (child_id IS NULL))) WITHOUT ROWID""",
    """CREATE TABLE context_items(
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        ordinal INTEGER NOT NULL,
        message_id INTEGER REFERENCES messages(id),
        summary_id TEXT REFERENCES summaries(id),
        tokens INTEGER NOT NULL,
        PRIMARY KEY (conversation_id, ordinal),
        CHECK ((message_id IS NULL) <> (summary_id IS NULL))) WITHOUT ROWID""",
    """CREATE INDEX context_summaries ON context_items(conversation_id, ordinal)
        WHERE summary_id IS NOT NULL""",
    """CREATE TABLE turns(
        conversation_id INTEGER NOT NULL REFERENCES conversations(id),
        turn_key TEXT NOT NULL,
        message_count INTEGER NOT NULL,
        ingested INTEGER NOT NULL,
        committed_at REAL NOT NULL,
        PRIMARY KEY (conversation_id, turn_key)) WITHOUT ROWID""",
    """CREATE TABLE maintenance(
        conversation_id INTEGER PRIMARY KEY REFERENCES conversations(id),
        pending INTEGER NOT NULL,
        reason TEXT,
        budget INTEGER,
        requested_at REAL,
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_after REAL NOT NULL DEFAULT 0,
        last_error TEXT)""",
)

#: Version 1 -> 2: the seq index and the lineages (generations count the conversations a key
#: already has, so no migrated conversation's generation is ever handed out again).
_MIGRATE_1: Final = (
    "CREATE INDEX messages_order ON messages(conversation_id, seq)",
    """CREATE TABLE lineages(
        session_key TEXT PRIMARY KEY,
        started INTEGER NOT NULL) WITHOUT ROWID""",
    "INSERT INTO lineages(session_key, started) "
    "SELECT session_key, count(*) FROM conversations GROUP BY session_key",
)

_BUSY_WORDS: Final = ("locked", "busy")


class StoreError(Exception):
    """The store cannot be used: a newer schema, or a file that is not this engine's."""


def _is_busy(error: sqlite3.OperationalError) -> bool:
    text = str(error).lower()
    return any(word in text for word in _BUSY_WORDS)


def _begin(conn: sqlite3.Connection, statement: str, busy_timeout_s: float) -> None:
    # busy_timeout makes SQLite wait for the lock; a BEGIN that still reports busy (the
    # handler gave up, or a checkpoint raced it) is retried until the same deadline, so
    # SQLITE_BUSY never escapes a write while the lock is merely contended.
    deadline = time.monotonic() + busy_timeout_s
    pause = 0.005
    while True:
        try:
            conn.execute(statement)
            return
        except sqlite3.OperationalError as error:
            if not _is_busy(error) or time.monotonic() >= deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


@contextlib.contextmanager
def write_tx(conn: sqlite3.Connection, busy_timeout_s: float) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on any exception)."""
    _begin(conn, "BEGIN IMMEDIATE", busy_timeout_s)
    try:
        yield conn
    except BaseException:
        # SQLite may have ended the transaction itself (a full disk, an I/O error): then a
        # ROLLBACK would raise "no transaction is active" and hide the real error.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextlib.contextmanager
def read_tx(conn: sqlite3.Connection, busy_timeout_s: float) -> Iterator[sqlite3.Connection]:
    """A consistent snapshot for several reads (a deferred transaction, always rolled back)."""
    _begin(conn, "BEGIN", busy_timeout_s)
    try:
        yield conn
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


class Pool:
    """Connections to one database file; see the module docstring."""

    def __init__(self, path: str, *, busy_timeout_s: float) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._free: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        with self.connection() as conn:
            self._migrate(conn)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path,
            timeout=self.busy_timeout_s,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA temp_store=MEMORY")
            conn.execute("PRAGMA cache_size=-16000")
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        # auto_vacuum only takes effect on a database without tables: a new store. It lets
        # retention hand freed pages back to the file system (incremental_vacuum).
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
                break
            except sqlite3.OperationalError as error:
                if not _is_busy(error) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        if mode is None or str(mode[0]).lower() != "wal":
            raise StoreError(f"cannot use WAL journal mode (got {mode!r})")
        with write_tx(conn, self.busy_timeout_s):
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"store schema {version} is newer than this engine's ({SCHEMA_VERSION})"
                )
            if version == 0:
                tables = conn.execute(
                    "SELECT count(*) FROM sqlite_master WHERE type='table'"
                ).fetchone()[0]
                if tables:
                    raise StoreError("the file holds tables that are not this engine's")
                for statement in _TABLES:
                    conn.execute(statement)
            elif version == 1:
                for statement in _MIGRATE_1:
                    conn.execute(statement)
            if version != SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """A connection for this thread's operation; returned to the pool afterwards."""
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            conn = self._free.pop() if self._free else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            with self._lock:
                if not conn.in_transaction and not self._closed:
                    self._free.append(conn)
                    conn = None
            if conn is not None:
                conn.close()

    def write(
        self, conn: sqlite3.Connection
    ) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return write_tx(conn, self.busy_timeout_s)

    def read(
        self, conn: sqlite3.Connection
    ) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return read_tx(conn, self.busy_timeout_s)

    def release(self) -> None:
        """Close the idle connections (new ones are opened on demand)."""
        with self._lock:
            free, self._free = self._free, []
        for conn in free:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for conn in free:
            conn.close()


class StoreAccess:
    """The pool (opened lazily) and its health, shared by the engine and its compactor (no
    reference back to the engine, so a dropped engine is freed at once, without the GC)."""

    def __init__(self, path: str, busy_timeout_s: float) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.error: str | None = None
        self.pool: Pool | None = None
        #: The open failed for a reason other than contention: remembered (see the header).
        self.open_failed = False
        self.closed = False
        self._open_lock = threading.Lock()

    def open(self, *, retry: bool = False) -> Pool:
        """The pool, opening (and migrating) the store first if needed. Blocking: call it in
        a worker thread (:meth:`ready`). ``retry`` tries again after a failed open."""
        with self._open_lock:
            if self.closed:
                raise StoreError("the store is closed")
            if self.pool is not None:
                return self.pool
            if self.open_failed and not retry:
                raise StoreError(f"the context store is unavailable: {self.error}")
            try:
                self.pool = Pool(self.path, busy_timeout_s=self.busy_timeout_s)
            except (sqlite3.Error, StoreError, OSError) as error:
                if isinstance(error, sqlite3.OperationalError) and _is_busy(error):
                    raise  # contention, not a broken store: the next use tries again
                self._failed(error)
                raise StoreError(f"the context store is unavailable: {self.error}") from error
            self.open_failed = False
            self.error = None
            return self.pool

    def _failed(self, error: BaseException) -> None:
        self.open_failed = True
        self.error = format_error(error)
        _log.warning("sqlite context store unavailable", error=self.error)

    async def ready(self) -> Pool:
        """The open pool; the first call opens the store in a worker thread."""
        pool = self.pool
        if pool is not None and not self.closed:
            return pool
        return await anyio.to_thread.run_sync(self.open)

    def require(self) -> Pool:
        if self.pool is None:
            if self.closed:
                raise StoreError("the store is closed")
            raise StoreError(f"the context store is unavailable: {self.error or 'not open'}")
        return self.pool

    def close(self) -> None:
        with self._open_lock:
            self.closed = True
            pool = self.pool
        if pool is not None:
            pool.close()

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run blocking store work in a worker thread; a database error marks the store
        unhealthy (lock contention does not)."""
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        except sqlite3.OperationalError as error:
            text = str(error).lower()
            if "locked" not in text and "busy" not in text:
                self.mark_unhealthy(error)
            raise
        except sqlite3.DatabaseError as error:
            self.mark_unhealthy(error)
            raise

    def mark_unhealthy(self, error: BaseException) -> None:
        if self.error is None:
            self.error = format_error(error)
            _log.warning("sqlite context store failed", error=self.error)
