"""SqliteContextEngine, behaviour by behaviour (no Codex binary; see the _e2e module for that).

Idempotency (retried after_turn, fallback snapshot vs mirrored copy, bootstrap after a
restart, incremental and rewritten transcripts, repeats), assembly (budget, fresh tail,
contiguity, tool pairs, determinism, prefix, epoch, summary template), compaction (honest
results, forced target below the threshold, lossless DAG, debt and maintenance, the
foreground never calling a model, escalation, the circuit breaker, optimistic conflicts),
health, doctor, retention, concurrency of sessions in one process.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import pytest
from support.engine_sqlite_workload import SMALL, Message, history, marker, texts, turn

from codex_turn.engines import (
    DoctorReport,
    EngineSettings,
    InvalidEngineSettings,
    SqliteContextEngine,
    StoreError,
    Summarizer,
    SummarizerAuthError,
    SummaryRequest,
    _plan,
    _store,
    estimate_tokens,
)
from codex_turn.engines._messages import message_tokens
from codex_turn.engines._plan import summary_text
from codex_turn.errors import CodexTurnError
from codex_turn.frozen import freeze
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    CompactParams,
    IngestBatchParams,
    IngestParams,
    MaintainParams,
)
from codex_turn.harness.session import clear_session_cache, load_session_messages, mirror_turn

pytestmark = pytest.mark.anyio

HUGE = 10_000_000


def engine_at(tmp_path: Path, **kwargs: Any) -> SqliteContextEngine:
    kwargs.setdefault("settings", SMALL)
    return SqliteContextEngine(tmp_path / "store" / "context.sqlite", **kwargs)


async def deliver(
    engine: SqliteContextEngine, session: str, messages: list[Message], pre: int, budget: int = HUGE
) -> None:
    await engine.after_turn(
        AfterTurnParams(
            session_id=session,
            session_file="",
            messages=messages,
            pre_prompt_message_count=pre,
            token_budget=budget,
        )
    )


async def play(
    engine: SqliteContextEngine, session: str, turns: int, budget: int = HUGE
) -> list[Message]:
    """``turns`` turns delivered one after_turn each; returns the history."""
    messages: list[Message] = []
    for index in range(turns):
        pre = len(messages)
        messages = [*messages, *turn(session, index, tools=int(index % 3 == 1))]
        await deliver(engine, session, messages, pre, budget)
    return messages


async def assemble(
    engine: SqliteContextEngine, session: str, budget: int = HUGE, live: list[Message] | None = None
) -> AssembleResult:
    return await engine.assemble(
        AssembleParams(session_id=session, messages=live or [], token_budget=budget)
    )


def stored(engine: SqliteContextEngine, session: str) -> list[Message]:
    """The conversation's messages in order, straight from the file."""
    with sqlite3.connect(engine.path) as conn:
        rows = conn.execute(
            "SELECT m.content FROM messages m JOIN conversations c ON c.id = m.conversation_id "
            "WHERE c.session_key=? AND c.archived_at IS NULL ORDER BY m.seq",
            (session,),
        ).fetchall()
    return [json.loads(_store.decode_content(row[0])) for row in rows]


def dumps(result: AssembleResult) -> str:
    return json.dumps(
        [result.messages, result.estimated_tokens, str(result.context_projection)], sort_keys=True
    )


def without_key(message: Message) -> Message:
    return {k: v for k, v in message.items() if k != "idempotencyKey"}


# --- settings --------------------------------------------------------------------------------

BAD_SETTINGS: list[tuple[str, Any]] = [
    ("default_token_budget", 0),
    ("default_token_budget", 10**400),
    ("threshold", "0.75"),
    ("threshold", float("nan")),
    ("compaction_target", 0),
    ("fresh_tail_count", True),
    ("fresh_tail_max_fraction", 1.5),
    ("leaf_chunk_tokens", 2.5),
    ("min_leaf_chunk_tokens", None),
    ("leaf_target_tokens", 7),
    ("condensed_target_tokens", 2**63),
    ("leaf_fanout", 1),
    ("condensed_fanout", "4"),
    ("max_depth", 0),
    ("fallback_summary_tokens", 15),
    ("max_passes", -1),
    ("sweep_deadline_s", float("inf")),
    ("summary_timeout_s", 10**400),
    ("breaker_cooldown_s", -1),
    ("breaker_failures", 0),
    ("summarizer", "model"),
    ("debt_backoff_s", float("nan")),
    ("busy_timeout_s", float("inf")),
    ("busy_timeout_s", 1e300),
    ("busy_timeout_s", 0),
    ("sync_chunk", 0),
    ("compress_over_bytes", -1),
    ("compress_over_bytes", "512"),
    ("max_db_bytes", 2**70),
    ("decode_cache_messages", -1),
    ("path_cache_sessions", 0),
    ("recall_tools", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_SETTINGS)
def test_a_bad_setting_is_refused_when_the_settings_are_built(field: str, value: Any) -> None:
    # Before: busy_timeout_s=inf was accepted and every later call raised OverflowError;
    # a string threshold raised a raw TypeError, compress_over_bytes was never checked.
    with pytest.raises(InvalidEngineSettings) as raised:
        EngineSettings(**{field: value})
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value, CodexTurnError)
    assert raised.value.problems == (raised.value.problems[0],)
    assert raised.value.problems[0].startswith(f"EngineSettings.{field}: ")


def test_every_setting_is_checked_and_the_target_stays_below_the_threshold() -> None:
    assert {field for field, _ in BAD_SETTINGS} == set(attrs.fields_dict(EngineSettings))
    with pytest.raises(InvalidEngineSettings, match="compaction_target: must be below"):
        EngineSettings(threshold=0.5, compaction_target=0.5)
    with pytest.raises(InvalidEngineSettings, match="busy_timeout_s"):
        attrs.evolve(EngineSettings(), busy_timeout_s=float("inf"))
    unbounded = EngineSettings(
        busy_timeout_s=2_000_000, compress_over_bytes=None, max_db_bytes=None
    )
    assert unbounded.max_db_bytes is None  # the cap can be lifted; by default there is one
    assert EngineSettings().max_db_bytes == 1 << 30


# --- idempotency -------------------------------------------------------------------------


async def test_retried_after_turn_adds_nothing(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    messages = await play(engine, "s", 5)
    before = stored(engine, "s")
    last_turn = len(messages) - len(turn("s", 4, tools=1))
    for _ in range(3):
        await deliver(engine, "s", messages, last_turn)
    assert stored(engine, "s") == before == messages
    with sqlite3.connect(engine.path) as conn:
        assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == 5


async def test_fallback_snapshot_and_mirrored_copy_are_one_message(tmp_path: Path) -> None:
    # The mirror failed: after_turn got the turn without idempotency keys; the next turn
    # reads it from the transcript with them. Same messages, one copy.
    engine = engine_at(tmp_path)
    first = turn("s", 0)
    await deliver(engine, "s", first, 0)
    mirrored = [{**m, "idempotencyKey": f"codex-app-server:t:{i}"} for i, m in enumerate(first)]
    second = mirrored + turn("s", 1)
    await deliver(engine, "s", second, len(first))
    kept = stored(engine, "s")
    assert [without_key(m) for m in kept] == [without_key(m) for m in second]
    assert "idempotencyKey" not in kept[0]  # the first copy is the one kept


async def test_repeated_identical_messages_are_kept_apart(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    ok = {"role": "user", "content": "ok", "timestamp": 1}
    messages = [ok, dict(ok), dict(ok)]
    await deliver(engine, "s", messages, 0)
    await deliver(engine, "s", [*messages, dict(ok)], 3)
    await deliver(engine, "s", [*messages, dict(ok)], 3)  # retried
    assert len(stored(engine, "s")) == 4


async def test_ingest_and_ingest_batch_redelivery_adds_nothing(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    batch = turn("s", 0, tools=1)
    first = await engine.ingest_batch(IngestBatchParams(session_id="s", messages=batch))
    again = await engine.ingest_batch(IngestBatchParams(session_id="s", messages=batch))
    single = await engine.ingest(IngestParams(session_id="s", message=batch[0]))
    assert (first.ingested_count, again.ingested_count, single.ingested) == (len(batch), 0, False)
    # The same messages arriving later through after_turn (as a path) are known too.
    await deliver(engine, "s", batch, 0)
    assert stored(engine, "s") == batch


async def test_ingest_keeps_genuine_repeats_and_drops_redeliveries(tmp_path: Path) -> None:
    # No timestamps: the user says "ok" twice in two turns, and the reply is the same too.
    engine = engine_at(tmp_path)
    ok = {"role": "user", "content": "ok"}
    done = {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}
    path = [ok, done, dict(ok), dict(done)]
    batch = await engine.ingest_batch(IngestBatchParams(session_id="s", messages=path[:2]))
    single = [await engine.ingest(IngestParams(session_id="s", message=m)) for m in path[2:]]
    assert batch.ingested_count == 2
    assert [r.ingested for r in single] == [True, True]
    assert stored(engine, "s") == path
    # Re-deliveries add nothing: a retried ingest, a retried batch, the whole history again.
    retried = await engine.ingest(IngestParams(session_id="s", message=dict(done)))
    again = await engine.ingest_batch(IngestBatchParams(session_id="s", messages=path[2:]))
    whole = await engine.ingest_batch(IngestBatchParams(session_id="s", messages=list(path)))
    assert (retried.ingested, again.ingested_count, whole.ingested_count) == (False, 0, 0)
    # The path (after_turn, bootstrap) names them as ingest did: nothing new either.
    await deliver(engine, "s", list(path), 0)
    transcript = tmp_path / "s.jsonl"
    write_transcript(transcript, path)
    boot = await engine.bootstrap(BootstrapParams(session_id="s", session_file=str(transcript)))
    assert (boot.bootstrapped, boot.imported_messages) == (True, 0)
    assert stored(engine, "s") == path
    # A third "ok" after the reply is new; a batch that repeats the stored end and goes on
    # is new from where it stops lining up with it.
    third = await engine.ingest(IngestParams(session_id="s", message=dict(ok)))
    tail = await engine.ingest_batch(
        IngestBatchParams(session_id="s", messages=[dict(ok), dict(done)])
    )
    assert third.ingested
    assert tail.ingested_count == 1  # "ok" is the stored end, "Done." follows it
    assert stored(engine, "s") == [*path, ok, done]
    assert (await engine.doctor(repair=False)).ok


async def test_ingest_replay_of_an_old_batch_with_timestamps_adds_nothing(
    tmp_path: Path,
) -> None:
    # After a restart a host replays an old batch: its timestamped messages anchor the run,
    # so the timestamp-less message inside it is recognised too.
    engine = engine_at(tmp_path)
    first = [{"role": "user", "content": "ok"}, *turn("s", 0)]
    await engine.ingest_batch(IngestBatchParams(session_id="s", messages=first))
    await engine.ingest_batch(IngestBatchParams(session_id="s", messages=turn("s", 1)))
    replay = await engine.ingest_batch(IngestBatchParams(session_id="s", messages=first))
    assert replay.ingested_count == 0
    assert stored(engine, "s") == [*first, *turn("s", 1)]


def write_transcript(path: Path, messages: list[Message], scope: str = "seed") -> None:
    mirror_turn(
        path,
        messages,
        scope=scope,
        identities=[f"{scope}-{i}" for i in range(len(messages))],
        session_id="s",
        cwd=str(path.parent),
    )


async def test_bootstrap_after_restart_adds_nothing_and_checkpoints(tmp_path: Path) -> None:
    transcript = tmp_path / "s.jsonl"
    write_transcript(transcript, history("s", 6))
    engine = engine_at(tmp_path)
    path_messages = list(load_session_messages(transcript))
    await deliver(engine, "s", path_messages, 0)
    engine.close()

    clear_session_cache()
    restarted = engine_at(tmp_path)
    first = await restarted.bootstrap(BootstrapParams(session_id="s", session_file=str(transcript)))
    second = await restarted.bootstrap(
        BootstrapParams(session_id="s", session_file=str(transcript))
    )
    assert (first.bootstrapped, first.imported_messages) == (True, 0)
    assert (second.imported_messages, second.reason) == (0, "checkpoint")
    assert stored(restarted, "s") == path_messages


async def test_bootstrap_is_incremental_and_reconciles_a_rewrite(tmp_path: Path) -> None:
    transcript = tmp_path / "s.jsonl"
    engine = engine_at(tmp_path)
    write_transcript(transcript, history("s", 3))
    params = BootstrapParams(session_id="s", session_file=str(transcript))
    assert (await engine.bootstrap(params)).imported_messages == 8
    write_transcript(transcript, turn("s", 3), scope="more")
    assert (await engine.bootstrap(params)).imported_messages == 2
    # A rewritten transcript (same first turns, then a different continuation): only what
    # is new is added, nothing twice.
    rewritten = tmp_path / "rewritten.jsonl"
    write_transcript(rewritten, history("s", 3) + turn("s", 7))
    result = await engine.bootstrap(BootstrapParams(session_id="s", session_file=str(rewritten)))
    assert result.imported_messages == 2
    assert len(stored(engine, "s")) == 12
    assert (await engine.doctor()).ok


async def test_bootstrap_without_transcript(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    result = await engine.bootstrap(
        BootstrapParams(session_id="s", session_file=str(tmp_path / "missing.jsonl"))
    )
    assert (result.bootstrapped, result.reason) == (False, "no transcript")


async def test_assemble_catches_up_with_the_live_history(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    live = history("s", 4)
    seen = await assemble(engine, "s", live=live)
    assert seen.messages == live
    assert stored(engine, "s") == live
    # An empty live history (an unreadable transcript) still assembles what is stored.
    assert dumps(await assemble(engine, "s")) == dumps(seen)


# --- assembly ------------------------------------------------------------------------------


async def test_assembly_is_byte_identical_across_calls_and_restarts(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 30, budget=1_500)
    await engine.maintain(MaintainParams(session_id="s", session_file=""))
    one = dumps(await assemble(engine, "s", 700))
    assert one == dumps(await assemble(engine, "s", 700))
    engine.close()
    assert one == dumps(await assemble(engine_at(tmp_path), "s", 700))


async def test_assembly_stays_within_budget_and_keeps_a_contiguous_suffix(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    messages = await play(engine, "s", 12)
    whole = await assemble(engine, "s")
    assert whole.messages == messages
    for budget in range(20, whole.estimated_tokens + 10, 37):
        result = await assemble(engine, "s", budget)
        assert result.estimated_tokens <= budget
        kept = [m for m in messages if m in result.messages]
        assert result.messages == kept  # order kept, nothing invented
        start = messages.index(kept[0]) if kept else len(messages)
        missing = [m for m in messages[start:] if m not in kept]
        # Inside the kept range only tool-pair halves may be missing (dropped together).
        assert all(m["role"] in {"assistant", "toolResult"} for m in missing)


async def test_a_large_old_message_ends_the_fill(tmp_path: Path) -> None:
    engine = engine_at(tmp_path, settings=EngineSettings(fresh_tail_count=2))
    big = {"role": "user", "content": "x " * 4000, "timestamp": 5}
    small = [{"role": "user", "content": f"m{i}", "timestamp": 10 + i} for i in range(6)]
    await deliver(engine, "s", [small[0], big, *small[1:]], 0)
    result = await assemble(engine, "s", 200)
    # The oldest small message would fit, but the fill stops at the first that does not.
    assert texts(result.messages) == [f"m{i}" for i in range(1, 6)]


async def test_fresh_tail_reaches_back_to_the_newest_user_message(tmp_path: Path) -> None:
    # Two messages and a few tokens of fresh tail, but the last turn is eight messages long:
    # compaction must leave all of it raw, back to its user message.
    settings = EngineSettings(
        fresh_tail_count=2, fresh_tail_max_fraction=0.01, min_leaf_chunk_tokens=20
    )
    engine = engine_at(tmp_path, settings=settings)
    messages = history("s", 6) + turn("s", 6, tools=3)
    await deliver(engine, "s", messages, 0)
    result = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=5_000, force=True)
    )
    assert result.compacted
    assembled = (await assemble(engine, "s")).messages
    assert assembled[-8:] == messages[-8:]
    assert texts(assembled[-9:-8])[0].startswith("<summary")


async def test_tool_pairs_go_together_and_nothing_is_fabricated(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    orphan_call = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "calling"},
            {"type": "toolCall", "id": "never-answered", "name": "exec", "arguments": {}},
        ],
        "timestamp": 3,
    }
    orphan_result = {
        "role": "toolResult",
        "toolCallId": "no-such-call",
        "content": [{"type": "text", "text": "stray"}],
        "timestamp": 4,
    }
    messages = [*turn("s", 0, tools=2), orphan_call, orphan_result, *turn("s", 1, tools=1)]
    await deliver(engine, "s", messages, 0)
    full = await assemble(engine, "s")
    assert orphan_result not in full.messages
    stripped = next(m for m in full.messages if texts([m]) == ["calling"])
    assert stripped["content"] == [{"type": "text", "text": "calling"}]
    for budget in range(10, full.estimated_tokens + 1, 7):
        result = await assemble(engine, "s", budget)
        calls = {
            p["id"]
            for m in result.messages
            for p in (m["content"] if isinstance(m["content"], list) else [])
            if p.get("type") == "toolCall"
        }
        answers = {m["toolCallId"] for m in result.messages if m["role"] == "toolResult"}
        assert calls == answers
        for message in result.messages:  # every message is a stored one (or a trimmed copy)
            assert any(texts([message]) == texts([m]) for m in messages)


async def test_prefix_grows_and_epoch_holds_until_a_compaction(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    messages: list[Message] = []
    previous: AssembleResult | None = None
    for index in range(8):
        pre = len(messages)
        messages = messages + turn("s", index, tools=index % 2)
        await deliver(engine, "s", messages, pre)
        result = await assemble(engine, "s")
        if previous is not None:
            assert result.messages[: len(previous.messages)] == previous.messages
            assert result.context_projection == previous.context_projection
        previous = result
    assert previous is not None
    assert previous.context_projection is not None
    assert previous.context_projection.mode == "thread_bootstrap"
    compacted = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=500, force=True)
    )
    assert compacted.compacted
    after = await assemble(engine, "s")
    assert after.context_projection != previous.context_projection


async def test_archived_conversation_gets_a_new_epoch(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    empty = await assemble(engine, "s")
    assert await engine.archive("s")
    assert (await assemble(engine, "s")).context_projection != empty.context_projection


async def test_the_same_turns_give_the_same_epoch_in_any_store(tmp_path: Path) -> None:
    # Same state, same epoch (and same bytes), in two fresh stores; a compaction and a reset
    # still rotate it, and a deleted and recreated store starts over where a fresh one does.
    results: list[list[str]] = []
    for run, name in enumerate(("one", "two", "two")):
        engine = engine_at(tmp_path / name)
        seen: list[str] = []
        await play(engine, "s", 10)
        seen.append(dumps(await assemble(engine, "s")))
        await engine.compact(
            CompactParams(session_id="s", session_file="", token_budget=500, force=True)
        )
        seen.append(dumps(await assemble(engine, "s")))
        await engine.archive("s")
        seen.append(dumps(await assemble(engine, "s")))
        await play(engine, "s", 2)
        seen.append(dumps(await assemble(engine, "s")))
        results.append(seen)
        engine.close()
        if run == 1:  # deleted, then recreated by the third run
            for file in Path(engine.path).parent.glob("context.sqlite*"):
                file.unlink()
    assert results[0] == results[1] == results[2]
    epochs = [json.loads(entry)[2] for entry in results[0]]
    assert len(set(epochs)) == 3  # compaction and reset rotate; appending does not
    assert epochs[2] == epochs[3]


async def test_summaries_render_from_stored_fields_with_the_fixed_template(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 12)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=600, force=True)
    )
    result = await assemble(engine, "s")
    summary = result.messages[0]
    assert summary["role"] == "user"
    text = summary["content"][0]["text"]
    with sqlite3.connect(engine.path) as conn:
        row = conn.execute(
            "SELECT s.id, kind, depth, descendant_count, earliest_ts, latest_ts, content "
            "FROM context_items ci JOIN summaries s ON s.id = ci.summary_id "
            "ORDER BY ci.ordinal LIMIT 1"
        ).fetchone()
    assert text == summary_text(*row)
    assert text.startswith(f'<summary id="{row[0]}" kind="{row[1]}" depth="{row[2]}"')
    assert "2023-11-14T22:13:20Z" in text  # stored timestamps, UTC, second precision
    assert "<" not in text[len("<summary") : -len("</summary>")].split("\n", 1)[1]


# --- compaction ----------------------------------------------------------------------------


async def test_compaction_reports_honestly(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 20)
    before = (await assemble(engine, "s")).estimated_tokens
    below = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=before * 2)
    )
    assert (below.compacted, below.reason) == (False, "below threshold")
    budget = before // 2
    result = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=budget, force=True)
    )
    assert result.result is not None
    after = (await assemble(engine, "s")).estimated_tokens
    assert result.result.tokens_before == before
    assert result.result.tokens_after == after < before
    assert result.compacted
    # Forced compaction aims below the threshold (compaction_target x budget).
    assert after <= SMALL.compaction_target * budget
    again = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=budget, force=True)
    )
    assert again.result is not None
    assert again.compacted == (again.result.tokens_after < again.result.tokens_before)


class IngestingSummarizer:
    """Summarises extractively, and while it does, the host finalizes a large turn."""

    def __init__(self) -> None:
        self.engine: SqliteContextEngine | None = None
        self.history: list[Message] = []
        self.done = False

    @property
    def id(self) -> str:
        return "ingesting/1"

    @property
    def uses_model(self) -> bool:
        return True

    async def summarize(self, request: SummaryRequest) -> str:
        if not self.done and self.engine is not None:
            self.done = True
            pre = len(self.history)
            self.history = [*self.history, *turn("s", 99, words=3000)]
            await deliver(self.engine, "s", self.history, pre)
        return "a short summary"


async def test_compacted_is_true_when_turns_arrive_during_the_sweep(tmp_path: Path) -> None:
    summarizer = IngestingSummarizer()
    engine = engine_at(tmp_path, summarizer=summarizer)
    summarizer.engine = engine
    summarizer.history = await play(engine, "s", 12)
    before = (await assemble(engine, "s")).estimated_tokens
    result = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=600, force=True)
    )
    assert summarizer.done
    assert result.result is not None
    stored_after = (await assemble(engine, "s")).estimated_tokens
    assert stored_after > before  # the new turn outweighs what the sweep saved ...
    assert result.compacted  # ... but the sweep did compact, and says so
    tokens_before, tokens_after = result.result.tokens_before, result.result.tokens_after
    assert tokens_before == before
    assert tokens_after < tokens_before
    # Its own accounting: what the sweep removed, exactly; the measured end is reported apart.
    new_turn = sum(_messages_tokens(m) for m in turn("s", 99, words=3000))
    assert stored_after == tokens_after + new_turn
    assert result.result.details["storedAfter"] == stored_after
    assert (await engine.doctor(repair=False)).ok


def _messages_tokens(message: Message) -> int:
    return message_tokens(message, estimate_tokens)


async def test_compaction_is_lossless_and_the_dag_links_every_message(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    messages = await play(engine, "s", 40)
    for budget in (3_000, 1_500, 800, 400):
        await engine.compact(
            CompactParams(session_id="s", session_file="", token_budget=budget, force=True)
        )
    assert stored(engine, "s") == messages  # nothing deleted
    report = await engine.doctor(repair=False)
    assert report == DoctorReport(
        conversations=1, messages=len(messages), summaries=report.summaries
    )
    assert report.summaries > 0
    with sqlite3.connect(engine.path) as conn:
        depths = {row[0] for row in conn.execute("SELECT depth FROM summaries")}
    assert max(depths) >= 1  # condensed summaries exist


async def test_exhausted_when_the_tail_alone_exceeds_the_target(tmp_path: Path) -> None:
    engine = engine_at(tmp_path, settings=EngineSettings(fresh_tail_count=50))
    await play(engine, "s", 6)
    result = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=100, force=True)
    )
    assert result.result is not None
    assert not result.compacted
    assert result.result.details["exhausted"] is True
    assert result.reason is not None
    assert result.reason.startswith("exhausted")


class CountingSummarizer:
    """A model-calling summariser stand-in: counts calls, answers by script."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.calls: list[SummaryRequest] = []

    @property
    def id(self) -> str:
        return "counting/1"

    @property
    def uses_model(self) -> bool:
        return True

    async def summarize(self, request: SummaryRequest) -> str:
        self.calls.append(request)
        answer = self.answers.pop(0) if self.answers else "a short summary"
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, str)
        return answer


def summarizers(engine: SqliteContextEngine) -> list[str]:
    with sqlite3.connect(engine.path) as conn:
        return [row[0] for row in conn.execute("SELECT summarizer FROM summaries ORDER BY rowid")]


async def test_debt_is_drained_in_the_background_never_by_a_model_in_the_foreground(
    tmp_path: Path,
) -> None:
    model = CountingSummarizer()
    assert isinstance(model, Summarizer)
    engine = engine_at(tmp_path, summarizer=model)
    messages = await play(engine, "s", 20, budget=800)  # crosses 0.75 x 800: debt recorded
    await engine.bootstrap(BootstrapParams(session_id="s", session_file=str(tmp_path / "none")))
    await assemble(engine, "s", 800, live=messages)
    foreground = await engine.maintain(MaintainParams(session_id="s", session_file=""))
    assert foreground.reason == "compaction deferred to background maintenance"
    assert model.calls == []
    background = await engine.maintain(
        MaintainParams(
            session_id="s",
            session_file="",
            runtime_context={"allowDeferredCompactionExecution": True},
        )
    )
    assert background.reason is not None
    assert background.reason.startswith("compacted")
    assert model.calls
    assert set(summarizers(engine)) == {"counting/1"}
    assert (await assemble(engine, "s", 800)).estimated_tokens <= 800
    settled = await engine.maintain(MaintainParams(session_id="s", session_file=""))
    assert settled.reason is None  # the debt is paid


async def test_deterministic_summariser_drains_debt_inline(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 20, budget=800)
    result = await engine.maintain(MaintainParams(session_id="s", session_file=""))
    assert result.reason is not None
    assert result.reason.startswith("compacted")
    assert set(summarizers(engine)) <= {"extractive/1", "truncate/1"}


async def test_escalation_normal_aggressive_then_truncation(tmp_path: Path) -> None:
    model = CountingSummarizer("", "   ", RuntimeError("provider said no"), "a fine summary")
    engine = engine_at(tmp_path, summarizer=model)
    await play(engine, "s", 12)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=600, force=True)
    )
    assert [c.aggressive for c in model.calls[:4]] == [False, True, False, True]
    used = summarizers(engine)
    assert used[:2] == ["truncate/1", "counting/1"]  # empty twice: the deterministic fallback
    assert (await engine.doctor(repair=False)).ok


async def test_an_oversized_summary_is_capped(tmp_path: Path) -> None:
    model = CountingSummarizer("word " * 5000)
    engine = engine_at(tmp_path, summarizer=model)
    await play(engine, "s", 12)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=600, force=True)
    )
    request = model.calls[0]
    with sqlite3.connect(engine.path) as conn:
        content = conn.execute(
            "SELECT content FROM summaries WHERE summarizer='counting/1' ORDER BY rowid LIMIT 1"
        ).fetchone()[0]
    assert len(content) <= 4 * 3 * request.target_tokens + 4


async def test_auth_error_writes_nothing_and_opens_the_breaker(tmp_path: Path) -> None:
    model = CountingSummarizer(SummarizerAuthError("bad key"))
    engine = engine_at(tmp_path, summarizer=model)
    await play(engine, "s", 12)
    result = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=600, force=True)
    )
    assert result.compacted
    assert len(model.calls) == 1  # then the breaker held it off
    assert "counting/1" not in summarizers(engine)
    await play(engine, "t", 12)
    await engine.compact(
        CompactParams(session_id="t", session_file="", token_budget=600, force=True)
    )
    assert len(model.calls) == 1


async def test_a_stale_plan_writes_nothing(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 10)
    pool = engine._require_pool()
    conv = _store.conversation(pool, "s")
    assert conv is not None
    _, items = _store.planning_items(pool, conv.id)
    chunk = items[:3]
    summary = _store.NewSummary("sum_x", "leaf", 0, "x", 5, 50, 3, None, None, "test")
    assert _store.commit_summary(pool, conv.id, chunk, summary)
    # The same plan again (another process got there first): refused, nothing written.
    again = _store.NewSummary("sum_y", "leaf", 0, "y", 5, 50, 3, None, None, "test")
    assert not _store.commit_summary(pool, conv.id, chunk, again)
    assert (await engine.doctor(repair=False)).ok


# --- health, doctor, retention ---------------------------------------------------------------


async def test_an_unusable_store_hands_compaction_back(tmp_path: Path) -> None:
    path = tmp_path / "not-a-db.sqlite"
    junk = b"this is not a database, it is a text file" * 100
    path.write_bytes(junk)
    engine = SqliteContextEngine(path)
    assert engine.healthy  # nothing is known before the first use opens it
    with pytest.raises(StoreError, match="unavailable"):
        await assemble(engine, "s")
    assert not engine.healthy
    assert engine.info.owns_compaction is False
    # Remembered: every later call fails at once with the same typed error, and so does
    # the operator's doctor, which tries again; the file is never touched.
    with pytest.raises(StoreError, match="unavailable"):
        await deliver(engine, "s", turn("s", 0), 0)
    with pytest.raises(StoreError, match="unavailable"):
        await engine.doctor()
    assert path.read_bytes() == junk
    assert engine_at(tmp_path).info.owns_compaction is True


async def test_the_store_opens_lazily_off_the_event_loop(tmp_path: Path) -> None:
    # Another process holds the write lock: opening (a migration) waits for it. The
    # constructor returns at once, and the first call waits in a worker thread while the
    # event loop keeps running.
    path = tmp_path / "store" / "context.sqlite"
    first = engine_at(tmp_path)
    await assemble(first, "s")  # a store exists (version current; opening still writes)
    first.close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    ticks = 0
    engine: SqliteContextEngine | None = None

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        started = anyio.current_time()
        engine = engine_at(tmp_path)
        assert anyio.current_time() - started < 0.05
        assert engine.healthy

        async def release() -> None:
            await anyio.sleep(0.4)
            holder.execute("ROLLBACK")

        tg.start_soon(release)
        await deliver(engine, "s", turn("s", 0), 0)
        tg.cancel_scope.cancel()
    holder.close()
    assert ticks >= 20  # the loop ran while the open waited for the lock
    assert stored(engine, "s") == turn("s", 0)
    engine.close()
    with pytest.raises(StoreError, match="closed"):
        await assemble(engine, "s")
    never_opened = SqliteContextEngine(tmp_path / "never" / "context.sqlite")
    never_opened.close()
    assert not (tmp_path / "never").exists()  # close() does not open a store


def drop_version_3(conn: sqlite3.Connection) -> None:
    """Take away what version 3 added (the full-text and source indexes)."""
    for table in ("messages_fts", "summaries_fts"):
        conn.execute(f"DROP TABLE {table}")
    for index in ("summary_sources_message", "summary_sources_child"):
        conn.execute(f"DROP INDEX {index}")


def test_a_version_1_store_is_migrated(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    anyio.run(play, engine, "s", 3)
    engine.close()
    with sqlite3.connect(engine.path) as conn:  # what version 1 had
        drop_version_3(conn)
        conn.execute("DROP INDEX messages_order")
        conn.execute("DROP TABLE lineages")
        conn.execute(
            "UPDATE conversations SET uid='random-v1-uid', epoch=?",
            (_plan.compute_epoch("random-v1-uid", ()),),
        )
        conn.execute("PRAGMA user_version=1")
    reopened = engine_at(tmp_path)

    async def check() -> None:
        assert (await reopened.doctor(repair=False)).ok
        assert await reopened.archive("s")
        await play(reopened, "s", 1)

    anyio.run(check)
    with sqlite3.connect(engine.path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
        uids = [row[0] for row in conn.execute("SELECT uid FROM conversations ORDER BY id")]
        assert conn.execute("SELECT started FROM lineages").fetchall() == [(2,)]
    assert uids[0] == "random-v1-uid"  # kept: its epoch does not change on upgrade
    assert uids[1] == _plan.conversation_uid("s", 1)
    reopened.close()


async def test_doctor_repairs_derived_data_and_then_finds_nothing(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 16)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=600, force=True)
    )
    good = await assemble(engine, "s")
    with sqlite3.connect(engine.path) as conn:
        conn.execute("UPDATE conversations SET context_tokens=7, epoch='stale'")
        last = conn.execute("SELECT max(ordinal) FROM context_items").fetchone()[0]
        conn.execute("DELETE FROM context_items WHERE ordinal=?", (last,))
    report = await engine.doctor()
    assert report.problems
    assert report.repaired == report.problems
    assert (await engine.doctor()).problems == ()
    assert dumps(await assemble(engine, "s")) == dumps(good)


def summary_items(engine: SqliteContextEngine) -> list[tuple[int, str, str, int]]:
    with sqlite3.connect(engine.path) as conn:
        return conn.execute(
            "SELECT ci.ordinal, s.id, s.kind, s.descendant_count FROM context_items ci "
            "JOIN summaries s ON s.id = ci.summary_id ORDER BY ci.ordinal"
        ).fetchall()


@pytest.mark.parametrize("damage", ["edges", "message", "child"])
async def test_doctor_repairs_a_summary_whose_sources_are_gone(tmp_path: Path, damage: str) -> None:
    engine = engine_at(tmp_path)
    messages = await play(engine, "s", 30)
    for budget in (1_500, 700):
        await engine.compact(
            CompactParams(session_id="s", session_file="", token_budget=budget, force=True)
        )
    layer = summary_items(engine)
    condensed = [row for row in layer if row[2] == "condensed"]
    assert condensed
    assert len(layer) >= 2
    with sqlite3.connect(engine.path) as conn:
        if damage == "edges":  # the first summary's edges are gone, its messages are not
            target = layer[0][1]
            conn.execute("DELETE FROM summary_sources WHERE summary_id=?", (target,))
        elif damage == "message":  # a message below a summary is gone (a broken store)
            target = condensed[0][1]
            gone = conn.execute(
                "SELECT ss2.message_id FROM summary_sources ss1 JOIN summary_sources ss2 "
                "ON ss2.summary_id = ss1.child_id WHERE ss1.summary_id=? "
                "ORDER BY ss1.position, ss2.position LIMIT 1",
                (target,),
            ).fetchone()[0]
            conn.execute("DELETE FROM messages WHERE id=?", (gone,))
        else:  # a child summary of a condensed one is gone
            target = condensed[0][1]
            child = conn.execute(
                "SELECT child_id FROM summary_sources WHERE summary_id=? ORDER BY position LIMIT 1",
                (target,),
            ).fetchone()[0]
            conn.execute("DELETE FROM summary_sources WHERE summary_id=?", (child,))
            conn.execute("DELETE FROM summaries WHERE id=?", (child,))
    held = stored(engine, "s")
    report = await engine.doctor()
    assert report.problems
    assert report.repaired == report.problems  # every problem repaired
    assert any("whose sources are gone" in p for p in report.repaired)
    assert (await engine.doctor()).problems == ()
    assert stored(engine, "s") == held  # no stored message deleted
    assert target not in {row[1] for row in summary_items(engine)}
    # Lossless for what exists: every stored message is reached once, in order.
    result = await assemble(engine, "s")
    raw = [m for m in result.messages if not texts([m])[0].startswith("<summary")]
    positions = [held.index(dict(m)) for m in raw]
    assert positions == sorted(positions)
    covered = sum(row[3] for row in summary_items(engine)) + len(raw)
    assert covered == len(held) == len(messages) - (damage == "message")


async def test_retention_prunes_archived_conversations_only(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    for name in ("old-1", "old-2", "live"):
        await play(engine, name, 30)
    await engine.archive("old-1")
    await engine.archive("old-2")
    nothing = await engine.prune(archived_before=0.0)
    assert nothing.deleted_conversations == 0
    report = await engine.prune(max_bytes=1)
    assert report.deleted_conversations == 2
    assert report.over_ceiling  # only the live conversation is left, and it is never pruned
    assert stored(engine, "live") == history("live", 30, tools_every=3)
    assert (await engine.doctor(repair=False)).ok


# --- concurrency and the other backend -------------------------------------------------------


async def test_sessions_are_isolated_under_concurrency(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    names = [f"c{i}" for i in range(8)]
    async with anyio.create_task_group() as tg:
        for name in names:
            tg.start_soon(play, engine, name, 10)
            tg.start_soon(play, engine, name, 10)  # the same session twice, concurrently
    for name in names:
        kept = stored(engine, name)
        assert len(kept) == len(history(name, 10))
        assert all(marker(name, 0).split(":")[0] in texts([m])[0] for m in kept)


async def test_idle_session_locks_are_dropped_without_letting_two_holders_in(
    tmp_path: Path,
) -> None:
    engine = engine_at(tmp_path)
    names = [f"c{i}" for i in range(20)]
    async with anyio.create_task_group() as tg:
        for name in names:
            tg.start_soon(play, engine, name, 3)
    await engine.compact(CompactParams(session_id="c0", session_file="", token_budget=300))
    assert engine._locks == {}  # every session is idle: nothing is kept
    # Holders and waiters come and go on one key, the entry leaving and coming back
    # between them: never two inside at once.
    inside = most = entries = 0

    async def hold(delay: float) -> None:
        nonlocal inside, most, entries
        await anyio.sleep(delay)
        async with engine._hold("ingest", "k"):
            inside += 1
            most = max(most, inside)
            entries += 1
            await anyio.lowlevel.checkpoint()
            await anyio.sleep(0.001 * (entries % 3))
            inside -= 1

    async with anyio.create_task_group() as tg:
        for index in range(60):
            tg.start_soon(hold, 0.002 * (index % 7))
    assert (most, entries) == (1, 60)
    assert engine._locks == {}


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_smoke(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    messages = await play(engine, "s", 10, budget=600)
    await engine.maintain(MaintainParams(session_id="s", session_file=""))
    result = await assemble(engine, "s", 600, live=messages)
    assert result.estimated_tokens <= 600
    await engine.dispose()
    assert dumps(await assemble(engine, "s", 600)) == dumps(result)


async def test_assembled_messages_are_read_only_and_equal_to_the_stored(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    messages = await play(engine, "s", 3)
    result = await assemble(engine, "s")
    assert result.messages == [freeze(m) for m in messages]
    with pytest.raises(TypeError):
        result.messages[0]["role"] = "assistant"


def test_one_engine_serves_successive_event_loops(tmp_path: Path) -> None:
    # A host that runs one event loop per command reuses the engine: its locks follow.
    engine = SqliteContextEngine.next_to(tmp_path / "sessions" / "s.jsonl", settings=SMALL)
    assert engine.path == str(tmp_path / "sessions" / "context.sqlite")

    async def turns() -> None:
        async with anyio.create_task_group() as tg:
            for name in ("x", "y", "x"):
                tg.start_soon(play, engine, name, 6)

    anyio.run(turns)
    anyio.run(turns)
    anyio.run(turns, backend="trio")
    assert stored(engine, "x") == history("x", 6)
    engine.close()
