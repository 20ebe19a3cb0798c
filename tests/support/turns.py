"""One turn's test inputs: a throwaway session file and the TurnParams for it.

Shared by the orchestrator tests that drive turns through the in-process fake app-server,
so each of them does not grow its own copy of the fixture and the params builder.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from codex_turn import TurnParams
from codex_turn.harness.session import clear_session_cache

__all__ = ["temporary_session_file", "turn_params"]


@contextlib.contextmanager
def temporary_session_file(prefix: str) -> Iterator[str]:
    """A session file path in a fresh directory; its read cache is dropped afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        path = os.path.join(directory, "session.jsonl")
        yield path
        clear_session_cache(path)


def turn_params(
    session_file: str, prompt: str, *, session_key: str | None = "agent:main:s-1", **overrides: Any
) -> TurnParams:
    """Session ``s-1`` in ``session_file``'s directory; ``overrides`` replace any field."""
    values: dict[str, Any] = {
        "session_id": "s-1",
        "session_key": session_key,
        "session_file": session_file,
        "workspace_dir": os.path.dirname(session_file),
        "prompt": prompt,
    }
    values.update(overrides)
    return TurnParams(**values)
