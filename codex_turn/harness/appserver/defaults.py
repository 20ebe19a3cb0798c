"""The app-server timing and memory defaults, in one place.

Every layer that takes one of these as a parameter (the client, :class:`~.manager.AppServer`,
and :class:`codex_turn.harness.compaction.CompactSessionParams`) defaults to the constant
here, so they can never drift apart again.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "INTERRUPT_GRACE_S",
    "MAX_REMEMBERED_THREADS",
    "NATIVE_COMPACTION_TIMEOUT_S",
]

INTERRUPT_GRACE_S: Final = 5.0
"""How long an interrupted turn may take to be acknowledged (Codex answers ``turn/interrupt``
and sends ``turn/completed`` within milliseconds; see the dynamic-tools reference, §2)."""

NATIVE_COMPACTION_TIMEOUT_S: Final = 300.0
"""The bound on one native ``thread/compact/start`` run (OpenClaw's default: 5 minutes)."""

MAX_REMEMBERED_THREADS: Final = 256
"""How many threads :class:`~.manager.AppServer` remembers resume parameters for (an LRU:
the least recently used thread is forgotten first; a forgotten thread is simply no longer
re-resumed automatically after a process restart)."""
