"""Transcript continuity: what of the conversation a turn's thread lacks, read from the transcript.

Theory. A transcript and a Codex thread hold two copies of one conversation, and only the
transcript is sure to survive: a second process with its own Codex home, a worker on another
machine, a restored backup or a deleted rollout leaves the binding naming a thread Codex does
not hold, and a rotation, a transient turn or an overflow retry starts a thread that holds
nothing. Such a *fresh* thread gets the conversation from the transcript (bounded by the cap,
newest kept) unless an engine's assembly stands for it; which one is the continuity table's
(:data:`codex_turn.fsm.thread.CONTINUITY_RULES`), what the thread lacks is this module's.

A *resumed* thread lacks what was appended to the transcript by anything but itself since it
was bound: turns that ran elsewhere (another worker, a transient thread), messages a host
appended. The binding records how far the thread's native history covers the transcript
(:class:`~codex_turn.harness.binding.HistoryCoverage`: a message count and the digest of the
last covered message), and everything after that point which the thread did not answer
itself (its mirror's idempotency keys name it) is *uncovered*: it is projected into the
turn, and once Codex accepted that turn the coverage moves to the end of the transcript.
So nothing is ever both in native history and in the projection (the snowball bound), and
nothing the transcript holds is left out.

A coverage the transcript contradicts (fewer messages than it counts, or another message at
its end: the host compacted or rewrote the transcript) cannot say what the thread lacks: it
is *lost*, and the thread table rotates to a fresh thread that carries the transcript.

This turn's own prompt is recognised by its idempotency key, never by its text (hosts
decorate prompts, and a user may say the same thing twice): a prompt made durable by an
earlier attempt of this very turn is the turn's input, not context.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from codex_turn.harness.binding import HistoryCoverage, ThreadBinding
from codex_turn.harness.engine import AgentMessage

__all__ = [
    "ADVANCE_AFTER",
    "Coverage",
    "coverage_of",
    "covered_through",
    "message_digest",
    "without_prompt",
]

#: The mirror's scope: ``codex-app-server:<threadId>:<identity>``.
_THREAD_SCOPE: Final = "codex-app-server:"
#: A resumed thread's coverage is moved forward (one binding write) once this many messages
#: follow it, all its own: the scan each turn makes stays short on a long session.
ADVANCE_AFTER: Final = 512


def message_digest(message: AgentMessage) -> str:
    """A stable digest of ``message``: its JSON with sorted keys (what it says, not how a
    writer spaced it)."""
    text = json.dumps(
        message, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def covered_through(messages: Sequence[AgentMessage]) -> HistoryCoverage:
    """The coverage of a thread that holds all of ``messages``."""
    last = message_digest(messages[-1]) if messages else None
    return HistoryCoverage(messages=len(messages), last_digest=last)


def _key(message: AgentMessage) -> str | None:
    key = message.get("idempotencyKey") if isinstance(message, Mapping) else None
    return key if isinstance(key, str) else None


def _thread_of(key: str | None) -> str | None:
    """The thread a mirrored message came from (its key's scope), else ``None``."""
    if key is None or not key.startswith(_THREAD_SCOPE):
        return None
    return key[len(_THREAD_SCOPE) :].partition(":")[0] or None


@attrs.frozen
class Coverage:
    """What the bound thread lacks of the transcript."""

    #: The binding's record contradicts the transcript: what the thread lacks is unknown.
    lost: bool = False
    #: The messages the thread lacks, oldest first (this turn's own prompt excluded).
    uncovered: tuple[AgentMessage, ...] = ()
    #: The coverage moves to the end of the transcript once Codex accepted this turn: it
    #: projects what was uncovered, the binding has no record yet, or the thread's own
    #: messages after the record grew long (:data:`ADVANCE_AFTER`).
    advance: bool = False

    @property
    def stale(self) -> bool:
        return bool(self.uncovered)


def coverage_of(
    messages: Sequence[AgentMessage], binding: ThreadBinding | None, *, prompt_key: str | None
) -> Coverage:
    """What the thread ``binding`` names lacks of ``messages`` (the stripped history read for
    this turn); ``prompt_key``: this turn's prompt key when a prompt with it may already be
    in the transcript (an earlier attempt of this turn made it durable)."""
    if binding is None:
        return Coverage()
    record = binding.history_covered_through
    if record is None:
        # A binding from before the record existed covered everything, as it always did.
        return Coverage(advance=True)
    count = record.messages
    if count > len(messages) or (
        count > 0 and message_digest(messages[count - 1]) != record.last_digest
    ):
        return Coverage(lost=True)
    thread = binding.thread_id
    uncovered: list[AgentMessage] = []
    # Newest first: a prompt we mirrored belongs to the thread of the first mirrored message
    # after it (its reply), whatever its own key says: a prompt made durable on one thread and
    # answered on another (an overflow's retry) went to the one that answered.
    answered_by: str | None = None
    for message in reversed(messages[count:]):
        key = _key(message)
        source = _thread_of(key)
        answered, answered_by = answered_by, source or answered_by
        if key is not None and key == prompt_key:
            continue  # this turn's input, never its context
        prompt = key is not None and message.get("role") == "user"
        if not (source == thread or (prompt and answered == thread)):
            uncovered.append(message)
    uncovered.reverse()
    advance = bool(uncovered) or len(messages) - count > ADVANCE_AFTER
    return Coverage(uncovered=tuple(uncovered), advance=advance)


def without_prompt(messages: Sequence[AgentMessage], prompt_key: str | None) -> list[AgentMessage]:
    """``messages`` without this turn's own prompt (by its key)."""
    if prompt_key is None:
        return list(messages)
    return [m for m in messages if _key(m) != prompt_key]
