"""The committed diagrams are exactly what the tables render today, and they are readable:
portrait-ish, at most 1000 px wide, every table row drawn once, the happy path set apart
from the other rows, and no state styled as the current one."""

from __future__ import annotations

import enum
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from codex_turn import cli, fsm
from codex_turn import diagrams as diagrams_module
from codex_turn._cli_support import EXIT_USAGE
from codex_turn.diagrams import (
    DIAGRAMS,
    FATES_DIAGRAM,
    PHASES,
    RULE_DIAGRAMS,
    ArrowKind,
    decision_lines,
    layout,
    render_chart_mermaid,
    render_chart_svg,
    render_mermaid,
    render_svg,
    row_label,
    spine,
    write_diagrams,
)
from codex_turn.fsm.compaction import CompactionFacts, CompactionModel
from codex_turn.fsm.hooks import ANSWER_RULES, INJECT_RULES
from codex_turn.fsm.steering import RUN_FATES, RunKind, SteerBatchModel, SteerMode, SteerState
from codex_turn.fsm.thread import CONTINUITY_RULES, THREAD_RULES, Rule
from codex_turn.fsm.turn import TurnFacts, TurnModel, TurnOutcome

ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"
MERMAID_LINK = re.compile(r'^  (\w+) (==>|-\.->)\|"(.*)"\| (\w+)$')

Rows = Counter[tuple[str, str, str]]  # (source state, dest state, row label)


def table_rows(name: str) -> Rows:
    machine = DIAGRAMS[name]
    return Counter(
        (source.name, (edge.dest or source).name, row_label(edge))
        for source, edges in machine.table.items()
        for edge in edges
    )


def phase_id(title: str) -> str:
    return "phase_" + re.sub(r"[^a-z0-9]", "_", title.lower()).strip("_")


def members(name: str, key: str) -> list[str]:
    """The states an arrow's source stands for: a state, or every state of a phase's box."""
    for title, states in PHASES.get(name, ()):
        if key == phase_id(title):
            return [state.name for state in states]
    return [key]


def row_of(line: str) -> str:
    """A label line without its remarks: ``turn_aborted  (Codex: interrupted)``."""
    return line.replace("\xa0", " ").split("  (")[0]


def mermaid_arrows(name: str) -> list[tuple[str, str, str, list[str]]]:
    """(source, link, dest, label lines) of every labelled link in the Mermaid source."""
    arrows = []
    for line in render_mermaid(name).splitlines():
        if match := MERMAID_LINK.match(line):
            source, link, label, dest = match.groups()
            arrows.append((source, link, dest, label.split("<br/>")))
    return arrows


def svg_root(name: str) -> ET.Element:
    data = render_svg(name)
    assert data is not None, "pygraphviz (the diagrams extra) must be installed for tests"
    return ET.fromstring(data)


def svg_arrows(root: ET.Element) -> dict[str, ET.Element]:
    """The drawn table arrows by id (``SOURCE->DEST``)."""
    return {
        g.attrib["id"]: g
        for g in root.iter(f"{SVG}g")
        if g.attrib.get("class") == "edge"
        and "->" in g.attrib.get("id", "")
        and not g.attrib["id"].startswith("START->")
    }


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_committed_mermaid_diagram_is_fresh(name: str) -> None:
    committed = (ROOT / "diagrams" / f"{name}.mmd").read_text(encoding="utf-8")
    assert committed == render_mermaid(name), (
        f"diagrams/{name}.mmd is stale: run `python -m codex_turn diagrams`"
    )


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_mermaid_is_a_top_to_bottom_flowchart_of_every_state(name: str) -> None:
    source = render_mermaid(name)
    assert "\nflowchart TB\n" in source
    for state in DIAGRAMS[name].table:
        assert re.search(rf"^\s+{state.name}\W", source, re.MULTILINE), state


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_every_table_row_is_drawn_exactly_once_in_mermaid(name: str) -> None:
    drawn: Rows = Counter()
    for source, _, dest, lines in mermaid_arrows(name):
        for state in members(name, source):
            drawn.update((state, dest, row_of(line)) for line in lines)
    assert drawn == table_rows(name)


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_every_table_row_is_drawn_exactly_once_in_the_svg(name: str) -> None:
    drawn: Rows = Counter()
    for arrow_id, g in svg_arrows(svg_root(name)).items():
        source, dest = arrow_id.split(":")[0].split("->")
        lines = [text.text or "" for text in g.iter(f"{SVG}text")]
        for state in members(name, source):
            drawn.update((state, dest, row_of(line)) for line in lines)
    assert drawn == table_rows(name)


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_the_svg_fits_the_readme(name: str) -> None:
    root = svg_root(name)
    width_pt = float(root.attrib["width"].removesuffix("pt"))
    height_pt = float(root.attrib["height"].removesuffix("pt"))
    width_px, height_px = width_pt * 96 / 72, height_pt * 96 / 72
    assert width_px <= 1000, (width_px, height_px)
    assert 0.4 <= width_px / height_px <= 1.0, (width_px, height_px)  # portrait


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_the_spine_is_set_apart_from_the_other_rows(name: str) -> None:
    arrows = layout(name).arrows
    kinds = {arrow.key: arrow.kind for arrow in arrows}
    assert len(kinds) == len(arrows), "every arrow has an id of its own"
    assert ArrowKind.SPINE in kinds.values()
    assert len(set(kinds.values())) > 1
    # Mermaid: the spine is thick (==>), every other row dotted (-.->); links in arrow order.
    links = mermaid_arrows(name)
    assert [(source, dest) for source, _, dest, _ in links] == [
        (arrow.key.split("->")[0], arrow.dest.name) for arrow in arrows
    ]
    for arrow, (_, link, _, _) in zip(arrows, links, strict=True):
        assert (link == "==>") == (arrow.kind is ArrowKind.SPINE), arrow.key
    # SVG: the spine is solid and heavier; every other row is dashed or dotted.
    drawn = svg_arrows(svg_root(name))
    assert set(drawn) == set(kinds)
    for arrow_id, g in drawn.items():
        if kinds[arrow_id] is ArrowKind.SPINE:
            assert is_bold(g), arrow_id
        else:
            assert "stroke-dasharray" in next(g.iter(f"{SVG}path")).attrib, arrow_id


def happy_rows(name: str) -> Rows:
    """The spine's rows, (source, dest, row label): the run that goes well."""
    return Counter(
        (source.name, (edge.dest or source).name, row_label(edge))
        for source, edge in spine(DIAGRAMS[name])
    )


def is_bold(g: ET.Element) -> bool:
    path = next(g.iter(f"{SVG}path"))
    return "stroke-dasharray" not in path.attrib and float(path.attrib["stroke-width"]) > 1.5


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_every_row_on_a_bold_arrow_is_a_happy_path_row(name: str) -> None:
    """A bold arrow carries the spine's row and nothing else: a failure (``turn_failed``,
    ``mirror_failed`` ...) between two spine states is an arrow of its own, dashed."""
    happy = happy_rows(name)
    assert sum(happy.values()) == len(spine(DIAGRAMS[name])) > 0
    # The drawing.
    bold: Rows = Counter()
    for arrow in layout(name).arrows:
        if arrow.kind is ArrowKind.SPINE:
            assert isinstance(arrow.source, enum.Enum), arrow.key
            bold.update((arrow.source.name, arrow.dest.name, row.label) for row in arrow.rows)
    assert bold == happy
    # Mermaid: every line of a thick link.
    bold = Counter()
    for source, link, dest, lines in mermaid_arrows(name):
        if link == "==>":
            bold.update((source, dest, row_of(line)) for line in lines)
    assert bold == happy
    # SVG: every line of a solid, heavy arrow.
    bold = Counter()
    for arrow_id, g in svg_arrows(svg_root(name)).items():
        if is_bold(g):
            source, dest = arrow_id.split(":")[0].split("->")
            bold.update((source, dest, row_of(text.text or "")) for text in g.iter(f"{SVG}text"))
    assert bold == happy


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_no_state_is_styled_as_the_current_one(name: str) -> None:
    source = render_mermaid(name)
    assert "s_active" not in source
    assert "Class " not in source
    state_lines = [
        line
        for line in source.splitlines()
        if re.match(r"^\s+[A-Z_]+\W.*:::(state|final)Node", line)
    ]
    assert len(state_lines) == len(DIAGRAMS[name].table)
    classes = dict(re.findall(r"classDef (\w+) (\S+)", source))
    assert classes["stateNode"].startswith("fill:#fff,")
    assert classes["finalNode"].startswith("fill:#fff,")
    states = {state.name for state in DIAGRAMS[name].table}
    for g in svg_root(name).iter(f"{SVG}g"):
        title = g.find(f"{SVG}title")
        if g.attrib.get("class") != "node" or title is None or title.text not in states:
            continue
        for shape in g:
            if shape.tag in (f"{SVG}path", f"{SVG}polygon", f"{SVG}ellipse"):
                assert shape.attrib.get("fill", "none") in ("none", "white"), title.text


def test_the_turn_spine_is_a_completed_turn() -> None:
    steps = spine(DIAGRAMS["turn"])
    facts = TurnFacts(engine_active=True, had_session_file=True, engine_maintains=True)
    with TurnModel.begin(facts) as turn:
        for _, edge in steps:
            turn.fire(edge.trigger)
        assert turn.state_name == "DONE"
        assert turn.outcome is TurnOutcome.COMPLETED
        assert turn.skip_reason is None


def test_the_compaction_spine_is_an_engine_compaction_then_native() -> None:
    steps = spine(DIAGRAMS["compaction"])
    facts = CompactionFacts(engine_owns=True, has_binding=True)
    with CompactionModel.begin(facts) as run:
        for _, edge in steps:
            run.fire(edge.trigger)
        assert run.state_name == "REPORTED"
    assert [source.name for source, _ in steps][1:3] == [
        "ENGINE_COMPACTING",
        "COMPACTION_MAINTENANCE",
    ]


def test_the_steering_spine_is_a_batch_codex_took_and_the_model_answered() -> None:
    steps = spine(DIAGRAMS["steering"])
    with SteerBatchModel.begin() as batch:
        for _, edge in steps:
            batch.fire(edge.trigger)
        assert batch.state is SteerState.STEERED
    assert [edge.trigger for _, edge in steps] == [
        "batch_closed",
        "accepted",
        "landed",
        "model_worked",
    ]


def test_the_steering_legend_names_the_spines_end_not_every_other_one() -> None:
    """Five ways a batch ends other than steered: the legend says so without listing them
    (a long legend widens the page), and the turn's single failure end is still named."""
    assert "red: ends other than steered" in layout("steering").legend()
    assert "red: ends failed" in layout("turn").legend()


@pytest.mark.parametrize("name", sorted(PHASES))
def test_every_state_in_flight_is_in_exactly_one_phase(name: str) -> None:
    machine = DIAGRAMS[name]
    phased = Counter(state for _, states in PHASES[name] for state in states)
    in_flight: set[enum.Enum] = {
        state
        for state in machine.table
        if state != machine.initial_state_enum() and state.name not in machine.final_states
    }
    assert set(phased) == in_flight
    assert set(phased.values()) == {1}


def test_rendering_is_byte_stable_across_hash_seeds(tmp_path: Path) -> None:
    outputs = []
    for seed in ("1", "2", "3"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "codex_turn", "diagrams", "--out", str(out), "--no-svg"],
            check=True,
            env=env,
            capture_output=True,
        )
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1] == outputs[2]
    assert set(outputs[0]) == {
        "turn.mmd",
        "compaction.mmd",
        "steering.mmd",
        "branch.mmd",
        "archive.mmd",
        "diagnostics.mmd",
        "thread_rules.mmd",
        "continuity_rules.mmd",
        "inject_rules.mmd",
        "answer_rules.mmd",
        "form_rules.mmd",
        "base_rules.mmd",
        "fork_rules.mmd",
        "keep_rules.mmd",
        "native_rules.mmd",
        "run_fates.mmd",
    }


def test_svg_is_rendered_with_the_diagrams_extra(tmp_path: Path) -> None:
    data = render_svg("turn")
    assert data is not None, "pygraphviz (the diagrams extra) must be installed for tests"
    assert data.lstrip().startswith(b"<?xml")
    assert b"<svg" in data
    assert b"running_turn" in data
    written = write_diagrams(tmp_path)
    assert {p.name for p in written} == {
        "turn.mmd",
        "turn.svg",
        "compaction.mmd",
        "compaction.svg",
        "steering.mmd",
        "steering.svg",
        "branch.mmd",
        "branch.svg",
        "archive.mmd",
        "archive.svg",
        "diagnostics.mmd",
        "diagnostics.svg",
        "thread_rules.mmd",
        "thread_rules.svg",
        "continuity_rules.mmd",
        "continuity_rules.svg",
        "inject_rules.mmd",
        "inject_rules.svg",
        "answer_rules.mmd",
        "answer_rules.svg",
        "form_rules.mmd",
        "form_rules.svg",
        "base_rules.mmd",
        "base_rules.svg",
        "fork_rules.mmd",
        "fork_rules.svg",
        "keep_rules.mmd",
        "keep_rules.svg",
        "native_rules.mmd",
        "native_rules.svg",
        "run_fates.mmd",
        "run_fates.svg",
    }


def test_write_diagrams_takes_no_default_directory() -> None:
    """A library call never writes into the current directory by default."""
    parameter = inspect.signature(write_diagrams).parameters["directory"]
    assert parameter.default is inspect.Parameter.empty


def test_the_module_cli_outside_a_checkout_needs_out_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m codex_turn diagrams`` is ``codex-turn diagrams``: run from an installed
    package (not a source checkout) in an empty directory, it asks for --out and writes
    nothing there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "source_diagrams_dir", lambda: None)
    assert cli.main(["diagrams"]) == EXIT_USAGE
    assert "--out DIR is required" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "out"
    assert cli.main(["diagrams", "--out", str(out), "--no-svg"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "answer_rules.mmd",
        "archive.mmd",
        "base_rules.mmd",
        "branch.mmd",
        "compaction.mmd",
        "continuity_rules.mmd",
        "diagnostics.mmd",
        "fork_rules.mmd",
        "form_rules.mmd",
        "inject_rules.mmd",
        "keep_rules.mmd",
        "native_rules.mmd",
        "run_fates.mmd",
        "steering.mmd",
        "thread_rules.mmd",
        "turn.mmd",
    ]
    assert capsys.readouterr().out.split() == [
        str(out / "turn.mmd"),
        str(out / "compaction.mmd"),
        str(out / "steering.mmd"),
        str(out / "branch.mmd"),
        str(out / "archive.mmd"),
        str(out / "diagnostics.mmd"),
        str(out / "thread_rules.mmd"),
        str(out / "continuity_rules.mmd"),
        str(out / "inject_rules.mmd"),
        str(out / "answer_rules.mmd"),
        str(out / "form_rules.mmd"),
        str(out / "base_rules.mmd"),
        str(out / "fork_rules.mmd"),
        str(out / "keep_rules.mmd"),
        str(out / "native_rules.mmd"),
        str(out / "run_fates.mmd"),
    ]


def test_the_module_cli_defaults_to_the_checkout_like_codex_turn_diagrams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From a source checkout, both write the checkout's diagrams/ (one implementation)."""
    assert cli.source_diagrams_dir() == ROOT / "diagrams"
    seen: list[tuple[Path, bool]] = []

    def fake_write(directory: Path, *, svg: bool = True) -> list[Path]:
        seen.append((directory, svg))
        return []

    monkeypatch.setattr(diagrams_module, "write_diagrams", fake_write)
    assert cli.main(["diagrams", "--no-svg"]) == 0
    assert cli.main(["diagrams", "--no-svg"]) == 0
    assert seen == [(ROOT / "diagrams", False)] * 2


def test_the_module_cli_help_describes_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["diagrams", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--out DIR" in help_text
    assert "source checkout" in help_text
    assert "render the state diagrams from the tables" in help_text
    assert "``" not in help_text  # not a docstring's markup


# --- rule tables ------------------------------------------------------------------------------

CHARTS = sorted((*RULE_DIAGRAMS, FATES_DIAGRAM))
CHART_NODE = re.compile(r'^  (\w+)(\{\{|\(\[|\[)"(.*)"(\}\}|\]\)|\]):::(\w+)Node$')
CHART_LINK = re.compile(r'^  (\w+) (==>|-\.->|~~~)(?:\|"(\w+)"\|)? (\w+)$')


def chart_nodes(name: str) -> list[tuple[str, list[str]]]:
    """(id, label lines) of every node of the Mermaid source, in drawing order."""
    source = render_chart_mermaid(name)
    return [
        (match[1], match[3].split("<br/>"))
        for line in source.splitlines()
        if (match := CHART_NODE.match(line))
    ]


def chart_links(name: str) -> list[tuple[str, str | None, str]]:
    """(source, label, dest) of every link of the Mermaid source, in drawing order."""
    source = render_chart_mermaid(name)
    return [
        (match[1], match[3], match[4])
        for line in source.splitlines()
        if (match := CHART_LINK.match(line))
    ]


def facts_of(rule: Rule[Any]) -> list[str]:
    return [*rule.when, *(f"!{fact}" for fact in rule.unless)]


def test_every_rule_table_of_the_fsm_package_is_drawn() -> None:
    """A rule table added to ``codex_turn.fsm`` gets its diagram: every module-level tuple of
    ``Rule`` rows there is in the registry, under its own name in lower case."""
    tables: dict[str, object] = {}
    for info in pkgutil.iter_modules(fsm.__path__, f"{fsm.__name__}."):
        module = importlib.import_module(info.name)
        for attribute, value in vars(module).items():
            if isinstance(value, tuple) and value and all(isinstance(r, Rule) for r in value):
                tables[attribute.lower()] = value
    assert {"thread_rules", "continuity_rules", "inject_rules", "answer_rules"} <= set(tables)
    assert set(RULE_DIAGRAMS) == set(tables)
    for name, rules in RULE_DIAGRAMS.items():
        assert rules is tables[name], name
    assert RULE_DIAGRAMS["thread_rules"] is THREAD_RULES
    assert RULE_DIAGRAMS["continuity_rules"] is CONTINUITY_RULES
    assert RULE_DIAGRAMS["inject_rules"] is INJECT_RULES
    assert RULE_DIAGRAMS["answer_rules"] is ANSWER_RULES


@pytest.mark.parametrize("name", CHARTS)
def test_committed_rule_diagram_is_fresh(name: str) -> None:
    committed = (ROOT / "diagrams" / f"{name}.mmd").read_text(encoding="utf-8")
    assert committed == render_chart_mermaid(name), (
        f"diagrams/{name}.mmd is stale: run `python -m codex_turn diagrams`"
    )


@pytest.mark.parametrize("name", sorted(RULE_DIAGRAMS))
def test_a_rule_table_ends_with_its_only_unconditional_row(name: str) -> None:
    """``decide`` needs the last row to hold always; an earlier one would hide the rest."""
    rules = RULE_DIAGRAMS[name]
    assert [bool(facts_of(rule)) for rule in rules] == [True] * (len(rules) - 1) + [False]


@pytest.mark.parametrize("name", sorted(RULE_DIAGRAMS))
def test_every_rule_is_drawn_exactly_once_in_table_order_in_mermaid(name: str) -> None:
    rules = RULE_DIAGRAMS[name]
    source = render_chart_mermaid(name)
    assert "\nflowchart TB\n" in source
    nodes = chart_nodes(name)
    rows = [(key, lines) for key, lines in nodes if key.startswith("R")]
    answers = dict((key, lines) for key, lines in nodes if key.startswith("D"))
    assert [key for key, _ in rows] == [f"R{i}" for i in range(1, len(rules) + 1)]
    assert len(nodes) == 2 * len(rules)
    for (key, lines), rule in zip(rows, rules, strict=True):
        if rule is rules[-1]:
            assert lines == ["otherwise"]
        else:
            assert [lines[0], *(line.removeprefix("& ") for line in lines[1:])] == facts_of(rule), (
                key
            )
        said = answers[key.replace("R", "D")]
        assert said == list(decision_lines(rule.decision))
        action = getattr(rule.decision, "action", rule.decision)
        assert said[0] == action.value
        if reason := getattr(rule.decision, "reason", None):
            assert said[1] == reason
    # yes to the row's answer, no to the next row; the last row has no "no".
    expected: list[tuple[str, str | None, str]] = []
    for i in range(1, len(rules)):
        expected += [(f"R{i}", "yes", f"D{i}"), (f"R{i}", "no", f"R{i + 1}")]
    expected.append((f"R{len(rules)}", None, f"D{len(rules)}"))
    assert chart_links(name) == expected


@pytest.mark.parametrize("name", sorted(RULE_DIAGRAMS))
def test_every_rule_is_drawn_exactly_once_in_table_order_in_the_svg(name: str) -> None:
    rules = RULE_DIAGRAMS[name]
    data = render_chart_svg(name)
    assert data is not None, "pygraphviz (the diagrams extra) must be installed for tests"
    root = ET.fromstring(data)
    texts: dict[str, list[str]] = {}
    for g in root.iter(f"{SVG}g"):
        title = g.find(f"{SVG}title")
        if g.attrib.get("class") == "node" and title is not None and title.text:
            texts[title.text] = [t.text or "" for t in g.iter(f"{SVG}text")]
    assert sorted(texts) == sorted(
        [f"R{i}" for i in range(1, len(rules) + 1)] + [f"D{i}" for i in range(1, len(rules) + 1)]
    )
    for i, rule in enumerate(rules, start=1):
        facts = facts_of(rule) or ["otherwise"]
        drawn = [line.replace("\xa0", " ").removeprefix("& ") for line in texts[f"R{i}"]]
        assert drawn == facts, i
        assert texts[f"D{i}"] == list(decision_lines(rule.decision)), i
    edges = [g.attrib["id"] for g in root.iter(f"{SVG}g") if g.attrib.get("class") == "edge"]
    last = len(rules)
    assert sorted(edges) == sorted(
        [f"R{i}->D{i}" for i in range(1, last + 1)] + [f"R{i}->R{i + 1}" for i in range(1, last)]
    )
    assert not any(edge.startswith(f"R{last}->R") for edge in edges)


def test_a_thread_row_says_when_it_keeps_the_raw_prompt_and_the_binding() -> None:
    answers = dict(chart_nodes("thread_rules"))
    kept = [lines for key, lines in answers.items() if "binding unchanged" in lines]
    assert (
        kept
        == [["resume", "context-unavailable-keep-thread", "raw prompt", "binding unchanged"]] * 3
    )
    assert answers["D1"] == ["transient", "own-transient-thread"]


@pytest.mark.parametrize("name", CHARTS)
def test_the_rule_svg_fits_the_readme(name: str) -> None:
    """At most 1000 px wide; a table of more than two rows is portrait (two rows side by
    side with their answers are wider than tall, however far apart)."""
    data = render_chart_svg(name)
    assert data is not None, "pygraphviz (the diagrams extra) must be installed for tests"
    root = ET.fromstring(data)
    width_pt = float(root.attrib["width"].removesuffix("pt"))
    height_pt = float(root.attrib["height"].removesuffix("pt"))
    assert width_pt * 96 / 72 <= 1000, (width_pt, height_pt)
    if len(RULE_DIAGRAMS.get(name, ())) != 2:
        assert width_pt <= height_pt, (width_pt, height_pt)


def test_every_run_fate_is_drawn_once_per_run_kind() -> None:
    nodes = chart_nodes(FATES_DIAGRAM)
    assert [key for key, _ in nodes] == [f"RUN_{kind.name}" for kind in RunKind]
    drawn = {
        (kind, line.split(" → ")[0]): line.split(" → ")[1]
        for (_, (title, *lines)), kind in zip(nodes, RunKind, strict=True)
        for line in lines
        if title == kind.value
    }
    assert len(drawn) == len(RUN_FATES) == len(RunKind) * len(SteerMode)
    assert set(drawn) == {(kind, mode.value) for kind, mode in RUN_FATES}
    assert drawn[(RunKind.TURN, "steer")] == "steered into the running turn"
    assert drawn[(RunKind.REVIEW, "steer")] == "queued (refuses_steering)"
    assert drawn[(RunKind.TURN, "collect")] == "collected (collect)"
    assert drawn[(RunKind.COMPACTION, "collect")] == "queued (refuses_steering)"
    # The boxes are stacked by invisible links, nothing else.
    assert chart_links(FATES_DIAGRAM) == [
        ("RUN_TURN", None, "RUN_REVIEW"),
        ("RUN_REVIEW", None, "RUN_COMPACTION"),
    ]
    data = render_chart_svg(FATES_DIAGRAM)
    assert data is not None
    svg_text = [t.text or "" for t in ET.fromstring(data).iter(f"{SVG}text")]
    for (kind, mode), fate in drawn.items():
        assert f"{mode} → {fate}" in [line.replace("\xa0", " ") for line in svg_text], (kind, mode)
