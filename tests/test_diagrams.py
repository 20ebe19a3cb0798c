"""The committed diagrams are exactly what the tables render today."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from codex_turn.fsm.diagrams import DIAGRAMS, render_mermaid, render_svg, write_diagrams

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_committed_mermaid_diagram_is_fresh(name: str) -> None:
    committed = (ROOT / "diagrams" / f"{name}.mmd").read_text(encoding="utf-8")
    assert committed == render_mermaid(name), (
        f"diagrams/{name}.mmd is stale: run `python -m codex_turn.fsm.diagrams`"
    )


@pytest.mark.parametrize("name", sorted(DIAGRAMS))
def test_diagram_shows_every_state_trigger_and_guard(name: str) -> None:
    source = render_mermaid(name)
    machine = DIAGRAMS[name]
    for state, edges in machine.table.items():
        assert f'state "{state.name}"' in source
        for edge in edges:
            assert edge.trigger in source
            for guard in edge.when:
                assert guard in source
            for guard in edge.unless:
                assert f"!{guard}" in source


def test_rendering_is_byte_stable_across_hash_seeds(tmp_path: Path) -> None:
    outputs = []
    for seed in ("1", "2", "3"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "codex_turn.fsm.diagrams", str(out), "--no-svg"],
            check=True,
            env=env,
            capture_output=True,
        )
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1] == outputs[2]
    assert set(outputs[0]) == {"turn.mmd", "compaction.mmd"}


def test_svg_is_rendered_with_the_diagrams_extra(tmp_path: Path) -> None:
    data = render_svg("turn")
    assert data is not None, "pygraphviz (the diagrams extra) must be installed for tests"
    assert data.lstrip().startswith(b"<?xml")
    assert b"<svg" in data
    assert b"RUNNING_TURN" in data
    written = write_diagrams(tmp_path)
    assert {p.name for p in written} == {"turn.mmd", "turn.svg", "compaction.mmd", "compaction.svg"}
