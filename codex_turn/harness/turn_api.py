"""The public records of a turn: what a runner passes in (:class:`TurnParams`) and gets back
(:class:`TurnResult`, :class:`MaintenanceReport`). No behaviour here; see
:mod:`codex_turn.harness.turn.orchestrator` for the turn itself.

Every field of :class:`TurnParams` is checked when the params are built, so that a value no
stage can use is refused at once with :class:`InvalidTurnParams` instead of failing a stage
(or every later turn) with another error: text fields are strings Codex can take (no lone
surrogate, :mod:`codex_turn._text`), paths are ones the OS can take (no NUL), integers fit the
64-bit integers of SQLite and Codex, an output schema is JSON nested at most
:data:`~codex_turn._json.MAX_JSON_DEPTH` levels. :func:`input_text_problem` is the one check
of a turn's input text, shared with the messages steered into a running turn.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, NoReturn, get_args

import attrs

from codex_turn._json import MAX_JSON_DEPTH, nested_deeper_than
from codex_turn._text import has_lone_surrogate, is_os_string
from codex_turn.errors import CodexTurnError
from codex_turn.fsm import TraceEntry, TurnOutcome
from codex_turn.fsm.thread import ThreadDecision
from codex_turn.harness.appserver.native_hooks import HookRelay
from codex_turn.harness.appserver.types import ApprovalsReviewer, SandboxMode
from codex_turn.harness.collaboration import CollaborationInstructions, HeartbeatResponse
from codex_turn.harness.engine import AgentMessage
from codex_turn.harness.usage import Usage

__all__ = [
    "TURN_START_TEXT_MAX_CHARS",
    "InvalidTurnParams",
    "MaintenanceReport",
    "TurnFile",
    "TurnParams",
    "TurnResult",
    "input_text_problem",
]

#: Codex refuses larger turn/start text; older context is cut first (OpenClaw's bound).
TURN_START_TEXT_MAX_CHARS: Final = 1 << 20

#: The largest token count a param may give: SQLite's and Codex's integers are 64-bit.
_INT64_MAX: Final = 2**63 - 1


def _collaboration(value: Any) -> Any:
    # A mapping of its fields (as a queued turn stores it) is the record; anything else is
    # left to the validation.
    if isinstance(value, Mapping):
        fields = dict(value)
        tools = fields.get("memory_tools")
        if isinstance(tools, list):
            fields["memory_tools"] = tuple(tools)
        try:
            return CollaborationInstructions(**fields)
        except TypeError:
            return value
    return value


def _images(value: Any) -> Any:
    # A string stays a string, so the validation refuses it instead of iterating characters;
    # so does anything that is not iterable.
    if isinstance(value, str) or value is None:
        return value
    try:
        return tuple(value)
    except TypeError:
        return value


class InvalidTurnParams(CodexTurnError, ValueError, TypeError):
    """A :class:`TurnParams` field has a wrong type or value (raised when the params are built,
    before anything is read, written or sent), or a message steered into a running turn could
    not be a prompt (raised by :func:`~codex_turn.steer_codex_turn` before anything is sent).
    A ``ValueError`` and a ``TypeError`` too."""


#: The steering modes (:class:`~codex_turn.fsm.steering.SteerMode`).
_STEERING_MODES: Final = ("steer", "queue", "reject", "followup", "collect")

#: The text fields: each a string Codex can take (the optional ones may also be ``None``).
_TEXT_FIELDS: Final = ("session_id", "prompt")
_OPTIONAL_TEXT_FIELDS: Final = (
    "session_key",
    "sandbox_session_key",
    "model",
    "citations_mode",
    "base_developer_instructions",
    "extra_developer_instructions",
    "auth_profile_id",
    "service_tier",
    "reasoning_effort",
)

# The runtime policy values Codex's schema accepts (checked when the params are built).
_POLICY_VALUES: Final[dict[str, frozenset[str]]] = {
    "approval_policy": frozenset({"untrusted", "on-request", "never"}),
    "sandbox": frozenset(get_args(SandboxMode)),
    "approvals_reviewer": frozenset(get_args(ApprovalsReviewer)),
}


@attrs.frozen(kw_only=True)
class TurnParams:
    """Everything one turn needs from the runner. Only the first four are required."""

    session_id: str
    session_file: str | os.PathLike[str]
    workspace_dir: str | os.PathLike[str]
    prompt: str
    #: The run's session key: engines are bound to it (OpenClaw test A6).
    session_key: str | None = None
    #: The sandbox's session key when it differs: reaches the engine only as a runtime-context
    #: fact (``sandboxSessionKey``), never as the session key its calls are bound to.
    sandbox_session_key: str | None = None
    #: Image inputs as URLs (``data:<mime>;base64,...`` included). Any iterable is taken once
    #: (a generator is not consumed by the validation); a single string is refused.
    images: tuple[str, ...] = attrs.field(default=(), converter=_images)
    model: str | None = None
    context_token_budget: int | None = None
    reserve_tokens: int | None = None
    citations_mode: str | None = None
    #: The host's base developer instructions (OpenClaw's preamble, skills, overlays ...).
    base_developer_instructions: str | None = None
    extra_developer_instructions: str | None = None
    auth_profile_id: str | None = None
    #: This turn's approval policy and sandbox, sent on its ``turn/start`` (so they take
    #: effect on a thread Codex already holds). ``None``: Codex's configured default, also
    #: after an earlier turn of the thread stated another value, and after an app-server
    #: restart (see :mod:`codex_turn.harness.runtime_controls`).
    approval_policy: Literal["untrusted", "on-request", "never"] | None = None
    sandbox: SandboxMode | None = None
    #: Thread settings, sent on thread/start and thread/resume. ``None``: not sent.
    approvals_reviewer: ApprovalsReviewer | None = None
    service_tier: str | None = None
    #: Per-turn settings, sent on ``turn/start`` when stated. The reasoning effort is a value
    #: the model advertises (``"low"``, ``"medium"``, ``"high"`` ...); ``None``: the configured
    #: default (Codex reports it only when one is configured, ``model_reasoning_effort``;
    #: without one an earlier turn's effort stays on the thread until a turn states one). The
    #: output schema, a JSON Schema object constraining this turn's final assistant message
    #: (this turn only).
    reasoning_effort: str | None = None
    output_schema: Mapping[str, Any] | None = None
    #: Bounds on the host's ``TurnHooks.on_approval`` / ``on_user_input`` callbacks: a request
    #: not answered in time is declined / gets no answers, and the turn continues. The turn's
    #: idle timer does not run while one is pending (``turn_timeout`` still bounds the turn).
    approval_timeout: float = 60.0
    user_input_timeout: float = 60.0
    #: Bound on each observation callback (``TurnHooks.after_tool_call``, ``llm_input``,
    #: ``llm_output``): one still running then is cancelled (and logged).
    observer_timeout: float = 2.0
    #: Host facts for the engine's runtime context, OpenClaw's camelCase keys.
    runtime_attempt: Mapping[str, Any] = attrs.field(factory=dict)
    turn_timeout: float = 600.0
    idle_timeout: float = 120.0
    #: Bound on the shielded mirror + finalize after a cancellation or crash.
    cleanup_timeout: float = 30.0
    #: Bound on each engine lifecycle call (bootstrap, assemble, finalize, maintain); a call
    #: that takes longer takes its stage's failure edge. ``None``: unbounded.
    engine_timeout: float | None = 300.0
    concurrency: Literal["wait", "reject"] = "wait"
    session_wait_timeout: float = 30.0
    #: Offer the ``sessions_yield`` tool: the model may end the run early (yield-aborted).
    yield_tool: bool = False
    #: What a message for this session that arrives while this turn runs becomes
    #: (:func:`~codex_turn.harness.turn.steering.steer_codex_turn`): ``"steer"``, delivered to the
    #: running Codex turn (one ``turn/steer`` per batch; a batch closes once
    #: ``steer_quiet_interval`` seconds pass without a new message); ``"queue"`` or
    #: ``"followup"``, each run as its own next turn; ``"collect"``, gathered into one next
    #: turn (``TurnResult.collected``); ``"reject"``, refused.
    steering: Literal["steer", "queue", "reject", "followup", "collect"] = "steer"
    steer_quiet_interval: float = 0.25
    #: The share of the model's context window a bound thread's native history may fill
    #: (Codex's last reported usage of it, in this process) before a turn rotates it to a
    #: fresh thread that carries the conversation from the transcript (bounded by the cap).
    #: Codex compacts a thread on its own well before that; this is the backstop for one it
    #: did not (a rollout written for a larger window, a compaction that failed). ``None``:
    #: never. Threads of a ``thread_bootstrap`` engine are kept (OpenClaw).
    native_history_share: float | None = 0.95
    #: Raise the engine's first contract violation (an assembly of ``None``, a malformed
    #: result, an exception escaping an engine method ...) as
    #: :class:`~codex_turn.harness.engine.EngineContractViolation` once the turn ended on its
    #: usual fallback path (prompt and reply mirrored, engine finalized, ``on_turn_end``
    #: called). Operational faults (a timeout, an ``OSError``, a database down) keep the
    #: fallback. See :mod:`codex_turn.harness.violations`. The CLI's ``--strict`` and the test
    #: kit turn it on.
    strict: bool = False
    #: How an engine's per-turn context reaches Codex: ``"structured"`` (the default) as
    #: Responses items injected into an ephemeral fork of the session's base thread, when the
    #: app-server can (else, and for an assembly that does not convert, the text frame);
    #: ``"text"``, always the text frame (one user message). See
    #: :mod:`codex_turn.harness.turn.structured` and ``FORM_RULES`` in :mod:`codex_turn.fsm.thread`.
    projection_format: Literal["structured", "text"] = "structured"
    #: Tool calls and results in the structured form: ``"full"`` (the default: what the model
    #: saw, as the engine assembled it), ``"shape-only"`` (arguments as their shape, results
    #: elided), ``"elide"`` (names kept, payloads replaced by a note). Secrets are redacted in
    #: every policy; Codex itself cuts a long tool result to ~12 KB in the prompt.
    tool_payloads: Literal["elide", "shape-only", "full"] = "full"
    #: A lightweight run (a cron job, say): Codex loads no project docs (AGENTS.md and
    #: friends) for this turn. A thread reads them when it starts, so the turn runs on a
    #: transient thread of its own, started without them; the session's thread stays bound,
    #: and the transcript carries the conversation to the transient thread.
    lightweight: bool = False
    #: Turn-scoped collaboration-mode developer instructions (a skills catalog, MEMORY.md
    #: pointers, or the plain-text memory when no memory tool is available); the next turn
    #: without them runs in Codex's default mode again. See :mod:`codex_turn.harness.collaboration`.
    collaboration: CollaborationInstructions | None = attrs.field(
        default=None, converter=_collaboration
    )
    #: A heartbeat turn (a scheduled wake): the ``heartbeat_respond`` tool is offered and its
    #: answer comes back in ``TurnResult.heartbeat``; the heartbeat guidance goes as the
    #: turn's collaboration-mode instructions; engines see ``is_heartbeat``. It runs on a
    #: transient thread of its own (its tool set differs from the session's thread).
    heartbeat: bool = False
    #: The heartbeat checklist (HEARTBEAT.md): named by its path when non-empty, never inlined.
    heartbeat_file: str | os.PathLike[str] | None = None
    #: How the turn's dynamic tools are declared to Codex: ``"flat"`` (each visible to the
    #: model), or ``"namespaced"``: in the searchable namespace ``openclaw`` (found through
    #: Codex's ``tool_search``; needs a model that supports it), those marked
    #: ``DynamicTool(direct=True)`` in ``openclaw_direct``, always visible. See
    #: :mod:`codex_turn.harness.appserver.tools`. A thread keeps the catalog it started with.
    tool_catalog: Literal["flat", "namespaced"] = "flat"
    #: Native Codex hooks relayed to the host's callbacks
    #: (:func:`~codex_turn.harness.appserver.native_hooks.serve_hook_relay`): the thread is
    #: started and resumed with the relay's per-thread hook config for this turn's approval
    #: policy. ``None``: no hooks of the host's.
    native_hooks: HookRelay | None = None

    def __attrs_post_init__(self) -> None:
        _validate(self)


def _fail(message: str) -> NoReturn:
    raise InvalidTurnParams(f"TurnParams.{message}")


_SURROGATE: Final = "contains an unpaired UTF-16 surrogate (invalid Unicode text)"


def input_text_problem(text: object, *, may_be_empty: bool = False) -> str | None:
    """Why ``text`` cannot be a turn's input text (a prompt, a steered message), as the end of
    a sentence naming it, or ``None`` when it can: not a string, empty (unless
    ``may_be_empty``), longer than Codex accepts, or holding a lone surrogate (Codex rejects
    such text on stderr only and never answers: the turn would hang)."""
    if not isinstance(text, str):
        return f"must be a string (got {type(text).__name__})"
    if not may_be_empty and not text.strip():
        return "must not be empty"
    if len(text) > TURN_START_TEXT_MAX_CHARS:
        return f"is {len(text)} characters; Codex accepts {TURN_START_TEXT_MAX_CHARS}"
    if has_lone_surrogate(text):
        return _SURROGATE
    return None


def _validate(p: TurnParams) -> None:
    """Every field checked once, here: a clear typed error instead of a raw AttributeError
    deep in a stage, or a value accepted silently and misread later."""
    for name in (*_TEXT_FIELDS, *_OPTIONAL_TEXT_FIELDS):
        value = getattr(p, name)
        if value is None and name in _OPTIONAL_TEXT_FIELDS:
            continue
        if not isinstance(value, str):
            optional = name in _OPTIONAL_TEXT_FIELDS
            _fail(f"{name} must be a string" + (" or None" if optional else ""))
        if has_lone_surrogate(value):
            _fail(f"{name} {_SURROGATE}")
    if not p.session_id.strip():
        _fail("session_id must not be blank")
    images: Any = p.images  # typed as a tuple, but callers pass what they pass
    if not isinstance(images, tuple) or not all(isinstance(i, str) and i for i in images):
        _fail("images must be a sequence of image URLs (not a single string)")
    if any(has_lone_surrogate(image) for image in images):
        _fail(f"images: an image URL {_SURROGATE}")
    if not p.prompt.strip() and not images:
        _fail("prompt must not be empty (a turn needs text or images)")
    if (problem := input_text_problem(p.prompt, may_be_empty=True)) is not None:
        _fail(f"prompt {problem}")
    for name in ("session_file", "workspace_dir"):
        value = getattr(p, name)
        if not isinstance(value, str | os.PathLike) or not is_os_string(value):
            _fail(f"{name} must be a path the OS can open (a string or path, without NUL)")
    if not os.fspath(p.session_file):
        _fail("session_file must be a non-empty path")
    for name in ("context_token_budget", "reserve_tokens"):
        value = getattr(p, name)
        if value is not None and (type(value) is not int or not 0 <= value <= _INT64_MAX):
            _fail(f"{name} must be an int from 0 to 2**63 - 1, or None")
    if not isinstance(p.runtime_attempt, Mapping):
        _fail("runtime_attempt must be a mapping of camelCase host facts")
    if p.concurrency not in ("wait", "reject"):
        _fail("concurrency must be 'wait' or 'reject'")
    if p.native_hooks is not None and not isinstance(p.native_hooks, HookRelay):
        _fail("native_hooks must be a HookRelay (serve_hook_relay) or None")
    hooks = p.native_hooks
    if hooks is not None and hooks.hooks.report_mode and p.approval_policy == "never":
        # No app-server approval would ever be asked for: report mode would decide nothing.
        _fail("report-mode native hooks need app-server approvals (approval_policy 'never')")
    for name in ("yield_tool", "strict", "lightweight", "heartbeat"):
        if not isinstance(getattr(p, name), bool):
            _fail(f"{name} must be a bool")
    timeouts = ("turn_timeout", "idle_timeout", "cleanup_timeout", "session_wait_timeout")
    for name in (*timeouts, "engine_timeout"):
        value = getattr(p, name)
        if value is None and name == "engine_timeout":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            _fail(
                f"{name} must be a positive number"
                + (" (or None)" if name == "engine_timeout" else "")
            )
    for name, allowed in _POLICY_VALUES.items():
        value = getattr(p, name)
        if value is not None and (not isinstance(value, str) or value not in allowed):
            _fail(f"{name} must be one of {sorted(allowed)}")
    _validate_runtime_controls(p)
    if p.projection_format not in ("structured", "text"):
        _fail("projection_format must be 'structured' or 'text'")
    if p.tool_payloads not in ("elide", "shape-only", "full"):
        _fail("tool_payloads must be 'elide', 'shape-only' or 'full'")
    if p.steering not in _STEERING_MODES:
        _fail(f"steering must be one of {list(_STEERING_MODES)}")
    _validate_collaboration(p)
    if p.tool_catalog not in ("flat", "namespaced"):
        _fail("tool_catalog must be 'flat' or 'namespaced'")
    quiet = p.steer_quiet_interval
    if isinstance(quiet, bool) or not isinstance(quiet, int | float) or not 0 <= quiet <= 60:
        _fail("steer_quiet_interval must be a number of seconds from 0 to 60")


def _validate_collaboration(p: TurnParams) -> None:
    """The collaboration instructions and the heartbeat file (collaboration.py)."""
    given: Any = p.collaboration
    if given is not None:
        if not isinstance(given, CollaborationInstructions):
            _fail("collaboration must be a CollaborationInstructions or None")
        for name in ("skills_catalog", "memory_pointers", "memory_context"):
            value = getattr(given, name)
            if value is not None and (not isinstance(value, str) or has_lone_surrogate(value)):
                _fail(f"collaboration.{name} must be a string (valid Unicode) or None")
        tools: Any = given.memory_tools
        if not isinstance(tools, tuple) or not all(isinstance(t, str) for t in tools):
            _fail("collaboration.memory_tools must be a tuple of tool names")
    path: Any = p.heartbeat_file
    if path is not None:
        if not isinstance(path, str | os.PathLike) or not is_os_string(path) or not os.fspath(path):
            _fail("heartbeat_file must be a path the OS can open (a string or path), or None")
        if not p.heartbeat:
            _fail("heartbeat_file is for a heartbeat turn (heartbeat=True)")


def _validate_runtime_controls(p: TurnParams) -> None:
    """The per-turn settings and the host-callback bounds (runtime_controls.py)."""
    effort = p.reasoning_effort  # a string or None (a text field)
    if effort is not None and not effort.strip():
        _fail("reasoning_effort must be a non-blank string (e.g. 'low', 'high') or None")
    if effort is not None and effort != effort.strip():
        _fail("reasoning_effort must not have surrounding whitespace")
    schema = p.output_schema
    if schema is not None:
        if not isinstance(schema, Mapping):
            _fail("output_schema must be a JSON Schema object (a mapping) or None")
        if nested_deeper_than(dict(schema)):
            _fail(f"output_schema must nest at most {MAX_JSON_DEPTH} levels")
        try:
            # As the request carries it: JSON, and UTF-8 (a lone surrogate has no encoding).
            json.dumps(schema, allow_nan=False, ensure_ascii=False).encode()
        except (TypeError, ValueError) as error:
            _fail(f"output_schema must be JSON-serialisable text ({type(error).__name__})")
    share = p.native_history_share
    if share is not None and (
        isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1
    ):
        _fail("native_history_share must be a number in (0, 1], or None")
    for name in ("approval_timeout", "user_input_timeout", "observer_timeout"):
        value = getattr(p, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            _fail(f"{name} must be a positive number")


@attrs.frozen(kw_only=True)
class MaintenanceReport:
    """What happened to turn maintenance: ``ran``, ``failed``, ``deferred``, ``skipped`` (with
    the reason) or ``cancelled`` (the caller left before it ran)."""

    status: Literal["ran", "failed", "deferred", "skipped", "cancelled"]
    skip_reason: str | None = None


@attrs.frozen(kw_only=True)
class TurnFile:
    """A file Codex saved to disk during the turn (today: a generated image)."""

    path: str
    #: What the file is: ``"generated_image"`` (an ``imageGeneration`` item's ``savedPath``).
    kind: str
    #: The Codex item that produced it.
    item_id: str
    #: Guessed from the file name (``image/png`` ...); ``None`` when unknown.
    mime_type: str | None = None
    #: The prompt the image model actually used, when Codex reported one.
    revised_prompt: str | None = None


@attrs.frozen(kw_only=True)
class TurnResult:
    """What one turn did: its outcome, Codex's reply and usage, the thread it ran on, what
    happened to maintenance, and the machine's trace."""

    outcome: TurnOutcome
    assistant_text: str | None
    prompt_error: str | None
    usage: Usage | None
    thread_id: str | None
    turn_id: str | None
    messages_snapshot: list[AgentMessage]
    maintenance: MaintenanceReport
    thread_decision: ThreadDecision | None
    projected: bool
    native_compactions: int
    trace: tuple[TraceEntry, ...]
    #: Why this turn could not be written to the transcript (outcome ``unsaved`` when Codex
    #: completed it); ``None`` when it was written or never ran.
    mirror_error: str | None = None
    #: Files Codex saved during the turn (generated images), even without assistant text.
    files: tuple[TurnFile, ...] = ()
    #: Messages steered into this turn while it ran, in arrival order (mirrored after the
    #: prompt; this turn's reply answers them too).
    steered: tuple[str, ...] = ()
    #: A heartbeat turn's answer, as the model recorded it with ``heartbeat_respond`` (stay
    #: silent, or notify with text); ``None``: not a heartbeat, or the model recorded none.
    heartbeat: HeartbeatResponse | None = None
    #: Messages collected while this turn ran (steering mode ``collect``), in arrival order:
    #: run them as one next turn.
    collected: tuple[str, ...] = ()

    @property
    def durations_ms(self) -> dict[str, float]:
        """Time spent in each state, from the FSM trace (internal transitions included)."""
        return state_durations_ms(self.trace)


def state_durations_ms(trace: Sequence[TraceEntry]) -> dict[str, float]:
    """Milliseconds spent in each state of ``trace`` (internal transitions included)."""
    spent: dict[str, float] = {}
    for entry, following in itertools.pairwise(trace):
        spent[entry.dest] = (
            spent.get(entry.dest, 0.0) + (following.monotonic_ns - entry.monotonic_ns) / 1e6
        )
    return spent
