"""Durable turns, the engine's side: ``commit_turn`` and the records it takes and returns.

An engine that declares :class:`~.contract.TranscriptSemantics` in its ``info`` (OpenClaw's
``info.transcriptSemantics``, 2026.8.1) promises two things and implements one method:

* *the current-turn fence* (``before-current-turn-entry-v1``): what it is asked to assemble
  is history *before* the current turn's entry, never the current prompt (the host cuts it;
  the prompt goes to the model once, as the prompt);
* *atomic, idempotent advancement* (``atomic-idempotent-v1``): ``commit_turn`` applies one
  logical turn atomically and at most once per :attr:`CommitTurnParams.advancement_key`; a
  second commit of a key answers ``duplicate``, which the host takes as success.

The host then settles every turn with ``commit_turn`` (from its durable outbox, after the
run, and again after a crash: :mod:`codex_turn.harness.durable_turns`) and never calls
``after_turn``, ``ingest_batch`` or ``ingest`` for it. An engine without the declaration keeps
those, unchanged. Names map OpenClaw's camelCase (``advancementKey``, ``sessionTarget``,
``isHeartbeat`` ...) through the one converter of :mod:`.shapes`; OpenClaw's
``runtimeSettings`` are our records' ``token_budget``, as in ``after_turn``.

A declaration is checked before any turn (:func:`durable_turn_problems`, part of
``check_engine``): a declaration without a callable ``commit_turn``, or a semantics string
this host does not know, refuses the engine at load with
:class:`~.contract.EngineContractError` / :class:`~.contract.EngineLoadError`.
"""

from __future__ import annotations

from typing import Final, Literal, Protocol

import attrs

from .contract import (
    KNOWN_CURRENT_TURN_FENCES,
    KNOWN_TURN_ADVANCEMENT_IDEMPOTENCY,
    AgentMessage,
    ContextEngineInfo,
    RuntimeContext,
    TranscriptSemantics,
)

__all__ = [
    "COMMIT_TURN_METHOD",
    "CommitStatus",
    "CommitTurnParams",
    "CommitTurnResult",
    "SessionTarget",
    "SupportsCommitTurn",
    "TerminalStatus",
    "TurnAdmission",
    "TurnTerminal",
    "declares_durable_turns",
    "durable_turn_problems",
]

COMMIT_TURN_METHOD: Final = "commit_turn"

#: How the turn ended (OpenClaw's terminal kinds).
TerminalStatus = Literal["completed", "interrupted", "failed", "timed_out"]
#: ``duplicate``: the key was committed before; nothing changed, and that is success.
CommitStatus = Literal["committed", "duplicate"]


@attrs.frozen
class TurnAdmission:
    """What the host admitted for the turn: its prompt entry, as the transcript holds it."""

    message: AgentMessage
    #: The prompt entry's transcript key (its ``idempotencyKey``), when it has one.
    entry_key: str | None = None


@attrs.frozen
class TurnTerminal:
    """How the turn ended, and the messages it left after its admission (replies, tool
    calls and results, steered messages), in transcript order."""

    status: TerminalStatus
    messages: list[AgentMessage]
    #: Codex's error for a failed or timed-out turn (redacted), else ``None``.
    error: str | None = None


@attrs.frozen
class SessionTarget:
    """Which session the turn advances."""

    session_id: str
    session_file: str
    session_key: str | None = None


@attrs.frozen
class CommitTurnParams:
    #: The logical turn's stable key: every retry, and the recovery after a crash, reuse it.
    advancement_key: str
    admission: TurnAdmission
    terminal: TurnTerminal
    #: The session through this turn: history, the admission, then the terminal's messages.
    messages: list[AgentMessage]
    #: ``messages[:pre_prompt_message_count]`` existed before the turn; the admission is next.
    pre_prompt_message_count: int
    session_target: SessionTarget
    runtime_context: RuntimeContext | None = None
    token_budget: int | None = None
    is_heartbeat: bool = False


@attrs.frozen
class CommitTurnResult:
    status: CommitStatus


class SupportsCommitTurn(Protocol):
    async def commit_turn(self, params: CommitTurnParams) -> CommitTurnResult: ...


def declares_durable_turns(info: ContextEngineInfo) -> bool:
    """Whether the engine asked to be settled with ``commit_turn`` (it declared semantics)."""
    return info.transcript_semantics is not None


def durable_turn_problems(engine: object, info: ContextEngineInfo) -> list[str]:
    """What is wrong with an engine's durable-turn declaration (empty when nothing, or when
    it declares none): semantics this host does not know, or no callable ``commit_turn``."""
    semantics = info.transcript_semantics
    if semantics is None:
        return []
    if not isinstance(semantics, TranscriptSemantics):  # an info built by hand, unchecked
        return [  # type: ignore[unreachable]
            f"info.transcript_semantics must be a TranscriptSemantics (got {semantics!r})"
        ]
    problems: list[str] = []
    for name, value, known in (
        ("current_turn_fence", semantics.current_turn_fence, KNOWN_CURRENT_TURN_FENCES),
        (
            "turn_advancement_idempotency",
            semantics.turn_advancement_idempotency,
            KNOWN_TURN_ADVANCEMENT_IDEMPOTENCY,
        ),
    ):
        if value not in known:
            problems.append(
                f"transcript semantics {name}={value!r} is unknown to this host "
                f"(it knows {', '.join(repr(k) for k in sorted(known))})"
            )
    try:
        method = getattr(engine, COMMIT_TURN_METHOD, None)
    except Exception as err:  # a property that raises
        return [*problems, f"reading commit_turn raised {type(err).__name__}"]
    if not callable(method):
        problems.append(
            "it declares transcript semantics but has no callable commit_turn "
            "(an engine that declares them is settled only through commit_turn)"
        )
    return problems
