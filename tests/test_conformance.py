"""The engine conformance suite in CI, one test per check and engine: the legacy engine and the
recording engine (both store nothing: declared ``storage="none"``) and the reference engine,
``codex_turn.engines.SqliteContextEngine`` (``storage="durable"``: every check applies); and a
sliding window of someone's, which the suite must not pass.

Every expected ``not_applicable`` (and failure) is written down here with its reason, so a
check that stops applying (or starts) is a visible change, never a silent pass. Everything
runs on asyncio and on trio.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from codex_turn import (
    AssembleParams,
    AssembleResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    IngestParams,
    IngestResult,
)
from codex_turn.harness.engine import LegacyContextEngine
from codex_turn.testing import (
    CONFORMANCE_CHECKS,
    ConformanceCheck,
    RecordingEngine,
    check_engine_conformance,
)

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

_NONE = 'declared storage "none": the engine keeps nothing'
#: Checks that do not apply to an engine that stores nothing, and the reason each reports.
#: (Only what needs storage to happen at all: the budget, tool pairs, prefix stability and
#: isolation are checked on every engine, on what it builds from the history it is handed.)
STATELESS_NOT_APPLICABLE: dict[str, str] = {
    "reingest_adds_nothing": _NONE,
    "retried_after_turn_adds_nothing": _NONE,
    "restart_adds_nothing": "declared storage 'none', not durable",
    "epoch_stable": "observed projection modes: none",
    "compaction_converges": "info.owns_compaction is false",
    # The later hooks: an engine without them is not asked (neither of these has them).
    "reset_archives_or_keeps": "the engine has no before_session_reset",
    "session_end_releases_only": "the engine has no session_end",
    "subagent_round_trip": "the engine has neither prepare_subagent_spawn nor on_subagent_ended",
    "control_answers": "the engine has no control",
    "compaction_abortable": "info.owns_compaction is false",
}
#: The engine-specific outcomes. The legacy engine is no engine (the harness never calls
#: it): it keeps no budget, and none is asked of it. The recording engine's default answer
#: echoes the history it is handed, whatever the budget: the budget check says so.
SPECIFIC: dict[str, dict[str, tuple[str, str]]] = {
    "legacy": {
        "within_budget": (
            "not_applicable",
            "the legacy engine is no engine: the harness never assembles with it",
        ),
    },
    "recording": {
        "within_budget": ("failed", "fewer than one token per 8 characters"),
    },
}

STATELESS_ENGINES: dict[str, Any] = {
    "legacy": lambda path: LegacyContextEngine(),
    "recording": lambda path: RecordingEngine(),
}


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=str)
@pytest.mark.parametrize("engine", sorted(STATELESS_ENGINES))
async def test_stateless_engines_conform(
    engine: str, check: ConformanceCheck, tmp_path: Path
) -> None:
    result = await check.run(STATELESS_ENGINES[engine], workdir=tmp_path, storage="none")
    if check.name in SPECIFIC[engine]:
        status, reason = SPECIFIC[engine][check.name]
        assert result.status == status, result.format()
        assert reason in result.reason
    elif check.name in STATELESS_NOT_APPLICABLE:
        assert result.status == "not_applicable", result.format()
        assert result.reason == STATELESS_NOT_APPLICABLE[check.name]
    else:
        assert result.status == "passed", result.format()


def test_every_check_that_can_pass_a_stateless_engine_is_expected_to() -> None:
    applicable = {c.name for c in CONFORMANCE_CHECKS} - set(STATELESS_NOT_APPLICABLE)
    assert applicable == {
        "storage_declaration",
        "results_valid",
        "within_budget",
        "tool_pairs_intact",
        "deterministic",
        "prefix_stable",
        "compaction_honest",
        "sessions_isolated",
        "host_requirements_met",
        "model_access_declared",
    }


def test_every_check_says_why_it_applies_and_what_a_failure_does_per_projection() -> None:
    # Before its fix: a check said when it applied, not why, and nothing said whether a
    # failure mattered (a sliding window fails prefix_stable, which costs a per-turn engine
    # its continued fork and harms a thread_bootstrap engine not at all).
    for check in CONFORMANCE_CHECKS:
        assert check.because, check.name
        assert {mode for mode, _, _ in check.matters} == {"per_turn", "thread_bootstrap"}
    prefix = next(c for c in CONFORMANCE_CHECKS if c.name == "prefix_stable")
    assert [severity for _, severity, _ in prefix.matters] == ["costs", "harmless"]


class SlidingWindow:
    """Someone's per-turn engine: the last four messages it is handed, whatever the budget,
    and an instruction. It stores nothing."""

    info = ContextEngineInfo(id="window-4", name="window", version="1")

    async def ingest(self, params: IngestParams) -> IngestResult:
        return IngestResult(ingested=False)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        kept = copy.deepcopy(list(params.messages)[-4:])
        tokens = len(json.dumps(kept)) // 4
        return AssembleResult(messages=kept, estimated_tokens=tokens, system_prompt_addition="Hi")

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(ok=True, compacted=False, reason="a window never compacts")


async def test_a_window_that_ignores_the_budget_fails_it_and_the_report_says_what_matters(
    tmp_path: Path,
) -> None:
    # Before its fix: with storage="none" such an engine passed: 9 of 13 checks did not
    # apply, the budget among them.
    report = await check_engine_conformance(
        lambda path: SlidingWindow(), workdir=tmp_path, storage="none"
    )
    assert report.projection == "per_turn"
    assert set(report.failed) == {"within_budget", "tool_pairs_intact", "prefix_stable"}
    assert "assembled" in report.result("within_budget").reason
    assert report.failures_that_matter("per_turn") == report.failed
    assert report.failures_that_matter("thread_bootstrap") == (
        "within_budget",
        "tool_pairs_intact",
    )
    text = report.format()
    assert "observed: per-turn projection; failures that matter there: within_budget" in text
    assert "matters for thread_bootstrap projection: harmless: " in text
    assert "because: " in text


# --- The reference engine -------------------------------------------------------------------


def reference_engine(path: Path) -> object:
    # Imported here, not at module level: the module is developed in parallel.
    engines = importlib.import_module("codex_turn.engines")
    return engines.SqliteContextEngine(path)


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=str)
async def test_reference_engine_conforms(check: ConformanceCheck, tmp_path: Path) -> None:
    result = await check.run(reference_engine, workdir=tmp_path, storage="durable")
    assert result.status == "passed", result.format()
