"""Contract violations: which engine faults are the engine's mistakes, and strict mode.

An engine is a plugin and must never break a turn, so the lifecycle catches every engine
fault at its fallback points (:mod:`~codex_turn.harness.lifecycle`,
:mod:`~codex_turn.harness.maintenance`, the engine step of
:mod:`~codex_turn.harness.compaction`), logs it and takes the stage's failure edge. That
keeps turns alive, and it also hid engines that never worked. This module is the
one place that decides, for each caught fault, whether it was the *engine's mistake* (a
contract violation) or the *world's* (an operational fault); the fallback points call
:func:`engine_fault` and nothing else decides it.

Classification
--------------
*Operational* (the fallback is the whole story, strict or not):

* an engine call that exceeded ``engine_timeout`` (it is cancelled, so it never reaches
  here; compaction's own timeout raises :class:`TimeoutError`, an ``OSError``);
* :class:`OSError` and its subclasses: :class:`TimeoutError`, :class:`ConnectionError`, a
  file or socket error;
* :class:`sqlite3.OperationalError` (a database locked, unreachable or out of disk);
* :class:`~codex_turn.harness.session.SessionError` (the transcript could not be read);
* :class:`~codex_turn.harness.engine.EngineUnavailable`, which an engine raises to say so.

*Contract violations* (everything else an engine method does wrong):

* a result without the contract's shape (:class:`~codex_turn.harness.engine.InvalidEngineResult`):
  ``assemble`` returning ``None`` or a malformed assembly, ``bootstrap`` / ``maintain`` /
  ``compact`` returning a malformed result;
* an edit of a read-only message it was handed (the :class:`TypeError` of
  :mod:`~codex_turn.frozen`);
* any other exception escaping an engine method (``TypeError``, ``KeyError``,
  ``RuntimeError``, a method that cannot be awaited ...): a bug, from the host's side;
* a result the lifecycle has always tolerated but the contract does not allow: ``bootstrap``
  returning ``None``, ``after_turn`` returning a value, ``ingest`` / ``ingest_batch``
  returning a malformed result. These change nothing in the turn (it goes on exactly as
  before); they are logged and counted (:func:`tolerated_violation`).

An object that is not an engine at all never gets this far: it is refused before the turn
starts, in both modes (:func:`~codex_turn.harness.engine.resolve_engine`).

Strict mode
-----------
A turn (``TurnParams.strict``) or a compaction (``CompactSessionParams.strict``) runs inside
:func:`watch_contract`, which collects the violations :func:`engine_fault` records, in order.
Without ``strict`` nothing else happens: each violation is a warning line with
``contract_violation=True``. With ``strict`` the run still ends on its usual fallback path,
so a strict failure keeps every safety guarantee of a turn (the user's prompt is in the
transcript, Codex's reply is mirrored, the engine is finalized, ``on_turn_end`` sees the
result), and then the *first* violation is raised as
:class:`~codex_turn.harness.engine.EngineContractViolation`, carrying the run's result.
Strict mode never changes what a run does, only how it ends. A caller's cancellation wins
over a violation.

The watch lives in a context variable, so the stages and the shielded cleanup tasks a turn
spawns report into it without being handed it. Deferred (background) maintenance runs
:func:`unwatched`: it belongs to no run, and its violations are only logged. A
harness-neutral runner that calls the lifecycle helpers itself gets strict mode the same
way::

    with watch_contract(strict=True) as watch:
        outcome = await assemble_context_engine(engine=engine, ...)
    watch.raise_first()
"""

from __future__ import annotations

import contextlib
import contextvars
import sqlite3
from collections.abc import Iterator
from typing import Any, Final

from codex_turn._log import format_error, redact_text
from codex_turn.harness.engine.contract import (
    EngineContractViolation,
    EngineUnavailable,
    InvalidEngineResult,
)
from codex_turn.harness.engine.validation import engine_id, engine_log_fields
from codex_turn.harness.session import SessionError

__all__ = [
    "OPERATIONAL_FAULTS",
    "ContractWatch",
    "engine_fault",
    "is_operational_fault",
    "tolerated_violation",
    "unwatched",
    "watch_contract",
]

#: Exception types that are the world's fault, not the engine's (see the module docstring).
OPERATIONAL_FAULTS: Final[tuple[type[BaseException], ...]] = (
    OSError,
    sqlite3.OperationalError,
    SessionError,
    EngineUnavailable,
)

_TOLERATED: Final = "context engine returned an invalid result; ignored"


def is_operational_fault(error: BaseException) -> bool:
    """True for a fault of the engine's environment; False for a contract violation."""
    return isinstance(error, OPERATIONAL_FAULTS)


class ContractWatch:
    """The contract violations seen during one run (a turn, or a compaction), in order."""

    def __init__(self, *, strict: bool) -> None:
        self.strict = strict
        self.violations: list[EngineContractViolation] = []
        self.closed = False

    def record(self, violation: EngineContractViolation) -> None:
        if not self.closed:
            self.violations.append(violation)

    @property
    def first(self) -> EngineContractViolation | None:
        return self.violations[0] if self.violations else None

    def raise_first(self, result: Any = None) -> None:
        """Strict: raise the first violation (with ``result`` attached); else do nothing."""
        first = self.first
        if not self.strict or first is None:
            return
        first.result = result
        first.later = len(self.violations) - 1
        raise first


_watch: contextvars.ContextVar[ContractWatch | None] = contextvars.ContextVar(
    "codex_turn_contract_watch", default=None
)


@contextlib.contextmanager
def watch_contract(*, strict: bool) -> Iterator[ContractWatch]:
    """Collect the violations of the code run inside (and of the tasks it spawns)."""
    watch = ContractWatch(strict=strict)
    token = _watch.set(watch)
    try:
        yield watch
    finally:
        watch.closed = True
        _watch.reset(token)


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """Run the code inside outside any watch (deferred maintenance: it belongs to no run)."""
    token = _watch.set(None)
    try:
        yield
    finally:
        _watch.reset(token)


def engine_fault(
    log: Any,
    message: str,
    *,
    engine: object,
    method: str,
    error: Exception,
    session_key: str | None,
    **fields: Any,
) -> str:
    """The one decision for a caught engine fault: log it, classify it, record a violation.

    Logs ``message`` as a warning with the engine's fields, the redacted ``error`` and
    ``contract_violation``; returns the redacted error text for the caller's outcome.
    """
    text = format_error(error)
    violation = not is_operational_fault(error)
    if violation:
        _record(engine, method, text, error)
    log.warning(
        message,
        **engine_log_fields(
            engine, session_key, method=method, **fields, error=text, contract_violation=violation
        ),
    )
    return text


def tolerated_violation(
    log: Any, *, engine: object, method: str, problem: str, session_key: str | None
) -> None:
    """A result the lifecycle goes on without, though the contract forbids it: logged and
    recorded; the caller's outcome does not change."""
    error = InvalidEngineResult(engine_id(engine), method, problem)
    text = format_error(error)
    _record(engine, method, text, error)
    log.warning(
        _TOLERATED,
        **engine_log_fields(
            engine, session_key, method=method, error=text, contract_violation=True
        ),
    )


def _record(engine: object, method: str, text: str, error: BaseException) -> None:
    watch = _watch.get()
    if watch is None:
        return
    if isinstance(error, InvalidEngineResult):
        problem = f"returned an invalid result: {redact_text(error.problem)}"
    else:
        problem = f"raised {text}"  # already redacted (format_error)
    violation = EngineContractViolation(engine_id(engine), method, problem)
    violation.__cause__ = error
    watch.record(violation)
