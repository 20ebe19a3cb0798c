"""Model access for engines and a subagent, through the REAL ``codex app-server``.

One session of two turns whose engine asks the host's model for a summary after each turn
(``runtime_context["llm"]``), then a subagent the engine seeds. What is asserted is what the
binary sent to the model and what the session kept: each completion ran on an ephemeral thread
of its own (its own prompt cache key, the engine's system prompt, none of Codex's tools) and
was answered by
the offline model; the session's own thread saw none of it, was resumed by the second turn,
and its transcript holds the turns only; nothing of a request or an answer reached the logs;
the child ran on a thread of its own with the engine's seed in its instructions, and its answer
came back to the engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
from structlog.testing import capture_logs

from codex_turn import AppServer, TurnParams, run_codex_turn
from codex_turn.harness.binding import read_binding
from codex_turn.harness.engine import (
    AssembleResult,
    CompactResult,
    ContextEngineInfo,
    ContextProjection,
    IngestResult,
    LlmMessage,
    LlmRequest,
    SubagentSpawnPreparation,
    runtime_llm,
)
from codex_turn.harness.session import load_session_messages
from codex_turn.harness.session_lifecycle import run_subagent
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

ASKED = "EXCERPT-7f3a to summarise"
SYSTEM = "SYSTEM-91c2: you write summaries"
ANSWER = "SUMMARY-55d0"
SEED = "SEED-0b6e parent context"
TASK = "CHILD-TASK-3e1d: check it"


class AskingEngine:
    """Keeps nothing; after each turn of the parent asks the host's model for a summary."""

    info = ContextEngineInfo(
        id="asking",
        name="asking",
        host_requirements=frozenset({"runtime-llm-complete", "subagents"}),
    )

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.ended: list[Any] = []

    async def ingest(self, params: Any) -> IngestResult:
        return IngestResult(ingested=False)

    async def assemble(self, params: Any) -> AssembleResult:
        # One epoch: the session keeps its thread from turn to turn.
        return AssembleResult(
            messages=list(params.messages),
            estimated_tokens=0,
            context_projection=ContextProjection(mode="thread_bootstrap", epoch="one"),
        )

    async def compact(self, params: Any) -> CompactResult:
        return CompactResult(ok=True, compacted=False)

    async def after_turn(self, params: Any) -> None:
        if params.session_id != "parent":
            return
        llm = runtime_llm(params.runtime_context)
        assert llm is not None
        completion = await llm.complete(
            LlmRequest(
                messages=(LlmMessage("user", ASKED),),
                system_prompt=SYSTEM,
                purpose="summary",
                max_tokens=100,
            )
        )
        self.answers.append(completion.text)

    async def prepare_subagent_spawn(self, params: Any) -> SubagentSpawnPreparation:
        return SubagentSpawnPreparation(system_prompt_addition=SEED)

    async def on_subagent_ended(self, params: Any) -> None:
        self.ended.append(params)


async def test_engines_reach_the_model_on_ephemeral_threads_and_run_a_subagent(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path, tmp_path: Path
) -> None:
    offline_model.script(Reply.fixed(ANSWER), user_contains=ASKED, times=2)
    offline_model.script(Reply.fixed("CHILD-ANSWER"), user_contains=TASK)
    engine = AskingEngine()
    session_file = tmp_path / "sessions" / "parent.jsonl"
    params = TurnParams(
        session_id="parent",
        session_file=session_file,
        workspace_dir=workspace,
        prompt="PROMPT-1 hello",
        projection_format="text",
    )
    with capture_logs() as records:
        first = await run_codex_turn(params, app_server=appserver, engine=engine)
        second = await run_codex_turn(
            attrs.evolve(params, prompt="PROMPT-2 again"), app_server=appserver, engine=engine
        )
        child = await run_subagent(
            params,
            task=TASK,
            child_session_id="child",
            child_session_file=tmp_path / "sessions" / "child.jsonl",
            app_server=appserver,
            engine=engine,
        )

    # The engine was answered by the model, once per turn.
    assert engine.answers == [ANSWER, ANSWER]
    requests = offline_model.turn_requests()
    asked = [r for r in requests if ASKED in r.last_user_text]
    assert len(asked) == 2
    session_thread = first.thread_id
    assert second.thread_id == session_thread  # resumed: the session's thread is its own
    keys = {r.body.get("prompt_cache_key") for r in asked}
    assert len(keys) == 2
    assert session_thread not in keys  # one ephemeral thread per call
    for request in asked:
        assert any(SYSTEM in part for part in request.developer_parts)
        # Codex's own tools are off: only its user-input request is left (declined by the host).
        assert set(request.tool_names) <= {"request_user_input"}
    # The session's own requests never carried what the engine asked, nor its answer.
    own = [r for r in requests if r.body.get("prompt_cache_key") == session_thread]
    assert len(own) == 2
    for request in own:
        text = json.dumps(request.body)
        assert ASKED not in text
        assert SYSTEM not in text
        assert ANSWER not in text
    # The transcript holds the two turns only; the ephemeral threads are not remembered.
    kept = json.dumps(list(load_session_messages(session_file)), default=str)
    assert "PROMPT-2 again" in kept
    assert ASKED not in kept
    assert ANSWER not in kept
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.thread_id == session_thread
    assert not keys & set(appserver.remembered_threads)
    # The subagent ran on its own thread, seeded by the engine, and its answer came back.
    assert child.outcome == "completed"
    assert child.result_text == "CHILD-ANSWER"
    (told,) = engine.ended
    assert (told.outcome, told.result_text) == ("completed", "CHILD-ANSWER")
    (child_request,) = [r for r in requests if TASK in r.last_user_text]
    assert any(SEED in part for part in child_request.developer_parts)
    assert child.turn is not None
    assert child.turn.thread_id not in (session_thread, *keys)
    assert read_binding(session_file) == binding  # the parent's thread untouched
    # Nothing of a request or an answer reached the logs.
    logged = "\n".join(repr(record) for record in records)
    for secret in (ASKED, SYSTEM, ANSWER, SEED, "CHILD-ANSWER"):
        assert secret not in logged
    assert any(r["event"] == "host llm completion" for r in records)
