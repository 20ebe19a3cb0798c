"""The engine conformance suite in CI, one test per check and engine: the legacy engine and the
recording engine (both store nothing: declared ``storage="none"``) and the reference engine,
``codex_turn.engines.SqliteContextEngine`` (``storage="durable"``: every check applies).

Every expected ``not_applicable`` is written down here with its reason, so a check that stops
applying (or starts) is a visible change, never a silent pass. Everything runs on asyncio
and on trio.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from codex_turn.harness.engine import LegacyContextEngine
from codex_turn.testing import CONFORMANCE_CHECKS, ConformanceCheck, RecordingEngine

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

_NONE = 'declared storage "none": the engine keeps nothing'
#: Checks that do not apply to an engine that stores nothing, and the reason each reports.
STATELESS_NOT_APPLICABLE: dict[str, str] = {
    "reingest_adds_nothing": _NONE,
    "retried_after_turn_adds_nothing": _NONE,
    "restart_adds_nothing": "declared storage 'none', not durable",
    "within_budget": _NONE,
    "tool_pairs_intact": _NONE,
    "prefix_stable": _NONE,
    "epoch_stable": "observed projection modes: none",
    "compaction_converges": "info.owns_compaction is false",
    "sessions_isolated": _NONE,
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
    if check.name in STATELESS_NOT_APPLICABLE:
        assert result.status == "not_applicable", result.format()
        assert result.reason == STATELESS_NOT_APPLICABLE[check.name]
    else:
        assert result.status == "passed", result.format()


def test_every_check_that_can_pass_a_stateless_engine_is_expected_to() -> None:
    applicable = {c.name for c in CONFORMANCE_CHECKS} - set(STATELESS_NOT_APPLICABLE)
    assert applicable == {
        "storage_declaration",
        "results_valid",
        "deterministic",
        "compaction_honest",
    }


# --- The reference engine -------------------------------------------------------------------


def reference_engine(path: Path) -> object:
    # Imported here, not at module level: the module is developed in parallel.
    engines = importlib.import_module("codex_turn.engines")
    return engines.SqliteContextEngine(path)


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=str)
async def test_reference_engine_conforms(check: ConformanceCheck, tmp_path: Path) -> None:
    result = await check.run(reference_engine, workdir=tmp_path, storage="durable")
    assert result.status == "passed", result.format()
