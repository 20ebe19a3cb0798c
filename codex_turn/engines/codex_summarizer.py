"""A summariser that asks Codex: one ephemeral thread and one turn per summary.

Theory
------
The engine's compaction hands this summariser a :class:`~codex_turn.engines.SummaryRequest`;
it starts an *ephemeral* Codex thread (nothing persisted, read-only sandbox, no approvals, so
the model cannot act on the excerpt), sends one turn whose developer instructions say what a
summary must be (facts, decisions, identifiers, open questions; no preamble; a size) and whose
input is the excerpt, and returns the final assistant message (never the reasoning). The
thread is forgotten afterwards.

Failures are reported, not hidden: an HTTP 401/403 (or Codex's ``unauthorized`` error) raises
:class:`~codex_turn.engines.SummarizerAuthError`, so the engine writes nothing and opens its
circuit breaker; any other failed turn raises :class:`CodexSummaryFailed`, and the engine
escalates (aggressive, then deterministic truncation). The engine's own checks (non-empty,
smaller than the sources, capped) apply to whatever this returns; ``uses_model`` is true, so
the engine never runs it on a turn's foreground path.

``app_server`` is anything with ``start_thread``/``run_turn``/``forget_thread``
(:class:`~codex_turn.harness.appserver.AppServer` has them); the offline model of
:mod:`codex_turn.testing` stands in for the real one in tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final, Protocol

from codex_turn.engines.summarizers import (
    REQUEST_MARKER,
    SUMMARY_INSTRUCTIONS,
    SummarizerAuthError,
    SummaryRequest,
    summary_prompt,
)
from codex_turn.harness.appserver import (
    CodexTurnResult,
    CodexTurnStatus,
    ThreadResult,
    ThreadSettings,
)

__all__ = [
    "REQUEST_MARKER",
    "CodexSummarizer",
    "CodexSummaryFailed",
    "SummaryAppServer",
    "summary_prompt",
]

_AUTH_STATUSES: Final = frozenset({401, 403})


class CodexSummaryFailed(RuntimeError):
    """The summary turn did not complete (the engine escalates)."""


class SummaryAppServer(Protocol):
    async def start_thread(
        self, settings: ThreadSettings, *, ephemeral: bool | None = None
    ) -> ThreadResult: ...

    async def run_turn(
        self,
        thread_id: str,
        input: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
        **kwargs: Any,
    ) -> CodexTurnResult: ...

    def forget_thread(self, thread_id: str) -> None: ...


def _is_auth_failure(result: CodexTurnResult) -> bool:
    info = result.error_info
    if isinstance(info, str):
        return info.lower() == "unauthorized"
    if isinstance(info, Mapping):
        if "unauthorized" in info:
            return True
        for value in info.values():
            if isinstance(value, Mapping) and value.get("httpStatusCode") in _AUTH_STATUSES:
                return True
    text = (result.prompt_error or "").lower()
    return "401 unauthorized" in text or "403 forbidden" in text


class CodexSummarizer:
    """Summaries written by Codex (see the module docstring)."""

    def __init__(
        self,
        app_server: SummaryAppServer,
        *,
        model: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        turn_timeout: float = 120.0,
    ) -> None:
        self._server = app_server
        self._model = model
        self._cwd = os.fspath(cwd) if cwd is not None else None
        self._timeout = turn_timeout

    @property
    def id(self) -> str:
        return f"codex/1:{self._model}" if self._model else "codex/1"

    @property
    def uses_model(self) -> bool:
        return True

    async def summarize(self, request: SummaryRequest) -> str:
        thread = await self._server.start_thread(
            ThreadSettings(
                cwd=self._cwd,
                developer_instructions=SUMMARY_INSTRUCTIONS,
                model=self._model,
                sandbox="read-only",
                approval_policy="never",
            ),
            ephemeral=True,
        )
        try:
            result = await self._server.run_turn(
                thread.thread_id, summary_prompt(request), timeout=self._timeout
            )
        finally:
            self._server.forget_thread(thread.thread_id)
        if result.outcome is not CodexTurnStatus.COMPLETED:
            if _is_auth_failure(result):
                raise SummarizerAuthError("the model refused the credentials")
            raise CodexSummaryFailed(f"summary turn {result.outcome.value}")
        return result.final_text or ""
