"""SqliteContextEngine end to end: 30 turns through the REAL ``codex app-server`` and the
offline model, with the engine's own compaction crossing the threshold mid-way; and the
Codex-backed summariser writing the summaries (and tripping the breaker on an auth error), and
the model the host lends (``runtime_context["llm"]``) writing them with ``summarizer="auto"``.

What is asserted is what the binary sent to the model: the first request after the engine
compacted starts a fresh thread whose input carries the summary and the fresh tail (the
newest turns, verbatim), and the size of what the model is sent stays bounded as the session
grows (it would grow with every turn without compaction). The store holds the transcript's
messages exactly once, and passes ``doctor``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import attrs
import pytest

from codex_turn import AppServer, TurnOutcome, TurnParams, run_codex_turn
from codex_turn.engines import (
    CodexSummarizer,
    EngineSettings,
    SqliteContextEngine,
    Summarizer,
    _store,
)
from codex_turn.engines.summarizers import REQUEST_MARKER, SUMMARY_INSTRUCTIONS
from codex_turn.fsm.thread import ThreadAction
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    CompactParams,
    ToolCallParams,
)
from codex_turn.harness.host_llm import CodexHostLlm
from codex_turn.harness.runtime_context import strip_runtime_context_messages
from codex_turn.harness.session import load_session_messages
from codex_turn.testing import OfflineModel, RecordedRequest, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

TURNS = 30
BUDGET = 4_000  # tokens: the threshold (0.75) is crossed after about eight turns
SETTINGS = EngineSettings(
    fresh_tail_count=6,
    fresh_tail_max_fraction=0.35,
    leaf_chunk_tokens=800,
    min_leaf_chunk_tokens=100,
    leaf_target_tokens=120,
    condensed_target_tokens=120,
    leaf_fanout=4,
    condensed_fanout=2,
)


def prompt(index: int) -> str:
    words = " ".join(f"topic{(index * 13 + k) % 97}" for k in range(90))
    return f"PROMPT-{index:02d}: please consider {words}."


def reply(index: int) -> str:
    words = " ".join(f"note{(index * 7 + k) % 89}" for k in range(90))
    return f"REPLY-{index:02d}: noted {words}."


def conversation_chars(request: RecordedRequest) -> int:
    """What the model was sent as conversation (user and assistant text), in characters."""
    return sum(len(text) for text in request.user_messages + request.assistant_messages)


def summaries(engine: SqliteContextEngine) -> int:
    with sqlite3.connect(engine.path) as conn:
        return int(conn.execute("SELECT count(*) FROM summaries").fetchone()[0])


async def test_thirty_turns_with_a_compaction_midway(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    engine = SqliteContextEngine(tmp_path / "store" / "context.sqlite", settings=SETTINGS)
    session_file = tmp_path / "sessions" / "e2e.jsonl"
    sizes: list[int] = []
    requests: list[RecordedRequest] = []
    decisions: list[ThreadAction | None] = []
    first_compacted_turn: int | None = None
    for index in range(TURNS):
        offline_model.script(Reply.fixed(reply(index)), user_contains=f"PROMPT-{index:02d}")
        result = await run_codex_turn(
            TurnParams(
                session_id="e2e",
                session_key="agent:main:e2e",
                session_file=session_file,
                workspace_dir=workspace,
                prompt=prompt(index),
                context_token_budget=BUDGET,
            ),
            app_server=appserver,
            engine=engine,
        )
        assert result.outcome is TurnOutcome.COMPLETED, result
        assert result.assistant_text == reply(index)
        request = offline_model.turn_requests()[-1]
        requests.append(request)
        sizes.append(conversation_chars(request))
        decisions.append(result.thread_decision.action if result.thread_decision else None)
        if first_compacted_turn is None and summaries(engine):
            first_compacted_turn = index  # maintenance after this turn compacted

    # A compaction mid-way (by the engine's own maintenance after a turn).
    assert first_compacted_turn is not None
    assert 5 <= first_compacted_turn <= 20, first_compacted_turn

    # The next request is a fresh thread carrying the summary and the fresh tail.
    after = first_compacted_turn + 1
    assert decisions[after] is ThreadAction.ROTATE
    sent = "\n".join(requests[after].user_messages)
    assert "<summary id=" in sent
    assert f"PROMPT-{after - 1:02d}" in sent
    assert f"REPLY-{after - 1:02d}" in sent
    assert "PROMPT-00" not in sent.split("<summary", 1)[0]  # the oldest turns: summarised

    # Bounded: the model is sent about the threshold, whatever the session's length.
    uncompacted = sum(len(prompt(i)) + len(reply(i)) for i in range(TURNS))
    later = sizes[after:]
    assert max(later) < BUDGET * 4, later  # ~4 characters per token
    assert max(later) < uncompacted / 3
    assert max(sizes[-8:]) <= max(sizes[after : after + 12]) * 1.2, sizes

    # Lossless and idempotent: every transcript message stored once, the DAG intact.
    transcript = strip_runtime_context_messages(load_session_messages(session_file))
    with sqlite3.connect(engine.path) as conn:
        rows = conn.execute("SELECT content FROM messages ORDER BY id").fetchall()
    kept = [json.loads(_store.decode_content(row[0])) for row in rows]
    assert kept == [dict(m) for m in transcript]
    assert len(kept) >= 2 * TURNS
    report = await engine.doctor(repair=False)
    assert report.problems == ()
    assert report.summaries >= 2
    assert offline_model.proxy_attempts == []
    engine.close()


async def test_codex_summariser_writes_the_summaries_and_trips_the_breaker_on_auth(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    summarizer = CodexSummarizer(appserver, cwd=workspace)
    assert isinstance(summarizer, Summarizer)
    engine = SqliteContextEngine(
        tmp_path / "store.sqlite", summarizer=summarizer, settings=SETTINGS
    )
    messages: list[dict[str, object]] = []
    for index in range(12):
        messages += [
            {"role": "user", "content": prompt(index), "timestamp": 1_000 * index},
            {"role": "assistant", "content": [{"type": "text", "text": reply(index)}]},
        ]
    await engine.after_turn(
        AfterTurnParams(
            session_id="sum", session_file="", messages=messages, pre_prompt_message_count=0
        )
    )
    offline_model.script(
        Reply.fixed("CODEX-SUMMARY: the user listed topics; notes were taken."),
        user_contains=REQUEST_MARKER,
        times=50,
    )
    result = await engine.compact(
        CompactParams(session_id="sum", session_file="", token_budget=BUDGET, force=True)
    )
    assert result.compacted
    asked = [r for r in offline_model.turn_requests() if REQUEST_MARKER in r.last_user_text]
    assert asked
    assert "<excerpt>" in asked[0].last_user_text
    assert "PROMPT-00" in asked[0].last_user_text
    assembled = await engine.assemble(
        AssembleParams(session_id="sum", messages=[], token_budget=BUDGET)
    )
    assert "CODEX-SUMMARY: the user listed topics" in json.dumps(assembled.messages)

    # Refused credentials: the pass writes nothing, the breaker opens, and the engine falls
    # back to the deterministic summariser instead of asking again.
    offline_model.clear_script()
    offline_model.script(
        Reply.http_error(401, '{"error":{"message":"bad key"}}'), user_contains=REQUEST_MARKER
    )
    for index in range(12, 24):
        messages += [
            {"role": "user", "content": prompt(index), "timestamp": 1_000 * index},
            {"role": "assistant", "content": [{"type": "text", "text": reply(index)}]},
        ]
    await engine.after_turn(
        AfterTurnParams(
            session_id="sum", session_file="", messages=messages, pre_prompt_message_count=24
        )
    )
    before = len(offline_model.turn_requests())
    again = await engine.compact(
        CompactParams(session_id="sum", session_file="", token_budget=BUDGET, force=True)
    )
    assert again.compacted
    assert len(offline_model.turn_requests()) == before + 1  # asked once, then the breaker
    with sqlite3.connect(engine.path) as conn:
        used = [row[0] for row in conn.execute("SELECT summarizer FROM summaries ORDER BY rowid")]
    assert used[0] == "codex/1"
    assert "extractive/1" in used
    assert (await engine.doctor(repair=False)).problems == ()
    assert offline_model.proxy_attempts == []
    engine.close()


async def test_the_model_the_host_lends_writes_the_summaries_of_a_compaction(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    settings = attrs.evolve(SETTINGS, summarizer="auto")
    engine = SqliteContextEngine(tmp_path / "store.sqlite", settings=settings)
    messages: list[dict[str, object]] = []
    for index in range(12):
        messages += [
            {"role": "user", "content": prompt(index), "timestamp": 1_000 * index},
            {"role": "assistant", "content": [{"type": "text", "text": reply(index)}]},
        ]
    await engine.after_turn(
        AfterTurnParams(
            session_id="lent", session_file="", messages=messages, pre_prompt_message_count=0
        )
    )
    offline_model.script(
        Reply.fixed("HOST-SUMMARY: the user listed topics."),
        user_contains=REQUEST_MARKER,
        times=50,
    )
    llm = CodexHostLlm(appserver, cwd=workspace)
    result = await engine.compact(
        CompactParams(
            session_id="lent",
            session_file="",
            token_budget=BUDGET,
            force=True,
            runtime_context={"llm": llm},
        )
    )
    assert result.compacted
    asked = [r for r in offline_model.turn_requests() if REQUEST_MARKER in r.last_user_text]
    assert asked
    assert "PROMPT-00" in asked[0].last_user_text
    assert any(SUMMARY_INSTRUCTIONS in part for part in asked[0].developer_parts)
    with sqlite3.connect(engine.path) as conn:
        written = conn.execute("SELECT summarizer, content FROM summaries").fetchall()
    assert written
    assert set(written) == {("host-llm/1", "HOST-SUMMARY: the user listed topics.")}
    # The first prompt, summarised by the model, is still reached byte for byte.
    found = await engine.call_tool(
        ToolCallParams(session_id="lent", name="recall_grep", arguments={"query": "PROMPT-00"})
    )
    hit = next(h for h in json.loads(found.text)["hits"] if h.get("seq") == 0)
    assert hit["expand"].startswith("sum_")
    page = await engine.call_tool(
        ToolCallParams(session_id="lent", name="recall_expand", arguments={"id": hit["expand"]})
    )
    first = next(m for m in json.loads(page.text)["messages"] if m["seq"] == 0)
    assert json.loads(first["json"]) == messages[0]
    assert offline_model.proxy_attempts == []
    engine.close()


async def test_the_model_recalls_a_compacted_message_through_grep_then_expand(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    """The engine's recall tools reach Codex as dynamic tools: the model searches the store,
    expands the summary that stands for the match, and answers from the original text."""
    engine = SqliteContextEngine(tmp_path / "store" / "context.sqlite", settings=SETTINGS)
    key = "agent:main:recall"
    history: list[dict[str, object]] = []
    for index in range(12):
        said = reply(index)
        if index == 1:  # deep inside a long reply, where no extract of it reaches
            said = said[: len(said) // 2] + " the vault code is plum4471 " + said[len(said) // 2 :]
        history += [
            {"role": "user", "content": prompt(index), "timestamp": 1_000 * index},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": said}],
                "timestamp": 1_000 * index + 1,
            },
        ]
    await engine.after_turn(
        AfterTurnParams(
            session_id="recall",
            session_file="",
            messages=history,
            pre_prompt_message_count=0,
            session_key=key,
        )
    )
    await engine.compact(
        CompactParams(
            session_id="recall", session_key=key, session_file="", token_budget=BUDGET, force=True
        )
    )
    found = await engine.call_tool(
        ToolCallParams(
            session_id="recall",
            session_key=key,
            name="recall_grep",
            arguments={"query": "vault code"},
        )
    )
    summary = json.loads(found.text)["hits"][0]["expand"]
    assert summary.startswith("sum_")

    def answer(request: RecordedRequest) -> str:
        expanded = request.function_call_outputs[-1]["output"]
        code = re.search(r"vault code is (\w+)", str(expanded))
        return f"The vault code was {code.group(1) if code else 'not found'}."

    offline_model.script(
        Reply.function_call("recall_grep", {"query": "vault code"}),
        Reply.function_call("recall_expand", {"id": summary}),
        Reply.computed(answer),
    )
    result = await run_codex_turn(
        TurnParams(
            session_id="recall",
            session_key=key,
            session_file=tmp_path / "sessions" / "recall.jsonl",
            workspace_dir=workspace,
            prompt="RECALL: what was the vault code?",
            context_token_budget=BUDGET,
        ),
        app_server=appserver,
        engine=engine,
    )
    assert result.outcome is TurnOutcome.COMPLETED, result
    assert result.assistant_text == "The vault code was plum4471."
    first, after_grep, after_expand = offline_model.turn_requests()[-3:]
    assert {"recall_grep", "recall_expand", "recall_describe", "recall_expand_query"} <= set(
        first.tool_names
    )
    assert "plum4471" not in json.dumps(first.input_items)  # compacted away from the context
    grep_output = str(after_grep.function_call_outputs[-1]["output"])
    assert summary in grep_output
    assert "vault code" in grep_output
    assert "plum4471" in str(after_expand.function_call_outputs[-1]["output"])
    engine.close()
