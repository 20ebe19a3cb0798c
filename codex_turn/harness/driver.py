"""The one way a table machine is driven: await the state's stage, fire its trigger, repeat.

Theory of operation. Every machine in :mod:`codex_turn.fsm` (the turn, compaction) is a table
that decides where a run goes after each step; this module is the loop that runs one, in the
shape of h2's ``stream.py``::

    while not model.is_terminal:
        step(model, await rows[model.state].stage(ctx))

A *row* (:class:`Row`) gives a non-final state its *stage*: an async function of the run's
context that does the I/O of that state and returns the past-tense trigger saying what
happened. Stages never fire, never read the trace and never choose the next state; the loop
never branches on a stage's result. Each step is shown to an observer (a turn's
``TurnHooks.on_transition``), whose errors are logged and never break the run.

A row also declares its stage's *shelter* (:class:`Shelter`): what the caller's cancellation
does to it. The shelter is data, applied here, by the one loop, to a *stretch*: the states a
run passes through in a row under the same shelter. A stretch is what a shelter wraps, so
consecutive protected states (a turn's mirroring, then finalizing) run in one shielded child
task, under one cleanup deadline, exactly as one protected state does. The shelters:

* ``EXPOSED``: nothing to shelter; the caller's cancellation propagates (compaction, whose
  native step bounds and interrupts itself; a turn's ``idle``);
* ``SELF``: the stage answers the caller itself, and the loop adds nothing (a turn's
  running_turn catches the cancellation, interrupts Codex, and ends the turn as aborted);
* ``CANCELLABLE``: the caller's cancellation is recorded and ends the stretch with the
  table's trigger for a stage cut short (before Codex: ``cancelled``);
* ``PROTECTED``: the stretch runs to its end despite the caller's cancellation, shielded in a
  child task; unbounded while the caller waits, bounded by the cleanup timeout once the
  caller is gone (one deadline for every protected stretch of the run), then ended with the
  table's cut-short trigger (OpenClaw #121515: the engine sees every turn that ran);
* ``UNLESS_GONE``: not started once the caller is gone, and cut short if the caller leaves;
  a row may name a trigger (``still_runs_if``) under which its stage starts all the same
  when the table allows it (a deferral to a scheduler never blocks).

What the shelters know of the caller is a :class:`Caller`: where its cancellation and the
cleanup deadline are recorded (the turn's context, so that the stage that catches a
cancellation itself records it in the same place), the cleanup timeout, and the table's
cut-short trigger for the current state. A table whose rows are all ``EXPOSED`` needs none.
No decision is taken here: the table chooses every route, the rows say how each state is
sheltered.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar

import anyio
import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm import TraceEntry
from codex_turn.fsm._machine import Model

__all__ = ["Caller", "CallerRecord", "Row", "Shelter", "drive", "stage_table", "step"]

_log = get_logger(__name__)

Ctx = TypeVar("Ctx")
Tr = TypeVar("Tr", bound=str)  # a machine's triggers: a StrEnum

Observer = Callable[[TraceEntry], object]


class Shelter(enum.Enum):
    """What the caller's cancellation does to a stage (see the module docstring)."""

    EXPOSED = "exposed"
    SELF = "self"
    CANCELLABLE = "cancellable"
    PROTECTED = "protected"
    UNLESS_GONE = "unless_gone"


@attrs.frozen
class Row(Generic[Ctx, Tr]):
    """A state's stage and its shelter. Calling a row runs its stage, unsheltered."""

    stage: Callable[[Ctx], Awaitable[Tr]]
    shelter: Shelter = Shelter.EXPOSED
    #: ``UNLESS_GONE`` only: the stage still starts after the caller left when the table
    #: allows this trigger now (a stage that cannot block need not be cut).
    still_runs_if: Tr | None = None

    def __call__(self, ctx: Ctx) -> Awaitable[Tr]:
        return self.stage(ctx)


class CallerRecord(Protocol):
    """Where a run records that its caller left, and the cleanup deadline that follows."""

    cancellation: BaseException | None
    cleanup_deadline: float | None


@attrs.frozen
class Caller(Generic[Tr]):
    """What the shelters need of the caller (see the module docstring)."""

    record: CallerRecord
    cleanup_timeout: float
    #: The table's trigger for the current state cut short.
    cut_short: Callable[[], Tr]


def stage_table(model: type[Model], rows: Mapping[Any, Row[Ctx, Tr]]) -> Mapping[Any, Row[Ctx, Tr]]:
    """``rows``, read-only, once checked against ``model``'s table: a row for every non-final
    state and for no final one (h11's rule, as :class:`~codex_turn.fsm._machine.TableMachine`
    checks its table)."""
    machine = model.machine
    wanted = {state for state in machine.state_enum if state.name not in machine.final_states}
    if set(rows) != wanted:
        missing = sorted(state.name for state in wanted - set(rows))
        extra = sorted(getattr(state, "name", str(state)) for state in set(rows) - wanted)
        raise ValueError(
            f"the stages of {machine.name!r} miss states {missing} or list others {extra}"
        )
    return MappingProxyType(dict(rows))


def step(model: Model, trigger: str, observe: Observer | None) -> None:
    """Take the step, then show it to the observer (never letting it break the run)."""
    model.fire(trigger)
    if observe is not None:
        try:
            observe(model.trace[-1])
        except Exception as error:
            _log.warning("transition observer failed", error=format_error(error))


async def drive(
    model: Model,
    rows: Mapping[Any, Row[Ctx, Tr]],
    ctx: Ctx,
    *,
    observe: Observer | None = None,
    caller: Caller[Tr] | None = None,
) -> None:
    """Drive ``model`` to a final state: each state's stage, sheltered as its row says."""
    run = _Run(model, rows, ctx, observe, caller)
    while not model.is_terminal:
        shelter = rows[model.state].shelter
        await _SHELTERED[shelter](run, shelter)


@attrs.define(eq=False)
class _Run(Generic[Ctx, Tr]):
    model: Model
    rows: Mapping[Any, Row[Ctx, Tr]]
    ctx: Ctx
    observe: Observer | None
    _caller: Caller[Tr] | None

    @property
    def caller(self) -> Caller[Tr]:
        if self._caller is None:
            raise TypeError("a table with sheltered stages is driven with a Caller")
        return self._caller

    async def stretch(self, shelter: Shelter) -> None:
        """The steps of the states the run passes through in a row under ``shelter``."""
        model, rows = self.model, self.rows
        while not model.is_terminal and (row := rows[model.state]).shelter is shelter:
            step(model, await row.stage(self.ctx), self.observe)

    def cut_short(self) -> None:
        step(self.model, self.caller.cut_short(), self.observe)


# --- the shelters ------------------------------------------------------------------------------


async def _exposed(run: _Run[Any, Any], shelter: Shelter) -> None:
    await run.stretch(shelter)


async def _cancellable(run: _Run[Any, Any], shelter: Shelter) -> None:
    record = run.caller.record
    try:
        await run.stretch(shelter)
    except anyio.get_cancelled_exc_class() as error:
        record.cancellation = error
        run.cut_short()


async def _protected(run: _Run[Any, Any], shelter: Shelter) -> None:
    if not await _shielded(run.caller, lambda: run.stretch(shelter)):
        run.cut_short()


async def _unless_gone(run: _Run[Any, Any], shelter: Shelter) -> None:
    record = run.caller.record
    runs_anyway = run.rows[run.model.state].still_runs_if
    if record.cancellation is None or (runs_anyway is not None and run.model.allows(runs_anyway)):
        try:
            await run.stretch(shelter)
            return
        except anyio.get_cancelled_exc_class() as error:
            record.cancellation = error
    run.cut_short()


_SHELTERED: Mapping[Shelter, Callable[[_Run[Any, Any], Shelter], Awaitable[None]]] = {
    Shelter.EXPOSED: _exposed,
    Shelter.SELF: _exposed,
    Shelter.CANCELLABLE: _cancellable,
    Shelter.PROTECTED: _protected,
    Shelter.UNLESS_GONE: _unless_gone,
}


def _cleanup_deadline(caller: Caller[Any]) -> float:
    """The run's one cleanup deadline, set when first asked for (the caller is gone)."""
    record = caller.record
    if record.cleanup_deadline is None:
        record.cleanup_deadline = anyio.current_time() + caller.cleanup_timeout
    return record.cleanup_deadline


async def _shielded(caller: Caller[Any], work: Callable[[], Awaitable[None]]) -> bool:
    """``work`` in a shielded child task: unbounded while the caller waits, bounded by the
    cleanup deadline once the caller is gone (one deadline for all protected stretches).
    Whether it completed (``False``: the deadline cut it). Its exception is raised as itself."""
    cancelled = anyio.get_cancelled_exc_class()
    record = caller.record
    scope = anyio.CancelScope(shield=True)
    if record.cancellation is not None:
        scope.deadline = _cleanup_deadline(caller)
    done = anyio.Event()
    completed: list[bool] = []
    failures: list[BaseException] = []

    async def worker() -> None:
        with scope:
            try:
                await work()
                completed.append(True)
            except cancelled:
                raise  # the cleanup deadline: the scope catches it
            except BaseException as error:
                # Re-raised below, outside the task group, as itself: a task group would
                # wrap it in an exception group the runner does not expect.
                failures.append(error)
            finally:
                done.set()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(worker)
            try:
                await done.wait()
            except cancelled as error:
                # The caller left meanwhile: the work gets the cleanup bound, no more.
                record.cancellation = record.cancellation or error
                scope.deadline = min(scope.deadline, _cleanup_deadline(caller))
                with anyio.CancelScope(shield=True):
                    await done.wait()
                raise
    except cancelled as error:
        record.cancellation = record.cancellation or error
    if failures:
        raise failures[0]
    return bool(completed)
