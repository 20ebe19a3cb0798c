"""Integer settings from the environment (``CODEX_TURN_*``), each read once at import.

One parser for all of them: unset or blank gives the default; anything that is not an
integer within bounds is ignored with a warning naming the variable (never its value), and
the default stands, so a typo never stops a host from starting.
"""

from __future__ import annotations

import os

from codex_turn._log import get_logger

__all__ = ["int_from_env"]

_log = get_logger(__name__)


def int_from_env(name: str, *, default: int, low: int, high: int | None = None, what: str) -> int:
    """``name``'s integer value in ``[low, high]`` (``high=None``: unbounded), else ``default``
    (logged as ``"invalid <what> ignored"`` when set but unusable)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        _log.warning(f"invalid {what} ignored", variable=name, default=default)
        return default
    return value
