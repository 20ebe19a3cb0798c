"""The public test kit, ``codex_turn.testing``: its exports, the recording engine (promoted from
the tests' support code, same behaviour) and the conformance suite's own API (reports,
applicability, failures of the engine under test reported rather than raised)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import support.recording_engine as support_recording

import codex_turn.testing as kit
from codex_turn.harness.engine import (
    AssembleParams,
    AssembleResult,
    CompactResult,
    IngestParams,
    LegacyContextEngine,
)
from codex_turn.testing import (
    CONFORMANCE_CHECKS,
    CheckResult,
    ConformanceFailure,
    ConformanceReport,
    RecordingEngine,
    check_engine_conformance,
)
from codex_turn.testing.recording_engine import ALL_METHODS, OPTIONAL_METHODS

pytestmark = pytest.mark.anyio


# --- Exports --------------------------------------------------------------------------------


def test_every_exported_name_resolves_and_the_support_module_re_exports_the_public_one() -> None:
    assert [name for name in kit.__all__ if not hasattr(kit, name)] == []
    assert support_recording.RecordingEngine is RecordingEngine
    assert support_recording.Call is kit.Call
    assert support_recording.OPTIONAL_METHODS is OPTIONAL_METHODS
    assert support_recording.ALL_METHODS is ALL_METHODS


def test_the_checks_have_unique_names_a_title_and_a_stated_rule() -> None:
    names = [str(check) for check in CONFORMANCE_CHECKS]
    assert len(set(names)) == len(names) == 20
    assert all(check.title and check.applies_to for check in CONFORMANCE_CHECKS)
    assert names[0] == "storage_declaration"  # the declaration the rules rely on comes first


# --- The recording engine -------------------------------------------------------------------


async def test_the_recording_engine_times_calls_and_echoes_a_new_list() -> None:
    engine = RecordingEngine(delays={"ingest": 0.01})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    result = await engine.assemble(AssembleParams(session_id="s", messages=messages))
    assert result.messages == messages
    assert result.messages is not messages
    assert result.estimated_tokens == 1
    await engine.ingest(IngestParams(session_id="s", message=messages[0]))
    call = engine.only_call("ingest")
    assert call.ended_at is not None
    assert call.ended_at - call.started_at >= 0.01
    with pytest.raises(AssertionError, match="expected one compact call, got 0"):
        engine.only_call("compact")


# --- Reports --------------------------------------------------------------------------------


def _report(*statuses: tuple[str, str]) -> ConformanceReport:
    results = tuple(
        CheckResult(check=name, status=status, rule="every engine", reason="because")  # type: ignore[arg-type]
        for name, status in statuses
    )
    return ConformanceReport("toy", "none", results)


def test_a_report_lists_each_status_and_asserts_the_expected_not_applicable_set() -> None:
    report = _report(("a", "passed"), ("b", "not_applicable"))
    assert report.ok
    assert (report.passed, report.not_applicable, report.failed) == (("a",), ("b",), ())
    report.assert_conforms(not_applicable={"b"})
    with pytest.raises(ConformanceFailure, match=r"not applicable: \['b'\], expected \[\]"):
        report.assert_conforms()
    text = report.format()
    assert "b: not_applicable" in text
    assert "applies to: every engine" in text
    assert "why: because" in text


def test_a_failed_check_fails_the_report_with_the_whole_report_in_the_error() -> None:
    report = _report(("a", "passed"), ("b", "failed"))
    assert not report.ok
    with pytest.raises(ConformanceFailure) as caught:
        report.assert_conforms(not_applicable={"b"})
    assert caught.value.report is report
    assert "failed checks: b" in str(caught.value)
    assert "failed: because" in str(caught.value)
    assert isinstance(caught.value, AssertionError)


async def test_checks_are_chosen_by_name_and_misuse_raises(tmp_path: Path) -> None:
    report = await check_engine_conformance(
        lambda path: LegacyContextEngine(),
        workdir=tmp_path,
        storage="none",
        checks=["deterministic", "within_budget"],
    )
    assert report.engine_id == "legacy"
    assert [r.check for r in report.results] == ["deterministic", "within_budget"]
    assert report.passed == ("deterministic",)
    assert report.not_applicable == ("within_budget",)
    with pytest.raises(ValueError, match="no conformance check named 'nope'"):
        await check_engine_conformance(
            lambda path: LegacyContextEngine(), workdir=tmp_path, storage="none", checks=["nope"]
        )
    with pytest.raises(ValueError, match="storage must be"):
        await CONFORMANCE_CHECKS[0].run(
            lambda path: LegacyContextEngine(),
            workdir=tmp_path,
            storage="disk",  # type: ignore[arg-type]
        )


# --- What the engine under test does is reported, never raised ------------------------------


async def test_a_factory_that_raises_fails_every_applicable_check(tmp_path: Path) -> None:
    def broken(path: Path) -> object:
        raise OSError("no disk")

    report = await check_engine_conformance(broken, workdir=tmp_path, storage="durable")
    assert report.engine_id == "<unknown>"
    assert set(report.failed) | set(report.not_applicable) == {c.name for c in CONFORMANCE_CHECKS}
    assert report.result("deterministic").reason == "the engine factory raised OSError: no disk"


async def test_an_async_factory_is_awaited(tmp_path: Path) -> None:
    async def make(path: Path) -> object:
        await anyio.lowlevel.checkpoint()
        return RecordingEngine()

    report = await check_engine_conformance(
        make, workdir=tmp_path, storage="none", checks=["results_valid", "deterministic"]
    )
    report.assert_conforms()


async def test_an_engine_without_a_required_method_fails(tmp_path: Path) -> None:
    report = await check_engine_conformance(
        lambda path: RecordingEngine(omit={"compact"}),
        workdir=tmp_path,
        storage="none",
        checks=["results_valid"],
    )
    assert report.result("results_valid").reason == (
        "the engine has no compact() (required by the contract)"
    )


@pytest.mark.parametrize(
    ("engine", "check", "reason"),
    [
        pytest.param(
            RecordingEngine(responses={"assemble": {"messages": "nope"}}),
            "results_valid",
            'context engine "recording" assemble() returned an invalid result: expected an '
            'object with a "messages" array (got messages of type string)',
            id="invalid-assembly",
        ),
        pytest.param(
            RecordingEngine(failures={"after_turn": RuntimeError("disk full")}),
            "results_valid",
            "after_turn() raised RuntimeError: disk full",
            id="after-turn-raises",
        ),
        pytest.param(
            RecordingEngine(failures={"dispose": RuntimeError("locked")}),
            "results_valid",
            "dispose() raised RuntimeError: locked",
            id="dispose-raises",
        ),
        pytest.param(
            RecordingEngine(responses={"compact": CompactResult(ok=False, compacted=True)}),
            "compaction_honest",
            "ok=false yet compacted=true",
            id="dishonest-compaction",
        ),
    ],
)
async def test_a_misbehaving_engine_fails_with_the_method_named(
    tmp_path: Path, engine: RecordingEngine, check: str, reason: str
) -> None:
    report = await check_engine_conformance(
        lambda path: engine, workdir=tmp_path, storage="none", checks=[check]
    )
    assert report.failed == (check,), report.format()
    assert reason in report.results[0].reason


async def test_an_assembly_that_ignores_state_is_caught_by_determinism(tmp_path: Path) -> None:
    counter = iter(range(10**6))

    def drifting(params: AssembleParams) -> AssembleResult:
        return AssembleResult(messages=list(params.messages), estimated_tokens=next(counter))

    report = await check_engine_conformance(
        lambda path: RecordingEngine(responses={"assemble": drifting}),
        workdir=tmp_path,
        storage="none",
        checks=["deterministic"],
    )
    assert report.failed == ("deterministic",)
    assert "assembled twice in a row" in report.results[0].reason
