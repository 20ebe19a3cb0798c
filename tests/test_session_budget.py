"""The transcript caches' byte ceiling, eviction, and the streaming reader."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codex_turn.harness.history_cache import StrippedHistories
from codex_turn.harness.runtime_context import strip_runtime_context_messages
from codex_turn.harness.session import (
    budget,
    build_session_context,
    clear_session_cache,
    iter_session_messages,
    load_session_context,
    parse_session_bytes,
    session_cache_limit,
    session_cache_usage,
    set_session_cache_limit,
)


@pytest.fixture(autouse=True)
def _restore_limit() -> Iterator[None]:
    clear_session_cache()
    yield
    set_session_cache_limit(None)
    clear_session_cache()


HEADER = {"type": "session", "version": 3, "id": "s", "timestamp": "t", "cwd": "/"}


def line(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def entry(entry_id: str, parent: str | None, text: str, role: str = "user") -> dict[str, Any]:
    message = {"role": role, "content": [{"type": "text", "text": text}], "timestamp": 1}
    return {"type": "message", "id": entry_id, "parentId": parent, "message": message}


def fresh(path: Path) -> list[dict[str, Any]]:
    """The uncached reference: parse the whole file, build pi's context."""
    parsed = parse_session_bytes(path.read_bytes())
    if parsed.header is None:
        return []
    return list(build_session_context(parsed.entries).messages)


def streamed(path: Path, chunk: int = 3) -> list[dict[str, Any]]:
    return [m for part in iter_session_messages(path, chunk) for m in part]


# (op, argument): append n entries on the leaf, branch from an older entry, compact, torn
# tail, rewrite the file, evict everything, evict under a tiny ceiling, read.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 4)),
        st.tuples(st.just("branch"), st.integers(0, 50)),
        st.tuples(st.just("compact"), st.integers(0, 50)),
        st.tuples(st.just("torn"), st.integers(0, 1)),
        st.tuples(st.just("rewrite"), st.integers(1, 5)),
        st.tuples(st.just("clear"), st.integers(0, 0)),
        st.tuples(st.just("squeeze"), st.integers(0, 2000)),
    ),
    min_size=1,
    max_size=25,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_a_read_after_eviction_equals_the_read_before_and_a_fresh_parse(
    tmp_path: Path, ops: list[tuple[str, int]]
) -> None:
    path = tmp_path / "s.jsonl"
    other = tmp_path / "other.jsonl"
    other.write_bytes(line(HEADER) + line(entry("o1", None, "x" * 500)))
    path.write_bytes(line(HEADER))
    ids: list[str] = []
    counter = 0
    histories = StrippedHistories()
    set_session_cache_limit(None)
    clear_session_cache()

    def add(obj: dict[str, Any]) -> None:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            data += b"\n"  # the mirror isolates a torn tail the same way
        path.write_bytes(data + line(obj))

    held: list[tuple[list[Any], list[Any]]] = []  # (a read handed out, its contents then)
    for op, arg in ops:
        before = list(load_session_context(path).messages)
        if op == "append":
            for _ in range(arg):
                counter += 1
                add(entry(f"e{counter}", ids[-1] if ids else None, f"m{counter}"))
                ids.append(f"e{counter}")
        elif op == "branch" and ids:
            counter += 1
            add(entry(f"e{counter}", ids[arg % len(ids)], f"b{counter}", "assistant"))
            ids.append(f"e{counter}")
        elif op == "compact" and ids:
            counter += 1
            compaction = {
                "type": "compaction",
                "id": f"e{counter}",
                "parentId": ids[-1],
                "summary": "sum",
                "firstKeptEntryId": ids[arg % len(ids)],
                "tokensBefore": 10,
                "timestamp": "2026-01-01T00:00:00.000Z",
            }
            add(compaction)
            ids.append(f"e{counter}")
        elif op == "torn":
            with path.open("ab") as handle:
                handle.write(b'{"type":"message","id":"torn' if arg else b"\n")
        elif op == "rewrite":
            ids = [f"r{counter}-{i}" for i in range(arg)]
            counter += 1
            body = [entry(i, ids[n - 1] if n else None, i) for n, i in enumerate(ids)]
            path.write_bytes(line(HEADER) + b"".join(map(line, body)))
        elif op == "clear":
            clear_session_cache()
        elif op == "squeeze":
            # A ceiling this small evicts the session as soon as another one is read.
            set_session_cache_limit(arg)
            load_session_context(other)
            after_evict = list(load_session_context(path).messages)
            set_session_cache_limit(None)
            assert after_evict == fresh(path)
            assert after_evict == before  # the file did not change: nor does the read
        expected = fresh(path)
        assert list(load_session_context(path).messages) == expected
        assert streamed(path) == expected
        read = histories.read(str(path))
        assert read == list(strip_runtime_context_messages(expected))
        held.append((read, list(read)))
        # A read is shared and read-only: what a running turn holds never changes under it.
        assert all(kept == contents for kept, contents in held)
    clear_session_cache()
    assert list(load_session_context(path).messages) == fresh(path)


def test_an_unchanged_file_reads_the_same_after_eviction(tmp_path: Path) -> None:
    paths = []
    for n in range(5):
        path = tmp_path / f"{n}.jsonl"
        body = [entry(f"{n}-{i}", f"{n}-{i - 1}" if i else None, "t" * 200) for i in range(20)]
        path.write_bytes(line(HEADER) + b"".join(map(line, body)))
        paths.append(path)
    before = [list(load_session_context(p).messages) for p in paths]
    set_session_cache_limit(1)  # everything but the entry in use goes
    after = [list(load_session_context(p).messages) for p in paths]
    assert before == after


def test_the_ceiling_is_respected_beyond_one_entry(tmp_path: Path) -> None:
    limit = 40_000
    set_session_cache_limit(limit)
    histories = StrippedHistories()
    largest = 0
    for n in range(30):
        path = tmp_path / f"{n}.jsonl"
        body = [entry(f"e{i}", f"e{i - 1}" if i else None, "x" * (50 * n)) for i in range(10)]
        path.write_bytes(line(HEADER) + b"".join(map(line, body)))
        histories.read(str(path))
        size = path.stat().st_size
        largest = max(
            largest,
            budget.ENTRY_OVERHEAD + budget.READ_BYTES_PER_BYTE * size,
        )
        assert session_cache_usage() <= limit + largest
    assert session_cache_limit() == limit
    set_session_cache_limit(0)
    assert session_cache_usage() <= largest


def test_the_ceiling_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(budget.ENV_LIMIT, "12345")
    set_session_cache_limit(None)
    assert session_cache_limit() == 12345
    monkeypatch.setenv(budget.ENV_LIMIT, "nonsense")
    set_session_cache_limit(None)
    assert session_cache_limit() == budget.DEFAULT_LIMIT
    with pytest.raises(ValueError, match=">= 0"):
        set_session_cache_limit(-1)


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_the_streaming_read_retains_no_parsed_graph(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    n = 3000
    body = [entry(f"e{i}", f"e{i - 1}" if i else None, f"text {i}") for i in range(n)]
    path.write_bytes(line(HEADER) + b"".join(map(line, body)))
    base = _tracked()
    count = 0
    for part in iter_session_messages(path, 256):
        count += len(part)
    del part
    assert count == n
    assert _tracked() - base < 50  # nothing kept: not one object per message
    assert load_session_context(path).messages  # the cached read keeps its graph
    assert _tracked() - base > n


def test_the_streaming_read_serves_a_cached_transcript_from_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(line(HEADER) + line(entry("a", None, "one")) + line(entry("b", "a", "two")))
    cached = load_session_context(path).messages
    (chunk,) = iter_session_messages(path, 10)
    assert chunk[0] is cached[0]  # shared, not re-parsed


def test_the_streaming_read_follows_the_cache_on_odd_files(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    assert streamed(path) == []  # missing
    path.write_bytes(b"")
    assert streamed(path) == []
    path.write_bytes(line({"type": "message"}) + line(entry("a", None, "x")))
    assert streamed(path) == [] == fresh(path)  # a foreign first object
    legacy = {"type": "session", "id": "s", "timestamp": "t"}  # v1: migrated by the cache
    path.write_bytes(line(legacy) + line({"type": "message", "message": {"role": "user"}}))
    assert streamed(path) == list(load_session_context(path).messages)
    path.write_bytes(b"\xef\xbb\xbf" + line(HEADER) + b"not json\n" + line(entry("a", None, "x")))
    clear_session_cache()
    assert streamed(path) == fresh(path) == list(load_session_context(path).messages)
    path.write_bytes(line(HEADER) + line(entry("a", None, "x"))[:-1])  # a complete last line
    clear_session_cache()
    assert streamed(path) == list(load_session_context(path).messages)
    with pytest.raises(ValueError, match="chunk"):
        list(iter_session_messages(path, 0))
