"""What a bound thread lacks of the transcript (the coverage), and this turn's prompt by key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from codex_turn.harness.binding import (
    HistoryCoverage,
    ThreadBinding,
    read_binding,
    write_binding,
)
from codex_turn.harness.turn.continuity import (
    ADVANCE_AFTER,
    coverage_of,
    covered_through,
    message_digest,
    without_prompt,
)
from codex_turn.projection.frame import drop_duplicate_prompt

X, Y, T = "thread-x", "thread-y", "thread-t"


def msg(role: str, text: str, key: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": text}]}
    if key is not None:
        message["idempotencyKey"] = key
    return message


def turn_on(thread: str, n: int, *, prompt_key: str | None = None) -> list[dict[str, Any]]:
    """A turn's prompt and reply as our mirror keys them."""
    return [
        msg("user", f"prompt {n}", prompt_key or f"codex-app-server:{thread}:run-{n}:prompt"),
        msg("assistant", f"reply {n}", f"codex-app-server:{thread}:turn-{n}:assistant"),
    ]


def bound(thread: str, coverage: HistoryCoverage | None) -> ThreadBinding:
    return ThreadBinding(thread_id=thread, history_covered_through=coverage)


def texts(messages: Any) -> list[str]:
    return [m["content"][0]["text"] for m in messages]


def test_no_binding_lacks_nothing_and_a_binding_without_a_record_is_recorded_next() -> None:
    history = turn_on(X, 1)
    assert coverage_of(history, None, prompt_key=None).uncovered == ()
    legacy = coverage_of(history, bound(X, None), prompt_key=None)
    assert (legacy.lost, legacy.stale, legacy.advance) == (False, False, True)


def test_the_thread_lacks_nothing_it_answered_itself() -> None:
    before = turn_on(Y, 0)
    history = [*before, *turn_on(X, 1), *turn_on(X, 2)]
    coverage = coverage_of(history, bound(X, covered_through(before)), prompt_key=None)
    assert (coverage.lost, coverage.uncovered, coverage.advance) == (False, (), False)


def test_turns_that_ran_elsewhere_are_uncovered_in_order() -> None:
    history = [*turn_on(X, 1), *turn_on(T, 2), *turn_on(X, 3), msg("user", "host note")]
    coverage = coverage_of(history, bound(X, covered_through([])), prompt_key=None)
    assert texts(coverage.uncovered) == ["prompt 2", "reply 2", "host note"]
    assert coverage.stale
    assert coverage.advance


def test_a_prompt_belongs_to_the_thread_that_answered_it() -> None:
    # Made durable on X, answered on Y (an overflow's retry); and a host-keyed prompt.
    retried = [msg("user", "prompt 1", f"codex-app-server:{X}:run-1:prompt"), turn_on(Y, 1)[1]]
    stable = [msg("user", "prompt 2", "codex-turn:turn-k2:prompt"), turn_on(Y, 2)[1]]
    history = [*retried, *stable]
    on_y = coverage_of(history, bound(Y, covered_through([])), prompt_key=None)
    assert on_y.uncovered == ()
    on_x = coverage_of(history, bound(X, covered_through([])), prompt_key=None)
    # X was sent prompt 1 (it overflowed there), never its answer nor the rest.
    assert texts(on_x.uncovered) == ["reply 1", "prompt 2", "reply 2"]


def test_a_host_message_without_a_key_is_never_taken_for_the_threads() -> None:
    history = [msg("user", "written by the host"), *turn_on(X, 1)]
    coverage = coverage_of(history, bound(X, covered_through([])), prompt_key=None)
    assert texts(coverage.uncovered) == ["written by the host"]


def test_this_turns_own_prompt_is_never_context() -> None:
    key = "codex-turn:turn-k9:prompt"
    history = [*turn_on(X, 1), msg("user", "prompt 9", key)]
    coverage = coverage_of(history, bound(X, covered_through([])), prompt_key=key)
    assert coverage.uncovered == ()
    assert texts(without_prompt(history, key)) == ["prompt 1", "reply 1"]


@pytest.mark.parametrize("change", ["shorter", "rewritten"])
def test_a_record_the_transcript_contradicts_is_lost(change: str) -> None:
    history = [*turn_on(T, 0), *turn_on(X, 1)]
    record = covered_through(history)
    if change == "shorter":
        now = history[:2]
    else:
        now = [msg("user", "summary of earlier turns"), *history[1:]]
        now[-1] = msg("assistant", "other", "k")
    coverage = coverage_of(now, bound(X, record), prompt_key=None)
    assert coverage.lost
    assert coverage.uncovered == ()


def test_a_long_run_of_the_threads_own_turns_moves_the_record_forward() -> None:
    short = [m for n in range(ADVANCE_AFTER // 2) for m in turn_on(X, n)]
    assert not coverage_of(short, bound(X, covered_through([])), prompt_key=None).advance
    long = [*short, *turn_on(X, 10_000)]
    assert coverage_of(long, bound(X, covered_through([])), prompt_key=None).advance


def test_the_digest_ignores_key_order_and_spacing() -> None:
    a = {"role": "user", "content": "hi"}
    b = json.loads('{"content": "hi",   "role": "user"}')
    assert message_digest(a) == message_digest(b)
    assert message_digest(a) != message_digest({"role": "user", "content": "hi!"})


def test_the_binding_keeps_the_record_and_reads_a_foreign_shape_as_unset(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    record = HistoryCoverage(messages=3, last_digest="abc")
    write_binding(session, ThreadBinding(thread_id=X, history_covered_through=record))
    read = read_binding(session)
    assert read is not None
    assert read.history_covered_through == record
    sidecar = Path(str(session) + ".codex-app-server.json")
    raw = json.loads(sidecar.read_text())
    assert raw["historyCoveredThrough"] == {"messages": 3, "lastDigest": "abc"}
    for foreign in ("2026-01-01T00:00:00Z", {"messages": -1}, {"messages": 2}, {"messages": True}):
        raw["historyCoveredThrough"] = foreign
        sidecar.write_text(json.dumps(raw))
        again = read_binding(session)
        assert again is not None
        assert again.history_covered_through is None, foreign


def test_this_turns_prompt_is_recognised_by_its_key_not_its_words() -> None:
    key = "codex-turn:turn-7:prompt"
    decorated = msg("user", "[Thu 10:00] yes", key)
    assert drop_duplicate_prompt([decorated], "yes", prompt_key=key) == []
    earlier_yes = msg("user", "yes", "codex-app-server:x:run-1:prompt")
    assert drop_duplicate_prompt([earlier_yes], "yes", prompt_key=key) == [earlier_yes]
    assert drop_duplicate_prompt([earlier_yes], "yes") == [earlier_yes]
    # Without a key, OpenClaw's rule: the words.
    unkeyed = msg("user", " yes ")
    assert drop_duplicate_prompt([unkeyed], "yes") == []
