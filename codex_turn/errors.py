"""The root of codex-turn's error hierarchy.

Every error this library raises on purpose derives from :class:`CodexTurnError`, so a runner
can catch "anything codex-turn refused" in one clause. Each part of the design (``fsm``,
``projection``, ``harness``) defines its own small family below this root, next to the code
that raises it; errors from lower layers (OS, JSON-RPC, engines) are mapped into these once,
at the boundary where they enter.
"""

from __future__ import annotations

__all__ = ["CodexTurnError"]


class CodexTurnError(Exception):
    """Base class of every error raised by codex-turn."""
