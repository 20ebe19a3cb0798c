"""The runtime context an engine receives, and the hidden runtime-context messages it never sees.

One builder for the whole harness: :func:`harness_runtime_context` is what a turn's and a
compaction's engine calls receive (so the two can never disagree); :func:`build_runtime_context`
and :func:`build_runtime_context_from_usage` are OpenClaw's ``buildAfterTurnRuntimeContext``
for other runners. Absent is not zero: ``tokenBudget``, ``currentTokenCount`` and
``promptCache`` are present only when known. :func:`strip_runtime_context_messages` drops
OpenClaw's hidden ``openclaw.runtime-context`` custom messages from a history.

The stripped histories the harness hands around are lists of two kinds, so that a long
history is walked only where it must be: :class:`RuntimeContextFree` (known stripped: not
scanned again; an engine gets its own such copy) and :class:`FrozenHistory` (the harness's
own, shared and read-only: never copied per reader).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from codex_turn.frozen import FrozenList
from codex_turn.harness.engine.contract import AgentMessage, RuntimeContext
from codex_turn.harness.usage import Usage

if TYPE_CHECKING:
    from codex_turn.harness.engine.host import HostLlm, PromptCacheObservation

__all__ = [
    "PROMPT_CACHE_RETENTION",
    "PROMPT_CACHE_TTL_S",
    "RUNTIME_CONTEXT_CUSTOM_TYPE",
    "FrozenHistory",
    "RuntimeContextFree",
    "build_runtime_context",
    "build_runtime_context_from_usage",
    "harness_runtime_context",
    "prompt_cache_observation",
    "strip_runtime_context_messages",
]

#: The custom message type OpenClaw uses for hidden runtime context; never shown to engines.
RUNTIME_CONTEXT_CUSTOM_TYPE: Final = "openclaw.runtime-context"
#: How long Codex's model path keeps a prompt cache, as the runtime context says it
#: (``promptCache.retention``): OpenAI's in-memory prompt cache, minutes after the last use.
PROMPT_CACHE_RETENTION: Final = "short"
PROMPT_CACHE_TTL_S: Final = 300
#: A call that read at least this share of its prompt from the cache observed a ``hit``.
_CACHE_HIT_SHARE: Final = 0.9


# --- Helpers --------------------------------------------------------------------------------


class RuntimeContextFree(list[AgentMessage]):
    """A list known to hold no hidden runtime-context messages (the result of a strip).

    Passing one back in skips the scan: a runner that strips the history once per read
    saves two passes over a long transcript per turn. Still copied on the way through,
    so an engine that mutates its input cannot reach the runner's list.
    """


class FrozenHistory(FrozenList, RuntimeContextFree):
    """The stripped history the harness keeps per session and shares, read-only.

    Every item is one of the harness's frozen messages, and the list refuses every change as
    any :class:`~codex_turn.frozen.FrozenList` does (``TypeError``; through its methods: C
    code calling ``list``'s own, such as ``heapq``, is not stopped): so a turn's stages can
    share it without a copy each (a copy of a long history is a pass over it). Engines never
    get it: what they are handed is their own :class:`RuntimeContextFree` copy
    (:func:`strip_runtime_context_messages`); ``copy.copy`` gives the same.
    """

    __slots__ = ()

    def __copy__(self) -> RuntimeContextFree:
        return RuntimeContextFree(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenHistory, (list(self),))


def strip_runtime_context_messages(messages: Iterable[AgentMessage]) -> RuntimeContextFree:
    """``messages`` without OpenClaw's hidden ``openclaw.runtime-context`` custom messages."""
    if isinstance(messages, RuntimeContextFree):  # the harness's own history among them
        return RuntimeContextFree(messages)
    # Test the exact type first (JSON messages are plain dicts): the abstract Mapping check
    # alone is ~3x slower per message, and this runs over the whole history.
    kept = [  # a list comprehension, then one C-level copy: faster than a generator
        m
        for m in messages
        if not (
            (type(m) is dict or isinstance(m, Mapping))
            and m.get("role") == "custom"
            and m.get("customType") == RUNTIME_CONTEXT_CUSTOM_TYPE
        )
    ]
    return RuntimeContextFree(kept)


# --- Runtime context ------------------------------------------------------------------------


def _positive_floor(value: float | None) -> int | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    floored = math.floor(value)
    return floored if floored > 0 else None


def build_runtime_context(
    *,
    attempt: Mapping[str, Any] | None = None,
    workspace_dir: str | None = None,
    agent_dir: str | None = None,
    token_budget: float | None = None,
    current_token_count: float | None = None,
    prompt_cache: Mapping[str, Any] | None = None,
) -> RuntimeContext:
    """The runtime context an engine receives (OpenClaw's ``buildAfterTurnRuntimeContext``).

    ``attempt`` holds the host's facts about the run, under OpenClaw's camelCase keys
    (``sessionKey``, ``provider``, ``model``, ``messageChannel`` ...); ``None`` values are
    dropped. ``tokenBudget`` and ``currentTokenCount`` are added only when finite and > 0
    (floored); ``promptCache`` only when given: absent is not the same as zero.
    """
    context: RuntimeContext = {k: v for k, v in (attempt or {}).items() if v is not None}
    if workspace_dir is not None:
        context["workspaceDir"] = workspace_dir
    if agent_dir is not None:
        context["agentDir"] = agent_dir
    if (budget := _positive_floor(token_budget)) is not None:
        context["tokenBudget"] = budget
    if (count := _positive_floor(current_token_count)) is not None:
        context["currentTokenCount"] = count
    if prompt_cache is not None:
        context["promptCache"] = dict(prompt_cache)
    return context


def build_runtime_context_from_usage(
    *,
    last_call_usage: Usage | Mapping[str, Any] | None,
    attempt: Mapping[str, Any] | None = None,
    workspace_dir: str | None = None,
    agent_dir: str | None = None,
    token_budget: float | None = None,
    prompt_cache: Mapping[str, Any] | None = None,
) -> RuntimeContext:
    """:func:`build_runtime_context` with ``currentTokenCount`` from the last call's usage.

    ``last_call_usage`` is a :class:`~codex_turn.harness.usage.Usage` or Codex's breakdown
    (``tokenUsage.last``). The count is the prompt size, cached tokens counted once; a zero
    count leaves ``currentTokenCount`` out.
    """
    usage = (
        last_call_usage
        if isinstance(last_call_usage, Usage) or last_call_usage is None
        else Usage.from_codex(last_call_usage)
    )
    return build_runtime_context(
        attempt=attempt,
        workspace_dir=workspace_dir,
        agent_dir=agent_dir,
        token_budget=token_budget,
        current_token_count=usage.prompt_tokens if usage is not None else None,
        prompt_cache=prompt_cache,
    )


def harness_runtime_context(
    *,
    session_key: str | None,
    model: str | None,
    auth_profile_id: str | None,
    workspace_dir: str | None,
    token_budget: float | None,
    sandbox_session_key: str | None = None,
    provider: str | None = None,
    agent_dir: str | None = None,
    usage: Usage | None = None,
    current_token_count: float | None = None,
    prompt_cache: Mapping[str, Any] | None = None,
    attempt: Mapping[str, Any] | None = None,
    cwd: str | None = None,
    llm: HostLlm | None = None,
) -> RuntimeContext:
    """The runtime context of this harness, for turns and compactions alike (one builder).

    The harness's own facts (``provider`` "codex" unless given, ``agentHarnessId``
    "codex-app-server", the session and sandbox keys, model, auth profile) come first and the
    host's ``attempt`` facts override them. ``usage`` (the last model call's) sets
    ``currentTokenCount`` and, unless ``prompt_cache`` is given, ``promptCache.lastCallUsage``
    from Codex's cached-input counts when Codex reported them, with ``retention``,
    ``observation`` (hit, partial, miss) and ``expiresAt`` (epoch ms; see
    :class:`~codex_turn.harness.engine.host.PromptCacheFacts`); otherwise ``promptCache`` is
    omitted, never zeroed. ``cwd`` is the turn's working directory; ``llm`` the model the host
    lends the engine (``runtime_context["llm"]``, see :mod:`codex_turn.harness.host_llm`).
    """
    facts: dict[str, Any] = {
        "sessionKey": session_key,
        "sandboxSessionKey": sandbox_session_key,
        "provider": provider or "codex",
        "model": model,
        "authProfileId": auth_profile_id,
        "agentHarnessId": "codex-app-server",
        **(attempt or {}),
    }
    if prompt_cache is None and usage is not None and usage.cache_reported:
        prompt_cache = {
            "lastCallUsage": {
                "input": usage.input,
                "output": usage.output,
                "cacheRead": usage.cache_read,
                "cacheWrite": usage.cache_write,
                "total": usage.total_tokens,
            },
            "retention": PROMPT_CACHE_RETENTION,
            "observation": prompt_cache_observation(usage),
            "expiresAt": int((time.time() + PROMPT_CACHE_TTL_S) * 1000),
        }
    context = build_runtime_context(
        attempt=facts,
        workspace_dir=workspace_dir,
        agent_dir=agent_dir,
        token_budget=token_budget,
        current_token_count=usage.prompt_tokens if usage is not None else current_token_count,
        prompt_cache=prompt_cache,
    )
    if cwd is not None:
        context.setdefault("cwd", cwd)
    if llm is not None:
        context["llm"] = llm
    return context


def prompt_cache_observation(usage: Usage) -> PromptCacheObservation:
    """What a call saw of the prompt cache: ``hit`` (nearly all its prompt cached),
    ``partial``, ``miss``, or ``unknown`` (Codex reported no cache counts)."""
    if not usage.cache_reported:
        return "unknown"
    prompt = usage.prompt_tokens or 0
    if usage.cache_read <= 0 or prompt <= 0:
        return "miss"
    return "hit" if usage.cache_read >= _CACHE_HIT_SHARE * prompt else "partial"
