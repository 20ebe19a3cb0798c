"""What crosses the queue: a turn's params and its result as plain JSON values.

A queued turn is stored in the DBOS system database and read back by another process,
perhaps another version of the program; the records here are plain JSON-able dicts, never a
pickled library object (a pickle would tie the database to one version of every class).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import attrs

from codex_turn.harness.turn_api import TurnParams, TurnResult

__all__ = ["TurnRecord", "params_from_wire", "params_to_wire", "record_of", "session_lane"]


def _plain(value: Any) -> Any:
    if attrs.has(type(value)):  # a record field (CollaborationInstructions): its fields
        return _plain(attrs.asdict(value, recurse=False))
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        # A deep, JSON-checked copy: the database must hold exactly what is re-read.
        return json.loads(json.dumps(dict(value), allow_nan=False))
    return value


def session_lane(params: TurnParams) -> str:
    """The queue partition of a turn: its session (the key the session gate uses too), so
    the turns of one session run one at a time, in submission order, across all workers."""
    return params.session_key or params.session_id


def params_to_wire(params: TurnParams) -> dict[str, Any]:
    """``params`` as a JSON-able dict, every field by name (a path becomes a string)."""
    return {field.name: _plain(getattr(params, field.name)) for field in attrs.fields(TurnParams)}


def params_from_wire(wire: Mapping[str, Any]) -> TurnParams:
    """The params :func:`params_to_wire` stored (validated again, as any params are)."""
    return TurnParams(**dict(wire))


@attrs.frozen(kw_only=True)
class TurnRecord:
    """The durable result of a queued turn: what :class:`~codex_turn.TurnResult` says about
    it, in JSON values, plus where it ran and whether it was recovered rather than run."""

    turn_id: str
    outcome: str
    assistant_text: str | None
    prompt_error: str | None
    thread_id: str | None
    #: Codex's id of its turn (``None`` when the turn never reached Codex or was recovered).
    codex_turn_id: str | None
    thread_action: str | None
    thread_reason: str | None
    projected: bool
    mirror_error: str | None
    #: The machine's path: one trigger per step (empty when recovered from the transcript).
    trace: tuple[str, ...]
    durations_ms: Mapping[str, float]
    #: The DBOS executor that ran it.
    executor_id: str
    #: ``"ran"``: the turn ran in this attempt; ``"already_mirrored"``: an earlier attempt
    #: died after the turn reached the transcript, and the transcript's reply is returned
    #: instead of running the turn again.
    source: str = "ran"
    #: Wall-clock bounds of the attempt that produced this record (seconds since the epoch):
    #: two turns of one session never overlap.
    started_at: float = 0.0
    ended_at: float = 0.0
    #: Where the turn ran relative to the session's thread (:mod:`codex_turn.scale._workflow`):
    #: ``"sticky"``: on the worker that ran the session's previous turn, whose Codex home holds
    #: its thread; ``"moved"``: on another one (that worker was dead or draining), so the
    #: harness started a fresh thread here;
    #: ``"first"``: no worker ran the session before. ``None``: not known (a database error).
    locality: str | None = None
    #: The worker that ran the session's previous turn (``None`` for a first turn).
    previous_executor_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self),
            "trace": list(self.trace),
            "durations_ms": dict(self.durations_ms),
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> TurnRecord:
        known = {field.name for field in attrs.fields(cls)}
        values = {k: v for k, v in wire.items() if k in known}
        values["trace"] = tuple(values.get("trace", ()))
        values["durations_ms"] = dict(values.get("durations_ms", {}))
        return cls(**values)


def record_of(turn_id: str, result: TurnResult, *, executor_id: str) -> TurnRecord:
    decision = result.thread_decision
    return TurnRecord(
        turn_id=turn_id,
        outcome=result.outcome.value,
        assistant_text=result.assistant_text,
        prompt_error=result.prompt_error,
        thread_id=result.thread_id,
        codex_turn_id=result.turn_id,
        thread_action=decision.action.value if decision is not None else None,
        thread_reason=decision.reason if decision is not None else None,
        projected=result.projected,
        mirror_error=result.mirror_error,
        trace=tuple(entry.trigger for entry in result.trace),
        durations_ms=result.durations_ms,
        executor_id=executor_id,
    )
