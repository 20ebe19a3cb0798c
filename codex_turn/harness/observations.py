"""Observations: telemetry callbacks about a turn that can neither block nor change it.

Theory. A host wants to see what went to the model and what came back (``llm_input``,
``llm_output``) and every tool call Codex completed (``after_tool_call``: its native tools,
commands, file changes, MCP tools, web searches, generated images, and the host's own
dynamic tools, told apart by :attr:`ToolCallObserved.native`), for tracing and metrics. These
are *observations*: built from the app-server's notifications and the harness's own state
(never byte captures of Codex's requests), delivered after the fact, with no say in what
happens. So they cannot be allowed to hold the turn up or break it:

* each callback runs in a task of its own (:meth:`Observations.emit` only schedules it and
  returns at once), in a task group that lives for the whole turn
  (:meth:`Observations.running`, opened by the orchestrator around the turn machine);
* each call is bounded by ``TurnParams.observer_timeout``: a callback that hangs is cancelled
  at the bound (the turn's return waits for a pending one at most that long); one that raises
  is logged (its type only: never its message, which may quote content) and forgotten;
* at most :data:`MAX_PENDING` calls are pending at once; beyond that an observation is
  dropped (and counted in the log): a slow observer never grows memory without bound.

The records carry content (the prompt, the reply, a tool item): they are for the host's own
callbacks. Nothing of it is logged here. A callback may be ``async`` or a plain function
(a plain one is called inline: keep it quick; only an ``async`` one can be cut at the bound).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import anyio
import anyio.abc
import attrs

from codex_turn._log import get_logger
from codex_turn.harness.usage import Usage

__all__ = [
    "MAX_PENDING",
    "NATIVE_TOOL_ITEMS",
    "LlmInputObserved",
    "LlmOutputObserved",
    "Observations",
    "Observer",
    "ToolCallObserved",
    "tool_call_observed",
]

_log = get_logger(__name__)

_R = TypeVar("_R")
Observer = Callable[[_R], Awaitable[None] | None]

#: Observations pending at once before new ones are dropped.
MAX_PENDING: Final = 64

#: The item types of Codex's own tools, and the tool name each reports under (``None``: the
#: item's own ``tool``/``server`` fields name it).
NATIVE_TOOL_ITEMS: Final[Mapping[str, str | None]] = {
    "commandExecution": "command",
    "fileChange": "file_change",
    "mcpToolCall": None,
    "webSearch": "web_search",
    "imageGeneration": "image_generation",
}
_DYNAMIC_TOOL_ITEM: Final = "dynamicToolCall"


@attrs.frozen(kw_only=True)
class ToolCallObserved:
    """A tool call Codex completed (its ``item/completed``)."""

    thread_id: str | None
    turn_id: str | None
    item_id: str | None
    #: The item type (``commandExecution``, ``mcpToolCall``, ``dynamicToolCall`` ...).
    kind: str
    #: The tool's name (``command``, ``server.tool`` for MCP, ``namespace.tool`` ...).
    name: str
    #: Codex's own tool (``False``: one of the host's dynamic tools).
    native: bool
    #: The item's status as Codex reported it (``completed``, ``failed``, ``declined`` ...).
    status: str | None
    duration_ms: int | None
    #: The item as Codex sent it (content included: for the host's callback only).
    item: Mapping[str, Any]


@attrs.frozen(kw_only=True)
class LlmInputObserved:
    """What this turn sends the model, as the harness built it (sent with ``turn/start``)."""

    session_id: str
    thread_id: str | None
    model: str | None
    #: The text of ``turn/start`` (the prompt, or the frame standing for the context).
    prompt: str
    #: The thread's developer instructions and this turn's collaboration-mode instructions.
    developer_instructions: str | None
    collaboration_instructions: str | None
    images: int
    tools: tuple[str, ...]
    #: The transcript's messages before this turn.
    history_messages: int


@attrs.frozen(kw_only=True)
class LlmOutputObserved:
    """What came back: the turn's final text, usage and how Codex ended it."""

    session_id: str
    thread_id: str | None
    turn_id: str | None
    model: str | None
    #: Codex's turn status (``completed``, ``failed``, ``interrupted``, ``timed_out``).
    status: str
    assistant_text: str | None
    usage: Usage | None
    error: str | None


def tool_call_observed(
    item: Mapping[str, Any], *, thread_id: str | None, turn_id: str | None
) -> ToolCallObserved | None:
    """The observation of a completed tool item (``None`` for any other item)."""
    kind = item.get("type")
    if not isinstance(kind, str):
        return None
    native = kind in NATIVE_TOOL_ITEMS
    if not native and kind != _DYNAMIC_TOOL_ITEM:
        return None
    name = NATIVE_TOOL_ITEMS.get(kind)
    if name is None:
        owner = item.get("server") if kind == "mcpToolCall" else item.get("namespace")
        tool = str(item.get("tool") or kind)
        name = f"{owner}.{tool}" if isinstance(owner, str) and owner else tool
    duration = item.get("durationMs")
    status = item.get("status")
    item_id = item.get("id")
    return ToolCallObserved(
        thread_id=thread_id,
        turn_id=turn_id,
        item_id=item_id if isinstance(item_id, str) else None,
        kind=kind,
        name=name,
        native=native,
        status=status if isinstance(status, str) else None,
        duration_ms=duration if type(duration) is int else None,
        item=item,
    )


class Observations:
    """One turn's observers: scheduled, bounded, never awaited by the turn (module header)."""

    def __init__(self, *, timeout: float, log: Any = _log) -> None:
        self.timeout = timeout
        self.log = log
        self.dropped = 0
        self._pending = 0
        self._group: anyio.abc.TaskGroup | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Observations may be emitted inside the block; its end waits for the pending ones
        (each at most :attr:`timeout`)."""
        raised: BaseException | None = None
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                yield
            except BaseException as error:
                # The block's own error (or cancellation) is raised as it is, not in a group,
                # and nothing waits for the observers on the way out.
                raised = error
                group.cancel_scope.cancel()
            finally:
                self._group = None
                if self.dropped:
                    self.log.warning("observations dropped", dropped=self.dropped)
        if raised is not None:
            raise raised

    def emit(self, observer: str, callback: Observer[_R] | None, record: _R) -> None:
        """Schedule ``callback(record)``; returns at once (nothing when there is no callback,
        or outside :meth:`running`)."""
        group = self._group
        if callback is None or group is None:
            return
        if self._pending >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending += 1
        group.start_soon(self._call, observer, callback, record)

    async def _call(self, observer: str, callback: Observer[_R], record: _R) -> None:
        try:
            with anyio.move_on_after(self.timeout) as scope:
                returned = callback(record)
                if inspect.isawaitable(returned):
                    await returned
            if scope.cancelled_caught:
                self.log.warning("observer timed out", observer=observer, seconds=self.timeout)
        except Exception as error:
            # Its type only: an observer's message may quote the content it was given.
            self.log.warning("observer failed", observer=observer, error_type=type(error).__name__)
        finally:
            self._pending -= 1
