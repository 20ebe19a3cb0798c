"""The engine contract's later part, host side: capabilities checked at load, the prompt's
authority, model access for engines, the prompt cache facts, the richer assemble and compact
params, and the session hooks (reset, end, subagents, control) with the host's API for each.

Fast and in-process (the fake app-server, the recording engine, a scripted model server);
the real binary's side of model access is covered in ``test_engine_host_e2e.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from structlog.testing import capture_logs

from codex_turn import run_codex_turn
from codex_turn.harness.appserver import CodexTurnStatus, ThreadResult, ThreadSettings
from codex_turn.harness.appserver.types import ThreadInfo
from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session_traced
from codex_turn.harness.engine import (
    AbortSignal,
    AssembleResult,
    CompactResult,
    ContextEngineInfo,
    ControlCapabilities,
    ControlRequest,
    ControlResult,
    ControlUnsupported,
    EngineContractError,
    HostLlm,
    HostRequirementsUnmet,
    InvalidEngineResult,
    LlmCompleteFailed,
    LlmCompleteTimedOut,
    LlmMessage,
    LlmRequest,
    LlmRequestInvalid,
    SessionResetResult,
    SubagentSpawnPreparation,
    check_host_requirements,
    ensure_assemble_result,
    resolve_engine,
    runtime_llm,
)
from codex_turn.harness.host_llm import (
    MAX_REQUEST_CHARS,
    CodexHostLlm,
    check_request,
    host_capabilities,
    render_conversation,
)
from codex_turn.harness.runtime_context import harness_runtime_context, prompt_cache_observation
from codex_turn.harness.session_lifecycle import (
    end_codex_session,
    engine_control,
    reset_codex_session,
    run_subagent,
)
from codex_turn.harness.usage import Usage
from codex_turn.testing import RecordingEngine
from tests.support.fake_appserver import FakeAppServer
from tests.support.turns import temporary_session_file, turn_params

pytestmark = pytest.mark.anyio


@pytest.fixture
def session_file() -> Any:
    with temporary_session_file("engine-host-") as path:
        yield path


def _info(**fields: Any) -> ContextEngineInfo:
    return ContextEngineInfo(id="needy", name="needy", **fields)


# --- host capabilities, checked at load -----------------------------------------------------


def test_an_engine_needing_what_the_host_lacks_is_refused_with_what_is_missing() -> None:
    engine = RecordingEngine(info=_info(host_requirements=frozenset({"compact", "telepathy"})))
    with pytest.raises(HostRequirementsUnmet) as caught:
        resolve_engine(engine)
    assert caught.value.missing == ("telepathy",)
    assert caught.value.unknown == ("telepathy",)
    assert 'context engine "needy" needs what this host does not offer: telepathy' in str(
        caught.value
    )
    check_host_requirements("ok", frozenset({"compact", "runtime-llm-complete"}))  # offered


def test_a_malformed_requirement_declaration_is_an_invalid_info() -> None:
    engine = RecordingEngine(info=_info(host_requirements=["compact"]))  # type: ignore[arg-type]
    with pytest.raises(EngineContractError, match="host_requirements must be a set"):
        resolve_engine(engine)


async def test_a_host_that_cannot_lend_its_model_refuses_before_any_turn(
    session_file: str,
) -> None:
    # The fake app-server cannot run an ephemeral thread (no run_turn): no model to lend.
    fake = FakeAppServer()
    assert "runtime-llm-complete" not in host_capabilities(fake)
    engine = RecordingEngine(info=_info(host_requirements=frozenset({"runtime-llm-complete"})))
    with pytest.raises(HostRequirementsUnmet, match="runtime-llm-complete"):
        await run_codex_turn(turn_params(session_file, "hi"), app_server=fake, engine=engine)
    assert fake.calls == []
    assert engine.calls == []
    assert not await anyio.Path(session_file).exists()


# --- the prompt's authority -------------------------------------------------------------------


def test_prompt_authority_is_checked_and_defaults_to_the_host_fitting_the_assembly() -> None:
    assert ensure_assemble_result({"messages": []}, engine_id="e").prompt_authority == (
        "preassembly_may_overflow"
    )
    checked = ensure_assemble_result(
        {"messages": [], "promptAuthority": "assembled"}, engine_id="e"
    )
    assert checked.prompt_authority == "assembled"
    with pytest.raises(InvalidEngineResult, match="promptAuthority must be one of"):
        ensure_assemble_result({"messages": [], "promptAuthority": "mine"}, engine_id="e")


@pytest.mark.parametrize(
    ("authority", "fitted"), [("preassembly_may_overflow", True), ("assembled", False)]
)
async def test_an_assembly_with_the_prompts_authority_is_sent_unfitted(
    session_file: str, authority: str, fitted: bool
) -> None:
    big = [
        {"role": "user", "content": f"message {i}: " + "word " * 200, "timestamp": i}
        for i in range(60)
    ]
    assembly = AssembleResult(
        messages=big,
        estimated_tokens=500,
        prompt_authority=authority,  # type: ignore[arg-type]
    )
    fake = FakeAppServer()
    engine = RecordingEngine(responses={"assemble": assembly})
    await run_codex_turn(
        turn_params(session_file, "hi", context_token_budget=1000, projection_format="text"),
        app_server=fake,
        engine=engine,
    )
    (sent,) = fake.turn_inputs()
    assert ("message 0:" not in sent) is fitted  # fitted: the oldest are cut
    assert "message 59:" in sent
    # The assembly is under its declared budget: nothing to warn about here.


async def test_an_authoritative_assembly_over_its_budget_is_sent_and_reported(
    session_file: str,
) -> None:
    assembly = AssembleResult(messages=[], estimated_tokens=5000, prompt_authority="assembled")
    with capture_logs() as records:
        await run_codex_turn(
            turn_params(session_file, "hi", context_token_budget=1000),
            app_server=FakeAppServer(),
            engine=RecordingEngine(responses={"assemble": assembly}),
        )
    (warning,) = [
        r
        for r in records
        if r["event"] == "context engine assembly exceeds the budget it vouched for"
    ]
    assert (warning["estimated_tokens"], warning["token_budget"]) == (5000, 1000)


# --- the richer assemble params ------------------------------------------------------------


async def test_assemble_gets_the_hosts_facts_of_the_turn(session_file: str) -> None:
    engine = RecordingEngine()
    attempt = {"requestedModelId": "big-model", "fallbackReason": "quota", "degradedReason": "x"}
    params = turn_params(
        session_file, "hi", model="small-model", sandbox="read-only", runtime_attempt=attempt
    )
    await run_codex_turn(params, app_server=FakeAppServer(), engine=engine)
    await run_codex_turn(
        attrs.evolve(params, prompt="again"), app_server=FakeAppServer(), engine=engine
    )
    first, second = (call.params for call in engine.calls_to("assemble"))
    assert (second.model_id, second.provider_id) == ("small-model", "codex")
    assert (second.requested_model_id, second.fallback_reason) == ("big-model", "quota")
    assert (second.degraded_reason, second.sandboxed) == ("x", True)
    assert second.runtime_context["cwd"] == os.path.dirname(session_file)
    assert first.transcript_read_fence.message_count == 0
    fence = second.transcript_read_fence
    assert fence.message_count == len(second.messages) == 2  # the first turn, never this one
    assert fence.last_entry_id == second.messages[-1]["idempotencyKey"]


# --- model access -------------------------------------------------------------------------


def _request(**fields: Any) -> LlmRequest:
    values: dict[str, Any] = {
        "messages": (LlmMessage("user", "summarise this"),),
        "purpose": "summary",
        **fields,
    }
    return LlmRequest(**values)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"purpose": "gossip"}, "purpose must be one of"),
        ({"messages": ()}, "no messages"),
        ({"messages": (LlmMessage("assistant", "hi"),)}, "the last message must be the user's"),
        ({"messages": (LlmMessage("system", "x"),)}, "must be a user or assistant"),  # type: ignore[arg-type]
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"temperature": 3.0}, "temperature must be a number from 0 to 2"),
        ({"model": ""}, "model must be a non-empty string"),
        (
            {"messages": (LlmMessage("user", "x" * (MAX_REQUEST_CHARS + 1)),)},
            "more than 400000",
        ),
    ],
)
def test_a_malformed_model_request_is_refused_before_anything_is_sent(
    fields: dict[str, Any], problem: str
) -> None:
    with pytest.raises(LlmRequestInvalid, match=problem):
        check_request(_request(**fields))


def test_a_camelcase_request_is_accepted_and_a_conversation_is_quoted() -> None:
    checked = check_request(
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            "systemPrompt": "be brief",
            "maxTokens": 10,
            "purpose": "summary",
        }
    )
    assert (checked.system_prompt, checked.max_tokens) == ("be brief", 10)
    assert render_conversation(checked.messages) == (
        "<conversation>\n[user]\na\n\n[assistant]\nb\n</conversation>\n\nc"
    )


@attrs.define
class ScriptedModel:
    """An app-server stand-in for :class:`CodexHostLlm`: one answer, recorded calls."""

    text: str = "the answer"
    outcome: CodexTurnStatus = CodexTurnStatus.COMPLETED
    started: list[tuple[ThreadSettings, bool | None]] = attrs.Factory(list)
    inputs: list[str] = attrs.Factory(list)
    released: list[str] = attrs.Factory(list)
    hang: bool = False

    async def start_thread(
        self, settings: ThreadSettings, *, config: Any = None, ephemeral: bool | None = None
    ) -> ThreadResult:
        self.started.append((settings, ephemeral))
        return ThreadResult(thread=ThreadInfo(id=f"eph-{len(self.started)}"), model="m")

    async def run_turn(self, thread_id: str, input: str, **kwargs: Any) -> Any:
        self.inputs.append(input)
        if self.hang:
            await anyio.sleep_forever()
        return attrs.make_class("R", ["outcome", "final_text", "error_info"])(
            self.outcome, self.text, None
        )

    def forget_thread(self, thread_id: str) -> None:
        self.released.append(thread_id)


async def test_the_host_model_runs_one_ephemeral_locked_down_thread_per_call() -> None:
    server = ScriptedModel(text="x" * 100)
    llm = CodexHostLlm(server, model="session-model", cwd="/w")  # type: ignore[arg-type]
    assert isinstance(llm, HostLlm)
    completion = await llm.complete(_request(system_prompt="be brief", max_tokens=5))
    assert (completion.text, completion.truncated) == ("x" * 20, True)
    assert completion.model == "session-model"
    ((settings, ephemeral),) = server.started
    assert ephemeral is True
    assert (settings.sandbox, settings.approval_policy, settings.tools) == (
        "read-only",
        "never",
        None,
    )
    assert settings.developer_instructions is not None
    assert settings.developer_instructions.endswith("be brief")
    assert server.inputs == ["summarise this"]
    assert server.released == ["eph-1"]


@pytest.mark.parametrize(
    ("outcome", "error"),
    [(CodexTurnStatus.TIMED_OUT, LlmCompleteTimedOut), (CodexTurnStatus.FAILED, LlmCompleteFailed)],
)
async def test_a_model_that_does_not_answer_raises_a_typed_error_and_the_thread_is_released(
    outcome: CodexTurnStatus, error: type[Exception]
) -> None:
    server = ScriptedModel(outcome=outcome)
    with pytest.raises(error):
        await CodexHostLlm(server, timeout=1).complete(_request())  # type: ignore[arg-type]
    assert server.released == ["eph-1"]


async def test_a_cancelled_completion_releases_its_thread() -> None:
    server = ScriptedModel(hang=True)
    with anyio.move_on_after(0.05) as scope:
        await CodexHostLlm(server).complete(_request())  # type: ignore[arg-type]
    assert scope.cancelled_caught
    assert server.released == ["eph-1"]


async def test_a_turn_lends_the_model_only_where_an_ephemeral_thread_can_run(
    session_file: str,
) -> None:
    engine = RecordingEngine()
    await run_codex_turn(turn_params(session_file, "hi"), app_server=FakeAppServer(), engine=engine)
    context = engine.only_call("after_turn").params.runtime_context
    assert runtime_llm(context) is None
    assert "llm" not in context
    lent = harness_runtime_context(
        session_key="k",
        model=None,
        auth_profile_id=None,
        workspace_dir="/w",
        token_budget=None,
        cwd="/w",
        llm=CodexHostLlm(ScriptedModel()),  # type: ignore[arg-type]
    )
    assert runtime_llm(lent) is lent["llm"]
    assert lent["cwd"] == "/w"


# --- prompt cache facts -------------------------------------------------------------------


def test_the_prompt_cache_facts_say_retention_observation_and_expiry() -> None:
    usage = Usage.from_codex({"inputTokens": 1000, "cachedInputTokens": 950, "outputTokens": 5})
    context = harness_runtime_context(
        session_key="k",
        model=None,
        auth_profile_id=None,
        workspace_dir="/w",
        token_budget=None,
        usage=usage,
    )
    cache = context["promptCache"]
    assert (cache["retention"], cache["observation"]) == ("short", "hit")
    assert cache["lastCallUsage"]["cacheRead"] == 950
    assert isinstance(cache["expiresAt"], int)
    assert cache["expiresAt"] > 1_700_000_000_000
    partial = Usage.from_codex({"inputTokens": 1000, "cachedInputTokens": 100})
    miss = Usage.from_codex({"inputTokens": 1000, "cachedInputTokens": 0})
    assert prompt_cache_observation(partial) == "partial"
    assert prompt_cache_observation(miss) == "miss"
    assert prompt_cache_observation(Usage.from_codex({"inputTokens": 5})) == "unknown"


# --- compaction: force reason, preflight, abort ---------------------------------------------


class SlowCompactor:
    """An owning engine whose compact waits for its abort signal (or forever)."""

    info = ContextEngineInfo(id="slow", name="slow", owns_compaction=True)

    def __init__(self) -> None:
        self.params: list[Any] = []

    async def ingest(self, params: Any) -> Any:
        raise AssertionError("not called")

    async def assemble(self, params: Any) -> AssembleResult:
        return AssembleResult(messages=[], estimated_tokens=0)

    async def compact(self, params: Any) -> CompactResult:
        self.params.append(params)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_an_aborted_engine_compaction_ends_the_run_without_native(tmp_path: Path) -> None:
    engine = SlowCompactor()
    signal = AbortSignal()
    fake = FakeAppServer()
    params = CompactSessionParams(
        session_id="s",
        session_file=tmp_path / "s.jsonl",
        preflight_trigger="budget",
        abort_signal=signal,
    )

    async def abort_soon() -> None:
        await anyio.sleep(0.05)
        signal.abort("user pressed stop")

    async with anyio.create_task_group() as group:
        group.start_soon(abort_soon)
        run = await compact_codex_session_traced(params, app_server=fake, engine=engine)
    (sent,) = engine.params
    assert (sent.force_reason, sent.preflight_trigger, sent.abort_signal) == (
        "manual",
        "budget",
        signal,
    )
    assert run.path == ("IDLE", "ENGINE_COMPACTING", "REPORTED")
    assert run.triggers == ("started", "engine_aborted")
    assert run.result.ok is False
    assert "aborted (user pressed stop)" in (run.result.reason or "")
    assert fake.calls_to("compact_thread") == []


# --- reset, end, subagents, control -----------------------------------------------------------


class Hooked(RecordingEngine):
    """The recording engine with the later hooks (recorded, answers scripted)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hooks: list[tuple[str, Any]] = []
        self.reset_answer: Any = SessionResetResult(action="archived")

    async def before_session_reset(self, params: Any) -> Any:
        self.hooks.append(("before_session_reset", params))
        if isinstance(self.reset_answer, Exception):
            raise self.reset_answer
        return self.reset_answer

    async def session_end(self, params: Any) -> None:
        self.hooks.append(("session_end", params))

    async def prepare_subagent_spawn(self, params: Any) -> SubagentSpawnPreparation:
        self.hooks.append(("prepare_subagent_spawn", params))
        return SubagentSpawnPreparation(system_prompt_addition="PARENT CONTEXT")

    async def on_subagent_ended(self, params: Any) -> None:
        self.hooks.append(("on_subagent_ended", params))

    def control_capabilities(self) -> ControlCapabilities:
        return ControlCapabilities(actions=frozenset({"status"}))

    async def control(self, request: ControlRequest) -> Any:
        return {"ok": True, "action": request.action, "summary": "fine"}


async def test_a_reset_tells_the_engine_first_then_forgets_the_thread(session_file: str) -> None:
    engine = Hooked()
    await run_codex_turn(turn_params(session_file, "hi"), app_server=FakeAppServer(), engine=engine)
    report = await reset_codex_session(
        session_file, session_id="s-1", session_key="agent:main:s-1", engine=engine, reason="new"
    )
    assert (report.engine, report.binding_removed) == ("archived", True)
    ((name, params),) = engine.hooks
    assert (name, params.session_key, params.reason) == (
        "before_session_reset",
        "agent:main:s-1",
        "new",
    )
    engine.reset_answer = RuntimeError("store down")
    again = await reset_codex_session(session_file, session_id="s-1", engine=engine)
    assert (again.engine, again.binding_removed) == ("failed", False)  # still reset
    engine.reset_answer = {"action": "shredded"}
    assert (await reset_codex_session(session_file, session_id="s-1", engine=engine)).engine == (
        "failed"
    )
    plain = await reset_codex_session(session_file, session_id="s-1", engine=RecordingEngine())
    assert plain.engine == "not_supported"
    assert await end_codex_session(session_file, session_id="s-1", engine=engine) == "ended"
    assert await end_codex_session(session_file, session_id="s-1", engine=None) == "no_engine"


async def test_a_subagent_is_seeded_by_the_engine_and_its_answer_folded_back(
    session_file: str,
) -> None:
    engine = Hooked()
    fake = FakeAppServer()
    parent = turn_params(session_file, "parent", extra_developer_instructions="BASE")
    child_file = os.path.join(os.path.dirname(session_file), "child.jsonl")
    run = await run_subagent(
        parent,
        task="look into it",
        child_session_id="c-1",
        child_session_file=child_file,
        app_server=fake,
        engine=engine,
    )
    assert (run.outcome, run.folded, run.result_text) == ("completed", True, "Done.")
    (start,) = fake.calls_to("start_thread")
    assert "BASE" in start.args["developer_instructions"]
    assert "PARENT CONTEXT" in start.args["developer_instructions"]
    assert fake.turn_inputs() == ["look into it"]
    names = [name for name, _ in engine.hooks]
    assert names == ["prepare_subagent_spawn", "on_subagent_ended"]
    ended = engine.hooks[1][1]
    assert (ended.child_session_key, ended.outcome, ended.result_text) == (
        "agent:main:s-1:subagent:c-1",
        "completed",
        "Done.",
    )
    assert await anyio.Path(child_file).exists()

    async def cannot_start(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no room")

    failed = await run_subagent(
        parent,
        task="t",
        child_session_id="c-2",
        child_session_file=child_file,
        app_server=fake,
        engine=engine,
        run_turn=cannot_start,
    )
    assert (failed.outcome, failed.turn, failed.folded) == ("spawn_failed", None, True)
    assert engine.hooks[-1][1].outcome == "spawn_failed"


async def test_control_answers_declared_actions_and_refuses_others() -> None:
    engine = Hooked()
    result = await engine_control(engine, ControlRequest(action="status"))
    assert result == ControlResult(ok=True, action="status", summary="fine")
    with pytest.raises(ControlUnsupported, match="cannot rotate: it offers status"):
        await engine_control(engine, ControlRequest(action="rotate"))
    with pytest.raises(ControlUnsupported, match="it offers no control actions"):
        await engine_control(RecordingEngine(), ControlRequest(action="status"))
