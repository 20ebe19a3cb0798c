"""The event projector on notification sequences recorded from the real 0.163.0 binary.

No binary needed: tests/fixtures/notifications/*.jsonl were recorded with the offline model
(first line: meta with threadId, turnId and the prompt; then one notification per line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from codex_turn.harness.appserver import CodexTurnStatus, Notification, TurnProjector, Usage

FIXTURES = Path(__file__).parent / "fixtures" / "notifications"


def load(name: str) -> tuple[dict[str, Any], list[Notification]]:
    lines = (FIXTURES / f"{name}.jsonl").read_text().splitlines()
    meta = json.loads(lines[0])["meta"]
    return meta, [Notification(d["method"], d["params"]) for d in map(json.loads, lines[1:])]


def project(name: str, **kwargs: Any) -> Any:
    meta, notes = load(name)
    projector = TurnProjector(
        thread_id=meta["threadId"],
        prompt=meta["prompt"],
        provider="offline",
        model="mock-model",
        clock_ms=lambda: 1234,
        **kwargs,
    )
    for n in notes:
        projector.feed(n)
    assert projector.done
    return projector.build_result()


def test_simple_turn_snapshot_in_mirror_order() -> None:
    result = project("simple")
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert result.prompt_error is None
    user, assistant = result.messages_snapshot
    assert user == {"role": "user", "content": "hello", "timestamp": 1234}
    assert assistant["content"] == [{"type": "text", "text": "ECHO: hello"}]
    assert assistant["api"] == "openai-codex-responses"
    assert (assistant["provider"], assistant["model"]) == ("offline", "mock-model")
    assert assistant["stopReason"] == "stop"
    assert "errorMessage" not in assistant
    assert list(assistant)[-1] == "timestamp"
    assert assistant["usage"] == {
        "input": 100,
        "output": 10,
        "cacheRead": 0,
        "cacheWrite": 0,
        "totalTokens": 110,
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
    }
    turn = result.turn_id
    assert result.mirror_identities == [f"{turn}:prompt", f"{turn}:assistant"]
    assert result.mirror_keys[0] == f"codex-app-server:{result.thread_id}:{turn}:prompt"
    assert result.turn_scoped_keys == [
        f"codex-app-server:{result.thread_id}:{turn}:user:0",
        f"codex-app-server:{result.thread_id}:{turn}:assistant:1",
    ]
    assert result.dangling_item_ids == []


def test_reasoning_mirror_and_cached_usage_not_double_counted() -> None:
    result = project("reasoning_cached_usage")
    roles_texts = [
        (m["role"], m["content"] if m["role"] == "user" else m["content"][0]["text"])
        for m in result.messages_snapshot
    ]
    assert roles_texts == [
        ("user", "what is the answer?"),
        ("assistant", "Codex reasoning:\nThinking about the answer."),
        ("assistant", "The answer is 42."),
    ]
    mirror = result.messages_snapshot[1]
    assert mirror["usage"]["totalTokens"] == 0
    assert mirror["stopReason"] == "stop"
    # Codex reported inputTokens=1200 of which cachedInputTokens=1000.
    assert result.usage == Usage(input=200, output=30, cache_read=1000)
    assert result.usage.prompt_tokens == 1200
    final_usage = result.messages_snapshot[-1]["usage"]
    assert final_usage["input"] + final_usage["cacheRead"] == 1200
    assert final_usage["totalTokens"] == 1230
    assert result.mirror_identities[1].endswith(":reasoning")


def test_dynamic_tool_turn_uses_last_agent_message() -> None:
    result = project("dynamic_tool")
    assert result.final_text == "TOOL RESULT: Sunny in Paris"
    assert "call_A1" in result.item_ids
    assert len(result.messages_snapshot) == 2


def test_failed_turn_carries_prompt_error() -> None:
    result = project("failed_http_400")
    assert result.outcome is CodexTurnStatus.FAILED
    assert result.prompt_error is not None
    assert "context too spicy" in result.prompt_error
    # No assistant text arrived, so only the prompt is mirrored (PR-era rule).
    assert [m["role"] for m in result.messages_snapshot] == ["user"]


def test_context_window_overflow_is_typed_and_reported_as_a_full_window() -> None:
    # Recorded from the real binary: the model's stream ended with ``response.failed``, code
    # ``context_length_exceeded`` (OfflineModel's Reply.context_length_exceeded()).
    result = project("failed_context_window")
    assert result.outcome is CodexTurnStatus.FAILED
    assert result.error_info == "contextWindowExceeded"
    assert result.context_window_exceeded
    assert result.prompt_error is not None
    assert "context window" in result.prompt_error
    # Codex reports the window as full: last.totalTokens == the window, every count zero.
    assert result.usage == Usage()
    assert result.context_window == 258400
    # Any other failure is not an overflow (a 400 is "other", whatever its body says).
    assert not project("failed_http_400").context_window_exceeded
    assert not project("simple").context_window_exceeded


def test_interrupted_turn_closes_dangling_partial_message() -> None:
    result = project("interrupted_partial")
    assert result.outcome is CodexTurnStatus.INTERRUPTED
    assert result.aborted
    assert result.prompt_error is None
    assert result.dangling_item_ids
    assert result.partial_text == "PARTIAL "
    assert result.final_text is None
    assert [m["role"] for m in result.messages_snapshot] == ["user"]


def test_manual_compaction_turn_reports_context_compaction_item() -> None:
    _meta, notes = load("manual_compaction")
    phases = [n.compaction_phase for n in notes if n.compaction_phase]
    assert phases == ["started", "completed"]
    result = project("manual_compaction")
    assert len(result.compaction_item_ids) == 1
    assert result.outcome is CodexTurnStatus.COMPLETED


def _retarget(n: Notification, **changes: str) -> Notification:
    params = json.loads(json.dumps(dict(n.params)))
    for key, value in changes.items():
        params[key] = value
    return Notification(n.method, params)


def test_unknown_notifications_and_other_turns_are_ignored_plan_mirrored() -> None:
    meta, notes = load("simple")
    thread, turn = meta["threadId"], meta["turnId"]
    extra = [
        Notification("totally/new", {"threadId": thread, "turnId": turn, "x": 1}),
        Notification(
            "item/completed",
            {"threadId": thread, "turnId": turn, "item": {"type": "hologram", "id": "h1"}},
        ),
        Notification(
            "item/plan/delta",
            {"threadId": thread, "turnId": turn, "itemId": "p1", "delta": "1. look"},
        ),
        Notification(
            "item/plan/delta",
            {"threadId": thread, "turnId": turn, "itemId": "p1", "delta": "\n2. answer"},
        ),
        Notification(
            "item/completed",
            {
                "threadId": thread,
                "turnId": "another-turn",
                "item": {"type": "agentMessage", "id": "x", "text": "WRONG TURN"},
            },
        ),
        Notification(
            "item/completed",
            {
                "threadId": "another-thread",
                "turnId": turn,
                "item": {"type": "agentMessage", "id": "y", "text": "WRONG THREAD"},
            },
        ),
        Notification(
            "thread/tokenUsage/updated",
            {
                "threadId": thread,
                "turnId": "another-turn",
                "tokenUsage": {"last": {"inputTokens": 9999}},
            },
        ),
    ]
    # Insert the extras just before turn/completed.
    ordered = notes[:-1] + extra + notes[-1:]
    projector = TurnProjector(thread_id=thread, prompt="hello", turn_id=turn, clock_ms=lambda: 1)
    belonged = [projector.feed(n) for n in ordered]
    assert belonged.count(False) >= 3
    result = projector.build_result()
    texts = [
        m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
        for m in result.messages_snapshot
    ]
    assert texts == ["hello", "Codex plan:\n1. look\n2. answer", "ECHO: hello"]
    assert result.usage is not None
    assert result.usage.input == 100
    # A notification after turn/completed changes nothing.
    assert projector.feed(notes[-1]) is False


def test_timed_out_override_and_error_notification_fallback() -> None:
    meta, notes = load("interrupted_partial")
    projector = TurnProjector(thread_id=meta["threadId"], prompt="p", turn_id=meta["turnId"])
    for n in notes[:5]:
        projector.feed(n)
    assert not projector.done
    result = projector.build_result(outcome=CodexTurnStatus.TIMED_OUT, error="idle for 1s")
    assert result.outcome is CodexTurnStatus.TIMED_OUT
    assert result.prompt_error == "idle for 1s"
    # willRetry errors are ignored; the final error is used when turn.error is missing.
    p2 = TurnProjector(thread_id="t", prompt="p", turn_id="u")
    p2.feed(
        Notification(
            "error",
            {
                "threadId": "t",
                "turnId": "u",
                "willRetry": True,
                "error": {"message": "Reconnecting... 1/2"},
            },
        )
    )
    p2.feed(
        Notification(
            "error",
            {
                "threadId": "t",
                "turnId": "u",
                "willRetry": False,
                "error": {"message": "stream closed"},
            },
        )
    )
    p2.feed(
        Notification("turn/completed", {"threadId": "t", "turn": {"id": "u", "status": "failed"}})
    )
    assert p2.build_result().prompt_error == "stream closed"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"inputTokens": 100, "cachedInputTokens": 0, "outputTokens": 10}, (100, 0, 0, 110)),
        ({"inputTokens": 1000, "cachedInputTokens": 900, "outputTokens": 5}, (100, 900, 0, 1005)),
        (
            {
                "inputTokens": 1000,
                "cachedInputTokens": 600,
                "cacheWriteInputTokens": 300,
                "outputTokens": 5,
            },
            (100, 600, 300, 1005),
        ),
        ({"input_tokens": 50, "cached_input_tokens": 80, "output_tokens": 1}, (0, 80, 0, 81)),
    ],
)
def test_usage_normalisation(raw: dict[str, int], expected: tuple[int, int, int, int]) -> None:
    usage = Usage.from_codex(raw)
    assert (usage.input, usage.cache_read, usage.cache_write, usage.total_tokens) == expected
