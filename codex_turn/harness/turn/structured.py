"""The structured projection's thread strategy: an ephemeral fork of the session's base thread.

Measured with the real binary (``benchmarks/bench_inject.py``): of the ways to hand
Codex an assembly as Responses items every turn, the fastest sound one is

    base thread (bound, idle, never runs a turn of its own; neutral instructions)
      -> thread/fork {ephemeral: true, excludeTurns: true}        (~10-13 ms)
      -> thread/inject_items into the idle fork: the assembly, then the turn's developer
         instructions as one developer item                   (~1 ms + ~0.03 ms/item)
      -> turn/start with the raw prompt, in the fork
      -> the fork is kept for the session's next turn (below), or released: forgotten
         here, unsubscribed in Codex (which unloads it after ``thread_unload_delay_secs``; an
         ephemeral fork can be neither deleted nor archived, and each one holds ~1.5 MB)

* *Cache.* An ephemeral fork keeps its parent's ``prompt_cache_key`` (the base thread id), so
  every turn of the session shares one key; the items carry their own deterministic ids
  (:mod:`codex_turn.projection.items`), so a conversation that only grows sends a request
  whose content is the previous request's plus the new messages.
* *No snowball.* The base never runs a turn, and a fork is continued only while the engine's
  items begin with everything it holds (otherwise it is discarded), so nothing projected
  accumulates in Codex's native history: each assembled message reaches the model once per
  turn, whatever the number of turns.
* *Never into a running turn.* Items are injected into the fork before its ``turn/start``
  (injection into a running turn would force an extra model call).
* *Compaction.* A native compaction inside the fork dies with the fork (a compacted fork is
  never continued); the next turn forks the base again and injects the assembly in full: it
  always re-projects.
* A thread with neither a turn nor an injection has no rollout and cannot be forked (Codex:
  "no rollout found"); the base is then anchored with :data:`ANCHOR`, an ``item_reference``
  that Codex accepts, writes, and never sends to the model.
* *Instructions.* The anchor writes the base's initial context (developer instructions,
  environment) into its rollout, and every fork inherits it: ``developerInstructions`` sent
  on ``thread/fork`` never reach the model. So the base is started without instructions,
  and each fork gets the turn's own (the host's, the engine's addition) as a developer item
  after the context (:func:`developer_item`): they may change every turn, and the context
  before them stays a cacheable prefix.

The other candidates measured (a fresh thread per turn with the text frame or with items; a
base thread reset with ``thread/revert`` and re-injected in full or by delta; a fork of a
base that accumulates the assembly) cost 1.7x to 8x the protocol floor at 1,000 messages, or
gave a new cache key every turn, or snowballed (a revert keeps items injected before the
first reverted turn, so "reset and re-inject in full" duplicates the context every turn).

*Continued forks.* A fork that ran a completed turn is kept (``AppServer.keep_fork``) with
what it holds; the session's next turn continues it, injecting only what follows, when the
fork table (:data:`codex_turn.fsm.thread.FORK_RULES`) says so: the engine's items begin with
everything the fork holds, and nothing else changed. A conversation that only grows then
costs what a plain follow-up turn costs (no fork, no re-injection), with the prompt cache's
prefix intact; anything else forks afresh.

This module performs the protocol steps and reports typed failures; it decides nothing
about the turn. The turn machine does: ``projecting`` exits ``projected_as_items`` when the
form table (:data:`codex_turn.fsm.thread.FORM_RULES`) chooses items, the thread table's
``fork`` action runs the turn in a fork, and a :class:`ForkFailed` is the trigger
``fork_failed``, which steps back to ``reprojecting`` for the text frame.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol, TypeGuard

import attrs

from codex_turn._log import format_error
from codex_turn.harness.appserver import (
    AppServerError,
    AppServerRpcError,
    NoRollout,
    ThreadNotFound,
    ThreadResult,
    ThreadSettings,
)
from codex_turn.harness.appserver.thread_settings import DEFAULT_SETTINGS
from codex_turn.harness.appserver.threads import KeptFork
from codex_turn.projection.items import canonical_json

__all__ = [
    "ANCHOR",
    "ForkFailed",
    "PreparedFork",
    "SupportsStructured",
    "anchor_base",
    "developer_item",
    "drop_kept_fork",
    "fork_failure",
    "keep_fork",
    "kept_fork",
    "prepare_fork",
    "release_fork",
    "supports_structured",
    "take_kept_fork",
]

#: Accepted and persisted by ``thread/inject_items``, never sent to the model.
ANCHOR: Final[Mapping[str, Any]] = {"type": "item_reference", "id": "msg_codex_turn_anchor"}


class SupportsStructured(Protocol):
    """What the structured projection needs beyond the turn port: fork and inject."""

    async def fork_thread(self, thread_id: str, settings: ThreadSettings) -> ThreadResult: ...

    async def inject_items(self, thread_id: str, items: Sequence[Mapping[str, Any]]) -> None: ...

    def forget_thread(self, thread_id: str) -> None: ...


def supports_structured(app_server: object) -> TypeGuard[SupportsStructured]:
    """Whether ``app_server`` can fork and inject: it has the methods (a test fake without
    them cannot, and its turns use the text frame) and has not learned that its binary
    lacks them (``AppServer.can_fork``)."""
    return (
        callable(getattr(app_server, "fork_thread", None))
        and callable(getattr(app_server, "inject_items", None))
        and getattr(app_server, "can_fork", True) is not False
    )


@attrs.frozen
class PreparedFork:
    """An idle ephemeral fork of ``base_thread_id`` holding the injected items."""

    base_thread_id: str
    thread: ThreadResult  # the fork, as thread/fork answered
    injected: int
    anchored: bool  # the base had no rollout and was anchored first

    @property
    def fork_thread_id(self) -> str:
        return self.thread.thread_id


@attrs.frozen
class ForkFailed:
    """Why no fork could be prepared."""

    step: str  # "fork" | "anchor" | "inject"
    error: str  # redacted; an item Codex quoted in its refusal is cut away
    #: Codex answered (it refused the fork or the items): asking again gets the same answer,
    #: and the turn falls back to the text frame. Otherwise (a timeout, a dead process) the
    #: failure says nothing about the base, and the turn fails with its binding kept.
    definitive: bool = True
    #: A fork that was created before the failure (already forgotten locally).
    fork_thread_id: str | None = None


# Codex's serde refusal quotes the item it could not parse: everything after the position
# is cut (format_error hides only longer quoted prose).
_ITEM_REFUSAL = re.compile(r"(items\[\d+\] is not a valid response item).*", re.DOTALL)


def fork_failure(step: str, error: AppServerError, fork_thread_id: str | None = None) -> ForkFailed:
    text = _ITEM_REFUSAL.sub(r"\1", format_error(error))
    return ForkFailed(
        step=step,
        error=text,
        definitive=isinstance(error, AppServerRpcError),
        fork_thread_id=fork_thread_id,
    )


def developer_item(text: str) -> dict[str, Any]:
    """``text`` as a developer message item, with a content-derived id (equal instructions,
    equal item: the prompt cache's prefix is kept). A fork inherits its base's initial
    context, so instructions that may change between turns travel as this item, after the
    context and right before the prompt."""
    item: dict[str, Any] = {
        "type": "message",
        "role": "developer",
        "content": [{"type": "input_text", "text": text}],
    }
    digest = hashlib.sha256(canonical_json(item).encode("utf-8", "surrogatepass"))
    return {**item, "id": "msg_dev_" + digest.hexdigest()[:40]}


def release_fork(port: SupportsStructured, fork_thread_id: str) -> None:
    """A fork ran its turn: release it (:meth:`AppServer.release_fork`: forgotten locally,
    unsubscribed in the background so that Codex unloads it), or just forget it locally
    on a port that cannot do more."""
    release = getattr(port, "release_fork", None)
    if callable(release):
        release(fork_thread_id)
    else:
        port.forget_thread(fork_thread_id)


def keep_fork(port: SupportsStructured, kept: KeptFork) -> None:
    """Keep a fork that ran its turn for the base's next turn (``AppServer.keep_fork``), or
    release it on a port that cannot keep forks."""
    keep = getattr(port, "keep_fork", None)
    if callable(keep):
        keep(kept)
    else:
        release_fork(port, kept.fork_thread_id)


def take_kept_fork(port: object, base_thread_id: str) -> KeptFork | None:
    """The fork kept for ``base_thread_id``, handed over to the caller (who continues or
    releases it), or ``None``."""
    take = getattr(port, "take_kept_fork", None)
    kept = take(base_thread_id) if callable(take) else None
    return kept if isinstance(kept, KeptFork) else None


def drop_kept_fork(port: object, base_thread_id: str) -> bool:
    """Release the fork kept for ``base_thread_id``, if ``port`` keeps one (whether it did):
    the session leaves that base, or its native history must go (a compaction)."""
    kept = take_kept_fork(port, base_thread_id)
    if kept is None:
        return False
    release = getattr(port, "release_fork", None)
    if callable(release):
        release(kept.fork_thread_id)
    return True


def kept_fork(port: SupportsStructured, base_thread_id: str) -> KeptFork | None:
    """The fork kept for ``base_thread_id``, left kept (a look at what it holds), or ``None``."""
    look = getattr(port, "kept_fork", None)
    kept = look(base_thread_id) if callable(look) else None
    return kept if isinstance(kept, KeptFork) else None


async def anchor_base(port: SupportsStructured, base_thread_id: str) -> None:
    """Give an idle, loaded base thread a rollout (:data:`ANCHOR`), so that it can be forked
    in this process and in any later one. Raises :class:`AppServerError`."""
    await port.inject_items(base_thread_id, [ANCHOR])


async def prepare_fork(
    port: SupportsStructured,
    base_thread_id: str,
    items: Sequence[Mapping[str, Any]],
    settings: ThreadSettings = DEFAULT_SETTINGS,
) -> PreparedFork | ForkFailed:
    """Fork ``base_thread_id`` (ephemeral, with ``settings``) and inject ``items`` into the
    idle fork.

    The base must be idle. A base without a rollout (loaded in this process) is anchored
    first. Never raises :class:`AppServerError`: a failure is returned as
    :class:`ForkFailed`; a fork created before a failure or a cancellation is forgotten
    locally (Codex keeps it until its process ends).
    """

    async def fork() -> ThreadResult:
        return await port.fork_thread(base_thread_id, settings)

    anchored = False
    try:
        try:
            thread = await fork()
        except AppServerRpcError as error:
            # Classified by the boundary's one reader of Codex's wording.
            if not isinstance(ThreadNotFound.match(error, base_thread_id), NoRollout):
                raise
            anchored = True
            await anchor_base(port, base_thread_id)
            thread = await fork()
    except AppServerError as error:
        return fork_failure("anchor" if anchored else "fork", error)
    try:
        if items:
            await port.inject_items(thread.thread_id, items)
    except AppServerError as error:
        port.forget_thread(thread.thread_id)
        return fork_failure("inject", error, thread.thread_id)
    except BaseException:
        port.forget_thread(thread.thread_id)  # cancelled: nobody will run this fork
        raise
    return PreparedFork(
        base_thread_id=base_thread_id, thread=thread, injected=len(items), anchored=anchored
    )
