"""Checking and repairing the store, and retention. Synchronous; runs in a worker thread.

Theory
------
*What must hold* (every write path keeps it by construction; ``doctor`` proves it):

1. SQLite's own integrity (``quick_check``) and the declared foreign keys
   (``foreign_key_check``).
2. Every context item names one message or summary *of its own conversation*, with that
   row's token count.
3. The summary DAG: a leaf summary's sources are messages and its depth is 0; a condensed
   summary's sources are summaries one level shallower (so the graph is acyclic); positions
   are 0..n-1; ``descendant_count`` is the number of messages below.
4. *Lossless coverage*: expanding the context items through the DAG reaches every message of
   the conversation exactly once.
5. The cached counters agree with the rows: ``context_tokens`` (sum of item tokens),
   ``next_ordinal``/``next_seq`` (past the largest), the ``epoch`` (a hash of the summary
   layer), and the sync checkpoint (``synced_len`` at most the messages held).

*Repairs touch derived data only*: counters, the epoch, item token counts and descendant
counts are recomputed; an item naming a missing or foreign row is removed; a message the
projection no longer reaches is appended as a raw item (in ``seq`` order), one reached twice
loses its raw duplicate; summaries nothing reaches are removed with their edges. A message is
never deleted, and a problem that cannot be repaired from the rows (a summary whose sources are
gone) is reported, not guessed at.

*Retention* is explicit and never touches an active conversation: :func:`archive` ends a
session's conversation (the next call for the key starts a new one), :func:`prune` deletes
archived conversations (all archived before a time, then the oldest while the file is over a
byte ceiling) and returns the freed pages to the file system (``incremental_vacuum``).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections import Counter
from typing import Any, Final

import attrs

from codex_turn.engines._plan import compute_epoch
from codex_turn.engines._schema import Pool

__all__ = ["DoctorReport", "RetentionReport", "archive", "doctor", "prune"]

# Statements are constants: nothing is ever formatted into SQL text.
_UPDATE_COUNTER: Final = {
    column: f"UPDATE conversations SET {column}=? WHERE id=?"  # noqa: S608 - constant names
    for column in ("context_tokens", "next_ordinal", "next_seq", "epoch", "synced_len")
}
_DELETE_BY_CONVERSATION: Final = tuple(
    f"DELETE FROM {table} WHERE conversation_id=?"  # noqa: S608 - constant names
    for table in ("summaries", "messages", "turns", "maintenance")
)


@attrs.frozen
class DoctorReport:
    """What :func:`doctor` found (``problems``) and, of that, what it fixed (``repaired``)."""

    conversations: int
    messages: int
    summaries: int
    problems: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


@attrs.frozen
class RetentionReport:
    deleted_conversations: int
    bytes_before: int
    bytes_after: int
    #: Still above the ceiling (only active conversations are left to delete).
    over_ceiling: bool = False

    @property
    def bytes_freed(self) -> int:
        return max(0, self.bytes_before - self.bytes_after)


class _Findings:
    def __init__(self, repair: bool) -> None:
        self.repair = repair
        self.problems: list[str] = []
        self.repaired: list[str] = []

    def found(self, problem: str, *, fixable: bool) -> bool:
        """Record ``problem``; True when the caller should repair it now."""
        self.problems.append(problem)
        if fixable and self.repair:
            self.repaired.append(problem)
            return True
        return False


def _check_conversation(conn: sqlite3.Connection, conv: tuple[Any, ...], f: _Findings) -> None:
    cid, uid, next_seq, next_ordinal, context_tokens, epoch, synced_len = conv
    name = f"conversation {cid}"
    messages = {
        row[0]: (row[1], row[2])
        for row in conn.execute(
            "SELECT id, seq, tokens FROM messages WHERE conversation_id=?", (cid,)
        )
    }
    summaries = {
        row[0]: (row[1], row[2], row[3], row[4])
        for row in conn.execute(
            "SELECT id, kind, depth, tokens, descendant_count FROM summaries "
            "WHERE conversation_id=?",
            (cid,),
        )
    }
    sources: dict[str, list[tuple[int, int | None, str | None]]] = {}
    for summary_id, position, message_id, child_id in conn.execute(
        "SELECT ss.summary_id, ss.position, ss.message_id, ss.child_id FROM summary_sources ss "
        "JOIN summaries s ON s.id = ss.summary_id WHERE s.conversation_id=? "
        "ORDER BY ss.summary_id, ss.position",
        (cid,),
    ):
        sources.setdefault(summary_id, []).append((position, message_id, child_id))
    items = conn.execute(
        "SELECT ordinal, message_id, summary_id, tokens FROM context_items "
        "WHERE conversation_id=? ORDER BY ordinal",
        (cid,),
    ).fetchall()

    # 3. the DAG (leaf -> messages, condensed -> summaries one level shallower)
    below: dict[str, list[int]] = {}

    def expand(summary_id: str, trail: tuple[str, ...] = ()) -> list[int]:
        if summary_id in below:
            return below[summary_id]
        kind, depth, _tokens, _count = summaries[summary_id]
        reached: list[int] = []
        edges = sources.get(summary_id, [])
        if not edges:
            f.found(f"{name}: summary {summary_id} has no sources", fixable=False)
        if [e[0] for e in edges] != list(range(len(edges))):
            f.found(f"{name}: summary {summary_id} has gaps in its source positions", fixable=False)
        for _position, message_id, child_id in edges:
            if message_id is not None:
                if kind != "leaf" or depth != 0:
                    f.found(
                        f"{name}: {kind} summary {summary_id} has a message source", fixable=False
                    )
                if message_id not in messages:
                    f.found(
                        f"{name}: summary {summary_id} lost message {message_id}", fixable=False
                    )
                    continue
                reached.append(message_id)
            elif child_id is not None:
                child = summaries.get(child_id)
                if child is None or child_id in trail:
                    f.found(f"{name}: summary {summary_id} lost child {child_id}", fixable=False)
                    continue
                if kind != "condensed" or child[1] != depth - 1:
                    f.found(
                        f"{name}: summary {summary_id} has a child of the wrong depth",
                        fixable=False,
                    )
                reached.extend(expand(child_id, (*trail, summary_id)))
        below[summary_id] = reached
        return reached

    for summary_id, (_kind, _depth, _tokens, count) in summaries.items():
        reached = expand(summary_id)
        if count != len(reached) and f.found(
            f"{name}: summary {summary_id} descendant_count {count} != {len(reached)}", fixable=True
        ):
            conn.execute(
                "UPDATE summaries SET descendant_count=? WHERE id=?", (len(reached), summary_id)
            )

    # 2. + 4. the projection: valid items, every message reached exactly once
    coverage: Counter[int] = Counter()
    used_summaries: set[str] = set()
    total = 0
    for ordinal, message_id, summary_id, tokens in items:
        if message_id is not None:
            row = messages.get(message_id)
            if row is None:
                if f.found(f"{name}: item {ordinal} names a missing message", fixable=True):
                    conn.execute(
                        "DELETE FROM context_items WHERE conversation_id=? AND ordinal=?",
                        (cid, ordinal),
                    )
                continue
            want, reached = row[1], [message_id]
        else:
            found = summaries.get(summary_id or "")
            if found is None:
                if f.found(f"{name}: item {ordinal} names a missing summary", fixable=True):
                    conn.execute(
                        "DELETE FROM context_items WHERE conversation_id=? AND ordinal=?",
                        (cid, ordinal),
                    )
                continue
            assert summary_id is not None
            used_summaries.add(summary_id)
            used_summaries.update(_descendant_summaries(summary_id, sources))
            want, reached = found[2], below.get(summary_id, [])
        if tokens != want and f.found(
            f"{name}: item {ordinal} tokens {tokens} != {want}", fixable=True
        ):
            conn.execute(
                "UPDATE context_items SET tokens=? WHERE conversation_id=? AND ordinal=?",
                (want, cid, ordinal),
            )
            tokens = want
        total += tokens
        coverage.update(reached)
    ordinal_next = max([next_ordinal, *(row[0] + 1 for row in items)])
    for message_id, (_seq, tokens) in sorted(messages.items(), key=lambda kv: kv[1][0]):
        times = coverage.get(message_id, 0)
        if times == 0 and f.found(f"{name}: message {message_id} is not reachable", fixable=True):
            conn.execute(
                "INSERT INTO context_items(conversation_id, ordinal, message_id, tokens) "
                "VALUES (?, ?, ?, ?)",
                (cid, ordinal_next, message_id, tokens),
            )
            ordinal_next += 1
            total += tokens
        elif times > 1:
            raw = [row for row in items if row[1] == message_id]
            if raw and f.found(
                f"{name}: message {message_id} is reached {times} times", fixable=True
            ):
                conn.execute(
                    "DELETE FROM context_items WHERE conversation_id=? AND ordinal=?",
                    (cid, raw[0][0]),
                )
                total -= raw[0][3]
            elif not raw:
                f.found(f"{name}: message {message_id} is in two summaries", fixable=False)
    for summary_id in sorted(set(summaries) - used_summaries):
        if f.found(f"{name}: summary {summary_id} is not reachable", fixable=True):
            conn.execute("DELETE FROM summary_sources WHERE summary_id=?", (summary_id,))
            conn.execute("DELETE FROM summaries WHERE id=?", (summary_id,))

    # 5. cached counters
    seq_next = max([next_seq, *(seq + 1 for seq, _ in messages.values())])
    layer = conn.execute(
        "SELECT ordinal, summary_id FROM context_items WHERE conversation_id=? "
        "AND summary_id IS NOT NULL ORDER BY ordinal",
        (cid,),
    ).fetchall()
    fixes = {
        "context_tokens": (context_tokens, total),
        "next_ordinal": (next_ordinal, ordinal_next),
        "next_seq": (next_seq, seq_next),
        "epoch": (epoch, compute_epoch(uid, [(row[0], row[1]) for row in layer])),
        "synced_len": (synced_len, synced_len if synced_len <= len(messages) else 0),
    }
    for column, (have, want) in fixes.items():
        if have != want and f.found(f"{name}: {column} is stale", fixable=True):
            conn.execute(_UPDATE_COUNTER[column], (want, cid))


def _descendant_summaries(
    summary_id: str, sources: dict[str, list[tuple[int, int | None, str | None]]]
) -> set[str]:
    out: set[str] = set()
    stack = [summary_id]
    while stack:
        for _position, _message_id, child_id in sources.get(stack.pop(), []):
            if child_id is not None and child_id not in out:
                out.add(child_id)
                stack.append(child_id)
    return out


def doctor(pool: Pool, repair: bool) -> DoctorReport:
    f = _Findings(repair)
    with pool.connection() as conn:
        check = conn.execute("PRAGMA quick_check").fetchall()
        if [tuple(row) for row in check] != [("ok",)]:
            f.found(f"integrity: {len(check)} problem(s) reported by quick_check", fixable=False)
        for table, _rowid, parent, _fk in conn.execute("PRAGMA foreign_key_check").fetchall():
            f.found(f"{table}: a row references a missing {parent} row", fixable=False)
        ids = [row[0] for row in conn.execute("SELECT id FROM conversations ORDER BY id")]
        for cid in ids:
            # One transaction per conversation: other writers wait for one, not for all.
            with pool.write(conn) if repair else pool.read(conn):
                conv = conn.execute(
                    "SELECT id, uid, next_seq, next_ordinal, context_tokens, epoch, synced_len "
                    "FROM conversations WHERE id=?",
                    (cid,),
                ).fetchone()
                if conv is not None:
                    _check_conversation(conn, tuple(conv), f)
        messages = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
        summaries = conn.execute("SELECT count(*) FROM summaries").fetchone()[0]
    return DoctorReport(
        conversations=len(ids),
        messages=int(messages),
        summaries=int(summaries),
        problems=tuple(f.problems),
        repaired=tuple(f.repaired),
    )


def archive(pool: Pool, session_key: str) -> bool:
    with pool.connection() as conn, pool.write(conn):
        cursor = conn.execute(
            "UPDATE conversations SET archived_at=? WHERE session_key=? AND archived_at IS NULL",
            (time.time(), session_key),
        )
        return cursor.rowcount > 0


def _used_bytes(conn: sqlite3.Connection) -> int:
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)


def _file_bytes(path: str) -> int:
    return sum(os.path.getsize(name) for name in (path, path + "-wal") if os.path.exists(name))


def _delete_conversation(conn: sqlite3.Connection, cid: int) -> None:
    conn.execute("DELETE FROM context_items WHERE conversation_id=?", (cid,))
    conn.execute(
        "DELETE FROM summary_sources WHERE summary_id IN "
        "(SELECT id FROM summaries WHERE conversation_id=?)",
        (cid,),
    )
    for statement in _DELETE_BY_CONVERSATION:
        conn.execute(statement, (cid,))
    conn.execute("DELETE FROM conversations WHERE id=?", (cid,))


def prune(pool: Pool, max_bytes: int | None, archived_before: float | None) -> RetentionReport:
    before = _file_bytes(pool.path)
    deleted = 0
    with pool.connection() as conn:
        archived = [
            (row[0], row[1])
            for row in conn.execute(
                "SELECT id, archived_at FROM conversations WHERE archived_at IS NOT NULL "
                "ORDER BY archived_at, id"
            )
        ]
        for cid, archived_at in archived:
            old = archived_before is not None and archived_at < archived_before
            over = max_bytes is not None and _used_bytes(conn) > max_bytes
            if not (old or over):
                continue
            with pool.write(conn):
                _delete_conversation(conn, cid)
            deleted += 1
        if deleted:
            conn.execute("PRAGMA incremental_vacuum").fetchall()
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        over_ceiling = max_bytes is not None and _used_bytes(conn) > max_bytes
    return RetentionReport(deleted, before, _file_bytes(pool.path), over_ceiling)
