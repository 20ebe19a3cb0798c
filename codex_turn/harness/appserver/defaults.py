"""The app-server timing and memory defaults, in one place.

Every layer that takes one of these as a parameter (the client, :class:`~.manager.AppServer`,
and :class:`codex_turn.harness.compaction.CompactSessionParams`) defaults to the constant
here, so they can never drift apart again.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CODEX_VERSION",
    "INTERRUPT_GRACE_S",
    "LIVENESS_TIMEOUT_S",
    "MAX_KEPT_FORKS",
    "MAX_LOGGED_ID_CHARS",
    "MAX_REMEMBERED_THREADS",
    "NATIVE_COMPACTION_TIMEOUT_S",
]

CODEX_VERSION: Final = "0.163.0"
"""The Codex release whose app-server protocol this library speaks (the ``codex`` extra pins
its binary, ``openai-codex-cli-bin``; the tests' schema is generated from it)."""

INTERRUPT_GRACE_S: Final = 5.0
"""How long an interrupted turn may take to be acknowledged (Codex answers ``turn/interrupt``
and sends ``turn/completed`` within milliseconds; see the dynamic-tools reference, §2)."""

NATIVE_COMPACTION_TIMEOUT_S: Final = 300.0
"""The bound on one native ``thread/compact/start`` run (OpenClaw's default: 5 minutes)."""

MAX_REMEMBERED_THREADS: Final = 256
"""How many threads :class:`~.manager.AppServer` remembers resume parameters for (an LRU:
the least recently used thread is forgotten first; a forgotten thread is simply no longer
re-resumed automatically after a process restart)."""

MAX_KEPT_FORKS: Final = 32
"""How many idle forks :class:`~.manager.AppServer` keeps loaded for their session's next
turn (the structured projection's continued fork; an LRU: the least recently kept one is
released first). Each costs Codex ~1.5 MB plus its history, and the harness a record of the
items it holds."""

LIVENESS_TIMEOUT_S: Final = 10.0
"""How long a process that just missed a deadline has to show any sign of life (a line on
stdout, e.g. the answer to the liveness probe, which Codex gives in under a millisecond even
mid-turn) before it is declared dead, killed and replaced (see :mod:`.connection`)."""

MAX_LOGGED_ID_CHARS: Final = 200
"""The longest identifier (thread, turn, request id, tool or method name) logged verbatim;
longer ones are cut and marked with their length (see :func:`.logsafe.capped`)."""
