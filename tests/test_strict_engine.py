"""Engine mistakes are visible: the engine is checked before a turn starts, and a
strict turn raises the engine's first contract violation instead of logging it.

Before: a spec string, an object without ``info`` or an engine whose ``assemble`` returns
``None`` all gave ``outcome=completed`` with one WARNING line. Now a string is loaded as a spec
or refused (:class:`EngineLoadError`), a non-engine is refused (:class:`EngineContractError`),
both before any I/O and in both modes; and with ``TurnParams(strict=True)`` every violation
the lifecycle falls back on is raised (:class:`EngineContractViolation`) once the turn ended,
with the prompt and the reply in the transcript. Operational faults keep the fallback.

In-process fake app-server, except one end-to-end test against the real binary.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from structlog.testing import capture_logs
from support.fake_appserver import FakeAppServer
from support.turns import temporary_session_file, turn_params

from codex_turn import (
    AppServer,
    AssembleResult,
    CodexTurnError,
    ContextEngineInfo,
    InvalidTurnParams,
    TurnOutcome,
    TurnParams,
    TurnResult,
    run_codex_turn,
)
from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session_traced
from codex_turn.harness.engine import (
    EngineContractError,
    EngineContractViolation,
    EngineLoadError,
    EngineUnavailable,
    LegacyContextEngine,
)
from codex_turn.harness.lifecycle import assemble_context_engine
from codex_turn.harness.session import SessionError, load_session_messages
from codex_turn.harness.violations import is_operational_fault, watch_contract
from codex_turn.testing import OfflineModel, RecordingEngine, run_strict_turn

pytestmark = pytest.mark.anyio

PROMPT = "please summarise the quarterly figures for me"
REPLY = "Done."


@pytest.fixture
def session_file(private_texts: set[str]) -> Iterator[str]:
    private_texts.add(PROMPT)  # the conftest guard fails the test if it reaches a log record
    with temporary_session_file("codex-turn-strict-") as path:
        yield path


def params(session_file: str, *, strict: bool = False, **overrides: Any) -> TurnParams:
    return turn_params(session_file, PROMPT, strict=strict, **overrides)


def transcript(session_file: str) -> list[Any]:
    return [m.get("content") for m in load_session_messages(session_file)]


def user_prompt_kept(session_file: str) -> bool:
    return any(
        m.get("role") == "user" and (m.get("content") == PROMPT or PROMPT in str(m.get("content")))
        for m in load_session_messages(session_file)
    )


async def seed(session_file: str) -> None:
    """A plain turn first, so the next one bootstraps (its session file exists) and has
    history to hand the engine."""
    await run_codex_turn(
        turn_params(session_file, "an earlier question"), app_server=FakeAppServer()
    )


def warnings_of(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in logs if r["log_level"] == "warning" and "contract_violation" in r]


# --- 1. up front: a string is a spec, an object must be an engine, before any I/O -----------

SPEC_MODULE = """
from codex_turn.testing import RecordingEngine

class Engine(RecordingEngine):
    def __init__(self):
        super().__init__(engine_id="from-spec")

instance = RecordingEngine(engine_id="from-spec-instance")

def factory():
    return RecordingEngine(engine_id="from-spec-factory")

not_an_engine = object()
"""


@pytest.fixture
def spec_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module in the current directory, which is not on sys.path (as for a console script):
    the loader finds it there as ``python -m`` would."""
    name = "strict_spec_engines_mod"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SPEC_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("attr", "engine_id"),
    [("Engine", "from-spec"), ("instance", "from-spec-instance"), ("factory", "from-spec-factory")],
)
async def test_a_string_engine_is_loaded_as_a_spec_relative_to_the_current_directory(
    session_file: str, spec_module: str, attr: str, engine_id: str
) -> None:
    server = FakeAppServer()
    with capture_logs() as logs:
        result = await run_codex_turn(
            params(session_file, strict=True), app_server=server, engine=f"{spec_module}:{attr}"
        )
    assert result.outcome is TurnOutcome.COMPLETED
    assert "assembled" in [e.trigger for e in result.trace]  # the engine really ran
    assert engine_id in {r.get("engine") for r in logs}


BAD_SPECS = [
    ("strict_no_such_module_xyz:Engine", "no module named 'strict_no_such_module_xyz'"),
    ("pkg.mod.Engine", 'expected "package.module:attribute" (did you mean "pkg.mod:Engine"?)'),
    (".relative:Engine", "relative module names are not supported"),
    ("codex_turn.harness.engine:NoSuchEngine", "has no attribute 'NoSuchEngine'"),
    ("codex_turn.harness.engine:EngineHandle", "calling 'EngineHandle' failed: TypeError"),
    ("strict_spec_engines_mod:not_an_engine", "object is not a context engine: missing info"),
]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(("spec", "problem"), BAD_SPECS, ids=[s for s, _ in BAD_SPECS])
async def test_a_bad_spec_is_refused_before_any_io_in_both_modes(
    session_file: str, spec_module: str, spec: str, problem: str, strict: bool
) -> None:
    server = FakeAppServer()
    with pytest.raises(EngineLoadError) as caught:
        await run_codex_turn(params(session_file, strict=strict), app_server=server, engine=spec)
    error = caught.value
    assert isinstance(error, ValueError)
    assert isinstance(error, CodexTurnError)
    assert problem in str(error)
    assert "\n" not in str(error)  # one line
    assert str(error).startswith(f"cannot load context engine {spec!r}: ")
    assert server.calls == []
    assert not Path(session_file).exists()  # nothing read, written or sent  # noqa: ASYNC240


class NoInfo:
    async def ingest(self, params: Any) -> Any: ...
    async def assemble(self, params: Any) -> Any: ...
    async def compact(self, params: Any) -> Any: ...


class NotCallable(NoInfo):
    info = ContextEngineInfo(id="not-callable", name="x")
    assemble = "assemble"  # type: ignore[assignment]


class OptionalNotCallable(NoInfo):
    info = ContextEngineInfo(id="optional", name="x")
    maintain = 42


class WrongInfo(NoInfo):
    info: ClassVar[dict[str, Any]] = {"id": 7, "name": "x"}


NON_ENGINES: list[tuple[str, Callable[[], object], str]] = [
    ("plain-object", object, "'object' object is not a context engine: missing info"),
    ("no-info", NoInfo, "'NoInfo' object is not a context engine: missing info"),
    (
        "missing-assemble",
        lambda: RecordingEngine(engine_id="half", omit={"assemble"}),
        '(id "half") is not a context engine: missing assemble',
    ),
    ("not-callable", NotCallable, "assemble is not callable (got str)"),
    ("optional-not-callable", OptionalNotCallable, "maintain is present but not callable"),
    ("wrong-info", WrongInfo, "invalid info: "),
    ("a-class", lambda: RecordingEngine, "it is a class, not an instance"),
]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    ("make", "problem"), [(m, p) for _, m, p in NON_ENGINES], ids=[n for n, _, _ in NON_ENGINES]
)
async def test_an_object_that_is_not_an_engine_is_refused_before_any_io_in_both_modes(
    session_file: str, make: Callable[[], object], problem: str, strict: bool
) -> None:
    server = FakeAppServer()
    with pytest.raises(EngineContractError) as caught:
        await run_codex_turn(params(session_file, strict=strict), app_server=server, engine=make())
    assert isinstance(caught.value, TypeError)
    assert problem in str(caught.value)
    assert server.calls == []
    assert not Path(session_file).exists()  # noqa: ASYNC240


async def test_the_legacy_engine_and_none_still_mean_no_engine(session_file: str) -> None:
    for engine in (None, LegacyContextEngine()):
        result = await run_codex_turn(
            params(session_file, strict=True), app_server=FakeAppServer(), engine=engine
        )
        assert result.outcome is TurnOutcome.COMPLETED
        assert "assemble_skipped" in [e.trigger for e in result.trace]


async def test_compaction_checks_its_engine_up_front_too(session_file: str) -> None:
    compact = CompactSessionParams(session_id="s-1", session_file=session_file)
    with pytest.raises(EngineContractError):
        await compact_codex_session_traced(compact, app_server=FakeAppServer(), engine=NoInfo())
    with pytest.raises(EngineLoadError):
        await compact_codex_session_traced(
            compact, app_server=FakeAppServer(), engine="strict_no_such_module_xyz:Engine"
        )


def test_strict_is_validated_like_the_other_params(session_file: str) -> None:
    with pytest.raises(InvalidTurnParams, match="strict must be a bool"):
        params(session_file, strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CompactSessionParams(session_id="s", session_file=session_file, strict=1)  # type: ignore[arg-type]


# --- 2. strict turns raise each kind of violation; without strict they fall back -----------


def mutate(p: Any) -> AssembleResult:
    p.messages[0]["content"] = "edited in place"
    return AssembleResult(messages=list(p.messages), estimated_tokens=1)


@attrs.frozen
class Violation:
    name: str
    method: str
    engine: Callable[[], RecordingEngine]
    #: The turn needs an earlier one (bootstrap runs only for an existing session file;
    #: an in-place edit needs history to edit).
    seeded: bool = False


class AfterTurnAnswers(RecordingEngine):
    """``after_turn`` must return nothing; this one returns a count."""

    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id=engine_id)

    async def after_turn(self, params: Any) -> Any:  # type: ignore[override]
        await super().after_turn(params)
        return 3


def engine(**kwargs: Any) -> Callable[[], RecordingEngine]:
    return lambda: RecordingEngine(engine_id="careless", **kwargs)


VIOLATIONS = [
    Violation("assemble-returns-none", "assemble", engine(responses={"assemble": None})),
    Violation(
        "assemble-malformed", "assemble", engine(responses={"assemble": {"messages": "nope"}})
    ),
    Violation("assemble-raises", "assemble", engine(failures={"assemble": RuntimeError("bug")})),
    Violation("messages-mutated", "assemble", engine(responses={"assemble": mutate}), True),
    Violation(
        "bootstrap-malformed",
        "bootstrap",
        engine(responses={"bootstrap": {"bootstrapped": "yes"}}),
        True,
    ),
    Violation("bootstrap-returns-none", "bootstrap", engine(responses={"bootstrap": None}), True),
    Violation("bootstrap-raises", "bootstrap", engine(failures={"bootstrap": KeyError("k")}), True),
    Violation(
        "after-turn-raises", "after_turn", engine(failures={"after_turn": ValueError("bad")})
    ),
    Violation("after-turn-returns-a-value", "after_turn", lambda: AfterTurnAnswers("careless")),
    Violation(
        "ingest-batch-malformed",
        "ingest_batch",
        engine(omit={"after_turn"}, responses={"ingest_batch": {"ingestedCount": "2"}}),
    ),
    Violation(
        "ingest-malformed",
        "ingest",
        engine(omit={"after_turn", "ingest_batch"}, responses={"ingest": None}),
    ),
    Violation(
        "ingest-raises",
        "ingest",
        engine(omit={"after_turn", "ingest_batch"}, failures={"ingest": AttributeError("x")}),
    ),
    Violation(
        "maintain-malformed", "maintain", engine(responses={"maintain": {"changed": "maybe"}})
    ),
    Violation("maintain-raises", "maintain", engine(failures={"maintain": TypeError("oops")})),
]


@pytest.mark.parametrize("case", VIOLATIONS, ids=[v.name for v in VIOLATIONS])
async def test_without_strict_a_violation_is_a_fallback_and_a_warning(
    session_file: str, case: Violation
) -> None:
    if case.seeded:
        await seed(session_file)
    with capture_logs() as logs:
        result = await run_codex_turn(
            params(session_file), app_server=FakeAppServer(), engine=case.engine()
        )
    assert result.outcome is TurnOutcome.COMPLETED
    flagged = [r for r in warnings_of(logs) if r["contract_violation"]]
    assert flagged, [r["event"] for r in logs if r["log_level"] == "warning"]
    assert all(r["engine"] == "careless" for r in flagged)


@pytest.mark.parametrize("case", VIOLATIONS, ids=[v.name for v in VIOLATIONS])
async def test_a_strict_turn_raises_the_violation_after_the_turn_was_kept(
    session_file: str, case: Violation
) -> None:
    if case.seeded:
        await seed(session_file)
    delivered: list[TurnResult] = []

    async def on_turn_end(result: TurnResult) -> None:
        delivered.append(result)

    server = FakeAppServer()
    with pytest.raises(EngineContractViolation) as caught:
        await run_codex_turn(
            params(session_file, strict=True),
            app_server=server,
            engine=case.engine(),
            on_turn_end=on_turn_end,
        )
    violation = caught.value
    assert violation.method == case.method
    assert violation.engine_id == "careless"
    assert str(violation).startswith(
        f'context engine "careless" broke the contract in {case.method}'
    )
    assert violation.__cause__ is not None
    # The turn ran to its end first: Codex answered, the transcript has both sides, the
    # runner's callback saw the result the error carries.
    assert delivered == [violation.result]
    assert violation.result.outcome is TurnOutcome.COMPLETED
    assert user_prompt_kept(session_file)
    assert any(REPLY in str(content) for content in transcript(session_file))
    assert len(server.calls_to("turn")) == 1  # one Codex turn (the seed had its own server)


async def test_the_first_violation_is_raised_and_the_later_ones_counted(session_file: str) -> None:
    careless = RecordingEngine(
        engine_id="careless",
        responses={"assemble": None},
        failures={"after_turn": RuntimeError("later")},
    )
    with pytest.raises(EngineContractViolation) as caught:
        await run_strict_turn(params(session_file), app_server=FakeAppServer(), engine=careless)
    assert caught.value.method == "assemble"
    assert caught.value.later == 1
    assert careless.methods()[:2] == ["assemble", "after_turn"]  # the turn went on after it


async def test_a_strict_turn_with_a_correct_engine_returns_normally(session_file: str) -> None:
    correct = RecordingEngine(engine_id="correct")
    result = await run_strict_turn(params(session_file), app_server=FakeAppServer(), engine=correct)
    assert result.outcome is TurnOutcome.COMPLETED
    assert correct.methods() == ["assemble", "after_turn", "maintain"]


# --- 3. operational faults are the world's, not the engine's: the fallback stays ------------

OPERATIONAL = [
    pytest.param(OSError("disk full"), id="os-error"),
    pytest.param(ConnectionError("memory service unreachable"), id="connection-error"),
    pytest.param(sqlite3.OperationalError("database is locked"), id="sqlite-locked"),
    pytest.param(EngineUnavailable("store offline"), id="engine-unavailable"),
    pytest.param(SessionError("transcript unreadable"), id="session-error"),
]


@pytest.mark.parametrize("fault", OPERATIONAL)
async def test_an_operational_fault_keeps_the_fallback_in_strict_mode(
    session_file: str, fault: Exception
) -> None:
    assert is_operational_fault(fault)
    flaky = RecordingEngine(engine_id="flaky", failures={"assemble": fault, "maintain": fault})
    with capture_logs() as logs:
        result = await run_strict_turn(
            params(session_file), app_server=FakeAppServer(), engine=flaky
        )
    assert result.outcome is TurnOutcome.COMPLETED
    assert "assemble_failed" in [e.trigger for e in result.trace]
    assert result.maintenance.status == "failed"
    assert [r["contract_violation"] for r in warnings_of(logs)] == [False, False]


async def test_an_engine_timeout_keeps_the_fallback_in_strict_mode(session_file: str) -> None:
    slow = RecordingEngine(engine_id="slow", delays={"assemble": 5.0})
    result = await run_strict_turn(
        params(session_file, engine_timeout=0.05), app_server=FakeAppServer(), engine=slow
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert "assemble_failed" in [e.trigger for e in result.trace]


# --- 4. the same rule for compaction and for a runner of its own ---------------------------


async def test_a_strict_compaction_raises_a_malformed_compact_result(session_file: str) -> None:
    owning = RecordingEngine(
        engine_id="owning", owns_compaction=True, responses={"compact": {"ok": "yes"}}
    )
    lenient = CompactSessionParams(session_id="s-1", session_file=session_file)
    run = await compact_codex_session_traced(lenient, app_server=FakeAppServer(), engine=owning)
    assert run.result.ok is False  # reported, as before
    strict = attrs.evolve(lenient, strict=True)
    with pytest.raises(EngineContractViolation) as caught:
        await compact_codex_session_traced(strict, app_server=FakeAppServer(), engine=owning)
    assert caught.value.method == "compact"
    assert caught.value.result.result.ok is False


async def test_a_runner_of_its_own_watches_the_lifecycle_helpers() -> None:
    careless = RecordingEngine(engine_id="careless", responses={"assemble": None})
    with watch_contract(strict=True) as watch:
        outcome = await assemble_context_engine(
            engine=careless, session_id="s", session_key=None, messages=[]
        )
    assert outcome.status == "failed"
    with pytest.raises(EngineContractViolation, match="assemble"):
        watch.raise_first()
    with watch_contract(strict=False) as lenient:
        await assemble_context_engine(
            engine=careless, session_id="s", session_key=None, messages=[]
        )
    lenient.raise_first()  # not strict: recorded, not raised
    assert [v.method for v in lenient.violations] == ["assemble"]


# --- 5. end to end: the real Codex app-server ----------------------------------------------


@pytest.mark.codex
async def test_e2e_a_strict_turn_raises_for_an_assembly_of_none_and_keeps_the_turn(
    appserver: AppServer, offline_model: OfflineModel, tmp_path: Path, workspace: Path
) -> None:
    session = str(tmp_path / "session.jsonl")
    careless = RecordingEngine(engine_id="careless", responses={"assemble": None})
    strict = TurnParams(
        session_id="s-1",
        session_file=session,
        workspace_dir=str(workspace),
        prompt="hello from a strict turn",
        strict=True,
    )
    with pytest.raises(EngineContractViolation) as caught:
        await run_codex_turn(strict, app_server=appserver, engine=careless)
    assert caught.value.method == "assemble"
    assert caught.value.result.outcome is TurnOutcome.COMPLETED
    # The fallback is the baseline prompt: the model got the raw prompt, and the transcript
    # keeps the user's words and the model's reply.
    assert offline_model.turn_requests()[-1].last_user_text == "hello from a strict turn"
    roles = [m.get("role") for m in load_session_messages(session)]
    assert roles[:1] == ["user"]
    assert "assistant" in roles
    assert careless.methods()[0] == "assemble"
