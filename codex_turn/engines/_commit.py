"""The reference engine's ``commit_turn``: one logical turn, applied once, in one transaction.

Durable turns (:mod:`codex_turn.harness.engine.durable`): the host settles each turn with
``commit_turn`` under a stable advancement key, after the run and again after a crash. The
engine answers ``committed`` the first time and ``duplicate`` every time after, and applies
the turn atomically: inside one ``BEGIN IMMEDIATE`` the key is looked up in the per-turn
ledger (``turns``, the table ``after_turn``'s ledger uses, under the ``advance:`` prefix so
the two never meet), the turn's messages the store does not hold are inserted with their
path identities, the path checkpoint advances and the key is recorded. A host killed at any
point leaves either all of it or none of it; two hosts committing one key are serialised by
SQLite's write lock, and the second sees the first's ledger row.

*The current-turn fence holds in the store too.* A transcript that ends with a user message
ends with a turn in flight: its prompt was made durable before the model ran, and its host
died, or runs it now (a retry of the same turn). Bootstrap does not import that prompt
(:func:`without_turn_in_flight`): otherwise the retry's assembly would hold its own prompt,
which the model is sent as the prompt too. The turn's commit (or ``after_turn``, or an
assembly handed a history that holds it) brings it, with its reply.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

from codex_turn.engines import _store
from codex_turn.engines._schema import Pool

__all__ = ["ADVANCE_PREFIX", "commit_turn", "without_turn_in_flight"]

#: The ledger namespace of advancement keys (``after_turn`` keys are bare hex digests).
ADVANCE_PREFIX: Final = "advance:"


def commit_turn(
    pool: Pool,
    conversation_id: int,
    advancement_key: str,
    prepared: Sequence[_store.Prepared],
    *,
    synced: tuple[int, str | None] | None,
) -> bool:
    """Apply the turn once: ``True`` when it was committed now, ``False`` when the ledger
    already held ``advancement_key`` (nothing is written then). ``prepared``: the path's
    messages from the sync start (held ones are skipped); ``synced``: the new checkpoint."""
    turn_key = ADVANCE_PREFIX + advancement_key
    with pool.connection() as conn, pool.write(conn):
        seen = conn.execute(
            "SELECT 1 FROM turns WHERE conversation_id=? AND turn_key=?",
            (conversation_id, turn_key),
        ).fetchone()
        if seen is not None:
            return False
        inserted = _store._insert(conn, conversation_id, prepared)  # inside this write
        if synced is not None:
            conn.execute(
                "UPDATE conversations SET synced_len=?, synced_anchor=? WHERE id=?",
                (*synced, conversation_id),
            )
        conn.execute(
            "INSERT INTO turns(conversation_id, turn_key, message_count, ingested, "
            "committed_at) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, turn_key, len(prepared), inserted, time.time()),
        )
        return True


def without_turn_in_flight(
    batches: Iterator[list[dict[str, Any]]],
) -> Iterator[list[dict[str, Any]]]:
    """``batches`` of a transcript's messages, less its last message when that is a user
    message (a turn in flight, see the module docstring). Closing it closes ``batches``."""
    try:
        held: list[dict[str, Any]] | None = None
        for batch in batches:
            if held:
                yield held
            held = batch
        if held and held[-1].get("role") == "user":
            held = held[:-1]
        if held:
            yield held
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
