"""The engine contract: camelCase JSON shapes, result validation, the legacy engine, loading,
and the recording engine that the lifecycle and orchestrator tests build on."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.recording_engine import RecordingEngine

from codex_turn.errors import CodexTurnError
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    CompactDetails,
    CompactParams,
    CompactResult,
    ContextEngine,
    ContextEngineInfo,
    ContextProjection,
    EngineError,
    EngineLoadError,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    InvalidEngineResult,
    LegacyContextEngine,
    MaintainParams,
    MaintenanceResult,
    coerce_result,
    engine_capabilities,
    engine_id,
    engine_info,
    ensure_assemble_result,
    from_json,
    is_active_engine,
    load_engine,
    to_json,
)

pytestmark = pytest.mark.both_backends


# --- JSON shapes ----------------------------------------------------------------------------


def test_results_use_openclaws_camel_case_shapes() -> None:
    result = AssembleResult(
        messages=[{"role": "user", "content": "hi"}],
        estimated_tokens=42,
        system_prompt_addition="context-engine system",
        context_projection=ContextProjection(mode="thread_bootstrap", epoch="epoch-1"),
    )
    assert to_json(result) == {
        "messages": [{"role": "user", "content": "hi"}],
        "estimatedTokens": 42,
        "systemPromptAddition": "context-engine system",
        "contextProjection": {"mode": "thread_bootstrap", "epoch": "epoch-1"},
    }
    compact = CompactResult(
        ok=True,
        compacted=True,
        result=CompactDetails(
            tokens_before=55,
            summary="engine summary",
            first_kept_entry_id="entry-1",
            details={"engine": "lossless-claw"},
        ),
    )
    assert to_json(compact) == {
        "ok": True,
        "compacted": True,
        "result": {
            "tokensBefore": 55,
            "summary": "engine summary",
            "firstKeptEntryId": "entry-1",
            "details": {"engine": "lossless-claw"},
        },
    }
    assert to_json(MaintenanceResult(changed=True, bytes_freed=10, rewritten_entries=2)) == {
        "changed": True,
        "bytesFreed": 10,
        "rewrittenEntries": 2,
    }
    info = ContextEngineInfo(
        id="lossless-claw",
        name="Lossless Claw",
        owns_compaction=True,
        turn_maintenance_mode="background",
    )
    assert to_json(info) == {
        "id": "lossless-claw",
        "name": "Lossless Claw",
        "ownsCompaction": True,
        "turnMaintenanceMode": "background",
    }


def test_params_use_camel_case_and_omit_absent_optionals() -> None:
    params = AfterTurnParams(
        session_id="session-1",
        session_key="agent:main:session-1",
        session_file="/tmp/s.jsonl",
        messages=[],
        pre_prompt_message_count=0,
        token_budget=111,
    )
    assert to_json(params) == {
        "sessionId": "session-1",
        "sessionKey": "agent:main:session-1",
        "sessionFile": "/tmp/s.jsonl",
        "messages": [],
        "prePromptMessageCount": 0,
        "tokenBudget": 111,
    }
    assert to_json(BootstrapParams(session_id="s", session_file="f")) == {
        "sessionId": "s",
        "sessionFile": "f",
    }
    assemble = AssembleParams(
        session_id="s", messages=[], available_tools=frozenset({"write", "exec"}), model="m"
    )
    assert to_json(assemble) == {
        "sessionId": "s",
        "messages": [],
        "availableTools": ["exec", "write"],
        "model": "m",
    }
    compact = CompactParams(
        session_id="s",
        session_file="f",
        force=True,
        compaction_target="threshold",
        current_token_count=123,
    )
    assert to_json(compact)["compactionTarget"] == "threshold"
    assert to_json(compact)["currentTokenCount"] == 123


SAMPLES: list[Any] = [
    BootstrapParams(session_id="s", session_file="f", session_key="k"),
    BootstrapResult(bootstrapped=True, imported_messages=3, reason="ok"),
    IngestParams(session_id="s", message={"role": "user", "content": "x", "odd": [1]}),
    IngestResult(ingested=False),
    IngestBatchParams(session_id="s", messages=[{"role": "assistant"}], is_heartbeat=True),
    IngestBatchResult(ingested_count=2),
    AfterTurnParams(
        session_id="s",
        session_file="f",
        messages=[{"role": "user"}],
        pre_prompt_message_count=1,
        runtime_context={"cwd": "/w", "tokenBudget": 5},
    ),
    AssembleParams(session_id="s", messages=[], available_tools=frozenset(), prompt=" p "),
    AssembleResult(messages=[], estimated_tokens=0),
    MaintainParams(session_id="s", session_file="f", runtime_context={}),
    MaintenanceResult(changed=False, bytes_freed=0, rewritten_entries=0, reason="r"),
    CompactParams(session_id="s", session_file="f", custom_instructions="keep todos"),
    CompactResult(ok=False, compacted=False, reason="below threshold"),
    ContextEngineInfo(id="x", name="X", version="1"),
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_every_type_round_trips_through_json_text(value: Any) -> None:
    text = json.dumps(to_json(value), sort_keys=True)
    assert from_json(json.loads(text), type(value)) == value


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)
agent_messages = st.dictionaries(st.text(), json_values, max_size=5).map(
    lambda extra: {**extra, "role": "user", "content": [{"type": "text", "text": "x", **extra}]}
)


@given(st.lists(agent_messages, max_size=4), st.integers(0, 10**6))
def test_agent_messages_round_trip_losslessly_with_unknown_keys(
    messages: list[dict[str, Any]], tokens: int
) -> None:
    result = AssembleResult(messages=messages, estimated_tokens=tokens)
    text = json.dumps(to_json(result))
    back = from_json(json.loads(text), AssembleResult)
    assert back == result
    assert json.dumps(to_json(back)) == text


def test_structuring_is_strict_and_ignores_unknown_keys() -> None:
    with pytest.raises(Exception, match="IngestResult"):
        from_json({"ingested": "yes"}, IngestResult)
    assert from_json({"ingested": True, "future": 1}, IngestResult) == IngestResult(True)
    with pytest.raises(Exception, match="ContextEngineInfo"):
        from_json({"id": "x", "name": "y", "turnMaintenanceMode": "sometimes"}, ContextEngineInfo)


# --- Result validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (None, 'expected an object with a "messages" array (got null)'),
        ([], 'expected an object with a "messages" array (got array)'),
        ("text", 'expected an object with a "messages" array (got string)'),
        ({}, 'expected an object with a "messages" array (got messages of type null)'),
        (
            {"messages": {"0": {}}},
            'expected an object with a "messages" array (got messages of type object)',
        ),
        ({"messages": [{}, "x"]}, "messages[1] must be an object (got string)"),
        (
            {"messages": [], "estimatedTokens": "5"},
            "estimatedTokens: expected a number (got string)",
        ),
        ({"messages": [], "estimatedTokens": True}, "estimatedTokens: expected a number"),
        (
            {"messages": [], "systemPromptAddition": 3},
            "systemPromptAddition must be a string (got number)",
        ),
        (
            AssembleResult(messages=None, estimated_tokens=0),  # type: ignore[arg-type]
            'expected an object with a "messages" array (got messages of type null)',
        ),
    ],
)
def test_invalid_assemble_results_name_the_engine_and_the_problem(
    value: object, problem: str
) -> None:
    with pytest.raises(InvalidEngineResult) as caught:
        ensure_assemble_result(value, engine_id="lossless-claw")
    assert str(caught.value).startswith(
        'context engine "lossless-claw" assemble() returned an invalid result: '
    )
    assert problem in str(caught.value)
    assert caught.value.engine_id == "lossless-claw"
    assert caught.value.method == "assemble"


def test_valid_assemble_results_are_accepted_in_both_shapes() -> None:
    messages = [{"role": "user", "content": "x"}]
    as_object = AssembleResult(messages=messages, estimated_tokens=7, system_prompt_addition="s")
    assert ensure_assemble_result(as_object, engine_id="e") == as_object
    as_json = {
        "messages": messages,
        "estimatedTokens": 7.9,
        "systemPromptAddition": "s",
        "contextProjection": {"mode": "per_turn"},
    }
    checked = ensure_assemble_result(as_json, engine_id="e")
    assert checked.estimated_tokens == 7
    assert checked.messages is messages
    assert checked.context_projection == ContextProjection(mode="per_turn")
    assert ensure_assemble_result({"messages": []}, engine_id="e").estimated_tokens == 0
    with pytest.raises(InvalidEngineResult, match="mode"):
        ensure_assemble_result({"messages": [], "contextProjection": {"mode": "x"}}, engine_id="e")


def test_coerce_result_checks_instances_and_mappings() -> None:
    good = MaintenanceResult(changed=True, bytes_freed=1, rewritten_entries=1)
    assert coerce_result(good, MaintenanceResult, engine_id="e", method="maintain") == good
    parsed = coerce_result(
        {"changed": False, "bytesFreed": 0, "rewrittenEntries": 0},
        MaintenanceResult,
        engine_id="e",
        method="maintain",
    )
    assert parsed == MaintenanceResult(changed=False, bytes_freed=0, rewritten_entries=0)
    with pytest.raises(
        InvalidEngineResult, match=r'"e" maintain\(\).*expected a MaintenanceResult'
    ):
        coerce_result(3, MaintenanceResult, engine_id="e", method="maintain")
    with pytest.raises(InvalidEngineResult, match=r"\$\.changed"):
        coerce_result({"bytesFreed": 0}, MaintenanceResult, engine_id="e", method="maintain")
    bad = MaintenanceResult(changed="yes", bytes_freed=0, rewritten_entries=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidEngineResult, match="expected bool"):
        coerce_result(bad, MaintenanceResult, engine_id="e", method="maintain")


def test_errors_belong_to_the_family_and_pickle() -> None:
    err = InvalidEngineResult("x", "assemble", "bad")
    assert isinstance(err, EngineError)
    assert isinstance(err, CodexTurnError)
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.engine_id, copy.method, copy.problem) == (
        str(err),
        "x",
        "assemble",
        "bad",
    )
    load = pickle.loads(pickle.dumps(EngineLoadError("a:b", "nope")))
    assert str(load) == "cannot load context engine 'a:b': nope"
    assert isinstance(load, CodexTurnError)


# --- Engines, capabilities and the legacy engine --------------------------------------------


@pytest.mark.anyio
async def test_the_legacy_engine_behaves_as_openclaws() -> None:
    legacy = LegacyContextEngine()
    assert legacy.info == ContextEngineInfo(
        id="legacy", name="Legacy Context Engine", version="1.0.0"
    )
    assert not hasattr(legacy, "bootstrap")
    assert not hasattr(legacy, "maintain")
    assert not is_active_engine(legacy)
    assert isinstance(legacy, ContextEngine)
    assert await legacy.ingest(IngestParams(session_id="s", message={})) == IngestResult(False)
    messages = [{"role": "user", "content": "x"}]
    assembled = await legacy.assemble(AssembleParams(session_id="s", messages=messages))
    assert assembled == AssembleResult(messages=messages, estimated_tokens=0)
    assert assembled.messages is not messages
    assert (
        await legacy.after_turn(
            AfterTurnParams(
                session_id="s", session_file="f", messages=[], pre_prompt_message_count=0
            )
        )
        is None
    )
    compacted = await legacy.compact(CompactParams(session_id="s", session_file="f"))
    assert (compacted.ok, compacted.compacted) == (True, False)
    assert await legacy.dispose() is None


def test_capabilities_are_detected_not_required() -> None:
    full = engine_capabilities(RecordingEngine())
    assert attrs.astuple(full) == (True, True, True, True, True)
    partial = engine_capabilities(RecordingEngine(omit={"after_turn", "ingest_batch"}))
    assert (partial.after_turn, partial.ingest_batch, partial.maintain) == (False, False, True)
    assert engine_capabilities(LegacyContextEngine()).maintain is False

    class NotCallable:
        maintain = None

    assert engine_capabilities(NotCallable()).maintain is False


def test_engine_identity_helpers() -> None:
    assert is_active_engine(RecordingEngine(engine_id="lossless-claw"))
    assert not is_active_engine(RecordingEngine(engine_id="legacy"))
    assert not is_active_engine(None)
    assert engine_id(object()) == "<unknown>"

    class DictInfo:
        info: ClassVar[dict[str, Any]] = {"id": "js-port", "name": "JS", "ownsCompaction": True}

    assert engine_id(DictInfo()) == "js-port"
    assert engine_info(DictInfo()).owns_compaction is True

    class NoInfo:
        info = 3

    with pytest.raises(InvalidEngineResult, match="expected a ContextEngineInfo"):
        engine_info(NoInfo())

    class EmptyId:
        info = ContextEngineInfo(id="", name="x")

    with pytest.raises(InvalidEngineResult, match="non-empty"):
        engine_info(EmptyId())


# --- load_engine ----------------------------------------------------------------------------

ENGINE_MODULE = """
from codex_turn.harness.engine import AssembleResult, CompactResult, ContextEngineInfo, IngestResult

class Engine:
    info = ContextEngineInfo(id="tmp-engine", name="Tmp")
    async def ingest(self, params): return IngestResult(True)
    async def assemble(self, params): return AssembleResult(messages=[], estimated_tokens=0)
    async def compact(self, params): return CompactResult(ok=True, compacted=False)

instance = Engine()

def factory():
    return Engine()

def failing_factory():
    raise RuntimeError("no config")

class Stored(Engine):
    def __init__(self, directory, name="store.json"):
        self.path = directory / name

def in_directory(directory, *, flavour="plain"):
    return Stored(directory, f"{flavour}.json")

class Holder:
    engine = Engine()

class NotAnEngine:
    info = ContextEngineInfo(id="x", name="x")
    async def assemble(self, params): ...

class BadInfo(Engine):
    info = ContextEngineInfo(id="", name="x")
"""


@pytest.fixture
def engine_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "tmp_engines_mod.py").write_text(textwrap.dedent(ENGINE_MODULE))
    (tmp_path / "tmp_broken_dep.py").write_text("import definitely_not_installed_xyz\n")
    (tmp_path / "tmp_raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tmp_engines_mod"
    for name in ("tmp_engines_mod", "tmp_broken_dep", "tmp_raises"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("attr", ["Engine", "instance", "factory", "Holder.engine"])
def test_load_engine_accepts_classes_instances_factories_and_dotted_paths(
    engine_module: str, attr: str
) -> None:
    engine = load_engine(f"{engine_module}:{attr}")
    assert engine.info.id == "tmp-engine"
    assert isinstance(engine, ContextEngine)


@pytest.mark.parametrize(
    ("attr", "name"), [("Stored", "store.json"), ("in_directory", "plain.json")]
)
def test_a_factory_that_takes_a_parameter_gets_the_session_directory(
    engine_module: str, attr: str, name: str, tmp_path: Path
) -> None:
    # Before its fix: a class or factory was always called with no arguments, so a durable
    # engine loaded by spec (--engine) could not know where its session lives.
    engine = load_engine(f"{engine_module}:{attr}", session_dir=str(tmp_path))
    assert engine.path == tmp_path / name  # type: ignore[attr-defined]
    assert load_engine(f"{engine_module}:factory", session_dir=tmp_path).info.id == "tmp-engine"
    with pytest.raises(EngineLoadError, match="takes the session's directory, and there is no"):
        load_engine(f"{engine_module}:{attr}")


def test_load_engine_loads_the_legacy_engine() -> None:
    engine = load_engine("codex_turn.harness.engine:LegacyContextEngine")
    assert isinstance(engine, LegacyContextEngine)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("no_colon_here", 'expected "package.module:attribute"'),
        ("mod:", 'expected "package.module:attribute"'),
        ("surely_missing_pkg_abc.engine:Engine", "no module named 'surely_missing_pkg_abc.engine'"),
        ("tmp_broken_dep:Engine", "importing 'tmp_broken_dep' failed"),
        ("tmp_raises:Engine", "importing 'tmp_raises' failed: RuntimeError: boom at import"),
        ("tmp_engines_mod:Missing", "'tmp_engines_mod' has no attribute 'Missing'"),
        ("tmp_engines_mod:failing_factory", "calling 'failing_factory' failed: RuntimeError"),
        (
            "tmp_engines_mod:NotAnEngine",
            "NotAnEngine is not a context engine: missing ingest, compact",
        ),
        ("tmp_engines_mod:BadInfo", "invalid info: info.id must be a non-empty string"),
    ],
)
def test_load_engine_says_what_went_wrong(engine_module: str, spec: str, problem: str) -> None:
    with pytest.raises(EngineLoadError) as caught:
        load_engine(spec)
    assert caught.value.spec == spec
    assert problem in str(caught.value)
    assert str(caught.value).startswith(f"cannot load context engine {spec!r}: ")


# --- The recording engine (test support used by later suites) ------------------------------


@pytest.mark.anyio
async def test_recording_engine_records_answers_and_fails_as_configured() -> None:
    async def assemble(params: AssembleParams) -> AssembleResult:
        return AssembleResult(
            messages=[{"role": "user", "content": params.prompt}], estimated_tokens=1
        )

    engine = RecordingEngine(
        omit={"after_turn"},
        responses={"assemble": assemble},
        failures={"ingest": lambda p: RuntimeError("nope") if p.message.get("bad") else None},
    )
    assert not hasattr(engine, "after_turn")
    with pytest.raises(AttributeError, match="omitted"):
        engine.after_turn  # noqa: B018
    result = await engine.assemble(AssembleParams(session_id="s", messages=[], prompt="p"))
    assert result.messages == [{"role": "user", "content": "p"}]
    assert await engine.ingest(IngestParams(session_id="s", message={"ok": 1})) == IngestResult(
        True
    )
    with pytest.raises(RuntimeError, match="nope"):
        await engine.ingest(IngestParams(session_id="s", message={"bad": 1}))
    assert engine.methods() == ["assemble", "ingest", "ingest"]
    failed = engine.calls_to("ingest")[1]
    assert isinstance(failed.error, RuntimeError)
    assert failed.finished
    assert engine.only_call("assemble").result is result
    engine.reset()
    assert engine.calls == []


@pytest.mark.anyio
async def test_recording_engine_snapshots_messages_at_call_time() -> None:
    engine = RecordingEngine()
    messages = [{"role": "user", "content": "before"}]
    rewriter = object()
    await engine.ingest_batch(IngestBatchParams(session_id="s", messages=messages))
    await engine.maintain(
        MaintainParams(session_id="s", session_file="f", runtime_context={"fn": rewriter})
    )
    messages[0]["content"] = "after"
    assert engine.only_call("ingest_batch").params.messages == [
        {"role": "user", "content": "before"}
    ]
    assert engine.only_call("maintain").params.runtime_context["fn"] is rewriter


def test_recording_engine_rejects_unknown_method_names() -> None:
    with pytest.raises(ValueError, match="unknown engine methods"):
        RecordingEngine(omit={"asemble"})
