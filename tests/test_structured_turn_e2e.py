"""The structured projection through ``run_codex_turn``, against the real binary.

An engine that projects per turn gets its assembly to Codex as Responses items, injected into
an ephemeral fork of the session's base thread; the turn machine shows the branch
(``projected_as_items``, ``thread_forked``) and its fallback (``fork_failed`` ->
``reprojecting`` -> the text frame on a fresh thread). What the model received is asserted on
the offline model's recorded requests:

* the assembly arrives as role items, in order, right before the raw prompt, no text frame;
* the binding stays on one base thread, every turn runs in a fork of it (continued while
  the conversation only grows: tests/test_structured_continue_e2e.py), and
  ``prompt_cache_key`` is the base's id on every turn; each earlier turn appears once;
* the fork gets this turn's tool handlers; a native compaction inside a fork dies with it;
* a turn whose assembly does not convert, a fork Codex refuses and items Codex rejects all
  fall back to the text frame, with the branch in the trace;
* a failed assemble on a structured session forks the base with the recent transcript.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from structlog.testing import capture_logs

from codex_turn import AppServer, AppServerConfig, TurnOutcome, TurnParams, run_codex_turn
from codex_turn.harness.appserver import tool
from codex_turn.harness.binding import read_binding, write_binding
from codex_turn.harness.engine import AssembleResult
from codex_turn.harness.turn import forms
from codex_turn.projection import CONTEXT_HEADER
from codex_turn.projection.items import ConvertedItems
from codex_turn.testing import OfflineModel, RecordingEngine, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

MARKER = "DEV-MARKER-structured-turn"


@pytest.fixture
def params(tmp_path: Path, workspace: Path) -> Callable[..., TurnParams]:
    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "session-s",
            "session_key": "agent:main:session-s",
            "session_file": tmp_path / "session-s.jsonl",
            "workspace_dir": workspace,
            "prompt": "hello",
            "extra_developer_instructions": MARKER,
        }
        values.update(overrides)
        return TurnParams(**values)

    return make


def triggers(result: Any) -> list[str]:
    return [entry.trigger for entry in result.trace]


def bound_thread(session_file: Path) -> str:
    binding = read_binding(session_file, session_id="session-s")
    assert binding is not None
    return binding.thread_id


async def test_per_turn_projection_runs_each_turn_in_a_fork_of_one_base(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()  # assembles the transcript, per turn
    results = []
    for k in range(1, 11):
        result = await run_codex_turn(
            params(prompt=f"TURN_{k}_ASK"), app_server=appserver, engine=engine
        )
        assert result.outcome is TurnOutcome.COMPLETED, result.prompt_error
        results.append(result)
    session_file = params().session_file
    base = bound_thread(Path(session_file))
    binding = read_binding(session_file, session_id="session-s")
    assert binding is not None
    assert binding.fork_base
    # Turn 1 had nothing to project (an empty transcript), and still runs in a fork of the
    # base: one prompt-cache key for the session from its first turn on.
    assert "thread_forked" in triggers(results[0])
    assert results[0].thread_decision is not None
    assert results[0].thread_decision.reason == "structured-session-without-context"
    for result in results[1:]:
        assert "projected_as_items" in triggers(result)
        assert "thread_forked" in triggers(result)
        assert result.thread_decision is not None
        assert result.thread_decision.reason == "per-turn-projection-items"
    forks = [r.thread_id for r in results]
    assert len(set(forks)) == 1  # a conversation that only grows continues one fork
    assert base not in forks
    requests = offline_model.turn_requests()
    assert len(requests) == 10
    # One cache key for the whole session: the base's.
    assert {r.body.get("prompt_cache_key") for r in requests} == {base}
    for k, request in enumerate(requests, start=1):
        assert request.user_messages[-1] == f"TURN_{k}_ASK"
        body = json.dumps(request.body)
        assert CONTEXT_HEADER not in body
        assert "item_reference" not in body  # the base's anchor never reaches the model
        assert any(MARKER in part for part in request.developer_parts)
    last = requests[-1]
    # Every earlier turn once, as role items in order before the raw prompt.
    for k in range(1, 10):
        assert sum(f"TURN_{k}_ASK" == text for text in last.user_messages) == 1
        assert sum(f"ECHO: TURN_{k}_ASK" in text for text in last.assistant_messages) == 1
    asks = [t for t in last.user_messages if t.startswith("TURN_")]
    assert asks == [f"TURN_{k}_ASK" for k in range(1, 11)]
    # Bounded: each turn adds its exchange (2 items), nothing piles up.
    sizes = [len(r.input_items) for r in requests]
    assert sizes[1:] == [sizes[1] + 2 * i for i in range(9)]


async def test_identical_assembly_gives_byte_identical_items(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    history = [
        {"role": "user", "content": "INJ_U1 list the files", "timestamp": 1},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "INJ_A1 looking"},
                {"type": "toolCall", "id": "c1", "name": "exec", "arguments": {"cmd": "ls"}},
            ],
            "timestamp": 2,
        },
        {"role": "toolResult", "toolCallId": "c1", "content": "a.py", "timestamp": 3},
    ]
    engine = RecordingEngine(
        responses={"assemble": AssembleResult(messages=history, estimated_tokens=3)}
    )
    for prompt in ("same ask", "same ask"):
        result = await run_codex_turn(params(prompt=prompt), app_server=appserver, engine=engine)
        assert "thread_forked" in triggers(result)
    one, two = offline_model.turn_requests()
    kinds = [i["type"] for i in one.input_items[-6:]]
    context = ["message", "message", "function_call", "function_call_output"]
    # ... then the turn's instructions as a developer item, then the raw prompt.
    assert kinds == [*context, "message", "message"]
    assert one.input_items[-2]["role"] == "developer"
    assert MARKER in json.dumps(one.input_items[-2])
    assert json.dumps(one.input_items[-6:-1]) == json.dumps(two.input_items[-6:-1])
    call = one.input_items[-4]
    assert call["name"] == "exec"
    assert json.loads(call["arguments"]) == {"cmd": "ls"}


async def test_the_fork_runs_this_turns_tool_handlers(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    answered: list[str] = []

    @tool("lookup", "look a thing up")
    async def lookup(args: Any) -> str:
        answered.append("called")
        return "LOOKUP_ANSWER"

    engine = RecordingEngine()
    await run_codex_turn(params(prompt="a"), app_server=appserver, engine=engine, tools=[lookup])
    offline_model.script(Reply.function_call("lookup", {}), user_contains="b")
    second = await run_codex_turn(
        params(prompt="b"), app_server=appserver, engine=engine, tools=[lookup]
    )
    assert second.outcome is TurnOutcome.COMPLETED
    assert "thread_forked" in triggers(second)
    assert answered == ["called"]
    assert "LOOKUP_ANSWER" in json.dumps(offline_model.turn_requests()[-1].function_call_outputs)


async def test_text_format_keeps_the_text_frame_on_fresh_threads(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()
    for prompt in ("first", "second"):
        result = await run_codex_turn(
            params(prompt=prompt, projection_format="text"), app_server=appserver, engine=engine
        )
    assert "projected" in triggers(result)
    assert "projected_as_items" not in triggers(result)
    assert "thread_rotated" in triggers(result)
    assert CONTEXT_HEADER in offline_model.turn_requests()[-1].user_messages[-1]


async def test_an_unconvertible_assembly_falls_back_to_the_text_frame(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    orphan = [
        {"role": "user", "content": "ORPHAN_CONTEXT_U", "timestamp": 1},
        {"role": "toolResult", "toolCallId": "nobody", "content": "x", "timestamp": 2},
    ]
    engine = RecordingEngine(
        responses={"assemble": AssembleResult(messages=orphan, estimated_tokens=2)}
    )
    with capture_logs() as records:
        result = await run_codex_turn(params(prompt="ask"), app_server=appserver, engine=engine)
    assert result.outcome is TurnOutcome.COMPLETED
    assert "projected" in triggers(result)
    assert "projected_as_items" not in triggers(result)
    warning = [r for r in records if "structured projection unavailable" in r["event"]]
    assert warning
    assert warning[0]["reason"] == "orphan_tool_result"
    assert "ORPHAN_CONTEXT_U" not in json.dumps(records, default=str)  # no content in logs
    request = offline_model.turn_requests()[-1]
    assert CONTEXT_HEADER in request.user_messages[-1]
    assert "ORPHAN_CONTEXT_U" in request.user_messages[-1]


async def test_an_assembly_holding_nan_falls_back_to_the_text_frame(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    # An engine's assembly is arbitrary Python: a float NaN in a tool payload kept as JSON
    # has no canonical JSON, so the items are refused and the turn still runs.
    nan_call = [
        {"role": "user", "content": "NAN_CONTEXT_U", "timestamp": 1},
        {
            "role": "assistant",
            "content": [
                {"type": "toolCall", "id": "c1", "name": "exec", "arguments": {"r": float("nan")}}
            ],
            "timestamp": 2,
        },
        {"role": "toolResult", "toolCallId": "c1", "content": "done", "timestamp": 3},
    ]
    engine = RecordingEngine(
        responses={"assemble": AssembleResult(messages=nan_call, estimated_tokens=3)}
    )
    with capture_logs() as records:
        result = await run_codex_turn(
            params(prompt="ask", tool_payloads="full"), app_server=appserver, engine=engine
        )
    assert result.outcome is TurnOutcome.COMPLETED
    assert "projected" in triggers(result)
    assert "projected_as_items" not in triggers(result)
    warning = [r for r in records if "structured projection unavailable" in r["event"]]
    assert warning
    assert warning[0]["reason"] == "non_json_number"
    request = offline_model.turn_requests()[-1]
    assert CONTEXT_HEADER in request.user_messages[-1]
    assert "NAN_CONTEXT_U" in request.user_messages[-1]


async def test_a_refused_fork_falls_back_to_the_text_frame_on_a_fresh_thread(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()
    await run_codex_turn(params(prompt="first ask"), app_server=appserver, engine=engine)
    forked = await run_codex_turn(params(prompt="next ask"), app_server=appserver, engine=engine)
    assert "thread_forked" in triggers(forked)
    session_file = Path(params().session_file)
    binding = read_binding(session_file, session_id="session-s")
    assert binding is not None
    # The base is gone (a Codex home that lost it): Codex refuses the fork.
    write_binding(
        session_file, attrs.evolve(binding, thread_id="01a22b2a-0000-7000-8000-00000000beef")
    )
    with capture_logs() as records:
        second = await run_codex_turn(
            params(prompt="second ask"), app_server=appserver, engine=engine
        )
    assert second.outcome is TurnOutcome.COMPLETED
    path = triggers(second)
    assert path.index("projected_as_items") < path.index("fork_failed")
    assert path.index("fork_failed") < path.index("reprojected") < path.index("thread_rotated")
    assert second.thread_decision is not None
    assert second.thread_decision.reason == "fork-base-refused"
    assert any("fork failed" in r["event"] for r in records)
    request = offline_model.turn_requests()[-1]
    assert CONTEXT_HEADER in request.user_messages[-1]
    assert "first ask" in request.user_messages[-1]  # the conversation, as the text frame
    # The next turn starts a new base and forks it again.
    third = await run_codex_turn(params(prompt="third ask"), app_server=appserver, engine=engine)
    assert "thread_forked" in triggers(third)
    assert read_binding(session_file, session_id="session-s").fork_base  # type: ignore[union-attr]


async def test_items_codex_rejects_fall_back_to_the_text_frame(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = RecordingEngine()
    await run_codex_turn(params(prompt="first ask"), app_server=appserver, engine=engine)
    bad = ({"type": "message", "role": "user", "content": "PRIVATE words of the assembly"},)

    def rejected(converted: ConvertedItems, max_chars: int | None) -> ConvertedItems:
        # An item Codex's own parser refuses (-32600): the injection is what fails.
        return attrs.evolve(converted, items=bad, canonical=json.dumps(bad))

    monkeypatch.setattr(forms, "newest_items", rejected)
    with capture_logs() as records:
        second = await run_codex_turn(
            params(prompt="second ask"), app_server=appserver, engine=engine
        )
    assert second.outcome is TurnOutcome.COMPLETED
    path = triggers(second)
    assert "fork_failed" in path
    assert "thread_rotated" in path
    failed = [r for r in records if "fork failed" in r["event"]]
    assert failed[0]["step"] == "inject"
    assert "not a valid response item" in failed[0]["error"]
    # Codex's refusal quotes the item; the log never does.
    assert "PRIVATE words" not in json.dumps(records, default=str)
    assert CONTEXT_HEADER in offline_model.turn_requests()[-1].user_messages[-1]


async def test_a_failed_assemble_forks_the_base_with_the_recent_transcript(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()
    for prompt in ("REMEMBER_LISBON", "REMEMBER_PORTO"):
        await run_codex_turn(params(prompt=prompt), app_server=appserver, engine=engine)
    base = bound_thread(Path(params().session_file))
    broken = RecordingEngine(failures={"assemble": RuntimeError("engine down")})
    with capture_logs() as records:
        third = await run_codex_turn(
            params(prompt="which cities?"), app_server=appserver, engine=broken
        )
    assert third.outcome is TurnOutcome.COMPLETED
    path = triggers(third)
    assert "assemble_failed" in path
    assert "thread_forked" in path
    assert third.thread_decision is not None
    assert third.thread_decision.reason == "fork-base-without-context"
    forked = [r for r in records if r["event"] == "codex app-server thread forked"]
    assert forked[0]["source"] == "transcript"
    request = offline_model.turn_requests()[-1]
    assert request.body.get("prompt_cache_key") == base
    assert "REMEMBER_LISBON" in request.user_messages
    assert "REMEMBER_PORTO" in request.user_messages
    assert bound_thread(Path(params().session_file)) == base  # the base is kept


async def test_a_native_compaction_inside_a_fork_dies_with_it(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    # Codex compacts on its own once usage passes the limit: inside a fork, the compaction
    # (and its summary) stays there; the next turn forks the base and re-projects in full.
    config = make_appserver_config(auto_compact_token_limit=50)
    engine = RecordingEngine()

    @tool("lookup", "look a thing up")
    async def lookup(args: Any) -> str:
        return "LOOKED_UP"

    # A tool call makes a second model request inside the fork's turn: Codex compacts
    # before it (the usage reported passed the limit).
    offline_model.script(Reply.function_call("lookup", {}), user_contains="STEP_2")
    async with AppServer.start(config) as server:
        results = [
            await run_codex_turn(
                params(prompt=f"STEP_{i}"), app_server=server, engine=engine, tools=[lookup]
            )
            for i in range(4)
        ]
    assert "thread_forked" in triggers(results[2])
    assert all(r.outcome is TurnOutcome.COMPLETED for r in results)
    assert sum(r.native_compactions for r in results) >= 1
    assert offline_model.compaction_requests()
    last = offline_model.turn_requests()[-1]
    # Re-projected: every earlier step as its own user item, no compaction summary.
    for i in range(3):
        assert last.user_messages.count(f"STEP_{i}") == 1
    assert not any("summary" in text.lower() for text in last.user_messages[:-1])


async def test_instructions_that_change_every_turn_reach_the_fork(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    # A fork inherits its base's initial context: the turn's own instructions (the host's and
    # the engine's addition, which may change every turn) travel into each fork.
    turn = iter(range(1, 100))

    def assemble(p: Any) -> AssembleResult:
        return AssembleResult(
            messages=list(p.messages),
            estimated_tokens=0,
            system_prompt_addition=f"ADDITION_{next(turn)}",
        )

    engine = RecordingEngine(responses={"assemble": assemble})
    for k, host in enumerate(("HOST_ONE", "HOST_ONE", "HOST_ONE", "HOST_TWO"), start=1):
        result = await run_codex_turn(
            params(prompt=f"ask {k}", extra_developer_instructions=host),
            app_server=appserver,
            engine=engine,
        )
        assert result.outcome is TurnOutcome.COMPLETED
    requests = offline_model.turn_requests()
    for k, request in enumerate(requests[1:], start=2):  # turns 2.. run in forks
        developer = " ".join(request.developer_parts)
        assert f"ADDITION_{k}" in developer
        assert f"ADDITION_{k - 1}" not in developer
    assert "HOST_ONE" in " ".join(requests[2].developer_parts)
    assert "HOST_TWO" in " ".join(requests[3].developer_parts)
    assert "HOST_ONE" not in " ".join(requests[3].developer_parts)


async def test_a_turn_without_tools_on_a_structured_session_keeps_the_conversation(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    @tool("lookup", "look a thing up")
    async def lookup(args: Any) -> str:
        return "x"

    engine = RecordingEngine()
    for prompt in ("REMEMBER_LISBON", "REMEMBER_PORTO"):
        await run_codex_turn(
            params(prompt=prompt), app_server=appserver, engine=engine, tools=[lookup]
        )
    heartbeat = await run_codex_turn(
        params(prompt="heartbeat"), app_server=appserver, engine=engine
    )
    assert heartbeat.thread_decision is not None
    assert heartbeat.thread_decision.action.value == "transient"
    assert "projected" in triggers(heartbeat)  # the form table chose the text frame
    framed = offline_model.turn_requests()[-1].user_messages[-1]
    assert CONTEXT_HEADER in framed
    assert "REMEMBER_LISBON" in framed
    assert "REMEMBER_PORTO" in framed
    # The binding keeps the tooled base.
    assert read_binding(params().session_file, session_id="session-s").fork_base  # type: ignore[union-attr]


async def test_engine_compaction_keeps_the_base_and_runs_no_native_compaction(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    from codex_turn import CompactSessionParams
    from codex_turn.harness.compaction import compact_codex_session_traced
    from codex_turn.harness.engine import CompactResult

    engine = RecordingEngine(
        owns_compaction=True, responses={"compact": CompactResult(ok=True, compacted=True)}
    )
    for prompt in ("REMEMBER_LISBON", "REMEMBER_PORTO"):
        await run_codex_turn(params(prompt=prompt), app_server=appserver, engine=engine)
    session_file = Path(params().session_file)
    base = bound_thread(session_file)
    run = await compact_codex_session_traced(
        CompactSessionParams(
            session_id="session-s",
            session_file=str(session_file),
            workspace_dir=str(params().workspace_dir),
            session_key="agent:main:session-s",
        ),
        app_server=appserver,
        engine=engine,
    )
    assert run.result.ok
    assert not offline_model.compaction_requests()  # the base was not compacted natively
    assert not run.projection_cleared  # the base's mark stays
    binding = read_binding(session_file, session_id="session-s")
    assert binding is not None
    assert binding.fork_base
    assert binding.thread_id == base
    broken = RecordingEngine(
        owns_compaction=True, failures={"assemble": RuntimeError("engine down")}
    )
    after = await run_codex_turn(
        params(prompt="which cities?"), app_server=appserver, engine=broken
    )
    assert "thread_forked" in triggers(after)  # the base was forked, never resumed
    request = offline_model.turn_requests()[-1]
    assert "REMEMBER_LISBON" in request.user_messages


async def test_a_session_that_loses_its_base_and_its_engine_keeps_the_conversation(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()
    for prompt in ("REMEMBER_LISBON", "REMEMBER_PORTO"):
        await run_codex_turn(params(prompt=prompt), app_server=appserver, engine=engine)
    session_file = Path(params().session_file)
    binding = read_binding(session_file, session_id="session-s")
    assert binding is not None
    write_binding(
        session_file, attrs.evolve(binding, thread_id="01a22b2a-0000-7000-8000-00000000beef")
    )
    # No engine any more, and the base is gone: a fresh thread seeded with the transcript.
    first = await run_codex_turn(params(prompt="which city one?"), app_server=appserver)
    assert first.outcome is TurnOutcome.COMPLETED
    assert first.thread_decision is not None
    assert first.thread_decision.reason == "fork-base-unusable-without-context"
    framed = offline_model.turn_requests()[-1].user_messages[-1]
    assert "REMEMBER_LISBON" in framed
    # ... which becomes the session's thread: the next turn resumes it, conversation intact.
    second = await run_codex_turn(params(prompt="which city two?"), app_server=appserver)
    assert second.thread_id == first.thread_id
    assert "REMEMBER_LISBON" in json.dumps(offline_model.turn_requests()[-1].user_messages)
    assert not read_binding(session_file, session_id="session-s").fork_base  # type: ignore[union-attr]


async def test_an_oversized_newest_message_falls_back_to_the_text_frame(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    huge = [{"role": "user", "content": "HUGE_START " + "word " * 20_000, "timestamp": 1}]
    engine = RecordingEngine(
        responses={"assemble": AssembleResult(messages=huge, estimated_tokens=1)}
    )
    with capture_logs() as records:
        result = await run_codex_turn(params(prompt="ask"), app_server=appserver, engine=engine)
    assert "projected" in triggers(result)
    assert "projected_as_items" not in triggers(result)
    assert any(r.get("reason") == "exceeds_cap" for r in records)
    framed = offline_model.turn_requests()[-1].user_messages[-1]
    assert "HUGE_START" in framed  # the frame cut inside the part, keeping its head
    assert len(framed) < 30_000


async def test_forks_carry_the_service_tier_and_survive_an_app_server_restart(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    engine = RecordingEngine()
    for prompt in ("REMEMBER_LISBON", "REMEMBER_PORTO"):
        result = await run_codex_turn(
            params(prompt=prompt, service_tier="flex"), app_server=appserver, engine=engine
        )
    assert "thread_forked" in triggers(result)
    assert offline_model.turn_requests()[-1].body.get("service_tier") == "flex"
    base = bound_thread(Path(params().session_file))
    client = appserver.current
    assert client is not None
    client.transport.kill()  # the process is gone: its forks with it
    with anyio.fail_after(10):
        while not client.closed:  # noqa: ASYNC110 - the client's own flag, no event to await
            await anyio.sleep(0.01)
    again = await run_codex_turn(
        params(prompt="which cities?", service_tier="flex"), app_server=appserver, engine=engine
    )
    assert again.outcome is TurnOutcome.COMPLETED, again.prompt_error
    assert "thread_forked" in triggers(again)
    request = offline_model.turn_requests()[-1]
    assert request.body.get("prompt_cache_key") == base
    assert "REMEMBER_LISBON" in request.user_messages


async def test_forks_are_released_and_codex_unloads_them(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    # An ephemeral fork cannot be deleted or archived; unsubscribed, Codex unloads it after
    # thread_unload_delay_secs (ours: FORK_UNLOAD_DELAY_S; 1 s here). Bound threads stay.
    from codex_turn.harness.appserver.config import FORK_UNLOAD_DELAY_S

    assert f"thread_unload_delay_secs = {FORK_UNLOAD_DELAY_S}" in (
        make_appserver_config().config_text()
    )
    config = make_appserver_config(extra_config={"thread_unload_delay_secs": 1})
    turn = iter(range(100))

    def assemble(p: Any) -> AssembleResult:
        # A new instruction every turn: no fork can be continued, each turn forks afresh.
        addition = f"ADDITION_{next(turn)}"
        return AssembleResult(
            messages=list(p.messages), estimated_tokens=0, system_prompt_addition=addition
        )

    engine = RecordingEngine(responses={"assemble": assemble})
    async with AppServer.start(config) as server:
        results = [
            await run_codex_turn(params(prompt=f"ask {k}"), app_server=server, engine=engine)
            for k in range(5)
        ]
        kept = results[-1].thread_id  # kept loaded for the session's next turn
        forks = {r.thread_id for r in results[1:]} - {kept}
        assert len(forks) == 3
        assert all("thread_forked" in triggers(r) for r in results[1:])
        loaded: set[str] = set(forks)
        with anyio.fail_after(15):
            while loaded & forks:  # polling Codex's own list
                await anyio.sleep(0.2)
                loaded = set((await server.request("thread/loaded/list", {}))["data"])
        assert kept in loaded
        # The session goes on: the next turn forks the (unloaded) base again.
        after = await run_codex_turn(params(prompt="ask more"), app_server=server, engine=engine)
        assert "thread_forked" in triggers(after)
        assert "ask 0" in offline_model.turn_requests()[-1].user_messages
