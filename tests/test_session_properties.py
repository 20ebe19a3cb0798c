"""Hypothesis: garbage never crashes the reader, corruption and truncation never lose an
intact entry, and a generated session tree reads back as exactly its path."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codex_turn.harness.session import (
    load_session_context,
    load_session_messages,
    parse_session_bytes,
    read_session,
)

TS = "2026-03-01T00:00:01.000Z"
TS_MS = 1772323201000
HEADER = {
    "type": "session",
    "version": 3,
    "id": "s",
    "timestamp": "2026-03-01T00:00:00.000Z",
    "cwd": "/w",
}

_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.text(max_size=8),
    st.floats(allow_nan=False, allow_infinity=False),
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
_objects = st.dictionaries(st.text(max_size=6), _json, max_size=4).filter(
    lambda obj: obj.get("type") != "session"  # extra headers are dropped by design
)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_the_reader(data: bytes) -> None:
    parse_session_bytes(data)
    parse_session_bytes(_dump(HEADER) + b"\n" + data)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "g.jsonl"
        path.write_bytes(data)
        load_session_messages(path)
        read_session(path)
        assert path.read_bytes() == data


@settings(max_examples=200, deadline=None)
@given(
    objects=st.lists(_objects, min_size=1, max_size=12),
    corrupt=st.lists(
        st.tuples(st.integers(0, 11), st.integers(0, 200), st.binary(min_size=1, max_size=6))
    ),
    cut=st.one_of(st.none(), st.integers(0, 4000)),
    crlf=st.booleans(),
)
def test_corruption_and_truncation_never_lose_an_intact_entry(
    objects: list[dict[str, Any]],
    corrupt: list[tuple[int, int, bytes]],
    cut: int | None,
    crlf: bool,
) -> None:
    lines = [_dump(obj) for obj in objects]
    damaged: set[int] = set()
    for index, position, garbage in corrupt:
        if index < len(lines):
            garbage = garbage.replace(b"\n", b"?")
            line = lines[index]
            lines[index] = (
                line[: position % (len(line) + 1)] + garbage + line[position % (len(line) + 1) :]
            )
            damaged.add(index)
    ending = b"\r\n" if crlf else b"\n"
    data = b"".join(line + ending for line in lines)
    if cut is not None:
        data = data[:cut]
    intact: list[dict[str, Any]] = []
    offset = 0
    for index, line in enumerate(lines):
        end = offset + len(line)  # the line is intact if its content survived the cut
        if index not in damaged and end <= len(data):
            intact.append(objects[index])
        offset = end + len(ending)
    parsed = parse_session_bytes(data)
    found = list(parsed.entries)
    # Every intact line is found, in order (extras come only from damaged lines that still parse).
    iterator = iter(found)
    assert all(any(candidate == wanted for candidate in iterator) for wanted in intact)
    assert parsed.malformed_lines + parsed.non_object_lines <= len(damaged) + 1


# --------------------------------------------------------------------------------------------
# A generated tree: a main path plus off-path siblings; the last line ends the main path.


@st.composite
def _session_tree(
    draw: st.DrawFn,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str, tuple[str, str] | None]:
    counter = iter(range(10_000))
    path_len = draw(st.integers(1, 25))
    main: list[dict[str, Any]] = []
    expected: list[dict[str, Any]] = []
    thinking = "off"
    model: tuple[str, str] | None = None
    parent: str | None = None
    for _ in range(path_len):
        entry_id = f"{next(counter):08x}"
        kind = draw(
            st.sampled_from(
                [
                    "user",
                    "assistant",
                    "toolResult",
                    "custom_message",
                    "branch_summary",
                    "custom",
                    "thinking",
                    "model",
                    "label",
                ]
            )
        )
        base = {"id": entry_id, "parentId": parent, "timestamp": TS}
        if kind in ("user", "assistant", "toolResult"):
            message: dict[str, Any] = {
                "role": kind,
                "content": draw(st.text(max_size=6)),
                "extra": draw(_json),
            }
            if kind == "assistant":
                message |= {
                    "provider": draw(st.sampled_from(["p1", "p2"])),
                    "model": draw(st.sampled_from(["m1", "m2"])),
                }
                model = (message["provider"], message["model"])
            entry = {"type": "message", **base, "message": message}
            expected.append(message)
        elif kind == "custom_message":
            entry = {
                "type": "custom_message",
                "customType": "c",
                "content": "x",
                "display": True,
                **base,
            }
            expected.append(
                {
                    "role": "custom",
                    "customType": "c",
                    "content": "x",
                    "display": True,
                    "timestamp": TS_MS,
                }
            )
        elif kind == "branch_summary":
            summary = draw(st.sampled_from(["", "went elsewhere"]))
            entry = {"type": "branch_summary", **base, "fromId": "root", "summary": summary}
            if summary:
                expected.append(
                    {
                        "role": "branchSummary",
                        "summary": summary,
                        "fromId": "root",
                        "timestamp": TS_MS,
                    }
                )
        elif kind == "thinking":
            thinking = draw(st.sampled_from(["low", "medium", "high"]))
            entry = {"type": "thinking_level_change", **base, "thinkingLevel": thinking}
        elif kind == "model":
            model = (draw(st.sampled_from(["p3", "p4"])), draw(st.sampled_from(["m3", "m4"])))
            entry = {"type": "model_change", **base, "provider": model[0], "modelId": model[1]}
        elif kind == "custom":
            entry = {"type": "custom", "customType": "model-snapshot", "data": draw(_json), **base}
        else:
            entry = {"type": "label", **base, "targetId": entry_id, "label": "l"}
        main.append(entry)
        parent = entry_id
    lines = list(main)
    for _ in range(draw(st.integers(0, 15))):  # off-path siblings, inserted before the leaf
        anchor = draw(st.sampled_from([None, *[e["id"] for e in main]]))
        sibling = {
            "type": "message",
            "id": f"{next(counter):08x}",
            "parentId": anchor,
            "timestamp": TS,
            "message": {"role": "user", "content": "OFF-PATH"},
        }
        position = draw(st.integers(0, len(lines) - 1))
        if anchor is None or position > next(i for i, e in enumerate(lines) if e["id"] == anchor):
            lines.insert(position, sibling)
    return lines, expected, thinking, model


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=_session_tree())
def test_generated_tree_reads_back_exactly_its_path(
    tree: tuple[list[dict[str, Any]], list[dict[str, Any]], str, tuple[str, str] | None],
) -> None:
    lines, expected, thinking, model = tree
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "tree.jsonl"
        path.write_bytes(b"".join(_dump(obj) + b"\n" for obj in [HEADER, *lines]))
        ctx = load_session_context(path)
    assert ctx.messages == expected
    assert ctx.thinking_level == thinking
    assert ((ctx.model.provider, ctx.model.model_id) if ctx.model else None) == model
