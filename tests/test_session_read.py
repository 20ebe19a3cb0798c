"""Reading transcripts exactly as pi/OpenClaw do: real fixtures, migrations, the tree walk,
and tolerance of malformed input (session-format.md sections 1 to 4 and 9.1)."""

from __future__ import annotations

import collections
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.transcripts import with_deep_entry

from codex_turn._json import MAX_JSON_DEPTH, nested_deeper_than
from codex_turn.harness.session import (
    ModelRef,
    SessionContext,
    build_session_context,
    iter_session_messages,
    load_session_context,
    load_session_messages,
    parse_session_bytes,
    read_session,
)

FIXTURES = Path(__file__).parent / "fixtures" / "sessions"


def _fixture(session_id: str) -> Path:
    return FIXTURES / f"okbest2024-openclaw-backup__{session_id}.jsonl"


def _manifest() -> dict[str, tuple[int, str]]:
    rows: dict[str, tuple[int, str]] = {}
    for line in (FIXTURES / "MANIFEST.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].endswith(".jsonl"):
            rows[cells[0]] = (int(cells[1]), cells[2])
    return rows


def _digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _write(path: Path, lines: list[Any], *, newline: str = "\n") -> Path:
    text = "".join(
        (line if isinstance(line, str) else json.dumps(line, separators=(",", ":"))) + newline
        for line in lines
    )
    path.write_bytes(text.encode())
    return path


HEADER = {
    "type": "session",
    "version": 3,
    "id": "s-1",
    "timestamp": "2026-03-01T00:00:00.000Z",
    "cwd": "/w",
}
TS = "2026-03-01T00:00:01.000Z"
TS_MS = 1772323201000


def _msg(entry_id: str, parent: str | None, role: str, text: str, **extra: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role, "content": text, "timestamp": 1, **extra}
    return {
        "type": "message",
        "id": entry_id,
        "parentId": parent,
        "timestamp": TS,
        "message": message,
    }


def _texts(ctx: SessionContext) -> list[str]:
    out = []
    for message in ctx.messages:
        content = message.get("content", message.get("summary"))
        out.append(content if isinstance(content, str) else json.dumps(content))
    return out


# --------------------------------------------------------------------------------------------
# Real fixtures (section 9.1)

EXPECTED_9_1 = {
    "d2e9ad15-1093-47ce-9fd5-95fb4255f267": (
        5,
        {"user": 1, "assistant": 1},
        "assistant",
        ("openrouter", "xiaomi/mimo-v2-pro"),
    ),
    "f2cd468e-644e-43ec-9edf-754c64fce19f": (
        12,
        {"user": 1, "assistant": 3, "toolResult": 4, "custom": 1},
        "custom",
        ("openrouter", "stepfun/step-3.5-flash:free"),
    ),
    "a9a9c6c6-419d-4c9f-a059-c262d061e3cd": (
        83,
        {"user": 3, "assistant": 38, "toolResult": 35},
        "assistant",
        ("bailian", "kimi-k2.5"),
    ),
    "890fb9ba-0015-47f8-944a-e428915a2933": (
        43,
        {"user": 1, "assistant": 20, "toolResult": 19},
        "assistant",
        ("openrouter", "stepfun/step-3.5-flash:free"),
    ),
}


def test_fixture_copies_match_the_manifest() -> None:
    manifest = _manifest()
    assert sorted(manifest) == sorted(p.name for p in FIXTURES.glob("*.jsonl"))
    for name, (size, sha) in manifest.items():
        data = (FIXTURES / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha)


@pytest.mark.parametrize("session_id", sorted(EXPECTED_9_1))
def test_real_fixture_reads_as_pi(session_id: str) -> None:
    entries, roles, last_role, model = EXPECTED_9_1[session_id]
    path = _fixture(session_id)
    before = _digest(path)
    transcript = read_session(path)
    ctx = load_session_context(path)
    assert transcript.header is not None
    assert transcript.header["id"] == session_id
    assert transcript.version == 3
    assert len(transcript.entries) == entries
    assert transcript.malformed_lines == 0
    assert not transcript.torn_tail
    assert len(ctx.messages) == sum(roles.values())
    assert dict(collections.Counter(m["role"] for m in ctx.messages)) == roles
    assert ctx.messages[-1]["role"] == last_role
    assert ctx.thinking_level == "low"
    assert ctx.model == ModelRef(*model)
    assert load_session_messages(path) == ctx.messages
    assert _digest(path) == before  # the reader never touches the file


def test_fixture_details_survive_losslessly() -> None:
    ctx = load_session_context(_fixture("d2e9ad15-1093-47ce-9fd5-95fb4255f267"))
    thinking = [
        block
        for message in ctx.messages
        if message["role"] == "assistant"
        for block in message["content"]
        if block["type"] == "thinking"
    ]
    assert thinking
    assert thinking[0]["thinkingSignature"] == "reasoning"
    aborted = [
        m
        for m in load_session_messages(_fixture("a9a9c6c6-419d-4c9f-a059-c262d061e3cd"))
        if m.get("stopReason") == "aborted"
    ]
    assert aborted
    assert aborted[0]["content"] == []
    assert aborted[0]["errorMessage"]
    errors = [
        m
        for m in load_session_messages(_fixture("890fb9ba-0015-47f8-944a-e428915a2933"))
        if m["role"] == "toolResult" and m["isError"]
    ]
    assert any("session_yield" in json.dumps(m["content"]) for m in errors)
    custom = load_session_messages(_fixture("f2cd468e-644e-43ec-9edf-754c64fce19f"))[-1]
    assert custom["customType"] == "openclaw.sessions_yield"
    assert isinstance(custom["timestamp"], int)


def test_fixture_bytes_round_trip_through_the_parser() -> None:
    path = _fixture("890fb9ba-0015-47f8-944a-e428915a2933")
    parsed = parse_session_bytes(path.read_bytes())
    lines = path.read_bytes().decode().splitlines()
    reserialised = [
        json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in parsed.entries
    ]
    assert reserialised == lines[1:]  # unknown keys and key order preserved


# --------------------------------------------------------------------------------------------
# Migrations (section 2): in memory only


def test_v1_file_migrates_in_memory_and_stays_byte_identical(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "v1.jsonl",
        [
            {
                "type": "session",
                "id": "v1-s",
                "timestamp": TS,
                "cwd": "/w",
                "provider": "a",
                "modelId": "m0",
                "thinkingLevel": "high",
            },
            {
                "type": "message",
                "timestamp": TS,
                "message": {"role": "user", "content": "one", "timestamp": 1},
            },
            "{not json",
            {
                "type": "message",
                "timestamp": TS,
                "message": {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "two"}],
                    "provider": "p1",
                    "model": "m1",
                    "timestamp": 2,
                },
            },
            {
                "type": "message",
                "timestamp": TS,
                "message": {"role": "user", "content": "three", "timestamp": 3},
            },
            # Index 2 counts the header as 0 and not the malformed line: "two".
            {
                "type": "compaction",
                "timestamp": TS,
                "summary": "S",
                "firstKeptEntryIndex": 2,
                "tokensBefore": 7,
            },
            {
                "type": "message",
                "timestamp": TS,
                "message": {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "four"}],
                    "provider": "p2",
                    "model": "m2",
                    "timestamp": 4,
                },
            },
            {"type": "thinking_level_change", "timestamp": TS, "thinkingLevel": "medium"},
        ],
    )
    before = _digest(path)
    transcript = read_session(path)
    assert transcript.version == 3
    assert transcript.header is not None
    assert transcript.header["version"] == 3
    assert "version" not in json.loads(path.read_text().splitlines()[0])
    ids = [e["id"] for e in transcript.entries]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 8 for i in ids)
    assert [e["parentId"] for e in transcript.entries] == [None, *ids[:-1]]
    compaction = transcript.entries[3]
    assert compaction["firstKeptEntryId"] == ids[1]
    assert "firstKeptEntryIndex" not in compaction
    ctx = load_session_context(path)
    assert [m["role"] for m in ctx.messages] == [
        "compactionSummary",
        "assistant",
        "user",
        "assistant",
    ]
    assert _texts(ctx)[0] == "S"
    assert ctx.messages[0]["tokensBefore"] == 7
    assert ctx.messages[0]["timestamp"] == TS_MS
    assert ctx.thinking_level == "medium"
    assert ctx.model == ModelRef("p2", "m2")
    assert read_session(path).entries == transcript.entries  # stable ids across reads
    assert _digest(path) == before


def test_v2_file_migrates_hook_messages_and_keeps_branches(tmp_path: Path) -> None:
    hook = {
        "role": "hookMessage",
        "customType": "x",
        "content": "hooked",
        "display": True,
        "timestamp": 5,
    }
    path = _write(
        tmp_path / "v2.jsonl",
        [
            {
                "type": "session",
                "version": 2,
                "id": "v2-s",
                "timestamp": TS,
                "cwd": "/w",
                "branchedFrom": "/old.jsonl",
            },
            _msg("a1", None, "user", "q"),
            _msg("a2", "a1", "assistant", "a", provider="p", model="m"),
            {"type": "message", "id": "b1", "parentId": "a2", "timestamp": TS, "message": hook},
            _msg("s1", "a1", "user", "sibling, off the path"),
            _msg("b2", "b1", "user", "after"),
        ],
    )
    before = _digest(path)
    ctx = load_session_context(path)
    assert [m["role"] for m in ctx.messages] == ["user", "assistant", "custom", "user"]
    assert _texts(ctx) == ["q", "a", "hooked", "after"]
    assert ctx.messages[2] == {**hook, "role": "custom"}
    transcript = read_session(path)
    assert transcript.header is not None
    assert transcript.header["branchedFrom"] == "/old.jsonl"
    assert _digest(path) == before


# --------------------------------------------------------------------------------------------
# buildSessionContext (section 3)


def test_compaction_keeps_from_first_kept_entry_and_only_the_last_counts() -> None:
    entries = [
        _msg("1", None, "user", "u1"),
        _msg("2", "1", "assistant", "a1"),
        {
            "type": "compaction",
            "id": "c1",
            "parentId": "2",
            "timestamp": TS,
            "summary": "old",
            "firstKeptEntryId": "1",
            "tokensBefore": 1,
        },
        _msg("3", "c1", "user", "u2"),
        _msg("4", "3", "assistant", "a2"),
        {
            "type": "compaction",
            "id": "c2",
            "parentId": "4",
            "timestamp": TS,
            "summary": "new",
            "firstKeptEntryId": "3",
            "tokensBefore": 9,
            "details": {"readFiles": []},
        },
        _msg("5", "c2", "user", "u3"),
    ]
    ctx = build_session_context(entries)
    assert ctx.messages[0] == {
        "role": "compactionSummary",
        "summary": "new",
        "tokensBefore": 9,
        "timestamp": TS_MS,
    }
    assert _texts(ctx)[1:] == ["u2", "a2", "u3"]
    off_path = [*entries[:5], {**entries[5], "firstKeptEntryId": "elsewhere"}, entries[6]]
    assert _texts(build_session_context(off_path)) == ["new", "u3"]


def test_branch_summaries_custom_messages_and_custom_entries() -> None:
    entries = [
        _msg("1", None, "user", "u1"),
        {
            "type": "branch_summary",
            "id": "b0",
            "parentId": "1",
            "timestamp": TS,
            "fromId": "1",
            "summary": "",
        },
        {
            "type": "branch_summary",
            "id": "b1",
            "parentId": "b0",
            "timestamp": TS,
            "fromId": "root",
            "summary": "went away",
        },
        {
            "type": "custom",
            "customType": "model-snapshot",
            "data": {"a": 1},
            "id": "c",
            "parentId": "b1",
            "timestamp": TS,
        },
        {
            "type": "custom_message",
            "customType": "openclaw.sessions_yield",
            "content": "y",
            "display": False,
            "id": "cm",
            "parentId": "c",
            "timestamp": TS,
        },
        {
            "type": "label",
            "id": "l",
            "parentId": "cm",
            "timestamp": TS,
            "targetId": "1",
            "label": "x",
        },
        {"type": "something_new", "id": "n", "parentId": "l", "timestamp": TS},
        _msg("2", "n", "user", "u2"),
    ]
    ctx = build_session_context(entries)
    assert ctx.messages == [
        entries[0]["message"],
        {"role": "branchSummary", "summary": "went away", "fromId": "root", "timestamp": TS_MS},
        {
            "role": "custom",
            "customType": "openclaw.sessions_yield",
            "content": "y",
            "display": False,
            "timestamp": TS_MS,
        },
        entries[-1]["message"],
    ]


def test_walk_stops_at_dangling_parent_cycle_and_missing_parent_key() -> None:
    dangling = [
        _msg("1", None, "user", "lost"),
        _msg("2", "gone", "user", "kept"),
        _msg("3", "2", "user", "leaf"),
    ]
    assert _texts(build_session_context(dangling)) == ["kept", "leaf"]
    cycle = [_msg("a", "b", "user", "A"), _msg("b", "a", "user", "B")]
    assert _texts(build_session_context(cycle)) == ["A", "B"]
    self_loop = [_msg("a", "a", "user", "A")]
    assert _texts(build_session_context(self_loop)) == ["A"]
    linear = [
        _msg("1", None, "user", "u1"),
        {
            "type": "message",
            "id": "2",
            "timestamp": TS,
            "message": {"role": "user", "content": "raw"},
        },
    ]
    assert _texts(build_session_context(linear)) == ["raw"]


def test_leaf_selection_duplicates_and_settings() -> None:
    entries = [
        {
            "type": "model_change",
            "id": "m",
            "parentId": None,
            "timestamp": TS,
            "provider": "p0",
            "modelId": "m0",
        },
        _msg("1", "m", "user", "u1"),
        _msg("2", "1", "assistant", "a1", provider="p1", model="m1"),
        {
            "type": "model_change",
            "id": "m2",
            "parentId": "2",
            "timestamp": TS,
            "provider": "p2",
            "modelId": "m2",
        },
        {
            "type": "thinking_level_change",
            "id": "t",
            "parentId": "m2",
            "timestamp": TS,
            "thinkingLevel": "high",
        },
        _msg("x", "1", "user", "branch"),
    ]
    ctx = build_session_context(entries)  # leaf = last line, a sibling branch
    assert _texts(ctx) == ["u1", "branch"]
    assert ctx.thinking_level == "off"
    assert ctx.model == ModelRef("p0", "m0")
    main = build_session_context(entries, leaf_id="t")
    assert _texts(main) == ["u1", "a1"]
    assert main.thinking_level == "high"
    assert main.model == ModelRef("p2", "m2")  # a later model_change wins over the assistant
    assert _texts(build_session_context(entries, leaf_id="unknown")) == ["u1", "branch"]
    duplicated = [*entries, _msg("1", None, "user", "replaced u1"), _msg("y", "1", "user", "y")]
    assert _texts(build_session_context(duplicated)) == ["replaced u1", "y"]
    assert build_session_context([]) == SessionContext([], "off", None)


# --------------------------------------------------------------------------------------------
# Malformed input (section 4)


def test_malformed_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "messy.jsonl",
        [
            HEADER,
            _msg("1", None, "user", "u1"),
            "",
            "   ",
            "{torn",
            "42",
            "[1,2]",
            "null",
            '"text"',
            '{"type":"message","id":"n","parentId":"1","timestamp":"x","message":{"role":"user","content":NaN}}',
            "[" * 50_000 + "]" * 50_000,
            {**HEADER, "id": "second-header"},
            _msg("2", "1", "assistant", "a1"),
        ],
    )
    transcript = read_session(path)
    assert transcript.malformed_lines == 3
    assert transcript.non_object_lines == 4
    assert [e["id"] for e in transcript.entries] == ["1", "2"]
    assert transcript.header is not None
    assert transcript.header["id"] == "s-1"
    assert _texts(load_session_context(path)) == ["u1", "a1"]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 600, 5000])
@pytest.mark.parametrize("session_id", sorted(EXPECTED_9_1))
def test_an_entry_nested_too_deeply_is_quarantined_and_counted(
    tmp_path: Path, session_id: str, depth: int
) -> None:
    # Before: a 600-deep line was accepted, and every later stage that walked it (the freeze
    # of the history, the engine's encoding) raised RecursionError on every later turn.
    fixture = _fixture(session_id)
    path = with_deep_entry(fixture, tmp_path / "deep.jsonl", depth)
    expected = load_session_context(fixture).messages
    transcript = read_session(path)
    assert transcript.malformed_lines == 1
    assert [e["id"] for e in transcript.entries] == [e["id"] for e in read_session(fixture).entries]
    with capture_logs() as logs:
        assert list(load_session_context(path).messages) == list(expected)
    assert "session transcript has malformed lines" in [log["event"] for log in logs]
    assert parse_session_bytes(path.read_bytes()).malformed_lines == 1
    assert [m for part in iter_session_messages(path, 50) for m in part] == list(expected)


def test_an_entry_at_the_depth_bound_is_read(tmp_path: Path) -> None:
    fixture = _fixture("890fb9ba-0015-47f8-944a-e428915a2933")
    path = with_deep_entry(fixture, tmp_path / "deep.jsonl", MAX_JSON_DEPTH)
    transcript = read_session(path)
    assert transcript.malformed_lines == 0
    deepest = load_session_messages(path)[-1]
    assert deepest["content"][0]["id"] == "call_deep"
    assert not nested_deeper_than(deepest, MAX_JSON_DEPTH - 1)
    assert nested_deeper_than(deepest, MAX_JSON_DEPTH - 2)


def test_crlf_bom_and_invalid_utf8_never_crash(tmp_path: Path) -> None:
    lines = [HEADER, _msg("1", None, "user", "u1"), _msg("2", "1", "assistant", "a1")]
    crlf = _write(tmp_path / "crlf.jsonl", lines, newline="\r\n")
    assert _texts(load_session_context(crlf)) == ["u1", "a1"]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + _write(tmp_path / "x.jsonl", lines).read_bytes())
    assert _texts(load_session_context(bom)) == ["u1", "a1"]
    bad = tmp_path / "bad.jsonl"
    raw = _write(tmp_path / "y.jsonl", lines).read_bytes().replace(b"u1", b"u\xff\xfe1")
    bad.write_bytes(raw + b"\x80\x81 not json \xc3\n")
    ctx = load_session_context(bad)
    assert _texts(ctx) == ["u\ufffd\ufffd1", "a1"]
    assert read_session(bad).malformed_lines == 1


def test_torn_last_line_is_ignored_but_a_complete_unterminated_one_counts(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [HEADER, _msg("1", None, "user", "u1")])
    whole = json.dumps(_msg("2", "1", "assistant", "a1"), separators=(",", ":")).encode()
    with path.open("ab") as handle:
        handle.write(whole[:-5])
    transcript = read_session(path)
    assert transcript.torn_tail
    assert transcript.malformed_lines == 1
    assert _texts(load_session_context(path)) == ["u1"]
    with path.open("ab") as handle:
        handle.write(whole[-5:])
    assert not read_session(path).torn_tail
    assert _texts(load_session_context(path)) == ["u1", "a1"]


def test_files_without_a_valid_header_read_as_empty_with_a_warning(tmp_path: Path) -> None:
    secret_text = "do-not-log-this-prompt"
    cases = {
        "no-header": [_msg("1", None, "user", secret_text)],
        "header-without-id": [{**HEADER, "id": 7}, _msg("1", None, "user", secret_text)],
    }
    for name, lines in cases.items():
        path = _write(tmp_path / f"{name}.jsonl", lines)
        with capture_logs() as logs:
            assert load_session_messages(path) == []
        warnings = [log for log in logs if log["log_level"] == "warning"]
        assert len(warnings) == 1, name
        assert warnings[0]["path"] == str(path)
        assert secret_text not in repr(logs)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with capture_logs() as logs:
        assert load_session_messages(empty) == []
        assert load_session_messages(tmp_path / "missing.jsonl") == []
    assert logs == []


def test_unreadable_path_reads_as_empty_with_a_warning(tmp_path: Path) -> None:
    directory = tmp_path / "dir.jsonl"
    directory.mkdir()
    with capture_logs() as logs:
        assert load_session_messages(directory) == []
    assert [log["event"] for log in logs] == ["session transcript read failed"]


def test_reader_opens_read_only(tmp_path: Path) -> None:
    path = _write(tmp_path / "ro.jsonl", [HEADER, _msg("1", None, "user", "u1")])
    os.chmod(path, 0o400)
    before = _digest(path)
    assert _texts(load_session_context(path)) == ["u1"]
    assert _digest(path) == before
