"""Render the state diagrams from the tables: ``python -m codex_turn.fsm.diagrams [DIR]``.

The diagrams are *generated*, never drawn by hand: a ``GraphMachine`` (mermaid engine, no
system binaries) is built from the very same tables as the runtime machines, for a fresh
model in the initial state, so the output is byte-stable. ``GraphMachine`` is used only here:
at run time it leaks per removed model.

Writes ``turn.mmd`` and ``compaction.mmd`` (golden files, checked by a test) and, when the
``diagrams`` extra (pygraphviz, which bundles Graphviz) is installed, ``turn.svg`` and
``compaction.svg``.
"""

from __future__ import annotations

import argparse
import enum
import sys
from pathlib import Path
from typing import Any, Literal

from transitions.extensions import GraphMachine

from codex_turn.fsm._machine import Table, TableMachine, table_to_transitions
from codex_turn.fsm.compaction import COMPACTION_MACHINE
from codex_turn.fsm.turn import CUT_SHORT_TRIGGERS, RUN_END_TRIGGERS, TURN_MACHINE

__all__ = ["DIAGRAMS", "render_mermaid", "render_svg", "write_diagrams"]

DIAGRAMS: dict[str, TableMachine] = {"turn": TURN_MACHINE, "compaction": COMPACTION_MACHINE}

DEFAULT_DIR = Path("diagrams")


class _Blank:
    """A stand-in model: rendering reads no guard, it only names them."""


def _graph(
    engine: Literal["mermaid", "pygraphviz"],
    name: str,
    states: type[enum.Enum],
    table: Table,
    initial: enum.Enum,
) -> Any:
    machine = GraphMachine(
        model=_Blank(),
        states=states,
        initial=initial,
        transitions=table_to_transitions(table),
        auto_transitions=False,
        show_conditions=True,
        graph_engine=engine,
        title=f"codex-turn: {name} machine",
    )
    return machine.get_graph()


def _turn_notes() -> str:
    """The turn machine's decision tables that are not edges, as Mermaid notes: how Codex's
    turn status maps to a running_turn exit, and how a stage cut short ends. Generated from
    :data:`RUN_END_TRIGGERS` and :data:`CUT_SHORT_TRIGGERS`, like the edges."""
    run_end = [
        f"    {end.value}{' + yield' if yielded else ''} -> {trigger.value}"
        for (end, yielded), trigger in RUN_END_TRIGGERS.items()
    ]
    lines = ["  note right of RUNNING_TURN", "    Codex turn status -> exit", *run_end]
    lines.append("  end note")
    for state, triggers in CUT_SHORT_TRIGGERS.items():
        first = " else ".join(trigger.value for trigger in triggers)
        lines += [f"  note left of {state.name}", f"    cut short -> {first}", "  end note"]
    return "\n".join(lines) + "\n"


_NOTES = {"turn": _turn_notes}


def render_mermaid(name: str) -> str:
    """The Mermaid ``stateDiagram-v2`` source of machine ``name``, newline-terminated, with
    the machine's non-edge decision tables as notes."""
    machine = DIAGRAMS[name]
    source: str = _graph(
        "mermaid",
        name,
        type(machine.initial_state_enum()),
        machine.table,
        machine.initial_state_enum(),
    ).source
    source = source if source.endswith("\n") else source + "\n"
    notes = _NOTES.get(name)
    return source + notes() if notes is not None else source


def render_svg(name: str) -> bytes | None:
    """SVG bytes of machine ``name`` via pygraphviz, or ``None`` when it is not installed."""
    try:
        import pygraphviz  # noqa: F401
    except ImportError:
        return None
    machine = DIAGRAMS[name]
    graph = _graph(
        "pygraphviz",
        name,
        type(machine.initial_state_enum()),
        machine.table,
        machine.initial_state_enum(),
    )
    data: bytes = graph.draw(format="svg", prog="dot")
    return data


def write_diagrams(directory: Path = DEFAULT_DIR, *, svg: bool = True) -> list[Path]:
    """Write every diagram into ``directory``; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name in DIAGRAMS:
        path = directory / f"{name}.mmd"
        path.write_text(render_mermaid(name), encoding="utf-8")
        written.append(path)
        if svg and (data := render_svg(name)) is not None:
            svg_path = directory / f"{name}.svg"
            svg_path.write_bytes(data)
            written.append(svg_path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="codex-turn diagrams", description=__doc__.splitlines()[0]
    )
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--no-svg", action="store_true", help="write only the Mermaid sources")
    args = parser.parse_args(argv)
    for path in write_diagrams(args.directory, svg=not args.no_svg):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
