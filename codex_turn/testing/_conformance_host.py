"""The conformance suite's machinery: scripted conversations, a faithful host, and analysis.

Private to :mod:`codex_turn.testing.conformance`; its public API is there.

Theory of operation
-------------------

*Play the harness, not a caricature of it.* :class:`DrivenEngine.turn` makes the engine
calls of one turn in the order and with the params ``run_codex_turn`` uses: ``bootstrap``
(then maintenance) when the transcript existed before the turn, ``assemble`` over the mirrored
history (frozen, as the harness hands it: an engine that edits a message gets a ``TypeError``)
with the turn's prompt kept out of it, the mirror (the real :func:`mirror_turn`, so messages
carry the ``idempotencyKey`` a real transcript gives them), then finalize by the harness's
preference (``after_turn`` with the whole session and the pre-prompt count, else
``ingest_batch`` of the new messages, else ``ingest`` of each) and turn maintenance.
Background maintenance is awaited where the scheduler would have drained it. Every runtime
context carries ``cwd`` and the kit's model (:class:`KitLlm`: a fixed answer per request,
each request recorded and checked as the harness checks it), as a host that lends its model
does; the later hooks (reset, end, subagents, control) are called as
:mod:`codex_turn.harness.session_lifecycle` calls them. Every result is
checked with the harness's own boundary validation; an exception or an invalid result fails
the check with the method's name. The host is *strict*, as a turn with
``TurnParams(strict=True)``: the engine is checked as every turn checks it before it starts
(:func:`~codex_turn.harness.engine.check_engine`), and the first contract violation (a result
of the wrong shape, ``bootstrap`` returning ``None``, ``after_turn`` returning a value, an
exception escaping a method, an edit of a read-only message) fails the check at once; nothing
falls back. Stricter still: an operational fault (an ``OSError``) fails the check too, since
the suite's own environment has none.

*Conversations are scripted and deterministic.* :func:`conversation` builds the same turns for
the same name every time (texts from a hash, fixed timestamps): user prompts (string and
text-part contents), assistant replies, and tool turns with one or two parallel tool calls and
their results. Every message carries a marker ``[<name>:<turn>:<position>]``, so a message is
recognised in an assembly by content, whatever keys an engine drops or adds.

*Identity and analysis.* A raw message in an assembly is identified by its role and its
canonical content (a tool result by its ``toolCallId``); anything else is *derived* (a summary).
:func:`duplicates`, :func:`tool_pair_problems` and :func:`missing` answer the invariant
questions; :func:`~codex_turn._json.canonical_json` (sorted keys, fixed separators, no NaN) is
the byte identity that "identical output" means: an assembly holding NaN or an infinity has
none, and fails the check that got it.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import anyio
import anyio.to_thread
import attrs

from codex_turn._json import canonical_json
from codex_turn.frozen import freeze
from codex_turn.harness.engine.contract import (
    REQUIRED_METHODS,
    AbortSignal,
    AfterTurnParams,
    AgentMessage,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    MaintainParams,
    MaintenanceResult,
)
from codex_turn.harness.engine.durable import (
    CommitTurnParams,
    CommitTurnResult,
    SessionTarget,
    TurnAdmission,
    TurnTerminal,
    declares_durable_turns,
)
from codex_turn.harness.engine.host import (
    ControlRequest,
    ControlResult,
    LlmCompletion,
    LlmRequest,
    SessionEndParams,
    SessionResetParams,
    SessionResetResult,
    SubagentEndedParams,
    SubagentOutcome,
    SubagentSpawnParams,
    SubagentSpawnPreparation,
)
from codex_turn.harness.engine.shapes import to_json
from codex_turn.harness.engine.validation import (
    check_engine,
    coerce_result,
    engine_info,
    ensure_assemble_result,
    optional_method,
)
from codex_turn.harness.host_llm import check_request
from codex_turn.harness.runtime_context import build_runtime_context
from codex_turn.harness.session import load_session_messages, mirror_turn

__all__ = [
    "HUGE_BUDGET",
    "CheckFailed",
    "DrivenEngine",
    "EngineFactory",
    "Host",
    "KitLlm",
    "NotApplicable",
    "ScriptedTurn",
    "Session",
    "Storage",
    "concurrently",
    "conversation",
    "duplicates",
    "epoch_pattern",
    "first_difference",
    "is_prefix",
    "message_key",
    "missing",
    "replay_json",
    "result_json",
    "text_chars",
    "tool_pair_problems",
]

#: How an engine keeps what it ingests (declared by its author; verified by the suite).
Storage = Literal["none", "memory", "durable"]
#: Makes a new engine instance whose store lives at the given path (may return an awaitable).
EngineFactory = Callable[[Path], object]
FinalizePath = Literal["commit_turn", "after_turn", "ingest_batch", "ingest"]

#: A budget no scripted conversation comes near: nothing needs to be left out.
HUGE_BUDGET: Final = 1_000_000
_BASE_MS: Final = 1_700_000_000_000
_WORDS: Final = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
    "juniper", "kestrel", "lagoon", "meadow", "nickel", "onyx", "pebble", "quartz", "raven",
    "saffron", "tundra", "umber", "violet", "willow", "xenon", "yarrow", "zephyr", "anchor",
    "bramble", "cobalt", "dune", "estuary", "falcon", "glacier", "heron", "iris", "jasper",
    "kelp", "lichen", "marble", "nectar", "orchid", "prairie", "quill", "ridge", "sierra",
    "thistle", "upland", "vale", "wharf", "yonder", "zinc", "atlas", "beacon", "canyon",
    "drift", "ember-2", "flint", "grove", "hollow", "islet", "jetty", "knoll", "ledge", "mesa",
)  # fmt: skip

T = TypeVar("T")


class CheckFailed(Exception):
    """A conformance check found a violation; the message says which and where."""


class NotApplicable(Exception):
    """A check does not apply to this engine; the message says by which rule."""


# --- Canonical form and identity ------------------------------------------------------------


def result_json(result: AssembleResult) -> str:
    """An assembly as canonical camelCase JSON (messages, tokens, addition, projection)."""
    return canonical_json(to_json(result))


def replay_json(result: AssembleResult) -> str:
    """:func:`result_json` with the projection's epoch left out: what must match between two
    stores driven alike (an epoch may carry a store's own identity, e.g. a conversation id)."""
    projection = result.context_projection
    if projection is not None:
        result = attrs.evolve(result, context_projection=attrs.evolve(projection, epoch=None))
    return result_json(result)


def epoch_pattern(results: Sequence[AssembleResult]) -> list[int]:
    """Each result's epoch as the index of its first occurrence: where the epochs change."""
    first: dict[str | None, int] = {}
    return [
        first.setdefault(r.context_projection.epoch if r.context_projection else None, i)
        for i, r in enumerate(results)
    ]


def message_key(message: object) -> str:
    """How a raw message is recognised: ``toolResult:<id>``, else role + canonical content."""
    if not isinstance(message, dict):
        return f"?:{canonical_json(message)}"
    role = message.get("role")
    if role == "toolResult" and isinstance(message.get("toolCallId"), str):
        return f"toolResult:{message['toolCallId']}"
    return f"{role}:{canonical_json(message.get('content'))}"


def text_chars(messages: Iterable[object], addition: str | None = None) -> int:
    """Characters of text a model reads in an assembly, for plausibility: string contents,
    text parts, tool-call names and arguments, summaries, and the prompt addition."""

    def part(value: object) -> int:
        if isinstance(value, str):
            return len(value)
        if not isinstance(value, dict):
            return 0
        if isinstance(value.get("text"), str):
            return len(value["text"])
        if value.get("type") == "toolCall":
            return len(str(value.get("name", ""))) + len(canonical_json(value.get("arguments")))
        return 0

    total = len(addition or "")
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        parts = content if isinstance(content, list) else [content]
        total += sum(part(p) for p in parts)
        summary = message.get("summary")
        total += len(summary) if isinstance(summary, str) else 0
    return total


def _label(message: object) -> str:
    text = canonical_json(message)
    return text if len(text) <= 120 else text[:117] + "..."


def duplicates(messages: Sequence[object], source: Iterable[AgentMessage]) -> list[str]:
    """Source messages that appear more than once in ``messages``, described."""
    known = {message_key(m) for m in source}
    counts = Counter(k for k in map(message_key, messages) if k in known)
    return [f"{key[:100]} x{n}" for key, n in sorted(counts.items()) if n > 1]


def missing(messages: Sequence[object], expected: Iterable[AgentMessage]) -> list[str]:
    """Expected source messages absent from ``messages`` (as raw messages), described."""
    present = {message_key(m) for m in messages}
    return [_label(m) for m in expected if message_key(m) not in present]


def _tool_calls(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, list):
        return []
    return [
        block["id"]
        for block in content
        if isinstance(block, dict)
        and block.get("type") == "toolCall"
        and isinstance(block.get("id"), str)
    ]


def tool_pair_problems(messages: Sequence[object], source: Iterable[AgentMessage]) -> list[str]:
    """Broken tool-call/result pairs in an assembly, described (empty when intact).

    Intact means: every tool call has exactly one result after it, every result follows its
    call, and neither is invented (each id exists in the source conversation).
    """
    known: set[str] = set()
    for source_message in source:
        known.update(_tool_calls(source_message))
    problems: list[str] = []
    calls: dict[str, int] = {}
    results: dict[str, int] = {}
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for call_id in _tool_calls(message):
            if call_id not in known:
                problems.append(f"message {position}: tool call {call_id!r} is not in the source")
            if call_id in calls:
                problems.append(f"message {position}: tool call {call_id!r} appears twice")
            calls[call_id] = position
        if message.get("role") == "toolResult":
            result_id = message.get("toolCallId")
            if not isinstance(result_id, str) or result_id not in known:
                problems.append(f"message {position}: tool result {result_id!r} has no source call")
            elif result_id not in calls:
                problems.append(
                    f"message {position}: tool result {result_id!r} without its call before it"
                )
            elif result_id in results:
                problems.append(f"message {position}: tool result {result_id!r} appears twice")
            if isinstance(result_id, str):
                results[result_id] = position
    problems.extend(
        f"message {position}: tool call {call_id!r} without its result"
        for call_id, position in calls.items()
        if call_id not in results
    )
    return problems


def is_prefix(earlier: Sequence[object], later: Sequence[object]) -> bool:
    """``earlier`` is a prefix of ``later``, message by message, in canonical JSON."""
    return len(earlier) <= len(later) and all(
        canonical_json(a) == canonical_json(b) for a, b in zip(earlier, later, strict=False)
    )


def first_difference(a: AssembleResult, b: AssembleResult) -> str:
    """Where two assemblies first differ, described briefly."""
    for position, (x, y) in enumerate(zip(a.messages, b.messages, strict=False)):
        if canonical_json(x) != canonical_json(y):
            return f"message {position}: {_label(x)} != {_label(y)}"
    if len(a.messages) != len(b.messages):
        return f"{len(a.messages)} messages != {len(b.messages)} messages"
    for name in ("estimated_tokens", "system_prompt_addition", "context_projection"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            return f"{name}: {x!r} != {y!r}"
    return "no difference"


# --- Scripted conversations -----------------------------------------------------------------


@attrs.frozen
class ScriptedTurn:
    """One turn of a scripted conversation: the prompt first, then what the model did."""

    index: int
    messages: tuple[AgentMessage, ...]
    identities: tuple[str, ...]

    @property
    def prompt(self) -> str:
        content = self.messages[0]["content"]
        return content if isinstance(content, str) else str(content[0]["text"])


def _words(seed: str, count: int) -> str:
    words: list[str] = []
    counter = 0
    while len(words) < count:
        digest = hashlib.blake2b(f"{seed}#{counter}".encode(), digest_size=32).digest()
        words.extend(_WORDS[byte % len(_WORDS)] for byte in digest)
        counter += 1
    return " ".join(words[:count])


def _assistant(content: list[dict[str, Any]], stop: str, at: int) -> AgentMessage:
    return {
        "role": "assistant",
        "content": content,
        "api": "openai-responses",
        "provider": "offline",
        "model": "mock-model",
        "usage": {"input": 10, "output": 5, "cacheRead": 0, "cacheWrite": 0, "totalTokens": 15},
        "stopReason": stop,
        "timestamp": at,
    }


def conversation(
    name: str, turns: int, *, words: int = 14, large_turns: int = 0, large_words: int = 90
) -> tuple[ScriptedTurn, ...]:
    """``turns`` deterministic turns; the first ``large_turns`` use ``large_words`` per text.

    Every third turn uses tools: one call, or two parallel calls on odd turns, each answered
    by a ``toolResult`` (twice as long as a text), then a final reply.
    """
    scripted: list[ScriptedTurn] = []
    for t in range(turns):
        size = large_words if t < large_turns else words
        at = _BASE_MS + t * 60_000
        marker = f"[{name}:{t}:"
        prompt = f"{marker}0] {_words(f'{name}/{t}/user', size)}"
        user: AgentMessage = {
            "role": "user",
            "content": prompt if t % 2 == 0 else [{"type": "text", "text": prompt}],
            "timestamp": at,
        }
        messages: list[AgentMessage] = [user]
        identities = [f"t{t}:prompt"]
        if t % 3 == 1:
            call_ids = [f"call-{name}-{t}-{k}" for k in range(2 if t % 2 else 1)]
            blocks: list[dict[str, Any]] = [
                {"type": "text", "text": f"{marker}1] {_words(f'{name}/{t}/plan', size // 2)}"}
            ]
            blocks += [
                {
                    "type": "toolCall",
                    "id": call_id,
                    "name": "read",
                    "arguments": {"path": f"notes/{name}-{t}-{k}.md"},
                }
                for k, call_id in enumerate(call_ids)
            ]
            messages.append(_assistant(blocks, "toolUse", at + 1000))
            identities.append(f"t{t}:tool-calls")
            for k, call_id in enumerate(call_ids):
                text = f"{marker}{2 + k}] {_words(f'{name}/{t}/result{k}', size * 2)}"
                messages.append(
                    {
                        "role": "toolResult",
                        "toolCallId": call_id,
                        "toolName": "read",
                        "content": [{"type": "text", "text": text}],
                        "isError": False,
                        "timestamp": at + 2000 + k,
                    }
                )
                identities.append(f"t{t}:result-{k}")
        reply = f"{marker}{len(messages)}] {_words(f'{name}/{t}/reply', size)}"
        messages.append(_assistant([{"type": "text", "text": reply}], "stop", at + 5000))
        identities.append(f"t{t}:assistant")
        scripted.append(ScriptedTurn(t, tuple(messages), tuple(identities)))
    return tuple(scripted)


# --- The host -------------------------------------------------------------------------------


class Session:
    """One scripted session and its real pi transcript under ``root``."""

    def __init__(self, root: Path, name: str, turns: Sequence[ScriptedTurn]) -> None:
        self.root = root
        self.id = name
        self.key = f"agent:conformance:{name}"
        self.file = root / f"{name}.jsonl"
        self.turns = tuple(turns)
        self.mirrored = 0  # turns written to the transcript

    def source(self, upto: int | None = None) -> list[AgentMessage]:
        """The scripted messages of the first ``upto`` turns (all mirrored ones by default)."""
        count = self.mirrored if upto is None else upto
        return [m for turn in self.turns[:count] for m in turn.messages]

    def next_prompt(self) -> str | None:
        return self.turns[self.mirrored].prompt if self.mirrored < len(self.turns) else None

    async def history(self) -> list[AgentMessage]:
        """The mirrored history as the harness hands it: a fresh list of frozen messages."""
        if not self.file.exists():
            return []
        messages = await anyio.to_thread.run_sync(load_session_messages, self.file)
        return [freeze(m) for m in messages]

    async def mirror(self, turn: ScriptedTurn, *, prompt_only: bool = False) -> None:
        """Append ``turn`` to the transcript (idempotent, as the harness's mirror is).
        ``prompt_only``: its prompt alone, as the harness makes it durable before the model
        runs (a host that dies then leaves a turn in flight); it is not counted mirrored."""
        count = 1 if prompt_only else len(turn.messages)
        await anyio.to_thread.run_sync(
            lambda: mirror_turn(
                self.file,
                turn.messages[:count],
                scope=f"codex-app-server:conformance-{self.id}",
                identities=turn.identities[:count],
                session_id=self.id,
                cwd=os.fspath(self.root),
            )
        )
        if not prompt_only:
            self.mirrored = max(self.mirrored, turn.index + 1)


async def concurrently(*calls: Callable[[], Coroutine[Any, Any, object]]) -> None:
    """Run ``calls`` concurrently; a :class:`CheckFailed` in any comes out as itself."""
    try:
        async with anyio.create_task_group() as tasks:
            for call in calls:
                tasks.start_soon(call)
    except BaseExceptionGroup as group:
        failed = group.subgroup(lambda e: isinstance(e, CheckFailed))
        if failed is None:
            raise
        leaf: BaseException = failed
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from None


async def _checked(what: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except CheckFailed:
        raise
    except Exception as err:
        raise CheckFailed(f"{what} raised {type(err).__name__}: {err}") from err


def _validated(value: object, cls: type[T], *, engine: str, method: str) -> T:
    try:
        return coerce_result(value, cls, engine_id=engine, method=method)
    except Exception as err:
        raise CheckFailed(str(err)) from err


@attrs.define(eq=False)
class KitLlm:
    """The model the kit lends in every runtime context (``runtime_context["llm"]``): it
    answers each request with a short fixed text, deterministically, and records the
    requests (checked as the harness checks them; an invalid one is recorded as its
    problem)."""

    requests: list[LlmRequest] = attrs.Factory(list)
    problems: list[str] = attrs.Factory(list)

    async def complete(self, request: LlmRequest) -> LlmCompletion:
        try:
            checked = check_request(request)
        except Exception as err:
            self.problems.append(str(err))
            raise
        self.requests.append(checked)
        digest = hashlib.sha256(canonical_json(to_json(checked)).encode()).hexdigest()[:8]
        return LlmCompletion(text=f"kit answer {digest}", model="conformance-kit")


@attrs.define
class DrivenEngine:
    """One engine instance ("one process") and the harness's calls on it."""

    engine: Any
    info: ContextEngineInfo
    budget: int = HUGE_BUDGET
    llm: KitLlm = attrs.Factory(KitLlm)

    def has(self, method: str) -> bool:
        """Whether the engine has ``method`` (:func:`optional_method`, as the harness asks)."""
        return optional_method(self.engine, method) is not None

    @property
    def durable_turns(self) -> bool:
        """The engine declared transcript semantics: the harness settles it with commit_turn."""
        return declares_durable_turns(self.info)

    @property
    def finalize_path(self) -> FinalizePath:
        if self.durable_turns:
            return "commit_turn"
        if self.has("after_turn"):
            return "after_turn"
        return "ingest_batch" if self.has("ingest_batch") else "ingest"

    def _runtime(self, session: Session, budget: int) -> dict[str, Any]:
        context = build_runtime_context(workspace_dir=os.fspath(session.root), token_budget=budget)
        context["cwd"] = os.fspath(session.root)
        context["llm"] = self.llm
        return context

    # -- the later hooks (reset, end, subagents, control) ---------------------------------

    async def reset(self, session: Session) -> SessionResetResult:
        raw = await _checked(
            "before_session_reset()",
            self.engine.before_session_reset(
                SessionResetParams(
                    session_id=session.id,
                    session_key=session.key,
                    session_file=os.fspath(session.file),
                    reason="conformance",
                )
            ),
        )
        return _validated(
            raw, SessionResetResult, engine=self.info.id, method="before_session_reset"
        )

    async def end(self, session: Session) -> None:
        result = await _checked(
            "session_end()",
            self.engine.session_end(
                SessionEndParams(
                    session_id=session.id,
                    session_key=session.key,
                    session_file=os.fspath(session.file),
                    reason="conformance",
                )
            ),
        )
        if result is not None:
            raise CheckFailed(f"session_end() returned {type(result).__name__}, not None")

    def _spawn(self, parent: Session, child: Session, task: str) -> SubagentSpawnParams:
        return SubagentSpawnParams(
            parent_session_id=parent.id,
            parent_session_key=parent.key,
            parent_session_file=os.fspath(parent.file),
            child_session_id=child.id,
            child_session_key=child.key,
            child_session_file=os.fspath(child.file),
            task=task,
        )

    async def prepare_subagent(
        self, parent: Session, child: Session, task: str
    ) -> SubagentSpawnPreparation | None:
        raw = await _checked(
            "prepare_subagent_spawn()",
            self.engine.prepare_subagent_spawn(self._spawn(parent, child, task)),
        )
        if raw is None:
            return None
        return _validated(
            raw, SubagentSpawnPreparation, engine=self.info.id, method="prepare_subagent_spawn"
        )

    async def subagent_ended(
        self, parent: Session, child: Session, outcome: SubagentOutcome, text: str | None
    ) -> None:
        result = await _checked(
            "on_subagent_ended()",
            self.engine.on_subagent_ended(
                SubagentEndedParams(
                    parent_session_id=parent.id,
                    parent_session_key=parent.key,
                    child_session_id=child.id,
                    child_session_key=child.key,
                    outcome=outcome,
                    result_text=text,
                )
            ),
        )
        if result is not None:
            raise CheckFailed(f"on_subagent_ended() returned {type(result).__name__}, not None")

    async def control(self, request: ControlRequest) -> ControlResult:
        raw = await _checked(f"control({request.action})", self.engine.control(request))
        return _validated(raw, ControlResult, engine=self.info.id, method="control")

    async def bootstrap(self, session: Session) -> BootstrapResult | None:
        """``bootstrap`` (when present) then maintenance, as for a session that existed."""
        result: BootstrapResult | None = None
        if self.has("bootstrap"):
            raw = await _checked(
                "bootstrap()",
                self.engine.bootstrap(
                    BootstrapParams(
                        session_id=session.id,
                        session_file=os.fspath(session.file),
                        session_key=session.key,
                    )
                ),
            )
            result = _validated(raw, BootstrapResult, engine=self.info.id, method="bootstrap")
        await self.maintain(session)
        return result

    async def assemble(
        self,
        session: Session,
        *,
        budget: int | None = None,
        messages: list[AgentMessage] | None = None,
        prompt: str | None = None,
    ) -> AssembleResult:
        """``assemble`` over the mirrored history (or ``messages``), validated."""
        history = await session.history() if messages is None else messages
        params = AssembleParams(
            session_id=session.id,
            session_key=session.key,
            messages=history,
            token_budget=self.budget if budget is None else budget,
            available_tools=frozenset({"read"}),
            model="mock-model",
            prompt=session.next_prompt() if prompt is None else prompt,
        )
        raw = await _checked("assemble()", self.engine.assemble(params))
        try:
            result = ensure_assemble_result(raw, engine_id=self.info.id)
        except Exception as err:
            raise CheckFailed(str(err)) from err
        try:
            canonical_json(result.messages)
        except ValueError:
            raise CheckFailed("assemble() returned messages holding NaN or an infinity") from None
        return result

    async def finalize(
        self,
        session: Session,
        before: list[AgentMessage],
        after: list[AgentMessage],
        *,
        path: FinalizePath | None = None,
    ) -> FinalizePath:
        """Hand a finished turn over by the harness's preference (or by ``path``, one the
        engine has); returns the path used."""
        path = path or self.finalize_path
        new = after[len(before) :]
        if path == "commit_turn":
            await self.commit_turn(session, before, after)
        elif path == "after_turn":
            result = await _checked(
                "after_turn()",
                self.engine.after_turn(
                    AfterTurnParams(
                        session_id=session.id,
                        session_key=session.key,
                        session_file=os.fspath(session.file),
                        messages=list(after),
                        pre_prompt_message_count=len(before),
                        token_budget=self.budget,
                        runtime_context=self._runtime(session, self.budget),
                    )
                ),
            )
            if result is not None:
                raise CheckFailed(f"after_turn() returned {type(result).__name__}, not None")
        elif path == "ingest_batch":
            await self.ingest_batch(session, new)
        else:
            for message in new:
                await self.ingest(session, message)
        return path

    async def commit_turn(
        self,
        session: Session,
        before: list[AgentMessage],
        after: list[AgentMessage],
    ) -> CommitTurnResult:
        """``commit_turn`` of the turn at ``after[len(before):]`` (its prompt first), as the
        harness settles it; its key is the turn's place in the session (stable across
        retries, as the host's advancement key is)."""
        start = len(before)
        if start >= len(after):
            raise CheckFailed("no turn to commit (the harness never commits an empty one)")
        params = CommitTurnParams(
            advancement_key=f"conformance-{session.id}-{start}",
            admission=TurnAdmission(message=freeze(after[start])),
            terminal=TurnTerminal(
                status="completed", messages=[freeze(m) for m in after[start + 1 :]]
            ),
            messages=[freeze(m) for m in after],
            pre_prompt_message_count=start,
            session_target=SessionTarget(
                session_id=session.id, session_file=os.fspath(session.file), session_key=session.key
            ),
            runtime_context=self._runtime(session, self.budget),
            token_budget=self.budget,
        )
        raw = await _checked("commit_turn()", self.engine.commit_turn(params))
        return _validated(raw, CommitTurnResult, engine=self.info.id, method="commit_turn")

    async def ingest(self, session: Session, message: AgentMessage) -> IngestResult:
        raw = await _checked(
            "ingest()",
            self.engine.ingest(
                IngestParams(
                    session_id=session.id, session_key=session.key, message=freeze(message)
                )
            ),
        )
        return _validated(raw, IngestResult, engine=self.info.id, method="ingest")

    async def ingest_batch(
        self, session: Session, messages: list[AgentMessage]
    ) -> IngestBatchResult:
        raw = await _checked(
            "ingest_batch()",
            self.engine.ingest_batch(
                IngestBatchParams(
                    session_id=session.id,
                    session_key=session.key,
                    messages=[freeze(m) for m in messages],
                )
            ),
        )
        return _validated(raw, IngestBatchResult, engine=self.info.id, method="ingest_batch")

    async def maintain(self, session: Session) -> MaintenanceResult | None:
        if not self.has("maintain"):
            return None
        raw = await _checked(
            "maintain()",
            self.engine.maintain(
                MaintainParams(
                    session_id=session.id,
                    session_key=session.key,
                    session_file=os.fspath(session.file),
                    runtime_context=self._runtime(session, self.budget),
                )
            ),
        )
        if raw is None:
            return None
        return _validated(raw, MaintenanceResult, engine=self.info.id, method="maintain")

    async def compact(
        self,
        session: Session,
        *,
        budget: int,
        force: bool,
        current_token_count: int | None = None,
        abort_signal: AbortSignal | None = None,
        preflight_trigger: str | None = None,
    ) -> CompactResult:
        """``compact`` as the harness asks it: manual (forced, to threshold) or for budget."""
        raw = await _checked(
            "compact()",
            self.engine.compact(
                CompactParams(
                    session_id=session.id,
                    session_key=session.key,
                    session_file=os.fspath(session.file),
                    token_budget=budget,
                    force=force,
                    current_token_count=current_token_count,
                    compaction_target="threshold" if force else "budget",
                    runtime_context=self._runtime(session, budget),
                    force_reason="manual" if force else None,
                    preflight_trigger=preflight_trigger,
                    abort_signal=abort_signal,
                )
            ),
        )
        return _validated(raw, CompactResult, engine=self.info.id, method="compact")

    async def turn(self, session: Session, *, finalize: bool = True) -> AssembleResult:
        """The next scripted turn, as ``run_codex_turn`` makes it; returns its assembly.

        ``finalize=False`` stops after the mirror: a host that died before finalizing.
        """
        turn = session.turns[session.mirrored]
        if session.file.exists():
            await self.bootstrap(session)
        before = await session.history()
        assembled = await self.assemble(session, messages=before, prompt=turn.prompt)
        await session.mirror(turn)
        if finalize:
            await self.finalize(session, before, await session.history())
            await self.maintain(session)
        return assembled

    async def turns(self, session: Session, count: int) -> list[AssembleResult]:
        return [await self.turn(session) for _ in range(count)]

    async def refinalize(self, session: Session, turns_back: int = 1) -> None:
        """Finalize the turn ``turns_back`` from the end again (a host's retry)."""
        history = await session.history()
        cut = len(session.source(session.mirrored - turns_back))
        await self.finalize(session, history[:cut], history)


class Host:
    """Starts engine instances for one check, each on a store path under ``root``."""

    def __init__(self, make_engine: EngineFactory, root: Path) -> None:
        self._make = make_engine
        self.root = root
        self._instances: list[Any] = []
        self._stores = 0

    def new_store(self) -> Path:
        """A path for a new, empty store (nothing exists there yet)."""
        self._stores += 1
        directory = self.root / f"store-{self._stores}"
        directory.mkdir(parents=True, exist_ok=True)
        return directory / "store"

    def new_sessions_dir(self) -> Path:
        directory = self.root / f"sessions-{len(list(self.root.glob('sessions-*'))) + 1}"
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    async def start(self, store: Path) -> DrivenEngine:
        """A new engine instance on ``store``: a process start (or restart) of the host."""
        try:
            engine = self._make(store)
            if inspect.isawaitable(engine):
                engine = await engine
        except Exception as err:
            raise CheckFailed(f"the engine factory raised {type(err).__name__}: {err}") from err
        self._instances.append(engine)
        for name in REQUIRED_METHODS:
            if optional_method(engine, name) is None:
                raise CheckFailed(f"the engine has no {name}() (required by the contract)")
        try:
            info = engine_info(engine)
            check_engine(engine)  # the rest of the check every turn makes before it starts
        except Exception as err:
            raise CheckFailed(str(err)) from err
        return DrivenEngine(engine, info)

    async def dispose_all(self) -> list[str]:
        """``dispose`` every instance started (newest first); the problems, described."""
        problems: list[str] = []
        while self._instances:
            engine = self._instances.pop()
            dispose = optional_method(engine, "dispose")
            if dispose is None:
                continue
            try:
                await dispose()
            except Exception as err:
                problems.append(f"dispose() raised {type(err).__name__}: {err}")
        return problems
