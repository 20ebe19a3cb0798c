"""Supervising a Codex home's native threads: list them, continue one as a branch, archive one.

Theory. A Codex home holds threads this library did not start (a person's own Codex, another
host). Supervision looks at them through a connection of its own and never takes them over:

* **Listing is passive** (:func:`list_native_threads`, :func:`read_native_thread`): only
  ``thread/list`` (unarchived threads, every page) and ``thread/read`` (metadata, no turns)
  are sent. No thread is resumed or subscribed to, and so Codex never asks this connection
  for an approval (it asks the clients of a loaded thread).
* **Continue as branch** (:func:`branch_native_thread`) makes a *new* thread that carries on
  where the source's last terminal turn ended, as the branch machine
  (:data:`codex_turn.fsm.supervision.BRANCH_TABLE`) runs it: the source's status and its
  visible history are read (``thread/turns/list``), a temporary native fork through its last
  terminal turn pins the snapshot and reports the model and provider the thread runs on (the
  fork sends no model or provider of its own), the canonical thread starts with exactly
  those, the bounded user/assistant history (newest kept, :class:`BranchLimits`) is injected
  as plain messages (reasoning and tool calls are not cloned) and the fork is archived. The
  source is never resumed. :func:`bind_branch` writes the session binding of the new thread
  as *supervised*: the turn pipeline then resumes it without a model or provider of its own,
  so Codex restores the pair the thread persisted (the model picker is locked).
* **Archiving** (:func:`archive_native_thread`) follows the archive machine
  (:data:`codex_turn.fsm.supervision.ARCHIVE_TABLE`): an active target never, an idle or
  unknown one only with ``confirm=True``, a known-active descendant (every page of Codex's
  ``ancestorThreadId`` query, all source kinds) blocks it, and an enumeration error, a cycle
  or an exhausted :attr:`ArchiveLimits.max_descendants` fails closed.

Each operation returns a result whose ``outcome`` is the machine's final state and whose
``reason`` is a stable, loggable word; Codex's own errors are mapped once, here (their text is
capped, never a prompt). Logs carry ids (capped), counts and reasons, never history text.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm.supervision import (
    ArchiveModel,
    ArchiveState,
    ArchiveTrigger,
    BranchModel,
    BranchState,
    BranchTrigger,
    NativeStatus,
    native_status,
)

from .appserver.errors import AppServerError
from .appserver.logsafe import capped
from .appserver.thread_settings import ThreadSettings
from .appserver.types import ThreadResult

__all__ = [
    "ArchiveLimits",
    "ArchiveResult",
    "BranchLimits",
    "BranchResult",
    "NativeThread",
    "SupervisorPort",
    "archive_native_thread",
    "bind_branch",
    "branch_native_thread",
    "list_native_threads",
    "list_pages",
    "read_native_thread",
    "visible_history",
]

log = get_logger(__name__)

#: Every source kind Codex knows: a descendant query must see spawned sub-agents too (the
#: default is interactive sources only).
ALL_SOURCE_KINDS: Final = (
    "cli",
    "vscode",
    "exec",
    "appServer",
    "subAgent",
    "subAgentReview",
    "subAgentCompact",
    "subAgentThreadSpawn",
    "subAgentOther",
    "unknown",
)
#: Turn statuses after which a turn's history stands (``inProgress`` does not).
TERMINAL_TURN_STATUSES: Final = frozenset({"completed", "interrupted", "failed"})
_PAGE: Final = 100


class SupervisorPort(Protocol):
    """What supervision needs of an app-server (:class:`~.appserver.AppServer` or
    :class:`~.appserver.AppServerClient`)."""

    async def request(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any: ...

    async def start_thread(self, settings: ThreadSettings) -> ThreadResult: ...

    async def inject_items(self, thread_id: str, items: Sequence[Mapping[str, Any]]) -> None: ...

    def forget_thread(self, thread_id: str) -> None: ...


@attrs.frozen
class NativeThread:
    """A native thread as Codex lists it (metadata only)."""

    thread_id: str
    session_id: str
    status: NativeStatus
    model: str | None
    model_provider: str | None
    cwd: str | None
    preview: str
    created_at: int | None = None
    updated_at: int | None = None
    name: str | None = None
    forked_from_id: str | None = None
    parent_thread_id: str | None = None

    @property
    def resume_command(self) -> str:
        """What a person types to continue it in their own Codex."""
        return f"codex resume {self.thread_id}"

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> NativeThread:
        def text(key: str) -> str | None:
            value = raw.get(key)
            return value if isinstance(value, str) else None

        def number(key: str) -> int | None:
            value = raw.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        thread_id = text("id") or ""
        return cls(
            thread_id=thread_id,
            session_id=text("sessionId") or thread_id,
            status=native_status(raw.get("status")),
            model=text("model"),
            model_provider=text("modelProvider"),
            cwd=text("cwd"),
            preview=text("preview") or "",
            created_at=number("createdAt"),
            updated_at=number("updatedAt"),
            name=text("name"),
            forked_from_id=text("forkedFromId"),
            parent_thread_id=text("parentThreadId"),
        )


def _thread_of(raw: Any) -> Mapping[str, Any]:
    thread = raw.get("thread") if isinstance(raw, Mapping) else None
    if not isinstance(thread, Mapping):
        raise TypeError("the answer carries no thread object")
    return thread


async def list_pages(
    port: SupervisorPort,
    params: Mapping[str, Any],
    *,
    max_pages: int,
    timeout: float | None,  # noqa: ASYNC109
    method: str = "thread/list",
) -> list[Mapping[str, Any]]:
    """Every row of a paginated list (``data`` + ``nextCursor``); raises ``LookupError`` when
    more than ``max_pages`` pages come, ``TypeError`` for an answer of another shape."""
    rows: list[Mapping[str, Any]] = []
    cursor: str | None = None
    for _ in range(max_pages):
        page = await port.request(
            method, {**params, **({"cursor": cursor} if cursor else {})}, timeout=timeout
        )
        data = page.get("data") if isinstance(page, Mapping) else None
        if not isinstance(data, list):
            raise TypeError(f"{method} answered without a data list")
        rows.extend(row for row in data if isinstance(row, Mapping))
        cursor = page.get("nextCursor")
        if not isinstance(cursor, str) or not cursor:
            return rows
    raise LookupError(f"{method} has more than {max_pages} pages")


async def list_native_threads(
    port: SupervisorPort,
    *,
    cwd: str | None = None,
    page_size: int = _PAGE,
    max_pages: int = 100,
    timeout: float | None = None,  # noqa: ASYNC109
) -> list[NativeThread]:
    """The home's unarchived native threads, newest first (passive: ``thread/list`` only).
    ``cwd``: only the threads of that working directory."""
    params: dict[str, Any] = {"archived": False, "limit": page_size}
    if cwd is not None:
        params["cwd"] = cwd
    rows = await list_pages(port, params, max_pages=max_pages, timeout=timeout)
    threads = [NativeThread.from_wire(row) for row in rows]
    log.info("supervision.threads_listed", count=len(threads))
    return threads


async def read_native_thread(
    port: SupervisorPort,
    thread_id: str,
    *,
    timeout: float | None = None,  # noqa: ASYNC109
) -> NativeThread:
    """One thread's metadata (``thread/read`` without turns: passive)."""
    raw = await port.request(
        "thread/read", {"threadId": thread_id, "includeTurns": False}, timeout=timeout
    )
    return NativeThread.from_wire(_thread_of(raw))


# --------------------------------------------------------------------------------------------
# Continue as branch
# --------------------------------------------------------------------------------------------


@attrs.frozen
class BranchLimits:
    """How much visible history a branch carries (newest kept)."""

    max_messages: int = attrs.field(default=40, validator=attrs.validators.ge(0))
    max_chars: int = attrs.field(default=60_000, validator=attrs.validators.ge(0))
    max_turn_pages: int = attrs.field(default=100, validator=attrs.validators.ge(1))


@attrs.frozen
class HistoryMessage:
    role: str  # "user" | "assistant"
    text: str


@attrs.frozen
class BranchResult:
    """What a branch did. ``outcome`` is the branch machine's final state; ``reason`` says
    why (``branched``, ``source-active``, ``no-terminal-turn``, or the failed step)."""

    outcome: BranchState
    reason: str
    source: NativeThread | None = None
    thread_id: str | None = None  # the canonical (new) thread
    model: str | None = None
    model_provider: str | None = None
    fork_thread_id: str | None = None
    fork_archived: bool = False
    messages: int = 0  # user/assistant messages injected
    error: str | None = None  # Codex's answer to the failed step (capped)

    @property
    def branched(self) -> bool:
        return self.outcome is BranchState.BRANCHED


def visible_history(
    turns: Sequence[Mapping[str, Any]], limits: BranchLimits
) -> tuple[str | None, list[HistoryMessage]]:
    """The id of the last terminal turn and the user/assistant messages up to it (only
    ``userMessage`` text parts and ``agentMessage`` text: reasoning, tool calls and
    everything else stay behind), bounded by ``limits`` (newest kept)."""
    last = None
    for index, turn in enumerate(turns):
        if turn.get("status") in TERMINAL_TURN_STATUSES:
            last = index
    if last is None:
        return None, []
    messages: list[HistoryMessage] = []
    for turn in turns[: last + 1]:
        items = turn.get("items")
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "userMessage":
                parts = item.get("content")
                text = "\n".join(
                    part["text"]
                    for part in (parts if isinstance(parts, list) else ())
                    if isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                )
                if text:
                    messages.append(HistoryMessage("user", text))
            elif item.get("type") == "agentMessage" and isinstance(item.get("text"), str):
                messages.extend([HistoryMessage("assistant", item["text"])] if item["text"] else [])
    kept: list[HistoryMessage] = []
    chars = 0
    for message in reversed(messages):
        if len(kept) >= limits.max_messages or chars + len(message.text) > limits.max_chars:
            break
        kept.append(message)
        chars += len(message.text)
    kept.reverse()
    last_id = turns[last].get("id")
    return (last_id if isinstance(last_id, str) else None), kept


def history_items(messages: Sequence[HistoryMessage]) -> list[dict[str, Any]]:
    """``messages`` as Responses message items for ``thread/inject_items``."""
    return [
        {
            "type": "message",
            "role": message.role,
            "content": [
                {
                    "type": "input_text" if message.role == "user" else "output_text",
                    "text": message.text,
                }
            ],
        }
        for message in messages
    ]


async def branch_native_thread(
    port: SupervisorPort,
    source_id: str,
    *,
    cwd: str | None = None,
    developer_instructions: str | None = None,
    limits: BranchLimits = BranchLimits(),
    timeout: float | None = None,  # noqa: ASYNC109
) -> BranchResult:
    """Continue ``source_id`` as a new thread (see the module header); the source is never
    resumed. ``cwd``: the new thread's (default: the source's)."""
    model = BranchModel.begin()
    source: NativeThread | None = None
    try:
        source = await read_native_thread(port, source_id, timeout=timeout)
        turns = await list_pages(
            port,
            {"threadId": source_id, "itemsView": "full", "sortDirection": "asc"},
            max_pages=limits.max_turn_pages,
            timeout=timeout,
            method="thread/turns/list",
        )
    except (AppServerError, TypeError, LookupError) as exc:
        model.fire(BranchTrigger.SOURCE_UNREADABLE)
        return _branch_failed(model, "source-unreadable", exc, source=source)
    last_turn, messages = visible_history(turns, limits)
    model.source_active = source.status is NativeStatus.ACTIVE
    model.no_terminal_turn = last_turn is None
    model.fire(BranchTrigger.SOURCE_READ)
    if model.state is BranchState.REFUSED:
        reason = "source-active" if model.source_active else "no-terminal-turn"
        log.info("supervision.branch_refused", source=capped(source_id), reason=reason)
        return BranchResult(model.state, reason, source=source)

    try:
        raw = await port.request(
            "thread/fork",
            {"threadId": source_id, "lastTurnId": last_turn, "excludeTurns": True},
            timeout=timeout,
        )
        fork = _thread_of(raw)
        fork_id = str(fork["id"])
        pinned_model = raw.get("model") if isinstance(raw.get("model"), str) else None
        pinned_provider = (
            raw.get("modelProvider") if isinstance(raw.get("modelProvider"), str) else None
        )
    except (AppServerError, TypeError, KeyError) as exc:
        model.fire(BranchTrigger.FORK_FAILED)
        return _branch_failed(model, "fork-failed", exc, source=source)

    model.fire(BranchTrigger.FORKED)
    result = BranchResult(
        BranchState.FAILED,
        "",
        source=source,
        model=pinned_model,
        model_provider=pinned_provider,
        fork_thread_id=fork_id,
        messages=len(messages),
    )
    error: BaseException | None = None
    try:
        started = await port.start_thread(
            ThreadSettings(
                cwd=cwd or source.cwd,
                model=pinned_model,
                model_provider=pinned_provider,
                developer_instructions=developer_instructions,
            )
        )
    except AppServerError as exc:
        model.fire(BranchTrigger.START_FAILED)
        error, reason = exc, "start-failed"
    else:
        model.fire(BranchTrigger.THREAD_STARTED)
        result = attrs.evolve(result, thread_id=started.thread_id)
        try:
            await port.inject_items(started.thread_id, history_items(messages))
        except AppServerError as exc:
            model.fire(BranchTrigger.INJECT_FAILED)
            error, reason = exc, "inject-failed"
        else:
            model.fire(BranchTrigger.HISTORY_INJECTED)
            reason = "branched"
    try:
        await port.request("thread/archive", {"threadId": fork_id}, timeout=timeout)
    except AppServerError as exc:
        model.fire(BranchTrigger.FORK_ARCHIVE_FAILED)
        error, reason = error or exc, reason if error else "fork-archive-failed"
    else:
        model.fire(BranchTrigger.FORK_ARCHIVED)
        result = attrs.evolve(result, fork_archived=True)
    port.forget_thread(fork_id)
    result = attrs.evolve(
        result,
        outcome=model.state,
        reason=reason,
        error=capped(format_error(error)) if error is not None else None,
    )
    log.info(
        "supervision.branch_ended",
        source=capped(source_id),
        thread_id=capped(result.thread_id or ""),
        outcome=model.state.value,
        reason=reason,
        messages=len(messages),
    )
    return result


def _branch_failed(
    model: BranchModel, reason: str, exc: BaseException, *, source: NativeThread | None
) -> BranchResult:
    log.warning("supervision.branch_failed", reason=reason, error=capped(format_error(exc)))
    return BranchResult(model.state, reason, source=source, error=capped(format_error(exc)))


def bind_branch(
    session_file: str | os.PathLike[str], result: BranchResult, *, session_id: str | None = None
) -> None:
    """Bind ``session_file`` to the branch's new thread, *supervised*: its turns resume it
    without a model or provider of their own (Codex restores the pair it persisted)."""
    from .binding import ThreadBinding, write_binding

    if not result.branched or result.thread_id is None:
        raise ValueError("only a branched result can be bound")
    write_binding(
        session_file,
        ThreadBinding(
            thread_id=result.thread_id,
            cwd=(result.source.cwd if result.source is not None else None) or "",
            model=result.model,
            model_provider=result.model_provider,
            session_id=session_id,
            supervised=True,
        ),
        session_id=session_id,
    )


# --------------------------------------------------------------------------------------------
# Archive
# --------------------------------------------------------------------------------------------


@attrs.frozen
class ArchiveLimits:
    """The safety limits of the descendant check (exhausted: nothing is archived)."""

    max_descendants: int = attrs.field(default=1000, validator=attrs.validators.ge(0))
    page_size: int = attrs.field(default=_PAGE, validator=attrs.validators.ge(1))
    max_pages: int = attrs.field(default=50, validator=attrs.validators.ge(1))


@attrs.frozen
class ArchiveResult:
    """What an archive request did: ``outcome`` is the archive machine's final state;
    ``reason`` says why (``archived``, ``target-active``, ``needs-confirmation``,
    ``descendant-active``, ``cycle``, ``safety-limit``, ``enumeration-failed`` ...)."""

    outcome: ArchiveState
    reason: str
    thread_id: str
    status: NativeStatus = NativeStatus.UNKNOWN
    descendants: int = 0
    error: str | None = None

    @property
    def archived(self) -> bool:
        return self.outcome is ArchiveState.ARCHIVED


async def archive_native_thread(
    port: SupervisorPort,
    thread_id: str,
    *,
    confirm: bool = False,
    limits: ArchiveLimits = ArchiveLimits(),
    timeout: float | None = None,  # noqa: ASYNC109
) -> ArchiveResult:
    """Archive ``thread_id`` under the safety rules (module header); ``confirm``: the
    caller's explicit confirmation, required for any status but active (never archived)."""
    model = ArchiveModel.begin(confirmed=confirm)

    def ended(reason: str, error: BaseException | None = None, **extra: Any) -> ArchiveResult:
        log.info(
            "supervision.archive_ended",
            thread_id=capped(thread_id),
            outcome=model.state.value,
            reason=reason,
        )
        return ArchiveResult(
            model.state,
            reason,
            thread_id,
            status=model.target_status,
            error=capped(format_error(error)) if error is not None else None,
            **extra,
        )

    try:
        target = await read_native_thread(port, thread_id, timeout=timeout)
    except (AppServerError, TypeError) as exc:
        model.fire(ArchiveTrigger.TARGET_UNREADABLE)
        return ended("target-unreadable", exc)
    model.target_status = target.status
    model.fire(ArchiveTrigger.TARGET_READ)
    if model.state is ArchiveState.REFUSED:
        return ended("target-active" if model.active else "needs-confirmation")

    seen = {thread_id}
    descendants = 0
    params = {
        "ancestorThreadId": thread_id,
        "archived": False,
        "sourceKinds": list(ALL_SOURCE_KINDS),
        "limit": limits.page_size,
    }
    try:
        rows = await list_pages(port, params, max_pages=limits.max_pages, timeout=timeout)
    except LookupError as exc:
        model.fire(ArchiveTrigger.ENUMERATION_FAILED)
        return ended("safety-limit", exc)
    except (AppServerError, TypeError) as exc:
        model.fire(ArchiveTrigger.ENUMERATION_FAILED)
        return ended("enumeration-failed", exc)
    for row in rows:
        descendant = NativeThread.from_wire(row)
        if descendant.thread_id in seen:
            model.fire(ArchiveTrigger.ENUMERATION_FAILED)
            return ended("cycle", descendants=descendants)
        seen.add(descendant.thread_id)
        descendants += 1
        if descendants > limits.max_descendants:
            model.fire(ArchiveTrigger.ENUMERATION_FAILED)
            return ended("safety-limit", descendants=descendants)
        if descendant.status is NativeStatus.ACTIVE:
            model.descendant_active = True
    model.fire(ArchiveTrigger.DESCENDANTS_CHECKED)
    if model.state is ArchiveState.REFUSED:
        return ended("descendant-active", descendants=descendants)
    try:
        await port.request("thread/archive", {"threadId": thread_id}, timeout=timeout)
    except AppServerError as exc:
        model.fire(ArchiveTrigger.ARCHIVE_FAILED)
        return ended("archive-failed", exc, descendants=descendants)
    model.fire(ArchiveTrigger.ARCHIVED)
    return ended("archived", descendants=descendants)
