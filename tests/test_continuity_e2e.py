"""The conversation survives what Codex loses, against the real binary.

A session's transcript holds every word; a Codex thread holds a copy that can be lost (another
process with its own Codex home, a worker elsewhere, a deleted rollout), outgrown (a
transient turn, a turn that ran elsewhere) or overflowed. Each test asserts on what the
offline model was sent: the turn after the loss carries the earlier turns, nothing reaches
the model twice, and the transcript holds every prompt once.
"""

from __future__ import annotations

import base64
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from codex_turn import AppServer, AppServerConfig, TurnOutcome, TurnParams, run_codex_turn
from codex_turn.harness.appserver import tool
from codex_turn.harness.engine.contract import AssembleResult, ContextProjection
from codex_turn.harness.idempotency import TurnAlreadyCompleted
from codex_turn.harness.session import load_session_messages, mirror_turn
from codex_turn.testing import OFFLINE_PNG, OfflineModel, RecordingEngine, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]


@pytest.fixture
def params(tmp_path: Path, workspace: Path) -> Callable[..., TurnParams]:
    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "session-c",
            "session_key": "agent:main:session-c",
            "session_file": tmp_path / "session-c.jsonl",
            "workspace_dir": workspace,
            "prompt": "hello",
        }
        values.update(overrides)
        return TurnParams(**values)

    return make


def sent_text(request: Any) -> str:
    """Everything the model was sent as conversation (user and assistant text)."""
    return "\n".join([*request.user_messages, *request.assistant_messages])


def times_sent(request: Any, prompt: str) -> int:
    """How many times ``prompt`` reached the model in ``request`` (replies are
    :func:`answer`, which never contains a prompt)."""
    return sent_text(request).count(prompt)


def answer(prompt: str) -> str:
    return f"ANSWER-{prompt.upper()}"


async def turn(model: OfflineModel, prompt: str, params: TurnParams, **kwargs: Any) -> Any:
    """One turn whose reply is :func:`answer` (scripted for its prompt)."""
    model.script(Reply.fixed(answer(prompt)), user_contains=prompt)
    return await run_codex_turn(params, **kwargs)


def prompts_in_transcript(path: Path, text: str) -> int:
    """How many user messages of the transcript say exactly ``text``."""
    count = 0
    for message in load_session_messages(path):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        parts = (
            [content]
            if isinstance(content, str)
            else [part.get("text") for part in content or () if hasattr(part, "get")]
        )
        count += parts.count(text)
    return count


def _bootstrap_engine() -> RecordingEngine:
    """An engine that projects its assembly once per epoch (thread_bootstrap)."""

    def assemble(params: Any) -> AssembleResult:
        return AssembleResult(
            messages=list(params.messages),
            estimated_tokens=len(params.messages),
            context_projection=ContextProjection(mode="thread_bootstrap", epoch="epoch-1"),
        )

    return RecordingEngine(engine_id="bootstrap-engine", responses={"assemble": assemble})


ENGINES: dict[str, Callable[[], RecordingEngine | None]] = {
    "no-engine": lambda: None,
    "thread-bootstrap-engine": _bootstrap_engine,
    "per-turn-engine": lambda: RecordingEngine(engine_id="per-turn-engine"),
}


@pytest.mark.parametrize("kind", sorted(ENGINES))
async def test_a_codex_home_without_the_thread_continues_with_the_conversation(
    kind: str,
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    tmp_path: Path,
) -> None:
    engine = ENGINES[kind]()
    text = "text" if kind == "per-turn-engine" else "structured"
    async with AppServer.start(make_appserver_config()) as first:
        for prompt in ("alpha-one", "alpha-two"):
            done = await turn(
                offline_model,
                prompt,
                params(prompt=prompt, projection_format=text),
                app_server=first,
                engine=engine,
            )
            assert done.outcome is TurnOutcome.COMPLETED
    # Another process with its own Codex home: it has never seen the session's thread.
    async with AppServer.start(make_appserver_config()) as second:
        moved = await turn(
            offline_model,
            "after-the-move",
            params(prompt="after-the-move", projection_format=text),
            app_server=second,
            engine=engine,
        )
        assert moved.outcome is TurnOutcome.COMPLETED
        request = offline_model.turn_requests()[-1]
        assert times_sent(request, "alpha-one") == 1
        assert times_sent(request, "alpha-two") == 1
        assert times_sent(request, answer("alpha-two")) == 1  # the replies too
        later = await turn(
            offline_model,
            "later",
            params(prompt="later", projection_format=text),
            app_server=second,
            engine=engine,
        )
        assert later.outcome is TurnOutcome.COMPLETED
        request = offline_model.turn_requests()[-1]
        # The next turn carries the earlier turns once: nothing is both in the thread's
        # native history and in what is projected.
        assert times_sent(request, "alpha-one") == 1
        assert times_sent(request, "after-the-move") == 1
    session = tmp_path / "session-c.jsonl"
    for prompt in ("alpha-one", "alpha-two", "after-the-move", "later"):
        assert prompts_in_transcript(session, prompt) == 1, prompt


async def test_a_transient_turn_reaches_the_bound_thread_once(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    @tool(name="lookup", description="Look something up.")
    async def lookup(query: str) -> str:
        return f"found {query}"

    with capture_logs() as records:
        first = await turn(
            offline_model,
            "tooled-one",
            params(prompt="tooled-one"),
            app_server=appserver,
            tools=[lookup],
        )
        # No tools: a thread for this turn only, which carries the conversation.
        heartbeat = await turn(
            offline_model, "heartbeat-two", params(prompt="heartbeat-two"), app_server=appserver
        )
        assert heartbeat.thread_id != first.thread_id
        assert times_sent(offline_model.turn_requests()[-1], "tooled-one") == 1
        # Back on the tooled thread: it lacks the transient turn, which goes with the prompt.
        third = await turn(
            offline_model,
            "tooled-three",
            params(prompt="tooled-three"),
            app_server=appserver,
            tools=[lookup],
        )
        assert third.thread_id == first.thread_id
        request = offline_model.turn_requests()[-1]
        assert times_sent(request, "heartbeat-two") == 1
        assert times_sent(request, "tooled-one") == 1
        fourth = await turn(
            offline_model,
            "tooled-four",
            params(prompt="tooled-four"),
            app_server=appserver,
            tools=[lookup],
        )
        assert fourth.thread_id == first.thread_id
        request = offline_model.turn_requests()[-1]
        # Now it holds it natively: never projected again.
        assert times_sent(request, "heartbeat-two") == 1
        assert times_sent(request, "tooled-three") == 1
    resumed = [r for r in records if r["event"] == "codex app-server thread resumed"]
    assert [r["uncovered"] for r in resumed] == [2, 0]


@pytest.mark.parametrize("kind", sorted(ENGINES))
async def test_an_overflow_is_retried_once_on_a_fresh_thread_with_the_conversation(
    kind: str,
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    tmp_path: Path,
) -> None:
    engine = ENGINES[kind]()
    first = await turn(
        offline_model,
        "before-overflow",
        params(prompt="before-overflow"),
        app_server=appserver,
        engine=engine,
    )
    offline_model.script(Reply.context_length_exceeded(), user_contains="overflowing")
    retried = await turn(
        offline_model,
        "overflowing",
        params(prompt="overflowing"),
        app_server=appserver,
        engine=engine,
    )
    assert retried.outcome is TurnOutcome.COMPLETED
    assert retried.thread_id != first.thread_id
    assert retried.assistant_text == answer("overflowing")
    request = offline_model.turn_requests()[-1]
    assert times_sent(request, "before-overflow") == 1
    assert times_sent(request, "overflowing") == 1  # the prompt, not also as context
    # A second overflow on the retry ends the turn, typed; the prompt is kept.
    offline_model.script(Reply.context_length_exceeded(), user_contains="too-long", times=2)
    failed = await turn(
        offline_model, "too-long", params(prompt="too-long"), app_server=appserver, engine=engine
    )
    assert failed.outcome is TurnOutcome.CONTEXT_OVERFLOW
    session = tmp_path / "session-c.jsonl"
    for prompt in ("before-overflow", "overflowing", "too-long"):
        assert prompts_in_transcript(session, prompt) == 1, prompt


OPS = ("turn", "transient", "lose-home", "overflow")


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.sampled_from(OPS), min_size=3, max_size=6))
def test_every_recent_message_reaches_the_next_request_exactly_once(
    ops: list[str],
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    workspace: Path,
) -> None:
    """Random sequences of turns, transient turns, lost Codex homes and overflows: after each
    turn, the prompt and reply of each of the session's earlier turns reached that turn's
    model request exactly once (the conversation is short: nothing is cut by the cap)."""
    with tempfile.TemporaryDirectory() as scratch:
        session = Path(scratch) / "session.jsonl"

        @tool(name="lookup", description="Look something up.")
        async def lookup(query: str) -> str:
            return f"found {query}"

        async def run() -> None:
            done: list[str] = []
            homes: list[list[tuple[int, str]]] = [[]]  # the ops each Codex home runs
            for index, op in enumerate(ops):
                if op == "lose-home":
                    homes.append([])
                else:
                    homes[-1].append((index, op))
            for home in homes:
                async with AppServer.start(make_appserver_config()) as server:
                    for index, op in home:
                        prompt = f"prompt-{index:02d}-end"
                        if op == "overflow":
                            offline_model.script(
                                Reply.context_length_exceeded(), user_contains=prompt
                            )
                        params = TurnParams(
                            session_id="session-p",
                            session_file=session,
                            workspace_dir=workspace,
                            prompt=prompt,
                        )
                        tools = [] if op == "transient" else [lookup]
                        result = await turn(
                            offline_model, prompt, params, app_server=server, tools=tools
                        )
                        assert result.outcome is TurnOutcome.COMPLETED, (ops, index)
                        request = offline_model.turn_requests()[-1]
                        for earlier in done:
                            assert times_sent(request, earlier) == 1, (ops, index, earlier)
                            assert times_sent(request, answer(earlier)) == 1, (ops, index)
                        assert times_sent(request, prompt) == 1, (ops, index)
                        done.append(prompt)
            for prompt in done:
                assert prompts_in_transcript(session, prompt) == 1, (ops, prompt)

        anyio.run(run)


@pytest.mark.parametrize("share", [None, 1e-6])
async def test_a_thread_that_fills_its_share_of_the_window_rotates_with_the_conversation(
    share: float | None,
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    first = await turn(
        offline_model,
        "small-one",
        params(prompt="small-one", native_history_share=share),
        app_server=appserver,
    )
    loaded = appserver.loaded_thread(first.thread_id or "")
    assert loaded is not None
    assert loaded.native_tokens  # Codex reported the usage
    assert loaded.context_window
    second = await turn(
        offline_model,
        "small-two",
        params(prompt="small-two", native_history_share=share),
        app_server=appserver,
    )
    assert second.outcome is TurnOutcome.COMPLETED
    assert second.thread_decision is not None
    if share is None:
        assert second.thread_id == first.thread_id
    else:
        assert second.thread_id != first.thread_id
        assert second.thread_decision.reason == "native-thread-oversized"
    request = offline_model.turn_requests()[-1]
    assert times_sent(request, "small-one") == 1
    assert times_sent(request, answer("small-one")) == 1


async def test_images_in_the_transcript_reach_a_fresh_thread_with_the_conversation(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    tmp_path: Path,
) -> None:
    # A host's transcript whose earlier turn carried an image (pi's image block).
    data = base64.b64encode(OFFLINE_PNG).decode()
    picture = {"type": "image", "data": data, "mimeType": "image/png"}
    session = tmp_path / "session-c.jsonl"
    mirror_turn(
        session,
        [
            {"role": "user", "content": [{"type": "text", "text": "see-this"}, picture]},
            {"role": "assistant", "content": [{"type": "text", "text": "SEEN"}]},
        ],
        scope="host",
        identities=["u1", "a1"],
        session_id="session-c",
        cwd=str(tmp_path),
    )
    done = await turn(
        offline_model, "what-was-it", params(prompt="what-was-it"), app_server=appserver
    )
    assert done.outcome is TurnOutcome.COMPLETED
    request = offline_model.turn_requests()[-1]
    assert times_sent(request, "see-this") == 1
    images = [
        part["image_url"]
        for item in request.input_items
        if item.get("role") == "user"
        for part in item.get("content", [])
        if part.get("type") == "input_image"
    ]
    assert images == [f"data:image/png;base64,{data}"]


async def test_the_hosts_message_id_decides_a_repeat_not_the_words(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    tmp_path: Path,
) -> None:
    def said(message_id: str) -> TurnParams:
        return params(prompt="yes", runtime_attempt={"currentMessageId": message_id})

    first = await turn(offline_model, "yes", said("m-1"), app_server=appserver)
    assert first.outcome is TurnOutcome.COMPLETED
    # The same message delivered again is the same turn: its recorded reply, no new turn.
    with pytest.raises(TurnAlreadyCompleted):
        await run_codex_turn(said("m-1"), app_server=appserver)
    # The same words in a new message are a new turn; the earlier "yes" is its context.
    again = await turn(offline_model, "yes", said("m-2"), app_server=appserver)
    assert again.outcome is TurnOutcome.COMPLETED
    assert len(offline_model.turn_requests()) == 2
    assert prompts_in_transcript(tmp_path / "session-c.jsonl", "yes") == 2
