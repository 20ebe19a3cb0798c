"""Text the package hands on: what Codex and the operating system can take, checked once.

Input is checked when the record holding it is built (:class:`~codex_turn.TurnParams`,
:class:`~codex_turn.AppServerConfig`), so that a value nothing downstream can use is refused
with the record's typed error, before anything is read, written, sent or spawned. Two
questions cover every text field:

* *Can Codex take it?* Text reaches Codex as UTF-8 (JSON-RPC lines, config.toml). A lone
  UTF-16 surrogate (``"\\ud800"``, possible in a Python ``str``, not in Unicode) has no UTF-8
  form: Codex refuses the line on stderr only and never answers, TOML cannot hold it, and the
  stores cannot encode it. :func:`has_lone_surrogate` finds one.
* *Can the OS take it?* A path, an argument of a spawned command or an environment entry is
  encoded with :func:`os.fsencode` (the file system encoding with ``surrogateescape``, so a
  file name read from disk as undecodable bytes round-trips), and a NUL byte ends a C string
  early, so the OS would act on a different path than the one given. :func:`is_os_string`
  says whether a value has an encoding without NUL.

A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import os

__all__ = ["has_lone_surrogate", "is_os_string"]


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a UTF-16 surrogate code point (see the module docstring)."""
    return not text.isascii() and any("\ud800" <= ch <= "\udfff" for ch in text)


def is_os_string(value: object) -> bool:
    """Whether ``value`` (a ``str``, ``bytes`` or path-like) is one the OS can take as a path,
    an argument or an environment entry: encodable by :func:`os.fsencode`, without NUL."""
    if not isinstance(value, str | bytes | os.PathLike):
        return False
    try:
        encoded = os.fsencode(value)
    except (TypeError, ValueError):  # a path-like of another type; an unencodable character
        return False
    return b"\x00" not in encoded
