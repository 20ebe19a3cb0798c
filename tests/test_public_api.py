"""The public API: everything in ``codex_turn.__all__`` exists, errors share one root."""

from __future__ import annotations

import inspect

import codex_turn
from codex_turn.errors import CodexTurnError


def test_every_exported_name_resolves() -> None:
    missing = [name for name in codex_turn.__all__ if not hasattr(codex_turn, name)]
    assert missing == []
    assert len(set(codex_turn.__all__)) == len(codex_turn.__all__)


def test_every_exported_error_derives_from_codex_turn_error() -> None:
    errors = [
        getattr(codex_turn, name)
        for name in codex_turn.__all__
        if inspect.isclass(getattr(codex_turn, name))
        and issubclass(getattr(codex_turn, name), BaseException)
    ]
    assert len(errors) >= 10
    assert [e.__name__ for e in errors if not issubclass(e, CodexTurnError)] == []


def test_the_illegal_transition_error_is_also_a_transitions_machine_error() -> None:
    from transitions.core import MachineError

    assert issubclass(codex_turn.IllegalTransition, MachineError)
