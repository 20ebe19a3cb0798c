"""The engine's reads and writes, one short transaction each. Synchronous; worker threads.

Theory
------
Each function is one unit of work on the :class:`~codex_turn.engines._schema.Pool`:

* :func:`conversation` finds (or creates) the active conversation of a session key; a new
  one is the key's next generation (``lineages``), its uid derived from both.
* :func:`insert_messages` (a path sync) and :func:`deliver` (``ingest``/``ingest_batch``) are
  the only ways messages enter: inside ``BEGIN IMMEDIATE`` they ask which source ids already
  exist, insert the others with explicit, consecutive row ids, append one context item per
  message and advance the counters and, for a path sync, the checkpoint. Two writers (threads
  or processes) delivering the same messages are serialised by SQLite's write lock; the
  second sees the first's rows and inserts nothing.
* :func:`deliver` names messages that come without their path. The stored conversation *is*
  the path, so a delivery is aligned with it, in the transaction: a run of the delivery that
  repeats a stored run is a re-delivery (it keeps the stored ids) when the run reaches the
  stored end (a retry, a replay of the history so far) or holds a message with its own
  identity (a ``timestamp``); anything else is appended, each message numbered one past its
  digest's highest stored occurrence, exactly the id a path sync gives it. So the user saying
  "ok" again (after anything else) is a second message, and a retried or replayed delivery
  adds nothing. A lone timestamp-less message that repeats the newest stored one is taken as
  a retry: without a timestamp or a path the two cannot be told apart.
* :func:`stream_items` runs one joined query (items left-joined to their message and
  summary) in descending ordinal order and hands the cursor to a consumer, so assembly reads
  only the rows it keeps.
* :func:`planning_items` / :func:`chunk_sources` read what a compaction pass needs;
  :func:`commit_summary` writes a pass *optimistically*: it re-reads the planned ordinal
  range inside its transaction and writes nothing if anything there changed (another process
  compacted meanwhile), so a summary computed outside any transaction can never be applied
  to a context it was not computed from. The summary, its source edges, the range's
  replacement, the token counter and the epoch change in that one transaction, which
  returns the tokens it applied (the sweep's own accounting).
* the ledger (:func:`has_turn`, :func:`record_turn`), the transcript checkpoint and the
  compaction debt (:func:`debt`, :func:`set_debt`, :func:`settle_debt`).

Messages are stored as their own JSON; content over ``compress_over`` bytes is zlib'd
(a stored value that does not start with ``{`` is compressed).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple, TypeVar

from codex_turn.engines._plan import Item, compute_epoch, conversation_uid, split_ids
from codex_turn.engines._schema import Pool, decode_content, encode_content

__all__ = [
    "Conversation",
    "Debt",
    "Prepared",
    "commit_summary",
    "conversation",
    "debt",
    "decode_content",
    "deliver",
    "encode_content",
    "has_turn",
    "insert_messages",
    "planning_items",
    "record_turn",
    "set_checkpoint",
    "set_debt",
    "settle_debt",
    "stream_items",
]

T = TypeVar("T")
_IN_BATCH: Final = 400  # host parameters per IN (...) query
_HELD: Final = "SELECT source_id FROM messages WHERE conversation_id=? AND source_id IN"

_SELECT_CONVERSATION: Final = (
    "SELECT id, uid, session_key, next_seq, next_ordinal, context_tokens, epoch, synced_len, "
    "synced_anchor, boot_path, boot_dev, boot_ino, boot_size, boot_mtime_ns FROM conversations "
)


class Conversation(NamedTuple):
    id: int
    uid: str
    session_key: str
    next_seq: int
    next_ordinal: int
    context_tokens: int
    epoch: str
    synced_len: int
    synced_anchor: str | None
    boot: tuple[str, int, int, int, int] | None

    @classmethod
    def of(cls, row: Sequence[Any]) -> Conversation:
        boot = None if row[9] is None else (row[9], row[10], row[11], row[12], row[13])
        return cls(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8], boot)


class Prepared(NamedTuple):
    """A message ready to insert (everything computed before the transaction)."""

    source_id: str
    role: str
    tokens: int
    ts: int | None
    calls: str | None
    results: str | None
    content: bytes
    #: What the full-text index holds for it (``_messages.search_text``).
    search_text: str = ""


class Debt(NamedTuple):
    pending: bool
    budget: int | None
    attempts: int
    next_attempt_after: float


def _in_batches(sql: str, values: Sequence[str]) -> Iterator[tuple[str, Sequence[str]]]:
    """``sql`` (ending in ``IN``) completed with one ``?`` per value, batch by batch.

    SQL text here and everywhere in the engine is built only from constants and ``?``
    placeholders; values are always bound, never formatted in."""
    for start in range(0, len(values), _IN_BATCH):
        batch = values[start : start + _IN_BATCH]
        yield sql + " (" + ",".join("?" * len(batch)) + ")", batch


def conversation(pool: Pool, key: str, *, create: bool = True) -> Conversation | None:
    """The active conversation of ``key`` (created when missing and ``create``)."""
    select = _SELECT_CONVERSATION + "WHERE session_key=? AND archived_at IS NULL"
    with pool.connection() as conn:
        row = conn.execute(select, (key,)).fetchone()
        if row is not None or not create:
            return None if row is None else Conversation.of(row)
        with pool.write(conn):
            row = conn.execute(select, (key,)).fetchone()
            if row is None:
                started = conn.execute(
                    "SELECT started FROM lineages WHERE session_key=?", (key,)
                ).fetchone()
                uid = conversation_uid(key, started[0] if started is not None else 0)
                conn.execute(
                    "INSERT INTO lineages(session_key, started) VALUES (?, 1) "
                    "ON CONFLICT(session_key) DO UPDATE SET started=started+1",
                    (key,),
                )
                conn.execute(
                    "INSERT INTO conversations(uid, session_key, created_at, epoch) "
                    "VALUES (?, ?, ?, ?)",
                    (uid, key, time.time(), compute_epoch(uid, ())),
                )
                row = conn.execute(select, (key,)).fetchone()
        return Conversation.of(row)


def read_conversation(conn: sqlite3.Connection, conversation_id: int) -> Conversation:
    row = conn.execute(_SELECT_CONVERSATION + "WHERE id=?", (conversation_id,)).fetchone()
    if row is None:
        raise LookupError(f"conversation {conversation_id} does not exist")
    return Conversation.of(row)


def conversation_by_id(pool: Pool, conversation_id: int) -> Conversation:
    with pool.connection() as conn:
        return read_conversation(conn, conversation_id)


def held_ids(pool: Pool, conversation_id: int, source_ids: Sequence[str]) -> set[str]:
    """Which of ``source_ids`` the conversation already holds (a read, no transaction)."""
    held: set[str] = set()
    with pool.connection() as conn:
        for sql, batch in _in_batches(_HELD, source_ids):
            held.update(row[0] for row in conn.execute(sql, (conversation_id, *batch)))
    return held


def _insert(conn: sqlite3.Connection, conversation_id: int, prepared: Sequence[Prepared]) -> int:
    """Insert the messages of ``prepared`` not held yet, in order (inside a write)."""
    held: set[str] = set()
    ids = [p.source_id for p in prepared]
    for sql, batch in _in_batches(_HELD, ids):
        held.update(row[0] for row in conn.execute(sql, (conversation_id, *batch)))
    seq, ordinal = conn.execute(
        "SELECT next_seq, next_ordinal FROM conversations WHERE id=?", (conversation_id,)
    ).fetchone()
    # AUTOINCREMENT's high-water mark: ids are never reused (the decode cache relies on it).
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='messages'").fetchone()
    next_id = int(row[0]) if row is not None else 0
    rows: list[tuple[Any, ...]] = []
    items: list[tuple[int, int, int, int]] = []
    texts: list[tuple[int, str]] = []
    added_tokens = 0
    for message in prepared:
        if message.source_id in held:
            continue
        held.add(message.source_id)
        next_id += 1
        rows.append((next_id, conversation_id, seq, *message[:-1]))
        items.append((conversation_id, ordinal, next_id, message.tokens))
        texts.append((next_id, message.search_text))
        added_tokens += message.tokens
        seq += 1
        ordinal += 1
    if rows:
        conn.executemany(
            "INSERT INTO messages(id, conversation_id, seq, source_id, role, tokens, ts, "
            "calls, results, content) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        conn.executemany(
            "INSERT INTO context_items(conversation_id, ordinal, message_id, tokens) "
            "VALUES (?, ?, ?, ?)",
            items,
        )
        # In the same transaction: the index never lags the messages (nor leads them).
        conn.executemany("INSERT INTO messages_fts(rowid, text) VALUES (?, ?)", texts)
    conn.execute(
        "UPDATE conversations SET next_seq=?, next_ordinal=?, context_tokens=context_tokens+? "
        "WHERE id=?",
        (seq, ordinal, added_tokens, conversation_id),
    )
    return len(rows)


def insert_messages(
    pool: Pool,
    conversation_id: int,
    prepared: Sequence[Prepared],
    *,
    synced: tuple[int, str | None] | None = None,
) -> int:
    """Insert the messages not held yet, in order; returns how many were new.

    ``synced=(length, anchor)`` also advances the path checkpoint (a path sync)."""
    with pool.connection() as conn, pool.write(conn):
        count = _insert(conn, conversation_id, prepared)
        if synced is not None:
            conn.execute(
                "UPDATE conversations SET synced_len=?, synced_anchor=? WHERE id=?",
                (*synced, conversation_id),
            )
        return count


#: At most this many stored occurrences of one digest are tried as alignment starts (the
#: newest first): only timestamp-less repeats have more than one.
_ALIGN_CANDIDATES: Final = 64


def _occurrences(
    conn: sqlite3.Connection, conversation_id: int, digest_hex: str
) -> list[tuple[int, int]]:
    """``(seq, occurrence)`` of every stored message with this digest, newest first."""
    rows = conn.execute(
        "SELECT seq, source_id FROM messages WHERE conversation_id=? AND source_id>=? "
        "AND source_id<?",
        (conversation_id, digest_hex + ".", digest_hex + "/"),
    ).fetchall()
    return sorted(((seq, int(sid.rsplit(".", 1)[1])) for seq, sid in rows), reverse=True)


def deliver(
    pool: Pool,
    conversation_id: int,
    digests: Sequence[bytes],
    stamped: Sequence[bool],
    prepared: Sequence[Prepared],
) -> int:
    """Store a delivery without its path (see the module docstring); returns how many
    messages were new. ``prepared`` carries everything but the source ids."""
    count = len(digests)
    with pool.connection() as conn, pool.write(conn):
        end = conn.execute(
            "SELECT next_seq FROM conversations WHERE id=?", (conversation_id,)
        ).fetchone()[0]
        # A digest held at all is held as occurrence 0 (messages are never deleted): one
        # batched query finds them, and only those are looked up one by one.
        firsts = [value.hex() + ".0" for value in dict.fromkeys(digests)]
        held: set[str] = set()
        for sql, batch in _in_batches(_HELD, firsts):
            held.update(row[0][:-2] for row in conn.execute(sql, (conversation_id, *batch)))
        found: dict[bytes, list[tuple[int, int]]] = {}
        following: dict[bytes, int] = {}
        chosen: list[Prepared] = []
        tail_open = True  # nothing appended yet: a run may still line up with the end
        index = 0
        while index < count:
            value = digests[index]
            if value not in found:
                hexed = value.hex()
                found[value] = _occurrences(conn, conversation_id, hexed) if hexed in held else []
                following[value] = max((n for _, n in found[value]), default=-1) + 1
            best: list[str] = []
            for start, _n in found[value][:_ALIGN_CANDIDATES]:
                stored = conn.execute(
                    "SELECT source_id FROM messages WHERE conversation_id=? AND seq>=? "
                    "ORDER BY seq LIMIT ?",
                    (conversation_id, start, count - index),
                ).fetchall()
                run: list[str] = []
                for offset, (sid,) in enumerate(stored):
                    if sid.rsplit(".", 1)[0] != digests[index + offset].hex():
                        break
                    run.append(sid)
                reaches_end = tail_open and start + len(run) == end
                if (reaches_end or any(stamped[index : index + len(run)])) and len(run) > len(best):
                    best = run
            if best:
                index += len(best)  # a re-delivery of a stored run: nothing to add
                continue
            chosen.append(prepared[index]._replace(source_id=f"{value.hex()}.{following[value]}"))
            following[value] += 1
            tail_open = False
            index += 1
        return _insert(conn, conversation_id, chosen) if chosen else 0


def has_turn(pool: Pool, conversation_id: int, turn_key: str) -> bool:
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT 1 FROM turns WHERE conversation_id=? AND turn_key=?",
            (conversation_id, turn_key),
        ).fetchone()
        return row is not None


def record_turn(
    pool: Pool, conversation_id: int, turn_key: str, message_count: int, ingested: int
) -> None:
    with pool.connection() as conn, pool.write(conn):
        conn.execute(
            "INSERT OR IGNORE INTO turns(conversation_id, turn_key, message_count, ingested, "
            "committed_at) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, turn_key, message_count, ingested, time.time()),
        )


def set_checkpoint(
    pool: Pool, conversation_id: int, boot: tuple[str, int, int, int, int] | None
) -> None:
    with pool.connection() as conn, pool.write(conn):
        conn.execute(
            "UPDATE conversations SET boot_path=?, boot_dev=?, boot_ino=?, boot_size=?, "
            "boot_mtime_ns=? WHERE id=?",
            (*(boot or (None,) * 5), conversation_id),
        )


_ASSEMBLY_QUERY: Final = """
SELECT ci.ordinal, ci.tokens, ci.message_id, m.role, m.calls, m.results, m.content,
       m.source_id, m.ts, ci.summary_id, s.kind, s.depth, s.content, s.descendant_count,
       s.earliest_ts, s.latest_ts
FROM context_items AS ci
LEFT JOIN messages AS m ON m.id = ci.message_id
LEFT JOIN summaries AS s ON s.id = ci.summary_id
WHERE ci.conversation_id = ?
ORDER BY ci.ordinal {order}
"""


def _item(row: Sequence[Any]) -> Item:
    # Positional construction: this runs once per row assembly reads.
    if row[9] is None:
        calls, results = row[4], row[5]
        return Item(
            row[0],
            row[1],
            row[2],
            row[3],
            split_ids(calls) if calls else (),
            split_ids(results) if results else (),
            row[6],
            row[7],
            row[8],
        )
    return Item(
        row[0],
        row[1],
        None,
        None,
        (),
        (),
        row[12],
        None,
        None,
        row[9],
        row[10],
        row[11],
        row[13],
        row[14],
        row[15],
    )


def stream_items(
    pool: Pool,
    conversation_id: int,
    consume: Callable[[Conversation, Iterator[Item]], T],
) -> T:
    """``consume(conversation, items newest first)`` inside one read snapshot."""
    with pool.connection() as conn, pool.read(conn):
        conv = read_conversation(conn, conversation_id)
        cursor = conn.execute(_ASSEMBLY_QUERY.format(order="DESC"), (conversation_id,))
        cursor.arraysize = 64

        def rows() -> Iterator[Item]:
            while batch := cursor.fetchmany():
                for row in batch:
                    yield _item(row)

        return consume(conv, rows())


_PLANNING_QUERY: Final = """
SELECT ci.ordinal, ci.tokens, ci.message_id, m.role, m.calls, m.results, NULL,
       m.source_id, m.ts, ci.summary_id, s.kind, s.depth, NULL, s.descendant_count,
       s.earliest_ts, s.latest_ts
FROM context_items AS ci
LEFT JOIN messages AS m ON m.id = ci.message_id
LEFT JOIN summaries AS s ON s.id = ci.summary_id
WHERE ci.conversation_id = ?
ORDER BY ci.ordinal
"""


def planning_items(pool: Pool, conversation_id: int) -> tuple[Conversation, list[Item]]:
    """The conversation and all its items, oldest first, without contents."""
    with pool.connection() as conn, pool.read(conn):
        conv = read_conversation(conn, conversation_id)
        items = [_item(row) for row in conn.execute(_PLANNING_QUERY, (conversation_id,))]
        return conv, items


def chunk_contents(pool: Pool, chunk: Sequence[Item]) -> dict[int | str, str]:
    """The stored text of each item of ``chunk``: message JSON by message id, summary
    content by summary id."""
    out: dict[int | str, str] = {}
    message_ids = [str(i.message_id) for i in chunk if i.message_id is not None]
    summary_ids = [i.summary_id for i in chunk if i.summary_id is not None]
    with pool.connection() as conn, pool.read(conn):
        for sql, batch in _in_batches("SELECT id, content FROM messages WHERE id IN", message_ids):
            for message_id, content in conn.execute(sql, batch):
                out[message_id] = decode_content(content)
        for sql, batch in _in_batches("SELECT id, content FROM summaries WHERE id IN", summary_ids):
            for summary_id, content in conn.execute(sql, batch):
                out[summary_id] = content
    return out


class NewSummary(NamedTuple):
    id: str
    kind: str
    depth: int
    content: str
    tokens: int
    source_tokens: int
    descendant_count: int
    earliest: int | None
    latest: int | None
    summarizer: str


def _summary_layer(conn: sqlite3.Connection, conversation_id: int) -> list[tuple[int, str]]:
    return [
        (row[0], row[1])
        for row in conn.execute(
            "SELECT ordinal, summary_id FROM context_items WHERE conversation_id=? "
            "AND summary_id IS NOT NULL ORDER BY ordinal",
            (conversation_id,),
        )
    ]


def commit_summary(
    pool: Pool, conversation_id: int, chunk: Sequence[Item], summary: NewSummary
) -> int | None:
    """Replace ``chunk`` (consecutive items) by ``summary``; returns the summary item's
    tokens, or ``None`` (nothing written) when the items in that ordinal range are no longer
    exactly ``chunk``."""
    first, last = chunk[0].ordinal, chunk[-1].ordinal
    planned = [(i.ordinal, i.message_id, i.summary_id) for i in chunk]
    removed = sum(i.tokens for i in chunk)
    with pool.connection() as conn, pool.write(conn):
        current = conn.execute(
            "SELECT ordinal, message_id, summary_id FROM context_items "
            "WHERE conversation_id=? AND ordinal BETWEEN ? AND ? ORDER BY ordinal",
            (conversation_id, first, last),
        ).fetchall()
        if [tuple(row) for row in current] != planned:
            return None
        written = conn.execute(
            "INSERT OR IGNORE INTO summaries(id, conversation_id, kind, depth, content, tokens, "
            "source_tokens, descendant_count, earliest_ts, latest_ts, summarizer, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                summary.id,
                conversation_id,
                summary.kind,
                summary.depth,
                summary.content,
                summary.tokens,
                summary.source_tokens,
                summary.descendant_count,
                summary.earliest,
                summary.latest,
                summary.summarizer,
                time.time(),
            ),
        )
        if written.rowcount:
            conn.execute(
                "INSERT INTO summaries_fts(rowid, text) VALUES (?, ?)",
                (written.lastrowid, summary.content),
            )
        tokens = conn.execute("SELECT tokens FROM summaries WHERE id=?", (summary.id,)).fetchone()[
            0
        ]
        conn.executemany(
            "INSERT OR IGNORE INTO summary_sources(summary_id, position, message_id, child_id) "
            "VALUES (?, ?, ?, ?)",
            [(summary.id, pos, i.message_id, i.summary_id) for pos, i in enumerate(chunk)],
        )
        conn.execute(
            "DELETE FROM context_items WHERE conversation_id=? AND ordinal BETWEEN ? AND ?",
            (conversation_id, first, last),
        )
        conn.execute(
            "INSERT INTO context_items(conversation_id, ordinal, summary_id, tokens) "
            "VALUES (?, ?, ?, ?)",
            (conversation_id, first, summary.id, tokens),
        )
        uid = conn.execute(
            "SELECT uid FROM conversations WHERE id=?", (conversation_id,)
        ).fetchone()[0]
        epoch = compute_epoch(uid, _summary_layer(conn, conversation_id))
        conn.execute(
            "UPDATE conversations SET context_tokens=context_tokens-?+?, epoch=? WHERE id=?",
            (removed, tokens, epoch, conversation_id),
        )
        return int(tokens)


def context_tokens(pool: Pool, conversation_id: int) -> int:
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT context_tokens FROM conversations WHERE id=?", (conversation_id,)
        ).fetchone()
        return int(row[0]) if row is not None else 0


def debt(pool: Pool, conversation_id: int) -> Debt | None:
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT pending, budget, attempts, next_attempt_after FROM maintenance "
            "WHERE conversation_id=?",
            (conversation_id,),
        ).fetchone()
        return None if row is None else Debt(bool(row[0]), row[1], row[2], row[3])


def set_debt(pool: Pool, conversation_id: int, budget: int, reason: str) -> None:
    """Record (coalesce) compaction debt; keeps the attempt counter and backoff."""
    with pool.connection() as conn, pool.write(conn):
        conn.execute(
            "INSERT INTO maintenance(conversation_id, pending, reason, budget, requested_at) "
            "VALUES (?, 1, ?, ?, ?) ON CONFLICT(conversation_id) DO UPDATE SET pending=1, "
            "reason=excluded.reason, budget=excluded.budget, requested_at=excluded.requested_at",
            (conversation_id, reason, budget, time.time()),
        )


def settle_debt(
    pool: Pool, conversation_id: int, *, resolved: bool, error: str | None, backoff_s: float
) -> None:
    """After a drain: clear the debt, or count a failed attempt and back off."""
    with pool.connection() as conn, pool.write(conn):
        if resolved:
            conn.execute(
                "UPDATE maintenance SET pending=0, attempts=0, next_attempt_after=0, "
                "last_error=NULL WHERE conversation_id=?",
                (conversation_id,),
            )
            return
        row = conn.execute(
            "SELECT attempts FROM maintenance WHERE conversation_id=?", (conversation_id,)
        ).fetchone()
        attempts = (row[0] if row is not None else 0) + 1
        delay = min(backoff_s * (2 ** min(attempts - 1, 10)), 3600.0)
        conn.execute(
            "UPDATE maintenance SET attempts=?, next_attempt_after=?, last_error=? "
            "WHERE conversation_id=?",
            (attempts, time.time() + delay, error, conversation_id),
        )
