"""The durable outbox of turns: one small owner-only JSON file next to the transcript.

``<session file>.turns.json`` (the session file's
:func:`~codex_turn.harness._fs.session_path` plus the suffix, like the binding's sidecar)
holds one entry per advancement key of the turns an engine with durable turns has to be
told of: its state in the outbox machine (:mod:`codex_turn.fsm.outbox`, which decides every
move: :meth:`TurnOutbox.fire` only applies it), the transcript key of its prompt, and, once
the run returned, how it ended. Synchronous; call it from a worker thread.

* **Written whole, atomically** (:func:`~codex_turn.harness._fs.atomic_write`: temp file,
  rename; ``0600`` whatever the umask). A host killed mid-write leaves the previous outbox.
  The admission is also fsynced (file and directory); the later moves need not be
  (:data:`_SYNCED_TRIGGERS` says why). Writers are the turns of the session, serialised by the
  session hold (gate and lease), so a read-modify-write never races another writer.
* **Bounded.** Unsettled entries are all kept; of the settled ones, the newest
  :data:`SETTLED_KEPT` (for inspection), the rest dropped: the engine's own idempotency per
  key, not the outbox, is what makes a late replay harmless.
* **Forgiving to read.** A missing file is an empty outbox; an unreadable or malformed one
  is logged and read as empty (the turns it held are then the engine's bootstrap's to catch
  up from the transcript), and the next write replaces it.

Entries hold keys, states and statuses only, never message text.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Final

import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm.errors import IllegalTransition
from codex_turn.fsm.outbox import (
    SETTLED_STATES,
    OutboxState,
    OutboxTrigger,
    next_outbox_state,
)
from codex_turn.harness._fs import atomic_write, session_path

__all__ = [
    "OUTBOX_SUFFIX",
    "SETTLED_KEPT",
    "OutboxEntry",
    "OutboxUnreadable",
    "TurnOutbox",
    "outbox_path",
]

OUTBOX_SUFFIX: Final = ".turns.json"
OUTBOX_VERSION: Final = 1
#: Settled entries kept for inspection (the newest); older ones are dropped.
SETTLED_KEPT: Final = 16
#: An outbox larger than this is not this library's (it holds keys and states only).
_MAX_OUTBOX_BYTES: Final = 4 * 1024 * 1024

#: The moves written with fsyncs. Only the admission must survive an OS crash (the turn is
#: then recovered); a later move an OS crash loses leaves the entry where it was, and its
#: recovery ends the same way (a turn ``admitted`` is recovered from the transcript; a commit
#: replayed answers ``duplicate``). Every write is atomic all the same.
_SYNCED_TRIGGERS: Final = frozenset({OutboxTrigger.ADMITTED})

_log = get_logger(__name__)


def outbox_path(session_file: str | os.PathLike[str]) -> str:
    """Where the outbox of ``session_file`` lives."""
    return session_path(session_file) + OUTBOX_SUFFIX


@attrs.frozen
class OutboxEntry:
    advancement_key: str
    state: OutboxState
    #: The transcript key (``idempotencyKey``) of the turn's prompt entry.
    prompt_key: str | None = None
    #: How the run ended (``TurnTerminal.status``), once it returned.
    terminal: str | None = None
    #: Codex's error for the terminal (redacted), when it had one.
    error: str | None = None
    #: Commits tried (a blocked entry is retried on every start and turn).
    attempts: int = 0
    updated_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "advancementKey": self.advancement_key,
            "state": self.state.value,
            "promptKey": self.prompt_key,
            "terminal": self.terminal,
            "error": self.error,
            "attempts": self.attempts,
            "updatedAt": self.updated_at,
        }

    @classmethod
    def from_json(cls, data: Any) -> OutboxEntry:
        if not isinstance(data, dict) or not isinstance(data.get("advancementKey"), str):
            raise ValueError("an outbox entry needs an advancementKey")

        def text(name: str) -> str | None:
            value = data.get(name)
            return value if isinstance(value, str) else None

        attempts = data.get("attempts")
        updated = data.get("updatedAt")
        return cls(
            advancement_key=data["advancementKey"],
            state=OutboxState(str(data.get("state"))),
            prompt_key=text("promptKey"),
            terminal=text("terminal"),
            error=text("error"),
            attempts=attempts if isinstance(attempts, int) and attempts >= 0 else 0,
            updated_at=float(updated) if isinstance(updated, int | float) else 0.0,
        )


class OutboxUnreadable(OSError):
    """The outbox exists but cannot be read whole (malformed, a newer version): it is left
    as it is, never rewritten from the part that could be read."""


@attrs.define
class TurnOutbox:
    """The outbox of one session file (see the module docstring)."""

    path: str

    @classmethod
    def of(cls, session_file: str | os.PathLike[str]) -> TurnOutbox:
        return cls(outbox_path(session_file))

    def entries(self) -> list[OutboxEntry]:
        """The entries, oldest first, for reading (recovery, inspection): an unreadable or
        malformed outbox reads as empty and a malformed entry is skipped, both logged."""
        try:
            return self._read(strict=False)
        except OSError as error:
            _log.warning("turn outbox unreadable; read as empty", error=format_error(error))
            return []

    def _read(self, *, strict: bool) -> list[OutboxEntry]:
        """The entries; ``strict`` (before a write): any doubt raises :class:`OSError` instead,
        so that a rewrite never drops the entries a failed or partial read did not see."""
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read(_MAX_OUTBOX_BYTES + 1)
        except FileNotFoundError:
            return []
        try:
            if len(raw) > _MAX_OUTBOX_BYTES:
                raise ValueError("the outbox is too large")
            document = json.loads(raw)
            if not isinstance(document, dict) or document.get("version") != OUTBOX_VERSION:
                raise ValueError("not a turn outbox of this version")
            items = document.get("turns", [])
            if not isinstance(items, list):
                raise ValueError("the outbox's turns are not a list")
        except (ValueError, TypeError) as error:
            if strict:
                raise OutboxUnreadable(f"the turn outbox is malformed: {error}") from None
            _log.warning("turn outbox malformed; read as empty", error=format_error(error))
            return []
        entries = []
        for item in items:
            try:
                entries.append(OutboxEntry.from_json(item))
            except (ValueError, TypeError, KeyError) as error:
                if strict:
                    raise OutboxUnreadable(f"an outbox entry is malformed: {error}") from None
                _log.warning("turn outbox entry malformed; skipped", error=format_error(error))
        return entries

    def entry(self, advancement_key: str) -> OutboxEntry | None:
        return next((e for e in self.entries() if e.advancement_key == advancement_key), None)

    def fire(self, advancement_key: str, trigger: OutboxTrigger, **changes: Any) -> OutboxEntry:
        """Move the entry of ``advancement_key`` on ``trigger`` as the outbox table says (an
        unknown key is created by ``admitted`` only), set ``changes``, and write the outbox.
        Raises :class:`~codex_turn.fsm.IllegalTransition` for a move the table refuses, and
        :class:`OSError` when the outbox cannot be read whole or written (it is then
        unchanged: a write never drops what a failed read did not see)."""
        entries = self._read(strict=True)
        index = next(
            (i for i, e in enumerate(entries) if e.advancement_key == advancement_key), None
        )
        if index is None:
            if trigger is not OutboxTrigger.ADMITTED:
                raise IllegalTransition("<none>", str(trigger), why="no such turn in the outbox")
            current = OutboxEntry(advancement_key, OutboxState.ADMITTED)
            state = OutboxState.ADMITTED
        else:
            state = next_outbox_state(entries[index].state, trigger)
            current = entries.pop(index)
        if trigger is OutboxTrigger.ADMITTED:
            current = OutboxEntry(advancement_key, OutboxState.ADMITTED)  # (re)starts fresh
        updated = attrs.evolve(current, state=state, updated_at=time.time(), **changes)
        entries.append(updated)
        self._write(entries, durable=trigger in _SYNCED_TRIGGERS)
        return updated

    def _write(self, entries: list[OutboxEntry], *, durable: bool) -> None:
        settled = [e for e in entries if e.state in SETTLED_STATES]
        dropped = {id(e) for e in settled[: max(0, len(settled) - SETTLED_KEPT)]}
        kept = [e for e in entries if id(e) not in dropped]
        document = {"version": OUTBOX_VERSION, "turns": [e.to_json() for e in kept]}
        atomic_write(self.path, (json.dumps(document, indent=2) + "\n").encode(), durable=durable)
