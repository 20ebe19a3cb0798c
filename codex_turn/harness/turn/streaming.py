"""A turn's public event stream: typed progress events for a runner, and the files Codex saved.

A runner that shows progress (a chat channel's "typing", a live reply, a plan, a tool line)
passes a :class:`TurnEventStream` to :func:`~codex_turn.run_codex_turn` and iterates it
meanwhile::

    events = TurnEventStream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(show_progress, events)   # async for event in events: ...
        result = await run_codex_turn(params, app_server=server, engine=engine, events=events)

The stream ends (the iteration stops) once the turn ended and what was buffered was read. It
carries, in order, every step of the turn machine (:class:`StateChanged`, built on the same
trace entries ``TurnHooks.on_transition`` sees) and what Codex reported while the turn ran:
agent message deltas and completed messages, reasoning summary deltas, tool calls (started,
completed), plan updates, compactions (start, end), native hook runs (:class:`HookRun`),
messages steered into the turn and files Codex saved (:class:`FileSaved`). One stream
serves one turn.

Back-pressure never reaches the turn: publishing never waits. Only deltas (agent message,
reasoning summary and plan deltas) are ever dropped: a delta that finds ``max_buffered`` events
waiting is dropped and counted (:attr:`TurnEventStream.dropped`); every other event (state
changes, completed messages, tool calls, plans, compactions, steered messages, files) is
always buffered, however slow the consumer, so the turn's last state change and its final
message always arrive (they are few: a handful per item and step). Every event carries its
sequence number ``seq`` (dropped ones included), so a consumer sees where it missed deltas
(the completed message carries the whole text). A consumer that stops reading (closes its
side) costs the turn nothing either.

Events carry content (deltas, tool arguments): they go to the runner, never to the logs; the
only log line here is the count of dropped events at the end of the turn.

Files. :func:`saved_file` reads the items Codex saved to disk: an ``imageGeneration`` item with
a ``savedPath`` (Codex writes generated images under ``$CODEX_HOME/generated_images``). They
reach :attr:`~codex_turn.TurnResult.files` whether or not the turn has assistant text.
"""

from __future__ import annotations

import math
import mimetypes
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, Self

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from codex_turn._log import get_logger
from codex_turn.fsm import TraceEntry
from codex_turn.harness.appserver import Notification
from codex_turn.harness.turn_api import TurnFile

__all__ = [
    "AgentMessageCompleted",
    "AgentMessageDelta",
    "CompactionEvent",
    "FileSaved",
    "HookRun",
    "MessagesSteered",
    "PlanDelta",
    "PlanStep",
    "PlanUpdated",
    "ReasoningSummaryDelta",
    "StateChanged",
    "ToolCall",
    "TurnEvent",
    "TurnEventStream",
    "TurnFile",
    "events_of",
    "saved_file",
]

_log = get_logger(__name__)

#: Thread item types that are a tool call of some kind (the schema of codex 0.163).
TOOL_ITEM_TYPES = frozenset(
    {
        "commandExecution",
        "fileChange",
        "mcpToolCall",
        "dynamicToolCall",
        "collabAgentToolCall",
        "webSearch",
        "imageView",
        "imageGeneration",
    }
)


def saved_file(item: Mapping[str, Any]) -> TurnFile | None:
    """The file a completed thread item saved to disk, or ``None``."""
    if item.get("type") != "imageGeneration":
        return None
    path = item.get("savedPath")
    if not isinstance(path, str) or not path:
        return None
    revised = item.get("revisedPrompt")
    return TurnFile(
        path=path,
        kind="generated_image",
        item_id=str(item.get("id", "")),
        mime_type=mimetypes.guess_type(path)[0],
        revised_prompt=revised if isinstance(revised, str) else None,
    )


# --- the events -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TurnEvent:
    """What every event has: its place in the turn's sequence (dropped events count too)
    and when it was published (``time.monotonic_ns()``)."""

    seq: int
    monotonic_ns: int


@attrs.frozen(kw_only=True)
class StateChanged(TurnEvent):
    """One step of the turn machine (``source == dest`` for an in-state event: a native
    compaction, messages steered into the running turn)."""

    source: str
    trigger: str
    dest: str

    @property
    def internal(self) -> bool:
        return self.source == self.dest


@attrs.frozen(kw_only=True)
class AgentMessageDelta(TurnEvent):
    item_id: str
    delta: str


@attrs.frozen(kw_only=True)
class AgentMessageCompleted(TurnEvent):
    item_id: str
    text: str


@attrs.frozen(kw_only=True)
class ReasoningSummaryDelta(TurnEvent):
    item_id: str
    summary_index: int
    delta: str


@attrs.frozen(kw_only=True)
class ToolCall(TurnEvent):
    """A tool call started or completed (commands, file changes, MCP and dynamic tools, web
    searches, image views and generations). ``name``: the tool (``server.tool`` for MCP),
    the command line, or the search query; ``status``: Codex's, when it gave one."""

    phase: Literal["started", "completed"]
    item_id: str
    kind: str
    name: str | None
    status: str | None
    arguments: Any = None


@attrs.frozen(kw_only=True)
class PlanStep:
    step: str
    status: str


@attrs.frozen(kw_only=True)
class PlanUpdated(TurnEvent):
    """The agent's plan as Codex now holds it (``turn/plan/updated``)."""

    explanation: str | None
    steps: tuple[PlanStep, ...]


@attrs.frozen(kw_only=True)
class PlanDelta(TurnEvent):
    """Text of a plan item as it streams (``item/plan/delta``)."""

    item_id: str
    delta: str


@attrs.frozen(kw_only=True)
class CompactionEvent(TurnEvent):
    """Codex compacting the thread natively inside the turn."""

    phase: Literal["started", "completed"]
    item_id: str | None


@attrs.frozen(kw_only=True)
class MessagesSteered(TurnEvent):
    """Messages that arrived while the turn ran, delivered to it as one ``turn/steer``."""

    turn_id: str
    texts: tuple[str, ...]


@attrs.frozen(kw_only=True)
class HookRun(TurnEvent):
    """A native hook run Codex reports (``hook/started``, ``hook/completed``): for
    trajectory analysis and debugging; it invokes nothing of the host's. ``entries`` counts
    the output entries Codex recorded (their text is the hook's, not carried here)."""

    phase: Literal["started", "completed"]
    run_id: str
    event_name: str
    status: str
    source: str | None
    duration_ms: int | None
    entries: int


@attrs.frozen(kw_only=True)
class FileSaved(TurnEvent):
    file: TurnFile


#: An event without its place in the sequence: the stream numbers it when publishing.
Pending = Callable[[int, int], TurnEvent]

#: The events a slow consumer may lose (the completed message carries the whole text).
_DELTAS: Final = (AgentMessageDelta, ReasoningSummaryDelta, PlanDelta)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _tool_name(item: Mapping[str, Any]) -> str | None:
    kind = item.get("type")
    if kind == "mcpToolCall":
        return f"{_text(item.get('server'))}.{_text(item.get('tool'))}"
    for key in (
        {"commandExecution": "command", "webSearch": "query", "imageView": "path"}.get(
            str(kind), "tool"
        ),
        "tool",
    ):
        value = item.get(key)
        if isinstance(value, str):
            return value
    return None


def events_of(note: Notification) -> list[Pending]:
    """The public events one Codex notification of the turn carries (often none)."""
    params = note.params
    method = note.method
    if method == "item/agentMessage/delta":
        item_id, delta = _text(params.get("itemId")), _text(params.get("delta"))
        return [
            lambda seq, ns: AgentMessageDelta(
                seq=seq, monotonic_ns=ns, item_id=item_id, delta=delta
            )
        ]
    if method == "item/reasoning/summaryTextDelta":
        item_id, delta = _text(params.get("itemId")), _text(params.get("delta"))
        index = params.get("summaryIndex")
        summary_index = index if isinstance(index, int) else 0
        return [
            lambda seq, ns: ReasoningSummaryDelta(
                seq=seq, monotonic_ns=ns, item_id=item_id, summary_index=summary_index, delta=delta
            )
        ]
    if method == "item/plan/delta":
        item_id, delta = _text(params.get("itemId")), _text(params.get("delta"))
        return [lambda seq, ns: PlanDelta(seq=seq, monotonic_ns=ns, item_id=item_id, delta=delta)]
    if method == "turn/plan/updated":
        explanation = params.get("explanation")
        steps = tuple(
            PlanStep(step=_text(s.get("step")), status=_text(s.get("status")))
            for s in params.get("plan") or ()
            if isinstance(s, Mapping)
        )
        said = explanation if isinstance(explanation, str) else None
        return [
            lambda seq, ns: PlanUpdated(seq=seq, monotonic_ns=ns, explanation=said, steps=steps)
        ]
    if method in ("hook/started", "hook/completed"):
        run = params.get("run")
        if not isinstance(run, Mapping):
            return []
        hook_phase: Literal["started", "completed"] = (
            "started" if method == "hook/started" else "completed"
        )
        duration, entries, source = run.get("durationMs"), run.get("entries"), run.get("source")
        run_id, event_name, run_status = (
            _text(run.get("id")),
            _text(run.get("eventName")),
            _text(run.get("status")),
        )
        return [
            lambda seq, ns: HookRun(
                seq=seq,
                monotonic_ns=ns,
                phase=hook_phase,
                run_id=run_id,
                event_name=event_name,
                status=run_status,
                source=source if isinstance(source, str) else None,
                duration_ms=duration if isinstance(duration, int) else None,
                entries=len(entries) if isinstance(entries, list) else 0,
            )
        ]
    if method == "thread/compacted":
        return [
            lambda seq, ns: CompactionEvent(
                seq=seq, monotonic_ns=ns, phase="completed", item_id=None
            )
        ]
    item = note.item
    if item is None or method not in ("item/started", "item/completed"):
        return []
    kind = str(item.get("type"))
    item_id = _text(item.get("id"))
    phase: Literal["started", "completed"] = "started" if method == "item/started" else "completed"
    out: list[Pending] = []
    if kind == "agentMessage" and phase == "completed":
        text = _text(item.get("text"))
        out.append(
            lambda seq, ns: AgentMessageCompleted(
                seq=seq, monotonic_ns=ns, item_id=item_id, text=text
            )
        )
    elif kind == "contextCompaction":
        out.append(
            lambda seq, ns: CompactionEvent(seq=seq, monotonic_ns=ns, phase=phase, item_id=item_id)
        )
    elif kind in TOOL_ITEM_TYPES:
        name, status = _tool_name(item), item.get("status")
        arguments = item.get("arguments")
        said_status = status if isinstance(status, str) else None
        out.append(
            lambda seq, ns: ToolCall(
                seq=seq,
                monotonic_ns=ns,
                phase=phase,
                item_id=item_id,
                kind=kind,
                name=name,
                status=said_status,
                arguments=arguments,
            )
        )
    if phase == "completed":
        file = saved_file(item)
        if file is not None:
            out.append(lambda seq, ns: FileSaved(seq=seq, monotonic_ns=ns, file=file))
    return out


def state_changed(entry: TraceEntry) -> Pending:
    return lambda seq, ns: StateChanged(
        seq=seq, monotonic_ns=ns, source=entry.state, trigger=entry.trigger, dest=entry.dest
    )


# --- the stream -------------------------------------------------------------------------------


class TurnEventStream:
    """One turn's events, as an async iterator (see the module docstring).

    ``max_buffered`` bounds the deltas that wait for the consumer (``math.inf``: unbounded,
    for a consumer that must see everything and can afford the memory). Publishing never
    blocks: a delta that finds ``max_buffered`` events waiting is dropped and counted in
    :attr:`dropped`; other events are never dropped (see the module docstring).
    """

    def __init__(self, max_buffered: float = 1024) -> None:
        if not (max_buffered == math.inf or (isinstance(max_buffered, int) and max_buffered > 0)):
            raise ValueError("max_buffered must be a positive int or math.inf")
        self.max_buffered = max_buffered
        send: MemoryObjectSendStream[TurnEvent]
        receive: MemoryObjectReceiveStream[TurnEvent]
        # Unbounded underneath: the bound applies to deltas only (publish).
        send, receive = anyio.create_memory_object_stream[TurnEvent](math.inf)
        self._send = send
        self._receive = receive
        #: Events published (delivered or dropped); the next event's ``seq``.
        self.published = 0
        #: Events dropped because the buffer was full (or the consumer had stopped reading).
        self.dropped = 0
        self._used = False
        self._closed = False
        self._waiting = 0  # events buffered, not yet read

    def __repr__(self) -> str:
        return (
            f"<TurnEventStream published={self.published} dropped={self.dropped}"
            f" closed={self.closed}>"
        )

    @property
    def closed(self) -> bool:
        """The turn ended: nothing more will be published."""
        return self._closed

    def _claim(self) -> None:
        """One stream serves one turn."""
        if self._used:
            raise ValueError("a TurnEventStream serves one turn; create one per turn")
        self._used = True

    def publish(self, pending: Pending) -> None:
        """Number the event and hand it over without waiting; full buffer: dropped."""
        if self.closed:
            return
        seq = self.published
        self.published += 1
        event = pending(seq, time.monotonic_ns())
        if isinstance(event, _DELTAS) and self._waiting >= self.max_buffered:
            self.dropped += 1  # a slow consumer loses deltas, never the rest
            return
        try:
            self._send.send_nowait(event)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.dropped += 1  # the consumer stopped reading: nobody will see it
        else:
            self._waiting += 1

    def close(self) -> None:
        """No more events: the iteration ends once the buffer is read (idempotent)."""
        if not self._closed:
            self._closed = True
            self._send.close()
            if self.dropped:
                _log.info(
                    "turn event stream dropped events",
                    dropped=self.dropped,
                    published=self.published,
                )

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> TurnEvent:
        try:
            event = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None
        self._waiting -= 1
        return event

    async def aclose(self) -> None:
        """Stop reading (the turn goes on; what it publishes meanwhile is dropped)."""
        self._receive.close()
