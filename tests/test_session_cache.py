"""Incremental reads: O(new bytes) for appends, a full re-read for replaced, truncated or
rewritten files, and always the same answer as a cold parse."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.session_turns import expected_messages, turn_messages

from codex_turn.harness.session import (
    SessionContext,
    build_session_context,
    clear_session_cache,
    load_session_context,
    load_session_messages,
    migrate_session_entries,
    mirror_turn,
    parse_session_bytes,
)
from codex_turn.harness.session import _format as format_mod

HEADER = {
    "type": "session",
    "version": 3,
    "id": "s",
    "timestamp": "2026-03-01T00:00:00.000Z",
    "cwd": "/w",
}
TS = "2026-03-01T00:00:01.000Z"


def _line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _msg(entry_id: str, parent: str | None, text: str, role: str = "user") -> dict[str, Any]:
    return {
        "type": "message",
        "id": entry_id,
        "parentId": parent,
        "timestamp": TS,
        "message": {"role": role, "content": text},
    }


def _cold(data: bytes) -> SessionContext:
    parsed = parse_session_bytes(data)
    if parsed.header is None:
        return SessionContext([])
    objects = (
        [parsed.header, *parsed.entries]
        if parsed.first_object is parsed.header
        else list(parsed.entries)
    )
    _, entries, _ = migrate_session_entries(parsed.header, objects)
    return build_session_context(entries)


def _chain(path: Path, count: int) -> None:
    with path.open("wb") as handle:
        handle.write(_line(HEADER))
        parent = None
        for index in range(count):
            handle.write(_line(_msg(f"e{index}", parent, f"m{index}")))
            parent = f"e{index}"


class _Counters:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes_read = 0
        self.full_builds = 0
        real_pread = os.pread
        real_build = format_mod._context_from_path

        def pread(fd: int, length: int, offset: int) -> bytes:
            data = real_pread(fd, length, offset)
            self.bytes_read += len(data)
            return data

        def build(path: Any) -> SessionContext:
            self.full_builds += 1
            return real_build(path)

        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(format_mod, "_context_from_path", build)

    def reset(self) -> None:
        self.bytes_read = self.full_builds = 0


def test_appends_cost_new_bytes_only_and_extend_the_cached_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.jsonl"
    _chain(path, 20_000)
    counters = _Counters(monkeypatch)
    assert len(load_session_messages(path)) == 20_000
    assert counters.full_builds == 1
    assert counters.bytes_read >= path.stat().st_size
    for _ in range(3):  # unchanged: digests only
        counters.reset()
        assert len(load_session_messages(path)) == 20_000
        assert counters.bytes_read <= 4 * 4096
        assert counters.full_builds == 0
    size = path.stat().st_size
    messages, identities = turn_messages("t", 0)
    mirror_turn(
        path, messages, scope="codex-app-server:t", identities=identities, session_id="s", cwd="/"
    )
    appended = path.stat().st_size - size
    counters.reset()
    after = load_session_messages(path)
    assert after[-4:] == expected_messages("t", range(1))
    assert len(after) == 20_004
    assert counters.full_builds == 0  # extended in O(new entries)
    assert counters.bytes_read <= appended + 4 * 4096


def test_replaced_truncated_and_rewritten_files_are_reread(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    _chain(path, 50)
    assert load_session_messages(path)[-1]["content"] == "m49"
    replacement = tmp_path / "other.jsonl"
    _chain(replacement, 3)
    os.replace(replacement, path)  # a new inode, e.g. a rewrite by pi's SessionManager
    assert [m["content"] for m in load_session_messages(path)] == ["m0", "m1", "m2"]
    _chain(path, 60)
    assert len(load_session_messages(path)) == 60
    with path.open("r+b") as handle:  # truncated in place
        handle.truncate(len(_line(HEADER)) + 2 * len(_line(_msg("e0", None, "m0"))))
    assert [m["content"] for m in load_session_messages(path)] == ["m0", "m1"]
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"m1"', b'"X1"'))  # same size, same inode, new content
    assert [m["content"] for m in load_session_messages(path)] == ["m0", "X1"]
    path.unlink()
    assert load_session_messages(path) == []


def test_branching_and_duplicate_ids_fall_back_to_a_full_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.jsonl"
    _chain(path, 10)
    load_session_messages(path)
    counters = _Counters(monkeypatch)
    with path.open("ab") as handle:
        handle.write(_line(_msg("b", "e3", "branch")))
    assert [m["content"] for m in load_session_messages(path)] == ["m0", "m1", "m2", "m3", "branch"]
    assert counters.full_builds == 1
    with path.open("ab") as handle:
        handle.write(_line(_msg("e2", "e1", "re-used id")))  # re-routes e3's parent
        handle.write(_line(_msg("c", "e3", "child of e3")))
    assert [m["content"] for m in load_session_messages(path)] == [
        "m0",
        "m1",
        "re-used id",
        "m3",
        "child of e3",
    ]
    assert counters.full_builds == 2


# --------------------------------------------------------------------------------------------
# Property: incremental == cold, whatever is appended and however it is split

_ids = st.sampled_from([f"i{n}" for n in range(12)])
_entry = st.one_of(
    st.builds(
        lambda i, p, t, r: _msg(i, p, t, r),
        _ids,
        st.one_of(st.none(), _ids),
        st.text(max_size=5),
        st.sampled_from(["user", "assistant", "toolResult"]),
    ),
    st.builds(
        lambda i, p, lvl: {
            "type": "thinking_level_change",
            "id": i,
            "parentId": p,
            "timestamp": TS,
            "thinkingLevel": lvl,
        },
        _ids,
        st.one_of(st.none(), _ids),
        st.sampled_from(["low", "high"]),
    ),
    st.builds(
        lambda i, p, k: {
            "type": "compaction",
            "id": i,
            "parentId": p,
            "timestamp": TS,
            "summary": "S",
            "firstKeptEntryId": k,
            "tokensBefore": 1,
        },
        _ids,
        st.one_of(st.none(), _ids),
        _ids,
    ),
)
_chunk = st.one_of(
    st.lists(_entry, min_size=1, max_size=4).map(lambda es: b"".join(_line(e) for e in es)),
    st.binary(max_size=12),  # garbage, torn fragments, stray newlines
    st.just(b"\n"),
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(header=st.booleans(), chunks=st.lists(_chunk, min_size=1, max_size=12))
def test_incremental_reads_equal_cold_reads(header: bool, chunks: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "s.jsonl"
        data = _line(HEADER) if header else b""
        path.write_bytes(data)
        for chunk in chunks:
            with path.open("ab") as handle:
                handle.write(chunk)
            data += chunk
            assert load_session_context(path) == _cold(data)
            assert path.read_bytes() == data
        clear_session_cache(path)
        assert load_session_context(path) == _cold(data)


def test_an_entry_older_entries_named_as_parent_reroutes_their_path(tmp_path: Path) -> None:
    """Found by the property above: ``i0`` names ``i1`` as its parent before ``i1`` exists;
    when ``i1`` arrives in a later append, the path through ``i0`` reaches it, so the cached
    conversation must be rebuilt, not extended."""
    path = tmp_path / "s.jsonl"

    def entry(entry_id: str, parent: str | None) -> bytes:
        return _line(_msg(entry_id, parent, entry_id))

    first = _line(HEADER) + entry("i0", None) + entry("i0", "i1")
    path.write_bytes(first)
    assert len(load_session_messages(path)) == 1
    second = entry("i1", None) + entry("i2", "i0")
    with path.open("ab") as handle:
        handle.write(second)
    assert load_session_context(path) == _cold(first + second)
    assert len(load_session_messages(path)) == 3
