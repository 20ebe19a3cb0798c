"""Durable turns: an engine that declares transcript semantics is settled with ``commit_turn``,
once per advancement key, from an owner-only outbox next to the transcript, and recovered
after a crash; assemble sees history before the current turn's entry (the fence).

Fast and in-process (the fake app-server); the real binary with a host SIGKILLed between the
reply and the commit is ``test_durable_turns_e2e.py``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.fake_appserver import FakeAppServer
from support.turns import temporary_session_file, turn_params

from codex_turn import run_codex_turn
from codex_turn.engines import SqliteContextEngine
from codex_turn.fsm import IllegalTransition, TurnOutcome
from codex_turn.fsm.outbox import (
    OUTBOX_TABLE,
    TERMINAL_OF_OUTCOME,
    OutboxState,
    OutboxTrigger,
    needs_settling,
    next_outbox_state,
)
from codex_turn.harness.durable_turns import (
    commit_context_engine_turn,
    fence_history,
    recover_turns,
    turn_span,
)
from codex_turn.harness.engine import (
    AssembleParams,
    AssembleResult,
    CommitTurnParams,
    CommitTurnResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    EngineContractError,
    EngineLoadError,
    IngestParams,
    IngestResult,
    InvalidEngineResult,
    LegacyContextEngine,
    TranscriptSemantics,
    check_engine,
    coerce_result,
    from_json,
    load_engine,
    to_json,
)
from codex_turn.harness.idempotency import (
    TurnAlreadyCompleted,
    advancement_key_for,
    completed_turn,
)
from codex_turn.harness.outbox import SETTLED_KEPT, OutboxUnreadable, TurnOutbox
from codex_turn.harness.session import mirror_prompt, mirror_turn
from codex_turn.harness.turn.context import stripped_histories
from codex_turn.testing import DURABLE_TURN_CHECKS, check_engine_conformance

pytestmark = pytest.mark.anyio


class DurableEngine:
    """A storing engine with durable turns: the turns it committed, by key, and every call."""

    def __init__(self, *, semantics: TranscriptSemantics | None = None) -> None:
        self.info = ContextEngineInfo(
            id="durable-test",
            name="durable test engine",
            transcript_semantics=semantics or TranscriptSemantics.v1(),
        )
        self.committed: dict[str, CommitTurnParams] = {}
        self.commits: list[str] = []
        self.assembled: list[AssembleParams] = []
        self.ingested = 0
        self.fail_commits = 0  # the next N commits raise
        self.hang_commits = 0  # the next N commits never return

    async def ingest(self, params: IngestParams) -> IngestResult:
        self.ingested += 1
        return IngestResult(ingested=True)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        self.assembled.append(params)
        return AssembleResult(messages=list(params.messages), estimated_tokens=0)

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(ok=True, compacted=False)

    async def commit_turn(self, params: CommitTurnParams) -> CommitTurnResult:
        self.commits.append(params.advancement_key)
        if self.hang_commits:
            self.hang_commits -= 1
            await anyio.sleep_forever()
        if self.fail_commits:
            self.fail_commits -= 1
            raise RuntimeError("store down")
        if params.advancement_key in self.committed:
            return CommitTurnResult(status="duplicate")
        self.committed[params.advancement_key] = params
        return CommitTurnResult(status="committed")


class NoCommitEngine(DurableEngine):
    """Declares transcript semantics, has no commit_turn: refused at load."""

    commit_turn = None  # type: ignore[assignment]


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


# --- the records and the check at load -------------------------------------------------------


def test_the_declaration_and_the_records_are_openclaws_camel_case() -> None:
    info = ContextEngineInfo(id="e", name="e", transcript_semantics=TranscriptSemantics.v1())
    assert to_json(info)["transcriptSemantics"] == {
        "currentTurnFence": "before-current-turn-entry-v1",
        "turnAdvancementIdempotency": "atomic-idempotent-v1",
    }
    assert from_json(to_json(info), ContextEngineInfo) == info
    assert from_json({"status": "duplicate"}, CommitTurnResult).status == "duplicate"
    with pytest.raises(InvalidEngineResult, match="commit_turn"):
        coerce_result({"status": "done"}, CommitTurnResult, engine_id="e", method="commit_turn")


def test_a_declaration_without_commit_turn_or_with_unknown_semantics_is_refused() -> None:
    assert check_engine(DurableEngine()).id == "durable-test"
    with pytest.raises(EngineContractError, match="declares transcript semantics but has no"):
        check_engine(NoCommitEngine())
    with pytest.raises(EngineLoadError, match="has no callable commit_turn"):
        load_engine("test_durable_turns:NoCommitEngine")
    later = DurableEngine(
        semantics=TranscriptSemantics("before-current-turn-entry-v2", "atomic-idempotent-v1")
    )
    with pytest.raises(EngineContractError) as caught:
        check_engine(later)
    assert caught.value.problems == (
        "transcript semantics current_turn_fence='before-current-turn-entry-v2' is unknown to "
        "this host (it knows 'before-current-turn-entry-v1')",
    )


async def test_a_turn_refuses_a_bad_declaration_before_any_io(tmp_path: Path) -> None:
    server = FakeAppServer()
    session_file = tmp_path / "s.jsonl"
    with pytest.raises(EngineContractError, match="commit_turn"):
        await run_codex_turn(
            turn_params(str(session_file), "hi"), app_server=server, engine=NoCommitEngine()
        )
    assert not session_file.is_file()
    assert server.calls == []
    assert not (tmp_path / "s.jsonl.turns.json").is_file()


# --- the outbox table and file ---------------------------------------------------------------


def test_the_outbox_table_moves_admitted_accepted_ready_or_blocked() -> None:
    s, t = OutboxState, OutboxTrigger
    path = [t.RUN_RETURNED, t.COMMIT_FAILED, t.COMMIT_FAILED, t.DUPLICATE]
    state = s.ADMITTED
    seen = [state]
    for trigger in path:
        state = next_outbox_state(state, trigger)
        seen.append(state)
    assert seen == [s.ADMITTED, s.ACCEPTED, s.BLOCKED, s.BLOCKED, s.READY]
    assert next_outbox_state(s.ADMITTED, t.PROMPT_MISSING) is s.ABANDONED
    assert next_outbox_state(s.ADMITTED, t.RECOVERED) is s.ACCEPTED
    for settled in (s.READY, s.ABANDONED, s.BLOCKED, s.ACCEPTED):  # a retry starts over
        assert next_outbox_state(settled, t.ADMITTED) is s.ADMITTED
    with pytest.raises(IllegalTransition):
        next_outbox_state(s.READY, t.COMMITTED)
    with pytest.raises(IllegalTransition):
        next_outbox_state(s.ADMITTED, t.COMMITTED)  # never committed before it ran
    assert set(OUTBOX_TABLE) == set(s)
    assert set(TERMINAL_OF_OUTCOME) == set(TurnOutcome)  # every ending has a terminal
    # Recovery settles what a crash left, never the running turn's own admission.
    assert needs_settling(s.ADMITTED, current=False)
    assert not needs_settling(s.ADMITTED, current=True)
    assert needs_settling(s.ACCEPTED, current=True)
    assert needs_settling(s.BLOCKED, current=True)
    assert not needs_settling(s.READY, current=False)


def test_the_outbox_file_is_owner_only_bounded_and_forgiving(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    outbox = TurnOutbox.of(session_file)
    outbox.fire("k1", OutboxTrigger.ADMITTED, prompt_key="p1")
    assert outbox.path == str(tmp_path / "s.jsonl.turns.json")
    assert stat.S_IMODE(os.stat(outbox.path).st_mode) == 0o600
    entry = outbox.fire("k1", OutboxTrigger.RUN_RETURNED, terminal="completed")
    assert (entry.state, entry.prompt_key, entry.terminal) == (
        OutboxState.ACCEPTED,
        "p1",
        "completed",
    )
    with pytest.raises(IllegalTransition):
        outbox.fire("nobody", OutboxTrigger.COMMITTED)
    for n in range(SETTLED_KEPT + 5):
        outbox.fire(f"s{n}", OutboxTrigger.ADMITTED, prompt_key=f"p{n}")
        outbox.fire(f"s{n}", OutboxTrigger.PROMPT_MISSING)
    keys = [e.advancement_key for e in outbox.entries()]
    assert keys[0] == "k1"  # unsettled: always kept
    assert len(keys) == 1 + SETTLED_KEPT
    assert keys[-1] == f"s{SETTLED_KEPT + 4}"
    document = json.loads(Path(outbox.path).read_text())
    assert "p1" in json.dumps(document)
    assert "completed" in json.dumps(document)
    Path(outbox.path).write_text("{not json")
    assert outbox.entries() == []


def test_a_write_never_drops_the_entries_a_failed_read_did_not_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox = TurnOutbox.of(tmp_path / "s.jsonl")
    outbox.fire("turn-a", OutboxTrigger.ADMITTED, prompt_key="pa")
    before = Path(outbox.path).read_bytes()
    real_open = open

    def failing_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == outbox.path and args[:1] == ("rb",):
            raise OSError(5, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(OSError, match="Input/output error"):
        outbox.fire("turn-b", OutboxTrigger.ADMITTED, prompt_key="pb")
    monkeypatch.undo()
    assert Path(outbox.path).read_bytes() == before  # turn-a is still there, nothing lost
    # One entry this version cannot read (a newer state): the rest is not rewritten without it.
    document = json.loads(before)
    document["turns"].append({"advancementKey": "turn-x", "state": "from-a-newer-version"})
    Path(outbox.path).write_text(json.dumps(document))
    assert [e.advancement_key for e in outbox.entries()] == ["turn-a"]  # read: skipped
    with pytest.raises(OutboxUnreadable):
        outbox.fire("turn-b", OutboxTrigger.ADMITTED, prompt_key="pb")
    assert "turn-x" in Path(outbox.path).read_text()


def test_the_advancement_key_is_the_hosts_turn_id_else_the_runs() -> None:
    assert advancement_key_for("turn-wf-42:prompt") == "wf-42"
    assert advancement_key_for("run-abc:prompt") == "run-abc"


# --- where a turn is, and the fence ----------------------------------------------------------


def _m(role: str, text: str, key: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role, "content": text}
    if key is not None:
        message["idempotencyKey"] = key
    return message


def test_a_turn_is_its_prompt_and_what_follows_up_to_the_next_users_message() -> None:
    prompt = "codex-turn:turn-K:prompt"
    history = [
        _m("user", "old"),
        _m("assistant", "old answer"),
        _m("user", "q", prompt),
        _m("assistant", "working"),
        _m("user", "more", "codex-app-server:t:turn-K:steer-1"),
        _m("assistant", "a", "codex-app-server:t:T1:assistant"),
        _m("user", "next"),
    ]
    assert turn_span(history, prompt) == (2, 6)
    assert turn_span(history, "codex-turn:turn-other:prompt") is None
    assert [_text(m) for m in fence_history(history, prompt)] == ["old", "old answer"]
    assert fence_history(history, None) == history


# --- turns through the fake app-server -------------------------------------------------------


async def test_a_turn_is_committed_once_with_its_admission_and_terminal_never_after_turn() -> None:
    engine = DurableEngine()
    server = FakeAppServer()
    with temporary_session_file("durable-") as session_file:
        await run_codex_turn(
            turn_params(session_file, "first"),
            app_server=server,
            engine=engine,
            idempotency_key="k1",
        )
        result = await run_codex_turn(
            turn_params(session_file, "second"),
            app_server=server,
            engine=engine,
            idempotency_key="k2",
        )
        entries = TurnOutbox.of(session_file).entries()
    assert engine.commits == ["k1", "k2"]
    assert engine.ingested == 0  # settled by commit_turn only
    second = engine.committed["k2"]
    assert _text(second.admission.message) == "second"
    assert second.admission.entry_key == "codex-turn:turn-k2:prompt"
    assert second.terminal.status == "completed"
    assert [_text(m) for m in second.terminal.messages] == [result.assistant_text]
    assert second.pre_prompt_message_count == 2
    assert [_text(m) for m in second.messages] == ["first", "Done.", "second", "Done."]
    assert second.session_target.session_key == "agent:main:s-1"
    # The fence: assemble saw history before the turn's entry, never its prompt.
    assert [[_text(m) for m in p.messages] for p in engine.assembled] == [[], ["first", "Done."]]
    assert [(e.advancement_key, e.state) for e in entries] == [
        ("k1", OutboxState.READY),
        ("k2", OutboxState.READY),
    ]


async def test_a_commit_cut_short_is_recovered_by_the_next_turn_exactly_once() -> None:
    engine = DurableEngine()
    engine.hang_commits = 1  # the host "dies" between the reply and the commit
    server = FakeAppServer()
    with temporary_session_file("durable-") as session_file:
        params = turn_params(session_file, "first", engine_timeout=0.2)
        first = await run_codex_turn(params, app_server=server, engine=engine, idempotency_key="k1")
        assert first.assistant_text == "Done."
        assert TurnOutbox.of(session_file).entry("k1").state is OutboxState.ACCEPTED  # type: ignore[union-attr]
        assert "k1" not in engine.committed
        # A retry of the same turn finds its reply: it is committed, and not run again.
        with pytest.raises(TurnAlreadyCompleted):
            await run_codex_turn(params, app_server=server, engine=engine, idempotency_key="k1")
        assert list(engine.committed) == ["k1"]
        await run_codex_turn(
            turn_params(session_file, "second"),
            app_server=server,
            engine=engine,
            idempotency_key="k2",
        )
        states = {e.advancement_key: e.state for e in TurnOutbox.of(session_file).entries()}
    assert engine.commits == ["k1", "k1", "k2"]  # the cut one, its recovery, the next turn
    assert list(engine.committed) == ["k1", "k2"]
    assert engine.committed["k1"].terminal.status == "completed"
    assert states == {"k1": OutboxState.READY, "k2": OutboxState.READY}


async def test_a_failed_commit_blocks_the_entry_and_the_next_turn_retries_it() -> None:
    engine = DurableEngine()
    engine.fail_commits = 1
    server = FakeAppServer()
    with temporary_session_file("durable-") as session_file:
        first = await run_codex_turn(
            turn_params(session_file, "first"),
            app_server=server,
            engine=engine,
            idempotency_key="k1",
        )
        entry = TurnOutbox.of(session_file).entry("k1")
        assert entry is not None
        assert (entry.state, entry.attempts) == (OutboxState.BLOCKED, 1)
        assert ("FINALIZING", "finalize_failed", "DONE") in [t[:3] for t in first.trace]
        await run_codex_turn(
            turn_params(session_file, "second"),
            app_server=server,
            engine=engine,
            idempotency_key="k2",
        )
        states = {e.advancement_key: e.state for e in TurnOutbox.of(session_file).entries()}
    assert engine.commits == ["k1", "k1", "k2"]
    assert states == {"k1": OutboxState.READY, "k2": OutboxState.READY}


async def test_a_retried_turn_whose_prompt_is_durable_already_assembles_behind_it() -> None:
    engine = DurableEngine()
    server = FakeAppServer()
    with temporary_session_file("durable-") as session_file:
        await run_codex_turn(
            turn_params(session_file, "first"),
            app_server=server,
            engine=engine,
            idempotency_key="k1",
        )
        # The first attempt of k2 died mid-turn: its prompt and admission are durable.
        mirror_prompt(
            session_file,
            {
                "role": "user",
                "content": [{"type": "text", "text": "second"}],
                "timestamp": 5,
                "idempotencyKey": "codex-turn:turn-k2:prompt",
            },
            scope="codex-app-server:gone-thread",
            identity="turn-k2:prompt",
            session_id="s-1",
            cwd=os.path.dirname(session_file),
        )
        TurnOutbox.of(session_file).fire(
            "k2", OutboxTrigger.ADMITTED, prompt_key="codex-turn:turn-k2:prompt"
        )
        await run_codex_turn(
            turn_params(session_file, "second"),
            app_server=server,
            engine=engine,
            idempotency_key="k2",
        )
    assert [_text(m) for m in engine.assembled[-1].messages] == ["first", "Done."]
    assert engine.commits == ["k1", "k2"]  # the retry's own, not a recovery of it too
    assert [_text(m) for m in engine.committed["k2"].messages] == [
        "first",
        "Done.",
        "second",
        "Done.",
    ]


# --- recovery at a host's start --------------------------------------------------------------


def _transcript(session_file: str, turns: list[tuple[str, str | None]]) -> None:
    """Turns ``(prompt, reply)`` keyed as a host's turn ids ``k<i>`` make them (no reply: the
    host died during the run)."""
    for index, (prompt, reply) in enumerate(turns):
        messages: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": prompt,
                "timestamp": index * 2,
                "idempotencyKey": f"codex-turn:turn-k{index}:prompt",
            }
        ]
        if reply is not None:
            messages.append(
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": reply}],
                    "timestamp": index * 2 + 1,
                    "idempotencyKey": f"codex-app-server:t:T{index}:assistant",
                }
            )
        mirror_turn(
            session_file,
            messages,
            scope="codex-app-server:t",
            identities=[f"turn-k{index}:prompt", f"T{index}:assistant"][: len(messages)],
            session_id="s-1",
            cwd=os.path.dirname(session_file),
        )


async def test_recovery_at_start_commits_what_a_dead_host_left_exactly_once() -> None:
    engine = DurableEngine()
    with temporary_session_file("durable-") as session_file:
        _transcript(session_file, [("q0", "a0"), ("q1", "a1"), ("q2", None)])
        outbox = TurnOutbox.of(session_file)
        for index, state in enumerate(["accepted", "admitted", "admitted"]):
            outbox.fire(
                f"k{index}", OutboxTrigger.ADMITTED, prompt_key=f"codex-turn:turn-k{index}:prompt"
            )
            if state == "accepted":
                outbox.fire(f"k{index}", OutboxTrigger.RUN_RETURNED, terminal="completed")
        outbox.fire("gone", OutboxTrigger.ADMITTED, prompt_key="codex-turn:turn-gone:prompt")
        report = await recover_turns(session_file, engine=engine, session_id="s-1")
        again = await recover_turns(session_file, engine=engine, session_id="s-1")
        states = {e.advancement_key: e.state for e in outbox.entries()}
    assert report.settled == ("k0", "k1", "k2")
    assert report.abandoned == ("gone",)
    assert again.settled == again.blocked == again.abandoned == ()
    assert engine.commits == ["k0", "k1", "k2"]
    # A host that died during the run: the turn ended as the transcript shows it.
    assert engine.committed["k1"].terminal.status == "completed"
    assert engine.committed["k2"].terminal.status == "interrupted"
    assert engine.committed["k2"].terminal.messages == []
    assert engine.committed["k1"].pre_prompt_message_count == 2
    assert states == {
        "k0": OutboxState.READY,
        "k1": OutboxState.READY,
        "k2": OutboxState.READY,
        "gone": OutboxState.ABANDONED,
    }


async def test_the_reference_engine_commits_atomically_once_per_key(tmp_path: Path) -> None:
    session_file = str(tmp_path / "s.jsonl")
    _transcript(session_file, [("q0", "a0"), ("q1", "a1")])
    outbox = TurnOutbox.of(session_file)
    for index in range(2):
        outbox.fire(
            f"k{index}", OutboxTrigger.ADMITTED, prompt_key=f"codex-turn:turn-k{index}:prompt"
        )
        outbox.fire(f"k{index}", OutboxTrigger.RUN_RETURNED, terminal="completed")
    engine = SqliteContextEngine.next_to(session_file)
    try:
        # The first host committed k0, then died before it could say so.
        history = stripped_histories.read(session_file)
        first = await commit_context_engine_turn(
            engine=engine,
            advancement_key="k0",
            messages=history,
            start=0,
            end=2,
            terminal="completed",
            error=None,
            session_id="s-1",
            session_key=None,
            session_file=session_file,
        )
        assert first.status == "committed"
        report = await recover_turns(session_file, engine=engine, session_id="s-1")
        assert (report.duplicates, report.settled) == (("k0",), ("k1",))
        assembled = await engine.assemble(AssembleParams(session_id="s-1", messages=[]))
        assert [_text(m) for m in assembled.messages] == ["q0", "a0", "q1", "a1"]
    finally:
        await engine.dispose()


# --- the conformance kit ---------------------------------------------------------------------


async def test_the_kit_checks_commit_turn_only_for_engines_that_declare_it(tmp_path: Path) -> None:
    report = await check_engine_conformance(
        SqliteContextEngine,
        workdir=tmp_path / "ref",
        storage="durable",
        checks=["commit_turn_exactly_once"],
    )
    report.assert_conforms()

    class NotIdempotent(SqliteContextEngine):
        async def commit_turn(self, params: CommitTurnParams) -> CommitTurnResult:
            await super().commit_turn(params)
            return CommitTurnResult(status="committed")  # never says duplicate

    broken = await DURABLE_TURN_CHECKS[0].run(
        NotIdempotent, workdir=tmp_path / "broken", storage="durable"
    )
    assert broken.status == "failed"
    assert "a replayed commit of turn 4 answered 'committed'" in broken.reason
    undeclared = await DURABLE_TURN_CHECKS[0].run(
        lambda path: LegacyContextEngine(), workdir=tmp_path / "na", storage="none"
    )
    assert (undeclared.status, undeclared.reason) == (
        "not_applicable",
        "info.transcript_semantics is not declared",
    )


async def test_a_queued_turn_recovered_as_mirrored_is_committed_under_its_turn_id() -> None:
    from codex_turn.scale._catch_up import catch_up_engine  # the scale extra (DBOS)

    engine = DurableEngine()
    with temporary_session_file("durable-") as session_file:
        _transcript(session_file, [("q0", "a0")])
        completed = completed_turn(session_file, "k0")
        assert completed is not None
        params = turn_params(session_file, "q0")
        assert await catch_up_engine(params, engine, completed) == "finalized"
        assert await catch_up_engine(params, engine, completed) == "finalized"  # duplicate
    assert engine.commits == ["k0", "k0"]
    assert list(engine.committed) == ["k0"]
    assert engine.ingested == 0
    assert [_text(m) for m in engine.committed["k0"].messages] == ["q0", "a0"]


async def test_without_a_turn_id_the_key_is_the_hosts_message_key_else_the_runs() -> None:
    engine = DurableEngine()
    server = FakeAppServer()
    with temporary_session_file("durable-") as session_file:
        await run_codex_turn(turn_params(session_file, "one"), app_server=server, engine=engine)
        await run_codex_turn(
            turn_params(session_file, "two", runtime_attempt={"currentMessageId": "m-2"}),
            app_server=server,
            engine=engine,
        )
    run_key, message_key = engine.committed
    assert run_key.startswith("run-")
    assert message_key.startswith("msg-")
    first, second = engine.committed[run_key], engine.committed[message_key]
    assert first.admission.entry_key == f"codex-app-server:thread-1:{run_key}:prompt"
    assert second.admission.entry_key == f"codex-turn:turn-{message_key}:prompt"
    assert [_text(m) for m in second.messages] == ["one", "Done.", "two", "Done."]
    assert (first.pre_prompt_message_count, second.pre_prompt_message_count) == (0, 2)
