"""The structured projection's thread strategy: an ephemeral fork of the session's base thread.

Measured with the real binary (``benchmarks/bench_inject.py``, issue 15): of the ways to hand
Codex an assembly as Responses items every turn, the fastest sound one is

    base thread (bound, idle, never runs a turn of its own)
      -> thread/fork {ephemeral: true, excludeTurns: true}        (~13 ms)
      -> thread/inject_items (the whole assembly, into the idle fork)  (~10 ms + 0.05 ms/item)
      -> turn/start with the raw prompt, in the fork
      -> the fork is forgotten

* *Cache.* An ephemeral fork keeps its parent's ``prompt_cache_key`` (the base thread id), so
  every turn of the session shares one key; the items carry their own deterministic ids
  (:mod:`codex_turn.projection.items`), so a conversation that only grows sends a request
  whose content is the previous request's plus the new messages.
* *No snowball.* The base never runs a turn and the fork is discarded, so nothing projected
  accumulates in Codex's native history: each assembled message reaches the model once per
  turn, whatever the number of turns.
* *Never into a running turn.* Items are injected into the fork before its ``turn/start``
  (injection into a running turn would force an extra model call).
* *Compaction.* A native compaction inside the fork dies with the fork; the next turn forks
  the base again and injects the assembly in full: it always re-projects.
* A thread with neither a turn nor an injection has no rollout and cannot be forked (Codex:
  "no rollout found"); the base is then anchored with :data:`ANCHOR`, an ``item_reference``
  that Codex accepts, writes, and never sends to the model.

The other candidates measured (a fresh thread per turn with the text frame or with items; a
base thread reset with ``thread/revert`` and re-injected in full or by delta; a fork of a
base that accumulates the assembly) cost 1.7x to 8x the protocol floor at 1,000 messages, or
gave a new cache key every turn, or snowballed (a revert keeps items injected before the
first reverted turn, so "reset and re-inject in full" duplicates the context every turn).

This module performs the protocol steps and reports typed failures; it decides nothing
about the turn (the caller falls back to the text frame when :func:`prepare_fork` fails).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

from codex_turn._log import format_error
from codex_turn.harness.appserver import AppServerError, AppServerRpcError

__all__ = [
    "ANCHOR",
    "INJECT_BATCH",
    "ForkFailed",
    "PreparedFork",
    "SupportsStructured",
    "prepare_fork",
    "supports_structured",
]

#: Accepted and persisted by ``thread/inject_items``, never sent to the model.
ANCHOR: Final[Mapping[str, Any]] = {"type": "item_reference", "id": "msg_codex_turn_anchor"}
#: Items per ``thread/inject_items`` call (a batch is atomic; smaller batches keep each
#: request well under the transport's line limits).
INJECT_BATCH: Final = 2000
_NO_ROLLOUT: Final = "no rollout found"


class SupportsStructured(Protocol):
    """What the structured projection needs beyond the turn port: raw JSON-RPC calls."""

    async def request(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any: ...


def supports_structured(app_server: object) -> bool:
    """Whether ``app_server`` can fork and inject (the real :class:`AppServer` can; a test
    fake without ``request`` cannot, and its turns use the text frame)."""
    return callable(getattr(app_server, "request", None))


@attrs.frozen
class PreparedFork:
    """An idle ephemeral fork of ``base_thread_id`` holding the injected items."""

    base_thread_id: str
    fork_thread_id: str
    injected: int
    anchored: bool  # the base had no rollout and was anchored first


@attrs.frozen
class ForkFailed:
    """Why no fork could be prepared (the turn then falls back to the text frame)."""

    step: str  # "fork" | "anchor" | "inject"
    error: str
    #: A fork that was created before the failure (the caller forgets it).
    fork_thread_id: str | None = None


async def _fork(port: SupportsStructured, base: str, settings: Mapping[str, Any]) -> str:
    raw = await port.request(
        "thread/fork",
        {"threadId": base, "ephemeral": True, "excludeTurns": True, **settings},
    )
    thread = raw.get("thread") if isinstance(raw, Mapping) else None
    fork_id = thread.get("id") if isinstance(thread, Mapping) else None
    if not isinstance(fork_id, str) or not fork_id:
        raise AppServerError(f"thread/fork answered without a thread id: {raw!r:.200}")
    return fork_id


async def inject_items(
    port: SupportsStructured, thread_id: str, items: Sequence[Mapping[str, Any]]
) -> None:
    """``thread/inject_items`` in batches of :data:`INJECT_BATCH` (into an idle thread only)."""
    for start in range(0, len(items), INJECT_BATCH):
        await port.request(
            "thread/inject_items",
            {
                "threadId": thread_id,
                "items": [dict(i) for i in items[start : start + INJECT_BATCH]],
            },
        )


async def prepare_fork(
    port: SupportsStructured,
    base_thread_id: str,
    items: Sequence[Mapping[str, Any]],
    *,
    developer_instructions: str | None = None,
    cwd: str | None = None,
) -> PreparedFork | ForkFailed:
    """Fork ``base_thread_id`` (ephemeral) and inject ``items`` into the idle fork.

    The base must be idle and loaded in this process. Never raises :class:`AppServerError`:
    a failure is returned as :class:`ForkFailed` (with the fork to forget, if one exists).
    """
    settings: dict[str, Any] = {}
    if developer_instructions is not None:
        settings["developerInstructions"] = developer_instructions
    if cwd is not None:
        settings["cwd"] = cwd
    anchored = False
    try:
        try:
            fork_id = await _fork(port, base_thread_id, settings)
        except AppServerRpcError as error:
            if _NO_ROLLOUT not in str(error):
                raise
            anchored = True
            await inject_items(port, base_thread_id, [ANCHOR])
            fork_id = await _fork(port, base_thread_id, settings)
    except AppServerError as error:
        return ForkFailed(step="anchor" if anchored else "fork", error=format_error(error))
    try:
        if items:
            await inject_items(port, fork_id, items)
    except AppServerError as error:
        return ForkFailed(step="inject", error=format_error(error), fork_thread_id=fork_id)
    return PreparedFork(
        base_thread_id=base_thread_id,
        fork_thread_id=fork_id,
        injected=len(items),
        anchored=anchored,
    )
