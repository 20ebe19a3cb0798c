"""Field checks for the records a user builds: one table per record, one typed error.

A record whose fields come from users (:class:`~codex_turn.AppServerConfig`,
:class:`~codex_turn.engines.EngineSettings`) checks every field when it is built, ``attrs.evolve``
included, with a table from field name to a :data:`Check`: a function that returns what the
value must be (``"must be ..."``), or ``None`` when it is fine. :func:`validate` runs the table
and raises the record's own error with one message per bad field, ``Class.field: must ...``,
in field order, never quoting the value (a URL can carry credentials, an environment value a
key). A check never raises, whatever it is handed: a wrong type is one more bad value.

The checks here are the ones more than one record needs; a check only one record needs lives
beside that record. Numbers follow one rule: a count is an ``int`` (not a ``bool``) that fits
the 64 bits of SQLite, TOML and Codex; seconds and rates are finite (an ``int`` too large for
a float is not).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

__all__ = [
    "INT64_MAX",
    "Check",
    "at_least",
    "finite",
    "flag",
    "integer",
    "number",
    "one_of",
    "positive_rate",
    "seconds",
    "validate",
]

#: A field check: what the value must be, or ``None`` when it is fine.
Check = Callable[[Any], str | None]

#: The largest count a field may hold: SQLite's, TOML's and Codex's integers are 64-bit.
INT64_MAX: Final = 2**63 - 1


def number(value: Any) -> bool:
    """An ``int`` or ``float``, not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(value: Any) -> bool:
    """An ``int``, not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite(value: Any) -> bool:
    """A number that is a finite float (an ``int`` too large for a float is not)."""
    try:
        return number(value) and math.isfinite(value)
    except OverflowError:
        return False


def seconds(*, positive: bool = True, at_most: float | None = None) -> Check:
    """A finite number of seconds, ``> 0`` (``positive``) or ``>= 0``, at most ``at_most``."""
    what = "must be a " + ("positive" if positive else "non-negative") + ", finite number"
    what += " of seconds" + (f" (at most {at_most:g})" if at_most is not None else "")

    def check(value: Any) -> str | None:
        if not finite(value) or not (value > 0 if positive else value >= 0):
            return what
        return None if at_most is None or value <= at_most else what

    return check


def positive_rate(value: Any) -> str | None:
    """A positive, finite number (a rate)."""
    return None if finite(value) and value > 0 else "must be a positive, finite number"


def at_least(minimum: int, *, optional: bool = False) -> Check:
    """An ``int`` from ``minimum`` to :data:`INT64_MAX` (or ``None`` when ``optional``)."""
    what = f"must be an int from {minimum} to 2**63 - 1" + (" or None" if optional else "")

    def check(value: Any) -> str | None:
        if (value is None and optional) or (integer(value) and minimum <= value <= INT64_MAX):
            return None
        return what

    return check


def flag(*, optional: bool = False) -> Check:
    """``True`` or ``False`` (or ``None`` when ``optional``)."""
    what = "must be True or False" + (" (or None)" if optional else "")

    def check(value: Any) -> str | None:
        return None if isinstance(value, bool) or (value is None and optional) else what

    return check


def one_of(*choices: str) -> Check:
    """One of the strings ``choices``."""
    what = "must be one of " + ", ".join(repr(c) for c in choices)

    def check(value: Any) -> str | None:
        return None if isinstance(value, str) and value in choices else what

    return check


def validate(
    instance: Any,
    checks: Mapping[str, Check],
    error: Callable[[Sequence[str]], Exception],
) -> None:
    """Raise ``error(problems)`` naming every field of ``instance`` that fails its check (in
    field order), one message each, when there is any."""
    owner = type(instance).__name__
    problems = [
        f"{owner}.{field.name}: {problem}"
        for field in attrs.fields(type(instance))
        if (problem := checks[field.name](getattr(instance, field.name))) is not None
    ]
    if problems:
        raise error(problems)
