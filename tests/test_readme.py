"""The README and the PyPI page say what is true: their examples run as written, every command
they name exists (with the flags they give it), and every public name their code uses is
exported.

A python block of ``README.md`` that follows :data:`RUN_MARKER` runs as written, in a fresh
process with this interpreter in an empty directory; the ``text`` block right after it lists
lines its output must contain. ``docs/PYPI.md`` is held to the same rule for the first python
block under its ``## A turn`` heading (a PyPI page carries no marker comments).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import codex_turn
from codex_turn.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PYPI = ROOT / "docs" / "PYPI.md"
RUN_MARKER = "<!-- tests/test_readme.py runs the next python block"
PYPI_ANCHOR = "## A turn"
EXAMPLE_TIMEOUT_S = 60.0

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"codex-turn ([a-z][a-z-]*)\b([^`\n]*)")
_COMMENT = re.compile(r"(?:^|\s)#\s.*")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fences(text: str, start: int = 0) -> list[re.Match[str]]:
    return list(_FENCE.finditer(text, start))


def example_after(text: str, anchor_at: int) -> tuple[str, list[str]]:
    """The first python block after ``anchor_at``, and the lines of the ``text`` block that
    immediately follows it (only prose in between), which the program must print."""
    fences = _fences(text, anchor_at)
    index = next(i for i, fence in enumerate(fences) if fence.group(1) == "python")
    code = fences[index].group(2)
    expected: list[str] = []
    if index + 1 < len(fences) and fences[index + 1].group(1) == "text":
        between = text[fences[index].end() : fences[index + 1].start()]
        if "```" not in between and "<!--" not in between:
            expected = fences[index + 1].group(2).splitlines()
    return code, [line for line in expected if line.strip()]


def readme_examples() -> list[tuple[str, list[str]]]:
    text = _read(README)
    return [example_after(text, m.end()) for m in re.finditer(re.escape(RUN_MARKER), text)]


def run_example(code: str, expected: list[str], workdir: Path) -> None:
    script = workdir / "example.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, script.name],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    printed = proc.stdout.splitlines()
    missing = [line for line in expected if line not in printed]
    assert not missing, f"not printed: {missing}\n--- stdout:\n{proc.stdout}"


def _example_params() -> list[Any]:
    params = []
    for index, (code, expected) in enumerate(readme_examples()):
        # A program that starts the app-server runs the real binary.
        marks = [pytest.mark.codex] if "AppServer.start" in code else []
        params.append(pytest.param(code, expected, id=f"readme-{index + 1}", marks=marks))
    return params


def test_the_readme_has_a_runner_and_an_engine_example_each_with_its_output() -> None:
    examples = readme_examples()
    assert len(examples) == 2
    runner, engine = examples
    assert "run_codex_turn" in runner[0]
    assert "AppServerConfig.user()" in runner[0]
    assert "internet attempts: 0" in runner[1]
    assert "check_engine_conformance" in engine[0]
    assert "assert_conforms" in engine[0]
    assert any("0 failed" in line for line in engine[1])


@pytest.mark.parametrize(("code", "expected"), _example_params())
def test_a_readme_example_runs_as_written(code: str, expected: list[str], tmp_path: Path) -> None:
    run_example(code, expected, tmp_path)


@pytest.mark.codex
def test_the_pypi_example_runs_as_written(tmp_path: Path) -> None:
    text = _read(PYPI)
    code, expected = example_after(text, text.index(PYPI_ANCHOR))
    assert "AppServerConfig.user()" in code
    assert expected
    run_example(code, expected, tmp_path)


# --- Commands -------------------------------------------------------------------------------


def _code_texts(text: str) -> list[str]:
    """Everything set as code: fenced blocks, indented blocks and inline spans."""
    prose = _FENCE.sub("", text)
    indented = [line for line in prose.splitlines() if line.startswith("    ")]
    return [m.group(2) for m in _fences(text)] + indented + _INLINE_CODE.findall(prose)


def named_commands(text: str) -> dict[str, set[str]]:
    """``codex-turn <command>`` set as code (not in a comment), with the flags given on the
    same line."""
    commands: dict[str, set[str]] = {}
    for code in _code_texts(text):
        for line in code.splitlines():
            line = _COMMENT.sub("", line)  # a comment is prose
            for match in _COMMAND.finditer(line):
                flags = commands.setdefault(match.group(1), set())
                flags.update(_FLAG.findall(match.group(2)))
    return commands


def cli_commands() -> set[str]:
    actions = build_parser()._actions
    return {
        name
        for action in actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    }


def test_every_command_the_docs_name_exists_with_its_flags() -> None:
    named = named_commands(_read(README))
    for command, flags in named_commands(_read(PYPI)).items():
        named.setdefault(command, set()).update(flags)
    assert set(named) <= cli_commands()
    helps = {  # all at once: each is a fresh interpreter
        command: subprocess.Popen(
            [sys.executable, "-m", "codex_turn", command, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in sorted(named)
    }
    for command, proc in helps.items():
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, f"codex-turn {command} --help: {err}"
        assert set(_FLAG.findall(out)) >= named[command], (command, named[command])


def test_the_readme_names_every_command() -> None:
    assert set(named_commands(_read(README))) == cli_commands()


# --- Public names ---------------------------------------------------------------------------


def used_names(code: str) -> set[tuple[str, str]]:
    """``(module, name)`` for every name a block takes from codex_turn."""
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT  # a fragment may await
    tree = compile(code, "<doc>", "exec", flags=flags)
    used: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("codex_turn"):
            used.update((node.module or "", alias.name) for alias in node.names)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "codex_turn"
        ):
            used.add(("codex_turn", node.attr))
    return used


@pytest.mark.parametrize("doc", [README, PYPI], ids=lambda path: path.name)
def test_every_public_name_the_docs_code_uses_is_exported(doc: Path) -> None:
    blocks = [m.group(2) for m in _fences(_read(doc)) if m.group(1) == "python"]
    used = set().union(*(used_names(code) for code in blocks))
    assert ("codex_turn", "run_codex_turn") in used
    unexported = {
        (module, name)
        for module, name in used
        if name not in getattr(importlib.import_module(module), "__all__", ())
    }
    assert not unexported


def test_every_class_the_engine_contract_names_is_exported_by_codex_turn() -> None:
    text = _read(README)
    section = text[text.index("## Writing an engine") : text.index("### The conformance kit")]
    names = {
        match.group(1)
        for span in _INLINE_CODE.findall(section)
        if (match := re.match(r"([A-Z][A-Za-z0-9]*)\b", span))
    }
    names -= {name for name in names if hasattr(builtins, name)}
    assert {"ContextEngineInfo", "AssembleParams", "CompactResult"} <= names
    assert names <= set(codex_turn.__all__)
