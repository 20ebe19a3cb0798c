"""The harness's own history: shared read-only between a turn's stages, copied for an engine.

``StrippedHistories.read`` hands out a :class:`FrozenHistory` of frozen messages, the same
list to every reader of an unchanged transcript; an engine gets its own copy, and what its
``assemble`` returns is checked with OpenClaw's wording for a bad message. (Accepting a
pass-through without that check saved 0.1% of a turn at a realistic model latency:
``benchmarks/bench_mechanisms.py``; it is not done.)
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn.frozen import FrozenDict
from codex_turn.harness import engine as engine_module
from codex_turn.harness.engine import AssembleParams, AssembleResult, validation
from codex_turn.harness.history_cache import StrippedHistories
from codex_turn.harness.lifecycle import (
    assemble_context_engine,
    finalize_context_engine_turn,
)
from codex_turn.harness.runtime_context import (
    FrozenHistory,
    RuntimeContextFree,
    strip_runtime_context_messages,
)
from codex_turn.harness.session import mirror_turn


def _message(index: int) -> dict[str, Any]:
    role = "user" if index % 2 == 0 else "assistant"
    return {"role": role, "content": [{"type": "text", "text": f"m{index}"}], "timestamp": 1}


@pytest.fixture
def session(tmp_path: Path) -> str:
    path = tmp_path / "s.jsonl"
    mirror_turn(
        str(path),
        [_message(i) for i in range(6)],
        scope="t",
        identities=[f"i{i}" for i in range(6)],
        session_id="s",
        cwd=str(tmp_path),
    )
    return str(path)


def test_a_read_is_the_shared_read_only_history_of_frozen_messages(session: str) -> None:
    histories = StrippedHistories()
    first = histories.read(session)
    assert type(first) is FrozenHistory
    assert len(first) == 6
    assert all(type(m) is FrozenDict for m in first)
    assert histories.read(session) is first  # unchanged transcript: shared, no copy
    for change in _MUTATIONS.values():
        with pytest.raises(TypeError, match="read-only"):
            change(first)
    assert len(first) == 6
    handed = strip_runtime_context_messages(first)  # what an engine gets: its own copy
    assert type(handed) is RuntimeContextFree
    assert handed == first
    assert handed is not first
    assert type(copy.copy(first)) is RuntimeContextFree
    assert type(copy.deepcopy(first)) is list
    assert type(copy.deepcopy(first)[0]) is dict
    assert pickle.loads(pickle.dumps(first)) == first


def test_a_read_after_an_append_extends_the_kept_history(session: str, tmp_path: Path) -> None:
    histories = StrippedHistories()
    before = histories.read(session)
    mirror_turn(
        session,
        [_message(6), _message(7)],
        scope="t",
        identities=["i6", "i7"],
        session_id="s",
        cwd=str(tmp_path),
    )
    after = histories.read(session)
    assert type(after) is FrozenHistory
    assert after is not before
    assert after[:6] == before
    assert [m["content"][0]["text"] for m in after[6:]] == ["m6", "m7"]
    assert all(type(m) is FrozenDict for m in after)
    assert after == StrippedHistories().read(session)  # the same as a fresh read


_MUTATIONS: dict[str, Callable[[list[Any]], object]] = {
    "setitem": lambda h: h.__setitem__(0, {"role": "user"}),
    "setslice": lambda h: h.__setitem__(slice(0, 1), [{"role": "user"}]),
    "delitem": lambda h: h.__delitem__(0),
    "iadd": lambda h: h.__iadd__([{"role": "user"}]),
    "imul": lambda h: h.__imul__(2),
    "append": lambda h: h.append({"role": "user"}),
    "extend": lambda h: h.extend([{"role": "user"}]),
    "insert": lambda h: h.insert(0, {"role": "user"}),
    "pop": lambda h: h.pop(),
    "remove": lambda h: h.remove(h[0] if h else None),
    "reverse": lambda h: h.reverse(),
    "sort": lambda h: h.sort(key=lambda m: str(m.get("content"))),
    "clear": lambda h: h.clear(),
}


class _Engine:
    """An engine whose assemble does ``change`` to the messages it is given, then hands them
    back (or hands back what ``change`` returns)."""

    info = engine_module.ContextEngineInfo(id="e", name="e", version="1")

    def __init__(self, change: Callable[[list[Any]], Any] | None = None) -> None:
        self.change = change
        self.given: list[Any] | None = None

    async def ingest(self, params: Any) -> Any:
        return engine_module.IngestResult(ingested=True)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        self.given = params.messages
        returned = params.messages
        if self.change is not None:
            replaced = self.change(params.messages)
            if replaced is not None:
                returned = replaced
        return AssembleResult(messages=returned, estimated_tokens=0)

    async def compact(self, params: Any) -> Any:
        return engine_module.CompactResult(ok=True, compacted=False)


def _assemble(engine: _Engine, messages: list[Any]) -> Any:
    async def run() -> Any:
        return await assemble_context_engine(
            engine=engine, session_id="s", session_key=None, messages=messages
        )

    return anyio.run(run)


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times ensure_assemble_result walked the types of a result's messages."""
    walks: list[int] = []
    real_map = map

    def counting_map(function: Any, *iterables: Any) -> Any:
        if function is type:
            walks.append(len(iterables[0]))
        return real_map(function, *iterables)

    monkeypatch.setattr(validation, "map", counting_map, raising=False)
    return walks


@pytest.mark.parametrize(
    ("change", "accepted"),
    [
        (lambda m: m.append("not an object"), False),
        (lambda m: list.append(m, "not an object"), False),  # C code: seen by the count
        (lambda m: m.__setitem__(1, 7), False),
        (lambda m: m.append({"role": "user", "content": "added"}), True),
        (lambda m: m[-2:], True),  # a slice: a plain list, walked
        (lambda m: [*m[:-1], None], False),
    ],
)
def test_a_changed_or_other_list_is_walked_and_a_bad_message_refused(
    session: str,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[list[Any]], Any],
    accepted: bool,
) -> None:
    walks = _count_walks(monkeypatch)
    outcome = _assemble(_Engine(change), StrippedHistories().read(session))
    assert len(walks) == 1
    assert outcome.status == ("assembled" if accepted else "failed")
    if not accepted:
        assert "must be an object" in str(outcome.error)


def test_a_plain_list_of_messages_is_walked_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    walks = _count_walks(monkeypatch)
    messages: list[Any] = [_message(0), "bad"]
    outcome = _assemble(_Engine(), messages)
    assert walks == [2]
    assert outcome.status == "failed"
    assert "messages[1] must be an object" in str(outcome.error)


def test_finalize_hands_after_turn_one_copy_with_the_right_count(session: str) -> None:
    snapshot = StrippedHistories().read(session)
    seen: list[Any] = []

    class AfterTurn(_Engine):
        async def after_turn(self, params: Any) -> None:
            seen.append(params)
            params.messages.append({"role": "user", "content": "the engine's own"})

    async def run() -> Any:
        return await finalize_context_engine_turn(
            engine=AfterTurn(),
            session_id="s",
            session_key=None,
            session_file=session,
            messages_snapshot=snapshot,
            pre_prompt_message_count=4,
            prompt_error=False,
            aborted=False,
            yield_aborted=False,
            run_maintenance=False,
        )

    outcome = anyio.run(run)
    assert outcome.succeeded
    assert outcome.path == "after_turn"
    (params,) = seen
    assert params.pre_prompt_message_count == 4
    assert params.messages is not snapshot
    assert len(snapshot) == 6
    assert params.messages[:6] == snapshot
    assert StrippedHistories().read(session) == snapshot
