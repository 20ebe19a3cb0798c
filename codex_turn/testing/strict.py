"""Turns in tests run strict: an engine's contract violation fails the test, never a log line.

:func:`run_strict_turn` is :func:`codex_turn.run_codex_turn` with ``TurnParams.strict`` on:
the turn runs exactly as in production (the engine is checked before it starts, faults fall
back, the prompt and the reply are mirrored, the engine is finalized, ``on_turn_end`` sees
the result), and then the engine's first contract violation is raised as
:class:`~codex_turn.harness.engine.EngineContractViolation` (its ``result`` is the turn's
:class:`~codex_turn.TurnResult`). A test that scripts an engine failure on purpose, to watch
the host cope, runs the turn with plain ``run_codex_turn`` (or ``strict=False``) instead.
See :mod:`codex_turn.harness.violations` for what counts as a violation.
"""

from __future__ import annotations

from typing import Any

import attrs

from codex_turn.harness.turn.orchestrator import run_codex_turn
from codex_turn.harness.turn_api import TurnParams, TurnResult

__all__ = ["run_strict_turn"]


async def run_strict_turn(params: TurnParams, **kwargs: Any) -> TurnResult:
    """``run_codex_turn(params with strict=True, **kwargs)``: see the module docstring."""
    strict = params if params.strict else attrs.evolve(params, strict=True)
    return await run_codex_turn(strict, **kwargs)
