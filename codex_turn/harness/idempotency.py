"""Exactly-once turns for a host's stable turn id (``run_codex_turn(..., idempotency_key=K)``).

A turn run with ``idempotency_key=K`` makes its prompt durable, before ``turn/start``, under
the thread-independent key ``codex-turn:turn-<K>:prompt``; its mirror then appends the reply
(keyed ``codex-app-server:<threadId>:<codexTurnId>:assistant``) after it. A re-run of the same
turn (a durable queue recovering it after a crash) must not ask Codex again once that reply is
in the transcript. :func:`completed_turn` is the one place that decides it, from the
transcript alone; :func:`~codex_turn.harness.turn.orchestrator.run_codex_turn` calls it *under the
session hold*, before any stage, so a re-run that overlaps the original attempt waits for it
and then sees its reply, and raises :class:`TurnAlreadyCompleted` carrying what was recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any, Final

import attrs

from codex_turn.errors import CodexTurnError
from codex_turn.harness.session import SessionError, read_session

__all__ = [
    "CompletedTurn",
    "TurnAlreadyCompleted",
    "advancement_key_for",
    "completed_turn",
    "message_turn_key",
    "stable_prompt_key",
]

#: The scope of a prompt keyed by the host's turn id: not the thread's, so the turn re-run on
#: another thread (another worker's Codex home, a dropped binding) finds the prompt it made
#: durable and appends it once (stages.py keys the prompt with it).
STABLE_PROMPT_SCOPE: Final = "codex-turn"
_CODEX_SCOPE: Final = "codex-app-server:"


def message_turn_key(runtime_attempt: Mapping[str, Any]) -> str | None:
    """The idempotency key of a turn that answers the host's message ``currentMessageId``
    (OpenClaw's runtime-attempt fact, scoped by ``currentChannelId`` and ``messageProvider``
    when given), else ``None``: a message delivered twice is one turn, and two messages with
    the same words are two. Hashed, so any id fits the key's alphabet."""
    message = runtime_attempt.get("currentMessageId")
    if not isinstance(message, str | int) or isinstance(message, bool) or message == "":
        return None
    scope = [runtime_attempt.get(k) for k in ("messageProvider", "currentChannelId")]
    text = json.dumps([*scope, message], default=str, ensure_ascii=False)
    return "msg-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def advancement_key_for(prompt_identity: str) -> str:
    """The advancement key of a turn (durable turns, ``commit_turn``) from its prompt's
    identity: the host's idempotency key for ``turn-<K>:prompt`` (stable across retries: the
    scale layer's turn id, the host's message key), else the run's own ``run-<hex>``."""
    identity = prompt_identity.removesuffix(":prompt")
    return identity.removeprefix("turn-") if identity.startswith("turn-") else identity


def stable_prompt_key(idempotency_key: str) -> str:
    """The transcript key of the prompt of the turn ``idempotency_key``."""
    return f"{STABLE_PROMPT_SCOPE}:turn-{idempotency_key}:prompt"


@attrs.frozen(kw_only=True)
class CompletedTurn:
    """A turn with a host's id whose reply is already in the transcript."""

    idempotency_key: str
    #: The recorded reply message (the final answer when there is one, else the last
    #: assistant message the turn left), as the transcript holds it.
    reply: Mapping[str, Any]
    #: The reply's text (its ``text`` parts joined), ``None`` when it has none.
    assistant_text: str | None
    #: The transcript keys of the prompt and of the reply.
    prompt_key: str
    reply_key: str | None
    #: The transcript entry id of the reply.
    reply_entry_id: str | None
    #: Codex's thread and turn that answered, read from the reply's key (``None`` if unknown).
    thread_id: str | None
    codex_turn_id: str | None


class TurnAlreadyCompleted(CodexTurnError):
    """The turn with this ``idempotency_key`` already completed: its reply is in the
    transcript (an earlier attempt ran it, e.g. before a crash). Raised under the session
    hold, before anything is sent to Codex or written; ``completed`` carries the recorded
    reply, so the caller returns it instead of running the turn again."""

    def __init__(self, completed: CompletedTurn) -> None:
        super().__init__(
            f"the turn with idempotency key {completed.idempotency_key!r} already completed"
        )
        self.completed = completed

    @property
    def assistant_text(self) -> str | None:
        return self.completed.assistant_text

    @property
    def thread_id(self) -> str | None:
        return self.completed.thread_id

    @property
    def codex_turn_id(self) -> str | None:
        return self.completed.codex_turn_id


def _text_of(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(
        part.get("text", "")
        for part in parts
        if isinstance(part, dict)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


def _codex_ids(key: str | None) -> tuple[str | None, str | None]:
    """``(threadId, codexTurnId)`` of a ``codex-app-server:<thread>:<turn>:<role>`` key."""
    if key is None or not key.startswith(_CODEX_SCOPE):
        return None, None
    parts = key[len(_CODEX_SCOPE) :].rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        return None, None
    return parts[0], parts[1]


def completed_turn(
    session_file: str | os.PathLike[str], idempotency_key: str
) -> CompletedTurn | None:
    """The reply an earlier run of the turn ``idempotency_key`` left in the transcript, or
    ``None`` (no such prompt, or a prompt with no reply after it: that run died mid-turn, and
    the turn runs again).

    The turn's prompt carries the key ``codex-turn:turn-<K>:prompt`` (an older, thread-scoped
    ``<scope>:turn-<K>:prompt`` is recognised too). Its reply is what follows it up to the
    next user message that is not one of the turn's own steered messages
    (``...:turn-<K>:steer-<n>``): the final answer (``...:assistant``) when there is one,
    else the last assistant message. Synchronous file I/O (call it from a worker thread);
    an unreadable transcript says ``None`` (the turn's preflight then says why).
    """
    if not os.path.exists(session_file):
        return None
    try:
        entries = read_session(session_file).entries
    except (SessionError, OSError):
        return None
    prompt_suffix = f":turn-{idempotency_key}:prompt"
    steer_marker = f":turn-{idempotency_key}:steer-"
    prompt_key: str | None = None
    final: tuple[Mapping[str, Any], str | None, str | None] | None = None
    last: tuple[Mapping[str, Any], str | None, str | None] | None = None
    for entry in entries:
        message = entry.get("message") if entry.get("type") == "message" else None
        if not isinstance(message, dict):
            continue
        raw_key = message.get("idempotencyKey")
        key = raw_key if isinstance(raw_key, str) else None
        if prompt_key is None:
            if key is not None and key.endswith(prompt_suffix):
                prompt_key = key
            continue
        role = message.get("role")
        if role == "user":
            if key is not None and steer_marker in key:
                continue  # the turn's own steered message: its reply comes after it
            break
        if role == "assistant":
            entry_id = entry.get("id")
            found = (message, key, entry_id if isinstance(entry_id, str) else None)
            last = found
            if key is not None and key.endswith(":assistant"):
                final = found
    chosen = final or last
    if prompt_key is None or chosen is None:
        return None
    reply, reply_key, entry_id = chosen
    thread_id, codex_turn_id = _codex_ids(reply_key)
    return CompletedTurn(
        idempotency_key=idempotency_key,
        reply=reply,
        assistant_text=_text_of(reply) or None,
        prompt_key=prompt_key,
        reply_key=reply_key,
        reply_entry_id=entry_id,
        thread_id=thread_id,
        codex_turn_id=codex_turn_id,
    )
