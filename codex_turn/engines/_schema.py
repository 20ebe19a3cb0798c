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

*A broken store is the world's fault.* :class:`StoreError` is an
:class:`~codex_turn.harness.engine.EngineUnavailable`: the harness falls back, and a strict
run does not blame the engine. Every database error is mapped once, in
:meth:`StoreAccess.run` and :meth:`StoreAccess.open`: a store that cannot be opened, is
corrupt (``DatabaseError``: a malformed page, not a database) or fails at the file system
(``OperationalError``: I/O, a full disk, read-only) raises :class:`StoreError`; lock
contention stays an ``OperationalError`` (operational too, and never remembered); what is
left (``IntegrityError``, ``ProgrammingError`` ...) is a bug of the engine and propagates.

*Nothing is changed before it is accepted.* An existing file is first read through a
read-only connection (``mode=ro``): its ``user_version`` and tables decide whether it is this
engine's store (or an older one it migrates). A file that is not is refused exactly as it
was (no switch to WAL, no journal beside it); only an accepted one is opened for writing,
checked again before its first change, switched to WAL and migrated, and checked once more
inside that first write transaction (another process may have changed the file in between).
A hot journal (a writer died mid-transaction) is the one thing a read-only connection cannot
read past: the writable connection rolls it back, as any SQLite reader would, then judges.
A missing store is created empty and owner-only
(:func:`~codex_turn.harness._fs.create_exclusive`) before SQLite opens it: SQLite gives the
``-wal`` and ``-shm`` the database file's mode, so all three stay private whatever the umask;
missing directories are made owner-only too. A refused or failed open closes every
connection it made: nothing of a refused store stays open in the process.

*A private copy, for previews.* A :class:`Pool` made with ``copy=True`` reads the file once
into an in-memory database and works on that alone: the file is opened read-only and never
changed (``codex-turn inspect`` previews a turn this way: the copy catches up with the
transcript, the store does not). When no ``-wal`` exists (no connection has the store open)
the file is read ``immutable``, so that SQLite creates no ``-wal``/``-shm`` beside it either;
the copy is kept only if the file did not change while it was read, else it is read again
through an ordinary read-only connection.

*Connections are pooled, not shared.* A :class:`Pool` hands each worker thread a connection
of its own for the duration of one operation (``check_same_thread=False``, so a connection
may move between pool threads, but never serves two at once). There is no process-wide lock
around I/O: SQLite's file lock is the only writer serialisation, across threads and processes
alike.

*The schema* (``user_version`` 3; an older store is migrated in place when opened, one
version at a time):

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
``messages_fts``   full-text index (FTS5) of each message's model text (rowid = message id)
``summaries_fts``  and of each summary's content (rowid = the summary's rowid), written in
                   the transaction that writes the row, so search never lags the store; the
                   version-3 migration indexes what an older store holds (the recall tools,
                   ``_recall.py``). *Contentless* (``content=''``): the text is not stored a
                   second time (the store stays about the transcript's size); a row's entry
                   is removed with FTS5's ``delete`` command and the same text, which
                   :func:`search_text` recomputes from the stored message.
                   ``summary_sources`` is indexed by source too, so a message's summary is
                   found without a scan.

Foreign keys are declared (``PRAGMA foreign_key_check`` verifies them in ``doctor``) but not
enforced per statement: every write path keeps them by construction, and retention deletes
whole conversations table by table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, ParamSpec, TypeVar

import anyio
import anyio.to_thread

from codex_turn._log import format_error, get_logger
from codex_turn.engines._messages import search_text
from codex_turn.harness._fs import create_exclusive, file_kind, make_private_dirs
from codex_turn.harness.engine.contract import EngineUnavailable

__all__ = [
    "PRUNED_CONTENT",
    "SCHEMA_VERSION",
    "STORE_FILE",
    "STORE_SIDECARS",
    "Pool",
    "StoreAccess",
    "StoreError",
    "decode_content",
    "encode_content",
    "file_identity",
    "read_tx",
    "write_tx",
]

SCHEMA_VERSION: Final = 3
#: The store's file name in a directory (``SqliteContextEngine.next_to``: next to the session).
STORE_FILE: Final = "context.sqlite"
#: The files SQLite keeps beside the store while it is open (WAL mode).
STORE_SIDECARS: Final = ("-wal", "-shm")

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

#: Version 2 -> 3: the full-text indexes and the source indexes (what the recall tools
#: read); the indexes are filled from the rows by :func:`_index_existing`.
_MIGRATE_2: Final = (
    "CREATE VIRTUAL TABLE messages_fts USING fts5(text, content='', "
    "tokenize='unicode61 remove_diacritics 2')",
    "CREATE VIRTUAL TABLE summaries_fts USING fts5(text, content='', "
    "tokenize='unicode61 remove_diacritics 2')",
    """CREATE INDEX summary_sources_message ON summary_sources(message_id)
        WHERE message_id IS NOT NULL""",
    """CREATE INDEX summary_sources_child ON summary_sources(child_id)
        WHERE child_id IS NOT NULL""",
)
#: A new store: every table of the current version.
_CREATE: Final = _TABLES + _MIGRATE_2

_BUSY_WORDS: Final = ("locked", "busy")


#: The content of a message retention shed (``_doctor.prune``): a real message is never
#: ``{}`` (it has a role), and this decodes like any stored message.
PRUNED_CONTENT: Final = b"{}"


def encode_content(raw: bytes, compress_over: int | None) -> bytes:
    if compress_over is not None and len(raw) > compress_over:
        packed = zlib.compress(raw, 1)
        if len(packed) < len(raw):
            return packed
    return raw


def decode_content(stored: bytes) -> str:
    raw = stored if stored[:1] == b"{" else zlib.decompress(stored)
    return raw.decode("utf-8", "surrogatepass")


def _index_existing(conn: sqlite3.Connection) -> None:
    """Fill the full-text indexes from the rows an older store holds (inside the migration's
    transaction: a store is indexed whole or not at all)."""
    rows = conn.execute("SELECT id, content FROM messages ORDER BY id")
    while batch := rows.fetchmany(512):
        conn.executemany(
            "INSERT INTO messages_fts(rowid, text) VALUES (?, ?)",
            [(mid, search_text(json.loads(decode_content(raw)))) for mid, raw in batch],
        )
    conn.execute("INSERT INTO summaries_fts(rowid, text) SELECT rowid, content FROM summaries")


class StoreError(EngineUnavailable):
    """The store cannot be used: it cannot be opened or created, it has a newer schema or
    another program's tables, it is corrupt, or the file system fails it. Operational (an
    :class:`~codex_turn.harness.engine.EngineUnavailable`), never a contract violation."""


def _is_busy(error: sqlite3.OperationalError) -> bool:
    text = str(error).lower()
    return any(word in text for word in _BUSY_WORDS)


def _is_store_fault(error: sqlite3.DatabaseError) -> bool:
    """A fault of the file, not of the engine's code: corrupt or not a database (a plain
    ``DatabaseError``), or the file system failing (an ``OperationalError`` that is not lock
    contention)."""
    if isinstance(error, sqlite3.OperationalError):
        return not _is_busy(error)
    return type(error) is sqlite3.DatabaseError


def _check_schema(conn: sqlite3.Connection) -> int:
    """The store's schema version; :class:`StoreError` when the file is not this engine's
    (a newer version, or tables of another program). Reads only.

    One statement, so one snapshot: read apart, outside a transaction, another process
    creating the store between the two reads shows "version 0" beside its new tables."""
    version, tables = conn.execute(
        "SELECT (SELECT user_version FROM pragma_user_version),"
        " (SELECT count(*) FROM sqlite_master WHERE type='table')"
    ).fetchone()
    if version > SCHEMA_VERSION:
        raise StoreError(f"store schema {version} is newer than this engine's ({SCHEMA_VERSION})")
    if version == 0 and tables:
        raise StoreError("the file holds tables that are not this engine's")
    return int(version)


def _read_only(path: str, busy_timeout_s: float, *, immutable: bool = False) -> sqlite3.Connection:
    """A read-only connection to the file at ``path`` (``immutable``: without locks or a
    look at a ``-wal``, so SQLite creates nothing beside the file)."""
    uri = Path(os.path.abspath(path)).as_uri() + "?mode=ro" + ("&immutable=1" if immutable else "")
    return sqlite3.connect(
        uri, uri=True, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
    )


def _regular_file(path: str) -> bool:
    """Whether ``path`` is a regular file (``False``: nothing is there); :class:`StoreError`
    for a directory, a FIFO, a device ... (never opened: SQLite would block or misread)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise StoreError(f"{path} is {file_kind(mode)}, not a store")
    return True


def _accept_file(path: str, busy_timeout_s: float) -> None:
    """Make the store file ready to be opened for writing, changing nothing that is refused:
    a missing one is created empty and owner-only (its directories too); an existing one is
    checked read-only first (see the module docstring)."""
    make_private_dirs(os.path.dirname(os.path.abspath(path)))
    if not _regular_file(path) and create_exclusive(path, b""):
        return  # an empty file is an empty database; SQLite's sidecars get its mode
    conn = _read_only(path, busy_timeout_s)
    try:
        _check_schema(conn)
    except sqlite3.OperationalError as error:
        if error.sqlite_errorname != "SQLITE_READONLY_ROLLBACK":
            raise
        # A hot journal (a writer died mid-transaction): only a writable connection rolls it
        # back, as any SQLite reader would; the writable open checks before it switches.
    finally:
        conn.close()


def file_identity(path: str) -> tuple[int, int, int, int]:
    """What changes when a file is replaced or written: device, inode, size, mtime."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _private_copy(path: str, busy_timeout_s: float) -> sqlite3.Connection:
    """An in-memory copy of the store at ``path``, read without changing anything there (see
    the module docstring); :class:`StoreError` when it is missing or not this engine's."""
    if not _regular_file(path):
        raise StoreError(f"no store at {path}")
    log = path + "-wal"
    if not os.path.exists(log):  # no connection has it open: read it as it is
        before = file_identity(path)
        try:
            copy = _copy(path, busy_timeout_s, immutable=True)
        except (sqlite3.DatabaseError, StoreError):
            if file_identity(path) == before and not os.path.exists(log):
                raise  # a consistent read: the answer stands
            copy = None  # read while a writer changed it
        if copy is not None:
            if file_identity(path) == before and not os.path.exists(log):
                return copy
            copy.close()  # a writer came and went while it was read
    return _copy(path, busy_timeout_s, immutable=False)  # the ordinary way, under SQLite's locks


def _copy(path: str, busy_timeout_s: float, *, immutable: bool) -> sqlite3.Connection:
    copy = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    try:
        source = _read_only(path, busy_timeout_s, immutable=immutable)
        try:
            _check_schema(source)
            source.backup(copy)
        finally:
            source.close()
    except BaseException:
        copy.close()
        raise
    return copy


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
    """Connections to one database file (or one connection to a private copy of it,
    ``copy``); see the module docstring."""

    def __init__(self, path: str, *, busy_timeout_s: float, copy: bool = False) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._free: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        #: The private copy's one connection (``copy``), used by one thread at a time.
        self._copy: sqlite3.Connection | None = None
        self._copy_lock = threading.RLock()
        try:
            if copy:
                self._copy = _private_copy(path, busy_timeout_s)
                self._configure(self._copy)
                self._migrate(self._copy, wal=False)
            else:
                _accept_file(path, busy_timeout_s)
                with self.connection() as conn:
                    self._migrate(conn, wal=True)
        except BaseException:
            self.close()  # a refused store keeps no connection open
            raise

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path,
            timeout=self.busy_timeout_s,
            isolation_level=None,
            check_same_thread=False,
        )
        self._configure(conn)
        return conn

    def _configure(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA temp_store=MEMORY")
            conn.execute("PRAGMA cache_size=-16000")
        except BaseException:
            conn.close()
            raise

    def _migrate(self, conn: sqlite3.Connection, *, wal: bool) -> None:
        """Create or migrate the schema of a store :func:`_accept_file` accepted (``wal``:
        switching it to WAL first), checking it again inside the transaction."""
        if wal:
            _check_schema(conn)  # before the first change (the read-only check may not have run)
            # auto_vacuum only takes effect on a database without tables: a new store. It
            # lets retention hand freed pages back to the file system (incremental_vacuum).
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._use_wal(conn)
        with write_tx(conn, self.busy_timeout_s):
            version = _check_schema(conn)
            if version == 0:
                for statement in _CREATE:
                    conn.execute(statement)
            else:
                if version < 2:
                    for statement in _MIGRATE_1:
                        conn.execute(statement)
                if version < 3:
                    for statement in _MIGRATE_2:
                        conn.execute(statement)
                    _index_existing(conn)
            if version != SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _use_wal(self, conn: sqlite3.Connection) -> None:
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

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """A connection for this thread's operation; returned to the pool afterwards."""
        if self._copy is not None:
            with self._copy_lock:  # the copy's one connection serves one thread at a time
                if self._closed:
                    raise StoreError("the store is closed")
                yield self._copy
            return
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
        if self._copy is not None:
            with self._copy_lock:  # after the operation in progress, if any
                self._copy.close()


class StoreAccess:
    """The pool (opened lazily) and its health, shared by the engine and its compactor (no
    reference back to the engine, so a dropped engine is freed at once, without the GC)."""

    def __init__(self, path: str, busy_timeout_s: float, *, copy: bool = False) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        #: Work on a private in-memory copy of the file (see the module docstring).
        self.copy = copy
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
                self.pool = Pool(self.path, busy_timeout_s=self.busy_timeout_s, copy=self.copy)
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
        """Run blocking store work in a worker thread. A database error marks the store
        unhealthy (lock contention does not); a fault of the file raises :class:`StoreError`
        (see the module docstring)."""
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        except sqlite3.DatabaseError as error:
            if isinstance(error, sqlite3.OperationalError) and _is_busy(error):
                raise
            self.mark_unhealthy(error)
            if _is_store_fault(error):
                raise StoreError(f"the context store failed: {format_error(error)}") from error
            raise

    def mark_unhealthy(self, error: BaseException) -> None:
        if self.error is None:
            self.error = format_error(error)
            _log.warning("sqlite context store failed", error=self.error)
