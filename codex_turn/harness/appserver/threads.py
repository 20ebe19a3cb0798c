"""The client's threads: ``thread/start``, ``thread/resume``, ``thread/fork``,
``thread/inject_items`` and each thread's local state.

:class:`Threads` is a part of :class:`~.client.AppServerClient` (which hands its methods on),
built on the :class:`~.connection.Connection`. A thread's local state is its
:class:`~.tools.ToolRegistry` (bound at start or resume, consulted by
:class:`~.server_requests.Responder` for ``item/tool/call``) and whether this process loaded
it; :meth:`Threads.forget_thread` releases both.

Each request takes the thread's settings as one :class:`~.thread_settings.ThreadSettings`
value, which also says what each request sends of it. ``thread/resume`` always sends
``excludeTurns`` and is always given the settings, developer instructions included: Codex keeps
only what is re-sent there across a later compaction. The runtime policy (approval policy,
sandbox, approvals reviewer, service tier) is sent only when set; see
:meth:`Threads.resume_thread` for what a resume without it loses.

The client also keeps, per thread this process loaded, what Codex holds
(:class:`LoadedThread`): the result of the last start/resume, the key of the settings sent
with it (:attr:`~.thread_settings.ThreadSettings.key`) and whether Codex has compacted or
unloaded the thread since
(:meth:`Threads.note` watches every notification, a listener of the connection:
``contextCompaction`` items, ``thread/compacted``, ``thread/status/changed`` to
``notLoaded``). The turn's resume table
(:func:`codex_turn.fsm.thread.decide_resume`) reads it to skip a ``thread/resume`` that
would change nothing.

**Defaults.** Each :class:`LoadedThread` also carries the thread's *defaults*: what a turn that
states no effort, approval policy or sandbox of its own must run with. They come from Codex's
configuration (``config/read`` with the thread's cwd, read once per app-server process and cwd,
:func:`configured_defaults`), not from what a start or resume reports: a resume reports what
the rollout restored, an earlier turn's override included (even one of an earlier host
process). Only a field the configuration leaves unset takes the reported value (Codex's
built-in default; after a resume, possibly the rollout's). A field the start/resume sent itself
(``approval_policy``, ``sandbox``) is the thread's default as Codex reports it. A load whose
reported values differ from the defaults marks those fields *overridden*, so the next turn
without its own values sends the defaults explicitly (:mod:`.turn_start`). When ``config/read``
is refused (an older binary) the defaults fall back to what the load reports, with a warning.

A resume that fails because Codex says the thread does not exist raises
:class:`~.errors.ThreadNotFound` (mapped here, the one place ``thread/resume`` is sent); any
other failure keeps its own type, so a caller can tell "gone" from "not now".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from codex_turn._log import get_logger

from .connection import Connection
from .errors import AppServerRpcError, ThreadNotFound
from .logsafe import capped
from .projector import Notification, token_usage_parts
from .thread_settings import DEFAULT_SETTINGS, ThreadSettings
from .tools import DynamicTool, ToolRegistry, as_registry
from .types import (
    ThreadForkParams,
    ThreadResult,
    ThreadResumeParams,
    ThreadStartParams,
    structure,
    unstructure,
)

__all__ = [
    "INJECT_BATCH",
    "STICKY_TURN_FIELDS",
    "KeptFork",
    "LoadedThread",
    "Threads",
    "configured_defaults",
    "loaded_defaults",
]

log = get_logger(__name__)


#: Items per ``thread/inject_items`` request (smaller batches keep each line of the transport
#: well under its limits; a batch is atomic, the injection as a whole is not).
INJECT_BATCH: Final = 2000
_NOT_LOADED: Final = "thread not found:"
#: The settings key of an ephemeral fork: it never matches a turn's, so a fork is never reused.
_FORK_SETTINGS: Final = "ephemeral-fork"

#: ``turn/start`` fields Codex keeps on the thread "for this turn and subsequent turns".
STICKY_TURN_FIELDS: Final = ("effort", "approvalPolicy", "sandboxPolicy")

# Notifications after which Codex may no longer hold a thread as this process loaded it.
_UNLOADING: Final = frozenset(
    {
        "thread/closed",
        "thread/archived",
        "thread/deleted",
        "thread/reverted",
        "thread/settings/updated",
    }
)
_UNLOADED_STATUSES: Final = frozenset({"notLoaded", "systemError"})
# Every method that can change what a loaded thread holds: the unloading ones, a status
# change, and those that can carry a compaction (Notification.compaction_phase). Others
# (deltas, token usage...) skip the check.
_THREAD_CHANGES: Final = _UNLOADING | {
    "thread/status/changed",
    "thread/compacted",
    "item/started",
    "item/completed",
    "thread/tokenUsage/updated",
}


@attrs.frozen
class LoadedThread:
    """What this process knows Codex holds for a thread it started or resumed."""

    result: ThreadResult  # the answer of the last thread/start or thread/resume
    settings: str  # ThreadSettings.key of what was sent with it
    compacted: bool = False  # Codex compacted the thread since (instructions may be gone)
    #: What a turn that states none of its own runs with, as ``turn/start`` fields
    #: (:data:`STICKY_TURN_FIELDS`; a field with no configured value is absent): Codex's
    #: configured defaults (see the module header). A resume of a thread already loaded keeps
    #: them (Codex ignores its settings).
    defaults: Mapping[str, Any] = attrs.field(factory=dict)
    #: The sticky fields the thread may hold with something else than the default (set by a
    #: ``turn/start`` of this process, or restored from the rollout by the load): the next
    #: turn without its own value sends the default explicitly.
    overridden: frozenset[str] = frozenset()
    #: The tokens the thread's last model call held (``tokenUsage.last.totalTokens``) and
    #: the model's context window then, as Codex last reported them (a turn's usage, or the
    #: replay of the last one when a process loads the thread); ``None``: not reported.
    native_tokens: int | None = None
    context_window: int | None = None

    def fills(self, share: float) -> bool:
        """The native history fills more than ``share`` of the context window."""
        tokens, window = self.native_tokens, self.context_window
        return tokens is not None and window is not None and window > 0 and tokens > share * window


@attrs.frozen
class KeptFork:
    """An idle ephemeral fork kept loaded after its turn, for the session's next turn (see
    :data:`codex_turn.fsm.thread.FORK_RULES`): what it holds, in the harness's terms."""

    base_thread_id: str
    fork_thread_id: str
    #: The ids of the items it holds, in order: the context injected into it and its
    #: turn's own messages, converted as the engine hands them back.
    holds: tuple[str, ...]
    settings: str  # ThreadSettings.key of what it was forked with, instructions included
    completed: bool  # its turn completed
    #: The harness's state for the next conversion (opaque here).
    memo: object = None


def loaded_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The sticky ``turn/start`` fields of a thread/start or thread/resume response."""
    reported = {
        "effort": raw.get("reasoningEffort"),
        "approvalPolicy": raw.get("approvalPolicy"),
        "sandboxPolicy": raw.get("sandbox"),
    }
    return {field: value for field, value in reported.items() if value is not None}


_POLICY_TYPES: Final[dict[str, str]] = {
    "read-only": "readOnly",
    "workspace-write": "workspaceWrite",
    "danger-full-access": "dangerFullAccess",
}


def configured_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """The sticky ``turn/start`` fields of Codex's configuration (``config/read``'s
    ``config``: ``model_reasoning_effort``, ``approval_policy``, ``sandbox_mode`` with its
    ``sandbox_workspace_write`` table). A field the configuration leaves unset is absent."""
    defaults: dict[str, Any] = {}
    if config.get("model_reasoning_effort") is not None:
        defaults["effort"] = config["model_reasoning_effort"]
    if config.get("approval_policy") is not None:
        defaults["approvalPolicy"] = config["approval_policy"]
    kind = _POLICY_TYPES.get(str(config.get("sandbox_mode")))
    if kind is not None:
        policy: dict[str, Any] = {"type": kind}
        table = config.get("sandbox_workspace_write")
        if kind == "workspaceWrite" and isinstance(table, Mapping):
            for key, wire in (
                ("writable_roots", "writableRoots"),
                ("network_access", "networkAccess"),
                ("exclude_tmpdir_env_var", "excludeTmpdirEnvVar"),
                ("exclude_slash_tmp", "excludeSlashTmp"),
            ):
                if table.get(key) is not None:
                    policy[wire] = table[key]
        defaults["sandboxPolicy"] = policy
    return defaults


def _thread_defaults(
    configured: Mapping[str, Any] | None,
    reported: Mapping[str, Any],
    *,
    sent: Iterable[str] = (),
) -> tuple[dict[str, Any], frozenset[str]]:
    """A freshly loaded thread's defaults and the fields it may hold otherwise.

    ``configured``: :func:`configured_defaults` (``None``: unknown, the load's report is
    taken, as before ``config/read`` existed); ``reported``: :func:`loaded_defaults` of the
    load; ``sent``: the sticky fields the load itself sent (their report is the default)."""
    if configured is None:
        return dict(reported), frozenset()
    # A field the configuration leaves unset is Codex's built-in default, which only the load
    # reports (reliably for a start; a resume may report what its rollout restored).
    defaults = {**reported, **configured}
    for field in sent:
        if field in reported:
            defaults[field] = reported[field]
    held = reported.get("sandboxPolicy")
    default = defaults.get("sandboxPolicy")
    if (
        isinstance(held, Mapping)
        and isinstance(default, Mapping)
        and held.get("type") == default.get("type")
    ):
        # Codex's own rendering of the configured mode (writable roots resolved ...).
        defaults["sandboxPolicy"] = dict(held)
    overridden = frozenset(
        field
        for field in STICKY_TURN_FIELDS
        if field in defaults and reported.get(field) != defaults[field]
    )
    return defaults, overridden


def _sent_sticky(settings: ThreadSettings) -> tuple[str, ...]:
    """The sticky fields a start/resume sent itself (see :func:`_thread_defaults`)."""
    fields = (("approvalPolicy", settings.approval_policy), ("sandboxPolicy", settings.sandbox))
    return tuple(field for field, value in fields if value is not None)


def _status_type(params: Mapping[str, Any]) -> object:
    status = params.get("status")
    return status.get("type") if isinstance(status, Mapping) else None


class Threads:
    """``thread/start``, ``thread/resume``, ``thread/fork``, ``thread/inject_items`` and the
    threads' local state (see the module header)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        #: Each thread's Python tools (what ``item/tool/call`` runs).
        self.tools: dict[str, ToolRegistry] = {}
        self._loaded: dict[str, LoadedThread] = {}
        #: Per cwd, the sticky turn defaults of Codex's configuration (``config/read``), or
        #: ``None`` when this app-server cannot tell.
        self._configured: dict[str | None, Mapping[str, Any] | None] = {}
        #: The threads a turn of this process gave collaboration-mode instructions of its own
        #: (kept across an unload: Codex may restore the mode from the rollout).
        self._collaborating: set[str] = set()

    def note(self, n: Notification) -> None:
        """Keep :class:`LoadedThread` true (a listener of the connection): a compaction may
        drop the instructions a resume re-sent, an unload drops the thread (both make the
        next turn resume)."""
        if n.method not in _THREAD_CHANGES:
            return
        thread_id = n.thread_id
        if thread_id is None:
            return
        loaded = self._loaded.get(thread_id)
        if loaded is None:
            return
        if n.method == "thread/tokenUsage/updated":
            tokens, window = _native_size(n.params)
            if (tokens, window) != (loaded.native_tokens, loaded.context_window):
                self._loaded[thread_id] = attrs.evolve(
                    loaded, native_tokens=tokens, context_window=window
                )
        elif n.compaction_phase is not None:
            if not loaded.compacted:
                self._loaded[thread_id] = attrs.evolve(loaded, compacted=True)
        elif n.method in _UNLOADING or (
            n.method == "thread/status/changed" and _status_type(n.params) in _UNLOADED_STATUSES
        ):
            del self._loaded[thread_id]

    def sticky_defaults(self, thread_id: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults a ``turn/start`` sends back: Codex keeps a turn's effort, approval
        policy and sandbox for the thread's later turns, so a turn that states none of its
        own after a turn that did runs with the defaults recorded when the thread was loaded
        (sent explicitly)."""
        loaded = self._loaded.get(thread_id)
        if loaded is None:
            return {}
        return {
            field: loaded.defaults[field]
            for field in loaded.overridden
            if field not in overrides and field in loaded.defaults
        }

    def note_sticky(self, thread_id: str, wire: Mapping[str, Any]) -> None:
        """A ``turn/start`` sent ``wire``: record which sticky fields the thread now holds
        other than its defaults."""
        loaded = self._loaded.get(thread_id)
        if loaded is None:
            return
        overridden = frozenset(
            field
            for field in STICKY_TURN_FIELDS
            if (field in wire and wire[field] != loaded.defaults.get(field))
            or (field not in wire and field in loaded.overridden)
        )
        if overridden != loaded.overridden:
            self._loaded[thread_id] = attrs.evolve(loaded, overridden=overridden)

    def collaboration(
        self,
        thread_id: str,
        wire: Mapping[str, Any],
        *,
        model: str | None,
        default_model: str | None = None,
    ) -> dict[str, Any]:
        """``wire`` (a ``turn/start``'s params) with its collaboration mode complete: the
        settings' model and reasoning effort are what the turn runs with (Codex lets them
        take precedence over the turn's own, and a ``null`` effort clears it), and a turn
        without a mode of its own after one that had instructions of its own sends Codex's
        default mode (its built-in instructions) once: instructions are turn-scoped (see
        :mod:`codex_turn.harness.collaboration`). The model: the turn's (``model``), else
        the thread's as Codex reported it, else ``default_model``; a mode whose model is
        unknown is dropped."""
        mode = wire.get("collaborationMode")
        if mode is None and thread_id not in self._collaborating:
            return dict(wire)
        if mode is None:
            mode = {"mode": "default", "settings": {"developer_instructions": None}}
        loaded = self._loaded.get(thread_id)
        settings = dict(mode.get("settings") or {})
        settings.setdefault("developer_instructions", None)
        held = loaded.result.model if loaded is not None else None
        chosen = wire.get("model") or model or held or default_model
        settings.setdefault("model", chosen)
        default_effort = loaded.defaults.get("effort") if loaded is not None else None
        settings.setdefault("reasoning_effort", wire.get("effort", default_effort))
        out = {key: value for key, value in wire.items() if key != "collaborationMode"}
        if not settings["model"]:
            log.warning("appserver.collaboration_mode_dropped", thread_id=capped(thread_id))
            return out
        out["collaborationMode"] = {**mode, "settings": settings}
        return out

    def note_collaboration(self, thread_id: str, wire: Mapping[str, Any]) -> None:
        """A ``turn/start`` sent ``wire``: record whether the thread now holds
        collaboration-mode instructions of this process's own."""
        mode = wire.get("collaborationMode")
        if not isinstance(mode, Mapping):
            return
        settings = mode.get("settings")
        own = isinstance(settings, Mapping) and settings.get("developer_instructions") is not None
        if own:
            self._collaborating.add(thread_id)
        else:
            self._collaborating.discard(thread_id)

    def register_tools(self, thread_id: str, tools: ToolRegistry | Iterable[DynamicTool]) -> None:
        """Bind Python tools to a thread (done by start/resume; also usable directly)."""
        registry = as_registry(tools)
        assert registry is not None
        self.tools[thread_id] = registry

    def is_loaded(self, thread_id: str) -> bool:
        """Whether this process started or resumed ``thread_id`` (and Codex kept it loaded)."""
        return thread_id in self._loaded

    def loaded_thread(self, thread_id: str) -> LoadedThread | None:
        """What Codex holds for ``thread_id`` as far as this process knows, or ``None`` when
        this process has not loaded it (or Codex unloaded it since)."""
        return self._loaded.get(thread_id)

    def adopt_defaults(self, thread_id: str, defaults: Mapping[str, Any]) -> None:
        """``thread_id`` was loaded again (a new process) with what Codex restored from its
        rollout, which may be an earlier turn's effort, approval policy or sandbox: its
        defaults are ``defaults`` (recorded at its first load), and its next turn without its
        own values sends them explicitly. Only for an app-server that cannot tell its
        configured defaults (see the module header): otherwise the load took them itself."""
        loaded = self._loaded.get(thread_id)
        if loaded is not None:
            self._loaded[thread_id] = attrs.evolve(
                loaded, defaults=dict(defaults), overridden=frozenset(STICKY_TURN_FIELDS)
            )

    async def _configured_defaults(
        self,
        cwd: str | None,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Mapping[str, Any] | None:
        """Codex's configured sticky defaults for ``cwd`` (``config/read``, once per
        app-server process and cwd), or ``None`` when this app-server refuses to tell."""
        if cwd in self._configured:
            return self._configured[cwd]
        params: dict[str, Any] = {} if cwd is None else {"cwd": cwd}
        try:
            raw = await self._connection.request("config/read", params, timeout=timeout)
            config = raw.get("config") if isinstance(raw, Mapping) else None
            if not isinstance(config, Mapping):
                raise TypeError("config/read answered without a config object")
        except (AppServerRpcError, TypeError) as exc:
            log.warning(
                "appserver.config_read_failed",
                error=capped(str(exc)),
                note="turn defaults fall back to what each thread load reports",
            )
            self._configured[cwd] = None
            return None
        defaults = configured_defaults(config)
        self._configured[cwd] = defaults
        return defaults

    def knows_configured_defaults(self, cwd: str | None) -> bool:
        """Whether this app-server told its configured turn defaults for ``cwd``
        (``config/read``): thread loads for that cwd take their defaults from there."""
        return self._configured.get(cwd) is not None

    def forget_thread(self, thread_id: str) -> None:
        """Drop this client's local state for ``thread_id``: its tool registry (and whatever
        the tools' closures keep alive) and its loaded mark.

        The thread is *not* unloaded in Codex. Call it once the thread will not run another
        turn here (e.g. when the engine rotated to a fresh thread): a later tool call for it
        would be answered as an unknown tool, and a later compaction would resume it first.
        Idempotent; unknown ids are ignored."""
        self.tools.pop(thread_id, None)
        self._loaded.pop(thread_id, None)
        self._collaborating.discard(thread_id)

    async def start_thread(
        self,
        settings: ThreadSettings = DEFAULT_SETTINGS,
        *,
        config: Mapping[str, Any] | None = None,
        ephemeral: bool | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """Start a thread with ``settings``. The runtime policy is sent only when set; the
        result reports the effective values."""
        registry = settings.tools
        configured = await self._configured_defaults(settings.cwd, timeout)
        wire = settings.wire("thread/start")
        extra = unstructure(ThreadStartParams(config=config, ephemeral=ephemeral))
        if "config" in wire and "config" in extra:  # the settings' overrides, then the caller's
            extra["config"] = {**wire["config"], **extra["config"]}
        params = {**wire, **extra}
        raw = await self._connection.request("thread/start", params, timeout=timeout)
        result = structure(raw, ThreadResult)
        if registry is not None:
            self.register_tools(result.thread_id, registry)
        defaults, overridden = _thread_defaults(
            configured, loaded_defaults(raw), sent=_sent_sticky(settings)
        )
        self._loaded[result.thread_id] = LoadedThread(
            result, settings.key, defaults=defaults, overridden=overridden
        )
        log.info(
            "appserver.thread_started",
            thread_id=capped(result.thread_id),
            tools=len(registry or ()),
        )
        return result

    async def resume_thread(
        self,
        thread_id: str,
        settings: ThreadSettings,
        *,
        exclude_turns: bool = True,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """Resume (load) a thread. ``settings`` are required on purpose (their developer
        instructions above all): Codex keeps only what is re-sent here across a later
        compaction. Their ``tools`` are bound locally only: Codex froze the thread's tool set
        at thread/start.

        The runtime policy is sent only when given. Codex 0.163 applies it when the resume
        loads the thread; a thread this process has loaded already keeps its current policy
        (the result reports the effective values either way). A resume that loads the thread
        without it does not restore all of it: the sandbox comes from the process's config
        and the service tier is dropped (approval policy and reviewer survive), so re-send
        it.

        Raises :class:`~.errors.ThreadNotFound` when Codex says the thread does not exist;
        a timeout, a closed process or any other refusal keeps its own error type."""
        params = {
            **unstructure(ThreadResumeParams(thread_id=thread_id, exclude_turns=exclude_turns)),
            **settings.wire("thread/resume"),
        }
        configured = await self._configured_defaults(settings.cwd, timeout)  # cached per cwd
        try:
            raw = await self._connection.request("thread/resume", params, timeout=timeout)
        except AppServerRpcError as exc:
            not_found = ThreadNotFound.match(exc, thread_id)
            if not_found is None:
                raise
            log.info("appserver.thread_not_found", thread_id=capped(thread_id))
            raise not_found from exc
        result = structure(raw, ThreadResult)
        if settings.tools is not None:
            self.register_tools(result.thread_id, settings.tools)
        # A thread already loaded keeps what it holds (Codex ignores the resume's settings);
        # one loaded now holds what its rollout restored, compared with the configuration.
        held = self._loaded.get(result.thread_id)
        if held is not None:
            defaults, overridden = dict(held.defaults), held.overridden
        else:
            defaults, overridden = _thread_defaults(
                configured, loaded_defaults(raw), sent=_sent_sticky(settings)
            )
        self._loaded[result.thread_id] = LoadedThread(
            result, settings.key, defaults=defaults, overridden=overridden
        )
        log.info("appserver.thread_resumed", thread_id=capped(result.thread_id))
        return result

    async def fork_thread(
        self,
        thread_id: str,
        settings: ThreadSettings,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """An *ephemeral* fork of ``thread_id`` (``thread/fork {ephemeral, excludeTurns}``):
        a loaded, idle thread with the parent's model-visible history and dynamic tool specs,
        its ``prompt_cache_key`` (Codex keys an ephemeral fork's cache by the parent), and
        nothing on disk. Of ``settings``, the fork sends what
        :data:`~.thread_settings.SENT` says; their ``tools`` are bound locally to the fork
        (their handlers).

        The parent need not be loaded here; it must have a rollout (a thread with neither a
        turn nor an injection has none: Codex answers "no rollout found"). Codex keeps an
        ephemeral fork loaded until the process ends (it cannot be deleted or unloaded);
        :meth:`forget_thread` drops this process's state for it.

        The fork's model-visible history begins with the *parent's* initial context (its
        developer instructions and environment, written into the parent's rollout): the
        developer instructions sent here do not replace them (send changing instructions
        as a developer item, :func:`codex_turn.harness.turn.structured.developer_item`)."""
        params = {
            **unstructure(ThreadForkParams(thread_id=thread_id)),
            **settings.wire("thread/fork"),
        }
        configured = await self._configured_defaults(settings.cwd, timeout)
        raw = await self._connection.request("thread/fork", params, timeout=timeout)
        result = structure(raw, ThreadResult)
        if settings.tools is not None:
            self.register_tools(result.thread_id, settings.tools)
        defaults, overridden = _thread_defaults(configured, loaded_defaults(raw), sent=frozenset())
        self._loaded[result.thread_id] = LoadedThread(
            result, _FORK_SETTINGS, defaults=defaults, overridden=overridden
        )
        log.info(
            "appserver.thread_forked",
            thread_id=capped(result.thread_id),
            parent=capped(thread_id),
        )
        return result

    async def inject_items(
        self,
        thread_id: str,
        items: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> None:
        """``thread/inject_items``: append raw Responses items to an *idle* thread's
        model-visible history (into a running turn they would force an extra model call), in
        batches of :data:`INJECT_BATCH` (each atomic: Codex refuses a batch with one invalid
        item whole). The thread must be loaded in this process: Codex's answer for one that is
        not is raised as :class:`~.errors.ThreadNotFound`."""
        for start in range(0, len(items), INJECT_BATCH):
            batch = [dict(item) for item in items[start : start + INJECT_BATCH]]
            try:
                await self._connection.request(
                    "thread/inject_items", {"threadId": thread_id, "items": batch}, timeout=timeout
                )
            except AppServerRpcError as exc:
                # About the thread, not the items: it is not loaded here (for an ephemeral
                # fork, gone). Codex 0.163: -32600 "thread not found: <id>".
                if exc.message.startswith(_NOT_LOADED):
                    raise ThreadNotFound(
                        exc.code or 0, exc.message, method=exc.method, thread_id=thread_id
                    ) from exc
                raise


def _native_size(params: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``thread/tokenUsage/updated``'s size of the thread: its last call's total tokens and
    the context window (``None`` for what it does not say)."""
    last, window = token_usage_parts(params)
    tokens = last.get("totalTokens") if last is not None else None
    counted = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    return (tokens if counted else None), (window if window is not None and window >= 0 else None)
