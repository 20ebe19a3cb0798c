""":class:`AppServer`: many threads over one app-server process, replaced when it dies.

One ``codex app-server`` process serves any number of threads concurrently; the client
routes notifications per thread, so :class:`AppServer` is simply the owner of "the current
client" plus two policies:

* **Supervision.** Each client runs inside a supervisor task of the manager's own task group
  (anyio task groups must be exited by the task that entered them, so a restart triggered
  from any caller task is still torn down correctly). When the process dies, every in-flight
  call fails with :class:`AppServerClosed`; the *next* call spawns a fresh process on the same
  CODEX_HOME (already initialised, so that is safe) and counts a restart. A process that
  stops answering is the same case: the client declares it dead once it misses a deadline
  and then a liveness probe (see "Liveness" in :mod:`.connection`), kills it and closes, and the
  manager replaces it exactly like a crashed one; threads and bindings are never dropped on
  a timeout.
* **Thread memory.** Threads started or resumed through the manager remember the
  :class:`~.thread_settings.ThreadSettings` they were last loaded with (developer
  instructions, cwd, model, Python tools, runtime policy ...). A thread that was loaded in a
  previous process is re-resumed automatically before its next turn with those settings
  (before a native compaction, with its runtime policy), so a crash costs one turn, not the
  thread, nor its policy. The memory is
  an LRU of ``max_threads`` threads (default
  :data:`~.defaults.MAX_REMEMBERED_THREADS`, 256): a per-turn engine rotates to a fresh
  thread every turn, and a tool closure can keep a whole turn alive. A thread that is done
  with should be released with :meth:`AppServer.forget_thread` (the memo *and* the live
  client's tool registry); an LRU eviction only drops the memo (the thread is then no longer
  re-resumed after a restart).
* **Kept forks.** An ephemeral fork that ran a turn of the structured projection may be kept
  loaded for its session's next turn (:meth:`AppServer.keep_fork`,
  :meth:`AppServer.take_kept_fork`): an LRU of ``max_kept_forks`` (default
  :data:`~.defaults.MAX_KEPT_FORKS`), one per base thread; an evicted or replaced one is
  released (:meth:`AppServer.release_fork`).
* **Login.** Each process the manager spawns from the real binary is asked for its account
  state right after ``initialize`` (:mod:`.account`): a configuration that needs an OpenAI
  login and has none raises :class:`~.errors.CodexLoginRequired` from :meth:`AppServer.start`
  (or from the call that restarts the process) in seconds, instead of every turn retrying
  until its timeout.
* **Compaction.** Native compactions of one thread are serialised by a per-thread lock held
  by the manager (so it survives restarts); a compaction whose interrupt went unanswered
  retires the process before that lock is released (see :meth:`AppServer.compact_thread`).

``transport_factory`` replaces spawning the binary (tests plug an in-process fake Codex in).

Size (~600 lines): every policy above owns state of "the current client" (its generation, the
thread memo, the kept forks, the compaction locks) and is read under the same restart rules;
split apart they would share that state through each other's internals.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from codex_turn._log import format_error, get_logger

from .account import check_login, should_check
from .client import AppServerClient
from .config import AppServerConfig
from .connection import NotificationListener, unwrap_single_group
from .defaults import (
    INTERRUPT_GRACE_S,
    MAX_KEPT_FORKS,
    MAX_REMEMBERED_THREADS,
    NATIVE_COMPACTION_TIMEOUT_S,
)
from .errors import AppServerClosed, AppServerError, AppServerRpcError, CodexLoginRequired
from .logsafe import capped
from .native_compaction import CompactionResult, KeyedLocks
from .port import AppServerPort
from .process import LineTransport, startup_reason
from .projector import CodexTurnResult, Notification
from .server_requests import ApprovalPolicy, TurnRequestHandlers, UserInputHandler, decline_all
from .thread_settings import DEFAULT_SETTINGS, ThreadSettings
from .threads import KeptFork, LoadedThread
from .tools import DynamicTool, ToolRegistry, as_registry
from .turn import TurnHandle
from .types import ThreadResult, UserInput

__all__ = ["AppServer"]

log = get_logger(__name__)
_METHOD_NOT_FOUND = -32601
_UNSUBSCRIBE_TIMEOUT_S = 10.0


@attrs.define
class _ThreadMemo:
    #: What the thread was last started or resumed with (the tools: the last bound).
    settings: ThreadSettings
    generation: int
    #: The thread's sticky turn defaults at its first load in this pool (see
    #: :attr:`~.threads.LoadedThread.defaults`). Only used when the app-server cannot tell its
    #: configured defaults (no ``config/read``): an auto-resume then restores them, never a
    #: per-turn override Codex kept in the rollout.
    defaults: Mapping[str, Any] = attrs.field(factory=dict)


class AppServer:
    """The app-server pool. ``async with AppServer.start(config) as server:``.

    ``max_threads`` bounds the thread memory (an LRU, see the module docstring)."""

    def __init__(
        self,
        config: AppServerConfig,
        *,
        approval_policy: ApprovalPolicy = decline_all,
        user_input_handler: UserInputHandler | None = None,
        record_sent: bool = False,
        auto_resume: bool = True,
        transport_factory: Callable[[AppServerConfig], Awaitable[LineTransport]] | None = None,
        max_threads: int = MAX_REMEMBERED_THREADS,
        max_kept_forks: int = MAX_KEPT_FORKS,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        if max_kept_forks < 0:
            raise ValueError(f"max_kept_forks must not be negative, got {max_kept_forks}")
        self.config = config
        self.max_threads = max_threads
        self.max_kept_forks = max_kept_forks
        self.approval_policy = approval_policy
        self.user_input_handler = user_input_handler
        self.record_sent = record_sent
        self.auto_resume = auto_resume
        self.generation = 0
        self.restarts = 0
        #: Whether the binary serves ``thread/fork`` and ``thread/inject_items`` (the
        #: structured projection); learned ``False`` from a "method not found".
        self.can_fork = True
        self.sent: list[dict[str, Any]] = []
        self.server_requests: dict[Any, str] = {}
        self._client: AppServerClient | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._lock = anyio.Lock()
        self._threads: collections.OrderedDict[str, _ThreadMemo] = collections.OrderedDict()
        self._kept: collections.OrderedDict[str, KeptFork] = collections.OrderedDict()
        self._listeners: list[NotificationListener] = []
        self._closing = False
        self._compaction_locks = KeyedLocks()
        self._transport_factory = transport_factory

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: AppServerConfig, **kwargs: Any) -> AsyncIterator[AppServer]:
        """Start the first process eagerly (so start errors surface here), yield, shut down."""
        server = cls(config, **kwargs)
        with unwrap_single_group():
            async with anyio.create_task_group() as tg:
                server._tg = tg
                try:
                    await server.client()
                    yield server
                finally:
                    server._closing = True
                    if server._client is not None:
                        server._client.request_stop()

    async def _supervise(self, *, task_status: anyio.abc.TaskStatus[AppServerClient]) -> None:
        transport = (
            None if self._transport_factory is None else await self._transport_factory(self.config)
        )
        async with AppServerClient.connect(
            self.config,
            transport=transport,
            approval_policy=self.approval_policy,
            user_input_handler=self.user_input_handler,
            sent_log=self.sent if self.record_sent else None,  # one log across restarts
        ) as client:
            if self.record_sent:
                client.server_requests = self.server_requests
            if should_check(self.config, injected_transport=transport is not None):
                # Before anyone can use the process: a missing login fails the start (or the
                # call that restarts it) in seconds, not every turn at its timeout.
                try:
                    await check_login(client, self.config)
                except CodexLoginRequired as missing:
                    # An invalid config.toml makes Codex fall back to its defaults, which may
                    # need a login the user's configuration did not: say so.
                    tail = getattr(client.transport, "stderr_tail", ())
                    said = startup_reason(tail, config_only=True)
                    if said is None:
                        raise
                    raise CodexLoginRequired(missing.codex_home, codex_said=said) from None
            for listener in self._listeners:
                client.add_listener(listener)
            task_status.started(client)
            await client.wait_closed()

    async def client(self) -> AppServerClient:
        """The live client, spawning (or re-spawning after a crash) when needed."""
        current = self._client
        if current is not None and not current.closed:
            return current
        async with self._lock:
            current = self._client
            if current is not None and not current.closed:
                return current
            if self._tg is None or self._closing:
                raise AppServerClosed("AppServer is not running")
            if current is not None:
                self.restarts += 1
                why = current.closed_error
                log.warning(
                    "appserver.restart",
                    restarts=self.restarts,
                    reason=None if why is None else format_error(why),
                )
            client: AppServerClient = await self._tg.start(self._supervise)
            self.generation += 1
            self._client = client
            return client

    @property
    def current(self) -> AppServerClient | None:
        """The current client without starting one (tests use it to kill the process)."""
        return self._client

    def add_listener(self, listener: NotificationListener) -> None:
        self._listeners.append(listener)
        if self._client is not None:
            self._client.add_listener(listener)

    # -- threads -------------------------------------------------------------------------

    def _remember(self, thread_id: str, memo: _ThreadMemo) -> None:
        self._threads[thread_id] = memo
        self._threads.move_to_end(thread_id)
        while len(self._threads) > self.max_threads:
            evicted, _ = self._threads.popitem(last=False)
            log.info("appserver.thread_memo_evicted", thread_id=capped(evicted))

    def forget_thread(self, thread_id: str) -> None:
        """Release everything kept locally for ``thread_id``: its resume memo (developer
        instructions, Python tools) and the live client's tool registry and loaded mark.

        The thread is *not* unloaded in Codex (and stays resumable). Call it when the thread
        will not run another turn (e.g. the engine rotated to a fresh thread). Idempotent."""
        self._threads.pop(thread_id, None)
        if self._client is not None:
            self._client.forget_thread(thread_id)

    def loaded_thread(self, thread_id: str) -> LoadedThread | None:
        """What the live process holds for ``thread_id`` (see :class:`~.threads.LoadedThread`);
        ``None`` when it has not loaded the thread, or no process is running."""
        client = self._client
        if client is None or client.closed:
            return None
        return client.loaded_thread(thread_id)

    def bind_tools(self, thread_id: str, tools: ToolRegistry | Iterable[DynamicTool]) -> None:
        """Bind this turn's Python tool handlers to a thread that stays loaded (local only:
        Codex froze the tool *specs* at thread/start); remembered for an auto-resume."""
        registry = as_registry(tools)
        assert registry is not None
        if self._client is not None:
            self._client.register_tools(thread_id, registry)
        memo = self._threads.get(thread_id)
        if memo is not None:
            memo.settings = attrs.evolve(memo.settings, tools=registry)
            self._threads.move_to_end(thread_id)

    @property
    def remembered_threads(self) -> list[str]:
        """The thread ids whose resume parameters are remembered, least recent first."""
        return list(self._threads)

    async def start_thread(
        self,
        settings: ThreadSettings = DEFAULT_SETTINGS,
        *,
        config: Mapping[str, Any] | None = None,
        ephemeral: bool | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """Start a thread (see :meth:`AppServerClient.start_thread`).

        The settings are remembered with the thread and re-sent when the thread is
        auto-resumed in a new process."""
        client = await self.client()
        result = await client.start_thread(
            settings, config=config, ephemeral=ephemeral, timeout=timeout
        )
        self._remember(
            result.thread_id,
            _ThreadMemo(settings, self.generation, self._defaults_of(client, result.thread_id)),
        )
        return result

    def _defaults_of(self, client: AppServerClient, thread_id: str) -> Mapping[str, Any]:
        """The thread's defaults: those of its first load in this pool, kept across restarts."""
        memo = self._threads.get(thread_id)
        if memo is not None and memo.defaults:
            return memo.defaults
        loaded = client.loaded_thread(thread_id)
        return dict(loaded.defaults) if loaded is not None else {}

    async def resume_thread(
        self,
        thread_id: str,
        settings: ThreadSettings,
        *,
        exclude_turns: bool = True,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """Resume a thread (see :meth:`AppServerClient.resume_thread`).

        The runtime policy is sent only when set (Codex applies it when this resume loads
        the thread); the settings are remembered for a later auto-resume."""
        client = await self.client()
        result = await client.resume_thread(
            thread_id, settings, exclude_turns=exclude_turns, timeout=timeout
        )
        known = self._threads.get(thread_id)
        if (
            known is not None
            and known.defaults
            and not client.knows_configured_defaults(settings.cwd)
        ):
            # Codex loads the thread from its rollout with the per-turn settings its last turn
            # left (it unloads idle threads; a restart loses them all). The client compares
            # them with Codex's configured defaults itself; an app-server that cannot tell
            # those (no config/read) gets the defaults recorded at the first load, sent back
            # by the next turn without its own.
            client.adopt_defaults(thread_id, known.defaults)
        defaults = self._defaults_of(client, thread_id)
        self._remember(thread_id, _ThreadMemo(settings, self.generation, defaults))
        return result

    async def fork_thread(self, thread_id: str, settings: ThreadSettings) -> ThreadResult:
        """An ephemeral fork of ``thread_id`` (see :meth:`AppServerClient.fork_thread`). Not
        remembered for an auto-resume: an ephemeral thread dies with its process."""
        client = await self.client()
        with self._learning_structured():
            return await client.fork_thread(thread_id, settings)

    async def inject_items(self, thread_id: str, items: Sequence[Mapping[str, Any]]) -> None:
        """Append Responses items to an idle loaded thread (see
        :meth:`AppServerClient.inject_items`)."""
        client = await self.client()
        with self._learning_structured():
            await client.inject_items(thread_id, items)

    def release_fork(self, thread_id: str) -> None:
        """A fork that ran its turn: forget it locally, and ask Codex, in the background,
        to drop it (``thread/unsubscribe``; Codex unloads a thread without subscribers after
        ``thread_unload_delay_secs``). An ephemeral fork can be neither deleted nor
        archived: without this, each one stays loaded (~1.5 MB) until the process ends."""
        self.forget_thread(thread_id)
        client = self._client
        if self._tg is None or self._closing or client is None or client.closed:
            return
        self._tg.start_soon(self._unsubscribe, client, thread_id)

    def keep_fork(self, kept: KeptFork) -> None:
        """Keep an idle fork that ran its turn for the next turn on its base (see the module
        header): it replaces (and releases) one kept for that base, and the least recently
        kept beyond ``max_kept_forks`` is released."""
        previous = self._kept.pop(kept.base_thread_id, None)
        if previous is not None and previous.fork_thread_id != kept.fork_thread_id:
            self.release_fork(previous.fork_thread_id)
        self._kept[kept.base_thread_id] = kept
        while len(self._kept) > self.max_kept_forks:
            _, evicted = self._kept.popitem(last=False)
            self.release_fork(evicted.fork_thread_id)

    def take_kept_fork(self, base_thread_id: str) -> KeptFork | None:
        """The fork kept for ``base_thread_id``, handed over (no longer kept: the caller
        continues it or releases it), or ``None``."""
        return self._kept.pop(base_thread_id, None)

    def kept_fork(self, base_thread_id: str) -> KeptFork | None:
        """The fork kept for ``base_thread_id``, left kept (a look, e.g. at its memo)."""
        return self._kept.get(base_thread_id)

    async def _unsubscribe(self, client: AppServerClient, thread_id: str) -> None:
        with anyio.move_on_after(_UNSUBSCRIBE_TIMEOUT_S):
            try:
                await client.request("thread/unsubscribe", {"threadId": thread_id})
            except AppServerError as error:  # best effort: a restart drops it anyway
                log.debug("appserver.unsubscribe_failed", error=capped(str(error)))

    @contextlib.contextmanager
    def _learning_structured(self) -> Iterator[None]:
        """A binary without ``thread/fork`` or ``thread/inject_items`` answers "method not
        found": from then on this pool says it cannot fork (:attr:`can_fork`), so turns use
        the text frame instead of starting a base they cannot use."""
        try:
            yield
        except AppServerRpcError as error:
            if error.code == _METHOD_NOT_FOUND:
                self.can_fork = False
                log.warning("appserver.structured_unsupported", error=capped(str(error)))
            raise

    async def _client_for(self, thread_id: str) -> AppServerClient:
        client = await self.client()
        memo = self._threads.get(thread_id)
        if memo is not None:
            self._threads.move_to_end(thread_id)
        if self.auto_resume and memo is not None and memo.generation != self.generation:
            log.info("appserver.auto_resume", thread_id=capped(thread_id))
            await self.resume_thread(thread_id, memo.settings)
        return client

    # -- turns ---------------------------------------------------------------------------

    async def run_turn(
        self,
        thread_id: str,
        input: str | Sequence[UserInput],
        *,
        on_event: Callable[[Notification], Awaitable[None]] | None = None,
        idle_timeout: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
        **kwargs: Any,
    ) -> CodexTurnResult:
        client = await self._client_for(thread_id)
        return await client.run_turn(
            thread_id,
            input,
            on_event=on_event,
            idle_timeout=idle_timeout,
            timeout=timeout,
            **kwargs,
        )

    @contextlib.asynccontextmanager
    async def turn(
        self,
        thread_id: str,
        input: str | Sequence[UserInput],
        *,
        prompt: str | None = None,
        images: Sequence[str] = (),
        provider: str | None = None,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
        overrides: Mapping[str, Any] | None = None,
        handlers: TurnRequestHandlers | None = None,
    ) -> AsyncIterator[TurnHandle]:
        """A turn of ``thread_id`` (see :meth:`AppServerClient.turn`), after re-resuming the
        thread when the process was restarted since it was loaded."""
        client = await self._client_for(thread_id)
        async with client.turn(
            thread_id,
            input,
            prompt=prompt,
            images=images,
            provider=provider,
            model=model,
            timeout=timeout,
            overrides=overrides,
            handlers=handlers,
        ) as handle:
            yield handle

    async def interrupt_turn(
        self,
        thread_id: str,
        turn_id: str,
        *,
        timeout: float = INTERRUPT_GRACE_S,  # noqa: ASYNC109
    ) -> None:
        client = await self.client()
        await client.interrupt_turn(thread_id, turn_id, timeout=timeout)

    async def compact_thread(
        self,
        thread_id: str,
        *,
        timeout: float = NATIVE_COMPACTION_TIMEOUT_S,  # noqa: ASYNC109
        interrupt_grace: float = INTERRUPT_GRACE_S,
        developer_instructions: str | None = None,
        cwd: str | None = None,
    ) -> CompactionResult:
        """Native compaction of ``thread_id`` (see :meth:`AppServerClient.compact_thread`).

        Compactions of one thread are serialised by a per-thread lock that outlives process
        restarts. A thread this process has not loaded is resumed first (``excludeTurns``,
        with ``developer_instructions`` and ``cwd`` when given: Codex drops developer
        instructions that were not re-sent on resume from the compacted context). When the
        compaction's interrupt is not acknowledged, the connection is retired before the lock
        is released, so the next call (of any kind) runs on a fresh process.
        """
        async with self._compaction_locks.hold(thread_id):
            client = await self._client_for(thread_id)
            if not client.is_loaded(thread_id):
                log.info("appserver.compaction_resume", thread_id=capped(thread_id))
                memo = self._threads.get(thread_id)
                policy = memo.settings.runtime_policy() if memo is not None else DEFAULT_SETTINGS
                await self.resume_thread(
                    thread_id,
                    attrs.evolve(policy, developer_instructions=developer_instructions, cwd=cwd),
                )
            return await client.compact_thread(
                thread_id, timeout=timeout, interrupt_grace=interrupt_grace
            )

    async def request(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """Any other method, raw JSON in and out."""
        client = await self.client()
        return await client.request(method, params, timeout=timeout)


if TYPE_CHECKING:  # mypy proves that AppServer implements the port the orchestrator uses

    def _implements_port(server: AppServer) -> AppServerPort:
        return server
