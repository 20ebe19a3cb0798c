"""Diagnostics: ``feedback/upload`` of Codex threads, only on the host's explicit approval.

Theory. ``feedback/upload`` sends a thread's logs to OpenAI. That is the host's user's call,
so the upload runs as the diagnostics machine (:data:`codex_turn.fsm.supervision.
DIAGNOSTICS_TABLE`) says: the threads are listed first (each named thread and, unless
``thread_only``, the sub-threads it spawned: Codex's ``ancestorThreadId`` query), then the
host's :data:`DiagnosticsApprover` is asked with a :class:`DiagnosticsRequest` (how many
threads, never their ids), bounded by ``approval_timeout`` and cancellable with the caller.
Only :attr:`DiagnosticsDecision.APPROVE` uploads. A denial, no answer in time, ``None`` or a
callback that raised all end *withheld*: nothing is uploaded and the result carries no ids.

An approved request uploads each thread in turn (``{classification, threadId, includeLogs,
reason}``). The result lists, per uploaded thread, its session id, its thread id and the
``codex resume <thread-id>`` command. Codex's refusal (a home with ``[feedback] enabled =
false``, which is what a private offline home writes, answers ``sending feedback is
disabled by configuration``) ends the run *failed* with Codex's error as it said it; the
threads uploaded before it are still listed.

Nothing of a thread's content is read or logged here: ids (capped), counts and outcomes.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import anyio
import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm.supervision import DiagnosticsModel, DiagnosticsState, DiagnosticsTrigger

from .appserver.errors import AppServerError
from .appserver.logsafe import capped
from .supervision import (
    ALL_SOURCE_KINDS,
    NativeThread,
    SupervisorPort,
    list_pages,
    read_native_thread,
)

__all__ = [
    "DiagnosticsApprover",
    "DiagnosticsDecision",
    "DiagnosticsRequest",
    "DiagnosticsResult",
    "UploadedThread",
    "upload_diagnostics",
]

log = get_logger(__name__)

#: How long the host's approval may take by default (then: ignored, nothing uploaded).
APPROVAL_TIMEOUT_S: Final = 300.0
_MAX_SUBTHREAD_PAGES: Final = 20


class DiagnosticsDecision(enum.StrEnum):
    APPROVE = "approve"
    DENY = "deny"


@attrs.frozen
class DiagnosticsRequest:
    """What the host is asked to approve (no ids: a denied request shows none)."""

    threads: int  # how many threads would be uploaded, sub-threads included
    thread_only: bool
    include_logs: bool
    classification: str


#: ``await approve(request)``: :attr:`DiagnosticsDecision.APPROVE` uploads; anything else
#: (a denial, ``None``, an exception, no answer in time) uploads nothing.
DiagnosticsApprover = Callable[[DiagnosticsRequest], Awaitable[DiagnosticsDecision | None]]


@attrs.frozen
class UploadedThread:
    thread_id: str
    session_id: str

    @property
    def resume_command(self) -> str:
        return f"codex resume {self.thread_id}"


@attrs.frozen
class DiagnosticsResult:
    """``outcome``: the diagnostics machine's final state (``uploaded``, ``withheld``,
    ``failed``); ``reason``: ``uploaded``, ``denied``, ``ignored``, ``list-failed`` or
    ``upload-failed``; ``uploads``: the threads uploaded (always empty when withheld);
    ``error``: Codex's answer to the failed request (capped)."""

    outcome: DiagnosticsState
    reason: str
    uploads: tuple[UploadedThread, ...] = ()
    error: str | None = None

    @property
    def uploaded(self) -> bool:
        return self.outcome is DiagnosticsState.UPLOADED


async def _threads_to_upload(
    port: SupervisorPort,
    thread_ids: Sequence[str],
    *,
    thread_only: bool,
    timeout: float | None,  # noqa: ASYNC109
) -> list[UploadedThread]:
    """Each named thread (its session id read with ``thread/read``) and, unless
    ``thread_only``, its spawned sub-threads; each thread once."""
    found: dict[str, UploadedThread] = {}
    for thread_id in thread_ids[:1] if thread_only else thread_ids:
        thread = await read_native_thread(port, thread_id, timeout=timeout)
        found.setdefault(thread.thread_id, UploadedThread(thread.thread_id, thread.session_id))
        if thread_only:
            break
        rows = await list_pages(
            port,
            {"ancestorThreadId": thread_id, "sourceKinds": list(ALL_SOURCE_KINDS)},
            max_pages=_MAX_SUBTHREAD_PAGES,
            timeout=timeout,
        )
        for row in rows:
            sub = NativeThread.from_wire(row)
            found.setdefault(sub.thread_id, UploadedThread(sub.thread_id, sub.session_id))
    return list(found.values())


async def _ask(
    approve: DiagnosticsApprover,
    request: DiagnosticsRequest,
    timeout: float | None,  # noqa: ASYNC109
) -> DiagnosticsTrigger:
    """The host's answer as a trigger: only an explicit approval in time approves."""
    decision: DiagnosticsDecision | None = None
    try:
        with anyio.move_on_after(timeout if timeout is not None else float("inf")):
            decision = await approve(request)
    except Exception as exc:  # a broken callback never approves
        log.warning("diagnostics.approval_failed", error=capped(format_error(exc)))
        return DiagnosticsTrigger.IGNORED
    if decision is DiagnosticsDecision.APPROVE:
        return DiagnosticsTrigger.APPROVED
    if decision is DiagnosticsDecision.DENY:
        return DiagnosticsTrigger.DENIED
    return DiagnosticsTrigger.IGNORED


async def upload_diagnostics(
    port: SupervisorPort,
    thread_ids: Sequence[str],
    *,
    approve: DiagnosticsApprover,
    thread_only: bool = False,
    classification: str = "bug",
    reason: str | None = None,
    include_logs: bool = True,
    approval_timeout: float | None = APPROVAL_TIMEOUT_S,
    timeout: float | None = None,  # noqa: ASYNC109
) -> DiagnosticsResult:
    """Upload diagnostics for ``thread_ids`` on the host's approval (see the module header).
    ``thread_only``: the first thread alone, without its sub-threads."""
    if not thread_ids:
        raise ValueError("name at least one thread")
    model = DiagnosticsModel.begin()
    try:
        threads = await _threads_to_upload(
            port, thread_ids, thread_only=thread_only, timeout=timeout
        )
    except (AppServerError, TypeError, LookupError) as exc:
        model.fire(DiagnosticsTrigger.LIST_FAILED)
        log.warning("diagnostics.list_failed", error=capped(format_error(exc)))
        return DiagnosticsResult(model.state, "list-failed", error=capped(format_error(exc)))
    request = DiagnosticsRequest(len(threads), thread_only, include_logs, classification)
    model.fire(DiagnosticsTrigger.THREADS_LISTED)
    answer = await _ask(approve, request, approval_timeout)
    model.fire(answer)
    if model.state is DiagnosticsState.WITHHELD:
        log.info("diagnostics.withheld", reason=answer.value, threads=len(threads))
        return DiagnosticsResult(model.state, answer.value)
    uploads: list[UploadedThread] = []
    for thread in threads:
        params: dict[str, Any] = {
            "classification": classification,
            "threadId": thread.thread_id,
            "includeLogs": include_logs,
        }
        if reason is not None:
            params["reason"] = reason
        try:
            await port.request("feedback/upload", params, timeout=timeout)
        except AppServerError as exc:
            model.fire(DiagnosticsTrigger.UPLOAD_FAILED)
            log.warning(
                "diagnostics.upload_failed",
                thread_id=capped(thread.thread_id),
                uploaded=len(uploads),
            )
            return DiagnosticsResult(
                model.state,
                "upload-failed",
                uploads=tuple(uploads),
                error=capped(format_error(exc)),
            )
        model.fire(DiagnosticsTrigger.THREAD_UPLOADED)
        uploads.append(thread)
    model.fire(DiagnosticsTrigger.UPLOADS_DONE)
    log.info("diagnostics.uploaded", threads=len(uploads))
    return DiagnosticsResult(model.state, "uploaded", uploads=tuple(uploads))
