"""The app-server as the turn orchestrator and compaction see it: :class:`AppServerPort`.

Exactly the surface :func:`codex_turn.run_codex_turn` and
:func:`codex_turn.harness.compaction.compact_session` use, typed, and nothing else: start,
resume and forget a thread, run a turn through a :class:`TurnHandlePort`, and compact a
thread natively. :class:`~.manager.AppServer` implements it; so does the tests' in-process
fake (``tests/support/fake_appserver.py``), and mypy checks both statically. A method the
orchestrator starts to use belongs here first, so that the fake cannot lag behind.

A thread is started and resumed with one :class:`~.thread_settings.ThreadSettings` value
(which says what each request sends of it). Its runtime policy (approval policy, sandbox,
approvals reviewer, service tier) is sent only when set; a resume that loads a thread should
re-send it (see :meth:`~.threads.Threads.resume_thread`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from .defaults import INTERRUPT_GRACE_S, NATIVE_COMPACTION_TIMEOUT_S
from .native_compaction import CompactionResult
from .projector import CodexTurnResult, Notification, TurnProjector
from .server_requests import TurnRequestHandlers
from .thread_settings import DEFAULT_SETTINGS, ThreadSettings
from .threads import LoadedThread
from .tools import DynamicTool
from .types import ThreadResult, UserInput

__all__ = ["AppServerPort", "TurnHandlePort"]


class TurnHandlePort(Protocol):
    """One running turn, as :meth:`AppServerPort.turn` yields it
    (:class:`~.turn.TurnHandle` implements it)."""

    @property
    def projector(self) -> TurnProjector:
        """The turn's fold of notifications so far (a partial result can be built from it)."""
        ...

    @property
    def result(self) -> CodexTurnResult | None:
        """The turn's result once :meth:`collect` (or the iteration) reached its end."""
        ...

    async def interrupt(self) -> None:
        """Send ``turn/interrupt`` once, after the turn's ``turn/started``."""
        ...

    async def steer(
        self,
        input: Sequence[UserInput],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> str:
        """``turn/steer``: more user input for this running turn (after its
        ``turn/started``); Codex's turn id. Raises ``TurnNotRunning`` when the turn is not
        running (any more), ``AppServerError`` when refused otherwise."""
        ...

    async def collect(
        self,
        *,
        on_event: Callable[[Notification], Awaitable[None]] | None = None,
        idle_timeout: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> CodexTurnResult:
        """Consume the turn to its end; a timeout interrupts it (``TIMED_OUT``)."""
        ...


class AppServerPort(Protocol):
    """What the orchestrator and compaction need from an app-server (see the module doc)."""

    async def start_thread(self, settings: ThreadSettings = DEFAULT_SETTINGS) -> ThreadResult:
        """``thread/start``, with the settings' tools bound to the new thread."""
        ...

    async def resume_thread(self, thread_id: str, settings: ThreadSettings) -> ThreadResult:
        """``thread/resume`` (turns excluded) with the thread's whole settings again: Codex
        keeps only the developer instructions re-sent here across a later compaction."""
        ...

    def forget_thread(self, thread_id: str) -> None:
        """Release what is kept locally for a thread that runs no more turns (idempotent)."""
        ...

    def loaded_thread(self, thread_id: str) -> LoadedThread | None:
        """What the live Codex process holds for a thread this process loaded, else ``None``."""
        ...

    def bind_tools(self, thread_id: str, tools: Iterable[DynamicTool]) -> None:
        """Bind this turn's Python tool handlers to a thread that stays loaded."""
        ...

    def turn(
        self,
        thread_id: str,
        input: str | Sequence[UserInput],
        *,
        prompt: str | None = None,
        images: Sequence[str] = (),
        model: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        handlers: TurnRequestHandlers | None = None,
    ) -> AbstractAsyncContextManager[TurnHandlePort]:
        """``async with port.turn(...) as handle``: ``turn/start`` (with the per-turn
        ``overrides``, wire names), the host ``handlers`` answering the turn's approvals and
        user-input requests; leaving the block before ``turn/completed`` interrupts the turn
        and waits briefly for its end."""
        ...

    async def compact_thread(
        self,
        thread_id: str,
        *,
        timeout: float = NATIVE_COMPACTION_TIMEOUT_S,  # noqa: ASYNC109
        interrupt_grace: float = INTERRUPT_GRACE_S,
        developer_instructions: str | None = None,
        cwd: str | None = None,
    ) -> CompactionResult:
        """Native compaction (``thread/compact/start``) to its end, serialised per thread."""
        ...
