"""What a turn does not let its inputs break: careless engines (editing what they were given,
hanging in compaction, raising a BaseException), bad params, and transcripts or sidecars that
cannot take the turn. In-process fake app-server.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.fake_appserver import FakeAppServer
from support.recording_engine import RecordingEngine
from support.transcripts import FIXTURES, transcript_texts, with_deep_entry
from support.turns import turn_params

from codex_turn import (
    AssembleResult,
    CompactResult,
    InvalidTurnParams,
    TurnOutcome,
    TurnParams,
    run_codex_turn,
)
from codex_turn._json import MAX_JSON_DEPTH
from codex_turn.engines import SqliteContextEngine
from codex_turn.frozen import FrozenDict, FrozenList, freeze, thaw
from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session_traced
from codex_turn.harness.session import clear_session_cache, load_session_messages

pytestmark = pytest.mark.anyio


def params(session_file: str, prompt: str, **overrides: Any) -> TurnParams:
    """Like ``support.turns.turn_params``, but with no session key."""
    return turn_params(session_file, prompt, session_key=None, **overrides)


# --- 8: an engine that edits what it was given cannot corrupt the shared history ------------


async def test_an_engine_editing_messages_in_place_cannot_corrupt_the_history(
    session_file: str,
) -> None:
    # Before: the edits landed in the process-wide read cache and compounded every turn.
    def vandal(p: Any) -> AssembleResult:
        for message in p.messages:
            message["content"] = "VANDALISED"
        return AssembleResult(messages=list(p.messages), estimated_tokens=1)

    server = FakeAppServer()
    await run_codex_turn(params(session_file, "first words"), app_server=server)
    engine = RecordingEngine(engine_id="vandal", responses={"assemble": vandal})
    for prompt in ("second", "third"):
        result = await run_codex_turn(
            params(session_file, prompt), app_server=server, engine=engine
        )
        assert result.outcome is TurnOutcome.COMPLETED
        assert "assemble_failed" in [e.trigger for e in result.trace]  # a logged fallback
    seen = [call.params.messages for call in engine.calls_to("assemble")]
    assert all("VANDALISED" not in json.dumps(messages) for messages in seen)
    assert seen[-1][0]["content"] == "first words"
    on_disk = [m.get("content") for m in load_session_messages(session_file)]
    assert "first words" in on_disk


async def test_an_engine_that_copies_first_may_edit_its_copy(session_file: str) -> None:
    def careful(p: Any) -> AssembleResult:
        mine = copy.deepcopy(p.messages)
        for message in mine:
            message["content"] = "edited copy"
        return AssembleResult(messages=mine, estimated_tokens=1)

    server = FakeAppServer()
    await run_codex_turn(params(session_file, "first words"), app_server=server)
    engine = RecordingEngine(engine_id="careful", responses={"assemble": careful})
    result = await run_codex_turn(params(session_file, "second"), app_server=server, engine=engine)
    assert "assembled" in [e.trigger for e in result.trace]
    assert "edited copy" in server.turn_inputs()[-1]
    assert load_session_messages(session_file)[0].get("content") == "first words"


def test_frozen_values_refuse_every_mutation_and_copy_to_plain_values() -> None:
    frozen = freeze({"role": "user", "content": [{"type": "text", "text": "x"}]})
    assert isinstance(frozen, dict)
    assert json.loads(json.dumps(frozen)) == thaw(frozen)
    mutations = [
        lambda: frozen.__setitem__("role", "x"),
        lambda: frozen.update(role="x"),
        lambda: frozen.pop("role"),
        lambda: frozen["content"].append({}),
        lambda: frozen["content"][0].__setitem__("text", "y"),
        lambda: frozen["content"].sort(),
    ]
    for mutate in mutations:
        with pytest.raises(TypeError, match="read-only"):
            mutate()
    plain = copy.deepcopy(frozen)
    assert type(plain) is dict
    assert type(plain["content"]) is list
    plain["content"][0]["text"] = "y"
    assert frozen["content"][0]["text"] == "x"
    assert isinstance(freeze(frozen), FrozenDict)


def test_freezing_and_thawing_take_any_depth() -> None:
    # Before: both recursed, and a message nested ~500 levels raised RecursionError.
    value: Any = "leaf"
    for level in range(5000):
        value = {"level": level, "next": value} if level % 2 else [value, level]
    frozen = freeze(value)
    thawed = thaw(frozen)
    copied = copy.deepcopy(frozen)
    for node, kind in ((frozen, (FrozenDict, FrozenList)), (thawed, (dict, list))):
        for _ in range(5000):
            assert type(node) in kind
            node = node["next"] if isinstance(node, dict) else node[0]
        assert node == "leaf"
    assert type(copied) is dict
    with pytest.raises(TypeError, match="read-only"):
        frozen["next"][0].__setitem__("level", 0)
    thawed["next"][0]["level"] = 0  # a plain copy: the frozen value is unchanged
    assert frozen["next"][0]["level"] == 4997


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 600, 5000])
@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.jsonl")), ids=lambda p: p.name[-14:-6])
async def test_a_deeply_nested_entry_never_breaks_a_later_turn(
    tmp_path: Path, fixture: Path, depth: int
) -> None:
    # Before: a 600-deep entry made every later turn end in history_read_failed and
    # assemble_failed (RecursionError freezing the history, then in the engine). The reader
    # quarantines a line deeper than MAX_JSON_DEPTH; every stage takes the deepest it keeps.
    path = with_deep_entry(fixture, tmp_path / "s.jsonl", depth)
    engine = SqliteContextEngine.next_to(path)
    server = FakeAppServer()
    try:
        for prompt in ("first turn after it", "second turn after it"):
            result = await run_codex_turn(
                params(str(path), prompt), app_server=server, engine=engine
            )
            triggers = [e.trigger for e in result.trace]
            assert result.outcome is TurnOutcome.COMPLETED
            assert "assembled" in triggers
            assert not [t for t in triggers if t.endswith("_failed")], triggers
    finally:
        engine.close()
        clear_session_cache(path)
    assert transcript_texts(path)[-4:] == [
        "first turn after it",
        "Done.",
        "second turn after it",
        "Done.",
    ]


# --- 9: a hung owning engine's compact() is bounded ------------------------------------------


async def test_a_hung_owning_engine_compaction_is_bounded(tmp_path: Any) -> None:
    # Before: still blocked after 10 s, holding the session (concurrent turns refused).
    async def hang(_params: Any) -> CompactResult:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    engine = RecordingEngine(
        engine_id="lossless-claw", owns_compaction=True, responses={"compact": hang}
    )
    started = time.monotonic()
    with anyio.fail_after(10):
        run = await compact_codex_session_traced(
            CompactSessionParams(
                session_id="s-1", session_file=str(tmp_path / "s.jsonl"), engine_timeout=0.3
            ),
            app_server=FakeAppServer(),
            engine=engine,
        )
    assert time.monotonic() - started < 5
    assert run.triggers[:2] == ("started", "engine_failed")
    assert run.result.ok is False
    assert "timed out" in (run.result.reason or "") or "exceeded" in (run.result.reason or "")


# --- 11: bad params are refused with one typed error -----------------------------------------


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEEP_SCHEMA = _deep_schema(5000)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("session_id", 7),
        ("session_id", None),
        ("prompt", ""),
        ("prompt", "   "),
        ("prompt", "x" * ((1 << 20) + 1)),
        ("prompt", "bad \ud800 text"),
        ("concurrency", "sometimes"),
        ("context_token_budget", -5),
        ("context_token_budget", "1000"),
        ("reserve_tokens", 1.5),
        ("images", "data:image/png;base64,AAAA"),
        ("runtime_attempt", ["not", "a", "mapping"]),
        ("turn_timeout", -1),
        ("engine_timeout", 0),
        ("yield_tool", "yes"),
        ("approval_policy", "always"),
        ("base_developer_instructions", "bad \udfff"),
        # Every text field is checked as the prompt is (a lone surrogate broke every engine
        # call, the binding and the queue); paths the OS cannot take; absurd integers.
        ("session_id", "s-\ud800"),
        ("session_key", "agent:main:\udc00"),
        ("sandbox_session_key", "\ud800"),
        ("model", "gpt-\ud800"),
        ("citations_mode", "\udbff"),
        ("extra_developer_instructions", "\ud800"),
        ("auth_profile_id", 5),
        ("auth_profile_id", "profile-\ud800"),
        ("service_tier", "\ud800"),
        ("reasoning_effort", "lo\ud800w"),
        ("images", ("data:image/png;base64,\ud800",)),
        ("images", None),
        ("images", 5),
        ("session_file", "/tmp/s\x00.jsonl"),
        ("session_file", "/tmp/\ud800.jsonl"),
        ("workspace_dir", "/tmp\x00"),
        ("workspace_dir", b"/tmp"),
        ("context_token_budget", 10**400),
        ("context_token_budget", 2**63),
        ("reserve_tokens", 10**400),
        ("output_schema", DEEP_SCHEMA),
        ("output_schema", {"type": "string", "description": "\ud800"}),
        ("approval_policy", ["never"]),
        ("sandbox", {}),
    ],
)
def test_bad_params_raise_invalid_turn_params(field: str, value: Any) -> None:
    # Before: raw AttributeErrors, or silently accepted (a string budget, images iterated
    # per character, an empty prompt sent to the model, a 10 MB prompt cut without a word).
    values: dict[str, Any] = {
        "session_id": "s-1",
        "session_file": "/tmp/s.jsonl",
        "workspace_dir": "/tmp",
        "prompt": "hello",
        field: value,
    }
    with pytest.raises(InvalidTurnParams, match=field):
        TurnParams(**values)
    assert issubclass(InvalidTurnParams, ValueError)


def test_an_image_only_turn_needs_no_text() -> None:
    assert params("/tmp/s.jsonl", "", images=("data:image/png;base64,AAAA",)).prompt == ""


# --- 11: a BaseException from an engine arrives as itself ------------------------------------


class _HostShutdown(BaseException):
    pass


async def test_a_base_exception_from_after_turn_is_not_wrapped_in_a_group(
    session_file: str,
) -> None:
    engine = RecordingEngine(engine_id="e", failures={"after_turn": _HostShutdown()})
    with pytest.raises(_HostShutdown):
        await run_codex_turn(
            params(session_file, "hello"), app_server=FakeAppServer(), engine=engine
        )


# --- 4: a reply the transcript could not take is visible in the outcome ----------------------


async def test_a_mirror_failure_is_the_outcome_unsaved_with_the_reason(
    session_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: outcome "completed"; only the trace said mirror_failed.
    from codex_turn.harness.turn import stages

    def disk_full(*_args: Any, **_kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stages, "mirror_turn", disk_full)
    result = await run_codex_turn(params(session_file, "hello"), app_server=FakeAppServer())
    assert result.outcome is TurnOutcome.UNSAVED
    assert result.assistant_text  # the user did get an answer
    assert result.mirror_error is not None
    assert "No space left" in result.mirror_error


# --- 4: a transcript that cannot take the turn is refused before Codex -----------------------


async def test_an_unwritable_transcript_refuses_the_turn_before_codex(tmp_path: Any) -> None:
    # Before: the model was called, the reply never saved, outcome "completed".
    from codex_turn import TranscriptUnwritable, TurnResult

    session = tmp_path / "session.jsonl"
    session.mkdir()  # a directory at the path
    server = FakeAppServer()
    delivered: list[TurnResult] = []

    async def on_turn_end(result: TurnResult) -> None:
        delivered.append(result)

    with pytest.raises(TranscriptUnwritable):
        await run_codex_turn(
            params(str(session), "hello"), app_server=server, on_turn_end=on_turn_end
        )
    assert server.calls == []
    (result,) = delivered
    assert result.outcome is TurnOutcome.TRANSCRIPT_UNWRITABLE
    assert result.prompt_error


# --- 10: the user's words are durable before the model sees them -----------------------------


async def test_the_prompt_is_in_the_transcript_before_turn_start(session_file: str) -> None:
    # Before: a host killed during the turn left the transcript without the prompt.
    server = FakeAppServer()
    real_turn = server.turn
    seen_at_turn_start: list[list[Any]] = []

    def turn(*args: Any, **kwargs: Any) -> Any:
        clear_session_cache(session_file)
        seen_at_turn_start.append([m.get("content") for m in load_session_messages(session_file)])
        return real_turn(*args, **kwargs)

    server.turn = turn  # type: ignore[method-assign]
    result = await run_codex_turn(params(session_file, "remember me"), app_server=server)
    assert result.outcome is TurnOutcome.COMPLETED
    assert seen_at_turn_start == [["remember me"]]
    contents = [m.get("content") for m in load_session_messages(session_file)]
    assert contents.count("remember me") == 1  # the mirror did not write it twice
    assert len(contents) == 2


# --- 5: a copied sidecar never makes one session resume another's thread ---------------------


async def test_a_copied_sidecar_is_ignored(tmp_path: Any) -> None:
    import shutil

    from codex_turn.harness.binding import binding_path

    server = FakeAppServer()
    a = str(tmp_path / "a.jsonl")
    b = str(tmp_path / "b.jsonl")
    first = await run_codex_turn(params(a, "secret of A", session_id="A"), app_server=server)
    await run_codex_turn(params(b, "hello from B", session_id="B"), app_server=server)
    shutil.copy(binding_path(a), binding_path(b))  # a stale or copied sidecar
    second = await run_codex_turn(params(b, "again from B", session_id="B"), app_server=server)
    assert second.thread_id != first.thread_id
    assert second.thread_decision is not None
    assert second.thread_decision.reason == "missing-thread-binding"


async def test_an_old_sidecar_copied_from_a_live_session_is_ignored(tmp_path: Any) -> None:
    # Before its fix: a pre-upgrade sidecar (no sessionId/transcriptId) copied next to
    # another session's transcript was accepted, then "upgraded" into looking legitimate.
    from codex_turn.harness.binding import binding_path

    server = FakeAppServer()
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    first = await run_codex_turn(params(a, "secret of A", session_id="A"), app_server=server)

    def copy_as_old_sidecar() -> None:
        raw = json.loads(Path(binding_path(a)).read_text())
        for key in ("sessionId", "transcriptId"):
            raw.pop(key, None)  # as written before the ownership fields existed
        Path(binding_path(b)).write_text(json.dumps(raw))

    copy_as_old_sidecar()
    second = await run_codex_turn(params(b, "hello from B", session_id="B"), app_server=server)
    assert second.thread_id != first.thread_id


def test_a_torn_header_with_an_entry_glued_on_is_refused_not_wiped(tmp_path: Path) -> None:
    # Before its fix: "holds only a torn header" accepted any one unparseable line naming a
    # session header, so an entry glued onto a torn header was replaced (the words lost).
    from codex_turn import TranscriptUnwritable
    from codex_turn.harness.session import ensure_transcript_writable

    path = tmp_path / "s.jsonl"
    glued = (
        '{"type":"session","id":"x{"type":"message","message":{"role":"user","content":"MY WORDS"}}'
    )
    path.write_text(glued)
    with pytest.raises(TranscriptUnwritable):
        ensure_transcript_writable(path, session_id="s", cwd=str(tmp_path))
    assert path.read_text() == glued  # untouched
    torn = tmp_path / "t.jsonl"
    torn.write_text('{"type":"session","version":3,"id":"ab')
    ensure_transcript_writable(torn, session_id="s", cwd=str(tmp_path))  # recovered
    assert json.loads(torn.read_text().splitlines()[0])["type"] == "session"


async def test_a_sidecar_that_cannot_be_written_refuses_the_turn(tmp_path: Path) -> None:
    # Before its fix: with a directory at the binding path every turn started a new thread
    # and reported "completed" while the model forgot the conversation.
    from codex_turn import TranscriptUnwritable
    from codex_turn.harness.binding import binding_path

    session = str(tmp_path / "s.jsonl")
    os.mkdir(binding_path(session))
    server = FakeAppServer()
    with pytest.raises(TranscriptUnwritable, match="binding"):
        await run_codex_turn(params(session, "hello"), app_server=server)
    assert server.calls == []


def test_images_from_a_generator_are_kept() -> None:
    # Before its fix: the validation consumed a generator and the turn had no images.
    urls = (f"data:image/png;base64,AA{i}" for i in range(2))
    assert params("/tmp/s.jsonl", "look", images=urls).images == (
        "data:image/png;base64,AA0",
        "data:image/png;base64,AA1",
    )
