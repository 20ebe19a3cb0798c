"""The orchestrator's per-session stripped history: incremental, and right after a rebuild."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from codex_turn.harness.session import (
    MessageHistory,
    clear_session_cache,
    load_session_messages,
    mirror_turn,
)
from codex_turn.harness.turn.context import StrippedHistories as _StrippedHistories

HIDDEN = {
    "role": "custom",
    "customType": "openclaw.runtime-context",
    "content": "hidden",
    "display": False,
}


def msg(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text, "timestamp": 1}


def append(path: Path, *messages: dict[str, Any], turn: str) -> None:
    mirror_turn(
        path,
        list(messages),
        scope="t",
        identities=[f"{turn}:{i}" for i in range(len(messages))],
        session_id="s",
        cwd="/",
    )


def test_reads_extend_the_stripped_history_incrementally(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    append(path, msg("user", "one"), HIDDEN, msg("assistant", "two"), turn="a")
    cache = _StrippedHistories()
    first = cache.read(str(path))
    assert [m["content"] for m in first] == ["one", "two"]

    append(path, msg("user", "three"), HIDDEN, msg("assistant", "four"), turn="b")
    view = load_session_messages(path)
    assert isinstance(view, MessageHistory)
    second = cache.read(str(path))
    assert [m["content"] for m in second] == ["one", "two", "three", "four"]
    # Incremental: the earlier view is a prefix of the later one.
    assert view.appended_since(view) == []
    # Shared with every reader, read-only: a caller cannot change it (it copies to edit).
    with pytest.raises(TypeError, match="read-only"):
        second.append(msg("user", "mutated by a caller"))
    mine = list(second)
    mine.append(msg("user", "mutated by a caller"))
    assert [m["content"] for m in cache.read(str(path))] == ["one", "two", "three", "four"]


def test_a_rebuilt_history_is_stripped_from_scratch(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    append(path, msg("user", "one"), HIDDEN, turn="a")
    cache = _StrippedHistories()
    assert [m["content"] for m in cache.read(str(path))] == ["one"]
    old_view = load_session_messages(path)
    clear_session_cache(path)  # the next read rebuilds a new list
    append(path, msg("assistant", "two"), turn="b")
    new_view = load_session_messages(path)
    assert isinstance(old_view, MessageHistory)
    assert isinstance(new_view, MessageHistory)
    assert new_view.appended_since(old_view) is None
    assert [m["content"] for m in cache.read(str(path))] == ["one", "two"]


def test_the_cache_is_bounded(tmp_path: Path) -> None:
    cache = _StrippedHistories(capacity=2)
    for name in ("a", "b", "c"):
        path = tmp_path / f"{name}.jsonl"
        append(path, msg("user", name), turn=name)
        assert [m["content"] for m in cache.read(str(path))] == [name]
    assert len(cache._entries) == 2
