"""Native hooks: per-thread Codex hook config relayed to typed host callbacks.

Theory. Codex runs *command* hooks (PreToolUse, PostToolUse, PermissionRequest, Stop) and
reads their answer from stdout. The host does not write a ``hooks.json`` anywhere: it serves
a relay (:func:`serve_hook_relay`: a Unix socket in a private directory, one line in, one
line out per call) and injects, per thread, a hook config whose command is the relay's
client (:mod:`.hook_relay_client`, run as a file with the standard library alone) through
``thread/start``'s (or ``thread/resume``'s) ``config`` (Codex's "session flags" layer:
:meth:`HookRelay.thread_config`). Codex runs a hook only when its definition is trusted, so
the config carries the trust hash of each hook it declares (:func:`trusted_hash`: Codex's
own normalisation, pinned against ``hooks/list`` in the tests).

Which events a thread gets and what a call answers are the tables of
:mod:`codex_turn.fsm.hooks` (:data:`~codex_turn.fsm.hooks.INJECT_RULES`,
:data:`~codex_turn.fsm.hooks.ANSWER_RULES`): PermissionRequest is left out while app-server
approvals are on unless :attr:`NativeHooks.permission_request` asks for it; only an explicit
:class:`HookVerdict` decides (no decision is never an allow); a callback that fails or
outlives :attr:`NativeHooks.timeout` blocks a PreToolUse and decides nothing otherwise. An
allow-always of a PermissionRequest is remembered by the call's exact fingerprint (session,
tool, input, cwd: :meth:`HookCall.fingerprint`) for :attr:`NativeHooks.allow_always_window`
seconds: any change asks again. In report mode (:attr:`NativeHooks.report_mode`) a PreToolUse
the host wants approved gets no native decision; it is recorded
(:meth:`HookRelay.deferred_approval`) for the app-server approval Codex then sends for the
same tool use.

Codex reports each hook run as ``hook/started`` / ``hook/completed`` notifications; a turn's
event stream carries them as :class:`~codex_turn.harness.turn.streaming.HookRun` events.

Callbacks run in the relay's task group (cancelled when the relay closes), each bounded by
the timeout. Nothing of a call's content (tool input, output, messages) is logged: the
event, the answer, its reason and the duration.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import attrs

from codex_turn._log import get_logger
from codex_turn.fsm.hooks import (
    ANSWER_RULES,
    INJECT_RULES,
    AnswerFacts,
    HookAnswer,
    HookEvent,
    InjectFacts,
    Injection,
)
from codex_turn.fsm.thread import decide

from . import hook_relay_client
from .logsafe import capped

__all__ = [
    "HookCall",
    "HookCallback",
    "HookEvent",
    "HookRelay",
    "HookVerdict",
    "NativeHooks",
    "Verdict",
    "hook_config",
    "serve_hook_relay",
    "trusted_hash",
]

log = get_logger(__name__)

#: Codex's name for the layer ``thread/start``'s ``config`` becomes (the trust key's prefix).
SESSION_FLAGS_SOURCE: Final = "/<session-flags>/config.toml"
#: Codex's snake_case label of each event (its trust hash and key use it).
_LABELS: Final = {
    HookEvent.PRE_TOOL_USE: "pre_tool_use",
    HookEvent.POST_TOOL_USE: "post_tool_use",
    HookEvent.PERMISSION_REQUEST: "permission_request",
    HookEvent.STOP: "stop",
}
_MAX_LINE: Final = hook_relay_client.MAX_BYTES
_DEFAULT_REASON: Final = "blocked by the host"


class Verdict(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    #: The host wants its approval asked (report mode defers it to Codex's app-server approval).
    ASK = "ask"


@attrs.frozen
class HookVerdict:
    """A callback's explicit answer. ``reason``: shown to the model (a blocked tool, a denied
    permission, why a Stop is refused); ``always``: an allow of a PermissionRequest that
    holds for the same fingerprint within the window."""

    verdict: Verdict
    reason: str | None = None
    always: bool = False

    @classmethod
    def allow(cls, *, always: bool = False) -> HookVerdict:
        return cls(Verdict.ALLOW, always=always)

    @classmethod
    def deny(cls, reason: str) -> HookVerdict:
        return cls(Verdict.DENY, reason=reason)

    @classmethod
    def ask(cls) -> HookVerdict:
        return cls(Verdict.ASK)


@attrs.frozen(kw_only=True)
class HookCall:
    """One hook call, typed from Codex's payload (content for the host, never logged)."""

    event: HookEvent
    session_id: str
    turn_id: str | None = None
    cwd: str | None = None
    tool_name: str | None = None
    tool_input: Any = None
    tool_use_id: str | None = None
    tool_response: Any = None
    last_assistant_message: str | None = None

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> HookCall:
        def text(key: str) -> str | None:
            value = payload.get(key)
            return value if isinstance(value, str) else None

        return cls(
            event=HookEvent(payload["hook_event_name"]),
            session_id=text("session_id") or "",
            turn_id=text("turn_id"),
            cwd=text("cwd"),
            tool_name=text("tool_name"),
            tool_input=payload.get("tool_input"),
            tool_use_id=text("tool_use_id"),
            tool_response=payload.get("tool_response"),
            last_assistant_message=text("last_assistant_message"),
        )

    def fingerprint(self) -> str:
        """The exact identity an allow-always holds for: session, tool, input and cwd."""
        identity = [self.session_id, self.tool_name, self.tool_input, self.cwd]
        text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=repr)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


#: The longest a hook callback may be given (Codex's own bound on the hook is derived from it).
MAX_HOOK_TIMEOUT: Final = 3600.0
#: Report-mode requirements kept for an approval that may never come (the oldest dropped).
MAX_DEFERRED: Final = 1024

#: ``await callback(call)``: a :class:`HookVerdict`, or ``None`` for no decision.
HookCallback = Callable[[HookCall], Awaitable[HookVerdict | None]]


@attrs.frozen(kw_only=True)
class NativeHooks:
    """The host's hook callbacks and the relay's policy (see the module header)."""

    callbacks: Mapping[HookEvent, HookCallback]
    #: Seconds a callback may take (finite: at most an hour).
    timeout: float = attrs.field(
        default=30.0, validator=[attrs.validators.gt(0), attrs.validators.le(MAX_HOOK_TIMEOUT)]
    )
    #: Inject PermissionRequest even while app-server approvals are on.
    permission_request: bool = False
    report_mode: bool = False
    allow_always_window: float = attrs.field(default=600.0, validator=attrs.validators.ge(0))

    def events(self, approval_policy: object) -> tuple[HookEvent, ...]:
        """The events a thread with ``approval_policy`` gets (:data:`INJECT_RULES`);
        ``None`` (Codex's configured default, unknown here) counts as approvals on."""
        approvals_on = approval_policy != "never"
        return tuple(
            event
            for event in HookEvent
            if event in self.callbacks
            and decide(
                INJECT_RULES,
                InjectFacts(
                    event,
                    approvals_on=approvals_on,
                    listed=event is HookEvent.PERMISSION_REQUEST and self.permission_request,
                ),
            ).action
            is Injection.INJECT
        )


def _handler(command: str, timeout_sec: int) -> dict[str, Any]:
    return {"type": "command", "command": command, "timeout": timeout_sec, "async": False}


def trusted_hash(event: HookEvent, handler: Mapping[str, Any]) -> str:
    """Codex's trust hash of a one-handler, no-matcher hook: SHA-256 of the compact JSON,
    keys sorted, of ``{event_name: <snake label>, hooks: [handler]}`` (its normalised
    identity, with ``None`` fields dropped as TOML drops them)."""
    identity = {"event_name": _LABELS[event], "hooks": [dict(handler)]}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def hook_config(events: Iterable[HookEvent], command: str, timeout_sec: int) -> dict[str, Any]:
    """The ``config`` of a thread whose ``events`` run ``command``, each hook trusted."""
    hooks: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for event in events:
        handler = _handler(command, timeout_sec)
        hooks[event.value] = [{"hooks": [handler]}]
        key = f"{SESSION_FLAGS_SOURCE}:{_LABELS[event]}:0:0"
        state[key] = {"trusted_hash": trusted_hash(event, handler)}
    if not hooks:
        return {}
    return {"hooks": {**hooks, "state": state}}


def wire_answer(answer: HookAnswer, event: HookEvent, reason: str | None) -> dict[str, Any]:
    """What the hook prints for ``answer`` (Codex's hook output)."""
    if answer is HookAnswer.BLOCK_TOOL:
        return {
            "hookSpecificOutput": {
                "hookEventName": event.value,
                "permissionDecision": "deny",
                "permissionDecisionReason": reason or _DEFAULT_REASON,
            }
        }
    if answer in (HookAnswer.ALLOW, HookAnswer.DENY):
        decision: dict[str, Any] = {"behavior": answer.value}
        if answer is HookAnswer.DENY:
            decision["message"] = reason or _DEFAULT_REASON
        return {"hookSpecificOutput": {"hookEventName": event.value, "decision": decision}}
    if answer is HookAnswer.CONTINUE_TURN:
        return {"decision": "block", "reason": reason or "the host asks to continue"}
    return {}


class HookRelay:
    """The host side of the relay (create with :func:`serve_hook_relay`)."""

    def __init__(self, hooks: NativeHooks, socket_path: str) -> None:
        self.hooks = hooks
        self.socket_path = socket_path
        #: Codex's own bound on a hook run (the relay answers within ``hooks.timeout``).
        self.timeout_sec = math.ceil(hooks.timeout) + 5
        self.command = " ".join(
            shlex.quote(part)
            for part in (
                sys.executable,
                "-I",
                hook_relay_client.__file__,
                socket_path,
                str(hooks.timeout + 2),
            )
        )
        self._allowed: dict[str, float] = {}  # fingerprint -> when the allow-always ends
        self._deferred: dict[str, HookCall] = {}  # tool use id -> a report-mode requirement

    def thread_config(self, approval_policy: object = None) -> dict[str, Any]:
        """The ``config`` to start or resume a thread with ``approval_policy`` under."""
        return hook_config(self.hooks.events(approval_policy), self.command, self.timeout_sec)

    def deferred_approval(self, tool_use_id: str) -> HookCall | None:
        """The report-mode requirement recorded for ``tool_use_id`` (taken: once)."""
        return self._deferred.pop(tool_use_id, None)

    def _remembered(self, call: HookCall) -> bool:
        now = time.monotonic()
        self._allowed = {key: end for key, end in self._allowed.items() if end > now}
        return call.fingerprint() in self._allowed

    async def answer(self, call: HookCall) -> dict[str, Any]:
        """Ask the host's callback about ``call`` and choose the answer (:data:`ANSWER_RULES`)."""
        started = time.monotonic()
        callback = self.hooks.callbacks.get(call.event)
        remembered = call.event is HookEvent.PERMISSION_REQUEST and self._remembered(call)
        verdict: HookVerdict | None = None
        failed = False
        if callback is not None and not remembered:
            try:
                with anyio.fail_after(self.hooks.timeout):
                    verdict = await callback(call)
            except Exception as exc:  # a broken or late callback decides nothing
                failed = True
                log.warning(
                    "hooks.callback_failed",
                    hook_event=call.event.value,
                    error=capped(type(exc).__name__),
                )
        facts = AnswerFacts(
            call.event,
            allowed=verdict is not None and verdict.verdict is Verdict.ALLOW,
            denied=verdict is not None and verdict.verdict is Verdict.DENY,
            needs_approval=verdict is not None and verdict.verdict is Verdict.ASK,
            failed=failed,
            remembered=remembered,
            report_mode=self.hooks.report_mode,
            traceable=call.tool_use_id is not None,
        )
        choice = decide(ANSWER_RULES, facts)
        if choice.action is HookAnswer.ALLOW and verdict is not None and verdict.always:
            window = self.hooks.allow_always_window
            self._allowed[call.fingerprint()] = time.monotonic() + window
        if choice.action is HookAnswer.DEFER and call.tool_use_id is not None:
            self._deferred[call.tool_use_id] = call
            while len(self._deferred) > MAX_DEFERRED:  # never matched: the oldest go first
                del self._deferred[next(iter(self._deferred))]
        log.info(
            "hooks.answered",
            hook_event=call.event.value,
            answer=choice.action.value,
            reason=choice.reason,
            ms=round((time.monotonic() - started) * 1000, 1),
        )
        reason = verdict.reason if verdict is not None else None
        if choice.reason == "callback-failed":
            reason = "the host's hook callback failed"
        return wire_answer(choice.action, call.event, reason)

    async def _serve(self, stream: anyio.abc.ByteStream) -> None:
        """One connection: one call in, one answer out. Whatever goes wrong stays inside
        (the listener serves the next call; the client prints its safe answer)."""
        try:
            await self._serve_one(stream)
        except Exception as exc:
            log.warning("hooks.connection_failed", error=capped(type(exc).__name__))

    async def _serve_one(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            data = b""
            try:
                with anyio.fail_after(self.hooks.timeout + 1):
                    while not data.endswith(b"\n") and len(data) <= _MAX_LINE:
                        data += await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError):
                pass
            try:
                payload = json.loads(data)
                call = HookCall.from_payload(payload)
            except (ValueError, KeyError, TypeError):
                log.warning("hooks.unreadable_call", size=len(data))
                return  # the client prints its safe answer
            out = await self.answer(call)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(json.dumps(out).encode("utf-8") + b"\n")


@contextlib.asynccontextmanager
async def serve_hook_relay(
    hooks: NativeHooks, *, directory: str | os.PathLike[str] | None = None
) -> AsyncIterator[HookRelay]:
    """Serve ``hooks`` on a Unix socket in a new owner-only directory (under ``directory``,
    default the system's temp dir; a socket path must stay short) until the block ends; the
    callbacks still running are cancelled then."""
    with tempfile.TemporaryDirectory(prefix="ctk-hooks-", dir=directory) as scratch:
        os.chmod(scratch, 0o700)
        path = str(Path(scratch) / "relay.sock")
        relay = HookRelay(hooks, path)
        listener = await anyio.create_unix_listener(path)
        async with listener, anyio.create_task_group() as group:
            group.start_soon(listener.serve, relay._serve)
            try:
                yield relay
            finally:
                group.cancel_scope.cancel()
