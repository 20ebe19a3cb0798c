"""The one driver of every table machine: steps, the observer, and each shelter, on the turn
table with scripted stages (the turn and compaction suites run it with real ones).

The protected shelter's guarantee is pinned here at its source: consecutive protected states
run in ONE shielded child task, unbounded while the caller waits, bounded by the cleanup
timeout once the caller is gone, with one deadline for all of them, then cut short with the
table's trigger."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar

import anyio
import attrs
import pytest
from structlog.testing import capture_logs

from codex_turn.fsm import TraceEntry, TurnFacts, TurnModel, TurnState, TurnTrigger
from codex_turn.harness.driver import Caller, Row, Shelter, drive, stage_table, step

pytestmark = pytest.mark.anyio

S = TurnState
T = TurnTrigger

#: An engine that maintains, in the foreground: every stage of the table is reached.
MAINTAINING = TurnFacts(engine_active=True, engine_maintains=True)


@attrs.define
class Ctx:
    """The run's context and the caller's record (a turn's context has both)."""

    cancellation: BaseException | None = None
    cleanup_deadline: float | None = None
    #: Each stage that ran, and the task mark it found (:func:`ran_in`).
    ran: list[tuple[TurnState, str | None]] = attrs.Factory(list)


#: Which task a stage runs in: each stage reads the mark it finds, then marks its task with
#: its own state. A task group's child starts with a copy of its parent's context, so a
#: stage sees the mark of the stage before it exactly when it runs in the same task.
_TASK_MARK: ContextVar[str | None] = ContextVar("task_mark", default=None)


def ran_in(ctx: Ctx, state: TurnState) -> None:
    ctx.ran.append((state, _TASK_MARK.get()))
    _TASK_MARK.set(state.name)


Stage = Callable[[Ctx], Awaitable[TurnTrigger]]


def returns(state: TurnState, trigger: TurnTrigger, *, sleep: float = 0.0) -> Stage:
    async def stage(ctx: Ctx) -> TurnTrigger:
        ran_in(ctx, state)
        if sleep:
            await anyio.sleep(sleep)
        return trigger

    return stage


def rows(**stages: Stage) -> dict[TurnState, Row[Ctx, TurnTrigger]]:
    """The turn's shelters, with stages that complete a foreground-maintained turn; any of
    them replaced by name."""
    plan: dict[TurnState, tuple[TurnTrigger, Shelter]] = {
        S.IDLE: (T.STARTED, Shelter.EXPOSED),
        S.READING_HISTORY: (T.HISTORY_READ, Shelter.CANCELLABLE),
        S.BOOTSTRAPPING: (T.BOOTSTRAP_SKIPPED, Shelter.CANCELLABLE),
        S.ASSEMBLING: (T.ASSEMBLED, Shelter.CANCELLABLE),
        S.PROJECTING: (T.PROJECTED, Shelter.CANCELLABLE),
        S.BUILDING_PROMPT: (T.PROMPT_BUILT, Shelter.CANCELLABLE),
        S.STARTING_THREAD: (T.THREAD_STARTED, Shelter.CANCELLABLE),
        S.REPROJECTING: (T.REPROJECTED, Shelter.CANCELLABLE),
        S.RUNNING_TURN: (T.TURN_COMPLETED, Shelter.SELF),
        S.MIRRORING: (T.MIRRORED, Shelter.PROTECTED),
        S.FINALIZING: (T.FINALIZED, Shelter.PROTECTED),
        S.MAINTAINING: (T.MAINTENANCE_RAN, Shelter.UNLESS_GONE),
    }
    table: dict[TurnState, Row[Ctx, TurnTrigger]] = {}
    for state, (trigger, shelter) in plan.items():
        stage = stages.get(state.name.lower(), returns(state, trigger))
        still = T.MAINTENANCE_DEFERRED if state is S.MAINTAINING else None
        table[state] = Row(stage, shelter, still_runs_if=still)
    return table


async def run(
    table: dict[TurnState, Row[Ctx, TurnTrigger]],
    *,
    facts: TurnFacts = MAINTAINING,
    cleanup_timeout: float = 10.0,
    observe: Callable[[TraceEntry], object] | None = None,
) -> tuple[TurnModel, Ctx, list[str]]:
    turn = TurnModel.begin(facts)
    ctx = Ctx()
    cut: list[str] = []

    def cut_short() -> TurnTrigger:
        trigger = turn.cut_short_trigger()
        assert trigger is not None
        cut.append(turn.state_name)
        return trigger

    caller = Caller(record=ctx, cleanup_timeout=cleanup_timeout, cut_short=cut_short)
    await drive(turn, stage_table(TurnModel, table), ctx, observe=observe, caller=caller)
    return turn, ctx, cut


def triggers(turn: TurnModel) -> list[str]:
    return [entry.trigger for entry in turn.trace]


# --- the loop ---------------------------------------------------------------------------------


async def test_every_step_is_fired_and_shown_to_the_observer() -> None:
    seen: list[TraceEntry] = []
    turn, ctx, cut = await run(rows(), observe=seen.append)
    assert turn.path() == [
        "IDLE",
        "READING_HISTORY",
        "BOOTSTRAPPING",
        "ASSEMBLING",
        "PROJECTING",
        "BUILDING_PROMPT",
        "STARTING_THREAD",
        "RUNNING_TURN",
        "MIRRORING",
        "FINALIZING",
        "MAINTAINING",
        "DONE",
    ]
    assert seen == turn.trace
    assert cut == []
    assert ctx.cancellation is None


async def test_a_failing_observer_never_breaks_the_run() -> None:
    def broken(entry: TraceEntry) -> None:
        raise RuntimeError("observer down")

    with capture_logs() as logs:
        turn, _, _ = await run(rows(), observe=broken)
    assert turn.state is S.DONE
    failures = [e for e in logs if e["event"] == "transition observer failed"]
    assert len(failures) == len(turn.trace)


def test_step_fires_then_observes() -> None:
    turn = TurnModel.begin()
    seen: list[TraceEntry] = []
    step(turn, T.STARTED, seen.append)
    assert seen == turn.trace
    assert turn.state is S.READING_HISTORY
    turn.close()


def test_a_stage_table_lists_every_non_final_state_and_no_other() -> None:
    table = rows()
    assert set(stage_table(TurnModel, table)) == set(table)
    del table[S.REPROJECTING]
    with pytest.raises(ValueError, match="REPROJECTING"):
        stage_table(TurnModel, table)
    with pytest.raises(ValueError, match="DONE"):
        stage_table(TurnModel, {**rows(), S.DONE: Row(returns(S.DONE, T.STARTED))})


async def test_a_sheltered_table_is_driven_with_a_caller() -> None:
    turn = TurnModel.begin(MAINTAINING)
    with pytest.raises(TypeError, match="Caller"):
        await drive(turn, stage_table(TurnModel, rows()), Ctx())
    turn.close()


async def test_an_exposed_stage_lets_the_cancellation_through() -> None:
    scope = anyio.CancelScope()

    async def leaves(ctx: Ctx) -> TurnTrigger:
        scope.cancel()
        await anyio.sleep(10)
        raise AssertionError("cancelled above")

    turn = TurnModel.begin(MAINTAINING)
    table = {state: Row(row.stage) for state, row in rows(reading_history=leaves).items()}
    with scope:
        await drive(turn, stage_table(TurnModel, table), Ctx())
    assert scope.cancelled_caught
    assert triggers(turn) == [T.STARTED]  # the stage was cut, nothing fired for it
    turn.close()


# --- the shelters -----------------------------------------------------------------------------


async def test_a_cancellable_stage_is_cut_short_with_the_tables_trigger() -> None:
    scope = anyio.CancelScope()

    async def leaves(ctx: Ctx) -> TurnTrigger:
        scope.cancel()
        await anyio.sleep(10)
        raise AssertionError("cancelled above")

    with scope:
        turn, ctx, cut = await run(rows(assembling=leaves))
    assert triggers(turn)[-1] == T.CANCELLED
    assert turn.state is S.FAILED
    assert cut == ["ASSEMBLING"]
    assert isinstance(ctx.cancellation, anyio.get_cancelled_exc_class())


class CallerLeft(Exception):
    """Stands for the cancellation running_turn caught (a backend's own is not constructible)."""


async def caller_left(ctx: Ctx) -> TurnTrigger:
    """running_turn's own shelter: it catches the caller's cancellation and records it."""
    ran_in(ctx, S.RUNNING_TURN)
    ctx.cancellation = CallerLeft()
    return T.TURN_ABORTED


async def test_consecutive_protected_states_share_one_child_task_and_one_deadline() -> None:
    # The caller left during the Codex turn: the mirror takes 0.3 s of the 0.5 s bound, and
    # the finalize only the 0.2 s left of the same deadline (not a bound of its own).
    table = rows(
        running_turn=caller_left,
        mirroring=returns(S.MIRRORING, T.MIRRORED, sleep=0.3),
        finalizing=returns(S.FINALIZING, T.FINALIZED, sleep=10),
    )
    started = anyio.current_time()
    turn, ctx, cut = await run(table, cleanup_timeout=0.5)
    elapsed = anyio.current_time() - started
    assert triggers(turn)[-3:] == [T.TURN_ABORTED, T.MIRRORED, T.FINALIZE_FAILED]
    assert turn.state is S.DONE
    assert cut == ["FINALIZING"]
    assert 0.45 <= elapsed < 0.75, elapsed
    assert ctx.cleanup_deadline is not None
    found = dict(ctx.ran)
    assert found[S.FINALIZING] == "MIRRORING"  # one child task for both


async def test_protected_states_run_in_a_child_task_of_their_own() -> None:
    turn, ctx, _ = await run(rows())
    found = dict(ctx.ran)
    assert found[S.MIRRORING] == "RUNNING_TURN"  # started from the driver's task ...
    assert found[S.FINALIZING] == "MIRRORING"  # ... one task for both ...
    assert found[S.MAINTAINING] == "RUNNING_TURN"  # ... and not the driver's own
    assert turn.state is S.DONE


async def test_protected_states_are_unbounded_while_the_caller_waits() -> None:
    table = rows(
        mirroring=returns(S.MIRRORING, T.MIRRORED, sleep=0.2),
        finalizing=returns(S.FINALIZING, T.FINALIZED, sleep=0.2),
    )
    turn, ctx, cut = await run(table, cleanup_timeout=0.05)
    assert triggers(turn)[-3:] == [T.MIRRORED, T.FINALIZED, T.MAINTENANCE_RAN]
    assert cut == []
    assert ctx.cleanup_deadline is None


async def test_the_caller_leaving_while_protected_starts_the_one_deadline() -> None:
    scope = anyio.CancelScope()

    async def mirror_while_the_caller_leaves(ctx: Ctx) -> TurnTrigger:
        ran_in(ctx, S.MIRRORING)
        scope.cancel()
        await anyio.sleep(0.2)  # shielded: completes within the bound
        return T.MIRRORED

    table = rows(
        mirroring=mirror_while_the_caller_leaves,
        finalizing=returns(S.FINALIZING, T.FINALIZED, sleep=10),
    )
    started = anyio.current_time()
    with scope:
        turn, ctx, cut = await run(table, cleanup_timeout=0.5)
    elapsed = anyio.current_time() - started
    assert triggers(turn)[-3:] == [T.TURN_COMPLETED, T.MIRRORED, T.FINALIZE_FAILED]
    assert turn.state is S.DONE
    assert cut == ["FINALIZING"]
    assert isinstance(ctx.cancellation, anyio.get_cancelled_exc_class())
    assert 0.45 <= elapsed < 0.75, elapsed


async def test_a_protected_stage_that_raises_raises_as_itself() -> None:
    async def broken(ctx: Ctx) -> TurnTrigger:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        await run(rows(finalizing=broken))


@pytest.mark.parametrize(
    ("background", "started", "last"),
    [(False, False, T.MAINTENANCE_FAILED), (True, True, T.MAINTENANCE_DEFERRED)],
)
async def test_maintenance_is_not_started_once_the_caller_is_gone_unless_it_defers(
    background: bool, started: bool, last: TurnTrigger
) -> None:
    # The caller leaves during the (protected) finalize of a completed turn. A deferral to a
    # scheduler never blocks: it is handed over all the same.
    scope = anyio.CancelScope()

    async def finalize_while_the_caller_leaves(ctx: Ctx) -> TurnTrigger:
        scope.cancel()
        await anyio.sleep(0.01)
        return T.FINALIZED

    facts = attrs.evolve(MAINTAINING, background_maintenance=background)
    table = rows(
        finalizing=finalize_while_the_caller_leaves,
        maintaining=returns(S.MAINTAINING, T.MAINTENANCE_DEFERRED),
    )
    with scope:
        turn, ctx, cut = await run(table, facts=facts)
    assert triggers(turn)[-2:] == [T.FINALIZED, last]
    assert any(state is S.MAINTAINING for state, _ in ctx.ran) is started
    assert cut == ([] if started else ["MAINTAINING"])
    assert ctx.cancellation is not None


async def test_maintenance_the_caller_leaves_is_cut_short() -> None:
    scope = anyio.CancelScope()

    async def leaves(ctx: Ctx) -> TurnTrigger:
        scope.cancel()
        await anyio.sleep(10)
        raise AssertionError("cancelled above")

    with scope:
        turn, ctx, cut = await run(rows(maintaining=leaves))
    assert triggers(turn)[-1] == T.MAINTENANCE_FAILED
    assert cut == ["MAINTAINING"]
    assert isinstance(ctx.cancellation, anyio.get_cancelled_exc_class())
