"""Errors of the state machines: illegal orderings and concurrent misuse."""

from __future__ import annotations

from transitions.core import MachineError

from codex_turn.errors import CodexTurnError

__all__ = ["FsmError", "IllegalTransition", "TurnBusy"]


class FsmError(CodexTurnError):
    """Base class of the state-machine errors."""


class IllegalTransition(MachineError, FsmError):
    """A trigger that the table does not allow from the current state under the current facts.

    Raised for an unknown trigger, a trigger with no edge out of the current state, and a
    trigger whose every edge is closed by its guards. The model's state is unchanged.
    """

    def __init__(self, state: str, trigger: str, *, why: str = "no edge from this state") -> None:
        super().__init__(f"trigger {trigger!r} is not legal in state {state!r}: {why}")
        self.state = state
        self.trigger = trigger
        self.why = why

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_illegal, (self.state, self.trigger, self.why))


def _rebuild_illegal(state: str, trigger: str, why: str) -> IllegalTransition:
    return IllegalTransition(state, trigger, why=why)


class TurnBusy(FsmError):
    """A second trigger (or a second turn) arrived while the first was still in progress.

    Like trio's ``BusyResourceError``: concurrent misuse is reported, never queued silently.
    """
