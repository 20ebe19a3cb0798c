"""Identifiers from outside, capped before they reach a log record or an error message.

Thread ids, turn ids, request ids, tool and method names come from callers, from binding
sidecars and from Codex itself, so their size is not ours to choose: a corrupt sidecar once
carried a 20 MB thread id into one log record. Every such value is logged through
:func:`capped` (at most :data:`~.defaults.MAX_LOGGED_ID_CHARS` characters, then a marker
with the original length), which keeps an ordinary id intact and a hostile one harmless.
"""

from __future__ import annotations

from .defaults import MAX_LOGGED_ID_CHARS

__all__ = ["capped"]


def capped(value: object, limit: int = MAX_LOGGED_ID_CHARS) -> str | None:
    """``value`` as text of at most ``limit`` characters (plus a length marker); ``None``
    stays ``None``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value
    else:
        try:
            text = str(value)
        except ValueError:  # an int too large to print (sys.get_int_max_str_digits)
            return f"<{type(value).__name__}>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…(+{len(text) - limit} chars)"
