"""Every flag of every command, given a hostile value, ends in a documented exit code.

The property: ``codex-turn COMMAND ... --FLAG=VALUE`` (or the positional replaced), for every
value-taking flag of every command but ``worker`` (the ``scale`` extra, tested with it), with
VALUE text holding NUL or lone surrogates (a non-UTF-8 byte of an argument, as the OS hands
it to Python: surrogateescape), absurd integers and floats, very long strings, odd paths (a
FIFO, a link loop, a directory, a path through a file, a ``~user`` of nobody), exits with
one of the codes ``--help`` documents (:data:`codex_turn._cli_support.EXIT_CODES`, 0, 130),
never 70 (a defect), prints no traceback, and under ``--log-format json`` writes stderr as
JSON lines only.

The command line runs in this process (:func:`codex_turn.cli.main`), not in a child: each
command starts from a valid base whose Codex binary does not exist, so nothing is spawned and
an example costs milliseconds; what the flags make of their values is checked before Codex
would start.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import write_session

from codex_turn import cli
from codex_turn._cli_support import EXIT_CODES, EXIT_INTERRUPTED, EXIT_OK, EXIT_SOFTWARE

DOCUMENTED = {EXIT_OK, EXIT_INTERRUPTED, *EXIT_CODES.values()}


def _base(command: str, root: Path) -> list[str]:
    session, missing = str(root / "s.jsonl"), str(root / "no-codex")
    return {
        "demo": ["demo", "--codex-bin", missing, "--out", str(root / "demo"), "--json"],
        "run": ["run", session, "--prompt", "hi", "--codex-bin", missing, "--engine", "none"],
        "chat": ["chat", session, "--codex-bin", missing, "--engine", "none"],
        "inspect": ["inspect", session],
        "doctor": ["doctor", session, "--codex-bin", missing],
        "compact": ["compact", session, "--codex-bin", missing],
        "engine": ["engine", "status", session, "--engine", "sqlite"],
        "diagrams": ["diagrams", "--out", str(root / "diagrams"), "--no-svg"],
        "login": ["login", "--with-api-key", "--codex-bin", missing],
        "logout": ["logout", "--codex-bin", missing],
        "threads": ["threads", "list", "--codex-bin", missing],
        "diagnostics": ["diagnostics", "--thread", "t", "--codex-bin", missing],
    }[command]


def _commands() -> dict[str, argparse.ArgumentParser]:
    return {
        name: child
        for action in cli.build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, child in action.choices.items()
        if name != "worker"
    }


def _value_flags() -> list[tuple[str, str]]:
    """(command, flag or positional dest) for every value-taking argument."""
    found = []
    for name, parser in _commands().items():
        for action in parser._actions:
            if action.nargs == 0 or action.help == argparse.SUPPRESS:
                continue  # switches (store_true, count, help) and the hidden old forms
            found.append(
                (name, action.option_strings[-1] if action.option_strings else action.dest)
            )
    return found


VALUE_FLAGS = _value_flags()

#: Paths made in the example's directory (a FIFO: reading it would wait forever).
ODD_PATHS = (
    "fifo",
    "loop",
    "file/sub",
    "/dev/null/x",
    "~nosuchuser0/x",
    ".",
    "/",
    "/proc/self/mem",
)

hostile = st.one_of(
    st.binary(max_size=40).map(os.fsdecode),  # NUL, and invalid UTF-8 as lone surrogates
    st.text(max_size=40),
    st.integers(min_value=-(10**420), max_value=10**420).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["1e999", "-1e999", "1e300", "nan", "-0", "0x10", "1_000", str(2**70)]),
    st.integers(min_value=256, max_value=200_000).map(lambda n: "x" * n),
    st.sampled_from(ODD_PATHS),
    st.sampled_from(["sk-proj-HOSTILE0123456789abc", "a:b", ":", "x" * 5000 + ":y"]),
)


@contextlib.contextmanager
def _sandbox(root: Path) -> Iterator[None]:
    (root / "file").write_text("x")
    os.mkfifo(root / "fifo")
    os.symlink("loop", root / "loop")
    write_session(root / "s.jsonl", "hello", "hi")
    with (
        contextlib.chdir(root),
        open(os.devnull) as nothing,
        mock.patch.object(sys, "stdin", nothing),
        mock.patch.object(cli, "configure_cli_logging", return_value=None),
    ):
        yield


def _argv(command: str, flag: str, value: str, root: Path) -> list[str]:
    argv = _base(command, root)
    if flag.startswith("-"):
        if flag in argv:
            at = argv.index(flag)
            del argv[at : at + 2]
        return [*argv, f"{flag}={value}"]
    if flag == "session_file":
        argv[1] = value
        return argv
    return [*argv, value]


def test_every_value_taking_flag_is_exercised() -> None:
    commands = {command for command, _ in VALUE_FLAGS}
    assert commands == set(_commands())
    assert ("run", "--token-budget") in VALUE_FLAGS
    assert ("inspect", "session_file") in VALUE_FLAGS
    assert ("compact", "--interrupt-grace") in VALUE_FLAGS


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(where=st.sampled_from(VALUE_FLAGS), value=hostile, json_lines=st.booleans())
def test_a_hostile_value_for_any_flag_ends_in_a_documented_exit_code(
    where: tuple[str, str], value: str, json_lines: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    command, flag = where
    root = tmp_path_factory.mktemp("hostile")
    argv = _argv(command, flag, value, root)
    if json_lines:
        argv.append("--log-format=json")
    out, err = io.StringIO(), io.StringIO()
    with _sandbox(root), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:  # argparse's exit: a usage error
            code = int(exit_.code or 0)
    stderr = err.getvalue()
    assert code != EXIT_SOFTWARE, (argv[:8], stderr[-600:])
    assert code in DOCUMENTED, (argv[:8], code, stderr[-600:])
    assert "Traceback" not in stderr
    assert "sk-proj-HOSTILE0123456789abc" not in stderr
    if json_lines:
        for line in stderr.splitlines():
            json.loads(line)
