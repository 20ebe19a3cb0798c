"""Summaries written by the model the host lends the reference engine (``runtime_context["llm"]``),
in process with a recording stand-in: with ``summarizer="auto"`` the model writes the summaries
of a compaction that carries model access (its answer checked, escalated when unacceptable),
the extractive summariser when none is lent or the setting says so, never in the foreground;
the circuit breaker opens on a refused login or after consecutive failures or timeouts, holds
the model off until the cooldown ends, and says so in the log; and every message a model summary
stands for is still reached through grep then expand, byte for byte."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from structlog.testing import capture_logs

from codex_turn.engines import EngineSettings, SqliteContextEngine, _compaction
from codex_turn.engines._messages import encode
from codex_turn.engines.summarizers import REQUEST_MARKER, SUMMARY_INSTRUCTIONS
from codex_turn.harness.engine import (
    AfterTurnParams,
    CompactParams,
    LlmCompleteFailed,
    LlmCompletion,
    LlmRequest,
    MaintainParams,
    ToolCallParams,
)

pytestmark = pytest.mark.anyio

AUTO = EngineSettings(
    summarizer="auto",
    fresh_tail_count=2,
    fresh_tail_max_fraction=0.1,
    leaf_chunk_tokens=400,
    min_leaf_chunk_tokens=10,
    leaf_fanout=2,
    condensed_fanout=2,
)
HANG = object()  # an answer that never comes (the engine's summary timeout ends it)


class RecordingLlm:
    """A ``HostLlm`` stand-in: records each request, answers by script (a text, an exception
    to raise, or :data:`HANG`), then ``"model summary N"``."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.requests: list[LlmRequest] = []

    async def complete(self, request: LlmRequest) -> LlmCompletion:
        self.requests.append(request)
        answer = self.answers.pop(0) if self.answers else f"model summary {len(self.requests)}"
        if answer is HANG:
            await anyio.sleep_forever()
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, str)
        return LlmCompletion(text=answer)


class Clock:
    """Stands in for the compactor's ``time`` module: the breaker's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def monotonic(self) -> float:
        return self.now


def turns(count: int, start: int = 0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(start, start + count):
        out.append({"role": "user", "content": f"ask {i} about zebra{i}", "timestamp": i * 10})
        out.append(
            {
                "role": "assistant",
                "content": [{"type": "text", "text": f"reply {i}: stripes{i} " + "la " * 40}],
                "timestamp": i * 10 + 1,
            }
        )
    return out


async def store(
    engine: SqliteContextEngine, key: str, messages: list[dict[str, Any]], budget: int = 10**6
) -> None:
    await engine.after_turn(
        AfterTurnParams(
            session_id=key,
            session_file="",
            messages=messages,
            pre_prompt_message_count=0,
            token_budget=budget,
        )
    )


async def compact(engine: SqliteContextEngine, key: str, llm: object | None) -> None:
    runtime = {"llm": llm} if llm is not None else None
    result = await engine.compact(
        CompactParams(
            session_id=key,
            session_file="",
            token_budget=300,
            force=True,
            runtime_context=runtime,
        )
    )
    assert result.ok
    assert result.compacted


def summaries(engine: SqliteContextEngine) -> list[tuple[str, str]]:
    with sqlite3.connect(engine.path) as conn:
        return list(conn.execute("SELECT summarizer, content FROM summaries ORDER BY rowid"))


async def call(engine: SqliteContextEngine, name: str, key: str, **args: Any) -> Any:
    answer = await engine.call_tool(ToolCallParams(session_id=key, name=name, arguments=args))
    assert answer.success, answer.text
    return json.loads(answer.text)


async def expanded(engine: SqliteContextEngine, ref: str, key: str) -> dict[int, str]:
    out: dict[int, str] = {}
    cursor: str | None = None
    while True:
        args: dict[str, Any] = {"id": ref} if cursor is None else {"id": ref, "cursor": cursor}
        page = await call(engine, "recall_expand", key, **args)
        for entry in page["messages"]:
            out[entry["seq"]] = out.get(entry["seq"], "") + entry["json"]
        cursor = page["cursor"]
        if cursor is None:
            return out


def transitions(logs: Sequence[dict[str, Any]]) -> list[str]:
    """The breaker's logged transitions, ``open`` (with its reason) or ``closed``."""
    out = []
    for event in logs:
        name = str(event["event"])
        if name.startswith("summariser circuit breaker"):
            out.append(name.split()[-1] + (f" ({event['reason']})" if "reason" in event else ""))
    return out


async def test_the_host_model_writes_the_summaries_and_every_message_stays_reachable(
    tmp_path: Path,
) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=AUTO)
    messages = turns(16)
    await store(engine, "s", messages)
    llm = RecordingLlm()
    await compact(engine, "s", llm)
    assert llm.requests
    for request in llm.requests:
        assert request.purpose == "summary"
        assert request.system_prompt == SUMMARY_INSTRUCTIONS
        assert request.messages[-1].role == "user"
        assert request.messages[-1].content.startswith(REQUEST_MARKER)
    written = summaries(engine)
    # Every answer is stored as a summary, and every summary is the model's answer.
    assert sorted(content for _, content in written) == sorted(
        f"model summary {n}" for n in range(1, len(llm.requests) + 1)
    )
    assert {used for used, _ in written} == {"host-llm/1"}
    # Nothing a model summary stands for is out of the recall tools' reach.
    for seq, message in enumerate(messages):
        word = f"zebra{seq // 2}" if seq % 2 == 0 else f"stripes{seq // 2}"
        hits = (await call(engine, "recall_grep", "s", query=word, limit=50))["hits"]
        target = next(hit["expand"] for hit in hits if hit.get("seq") == seq)
        assert (await expanded(engine, target, "s"))[seq] == encode(message)[1].decode()


@pytest.mark.parametrize("lent", [False, True], ids=["no-model-lent", "setting-extractive"])
async def test_extractive_when_no_model_is_lent_or_the_setting_says_so(
    tmp_path: Path, lent: bool
) -> None:
    settings = attrs.evolve(AUTO, summarizer="extractive") if lent else AUTO
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=settings)
    await store(engine, "s", turns(16))
    llm = RecordingLlm()
    await compact(engine, "s", llm if lent else None)
    assert not llm.requests
    assert {used for used, _ in summaries(engine)} == {"extractive/1"}


async def test_debt_waits_for_the_background_to_use_the_lent_model(tmp_path: Path) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=AUTO)
    await store(engine, "s", turns(16), budget=600)  # over 0.75 x 600: debt recorded
    llm = RecordingLlm()
    foreground = await engine.maintain(
        MaintainParams(session_id="s", session_file="", runtime_context={"llm": llm})
    )
    assert foreground.reason == "compaction deferred to background maintenance"
    assert not llm.requests
    assert not summaries(engine)
    background = await engine.maintain(
        MaintainParams(
            session_id="s",
            session_file="",
            runtime_context={"llm": llm, "allowDeferredCompactionExecution": True},
        )
    )
    assert background.reason is not None
    assert background.reason.startswith("compacted")
    assert llm.requests
    assert {used for used, _ in summaries(engine)} == {"host-llm/1"}


async def test_an_unacceptable_answer_escalates(tmp_path: Path) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=AUTO)
    await store(engine, "s", turns(16))
    # Pass 1: empty, then blank: truncation. Pass 2: empty, then a fine terse one.
    llm = RecordingLlm("", "   ", "", "terse model summary")
    await compact(engine, "s", llm)
    terse = ["be terse" in r.messages[-1].content for r in llm.requests[:4]]
    assert terse == [False, True, False, True]
    written = summaries(engine)
    assert written[0][0] == "truncate/1"
    assert written[1] == ("host-llm/1", "terse model summary")


@pytest.mark.parametrize("failure", ["error", "timeout"])
async def test_consecutive_failures_open_the_breaker_until_the_cooldown_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    clock = Clock()
    monkeypatch.setattr(_compaction, "time", clock)
    settings = attrs.evolve(
        AUTO, breaker_failures=3, breaker_cooldown_s=60.0, summary_timeout_s=0.05
    )
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=settings)
    bad = LlmCompleteFailed("failed") if failure == "error" else HANG
    await store(engine, "s", turns(16))
    llm = RecordingLlm(*[bad] * 5)
    with capture_logs() as logs:
        await compact(engine, "s", llm)
    # Pass 1 fails twice (truncation); pass 2's first failure is the third: the breaker opens
    # and the extractive summariser writes that pass and the rest.
    assert len(llm.requests) == 3
    assert engine._compactor.breaker_open
    used = [u for u, _ in summaries(engine)]
    assert "host-llm/1" not in used
    assert used[0] == "truncate/1"
    assert "extractive/1" in used
    assert transitions(logs) == ["open (consecutive failures)"]
    assert "zebra" not in repr(logs)
    assert "stripes" not in repr(logs)

    await store(engine, "t", turns(16))
    await compact(engine, "t", llm)  # still open: the model is not asked
    assert len(llm.requests) == 3

    clock.now += 60.0
    llm.answers.clear()
    await store(engine, "u", turns(16))
    with capture_logs() as logs:
        await compact(engine, "u", llm)  # closed: the model again
    assert not engine._compactor.breaker_open
    assert len(llm.requests) > 3
    assert transitions(logs) == ["closed"]
    assert summaries(engine)[-1][0] == "host-llm/1"


async def test_an_answer_resets_the_failure_count_and_a_refused_login_opens_at_once(
    tmp_path: Path,
) -> None:
    settings = attrs.evolve(AUTO, breaker_failures=3)
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=settings)
    await store(engine, "s", turns(16))
    failed = LlmCompleteFailed("failed")
    llm = RecordingLlm(failed, failed, "fine", failed, failed, "fine")
    await compact(engine, "s", llm)
    # Four failures in five requests, never three in a row: the breaker stays closed.
    assert len(llm.requests) == 5
    assert not engine._compactor.breaker_open
    assert [u for u, _ in summaries(engine)] == ["truncate/1", "host-llm/1", "truncate/1"]

    await store(engine, "t", turns(16))
    refused = RecordingLlm(LlmCompleteFailed("failed (unauthorized)"))
    with capture_logs() as logs:
        await compact(engine, "t", refused)
    assert len(refused.requests) == 1
    assert engine._compactor.breaker_open
    assert transitions(logs) == ["open (auth)"]
