"""Continued forks, against the real binary (the fastest sound thread strategy).

After a turn that completed in a fork of the session's base, the fork is kept with what it
holds; the next turn continues it, injecting only what follows, when the fork table says so
(:data:`codex_turn.fsm.thread.FORK_RULES`): the engine's items begin with everything the fork
holds, the settings and instructions are the same, and Codex has not compacted it. Every
test asserts on what the model received (the offline model's recorded requests):

* a conversation that only grows runs in one fork: each request extends the previous one,
  every earlier turn and the developer instructions appear exactly once;
* an engine that adds a message where the next assembly keeps it: only that message is
  injected, once, in place;
* an engine that drops or rewrites an earlier message, changed instructions, an interrupted
  turn, an evicted fork and a steer whose answer was lost: a fresh fork, and nothing stale
  reaches the model.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from codex_turn import AppServer, AppServerConfig, TurnOutcome, TurnParams, run_codex_turn
from codex_turn.harness.appserver import tool
from codex_turn.harness.binding import read_binding
from codex_turn.harness.engine import AssembleResult
from codex_turn.harness.hooks import PromptBuildResult, TurnHooks
from codex_turn.testing import OfflineModel, RecordingEngine, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

MARKER = "DEV-MARKER-continued-fork"
TURNS = 20  # the bound: the 20th request holds every earlier turn exactly once


@pytest.fixture
def params(tmp_path: Path, workspace: Path) -> Callable[..., TurnParams]:
    def make(session: str = "s", **overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": f"session-{session}",
            "session_key": f"agent:main:session-{session}",
            "session_file": tmp_path / f"session-{session}.jsonl",
            "workspace_dir": workspace,
            "prompt": "hello",
            "extra_developer_instructions": MARKER,
        }
        values.update(overrides)
        return TurnParams(**values)

    return make


def fork_reasons(logs: list[dict[str, Any]]) -> list[str]:
    """The fork table's reason of each forked turn, in order (the ``fork`` log field)."""
    return [e["fork"] for e in logs if e.get("event") == "codex app-server thread forked"]


def injected(logs: list[dict[str, Any]]) -> list[int]:
    return [e["items"] for e in logs if e.get("event") == "codex app-server thread forked"]


async def test_a_growing_conversation_runs_in_one_continued_fork(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()  # assembles the transcript, per turn: it only grows
    results = []
    with capture_logs() as logs:
        for k in range(1, TURNS + 1):
            result = await run_codex_turn(
                params(prompt=f"GROW_{k}_ASK"), app_server=appserver, engine=engine
            )
            assert result.outcome is TurnOutcome.COMPLETED, result.prompt_error
            results.append(result)
    # Turn 1 has no context and forks the base; the rest continue its fork.
    assert fork_reasons(logs) == ["no-kept-fork"] + ["context-extends-kept-fork"] * (TURNS - 1)
    assert injected(logs)[1:] == [0] * (TURNS - 1)  # nothing re-injected: the fork holds it
    assert len({r.thread_id for r in results}) == 1
    requests = offline_model.turn_requests()
    assert len({r.body.get("prompt_cache_key") for r in requests}) == 1
    for previous, current in itertools.pairwise(requests):
        # The whole previous request is a prefix of the next one (the cacheable part).
        before = [json.dumps(i, sort_keys=True) for i in previous.input_items]
        after = [json.dumps(i, sort_keys=True) for i in current.input_items]
        assert after[: len(before)] == before
    for k, request in enumerate(requests, start=1):
        assert request.user_messages[-1] == f"GROW_{k}_ASK"
        assert sum(MARKER in part for part in request.developer_parts) == 1
    last = requests[-1]
    asks = [t for t in last.user_messages if t.startswith("GROW_")]
    assert asks == [f"GROW_{k}_ASK" for k in range(1, TURNS + 1)]
    for k in range(1, TURNS):
        assert sum(f"ECHO: GROW_{k}_ASK" in t for t in last.assistant_messages) == 1
    sizes = [len(r.input_items) for r in requests]
    assert sizes == [sizes[0] + 2 * i for i in range(TURNS)]  # bounded: each turn adds its exchange


async def test_a_message_the_engine_adds_is_injected_once_in_place(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    # From turn 3 on the engine keeps a note after what the transcript held at turn 3.
    anchor: list[int] = []

    def assemble(p: Any) -> AssembleResult:
        messages = list(p.messages)
        if p.prompt == "NOTE_3_ASK" or anchor:
            if not anchor:
                anchor.append(len(messages))
            note = {"role": "user", "content": "ENGINE_NOTE", "timestamp": 1}
            messages.insert(anchor[0], note)
        return AssembleResult(messages=messages, estimated_tokens=0)

    engine = RecordingEngine(responses={"assemble": assemble})
    with capture_logs() as logs:
        for k in range(1, 6):
            result = await run_codex_turn(
                params(prompt=f"NOTE_{k}_ASK"), app_server=appserver, engine=engine
            )
            assert result.outcome is TurnOutcome.COMPLETED, result.prompt_error
    assert fork_reasons(logs) == ["no-kept-fork"] + ["context-extends-kept-fork"] * 4
    assert injected(logs)[1:] == [0, 1, 0, 0]  # the note, once (at turn 3)
    for request in offline_model.turn_requests()[2:]:
        users = request.user_messages
        assert users.count("ENGINE_NOTE") == 1
        assert users.index("ENGINE_NOTE") == users.index("NOTE_3_ASK") - 1


async def test_an_engine_that_drops_an_earlier_message_gets_a_fresh_fork(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    def assemble(p: Any) -> AssembleResult:
        messages = list(p.messages)
        if p.prompt == "DROP_4_ASK":  # the engine forgets the first exchange from here on
            messages = [m for m in messages if "DROP_1" not in json.dumps(m)]
        return AssembleResult(messages=messages, estimated_tokens=0)

    engine = RecordingEngine(responses={"assemble": assemble})
    with capture_logs() as logs:
        results = [
            await run_codex_turn(
                params(prompt=f"DROP_{k}_ASK"), app_server=appserver, engine=engine
            )
            for k in range(1, 5)
        ]
    assert all(r.outcome is TurnOutcome.COMPLETED for r in results)
    assert fork_reasons(logs) == [
        "no-kept-fork",
        "context-extends-kept-fork",
        "context-extends-kept-fork",
        "context-diverged-from-kept-fork",
    ]
    assert results[3].thread_id != results[2].thread_id
    last = offline_model.turn_requests()[-1]
    body = json.dumps(last.input_items)
    assert "DROP_1_ASK" not in body  # the fork that held it is gone
    assert last.user_messages.count("DROP_2_ASK") == 1
    assert last.user_messages.count("DROP_3_ASK") == 1
    assert sum(MARKER in part for part in last.developer_parts) == 1


async def test_changed_instructions_fork_afresh_and_reach_the_model_alone(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()
    with capture_logs() as logs:
        for k, host in enumerate(("HOST_A", "HOST_A", "HOST_A", "HOST_B"), start=1):
            result = await run_codex_turn(
                params(prompt=f"INS_{k}", extra_developer_instructions=host),
                app_server=appserver,
                engine=engine,
            )
            assert result.outcome is TurnOutcome.COMPLETED
    assert fork_reasons(logs) == [
        "no-kept-fork",
        "context-extends-kept-fork",
        "context-extends-kept-fork",
        "kept-fork-settings-changed",
    ]
    last = " ".join(offline_model.turn_requests()[-1].developer_parts)
    assert "HOST_B" in last
    assert "HOST_A" not in last
    assert offline_model.turn_requests()[-1].user_messages.count("INS_3") == 1


async def test_an_interrupted_turn_leaves_no_fork_to_continue(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()
    offline_model.script(
        Reply.fixed("never finished", delay=30.0, partial_text="PARTIAL_REPLY"),
        user_contains="CUT_3_ASK",
    )
    with capture_logs() as logs:
        outcomes = [
            (
                await run_codex_turn(
                    params(prompt=f"CUT_{k}_ASK", turn_timeout=2.0 if k == 3 else 600.0),
                    app_server=appserver,
                    engine=engine,
                )
            ).outcome
            for k in range(1, 5)
        ]
    assert outcomes[2] is not TurnOutcome.COMPLETED
    assert outcomes[3] is TurnOutcome.COMPLETED
    # The interrupted turn's fork was released at once (its tool handlers with it).
    assert fork_reasons(logs) == [
        "no-kept-fork",
        "context-extends-kept-fork",
        "context-extends-kept-fork",
        "no-kept-fork",
    ]
    last = offline_model.turn_requests()[-1]
    assert last.user_messages.count("CUT_2_ASK") == 1
    assert last.user_messages.count("CUT_3_ASK") == 1
    assert last.user_messages[-1] == "CUT_4_ASK"


async def test_an_evicted_fork_is_forked_afresh_with_the_whole_conversation(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    # One fork kept for the whole pool: two sessions taking turns evict each other's.
    engine = RecordingEngine()
    async with AppServer.start(make_appserver_config(), max_kept_forks=1) as server:
        with capture_logs() as logs:
            for k in range(1, 4):
                for session in ("a", "b"):
                    result = await run_codex_turn(
                        params(session, prompt=f"EVICT_{session}_{k}"),
                        app_server=server,
                        engine=engine,
                    )
                    assert result.outcome is TurnOutcome.COMPLETED
    assert fork_reasons(logs) == ["no-kept-fork"] * 6
    by_session = {
        session: [
            r for r in offline_model.turn_requests() if f"EVICT_{session}_3" in r.user_messages
        ]
        for session in ("a", "b")
    }
    for session, (request,) in by_session.items():
        asks = [t for t in request.user_messages if t.startswith("EVICT_")]
        assert asks == [f"EVICT_{session}_{k}" for k in range(1, 4)]


async def test_a_prompt_a_hook_changed_is_not_continued(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    # The fork holds the prompt as sent (with the hook's context); the transcript, and so the
    # engine's next assembly, holds the raw prompt: no exact record, no continued fork.
    turn = iter(range(1, 100))

    async def recall(_: Any) -> PromptBuildResult:
        return PromptBuildResult(prepend_context=f"RECALL_{next(turn)}")

    hooks = TurnHooks(before_prompt_build=[recall])
    engine = RecordingEngine()
    with capture_logs() as logs:
        for k in range(1, 5):
            result = await run_codex_turn(
                params(prompt=f"HOOK_{k}_ASK"), app_server=appserver, engine=engine, hooks=hooks
            )
            assert result.outcome is TurnOutcome.COMPLETED
    assert fork_reasons(logs) == ["no-kept-fork"] * 4
    last = offline_model.turn_requests()[-1]
    recalls = [t for t in last.user_messages if "RECALL_" in t]
    assert len(recalls) == 1  # this turn's only: earlier hook context does not pile up
    assert last.user_messages.count("HOOK_3_ASK") == 1


async def test_a_fork_a_steer_went_to_unconfirmed_is_not_continued(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Turn 2's turn/steer gets no answer in time and its message never shows up: Codex may
    # still hold it in that fork, where neither the mirror nor the fork's record has it. The
    # fork is released (a runner that sends the message again must not see it twice there).
    from codex_turn.harness.appserver import AppServerTimeout
    from codex_turn.harness.appserver.turn import TurnHandle
    from codex_turn.harness.turn import steering

    async def lost_answer(self: TurnHandle, *_: Any, **__: Any) -> str:
        raise AppServerTimeout("turn/steer got no response", method="turn/steer", seconds=0.1)

    monkeypatch.setattr(TurnHandle, "steer", lost_answer)
    monkeypatch.setattr(steering, "INTERRUPT_GRACE_S", 0.05)
    offline_model.script(Reply.fixed("slow enough to steer", delay=1.5), user_contains="LOST_2_ASK")
    engine = RecordingEngine()
    receipts: list[Any] = []

    async def steer_during(session_file: Path) -> None:
        # Turn 2's request is in (the model holds its reply): the Codex turn is running.
        await anyio.to_thread.run_sync(lambda: offline_model.wait_for_requests(2, timeout=20))
        receipts.append(await steering.steer_codex_turn(session_file, "STEER_LOST"))

    with capture_logs() as logs:
        for k in range(1, 5):
            p = params(prompt=f"LOST_{k}_ASK")
            async with anyio.create_task_group() as tg:
                if k == 2:
                    tg.start_soon(steer_during, p.session_file)
                result = await run_codex_turn(p, app_server=appserver, engine=engine)
            assert result.outcome is TurnOutcome.COMPLETED, result.prompt_error
    assert [r.status for r in receipts] == [steering.SteerStatus.UNKNOWN]
    # Turn 3 forks afresh (the fork of turn 2 was released); turn 4 continues turn 3's.
    assert fork_reasons(logs) == [
        "no-kept-fork",
        "context-extends-kept-fork",
        "no-kept-fork",
        "context-extends-kept-fork",
    ]
    released = [e for e in logs if e.get("event") == "codex fork released"]
    assert [e["reason"] for e in released] == ["steer_unconfirmed"]
    assert "STEER_LOST" not in repr(logs)  # the message itself is never logged


async def test_a_turn_with_tool_calls_is_not_continued(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    # The fork holds the call and its full output; the engine's form follows tool_payloads.
    @tool("lookup", "look a thing up")
    async def lookup(args: Any) -> str:
        return "BIG_TOOL_OUTPUT " * 50

    engine = RecordingEngine()
    offline_model.script(Reply.function_call("lookup", {}), user_contains="TOOL_2_ASK")
    with capture_logs() as logs:
        for k in range(1, 5):
            result = await run_codex_turn(
                params(prompt=f"TOOL_{k}_ASK", tool_payloads="elide"),
                app_server=appserver,
                engine=engine,
                tools=[lookup],
            )
            assert result.outcome is TurnOutcome.COMPLETED
    assert fork_reasons(logs) == [
        "no-kept-fork",
        "context-extends-kept-fork",
        "no-kept-fork",
        "context-extends-kept-fork",
    ]
    later = [
        r
        for r in offline_model.turn_requests()
        if r.user_messages[-1] in ("TOOL_3_ASK", "TOOL_4_ASK")
    ]
    assert len(later) == 2
    for request in later:
        # The call's output is not in the request (the reply quoting it is: the transcript's).
        assert "BIG_TOOL_OUTPUT" not in json.dumps(request.function_call_outputs)


async def test_a_compaction_drops_the_kept_fork(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    from codex_turn import CompactSessionParams
    from codex_turn.harness.compaction import compact_codex_session_traced

    engine = RecordingEngine()  # does not own compaction: the native step is asked
    with capture_logs() as logs:
        for k in (1, 2):
            await run_codex_turn(params(prompt=f"CMP_{k}"), app_server=appserver, engine=engine)
        first = params()
        run = await compact_codex_session_traced(
            CompactSessionParams(
                session_id=first.session_id,
                session_file=str(first.session_file),
                workspace_dir=str(first.workspace_dir),
                session_key=first.session_key,
            ),
            app_server=appserver,
            engine=engine,
        )
        assert run.result.ok
        after = await run_codex_turn(params(prompt="CMP_3"), app_server=appserver, engine=engine)
    assert after.outcome is TurnOutcome.COMPLETED
    assert fork_reasons(logs) == ["no-kept-fork", "context-extends-kept-fork", "no-kept-fork"]
    assert offline_model.turn_requests()[-1].user_messages.count("CMP_1") == 1


async def test_a_kept_fork_codex_no_longer_knows_is_forked_afresh_in_the_same_turn(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    # Unsubscribed behind the client's back, Codex unloads the fork and tells nobody: the
    # continuation's injection answers "thread not found", about the fork, not the base.
    config = make_appserver_config(extra_config={"thread_unload_delay_secs": 1})
    engine = RecordingEngine()
    async with AppServer.start(config) as server:
        with capture_logs() as logs:
            for k in (1, 2):
                await run_codex_turn(params(prompt=f"LOST_{k}"), app_server=server, engine=engine)
            kept = offline_model.turn_requests()[-1]
            fork = server.kept_fork(
                read_binding(params().session_file, session_id="session-s").thread_id
            )  # type: ignore[union-attr]
            assert fork is not None
            await server.request("thread/unsubscribe", {"threadId": fork.fork_thread_id})
            with anyio.fail_after(15):
                while (  # noqa: ASYNC110 - polling Codex's own list, no event to await
                    fork.fork_thread_id in (await server.request("thread/loaded/list", {}))["data"]
                ):
                    await anyio.sleep(0.2)
            result = await run_codex_turn(params(prompt="LOST_3"), app_server=server, engine=engine)
    assert kept.user_messages[-1] == "LOST_2"
    assert result.outcome is TurnOutcome.COMPLETED, result.prompt_error
    assert "fork_failed" not in [e.trigger for e in result.trace]
    assert fork_reasons(logs) == ["no-kept-fork", "context-extends-kept-fork", "no-kept-fork"]
    binding = read_binding(params().session_file, session_id="session-s")
    assert binding is not None
    assert binding.fork_base  # the base was kept
    last = offline_model.turn_requests()[-1]
    assert last.user_messages.count("LOST_1") == 1
    assert last.user_messages.count("LOST_2") == 1


async def test_a_kept_fork_codex_answers_unknown_to_an_injection_is_forked_afresh(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Codex answers that the kept fork is unknown when the next turn injects what follows
    (the client still held it as loaded, unlike the unload above): the fork table, told no
    fork is kept, forks the base afresh with the whole context, and the log says so."""
    from codex_turn.harness.appserver import ThreadNotFound

    anchor: list[int] = []

    def assemble(p: Any) -> AssembleResult:
        messages = list(p.messages)
        if p.prompt == "LOST_3_ASK" or anchor:
            if not anchor:
                anchor.append(len(messages))
            messages.insert(anchor[0], {"role": "user", "content": "ENGINE_NOTE", "timestamp": 1})
        return AssembleResult(messages=messages, estimated_tokens=0)

    engine = RecordingEngine(responses={"assemble": assemble})
    results = []
    real_inject = appserver.inject_items
    gone: set[str] = set()

    async def inject(thread_id: str, items: Any) -> None:
        if thread_id in gone:
            raise ThreadNotFound(-32600, f"thread not found: {thread_id}")
        await real_inject(thread_id, items)

    monkeypatch.setattr(appserver, "inject_items", inject)
    with capture_logs() as logs:
        for k in range(1, 4):
            if k == 3:
                gone.add(results[1].thread_id)  # the fork kept after turn 2
            result = await run_codex_turn(
                params(prompt=f"LOST_{k}_ASK"), app_server=appserver, engine=engine
            )
            assert result.outcome is TurnOutcome.COMPLETED, result.prompt_error
            results.append(result)
    assert fork_reasons(logs) == ["no-kept-fork", "context-extends-kept-fork", "no-kept-fork"]
    assert results[2].thread_id != results[1].thread_id
    last = offline_model.turn_requests()[-1]
    assert last.user_messages.count("ENGINE_NOTE") == 1
    asks = [t for t in last.user_messages if t.startswith("LOST_")]
    assert asks == ["LOST_1_ASK", "LOST_2_ASK", "LOST_3_ASK"]
