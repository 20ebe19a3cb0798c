"""Shared machinery for the table-driven machines in this package.

Theory: each machine in ``codex_turn.fsm`` is a *table*, a mapping from source state to the
edges leaving it, declared as data in its own module. The table lookup is the runtime: one
function, :meth:`TableMachine.select`, finds the edge a trigger takes (the first whose guards
hold) and both :meth:`Model.fire` and :meth:`Model.allows` ask it, so a guard is evaluated by
one piece of code only. ``transitions`` holds the states and the table's transitions (the
diagrams are drawn from the same tables, :mod:`codex_turn.diagrams`) and is driven only
through its public API (``set_state``); no private hook of it is overridden. Models get a
single entry point, :meth:`Model.fire`, in the spirit of h2's ``process_input``:

* an unknown trigger, a trigger with no edge from the current state, and a trigger whose every
  edge is closed by its guards all raise :class:`IllegalTransition`, and the state is
  unchanged (``transitions`` alone would return ``False`` for a guard miss);
* a trigger fired while another is still being processed on the same model raises
  :class:`TurnBusy` (trio's ``ConflictDetector``);
* every accepted trigger appends a :class:`TraceEntry`; reaching a final state detaches the
  model from the shared machine, so a long-lived process holds only live models (a runner
  that abandons a run calls ``close()``, or uses the model as a context manager).

Models are attached with a lean ``add_model`` that binds no convenience methods (no
``to_<state>``, ``may_<trigger>`` or ``is_<state>`` partials): ``fire`` is the only way in,
and attaching costs a few microseconds instead of one partial per trigger and state.
No I/O and no async here: the orchestrator awaits work, then fires a past-tense trigger.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Self

import attrs
from transitions import Machine

from codex_turn.fsm.errors import IllegalTransition, TurnBusy

__all__ = ["Edge", "Model", "TableMachine", "TraceEntry", "table_to_transitions"]


@attrs.frozen
class Edge:
    """One row of a table: ``trigger`` leads to ``dest`` when every guard in ``when`` is true
    and every guard in ``unless`` is false. ``dest=None`` is an internal transition (the state
    does not change; the trigger is still traced). Edges sharing a trigger are tried in order.
    """

    trigger: str = attrs.field(converter=str)  # StrEnum members become plain names
    dest: enum.Enum | None
    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()


# Keys are the members of one state Enum (Mapping is invariant in its key type, hence Any).
Table = Mapping[Any, Sequence[Edge]]

# The model attribute ``transitions`` maintains: the current state's *name*.
STATE_ATTRIBUTE = "state_name"


class TraceEntry(NamedTuple):
    """One accepted trigger: where the model was, what fired, where it went, and when.

    A named tuple, not an attrs class: one is built per trigger on the hot path.
    """

    state: str
    trigger: str
    dest: str
    monotonic_ns: int


def table_to_transitions(table: Table) -> list[dict[str, Any]]:
    """The ``transitions`` form of a table, in declaration order."""
    rows: list[dict[str, Any]] = []
    for source, edges in table.items():
        for edge in edges:
            rows.append(
                {
                    "trigger": edge.trigger,
                    "source": source.name,
                    "dest": None if edge.dest is None else edge.dest.name,
                    "conditions": list(edge.when),
                    "unless": list(edge.unless),
                }
            )
    return rows


class TableMachine(Machine):
    """A ``transitions.Machine`` built from a table, shared by every model of one kind."""

    def __init__(
        self,
        *,
        name: str,
        states: type[enum.Enum],
        table: Table,
        initial: enum.Enum,
        final: Iterable[enum.Enum],
    ) -> None:
        missing = set(states) - set(table)
        if missing:  # h11's rule: every state is listed, dead ends as empty rows
            raise ValueError(
                f"table {name!r} does not list states {sorted(s.name for s in missing)}"
            )
        self.table = table
        self.state_enum = states
        # The edges by (source name, trigger), in declaration order: select()'s lookup.
        self.edges: dict[tuple[str, str], tuple[Edge, ...]] = {}
        for source, source_edges in table.items():
            for edge in source_edges:
                key = (source.name, edge.trigger)
                self.edges[key] = (*self.edges.get(key, ()), edge)
        self.triggers = frozenset(edge.trigger for edges in table.values() for edge in edges)
        self.final_states = frozenset(state.name for state in final)
        # Live models by identity. ``transitions`` keeps a list (O(n) removal); the shared
        # machine never re-binds models, so a dict is all attachment needs to be.
        self.live: dict[int, Any] = {}
        # States are registered by *name*: ``transitions`` resolves Enum states through
        # descriptor lookups on every trigger (a third of its cost); models expose the Enum.
        super().__init__(
            model=None,
            states=[state.name for state in states],
            initial=initial.name,
            model_attribute=STATE_ATTRIBUTE,
            transitions=table_to_transitions(table),
            auto_transitions=False,
            ignore_invalid_triggers=False,
            send_event=False,
            name=name,
        )

    def initial_state_enum(self) -> enum.Enum:
        return self.state_enum[str(self.initial)]

    def add_model(self, model: Any, initial: Any = None) -> None:
        """Attach ``model`` in ``initial`` without binding convenience methods (see header)."""
        name = str(self.initial) if initial is None else getattr(initial, "name", initial)
        self.set_state(name, model=model)
        self.live[id(model)] = model

    def remove_model(self, model: Any) -> None:
        """Detach ``model``; O(1), and a no-op for a model that is not attached."""
        self.live.pop(id(model), None)

    def select(self, model: Any, trigger: str) -> Edge:
        """The edge ``trigger`` takes from ``model``'s state: the first whose guards hold.

        Raises :class:`IllegalTransition` (state unchanged) for an unknown trigger, a trigger
        with no edge from this state, and a trigger whose every edge is closed by its guards.
        """
        source: str = getattr(model, STATE_ATTRIBUTE)
        edges = self.edges.get((source, trigger))
        if edges is None:
            why = "no edge from this state" if trigger in self.triggers else "unknown trigger"
            raise IllegalTransition(source, trigger, why=why)
        for edge in edges:
            if all(getattr(model, guard) for guard in edge.when) and not any(
                getattr(model, guard) for guard in edge.unless
            ):
                return edge
        raise IllegalTransition(source, trigger, why="guards are closed")

    def take(self, model: Any, edge: Edge) -> None:
        """Move ``model`` along ``edge`` (an internal edge leaves the state as it is)."""
        if edge.dest is not None:
            self.set_state(edge.dest.name, model=model)


@attrs.define(eq=False, slots=False)
class Model:
    """Base of the per-run models: current state, trace, busy guard. Subclasses set ``machine``."""

    machine: ClassVar[TableMachine]

    state_name: str = attrs.field(init=False, default="")
    trace: list[TraceEntry] = attrs.field(init=False, factory=list)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    _attached: bool = attrs.field(init=False, default=False, repr=False)

    def _attach(self, initial: enum.Enum | None) -> None:
        self.machine.add_model(self, initial)
        self._attached = True
        if self.is_terminal:
            self._detach()

    def _detach(self) -> None:
        if self._attached:
            self.machine.remove_model(self)
            self._attached = False

    def close(self) -> None:
        """Detach an unfinished run (a runner abandoning a turn); finished runs detach alone."""
        self._detach()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._detach()

    @property
    def state(self) -> Any:
        """The current state, as a member of the machine's state Enum."""
        return self.machine.state_enum[self.state_name]

    @property
    def is_terminal(self) -> bool:
        return self.state_name in self.machine.final_states

    def fire(self, trigger: str) -> None:
        """Apply ``trigger``; raise :class:`IllegalTransition` or :class:`TurnBusy` if it can't."""
        if not self._lock.acquire(blocking=False):
            raise TurnBusy(f"{type(self).__name__} is processing another trigger")
        try:
            name = str(trigger)
            source = self.state_name
            if not self._attached:
                # Finished models are detached; nothing may follow a final state.
                raise IllegalTransition(source, name, why="the run has ended")
            self.machine.take(self, self.machine.select(self, name))
            self.trace.append(TraceEntry(source, name, self.state_name, time.monotonic_ns()))
            self._on_fired(name)
            if self.is_terminal:
                self._detach()
        finally:
            self._lock.release()

    def allows(self, trigger: str) -> bool:
        """Whether ``trigger`` would be accepted now (its edge exists and its guards hold).

        The orchestrator asks this instead of re-deriving a branch: the table decides.
        """
        if not self._attached:
            return False
        try:
            self.machine.select(self, str(trigger))
        except IllegalTransition:
            return False
        return True

    def _on_fired(self, trigger: str) -> None:
        """Hook for subclasses: record facts that a trigger establishes (outcomes, counts)."""

    def path(self) -> list[str]:
        """The states visited, starting with the initial one (internal transitions collapse)."""
        if not self.trace:
            return [self.state_name]
        states = [self.trace[0].state]
        for entry in self.trace:
            if entry.dest != states[-1]:
                states.append(entry.dest)
        return states
