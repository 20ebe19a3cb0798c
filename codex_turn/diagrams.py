"""Render the state diagrams from the tables: ``codex-turn diagrams [--out DIR]``.

``python -m codex_turn diagrams`` is the same command. Rendering lives outside
:mod:`codex_turn.fsm`, which stays tables; the command itself is the CLI's. Without ``--out``
it rewrites the ``diagrams/`` of the source checkout it runs from, and refuses to run
anywhere else (an installed package writes only where it is told to).

The diagrams are *generated*, never drawn by hand, from the very same tables as the runtime
machines; the output is byte-stable (a test renders it under several hash seeds).

Writes ``turn.mmd``, ``compaction.mmd``, ``steering.mmd`` and the supervision machines'
``branch.mmd``, ``archive.mmd`` and ``diagnostics.mmd`` (Mermaid ``flowchart TB``: the text
source, golden files checked by a test, rendered by GitHub), then the rule tables' (below),
and, when the ``diagrams`` extra (pygraphviz, which bundles Graphviz) is installed, an ``.svg``
of each from the same drawing (:func:`layout`, :func:`chart`), so the two cannot disagree.

How a table becomes a drawing, all of it derived from the tables:

* **The spine** is the path of a run that goes well: from the initial state, each state's
  *first* row that leaves it (the tables declare the success first), until a final state.
  For the turn that is a completed turn; a test fires it on a real model to prove it. The
  spine is drawn as a straight, bold column.
* Every other row is an arrow of its own kind: a **branch** (dashed, grey) goes to another
  state of the run; a **failure** (dashed, red) ends in a final state that is not the spine's
  end (the turn's ``failed``); an **internal** row (no state change) is a dotted self-loop.
  Rows between the same two states share one arrow, one row per label line, except the
  spine's: a spine arrow carries the spine's row alone, and the other rows between those two
  states (``turn_failed``, ``mirror_failed`` ...) are a dashed arrow beside it; a row every
  state of a phase has (the turn's ``cancelled`` before Codex) is one arrow from the phase's
  box.
* Layout (SVG): a detour (reprojecting) sits level with the spine state it returns to, a
  failure end (failed) level with the spine state before the last one that can fail, so no
  arrow crosses the page; the ranks are spread until the drawing is no wider than tall, and a
  drawing wider than 750 pt (1000 px) is scaled down to fit.
* States are grouped by **phase** (:data:`PHASES`, the one hand-written part: a reader's
  grouping, not a decision), each phase a box. No state is styled as current: a diagram
  shows the machine, not a run.
* A machine's decision tables that are not rows become remarks on the rows they choose, in
  parentheses: ``turn_aborted  (Codex: interrupted)``, ``mirror_failed  (cut short)``.

The first-match rule tables (:data:`RULE_DIAGRAMS`: ``THREAD_RULES``, ``CONTINUITY_RULES``,
the native hooks' ``INJECT_RULES`` and ``ANSWER_RULES``, the fork tables, ``NATIVE_RULES``)
change a run's course without being any machine's rows; each is a flowchart of its own
(``thread_rules.mmd`` ...), drawn as :func:`decide` reads it:

* one question per row, in table order, labelled with the facts that must hold and, as
  ``!fact``, those that must not; ``yes`` (bold) goes to the row's answer (its action, its
  reason, and for a thread decision whether it keeps the raw prompt or the binding), ``no``
  (dashed) to the next row; the unconditional last row is the final ``otherwise``, with no
  ``no``. A row and its answer are drawn level, so the questions form one column.
* ``run_fates.mmd`` is :data:`~codex_turn.fsm.steering.RUN_FATES` (run kind x queue mode ->
  fate): a box per run kind, a line per mode, stacked.

Both come from one drawing (:func:`chart`), like the machines'; :func:`write_diagrams` writes
the machines and the tables.
"""

from __future__ import annotations

import enum
import html
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from codex_turn.fsm import Edge, TableMachine
from codex_turn.fsm.compaction import COMPACTION_MACHINE, NATIVE_RULES
from codex_turn.fsm.hooks import ANSWER_RULES, INJECT_RULES
from codex_turn.fsm.steering import (
    RUN_FATES,
    STEERING_MACHINE,
    RunKind,
    SteerFate,
    SteerMode,
)
from codex_turn.fsm.supervision import ARCHIVE_MACHINE, BRANCH_MACHINE, DIAGNOSTICS_MACHINE
from codex_turn.fsm.thread import (
    BASE_RULES,
    CONTINUITY_RULES,
    FORK_RULES,
    FORM_RULES,
    KEEP_RULES,
    THREAD_RULES,
    Choice,
    Rule,
    ThreadDecision,
)
from codex_turn.fsm.turn import (
    CUT_SHORT_TRIGGERS,
    FORM_TRIGGERS,
    RUN_END_TRIGGERS,
    THREAD_TRIGGERS,
    TURN_MACHINE,
    TurnState,
    TurnTrigger,
)

__all__ = [
    "DIAGRAMS",
    "FATES_DIAGRAM",
    "PHASES",
    "RULE_DIAGRAMS",
    "Arrow",
    "ArrowKind",
    "Chart",
    "ChartLink",
    "ChartNode",
    "Drawing",
    "LinkKind",
    "NodeKind",
    "Row",
    "chart",
    "decision_lines",
    "fate_label",
    "layout",
    "render_chart_dot",
    "render_chart_mermaid",
    "render_chart_svg",
    "render_dot",
    "render_mermaid",
    "render_svg",
    "rule_facts",
    "spine",
    "write_diagrams",
]

DIAGRAMS: dict[str, TableMachine] = {
    "turn": TURN_MACHINE,
    "compaction": COMPACTION_MACHINE,
    "steering": STEERING_MACHINE,
    "branch": BRANCH_MACHINE,
    "archive": ARCHIVE_MACHINE,
    "diagnostics": DIAGNOSTICS_MACHINE,
}

#: The boxes states are drawn in, per diagram, in drawing order: a reader's grouping, not a
#: decision. States in no phase (the initial and final ones) are drawn outside the boxes. The
#: compaction machine has none: its states already say whose they are (``engine_*``,
#: ``native_*``), and boxes around single states only widen it.
PHASES: dict[str, tuple[tuple[str, tuple[enum.Enum, ...]], ...]] = {
    "turn": (
        (
            "before Codex",
            (
                TurnState.READING_HISTORY,
                TurnState.BOOTSTRAPPING,
                TurnState.ASSEMBLING,
                TurnState.PROJECTING,
                TurnState.BUILDING_PROMPT,
            ),
        ),
        ("Codex", (TurnState.STARTING_THREAD, TurnState.REPROJECTING, TurnState.RUNNING_TURN)),
        ("after Codex", (TurnState.MIRRORING, TurnState.FINALIZING, TurnState.MAINTAINING)),
    ),
}


class ArrowKind(enum.Enum):
    SPINE = "spine"  # the run that goes well
    BRANCH = "branch"  # another way through the run
    FAILURE = "failure"  # ends in a final state other than the spine's end
    INTERNAL = "internal"  # no state change


#: Remarks on rows from a machine's decision tables that are not rows, by (state, trigger).
Remarks = dict[tuple[enum.Enum, str], tuple[str, ...]]


@attrs.frozen
class Row:
    """One table row as a label line: ``trigger [guards]``, then its remarks in parentheses."""

    label: str
    remarks: tuple[str, ...] = ()

    def line(self) -> str:
        return f"{self.label}  ({'; '.join(self.remarks)})" if self.remarks else self.label


@attrs.frozen
class Arrow:
    """One drawn arrow: table rows from ``source`` to ``dest``, one label line each.

    ``key`` (``SOURCE->DEST``, the arrow's id in the SVG) names it; the other rows between two
    states of the spine, drawn beside the spine's arrow, have ``SOURCE->DEST:other``."""

    source: enum.Enum | str  # a state, or a phase's title: every state in it has the rows
    dest: enum.Enum  # ``source`` for internal rows
    kind: ArrowKind
    rows: tuple[Row, ...]
    key: str

    def lines(self) -> tuple[str, ...]:
        return tuple(row.line() for row in self.rows)


@attrs.frozen
class Drawing:
    """What both renderers draw: states, phases and arrows, in a stable order."""

    name: str
    title: str
    states: tuple[enum.Enum, ...]
    initial: enum.Enum
    final: frozenset[enum.Enum]
    spine: tuple[enum.Enum, ...]
    phases: tuple[tuple[str, tuple[enum.Enum, ...]], ...]
    arrows: tuple[Arrow, ...]

    def legend(self) -> str:
        kinds = {arrow.kind for arrow in self.arrows}
        parts = ["bold: the run that goes well", "dashed: the other rows"]
        if ArrowKind.FAILURE in kinds:
            ends = sorted(
                state_label(arrow.dest) for arrow in self.arrows if arrow.kind is ArrowKind.FAILURE
            )
            named = list(dict.fromkeys(ends))
            # Many ends (the steering machine's fates) would widen the page: name the spine's.
            said = (
                " or ".join(named)
                if len(named) <= 2
                else f"other than {state_label(self.spine[-1])}"
            )
            parts.append(f"red: ends {said}")
        if ArrowKind.INTERNAL in kinds:
            parts.append("dotted loop: the state does not change")
        return " · ".join(parts)


def row_label(edge: Edge) -> str:
    """A row as one label line: ``trigger [guard & !other]``."""
    guards = [*edge.when, *(f"!{guard}" for guard in edge.unless)]
    return f"{edge.trigger} [{' & '.join(guards)}]" if guards else edge.trigger


def state_label(state: enum.Enum) -> str:
    return state.value if isinstance(state.value, str) else state.name.lower()


def spine(machine: TableMachine) -> tuple[tuple[enum.Enum, Edge], ...]:
    """The run that goes well, as ``(source, row)`` pairs: from the initial state, each
    state's first row that leaves it, until a final state (or a state already on the path)."""
    table = machine.table
    state = machine.initial_state_enum()
    path: list[tuple[enum.Enum, Edge]] = []
    seen = {state}
    while state.name not in machine.final_states:
        edge = next((e for e in table[state] if e.dest is not None and e.dest != state), None)
        if edge is None or edge.dest is None or edge.dest in seen:
            break
        path.append((state, edge))
        state = edge.dest
        seen.add(state)
    return tuple(path)


def _lifted(
    machine: TableMachine,
    spine_rows: set[int],
    phases: Sequence[tuple[str, tuple[enum.Enum, ...]]],
    remarks: Remarks,
) -> dict[tuple[enum.Enum, Edge], str]:
    """Rows drawn once from a phase's box, by (state, row): a row (trigger, guards,
    destination and remarks) that every state of the phase has, like a statechart's transition
    from a superstate."""
    lifted: dict[tuple[enum.Enum, Edge], str] = {}
    for title, members in phases:
        if len(members) < 2:
            continue
        first = members[0]
        for edge in machine.table[first]:
            if edge.dest is None or id(edge) in spine_rows:
                continue
            said = remarks.get((first, edge.trigger), ())
            if all(
                edge in machine.table[state] and remarks.get((state, edge.trigger), ()) == said
                for state in members
            ):
                lifted.update({(state, edge): title for state in members})
    return lifted


def _arrows(
    machine: TableMachine,
    steps: Sequence[tuple[enum.Enum, Edge]],
    phases: Sequence[tuple[str, tuple[enum.Enum, ...]]],
    remarks: Remarks,
) -> tuple[Arrow, ...]:
    """The arrows: the spine's rows each on a bold arrow of their own, every other row grouped
    by (source, destination) on a dashed or dotted one (beside the spine's arrow when it joins
    the same two states: a failure never rides on the run that goes well)."""
    spine_rows = {id(edge) for _, edge in steps}
    end = steps[-1][1].dest if steps else machine.initial_state_enum()
    final = {machine.state_enum[name] for name in machine.final_states}
    lifted = _lifted(machine, spine_rows, phases, remarks)
    drawn: set[tuple[str, Edge]] = set()
    # (origin, dest, on the spine) -> the arrow's kind and rows
    grouped: dict[tuple[enum.Enum | str, enum.Enum, bool], tuple[ArrowKind, list[Row]]] = {}
    for source, edges in machine.table.items():
        for edge in edges:
            dest = source if edge.dest is None else edge.dest
            origin: enum.Enum | str = source
            if (source, edge) in lifted:
                origin = lifted[(source, edge)]
            if isinstance(origin, str):
                if (origin, edge) in drawn:
                    continue  # drawn once, from the phase's box
                drawn.add((origin, edge))
            on_spine = id(edge) in spine_rows
            if on_spine:
                kind = ArrowKind.SPINE
            elif edge.dest is None:
                kind = ArrowKind.INTERNAL
            elif dest in final and dest != end:
                kind = ArrowKind.FAILURE
            else:
                kind = ArrowKind.BRANCH
            row = Row(row_label(edge), remarks.get((source, edge.trigger), ()))
            grouped.setdefault((origin, dest, on_spine), (kind, []))[1].append(row)
    # The spine first, top to bottom, then the rest in table order.
    order: list[tuple[enum.Enum | str, enum.Enum, bool]] = [
        (source, edge.dest, True) for source, edge in steps if edge.dest is not None
    ]
    order += [group for group in grouped if not group[2]]
    spine_pairs = {(origin, dest) for origin, dest, _ in order[: len(steps)]}
    arrows = []
    for origin, dest, on_spine in order:
        kind, rows = grouped[(origin, dest, on_spine)]
        key = f"{_key(origin)}->{dest.name}"
        if not on_spine and (origin, dest) in spine_pairs:
            key += ":other"
        arrows.append(Arrow(origin, dest, kind, tuple(rows), key))
    return tuple(arrows)


def _turn_remarks() -> Remarks:
    """The turn machine's decision tables that are not rows, as remarks on the rows they
    choose: which Codex turn status ends running_turn how (:data:`RUN_END_TRIGGERS`), which
    thread decision leaves starting_thread how (:data:`THREAD_TRIGGERS`), and what a stage
    reports when it is cut short (:data:`CUT_SHORT_TRIGGERS`)."""
    remarks: dict[tuple[enum.Enum, str], list[str]] = {}
    statuses: dict[str, list[str]] = {}
    for (end, yielded), exit_ in RUN_END_TRIGGERS.items():
        statuses.setdefault(exit_, []).append(f"{end.value}{' + yield' if yielded else ''}")
    for exit_name, ends in statuses.items():
        remarks.setdefault((TurnState.RUNNING_TURN, exit_name), []).append(
            f"Codex: {_either_yield(ends)}"
        )
    actions: dict[str, list[str]] = {}
    for action, started in THREAD_TRIGGERS.items():
        actions.setdefault(started, []).append(action.value)
    for started_name, names in actions.items():
        remarks.setdefault((TurnState.STARTING_THREAD, started_name), []).append(
            f"decision: {', '.join(names)}"
        )
    for form, projected in FORM_TRIGGERS.items():
        remarks.setdefault((TurnState.PROJECTING, projected), []).append(f"form: {form.value}")
    remarks.setdefault((TurnState.STARTING_THREAD, TurnTrigger.FORK_FAILED), []).append(
        "then the text frame"
    )
    for state, triggers in CUT_SHORT_TRIGGERS.items():
        for trigger in triggers:
            remarks.setdefault((state, trigger), []).append("cut short")
    return {key: tuple(said) for key, said in remarks.items()}


def _either_yield(ends: list[str]) -> str:
    """``completed`` for ``[completed, completed + yield]``: a yield request changes nothing."""
    if len(ends) == 2 and ends[1] == f"{ends[0]} + yield":
        return ends[0]
    return ", ".join(ends)


_REMARKS: dict[str, Callable[[], Remarks]] = {"turn": _turn_remarks}


def layout(name: str) -> Drawing:
    """The drawing of machine ``name``: what :func:`render_mermaid` and :func:`render_dot` draw."""
    machine = DIAGRAMS[name]
    steps = spine(machine)
    initial = machine.initial_state_enum()
    remarks = _REMARKS.get(name)
    phases = PHASES.get(name, ())
    return Drawing(
        name=name,
        title=f"codex-turn: {name} machine",
        states=tuple(machine.table),
        initial=initial,
        final=frozenset(machine.state_enum[n] for n in machine.final_states),
        spine=(initial, *(edge.dest for _, edge in steps if edge.dest is not None)),
        phases=phases,
        arrows=_arrows(machine, steps, phases, remarks() if remarks is not None else {}),
    )


def _phase_id(title: str) -> str:
    return "phase_" + "".join(c if c.isalnum() else "_" for c in title.lower()).strip("_")


def _key(node: enum.Enum | str) -> str:
    """The id of a state (its name) or of a phase's box, in both renderers."""
    return node.name if isinstance(node, enum.Enum) else _phase_id(node)


# Mermaid ---------------------------------------------------------------------------------

_MERMAID_LINK = {
    ArrowKind.SPINE: "==>",
    ArrowKind.BRANCH: "-.->",
    ArrowKind.FAILURE: "-.->",
    ArrowKind.INTERNAL: "-.->",
}
_MERMAID_LINK_STYLE = {
    ArrowKind.SPINE: "stroke:#222,stroke-width:2.5px",
    ArrowKind.BRANCH: "stroke:#888,stroke-width:1px",
    ArrowKind.FAILURE: "stroke:#c0504d,stroke-width:1px",
    ArrowKind.INTERNAL: "stroke:#888,stroke-width:1px",
}
_MERMAID_CLASSES = (
    "  classDef stateNode fill:#fff,stroke:#333,color:#111",
    "  classDef finalNode fill:#fff,stroke:#333,color:#111",
    "  classDef startNode fill:#333,stroke:#333",
)


def _mermaid_node(drawing: Drawing, state: enum.Enum) -> str:
    label = state_label(state)
    if state in drawing.final:
        return f'{state.name}((("{label}"))):::finalNode'
    return f'{state.name}("{label}"):::stateNode'


def render_mermaid(name: str) -> str:
    """The Mermaid ``flowchart TB`` source of machine ``name``, newline-terminated: the spine
    as thick links (``==>``), every other row dotted (``-.->``), phases as subgraphs."""
    drawing = layout(name)
    lines = ["---", f"title: {drawing.title}", "---", "flowchart TB"]
    lines += [f"  %% {drawing.legend()}", *_MERMAID_CLASSES, '  START((" ")):::startNode']
    phased = {state for _, members in drawing.phases for state in members}
    lines += [
        f"  {_mermaid_node(drawing, state)}"
        for state in drawing.states
        if state not in phased and state not in drawing.final
    ]
    for title, members in drawing.phases:
        lines += [f'  subgraph {_phase_id(title)}["{title}"]', "    direction TB"]
        lines += [f"    {_mermaid_node(drawing, state)}" for state in members]
        lines.append("  end")
    lines += [
        f"  {_mermaid_node(drawing, state)}" for state in drawing.states if state in drawing.final
    ]
    links: list[tuple[ArrowKind | None, str]] = [(None, f"  START --> {drawing.initial.name}")]
    links += [
        (
            arrow.kind,
            f"  {_key(arrow.source)} {_MERMAID_LINK[arrow.kind]}"
            f'|"{"<br/>".join(arrow.lines())}"| {arrow.dest.name}',
        )
        for arrow in drawing.arrows
    ]
    lines += [link for _, link in links]
    for kind in ArrowKind:
        indices = [str(i) for i, (k, _) in enumerate(links) if k is kind]
        if indices:
            lines.append(f"  linkStyle {','.join(indices)} {_MERMAID_LINK_STYLE[kind]}")
    for index, (title, _) in enumerate(drawing.phases):
        fill = _PHASE_FILLS[index % len(_PHASE_FILLS)]
        lines.append(f"  style {_phase_id(title)} fill:{fill},stroke:{_PHASE_STROKE}")
    return "\n".join(lines) + "\n"


# Graphviz --------------------------------------------------------------------------------

_FONT = "Helvetica,Arial,sans-serif"
_MAX_WIDTH_PT = 750
_EDGE_STYLE: dict[ArrowKind, dict[str, str]] = {
    ArrowKind.SPINE: {"penwidth": "2.2", "color": "#222222", "weight": "100"},
    ArrowKind.BRANCH: {
        "style": "dashed",
        "color": "#8a8a8a",
        "fontcolor": "#555555",
        "weight": "0",
    },
    ArrowKind.FAILURE: {
        "style": "dashed",
        "color": "#c0504d",
        "fontcolor": "#a33b38",
        "weight": "0",
    },
    ArrowKind.INTERNAL: {"style": "dotted", "color": "#8a8a8a", "fontcolor": "#555555"},
}
_PHASE_FILLS = ("#f1f5fb", "#eff7ec", "#fbf4ea", "#f5f0fa")
_PHASE_STROKE = "#c5cdd8"


def _html_lines(first: str, rest: Sequence[str], *, size: int) -> str:
    """An HTML-like Graphviz label: ``first`` in bold, ``rest`` smaller, left-aligned."""
    body = [f"<B>{html.escape(first)}</B>"]
    body += [f'<FONT POINT-SIZE="{size}">{html.escape(line)}</FONT>' for line in rest]
    return "<" + '<BR ALIGN="LEFT"/>'.join(body) + '<BR ALIGN="LEFT"/>>'


def _beside(drawing: Drawing) -> dict[enum.Enum, enum.Enum]:
    """States drawn level with a spine state, so that their arrows stay short:

    * a detour (a state the spine steps out to and back from, like reprojecting) sits beside
      the spine state it returns to;
    * a failure end (like failed) sits beside the spine state *before* the last one that can
      fail: the last failure arrow rises one step, the earlier ones fall.
    """
    index = {state: i for i, state in enumerate(drawing.spine)}
    pairs = {(arrow.source, arrow.dest) for arrow in drawing.arrows}
    beside: dict[enum.Enum, enum.Enum] = {}
    for state in drawing.states:
        if state in index or state in drawing.final:
            continue
        for partner in drawing.spine:
            if (partner, state) in pairs and (state, partner) in pairs:
                beside[state] = partner
                break
    members_of = dict(drawing.phases)
    last: dict[enum.Enum, int] = {}
    for arrow in drawing.arrows:
        if arrow.kind is not ArrowKind.FAILURE:
            continue
        source = arrow.source
        tail = members_of[source][-1] if isinstance(source, str) else source
        tail = beside.get(tail, tail)
        if tail in index:
            last[arrow.dest] = max(last.get(arrow.dest, 0), index[tail])
    for end, position in last.items():
        beside[end] = drawing.spine[max(position - 1, 0)]
    return beside


def render_dot(name: str) -> Any:
    """The ``pygraphviz.AGraph`` of machine ``name`` (not laid out); needs the diagrams extra.

    Every arrow has the id ``SOURCE->DEST`` (a state's name, or ``phase_...`` for a phase's
    box), which the SVG keeps."""
    import pygraphviz

    drawing = layout(name)
    graph = pygraphviz.AGraph(directed=True, strict=False, name=name)
    graph.graph_attr.update(
        label=_html_lines(drawing.title, (drawing.legend(),), size=10),
        labelloc="t",
        fontname=_FONT,
        fontsize="15",
        rankdir="TB",
        newrank="true",
        compound="true",
        nodesep="0.15",
        # Never wider than 750 pt (1000 px): a wider drawing is scaled down to fit.
        size=f"{_MAX_WIDTH_PT / 72:.2f},100",
        ranksep=_RANKSEP_STEPS[0],  # spread further when too wide (_make_portrait)
        pad="0.2",
    )
    graph.node_attr.update(
        shape="box",
        style="rounded",
        fontname=_FONT,
        fontsize="12",
        color="#333333",
        margin="0.12,0.05",
        height="0.36",
    )
    graph.edge_attr.update(fontname=_FONT, fontsize="10", arrowsize="0.7")
    on_spine = set(drawing.spine)

    def add_state(target: Any, state: enum.Enum) -> None:
        extra = {"group": "spine"} if state in on_spine else {}
        if state in drawing.final:
            extra["peripheries"] = "2"
        target.add_node(state.name, label=state_label(state), **extra)

    graph.add_node("START", shape="point", width="0.12", color="#333333", label="")
    phased = {state for _, members in drawing.phases for state in members}
    for state in drawing.states:
        if state not in phased:
            add_state(graph, state)
    for index, (title, members) in enumerate(drawing.phases):
        cluster = graph.add_subgraph(
            name=f"cluster_{_phase_id(title)}",
            label="",
            style="rounded,filled",
            fillcolor=_PHASE_FILLS[index % len(_PHASE_FILLS)],
            color=_PHASE_STROKE,
        )
        # The phase's title left of its first state (a cluster label would sit where the
        # spine enters the box).
        heading = f"title_{_phase_id(title)}"
        cluster.add_node(
            heading, label=f"<<B>{html.escape(title)}</B>>", shape="plaintext", fontsize="12"
        )
        for state in members:
            add_state(cluster, state)
        graph.add_subgraph([heading, members[0].name], name=f"rank_{heading}", rank="same")
        graph.add_edge(heading, members[0].name, style="invis")
    graph.add_edge(
        "START", drawing.initial.name, id=f"START->{drawing.initial.name}", arrowsize="0.6"
    )
    for state, beside in _beside(drawing).items():
        graph.add_subgraph([beside.name, state.name], name=f"rank_{state.name}", rank="same")
    members_of = dict(drawing.phases)
    for arrow in drawing.arrows:
        extra: dict[str, str] = {}
        tail = arrow.source
        if isinstance(tail, str):  # from a phase's box: clipped at the box, from its last state
            extra["ltail"] = f"cluster_{_phase_id(tail)}"
            tail = members_of[tail][-1]
        if arrow.kind is ArrowKind.FAILURE:
            extra["constraint"] = "false"  # placed by _beside, never bending the spine
        if arrow.kind is ArrowKind.SPINE and arrow.dest == drawing.spine[-1]:
            # Room above the end for the labels of the other arrows converging on it.
            extra["minlen"] = str(max(1, sum(a.dest == arrow.dest for a in drawing.arrows) - 1))
        graph.add_edge(
            tail.name,
            arrow.dest.name,
            id=arrow.key,
            label="\\l".join(arrow.lines()) + "\\l",
            **_EDGE_STYLE[arrow.kind],
            **extra,
        )
    _make_portrait(graph)
    return graph


_RANKSEP_STEPS = ("0.34", "0.5", "0.65", "0.8", "1.0", "1.2", "1.5", "1.8")


def _make_portrait(graph: Any, spread: str = "ranksep") -> None:
    """Spread the ranks (``ranksep``, in steps) until the drawing is no wider than tall: the
    labels of arrows that skip states sit side by side, and more room between the ranks lets
    them stack instead of widening the page. A left-to-right drawing spreads its nodes
    (``nodesep``) instead: there the ranks are columns."""
    for step in _RANKSEP_STEPS:
        graph.graph_attr[spread] = step
        # The "plain" output starts ``graph SCALE WIDTH HEIGHT``, as the SVG will be drawn.
        plain: bytes = graph.draw(format="plain", prog="dot")
        _, _, width, height = plain.split(b"\n", 1)[0].split()[:4]
        if float(width) <= float(height):
            return


def render_svg(name: str) -> bytes | None:
    """SVG bytes of machine ``name`` via pygraphviz, or ``None`` when it is not installed."""
    try:
        import pygraphviz  # noqa: F401
    except ImportError:
        return None
    data: bytes = render_dot(name).draw(format="svg", prog="dot")
    return data


# Rule tables -----------------------------------------------------------------------------

#: The first-match rule tables drawn as flowcharts (:func:`chart`), by diagram name: the
#: decisions that change a turn's course without being a machine's rows.
RULE_DIAGRAMS: dict[str, Sequence[Rule[Any]]] = {
    "thread_rules": THREAD_RULES,
    "continuity_rules": CONTINUITY_RULES,
    "inject_rules": INJECT_RULES,
    "answer_rules": ANSWER_RULES,
    "form_rules": FORM_RULES,
    "base_rules": BASE_RULES,
    "fork_rules": FORK_RULES,
    "keep_rules": KEEP_RULES,
    "native_rules": NATIVE_RULES,
}

#: The queue-mode table (run kind x mode -> fate), drawn as a chart of its own.
FATES_DIAGRAM = "run_fates"

#: The drawings' titles: the table, and what it decides.
_CHART_SOURCES: dict[str, str] = {
    "thread_rules": "THREAD_RULES (how a turn gets its thread)",
    "continuity_rules": "CONTINUITY_RULES (what goes with the prompt)",
    "inject_rules": "INJECT_RULES (a thread's hook events)",
    "answer_rules": "ANSWER_RULES (a hook call's answer)",
    "form_rules": "FORM_RULES (text frame or items)",
    "base_rules": "BASE_RULES (which base a fork uses)",
    "fork_rules": "FORK_RULES (whether a kept fork continues)",
    "keep_rules": "KEEP_RULES (whether a fork is kept)",
    "native_rules": "NATIVE_RULES (native compaction)",
    FATES_DIAGRAM: "RUN_FATES (a message's fate)",
}


class NodeKind(enum.Enum):
    CONDITION = "condition"  # a rule's facts: the question a row asks
    OTHERWISE = "otherwise"  # the unconditional last row
    DECISION = "decision"  # what a row answers
    RUN = "run"  # what holds the session, and each mode's fate (the fates table)


class LinkKind(enum.Enum):
    YES = "yes"  # the row holds: its decision
    NO = "no"  # it does not: the next row
    ALWAYS = "always"  # the last row holds whatever the facts
    ORDER = "order"  # no arrow: the boxes of the fates table stacked in order


@attrs.frozen
class ChartNode:
    key: str  # the node's id in both renderers
    lines: tuple[str, ...]
    kind: NodeKind


@attrs.frozen
class ChartLink:
    source: str
    dest: str
    kind: LinkKind
    label: str = ""

    @property
    def key(self) -> str:
        return f"{self.source}->{self.dest}"


@attrs.frozen
class Chart:
    """A table that is not a machine, as both renderers draw it: nodes, links and the nodes
    drawn level with each other (a row and its decision)."""

    name: str
    title: str
    legend: str
    direction: str  # "TB" or "LR"
    nodes: tuple[ChartNode, ...]
    links: tuple[ChartLink, ...]
    level: tuple[tuple[str, ...], ...] = ()


def rule_facts(rule: Rule[Any]) -> tuple[str, ...]:
    """A row's question, one fact a line: ``items``, ``& !tools_dropped`` ..."""
    facts = [*rule.when, *(f"!{fact}" for fact in rule.unless)]
    return tuple(fact if i == 0 else f"& {fact}" for i, fact in enumerate(facts))


def decision_lines(decision: object) -> tuple[str, ...]:
    """A row's answer: its action, then its reason, then what else it says (a thread
    decision that keeps the raw prompt or the bound thread's record)."""
    if isinstance(decision, ThreadDecision):
        lines = [decision.action.value, decision.reason]
        if not decision.project:
            lines.append("raw prompt")
        if not decision.rebind:
            lines.append("binding unchanged")
        return tuple(lines)
    if isinstance(decision, Choice):
        return (_value(decision.action), decision.reason)
    return (_value(decision),)


def _value(value: object) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def chart(name: str) -> Chart:
    """The drawing of table ``name`` (:data:`RULE_DIAGRAMS` or :data:`FATES_DIAGRAM`)."""
    if name == FATES_DIAGRAM:
        return _fates_chart()
    rules = RULE_DIAGRAMS[name]
    nodes: list[ChartNode] = []
    links: list[ChartLink] = []
    last = len(rules)
    for index, rule in enumerate(rules, start=1):
        row, answer = f"R{index}", f"D{index}"
        if index == last:
            nodes.append(ChartNode(row, ("otherwise",), NodeKind.OTHERWISE))
            links.append(ChartLink(row, answer, LinkKind.ALWAYS))
        else:
            nodes.append(ChartNode(row, rule_facts(rule), NodeKind.CONDITION))
            links.append(ChartLink(row, answer, LinkKind.YES, "yes"))
            links.append(ChartLink(row, f"R{index + 1}", LinkKind.NO, "no"))
        nodes.append(ChartNode(answer, decision_lines(rule.decision), NodeKind.DECISION))
    return Chart(
        name=name,
        title=f"codex-turn: {_CHART_SOURCES[name]}",
        legend="the first row whose facts hold decides · !fact: it does not hold",
        direction="TB",
        nodes=tuple(nodes),
        links=tuple(links),
        level=tuple((f"R{i}", f"D{i}") for i in range(1, last + 1)),
    )


def _fates_chart() -> Chart:
    """:data:`RUN_FATES` as one box per run kind (what holds the session), one line a queue
    mode and the message's fate in it, the boxes stacked in :class:`RunKind`'s order."""
    nodes = tuple(
        ChartNode(
            f"RUN_{kind.name}",
            (
                kind.value,
                *(f"{mode.value} → {fate_label(RUN_FATES[(kind, mode)])}" for mode in SteerMode),
            ),
            NodeKind.RUN,
        )
        for kind in RunKind
    )
    links = tuple(
        ChartLink(above.key, below.key, LinkKind.ORDER)
        for above, below in itertools.pairwise(nodes)
    )
    return Chart(
        name=FATES_DIAGRAM,
        title=f"codex-turn: {_CHART_SOURCES[FATES_DIAGRAM]}",
        legend="while a run of this kind holds the session: mode → fate",
        direction="TB",
        nodes=nodes,
        links=links,
    )


def fate_label(fate: SteerFate | None) -> str:
    """``queued (refuses_steering)``; ``None`` is steering (the steering machine decides)."""
    if fate is None:
        return "steered into the running turn"
    return f"{fate.status.value} ({fate.reason})" if fate.reason else fate.status.value


_MERMAID_SHAPES: dict[NodeKind, tuple[str, str]] = {
    NodeKind.CONDITION: ("{{", "}}"),
    NodeKind.OTHERWISE: ("([", "])"),
    NodeKind.DECISION: ("[", "]"),
    NodeKind.RUN: ("[", "]"),
}
_MERMAID_CHART_LINKS: dict[LinkKind, tuple[str, str]] = {
    LinkKind.YES: ("==>", "stroke:#222,stroke-width:2px"),
    LinkKind.NO: ("-.->", "stroke:#888,stroke-width:1px"),
    LinkKind.ALWAYS: ("==>", "stroke:#222,stroke-width:2px"),
    LinkKind.ORDER: ("~~~", ""),
}


_MERMAID_NODE_STYLE: dict[NodeKind, str] = {
    NodeKind.CONDITION: "fill:#f1f5fb,stroke:#333,color:#111",
    NodeKind.OTHERWISE: "fill:#f1f5fb,stroke:#333,color:#111",
    NodeKind.DECISION: "fill:#fff,stroke:#333,color:#111",
    NodeKind.RUN: "fill:#fff,stroke:#333,color:#111",
}


def render_chart_mermaid(name: str) -> str:
    """The Mermaid flowchart of table ``name``, newline-terminated: each row a node in table
    order, ``yes`` (thick) to its decision, ``no`` (dotted) to the next row."""
    drawing = chart(name)
    lines = ["---", f"title: {drawing.title}", "---", f"flowchart {drawing.direction}"]
    lines.append(f"  %% {drawing.legend}")
    kinds = {node.kind for node in drawing.nodes}
    lines += [
        f"  classDef {kind.value}Node {_MERMAID_NODE_STYLE[kind]}"
        for kind in NodeKind
        if kind in kinds
    ]
    for node in drawing.nodes:
        opening, closing = _MERMAID_SHAPES[node.kind]
        label = "<br/>".join(node.lines)
        lines.append(f'  {node.key}{opening}"{label}"{closing}:::{node.kind.value}Node')
    for link in drawing.links:
        arrow = _MERMAID_CHART_LINKS[link.kind][0]
        said = f'|"{link.label}"|' if link.label else ""
        lines.append(f"  {link.source} {arrow}{said} {link.dest}")
    for kind in LinkKind:
        indices = [str(i) for i, link in enumerate(drawing.links) if link.kind is kind]
        if indices and _MERMAID_CHART_LINKS[kind][1]:
            lines.append(f"  linkStyle {','.join(indices)} {_MERMAID_CHART_LINKS[kind][1]}")
    return "\n".join(lines) + "\n"


_DOT_NODE_STYLE: dict[NodeKind, dict[str, str]] = {
    NodeKind.CONDITION: {"shape": "hexagon", "style": "filled", "fillcolor": "#f1f5fb"},
    NodeKind.OTHERWISE: {"shape": "box", "style": "rounded,filled", "fillcolor": "#f1f5fb"},
    NodeKind.DECISION: {"shape": "box", "style": "rounded"},
    NodeKind.RUN: {"shape": "box", "style": "rounded"},
}
_DOT_LINK_STYLE: dict[LinkKind, dict[str, str]] = {
    LinkKind.YES: {"penwidth": "1.8", "color": "#222222", "weight": "0"},
    LinkKind.NO: {"style": "dashed", "color": "#8a8a8a", "fontcolor": "#555555", "weight": "100"},
    LinkKind.ALWAYS: {"penwidth": "1.8", "color": "#222222", "weight": "0"},
    LinkKind.ORDER: {"style": "invis"},
}


def render_chart_dot(name: str) -> Any:
    """The ``pygraphviz.AGraph`` of table ``name`` (not laid out); needs the diagrams extra.
    Every link has the id ``SOURCE->DEST``, every node its key as its title."""
    import pygraphviz

    drawing = chart(name)
    graph = pygraphviz.AGraph(directed=True, strict=False, name=name)
    graph.graph_attr.update(
        label=_html_lines(drawing.title, (drawing.legend,), size=10),
        labelloc="t",
        fontname=_FONT,
        fontsize="15",
        rankdir=drawing.direction,
        newrank="true",
        nodesep="0.3",
        size=f"{_MAX_WIDTH_PT / 72:.2f},100",
        ranksep=_RANKSEP_STEPS[0],
        pad="0.2",
    )
    graph.node_attr.update(
        fontname=_FONT, fontsize="11", color="#333333", margin="0.12,0.05", height="0.36"
    )
    graph.edge_attr.update(fontname=_FONT, fontsize="10", arrowsize="0.7")
    for node in drawing.nodes:
        first, *rest = node.lines
        label = (
            _html_lines(first, rest, size=10)
            if node.kind in (NodeKind.DECISION, NodeKind.RUN)
            else "\\l".join(node.lines) + "\\l"
        )
        extra = {"group": "rows"} if node.kind in (NodeKind.CONDITION, NodeKind.OTHERWISE) else {}
        graph.add_node(node.key, label=label, **_DOT_NODE_STYLE[node.kind], **extra)
    for index, keys in enumerate(drawing.level):
        graph.add_subgraph(list(keys), name=f"level_{index}", rank="same")
    for link in drawing.links:
        graph.add_edge(
            link.source, link.dest, id=link.key, label=link.label, **_DOT_LINK_STYLE[link.kind]
        )
    _make_portrait(graph, "ranksep" if drawing.direction == "TB" else "nodesep")
    return graph


def render_chart_svg(name: str) -> bytes | None:
    """SVG bytes of table ``name`` via pygraphviz, or ``None`` when it is not installed."""
    try:
        import pygraphviz  # noqa: F401
    except ImportError:
        return None
    data: bytes = render_chart_dot(name).draw(format="svg", prog="dot")
    return data


def write_diagrams(directory: Path, *, svg: bool = True) -> list[Path]:
    """Write every diagram into ``directory`` (created if needed); return the paths written.

    There is no default directory: a library call never writes into the current one. The
    command (``codex-turn diagrams``) defaults to the source checkout's ``diagrams/``."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    renderers: list[tuple[str, Callable[[str], str], Callable[[str], bytes | None]]] = [
        (name, render_mermaid, render_svg) for name in DIAGRAMS
    ]
    renderers += [
        (name, render_chart_mermaid, render_chart_svg) for name in (*RULE_DIAGRAMS, FATES_DIAGRAM)
    ]
    for name, mermaid, draw_svg in renderers:
        path = directory / f"{name}.mmd"
        path.write_text(mermaid(name), encoding="utf-8")
        written.append(path)
        if svg and (data := draw_svg(name)) is not None:
            svg_path = directory / f"{name}.svg"
            svg_path.write_bytes(data)
            written.append(svg_path)
    return written
