"""The dynamic-tools fingerprint: when may a Codex thread be resumed with this tool catalog?

Codex fixes a thread's dynamic tools when the thread starts, so a runner that resumes a thread
must know whether the tools it would declare now are the ones the thread was started with. The
fingerprint is the canonical JSON text of the catalog (OpenClaw's PR-era rule, reference 2.11):

* every object's keys sorted, recursively, in code-point order (``json.dumps(sort_keys=True)``;
  note JavaScript sorts by UTF-16 code units, which differs only for astral characters);
* each spec's *top-level* ``description`` removed: rewording a tool's help must not rotate
  threads (nested descriptions, inside the input schema, do count);
* the specs sorted by their own JSON text, so declaration order does not matter;
* compact separators, non-ASCII kept as is (``JSON.stringify``'s shape).

It is computed from the tool catalog *only*. Assembled context and developer instructions
change every turn; if they entered the fingerprint, every turn would start a new thread and
the prompt cache would never be warm. The signature makes that impossible: the function sees
nothing but the specs. An empty catalog fingerprints as ``"[]"``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["dynamic_tools_fingerprint", "fingerprints_compatible"]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def dynamic_tools_fingerprint(specs: Iterable[Mapping[str, Any]]) -> str:
    """Stable text identifying a dynamic-tool catalog (see module docstring)."""
    texts = []
    for spec in specs:
        if not isinstance(spec, Mapping):
            raise TypeError(f"a dynamic tool spec must be a mapping, not {type(spec).__name__}")
        texts.append(_canonical({k: v for k, v in spec.items() if k != "description"}))
    texts.sort()
    return "[" + ",".join(texts) + "]"


def fingerprints_compatible(previous: str | None, current: str) -> bool:
    """A thread bound under ``previous`` may be resumed with ``current`` (missing = unknown)."""
    return previous is None or previous == current
