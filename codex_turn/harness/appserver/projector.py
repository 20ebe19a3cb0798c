"""The event projector: one turn's notifications in, one :class:`CodexTurnResult` out.

This is a pure fold (no I/O, no clock except an injectable one), so it is tested on recorded
notification sequences without the binary. It reproduces OpenClaw's PR-era Codex event
projector (``buildResult``), with two corrections:

* **Usage** comes from the last ``thread/tokenUsage/updated`` of the turn (``tokenUsage.last``,
  the last model call). Codex's ``inputTokens`` *already includes* ``cachedInputTokens`` (and,
  we assume, ``cacheWriteInputTokens``), so the OpenClaw ``input`` is the *non-cached* part:
  ``input = inputTokens - cachedInputTokens - cacheWriteInputTokens``. Then
  ``input + cacheRead + cacheWrite`` is the prompt size, and nothing is counted twice.
* **Dangling items** (an agent message that was streamed but never completed because the turn
  was interrupted or the stream failed) are closed at ``turn/completed``: they are listed in
  ``dangling_item_ids`` and their partial text is kept apart (``partial_text``); it is never
  mirrored as the assistant reply, because Codex drops it from the model history too.

``messages_snapshot`` is in OpenClaw's mirror order: the raw user prompt (a string), an
optional ``"Codex reasoning:\\n…"`` mirror, an optional ``"Codex plan:\\n…"`` mirror, then the
final assistant message (the last completed, non-blank ``agentMessage``), which carries usage,
``stopReason`` and ``errorMessage``. ``mirror_identities`` gives the idempotency identity of
each message (``<turnId>:prompt|reasoning|plan|assistant``) under the thread-stable
``idempotency_scope`` ``codex-app-server:<threadId>``.

Unknown notification methods and item types are ignored: the binary emits many kinds
(``warning``, ``account/rateLimits/updated``, ``thread/readState/changed``…) that carry nothing
for the turn result, and newer binaries add more.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs

from codex_turn.harness.usage import Usage

from .types import CONTEXT_WINDOW_EXCEEDED

__all__ = [
    "CodexTurnResult",
    "CodexTurnStatus",
    "Notification",
    "TurnProjector",
    "Usage",
]

DEFAULT_API = "openai-codex-responses"
REASONING_PREFIX = "Codex reasoning:\n"
PLAN_PREFIX = "Codex plan:\n"


_UNKNOWN: Any = object()  # a key that is absent
_set_slot = object.__setattr__  # sets a cached property's slot of a frozen class


@attrs.frozen
class Notification:
    """A server notification (``method`` + ``params``), with routing helpers.

    ``params`` is read, never changed: the thread and turn ids are looked up once, when it is
    made (the reader, the projector and the turn's observers each ask for them: a cached
    property of a slotted attrs class is first computed through ``__getattr__``, after a
    missed attribute lookup, several times the cost of the lookup itself)."""

    method: str
    params: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        params = self.params
        _set_slot(self, "thread_id", _thread_id_of(params))
        _set_slot(self, "turn_id", _turn_id_of(params))

    @functools.cached_property
    def thread_id(self) -> str | None:
        return _thread_id_of(self.params)

    @functools.cached_property
    def turn_id(self) -> str | None:
        return _turn_id_of(self.params)

    @property
    def item(self) -> Mapping[str, Any] | None:
        item = self.params.get("item")
        # A JSON object is a dict: checked first, the (slow) abstract Mapping only otherwise.
        return item if isinstance(item, (dict, Mapping)) else None

    @property
    def item_type(self) -> str | None:
        item = self.item
        return str(item.get("type")) if item is not None and "type" in item else None

    @property
    def compaction_phase(self) -> str | None:
        """``"started"``/``"completed"`` for a contextCompaction item (or legacy
        ``thread/compacted``), else ``None``. The orchestrator's compaction hooks key on it."""
        method = self.method
        if method == "thread/compacted":
            return "completed"
        # Asked of every notification (the reader, the turn's observers): the method first.
        if method in _ITEM_PHASES and self.item_type == "contextCompaction":
            return _ITEM_PHASES[method]
        return None


_ITEM_PHASES: Final = {"item/started": "started", "item/completed": "completed"}


def _thread_id_of(params: Mapping[str, Any]) -> str | None:
    value = params.get("threadId", _UNKNOWN)
    if value is _UNKNOWN:
        value = params.get("thread_id")
    if isinstance(value, str):
        return value
    thread = params.get("thread")
    if isinstance(thread, Mapping) and isinstance(thread.get("id"), str):
        return str(thread["id"])
    return None


def _turn_id_of(params: Mapping[str, Any]) -> str | None:
    value = params.get("turnId")
    if isinstance(value, str):
        return value
    turn = params.get("turn")
    if isinstance(turn, Mapping) and isinstance(turn.get("id"), str):
        return str(turn["id"])
    return None


class CodexTurnStatus(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed_out"


@attrs.frozen(kw_only=True)
class CodexTurnResult:
    thread_id: str
    turn_id: str | None
    outcome: CodexTurnStatus
    prompt_error: str | None
    final_text: str | None
    reasoning_text: str | None
    plan_text: str | None
    usage: Usage | None
    context_window: int | None
    messages_snapshot: list[dict[str, Any]]
    mirror_identities: list[str]
    idempotency_scope: str
    compaction_item_ids: list[str]
    item_ids: list[str]
    dangling_item_ids: list[str]
    partial_text: str | None
    error_info: Any = None
    duration_ms: int | None = None
    #: The type of each item of ``item_ids`` (``agentMessage``, ``reasoning``,
    #: ``dynamicToolCall``, ...): what the thread now holds of the turn, natively.
    item_kinds: list[str] = attrs.field(factory=list)

    @property
    def aborted(self) -> bool:
        return self.outcome in (CodexTurnStatus.INTERRUPTED, CodexTurnStatus.TIMED_OUT)

    @property
    def context_window_exceeded(self) -> bool:
        """The turn failed because its prompt did not fit the model's context window
        (:data:`~.types.CONTEXT_WINDOW_EXCEEDED`). Codex then also reports the window as full
        (``tokenUsage.last.totalTokens == modelContextWindow``, every other count 0: so
        :attr:`usage` is all zeros), and compacts the thread before its next turn (with the
        default auto-compaction limit)."""
        return bool(self.error_info == CONTEXT_WINDOW_EXCEEDED)

    @property
    def mirror_keys(self) -> list[str]:
        """Thread-stable idempotency keys, ``codex-app-server:<threadId>:<identity>``."""
        return [f"{self.idempotency_scope}:{i}" for i in self.mirror_identities]

    @property
    def turn_scoped_keys(self) -> list[str]:
        """PR-era keys, ``codex-app-server:<threadId>:<turnId>:<role>:<index>``."""
        scope = f"{self.idempotency_scope}:{self.turn_id}"
        return [f"{scope}:{m['role']}:{i}" for i, m in enumerate(self.messages_snapshot)]


def token_usage_parts(params: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, int | None]:
    """A ``thread/tokenUsage/updated``'s last model call (its breakdown) and the model's
    context window, ``None`` for what it does not say."""
    usage = params.get("tokenUsage")
    if not isinstance(usage, Mapping):
        return None, None
    last = next(
        (
            value
            for key in ("last", "lastCall", "lastTokenUsage", "last_token_usage")
            if isinstance(value := usage.get(key), Mapping)
        ),
        None,
    )
    window = usage.get("modelContextWindow")
    return last, window if isinstance(window, int) and not isinstance(window, bool) else None


def _now_ms() -> int:
    return int(time.time() * 1000)


class TurnProjector:
    """Folds one turn's notifications. Feed every notification of the thread; the projector
    keeps those of its turn (the first ``turn/started`` it sees fixes the id if not given)."""

    def __init__(
        self,
        *,
        thread_id: str,
        prompt: str,
        provider: str | None = None,
        model: str | None = None,
        api: str = DEFAULT_API,
        turn_id: str | None = None,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self.thread_id = thread_id
        self.turn_id = turn_id
        self.prompt = prompt
        self.provider = provider
        self.model = model
        self.api = api
        self._clock_ms = clock_ms
        self.done = False
        self._status: str | None = None
        self._turn_error: str | None = None
        self._error_info: Any = None
        self._last_error: str | None = None
        self._duration_ms: int | None = None
        self._agent_messages: list[tuple[str, str]] = []
        self._summary_agent_messages: list[str] = []
        self._deltas: dict[str, list[str]] = {}
        self._started: dict[str, str] = {}
        self._completed: list[str] = []
        self._kinds: list[str] = []  # the type of each completed item, in order
        self._reasoning: dict[str, dict[str, str]] = {}
        self._reasoning_order: list[str] = []
        self._plans: dict[str, str] = {}
        self._plan_order: list[str] = []
        self._usage: Mapping[str, Any] | None = None
        self._context_window: int | None = None
        self._compactions: list[str] = []

    # -- folding -------------------------------------------------------------------------

    def feed(self, n: Notification) -> bool:
        """Fold one notification; ``True`` when it belonged to this turn."""
        if self.done:
            return False
        if n.thread_id is not None and n.thread_id != self.thread_id:
            return False
        turn_id = n.turn_id
        if turn_id is not None:
            if self.turn_id is None and n.method == "turn/started":
                self.turn_id = turn_id
            elif turn_id != self.turn_id:
                return False
        handler = _HANDLERS.get(n.method)
        if handler is not None:
            handler(self, n.params)
        return True

    def _on_item_started(self, params: Mapping[str, Any]) -> None:
        item = params.get("item")
        if isinstance(item, Mapping) and isinstance(item.get("id"), str):
            self._started[item["id"]] = str(item.get("type"))

    def _on_item_completed(self, params: Mapping[str, Any]) -> None:
        item = params.get("item")
        if not isinstance(item, Mapping):
            return
        item_id = str(item.get("id", ""))
        kind = item.get("type")
        self._started.pop(item_id, None)
        self._completed.append(item_id)
        self._kinds.append(str(kind))
        if kind == "agentMessage":
            text = item.get("text")
            if not isinstance(text, str):
                text = "".join(self._deltas.get(item_id, []))
            self._agent_messages.append((item_id, text))
            self._deltas.pop(item_id, None)
        elif kind == "reasoning":
            self._note_reasoning(item_id)
            parts = self._reasoning[item_id]
            if not parts:
                summary = [s for s in item.get("summary") or [] if isinstance(s, str)]
                content = [s for s in item.get("content") or [] if isinstance(s, str)]
                for i, text in enumerate(summary or content):
                    parts[f"s{i}"] = text
        elif kind == "plan":
            text = item.get("text")
            self._note_plan(item_id)
            if isinstance(text, str) and text.strip():
                self._plans[item_id] = text
        elif kind == "contextCompaction":
            self._compactions.append(item_id)

    def _on_agent_delta(self, params: Mapping[str, Any]) -> None:
        item_id = str(params.get("itemId", ""))
        self._deltas.setdefault(item_id, []).append(str(params.get("delta", "")))

    def _note_reasoning(self, item_id: str) -> None:
        if item_id not in self._reasoning:
            self._reasoning[item_id] = {}
            self._reasoning_order.append(item_id)

    def _on_reasoning_summary_delta(self, params: Mapping[str, Any]) -> None:
        item_id = str(params.get("itemId", ""))
        self._note_reasoning(item_id)
        key = f"s{params.get('summaryIndex', 0)}"
        parts = self._reasoning[item_id]
        parts[key] = parts.get(key, "") + str(params.get("delta", ""))

    def _on_reasoning_text_delta(self, params: Mapping[str, Any]) -> None:
        item_id = str(params.get("itemId", ""))
        self._note_reasoning(item_id)
        parts = self._reasoning[item_id]
        if any(k.startswith("s") for k in parts):
            return  # the summary is what OpenClaw mirrors when both arrive
        key = f"c{params.get('contentIndex', 0)}"
        parts[key] = parts.get(key, "") + str(params.get("delta", ""))

    def _note_plan(self, item_id: str) -> None:
        if item_id not in self._plan_order:
            self._plan_order.append(item_id)

    def _on_plan_delta(self, params: Mapping[str, Any]) -> None:
        item_id = str(params.get("itemId", ""))
        self._note_plan(item_id)
        self._plans[item_id] = self._plans.get(item_id, "") + str(params.get("delta", ""))

    def _on_token_usage(self, params: Mapping[str, Any]) -> None:
        last, window = token_usage_parts(params)
        if last is not None:
            self._usage = last
        if window is not None:
            self._context_window = window

    def _on_error(self, params: Mapping[str, Any]) -> None:
        if params.get("willRetry"):
            return
        error = params.get("error")
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            self._last_error = error["message"]
            self._error_info = error.get("codexErrorInfo")

    def _on_compacted(self, params: Mapping[str, Any]) -> None:
        self._compactions.append(f"thread/compacted:{params.get('turnId', '')}")

    def _on_turn_completed(self, params: Mapping[str, Any]) -> None:
        turn = params.get("turn")
        if not isinstance(turn, Mapping):
            turn = {}
        status = turn.get("status")
        self._status = status if isinstance(status, str) else None
        error = turn.get("error")
        if isinstance(error, Mapping) and isinstance(error.get("message"), str):
            self._turn_error = error["message"]
            self._error_info = error.get("codexErrorInfo", self._error_info)
        duration = turn.get("durationMs")
        self._duration_ms = duration if isinstance(duration, int) else None
        for item in turn.get("items") or []:
            if isinstance(item, Mapping) and item.get("type") == "agentMessage":
                text = item.get("text")
                if isinstance(text, str):
                    self._summary_agent_messages.append(text)
        self.done = True

    # -- result --------------------------------------------------------------------------

    def _outcome(self) -> CodexTurnStatus:
        return {
            "completed": CodexTurnStatus.COMPLETED,
            "failed": CodexTurnStatus.FAILED,
            "interrupted": CodexTurnStatus.INTERRUPTED,
        }.get(self._status or "", CodexTurnStatus.FAILED)

    def build_result(
        self, *, outcome: CodexTurnStatus | None = None, error: str | None = None
    ) -> CodexTurnResult:
        """The turn result. ``outcome``/``error`` override what the notifications said (the
        client passes ``TIMED_OUT`` and its timeout message when it gave up waiting)."""
        final_outcome = outcome or self._outcome()
        prompt_error: str | None = None
        if final_outcome is CodexTurnStatus.FAILED:
            prompt_error = (
                error
                or self._turn_error
                or self._last_error
                or ("codex turn did not complete" if not self.done else "codex turn failed")
            )
        elif final_outcome is CodexTurnStatus.TIMED_OUT:
            prompt_error = error or "codex app-server attempt timed out"

        final_text = next(
            (t for _, t in reversed(self._agent_messages) if t.strip()),
            next((t for t in reversed(self._summary_agent_messages) if t.strip()), None),
        )
        reasoning = [
            "".join(self._reasoning[i][k] for k in sorted(self._reasoning[i], key=_part_key))
            for i in self._reasoning_order
        ]
        reasoning_text = "\n\n".join(r for r in reasoning if r.strip()) or None
        plans = [self._plans.get(i, "") for i in self._plan_order]
        plan_text = "\n\n".join(p for p in plans if p.strip()) or None
        usage = Usage.from_codex(self._usage) if self._usage is not None else None
        dangling = [i for i, kind in self._started.items() if kind != "userMessage"]
        partial = "".join(part for i in dangling for part in self._deltas.get(i, [])) or None

        stop_reason = {
            CodexTurnStatus.COMPLETED: "stop",
            CodexTurnStatus.FAILED: "error",
            CodexTurnStatus.INTERRUPTED: "aborted",
            CodexTurnStatus.TIMED_OUT: "aborted",
        }[final_outcome]
        now = self._clock_ms()
        turn_id = self.turn_id or "unknown-turn"
        snapshot: list[dict[str, Any]] = [
            {"role": "user", "content": self.prompt, "timestamp": now}
        ]
        identities = [f"{turn_id}:prompt"]
        if reasoning_text is not None:
            snapshot.append(
                self._assistant(REASONING_PREFIX + reasoning_text, None, "stop", None, now)
            )
            identities.append(f"{turn_id}:reasoning")
        if plan_text is not None:
            snapshot.append(self._assistant(PLAN_PREFIX + plan_text, None, "stop", None, now))
            identities.append(f"{turn_id}:plan")
        if final_text is not None:
            snapshot.append(self._assistant(final_text, usage, stop_reason, prompt_error, now))
            identities.append(f"{turn_id}:assistant")

        return CodexTurnResult(
            thread_id=self.thread_id,
            turn_id=self.turn_id,
            outcome=final_outcome,
            prompt_error=prompt_error,
            final_text=final_text,
            reasoning_text=reasoning_text,
            plan_text=plan_text,
            usage=usage,
            context_window=self._context_window,
            messages_snapshot=snapshot,
            mirror_identities=identities,
            idempotency_scope=f"codex-app-server:{self.thread_id}",
            compaction_item_ids=list(self._compactions),
            item_ids=list(self._completed),
            item_kinds=list(self._kinds),
            dangling_item_ids=dangling,
            partial_text=partial,
            error_info=self._error_info,
            duration_ms=self._duration_ms,
        )

    def _assistant(
        self,
        text: str,
        usage: Usage | None,
        stop_reason: str,
        error: str | None,
        timestamp: int,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "api": self.api,
            "provider": self.provider,
            "model": self.model,
            "usage": (usage or Usage()).to_agent_usage(),
            "stopReason": stop_reason,
        }
        if error is not None:
            message["errorMessage"] = error
        message["timestamp"] = timestamp
        return message


def _part_key(key: str) -> tuple[str, int]:
    return key[0], int(key[1:]) if key[1:].isdigit() else 0


_HANDLERS: dict[str, Callable[[TurnProjector, Mapping[str, Any]], None]] = {
    "item/started": TurnProjector._on_item_started,
    "item/completed": TurnProjector._on_item_completed,
    "item/agentMessage/delta": TurnProjector._on_agent_delta,
    "item/reasoning/summaryTextDelta": TurnProjector._on_reasoning_summary_delta,
    "item/reasoning/textDelta": TurnProjector._on_reasoning_text_delta,
    "item/plan/delta": TurnProjector._on_plan_delta,
    "thread/tokenUsage/updated": TurnProjector._on_token_usage,
    "error": TurnProjector._on_error,
    "thread/compacted": TurnProjector._on_compacted,
    "turn/completed": TurnProjector._on_turn_completed,
}
