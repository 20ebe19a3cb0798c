"""Fixtures of the ``codex_turn.scale`` suites (registered by ``tests/conftest.py``): an
embedded SQLite database URL per test, and a :class:`~codex_turn.scale.TurnQueue` on it.
``codex_turn.scale`` (DBOS) is imported only by a test that asks for a queue."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from codex_turn.scale import TurnQueue


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/turns.sqlite"


@pytest.fixture
def queue(db_url: str) -> Iterator[TurnQueue]:
    from codex_turn.scale import TurnQueue

    with TurnQueue(db_url) as turns:
        yield turns
