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
projection no longer reaches goes back in as a raw item where it belongs (before the first
item that starts after it in ``seq``), one reached twice loses its raw duplicate; summaries
nothing reaches are removed with their edges. A message is never deleted.

*A summary whose sources are gone* (no edges, gaps, a lost message or child, a source of the
wrong shape, or such a summary below it) no longer says what it stands for, so it cannot stay
in the DAG: the context item naming it is *re-pointed at what it summarised*, in its place,
in source order (each surviving message raw, each intact child summary as it is, broken
children opened the same way); messages nothing reaches any more (the edges were lost) come
back by the rule above; the broken summary is then unreachable and removed. Messages whose
rows are gone cannot be restored (the report names them). Items keep their ordinals where
they still ascend; an insertion that does not fit the gap shifts what follows (the epoch then
changes, as it must: the summary layer did).

*Private files*: :func:`private_file_findings` names the files the library keeps owner-only
for a session (the store beside it and SQLite's sidecars, the thread binding, the lock file)
that group or others may read: what an earlier version or a hand made wider (the library
creates them ``0600`` whatever the umask, and changes no existing file's mode). ``codex-turn
doctor`` prints them.

*Retention* never touches an active conversation, so the latest turns and everything a live
summary stands for stay: :func:`archive` ends a session's conversation (a reset: the next call
for the key starts a new one; the archived one stays reachable by the recall tools),
:func:`prune` deletes archived conversations archived before a time, then, while the file is
over a byte ceiling (``EngineSettings.max_db_bytes``, 1 GiB by default, kept by background
maintenance), works through the archived conversations oldest first in two steps: first it
*sheds* them (:func:`_shed`: the messages their summaries stand for lose their content, which
becomes :data:`PRUNED_CONTENT`, and their index entries, while the summaries, the DAG and what
their context showed raw all stay, so the old conversation's summaries stay searchable and
describable: ``recall_expand`` says what was pruned), then, if that was not enough, it deletes
them whole. The freed pages go back to the file system (``incremental_vacuum``).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections import Counter
from typing import Any, Final, NamedTuple

import attrs

from codex_turn.engines._messages import search_text
from codex_turn.engines._plan import compute_epoch
from codex_turn.engines._schema import (
    PRUNED_CONTENT,
    STORE_FILE,
    STORE_SIDECARS,
    Pool,
    decode_content,
)
from codex_turn.harness._fs import PermissionFinding, loose_permissions, session_path
from codex_turn.harness.binding import binding_path

__all__ = [
    "DoctorReport",
    "RetentionReport",
    "archive",
    "doctor",
    "private_file_findings",
    "prune",
]

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
    #: Archived conversations whose summarised messages were dropped, summaries kept.
    shed_conversations: int = 0

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


class _Entry(NamedTuple):
    """One context item of the repaired layout (``ordinal`` None: new, to be placed)."""

    ordinal: int | None
    message_id: int | None
    summary_id: str | None
    tokens: int


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

    # 3. the DAG (leaf -> messages, condensed -> summaries one level shallower). A summary
    # whose sources cannot be followed (gone, or of the wrong shape) is *broken*, and so is
    # every summary above it: it no longer says which messages it stands for.
    below: dict[str, list[int]] = {}
    broken: set[str] = set()

    def bad(summary_id: str, problem: str) -> None:
        broken.add(summary_id)
        # Repaired below: the summary leaves the context, what it still reaches takes its
        # place, and it is removed as unreachable (its messages are never touched).
        f.found(f"{name}: summary {summary_id} {problem}", fixable=True)

    def expand(summary_id: str, trail: tuple[str, ...] = ()) -> list[int]:
        if summary_id in below:
            return below[summary_id]
        kind, depth, _tokens, _count = summaries[summary_id]
        reached: list[int] = []
        edges = sources.get(summary_id, [])
        if not edges:
            bad(summary_id, "has no sources")
        if [e[0] for e in edges] != list(range(len(edges))):
            bad(summary_id, "has gaps in its source positions")
        for _position, message_id, child_id in edges:
            if message_id is not None:
                if kind != "leaf" or depth != 0:
                    bad(summary_id, f"({kind}) has a message source")
                if message_id not in messages:
                    bad(summary_id, f"lost message {message_id}")
                    continue
                reached.append(message_id)
            elif child_id is not None:
                child = summaries.get(child_id)
                if child is None or child_id in trail:
                    bad(summary_id, f"lost child {child_id}")
                    continue
                if kind != "condensed" or child[1] != depth - 1:
                    bad(summary_id, "has a child of the wrong depth")
                reached.extend(expand(child_id, (*trail, summary_id)))
                if child_id in broken:
                    broken.add(summary_id)
        below[summary_id] = reached
        return reached

    for summary_id, (_kind, _depth, _tokens, count) in summaries.items():
        reached = expand(summary_id)
        if summary_id in broken:
            continue  # leaves the DAG below
        if count != len(reached) and f.found(
            f"{name}: summary {summary_id} descendant_count {count} != {len(reached)}", fixable=True
        ):
            conn.execute(
                "UPDATE summaries SET descendant_count=? WHERE id=?", (len(reached), summary_id)
            )

    def surviving(summary_id: str, trail: tuple[str, ...] = ()) -> list[_Entry]:
        """What a broken summary still reaches, in source order: its messages raw, intact
        children as they are, broken children opened the same way."""
        out: list[_Entry] = []
        for _position, message_id, child_id in sources.get(summary_id, []):
            if message_id is not None and message_id in messages:
                out.append(_Entry(None, message_id, None, messages[message_id][1]))
            elif child_id is not None and child_id in summaries and child_id not in trail:
                if child_id in broken:
                    out.extend(surviving(child_id, (*trail, summary_id)))
                else:
                    out.append(_Entry(None, None, child_id, summaries[child_id][2]))
        return out

    # 2. + 4. the projection: valid items, every message reached exactly once
    layout: list[_Entry] = []
    for ordinal, message_id, summary_id, tokens in items:
        if message_id is not None:
            row = messages.get(message_id)
            if row is None:
                f.found(f"{name}: item {ordinal} names a missing message", fixable=True)
                continue
            want = row[1]
        else:
            found = summaries.get(summary_id or "")
            if found is None:
                f.found(f"{name}: item {ordinal} names a missing summary", fixable=True)
                continue
            assert summary_id is not None
            if summary_id in broken:
                # Re-pointed at what it summarised: the first replacement keeps its place.
                replacement = surviving(summary_id)
                f.found(
                    f"{name}: item {ordinal} names summary {summary_id} whose sources are "
                    f"gone; replaced by its {len(replacement)} surviving source(s)",
                    fixable=True,
                )
                if replacement:
                    replacement[0] = replacement[0]._replace(ordinal=ordinal)
                layout.extend(replacement)
                continue
            want = found[2]
        if tokens != want:
            f.found(f"{name}: item {ordinal} tokens {tokens} != {want}", fixable=True)
        layout.append(_Entry(ordinal, message_id, summary_id, want))

    def reached_by(entry: _Entry) -> list[int]:
        if entry.message_id is not None:
            return [entry.message_id]
        return below.get(entry.summary_id or "", [])

    coverage: Counter[int] = Counter()
    for entry in layout:
        coverage.update(reached_by(entry))
    for message_id, (seq, tokens) in sorted(messages.items(), key=lambda kv: kv[1][0]):
        times = coverage.get(message_id, 0)
        if times == 0:
            f.found(f"{name}: message {message_id} is not reachable", fixable=True)
            # Back where it belongs: before the first item that starts after it (in seq).
            at = next(
                (
                    i
                    for i, entry in enumerate(layout)
                    if (first := min((messages[m][0] for m in reached_by(entry)), default=None))
                    is not None
                    and first > seq
                ),
                len(layout),
            )
            layout.insert(at, _Entry(None, message_id, None, tokens))
        elif times > 1:
            raw = [i for i, entry in enumerate(layout) if entry.message_id == message_id]
            if raw:
                f.found(f"{name}: message {message_id} is reached {times} times", fixable=True)
                del layout[raw[0]]
            else:
                f.found(f"{name}: message {message_id} is in two summaries", fixable=False)

    used_summaries: set[str] = set()
    for entry in layout:
        if entry.summary_id is not None:
            used_summaries.add(entry.summary_id)
            used_summaries.update(_descendant_summaries(entry.summary_id, sources))
    unused = sorted(set(summaries) - used_summaries)
    for summary_id in unused:
        f.found(f"{name}: summary {summary_id} is not reachable", fixable=True)

    # Ordinals: kept where they still ascend, the next free one otherwise (so a repair
    # shifts only what follows an insertion that did not fit in the gap).
    placed: list[tuple[int, int | None, str | None, int]] = []
    previous = -1
    for entry in layout:
        ordinal = (
            entry.ordinal
            if entry.ordinal is not None and entry.ordinal > previous
            else previous + 1
        )
        placed.append((ordinal, entry.message_id, entry.summary_id, entry.tokens))
        previous = ordinal
    if f.repair:
        if placed != [tuple(row) for row in items]:
            conn.execute("DELETE FROM context_items WHERE conversation_id=?", (cid,))
            conn.executemany(
                "INSERT INTO context_items(conversation_id, ordinal, message_id, summary_id, "
                "tokens) VALUES (?, ?, ?, ?, ?)",
                [(cid, *row) for row in placed],
            )
        for summary_id in unused:
            conn.execute("DELETE FROM summary_sources WHERE summary_id=?", (summary_id,))
            conn.execute(
                "INSERT INTO summaries_fts(summaries_fts, rowid, text) "
                "SELECT 'delete', rowid, content FROM summaries WHERE id=?",
                (summary_id,),
            )
            conn.execute("DELETE FROM summaries WHERE id=?", (summary_id,))

    # 5. cached counters
    total = sum(row[3] for row in placed)
    ordinal_next = max([next_ordinal, *(row[0] + 1 for row in placed)])
    seq_next = max([next_seq, *(seq + 1 for seq, _ in messages.values())])
    layer = [(row[0], row[2]) for row in placed if row[2] is not None]
    fixes = {
        "context_tokens": (context_tokens, total),
        "next_ordinal": (next_ordinal, ordinal_next),
        "next_seq": (next_seq, seq_next),
        "epoch": (epoch, compute_epoch(uid, layer)),
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
        dangling = [
            f"{table}: a row references a missing {parent} row"
            for table, _rowid, parent, _fk in conn.execute("PRAGMA foreign_key_check")
        ]
        f.problems.extend(dangling)  # repaired when the conversation's repair removes them
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
        if repair and dangling:
            left = Counter(
                f"{table}: a row references a missing {parent} row"
                for table, _rowid, parent, _fk in conn.execute("PRAGMA foreign_key_check")
            )
            fixed = Counter(dangling) - left
            f.repaired.extend(fixed.elements())
            first: dict[str, int] = {}
            for index, problem in enumerate(f.problems):
                first.setdefault(problem, index)
            f.repaired.sort(key=first.__getitem__)  # in the order they were found
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


def _unindex_conversation(conn: sqlite3.Connection, cid: int) -> None:
    """Remove the conversation's rows from the contentless full-text indexes (FTS5's
    ``delete`` takes the indexed text again: recomputed from the stored rows)."""
    rows = conn.execute(
        "SELECT id, content FROM messages WHERE conversation_id=? AND content!=?",
        (cid, PRUNED_CONTENT),
    )
    while batch := rows.fetchmany(512):
        conn.executemany(
            "INSERT INTO messages_fts(messages_fts, rowid, text) VALUES ('delete', ?, ?)",
            [(mid, search_text(json.loads(decode_content(raw)))) for mid, raw in batch],
        )
    conn.execute(
        "INSERT INTO summaries_fts(summaries_fts, rowid, text) "
        "SELECT 'delete', rowid, content FROM summaries WHERE conversation_id=?",
        (cid,),
    )


def _delete_conversation(conn: sqlite3.Connection, cid: int) -> None:
    _unindex_conversation(conn, cid)
    conn.execute("DELETE FROM context_items WHERE conversation_id=?", (cid,))
    conn.execute(
        "DELETE FROM summary_sources WHERE summary_id IN "
        "(SELECT id FROM summaries WHERE conversation_id=?)",
        (cid,),
    )
    for statement in _DELETE_BY_CONVERSATION:
        conn.execute(statement, (cid,))
    conn.execute("DELETE FROM conversations WHERE id=?", (cid,))


def _merge_indexes(conn: sqlite3.Connection) -> None:
    """Merge the full-text indexes, dropping the entries deleted from them: a contentless
    FTS5 delete only *adds* a tombstone until the index is merged, so without this a prune
    step would grow the file it is meant to shrink (a rewrite of the index: retention runs in
    background maintenance, and only over the ceiling)."""
    for table in ("messages_fts", "summaries_fts"):
        conn.execute(f"INSERT INTO {table}({table}) VALUES ('optimize')")  # noqa: S608 - constants


def _shed(conn: sqlite3.Connection, cid: int) -> bool:
    """Drop the archived conversation ``cid``'s messages that its summaries stand for (their
    content becomes :data:`PRUNED_CONTENT`, their index entries go), keeping the rows, the
    summaries and the messages no summary stands for (what its context showed raw). The DAG
    and the projection are untouched, so ``doctor`` finds nothing. True when it dropped any."""
    rows = conn.execute(
        "SELECT m.id, m.content FROM messages AS m WHERE m.conversation_id=? AND m.content!=? "
        "AND EXISTS (SELECT 1 FROM summary_sources AS ss WHERE ss.message_id=m.id)",
        (cid, PRUNED_CONTENT),
    )
    shed = False
    while batch := rows.fetchmany(512):
        shed = True
        conn.executemany(
            "INSERT INTO messages_fts(messages_fts, rowid, text) VALUES ('delete', ?, ?)",
            [(mid, search_text(json.loads(decode_content(raw)))) for mid, raw in batch],
        )
        conn.executemany(
            "UPDATE messages SET content=? WHERE id=?",
            [(PRUNED_CONTENT, mid) for mid, _raw in batch],
        )
    return shed


def prune(pool: Pool, max_bytes: int | None, archived_before: float | None) -> RetentionReport:
    """Retention (see the module docstring): archived conversations only, oldest first."""
    before = _file_bytes(pool.path)
    deleted = shed = 0
    with pool.connection() as conn:
        archived = [
            (row[0], row[1])
            for row in conn.execute(
                "SELECT id, archived_at FROM conversations WHERE archived_at IS NOT NULL "
                "ORDER BY archived_at, id"
            )
        ]

        def over() -> bool:
            return max_bytes is not None and _used_bytes(conn) > max_bytes

        kept: list[int] = []
        for cid, archived_at in archived:
            if archived_before is not None and archived_at < archived_before:
                with pool.write(conn):
                    _delete_conversation(conn, cid)
                deleted += 1
            else:
                kept.append(cid)
        if deleted:
            with pool.write(conn):
                _merge_indexes(conn)
        # Over the ceiling: first what old summaries stand for, then old conversations whole.
        for cid in kept:
            if not over():
                break
            with pool.write(conn):
                if _shed(conn, cid):
                    _merge_indexes(conn)
                    shed += 1
        for cid in kept:
            if not over():
                break
            with pool.write(conn):
                _delete_conversation(conn, cid)
                _merge_indexes(conn)
            deleted += 1
        if deleted or shed:
            conn.execute("PRAGMA incremental_vacuum").fetchall()
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        over_ceiling = over()
    return RetentionReport(deleted, before, _file_bytes(pool.path), over_ceiling, shed)


def private_file_findings(
    session_file: str | os.PathLike[str], store: str | os.PathLike[str] | None = None
) -> tuple[PermissionFinding, ...]:
    """The files kept owner-only for ``session_file`` that group or others may use: the
    store (default: the one beside the session) and its ``-wal``/``-shm``, the thread
    binding sidecar, the lock file. Missing files are not findings; nothing is changed."""
    directory = os.path.dirname(os.path.abspath(os.fspath(session_file)))
    database = os.fspath(store) if store is not None else os.path.join(directory, STORE_FILE)
    return loose_permissions(
        [
            database,
            *(database + suffix for suffix in STORE_SIDECARS),
            binding_path(session_file),
            session_path(session_file) + ".lock",
        ]
    )
