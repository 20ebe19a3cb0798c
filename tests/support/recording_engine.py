"""The recording engine, now public: :mod:`codex_turn.testing.recording_engine`.

Kept so the suites that import it from here keep working; new code imports
``from codex_turn.testing import RecordingEngine``.
"""

from __future__ import annotations

from codex_turn.testing.recording_engine import (
    ALL_METHODS,
    OPTIONAL_METHODS,
    Call,
    EngineMethod,
    Failure,
    RecordingEngine,
    Response,
)

__all__ = [
    "ALL_METHODS",
    "OPTIONAL_METHODS",
    "Call",
    "EngineMethod",
    "Failure",
    "RecordingEngine",
    "Response",
]
