"""A Hypothesis state machine over SqliteContextEngine: random ingest / after_turn / retry /
bootstrap / assemble / compact / maintain / restart sequences on two sessions.

Invariants, checked where they apply:

* **no duplicates, no loss**: the store holds each session's history exactly (teardown), and
  no raw message appears twice in an assembly;
* **within budget**: ``estimated_tokens <= budget``;
* **tool pairs intact**: every tool call in an assembly has its result there, and back;
* **nothing invented**: every raw message assembled is one of the history, in order;
* **identical output for identical state**: assembling twice, or after a restart, gives the
  same bytes;
* **prefix**: with a budget that holds everything, the previous assembly is a prefix of the
  next until a compaction;
* **epoch**: unchanged until a compaction;
* **honest compaction**: ``tokens_before``/``tokens_after`` are the stored context measured
  before and after, ``compacted`` is ``after < before``;
* the store passes ``doctor`` without repairs (teardown).
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from support.engine_sqlite_workload import SMALL, Message, texts, turn

from codex_turn.engines import SqliteContextEngine, _store
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    CompactParams,
    IngestBatchParams,
    MaintainParams,
)
from codex_turn.harness.session import mirror_turn

T = TypeVar("T")
HUGE = 10_000_000
SESSIONS = ("a", "b")


def canonical(result: AssembleResult) -> str:
    return json.dumps(
        [result.messages, result.estimated_tokens, str(result.context_projection)],
        sort_keys=True,
    )


def tool_ids(messages: list[Message]) -> tuple[set[str], set[str]]:
    calls = {
        part["id"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "toolCall"
    }
    answers = {m["toolCallId"] for m in messages if m.get("role") == "toolResult"}
    return calls, answers


def is_pair_half(message: Message) -> bool:
    if message.get("role") == "toolResult":
        return True
    content = message.get("content")
    return isinstance(content, list) and any(p.get("type") == "toolCall" for p in content)


def without_calls(message: Message) -> Message:
    content = [p for p in message["content"] if p.get("type") != "toolCall"]
    return {**message, "content": content}


def assert_suffix(part: list[Message], whole: list[Message]) -> None:
    """``part`` is a suffix of ``whole``, except for tool-pair halves left out (or calls
    removed from their message): the budget cut one contiguous range."""
    if not part:
        return
    position = whole.index(part[0]) if part[0] in whole else whole.index(without_calls(whole[0]))
    index = 0
    for message in whole[position:]:
        if index < len(part) and part[index] == message:
            index += 1
        elif is_pair_half(message):
            stripped = message.get("role") == "assistant" and index < len(part)
            if stripped and part[index] == without_calls(message):
                index += 1
        else:
            raise AssertionError(f"assembly skipped a message inside its range: {message!r}")
    assert index == len(part)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix="engine-stateful-")
        self.root = Path(self._tmp.name)
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal: BlockingPortal = self.portal_cm.__enter__()
        self.engine = SqliteContextEngine(self.root / "store.sqlite", settings=SMALL)
        self.history: dict[str, list[Message]] = {s: [] for s in SESSIONS}
        self.turns: dict[str, int] = dict.fromkeys(SESSIONS, 0)
        self.last_turn: dict[str, tuple[list[Message], int] | None] = dict.fromkeys(SESSIONS)
        self.whole: dict[str, AssembleResult | None] = dict.fromkeys(SESSIONS)
        self.epoch: dict[str, Any] = dict.fromkeys(SESSIONS)
        self.mirrored: dict[str, int] = dict.fromkeys(SESSIONS, 0)

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self.portal.call(fn, *args)

    def teardown(self) -> None:
        try:
            report = self.run(lambda: self.engine.doctor(repair=False))
            assert report.problems == (), report.problems
            for session in SESSIONS:
                assert self.stored(session) == self.history[session]
        finally:
            self.engine.close()
            self.portal_cm.__exit__(None, None, None)
            self._tmp.cleanup()

    def stored(self, session: str) -> list[Message]:
        if not Path(self.engine.path).exists():
            return []  # the engine opens its store on first use
        with sqlite3.connect(self.engine.path) as conn:
            rows = conn.execute(
                "SELECT m.content FROM messages m JOIN conversations c "
                "ON c.id = m.conversation_id WHERE c.session_key=? ORDER BY m.seq",
                (session,),
            ).fetchall()
        return [json.loads(_store.decode_content(row[0])) for row in rows]

    def context_tokens(self, session: str) -> int:
        result = self.assemble(session, HUGE)
        return result.estimated_tokens

    def assemble(self, session: str, budget: int) -> AssembleResult:
        return self.run(
            self.engine.assemble,
            AssembleParams(session_id=session, messages=[], token_budget=budget),
        )

    def compaction_happened(self, session: str) -> None:
        self.whole[session] = None
        self.epoch[session] = None

    @initialize()
    def start(self) -> None:
        pass

    @rule(
        session=st.sampled_from(SESSIONS),
        shapes=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 60)), min_size=1, max_size=5),
        path=st.sampled_from(["after_turn", "after_turn", "ingest_batch"]),
    )
    def new_turns(self, session: str, shapes: list[tuple[int, int]], path: str) -> None:
        """A few turns, each finalized as the harness does (or by ingest_batch)."""
        for tools, words in shapes:
            index = self.turns[session]
            self.turns[session] += 1
            new = turn(session, index, tools=tools, words=words)
            pre = len(self.history[session])
            self.history[session] = [*self.history[session], *new]
            messages = list(self.history[session])
            if path == "ingest_batch":
                params = IngestBatchParams(session_id=session, messages=new)
                self.run(self.engine.ingest_batch, params)
            else:
                self.run(
                    self.engine.after_turn,
                    AfterTurnParams(
                        session_id=session,
                        session_file="",
                        messages=messages,
                        pre_prompt_message_count=pre,
                        token_budget=400,
                    ),
                )
            self.last_turn[session] = (messages, pre)

    @precondition(lambda self: any(self.last_turn.values()))
    @rule(session=st.sampled_from(SESSIONS))
    def retry_after_turn(self, session: str) -> None:
        last = self.last_turn[session]
        if last is None:
            return
        messages, pre = last
        before = self.stored(session)
        self.run(
            self.engine.after_turn,
            AfterTurnParams(
                session_id=session, session_file="", messages=messages, pre_prompt_message_count=pre
            ),
        )
        assert self.stored(session) == before

    @rule(session=st.sampled_from(SESSIONS), data=st.data())
    def redeliver_a_prefix(self, session: str, data: st.DataObject) -> None:
        """A restarted host hands an older or the whole path again, cut anywhere."""
        history = self.history[session]
        length = data.draw(st.integers(0, len(history)))
        cut = data.draw(st.integers(0, length))
        before = self.stored(session)
        self.run(
            self.engine.after_turn,
            AfterTurnParams(
                session_id=session,
                session_file="",
                messages=history[:length],
                pre_prompt_message_count=cut,
            ),
        )
        assert self.stored(session) == before

    @rule(session=st.sampled_from(SESSIONS))
    def bootstrap_from_the_transcript(self, session: str) -> None:
        """The transcript (mirrored, so with idempotency keys) holds what was delivered."""
        transcript = self.root / f"{session}.jsonl"
        new = self.history[session][self.mirrored[session] :]
        if new:
            mirror_turn(
                transcript,
                new,
                scope="prop",
                identities=[str(self.mirrored[session] + i) for i in range(len(new))],
                session_id=session,
                cwd=str(self.root),
            )
            self.mirrored[session] += len(new)
        result = self.run(
            self.engine.bootstrap, BootstrapParams(session_id=session, session_file=str(transcript))
        )
        assert result.imported_messages == 0

    @rule(session=st.sampled_from(SESSIONS), share=st.integers(1, 101))
    def assemble_and_check(self, session: str, share: int) -> None:
        """Assemble with ``share`` percent of the whole context as the budget (101: all)."""
        whole = self.assemble(session, HUGE)
        budget = HUGE if share > 100 else max(1, whole.estimated_tokens * share // 100)
        result = self.assemble(session, budget)
        assert_suffix(result.messages, whole.messages)
        again = self.assemble(session, budget)
        assert canonical(result) == canonical(again)
        assert result.estimated_tokens <= budget
        raw = [m for m in result.messages if not texts([m])[0].startswith("<summary")]
        keys = [json.dumps(m, sort_keys=True) for m in raw]
        assert len(keys) == len(set(keys))
        positions = [self.history[session].index(dict(m)) for m in raw]
        assert positions == sorted(positions)
        calls, answers = tool_ids(result.messages)
        assert calls == answers
        projection = result.context_projection
        assert projection is not None
        assert projection.mode == "thread_bootstrap"
        if self.epoch[session] is not None:
            assert projection.epoch == self.epoch[session]
        self.epoch[session] = projection.epoch
        if budget == HUGE:
            previous = self.whole[session]
            if previous is not None:
                assert result.messages[: len(previous.messages)] == previous.messages
            self.whole[session] = result

    @rule(
        session=st.sampled_from(SESSIONS),
        budget=st.sampled_from([150, 300, 600, 1200]),
        force=st.booleans(),
    )
    def compact(self, session: str, budget: int, force: bool) -> None:
        before = self.context_tokens(session)
        epoch = self.assemble(session, HUGE).context_projection
        result = self.run(
            self.engine.compact,
            CompactParams(session_id=session, session_file="", token_budget=budget, force=force),
        )
        after = self.context_tokens(session)
        assert result.ok
        assert result.result is not None
        assert (result.result.tokens_before, result.result.tokens_after) == (before, after)
        assert result.compacted == (after < before)
        if self.assemble(session, HUGE).context_projection != epoch or after != before:
            self.compaction_happened(session)

    @rule(session=st.sampled_from(SESSIONS))
    def maintain(self, session: str) -> None:
        epoch = self.assemble(session, HUGE).context_projection
        self.run(self.engine.maintain, MaintainParams(session_id=session, session_file=""))
        if self.assemble(session, HUGE).context_projection != epoch:
            self.compaction_happened(session)

    @rule()
    def restart(self) -> None:
        before = {s: canonical(self.assemble(s, HUGE)) for s in SESSIONS}
        self.engine.close()
        self.engine = SqliteContextEngine(self.root / "store.sqlite", settings=SMALL)
        for session in SESSIONS:
            assert canonical(self.assemble(session, HUGE)) == before[session]


EngineMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_engine_state_machine = EngineMachine.TestCase
