"""The engine conformance suite: what every context engine must do, checked against yours.

Hand the suite a factory that makes your engine on a store path, declare how your engine
stores what it ingests, and it drives the engine through scripted sessions exactly as the
harness does (bootstrap, assemble, the transcript mirror, after_turn / ingest_batch / ingest,
maintain, compact; see :mod:`codex_turn.testing._conformance_host`) and reports, check by
check, what held, what broke and what did not apply. No model, no Codex binary, no network.

Usage
-----

One report (any async test; ``anyio.run`` from synchronous code)::

    from codex_turn.testing import check_engine_conformance

    async def test_my_engine_conforms(tmp_path):
        report = await check_engine_conformance(
            lambda path: MyEngine(path), workdir=tmp_path, storage="durable"
        )
        report.assert_conforms()            # raises with the whole report on any failure

One pytest test per check (the checks are values; their ``str`` is their name)::

    import pytest
    from codex_turn.testing import CONFORMANCE_CHECKS

    @pytest.mark.anyio
    @pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=str)
    async def test_my_engine(check, tmp_path):
        result = await check.run(MyEngine, workdir=tmp_path, storage="durable")
        expected = "not_applicable" if check.name in {"epoch_stable"} else "passed"
        assert result.status == expected, result.format()

``assert_conforms(not_applicable=...)`` and the ``expected`` above make a check that does not
apply a *stated* expectation of your test: a check is never passed because it did not run.

Theory of operation
-------------------

*Declared, then verified.* Two facts decide which checks apply. ``storage`` is declared by
the author: ``"none"`` (the engine keeps nothing; its assembly is a function of the params,
like the legacy engine or the recording engine's echo), ``"memory"`` (it keeps what it
ingested for the life of the instance) or ``"durable"`` (it keeps it under the path the
factory receives; a new instance there sees it). The check ``storage_declaration`` verifies the
declaration, so it cannot be used to dodge checks: a "none" engine must assemble exactly what
a fresh instance assembles, a storing one must still assemble what it stored when the live
history is empty (as the harness hands it when the transcript is unreadable), a durable one
must do so from a new instance. The other facts are the engine's own: ``info.owns_compaction``
and the projection its assemblies carry (``context_projection.mode``).

*Applicability is a rule, stated in every result, with its reason.* Each check carries its
rule (:attr:`ConformanceCheck.applies_to`) and why the rule is what it is
(:attr:`ConformanceCheck.because`). A check that does not apply ends ``not_applicable`` with
the rule and the fact that excluded it; it is never reported as passed. Only what needs
storage to happen at all is excused by storage "none" (a message kept twice, a restart); the
budget, tool pairs, prefix stability and isolation are checked on every engine, on the
assemblies it builds from the history it is handed. A step inside an applicable check that
depends on a capability (a bootstrap, a compaction) is listed in the result's ``notes`` as
run or not run, with the reason.

*What a failure costs depends on the projection.* An engine's context reaches Codex each turn
(``per_turn``: Responses items in a fork of the session's base thread, or the text frame) or
once per epoch (``thread_bootstrap``). Each check states, per mode, whether a failure
``breaks`` a session (wrong or lost context, a refused turn), ``costs`` (slower turns, a lost
prompt cache; the context is right) or is ``harmless`` there (:attr:`CheckResult.matters`):
a sliding window fails ``prefix_stable`` by design, which costs a per-turn engine its
continued fork and harms a thread_bootstrap one not at all. The report observes the engine's
mode (:attr:`ConformanceReport.projection`) and lists the failures that matter for it
(:meth:`ConformanceReport.failures_that_matter`).

*Identical means byte-identical.* Assemblies are compared as canonical JSON (sorted keys,
fixed separators) of the whole result: messages, ``estimated_tokens``,
``system_prompt_addition`` and ``context_projection``. That is the rule for one store (twice
in a row, after a retry, after a restart). Between two stores driven through the same turns
(a replay on a fresh store) the projection's ``epoch`` is exempt: it names a store's summary
layer and may carry the store's own identity (a random conversation id, say), and it never
reaches the model; there only the turns at which it changes must coincide. A raw message is
recognised by its role and content (a tool result by its ``toolCallId``), so an engine may
drop or add message keys.

*Every check is independent*: its own directory under ``workdir``, its own stores, its own
transcripts, its own instances, all disposed at the end (a ``dispose`` that raises fails the
check). The factory receives a path where nothing exists yet, inside an existing directory
(create a file or a directory there); a restart passes the same path again, while the old
instance is still alive and undisposed, as after a crash. Each check is bounded by
``timeout``; the suite runs on asyncio and trio.

The checks (rules in brackets; "stores" means storage "memory" or "durable")
----------------------------------------------------------------------------

``storage_declaration`` [every engine]  ``results_valid`` [every engine]
``reingest_adds_nothing`` [stores]  ``retried_after_turn_adds_nothing`` [stores]
``restart_adds_nothing`` [durable]  ``within_budget`` [every engine but the legacy one, which
the harness never calls]  ``tool_pairs_intact`` [every engine]  ``deterministic`` [every
engine]  ``prefix_stable`` [every engine]  ``epoch_stable`` [assemblies carry a
thread_bootstrap projection]  ``compaction_honest`` [every engine]  ``compaction_converges``
[info.owns_compaction]  ``sessions_isolated`` [every engine]; for an engine that declares
transcript semantics only (:data:`DURABLE_TURN_CHECKS`), ``commit_turn_exactly_once``; and
the contract's later part:
``host_requirements_met`` [every engine]  ``model_access_declared`` [every engine]
``reset_archives_or_keeps`` [engines with before_session_reset]  ``session_end_releases_only``
[engines with session_end]  ``subagent_round_trip`` [engines with the subagent hooks]
``control_answers`` [engines with control]  ``compaction_abortable`` [info.owns_compaction].
A check whose rule names a hook finds out whether the engine has it (as the harness does)
and reports ``not_applicable`` with that reason when it has not.
:attr:`ConformanceCheck.description` says exactly what each one does and proves.

Why one module of ~1,000 lines: it is the specification engine authors read, the checks next to
the rules that select them; the machinery that plays the host is apart, in
:mod:`codex_turn.testing._conformance_host`.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Final, Literal

import anyio
import anyio.lowlevel
import attrs

from codex_turn._json import canonical_json
from codex_turn.errors import CodexTurnError
from codex_turn.harness.engine.contract import (
    LEGACY_ENGINE_ID,
    OPTIONAL_METHODS,
    AbortSignal,
    AgentMessage,
    AssembleResult,
    CompactResult,
)
from codex_turn.harness.engine.host import (
    CONTROL_ACTIONS,
    ControlRequest,
    HostRequirementsUnmet,
    check_host_requirements,
)
from codex_turn.harness.session_lifecycle import control_capabilities
from codex_turn.testing._conformance_host import (
    HUGE_BUDGET,
    CheckFailed,
    DrivenEngine,
    EngineFactory,
    Host,
    NotApplicable,
    Session,
    Storage,
    concurrently,
    conversation,
    duplicates,
    epoch_pattern,
    first_difference,
    is_prefix,
    message_key,
    missing,
    replay_json,
    result_json,
    text_chars,
    tool_pair_problems,
)

__all__ = [
    "CONFORMANCE_CHECKS",
    "DURABLE_TURN_CHECKS",
    "PROJECTIONS",
    "CheckResult",
    "CheckStatus",
    "ConformanceCheck",
    "ConformanceFailure",
    "ConformanceReport",
    "EngineFactory",
    "ProjectionKind",
    "Severity",
    "Storage",
    "check_engine_conformance",
]

CheckStatus = Literal["passed", "failed", "not_applicable"]
#: How an engine's context reaches Codex: each turn (``per_turn``: Responses items in a fork
#: of the session's base thread, or the text frame) or once per epoch (``thread_bootstrap``).
ProjectionKind = Literal["per_turn", "thread_bootstrap"]
#: What a failed check does to a session: ``breaks`` it (wrong or lost context, a refused
#: turn), ``costs`` (slower turns, a lost prompt cache; the context is right) or is
#: ``harmless`` in that mode.
Severity = Literal["breaks", "costs", "harmless"]
PROJECTIONS: Final[dict[ProjectionKind, str]] = {
    "per_turn": "per-turn projection",
    "thread_bootstrap": "thread_bootstrap projection",
}

DEFAULT_TIMEOUT: Final = 120.0

_EVERY: Final = "every engine"
_CALLED: Final = (
    "every engine the harness calls (not the legacy engine: it is no engine, Codex sees what "
    "it would without one)"
)
_STORES: Final = 'storage is "memory" or "durable" (declared; verified by storage_declaration)'
_DURABLE: Final = 'storage is "durable" (declared; verified by storage_declaration)'
_OWNS: Final = "info.owns_compaction is true"
_COMMITS: Final = (
    "the engine declares info.transcript_semantics (durable turns: it implements commit_turn)"
)
_THREAD_BOOTSTRAP: Final = (
    'the engine\'s assemblies carry context_projection.mode == "thread_bootstrap" '
    "(observed on the first three turns)"
)
#: Budgets of the budget checks, as fractions of the whole conversation's size.
_BUDGET_FRACTIONS: Final = (1.0, 0.8, 0.65, 0.5, 0.4, 0.3, 0.22, 0.15, 0.1, 0.06, 0.03, 0.01)
#: An engine estimating fewer tokens than this many characters of text each is not counting.
_CHARS_PER_TOKEN_CEILING: Final = 8
_MAX_COMPACTIONS: Final = 16


class ConformanceFailure(CodexTurnError, AssertionError):
    """An engine did not conform; ``str(err)`` is the report, ``err.report`` the object."""

    def __init__(self, report: ConformanceReport, problem: str) -> None:
        super().__init__(f"{problem}\n{report.format()}")
        self.report = report


@attrs.frozen
class CheckResult:
    """What one check found. ``reason`` says why it failed or did not apply."""

    check: str
    status: CheckStatus
    #: The applicability rule of the check, verbatim.
    rule: str
    reason: str = ""
    #: What was verified, and which capability-dependent steps ran or did not (and why).
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    #: Why the rule is what it is (why a check applies to those engines and no others).
    because: str = ""
    #: What a failure of this check does to a session, per projection mode:
    #: ``(mode, severity, what)``, severity ``breaks``, ``costs`` or ``harmless``.
    matters: tuple[tuple[ProjectionKind, Severity, str], ...] = ()

    def severity(self, projection: ProjectionKind) -> Severity:
        """What a failure of this check does to an engine projecting in ``projection``."""
        return next((sev for mode, sev, _ in self.matters if mode == projection), "breaks")

    def format(self) -> str:
        lines = [f"{self.check}: {self.status} ({self.seconds:.2f}s)", f"  applies to: {self.rule}"]
        if self.because:
            lines.append(f"  because: {self.because}")
        if self.reason:
            label = "why" if self.status == "not_applicable" else "failed"
            lines.append(f"  {label}: {self.reason}")
        if self.status == "failed":
            lines.extend(
                f"  matters for {PROJECTIONS[mode]}: {severity}: {what}"
                for mode, severity, what in self.matters
            )
        lines.extend(f"  - {note}" for note in self.notes)
        return "\n".join(lines)


@attrs.frozen
class ConformanceReport:
    """The results of the checks run on one engine, in suite order."""

    engine_id: str
    storage: Storage
    results: tuple[CheckResult, ...]
    #: How the engine's assemblies project (observed on a short session; ``None``: unknown).
    projection: ProjectionKind | None = None

    def _named(self, status: CheckStatus) -> tuple[str, ...]:
        return tuple(r.check for r in self.results if r.status == status)

    @property
    def passed(self) -> tuple[str, ...]:
        return self._named("passed")

    @property
    def failed(self) -> tuple[str, ...]:
        return self._named("failed")

    @property
    def not_applicable(self) -> tuple[str, ...]:
        return self._named("not_applicable")

    @property
    def ok(self) -> bool:
        """No check failed (checks that do not apply are listed, not counted as passed)."""
        return not self.failed

    def result(self, check: str) -> CheckResult:
        return next(r for r in self.results if r.check == check)

    def failures_that_matter(self, projection: ProjectionKind | None = None) -> tuple[str, ...]:
        """The failed checks that break or cost something for an engine projecting in
        ``projection`` (default: the one observed)."""
        mode = projection or self.projection or "per_turn"
        return tuple(
            r.check for r in self.results if r.status == "failed" and r.severity(mode) != "harmless"
        )

    def format(self) -> str:
        head = (
            f"conformance of engine {self.engine_id!r} (storage {self.storage!r}): "
            f"{len(self.passed)} passed, {len(self.failed)} failed, "
            f"{len(self.not_applicable)} not applicable"
        )
        lines = [head]
        if self.projection is not None:
            mode = PROJECTIONS[self.projection]
            matter = self.failures_that_matter()
            lines.append(
                f"observed: {mode}; failures that matter there: {', '.join(matter) or 'none'}"
            )
        return "\n".join([*lines, *(r.format() for r in self.results)])

    def assert_conforms(self, *, not_applicable: Iterable[str] = ()) -> None:
        """Raise :class:`ConformanceFailure` unless no check failed and exactly the checks
        named in ``not_applicable`` did not apply."""
        if self.failed:
            raise ConformanceFailure(self, f"failed checks: {', '.join(self.failed)}")
        expected = set(not_applicable)
        if set(self.not_applicable) != expected:
            raise ConformanceFailure(
                self,
                f"not applicable: {sorted(self.not_applicable)}, expected {sorted(expected)}",
            )


# --- The check runner -----------------------------------------------------------------------


@attrs.define
class _Run:
    """What a check body gets: the host, the declaration, and a notebook."""

    host: Host
    storage: Storage
    notes: list[str] = attrs.Factory(list)

    def note(self, text: str) -> None:
        self.notes.append(text)

    async def engine(self, store: Path | None = None) -> DrivenEngine:
        return await self.host.start(store or self.host.new_store())

    def session(self, name: str, turns: int, root: Path | None = None, **sizes: int) -> Session:
        return Session(
            root or self.host.new_sessions_dir(), name, conversation(name, turns, **sizes)
        )

    def fresh_copy(self, session: Session) -> Session:
        """The same scripted session with a new, empty transcript (for a replay)."""
        return Session(self.host.new_sessions_dir(), session.id, session.turns)


_Body = Callable[[_Run], Awaitable[None]]


@attrs.frozen
class ConformanceCheck:
    """One check of the suite; ``str(check)`` is its name (use it as a pytest id)."""

    name: str
    #: What the check proves, in one line.
    title: str
    #: What it does and proves, in full.
    description: str
    #: When it applies, in one line (also in every :class:`CheckResult`).
    applies_to: str
    _body: _Body = attrs.field(repr=False, alias="body")
    _requires: Callable[[Storage], str | None] = attrs.field(repr=False, alias="requires")
    #: Why it applies to those engines (also in every :class:`CheckResult`).
    because: str = ""
    #: What a failure does, per projection mode (see :attr:`CheckResult.matters`).
    matters: tuple[tuple[ProjectionKind, Severity, str], ...] = ()

    def __str__(self) -> str:
        return self.name

    async def run(
        self,
        make_engine: EngineFactory,
        *,
        workdir: str | os.PathLike[str],
        storage: Storage,
        timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (a bound per check, by design)
    ) -> CheckResult:
        """Run this check on engines made by ``make_engine`` under ``workdir/<name>``."""
        if storage not in ("none", "memory", "durable"):
            raise ValueError(f'storage must be "none", "memory" or "durable" (got {storage!r})')
        root = Path(workdir) / self.name
        root.mkdir(parents=True, exist_ok=True)
        run = _Run(Host(make_engine, root), storage)
        started = time.monotonic()
        status: CheckStatus = "passed"
        reason = ""
        excluded = self._requires(storage)
        try:
            if excluded is not None:
                raise NotApplicable(excluded)
            with anyio.fail_after(timeout):
                await self._body(run)
        except NotApplicable as err:
            status, reason = "not_applicable", str(err)
        except CheckFailed as err:
            status, reason = "failed", str(err)
        except TimeoutError:
            status, reason = "failed", f"did not finish within {timeout:g}s"
        finally:
            with anyio.CancelScope(shield=True):
                problems = await run.host.dispose_all()
        if problems and status != "failed":
            status, reason = "failed", "; ".join(problems)
        return CheckResult(
            check=self.name,
            status=status,
            rule=self.applies_to,
            reason=reason,
            notes=tuple(run.notes),
            seconds=round(time.monotonic() - started, 3),
            because=self.because,
            matters=self.matters,
        )


async def check_engine_conformance(
    make_engine: EngineFactory,
    *,
    workdir: str | os.PathLike[str],
    storage: Storage,
    checks: Iterable[ConformanceCheck | str] = (),
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (a bound per check, by design)
) -> ConformanceReport:
    """Run the checks (all of :data:`CONFORMANCE_CHECKS` by default, or those named) one after
    another on engines made by ``make_engine(path)``; every check gets fresh store paths.

    ``storage`` is the author's declaration (see the module docstring); ``timeout`` bounds each
    check. An engine that declares transcript semantics is checked by
    :data:`DURABLE_TURN_CHECKS` too. Never raises for what the engine does: everything is in
    the report.
    """
    by_name = {check.name: check for check in (*CONFORMANCE_CHECKS, *DURABLE_TURN_CHECKS)}
    chosen: list[ConformanceCheck] = []
    default = CONFORMANCE_CHECKS
    if not checks and await _declares_durable_turns(make_engine, Path(workdir), timeout):
        default = (*CONFORMANCE_CHECKS, *DURABLE_TURN_CHECKS)
    for item in checks or default:
        if isinstance(item, str):
            if item not in by_name:
                raise ValueError(f"no conformance check named {item!r}")
            item = by_name[item]
        chosen.append(item)
    results = [
        await check.run(make_engine, workdir=workdir, storage=storage, timeout=timeout)
        for check in chosen
    ]
    engine_id, projection = await _observe(make_engine, Path(workdir), timeout)
    return ConformanceReport(engine_id, storage, tuple(results), projection)


async def _declares_durable_turns(
    make_engine: EngineFactory,
    workdir: Path,
    timeout: float,  # noqa: ASYNC109 (the checks' bound, here too)
) -> bool:
    """Whether the engine declares transcript semantics (``False`` when it cannot be made)."""
    host = Host(make_engine, workdir / "_declaration")
    try:
        with anyio.move_on_after(timeout):
            return (await host.start(host.new_store())).durable_turns
    except CheckFailed:
        pass
    finally:
        with anyio.CancelScope(shield=True):
            await host.dispose_all()
    return False


async def _observe(
    make_engine: EngineFactory,
    workdir: Path,
    timeout: float,  # noqa: ASYNC109 (the checks' bound, here too)
) -> tuple[str, ProjectionKind | None]:
    """The engine's id, and how its assemblies project (three turns of a short session;
    ``None`` when the engine could not say within ``timeout``)."""
    host = Host(make_engine, workdir / "_info")
    engine_id = "<unknown>"
    projection: ProjectionKind | None = None
    try:
        with anyio.move_on_after(timeout):
            engine = await host.start(host.new_store())
            engine_id = engine.info.id
            session = Session(host.new_sessions_dir(), "observe", conversation("observe", 3))
            modes = {
                result.context_projection.mode if result.context_projection else "per_turn"
                for result in await engine.turns(session, 3)
            }
            projection = "thread_bootstrap" if "thread_bootstrap" in modes else "per_turn"
    except CheckFailed:
        pass
    finally:
        with anyio.CancelScope(shield=True):
            await host.dispose_all()
    return engine_id, projection


# --- Helpers shared by the checks -----------------------------------------------------------


def _no_duplicates(what: str, result: AssembleResult, source: Sequence[AgentMessage]) -> None:
    found = duplicates(result.messages, source)
    if found:
        raise CheckFailed(f"{what}: duplicated messages: {'; '.join(found[:3])}")


def _same(what: str, expected: AssembleResult, actual: AssembleResult) -> None:
    """Byte-identical, epoch included: the same store, the same state."""
    if result_json(expected) != result_json(actual):
        raise CheckFailed(f"{what}: the assembly changed ({first_difference(expected, actual)})")


def _alike(what: str, expected: AssembleResult, actual: AssembleResult) -> None:
    """Byte-identical but for the epoch: two stores driven alike (see the module docstring)."""
    if replay_json(expected) != replay_json(actual):
        raise CheckFailed(f"{what}: the assembly changed ({first_difference(expected, actual)})")


def _stores(storage: Storage) -> str | None:
    return None if storage != "none" else 'declared storage "none": the engine keeps nothing'


def _durable(storage: Storage) -> str | None:
    return None if storage == "durable" else f"declared storage {storage!r}, not durable"


def _always(storage: Storage) -> str | None:
    return None


async def _long_session(run: _Run, engine: DrivenEngine, name: str = "long") -> Session:
    """48 turns: 24 large ones, then 24 small ones (a budget can keep the recent turns)."""
    session = run.session(name, 48, words=10, large_turns=24, large_words=90)
    await engine.turns(session, len(session.turns))
    return session


def _budgets(full: AssembleResult, session: Session) -> list[int]:
    """Budgets from the whole conversation's size down to twice the newest turn's, in the
    engine's own units: its tokens per byte, read off its assembly of everything (an engine
    that keeps only part of the conversation, a window, is measured against the whole, so
    that ignoring the budget shows)."""
    per_byte = full.estimated_tokens / max(1, _bytes(full.messages))
    whole = _whole(full, session)
    newest = _bytes(session.turns[session.mirrored - 1].messages)
    floor = max(1, min(whole, int(2 * per_byte * newest)))
    return sorted({max(floor, int(whole * f)) for f in _BUDGET_FRACTIONS}, reverse=True)


def _whole(full: AssembleResult, session: Session) -> int:
    """The whole conversation's size in the engine's units (see :func:`_budgets`)."""
    per_byte = full.estimated_tokens / max(1, _bytes(full.messages))
    return max(full.estimated_tokens, int(per_byte * _bytes(session.source())))


def _bytes(messages: Sequence[AgentMessage]) -> int:
    return len(canonical_json(list(messages)).encode())


def _newest_user(session: Session) -> AgentMessage:
    return session.turns[session.mirrored - 1].messages[0]


def _honesty_problem(result: CompactResult) -> str | None:
    details = result.result
    before = details.tokens_before if details else None
    after = details.tokens_after if details else None
    if not result.ok and result.compacted:
        return "ok=false yet compacted=true"
    if result.compacted:
        if before is None or after is None:
            return "compacted=true without tokens_before and tokens_after"
        if after >= before:
            return f"compacted=true but tokens_after {after} >= tokens_before {before}"
    elif before is not None and after is not None and after < before:
        return f"compacted=false but tokens_after {after} < tokens_before {before}"
    return None


# --- The checks -----------------------------------------------------------------------------


async def _storage_declaration(run: _Run) -> None:
    """The declared storage is true.

    ``none``: after ingesting a session, the engine assembles byte-identically to a fresh
    instance, for the live history and for an empty one. ``memory``/``durable``: with an
    empty live history (the harness reads an unreadable transcript as empty) the engine still
    assembles every stored message; ``durable``: so does a new instance on the same store,
    with no bootstrap in between.
    """
    store = run.host.new_store()
    engine = await run.engine(store)
    session = run.session("decl", 5)
    await engine.turns(session, 5)
    history = await session.history()
    if run.storage == "none":
        fresh = await run.engine()
        for label, messages in (("the live history", history), ("an empty history", [])):
            used = await engine.assemble(session, messages=list(messages))
            new = await fresh.assemble(session, messages=list(messages))
            if result_json(used) != result_json(new):
                raise CheckFailed(
                    f'declared storage "none", but after ingesting a session it assembles '
                    f"{label} unlike a fresh instance ({first_difference(new, used)})"
                )
        run.note("assembles like a fresh instance after ingesting: it keeps nothing")
        return
    stored = await engine.assemble(session, messages=[])
    lost = missing(stored.messages, session.source())
    if lost:
        raise CheckFailed(
            f"declared storage {run.storage!r}, but with an empty live history it assembled "
            f"{len(session.source()) - len(lost)} of {len(session.source())} stored messages "
            f"(first missing: {lost[0]})"
        )
    run.note("with an empty live history it assembles every stored message")
    if run.storage == "durable":
        again = await (await run.engine(store)).assemble(session, messages=[])
        _same("a new instance on the same store (no bootstrap)", stored, again)
        run.note("a new instance on the same store assembles the same, byte for byte")


async def _results_valid(run: _Run) -> None:
    """Every method answers in the contract's shape, through the harness's own validation.

    The whole turn sequence (bootstrap, assemble, after_turn or ingest_batch or ingest,
    maintain), ``compact`` both ways, and ``ingest`` and ``ingest_batch`` called directly on
    another session; ``assemble`` returns a new list (never the host's own), and the messages
    it was given are read-only (an engine that edits one gets a ``TypeError`` and fails).
    """
    engine = await run.engine()
    session = run.session("valid", 4)
    await engine.turns(session, 4)
    history = await session.history()
    result = await engine.assemble(session, messages=history)
    if result.messages is history:
        raise CheckFailed("assemble() returned the host's own messages list, not a new one")
    await engine.compact(session, budget=HUGE_BUDGET, force=False, current_token_count=100)
    await engine.compact(session, budget=HUGE_BUDGET, force=True)
    other = run.session("valid-direct", 2)
    direct = [m for turn in other.turns for m in turn.messages]
    if engine.has("ingest_batch"):
        await engine.ingest_batch(other, direct[:2])
    for message in direct[2:]:
        await engine.ingest(other, message)
    present = [name for name in OPTIONAL_METHODS if engine.has(name)]
    run.note(
        f"optional methods present: {', '.join(present) or 'none'}; "
        f"finalize path: {engine.finalize_path}"
    )


async def _reingest_adds_nothing(run: _Run) -> None:
    """Delivering a session it already holds again adds nothing, by every ingestion path.

    After five turns: ``bootstrap`` over the transcript (it must report 0 imported),
    ``after_turn`` with the whole session as new (pre-prompt count 0), ``ingest_batch`` of the
    whole session (count 0) and ``ingest`` of each message (``ingested`` false), each path the
    engine has; after each the assembly is byte-identical to before.
    """
    engine = await run.engine()
    session = run.session("reingest", 5)
    await engine.turns(session, 5)
    history = await session.history()
    expected = await engine.assemble(session)
    _no_duplicates("before re-ingesting", expected, session.source())
    ran: list[str] = []
    if engine.has("bootstrap"):
        boot = await engine.bootstrap(session)
        if boot is not None and boot.imported_messages:
            raise CheckFailed(
                f"bootstrap over a transcript it holds imported {boot.imported_messages}"
            )
        _same("bootstrap over a transcript it holds", expected, await engine.assemble(session))
        ran.append("bootstrap")
    if engine.has("after_turn"):
        await engine.finalize(session, [], history, path="after_turn")
        _same("after_turn with the whole session as new", expected, await engine.assemble(session))
        ran.append("after_turn")
    if engine.has("ingest_batch"):
        batch = await engine.ingest_batch(session, history)
        if batch.ingested_count:
            raise CheckFailed(f"ingest_batch of held messages counted {batch.ingested_count}")
        _same("ingest_batch of the whole session", expected, await engine.assemble(session))
        ran.append("ingest_batch")
    counted = [m for m in history if (await engine.ingest(session, m)).ingested]
    if counted:
        raise CheckFailed(f"ingest of {len(counted)} held messages answered ingested=true")
    _same("ingest of every message", expected, await engine.assemble(session))
    ran.append("ingest")
    run.note("re-delivered through: " + ", ".join(ran))


async def _retried_after_turn_adds_nothing(run: _Run) -> None:
    """A retried finalize adds nothing: sequential or concurrent with the original.

    Turn 4 is finalized twice in a row, turn 5 twice concurrently, by the harness's finalize
    path (``after_turn``, else ``ingest_batch``, else ``ingest``). The assembly after the
    sequential retry is unchanged, and the final one has no duplicate and is byte-identical
    (epoch aside) to a replay of the same turns without retries on a fresh store.
    """
    engine = await run.engine()
    session = run.session("retry", 6)
    await engine.turns(session, 4)
    once = await engine.assemble(session)
    await engine.refinalize(session)
    _same("a sequential retry of after_turn", once, await engine.assemble(session))
    await engine.turn(session, finalize=False)
    history = await session.history()
    before = history[: len(session.source(session.mirrored - 1))]
    retry = functools.partial(engine.finalize, session, before, history)
    await concurrently(retry, retry)
    await engine.turn(session)
    retried = await engine.assemble(session)
    _no_duplicates("after retries", retried, session.source())
    replay_session = run.fresh_copy(session)
    replay = await run.engine()
    await replay.turns(replay_session, len(session.turns))
    _alike("compared with a replay without retries", await replay.assemble(replay_session), retried)
    run.note(f"finalize path retried: {engine.finalize_path} (sequentially and concurrently)")


async def _restart_adds_nothing(run: _Run) -> None:
    """A restart (a new instance on the same store, the old one never disposed) adds nothing.

    After four turns, a new instance's bootstrap and assembly equal the old assembly byte for
    byte; a retry of turn 4's finalize on it changes nothing. Then turn 5 is mirrored but never
    finalized (the host died), a third instance runs turn 6: no duplicate; with ``bootstrap``
    nothing is lost (turn 5 comes from the transcript) and the assembly is byte-identical
    (epoch aside) to a replay of the six turns without restarts on a fresh store.
    """
    store = run.host.new_store()
    first = await run.engine(store)
    session = run.session("restart", 6)
    await first.turns(session, 4)
    expected = await first.assemble(session)
    second = await run.engine(store)
    if second.has("bootstrap") or second.has("maintain"):
        await second.bootstrap(session)
        run.note("the new instance ran bootstrap and maintenance first, as the harness does")
    _same("after a restart", expected, await second.assemble(session))
    await second.refinalize(session)
    _same("after a restart and a retried after_turn", expected, await second.assemble(session))
    await second.turn(session, finalize=False)
    third = await run.engine(store)
    await third.turn(session)
    final = await third.assemble(session)
    _no_duplicates("after a restart that lost a finalize", final, session.source())
    if not third.has("bootstrap"):
        run.note("no bootstrap: turn 5 (mirrored, never finalized) may be lost; not required")
        return
    lost = missing(final.messages, session.source())
    if lost:
        raise CheckFailed(f"after a restart that lost a finalize, lost: {lost[0]}")
    replay_session = run.fresh_copy(session)
    replay = await run.engine()
    await replay.turns(replay_session, len(session.turns))
    _alike("compared with a replay without restarts", await replay.assemble(replay_session), final)
    run.note("with bootstrap: nothing lost, and identical to a replay without restarts")


async def _within_budget(run: _Run) -> None:
    """Every assembly fits its budget, and not by dropping the newest turn.

    A 48-turn conversation (large old turns, small recent ones) assembled at budgets from its
    whole size down to 6% of it (never below a few times the newest turn): ``estimated_tokens``
    <= budget, the estimate is plausible (at least one token per 8 characters of the text a
    model reads in the assembly: text, tool calls, summaries) and the newest user message is
    in it.
    """
    engine = await run.engine()
    if engine.info.id == LEGACY_ENGINE_ID:
        raise NotApplicable("the legacy engine is no engine: the harness never assembles with it")
    session = await _long_session(run, engine)
    full = await engine.assemble(session)
    for budget in _budgets(full, session):
        result = await engine.assemble(session, budget=budget)
        share = f"budget {budget} ({budget / max(1, _whole(full, session)):.0%} of the whole)"
        if result.estimated_tokens > budget:
            raise CheckFailed(f"{share}: assembled {result.estimated_tokens} tokens")
        chars = text_chars(result.messages, result.system_prompt_addition)
        if result.estimated_tokens * _CHARS_PER_TOKEN_CEILING < chars:
            raise CheckFailed(
                f"{share}: estimated_tokens {result.estimated_tokens} for {chars} characters "
                f"of text (fewer than one token per {_CHARS_PER_TOKEN_CEILING} characters)"
            )
        if missing(result.messages, [_newest_user(session)]):
            raise CheckFailed(f"{share}: the newest user message is not in the assembly")
    run.note(f"budgets checked: {_budgets(full, session)} (whole: {_whole(full, session)})")


async def _tool_pairs_intact(run: _Run) -> None:
    """No assembly splits, orphans, duplicates or invents a tool call or result.

    The 48-turn conversation (one or two parallel calls every third turn) assembled whole and
    at every budget of ``within_budget``: each call has exactly one result after it, each result
    follows its call, and every id exists in the source conversation.
    """
    engine = await run.engine()
    session = await _long_session(run, engine)
    full = await engine.assemble(session)
    budgets = sorted({*_budgets(full, session), *_pair_edges(full, session)}, reverse=True)
    for budget in [HUGE_BUDGET, *budgets]:
        result = await engine.assemble(session, budget=budget)
        problems = tool_pair_problems(result.messages, session.source())
        if problems:
            raise CheckFailed(f"budget {budget}: {'; '.join(problems[:3])}")
    edges = len(budgets) - len(_budgets(full, session))
    run.note(f"{len(budgets) + 1} budgets, {edges} of them where a cut splits a tool pair")


def _pair_edges(full: AssembleResult, session: Session) -> set[int]:
    """Budgets at which a message-by-message fill would keep a tool result but not its call.

    The engine's units are estimated from the whole assembly (tokens in proportion to bytes);
    three budgets around each edge absorb the estimate's error.
    """
    sizes = [len(canonical_json(m).encode()) for m in full.messages]
    per_byte = full.estimated_tokens / max(1, sum(sizes))
    floor = min(_budgets(full, session))
    edges: set[int] = set()
    for position, message in enumerate(full.messages):
        if isinstance(message, dict) and message.get("role") == "toolResult":
            suffix = sum(sizes[position:]) * per_byte
            edges.update(int(suffix * f) for f in (0.97, 1.0, 1.03) if suffix * f >= floor)
    return edges


async def _deterministic(run: _Run) -> None:
    """Identical state gives byte-identical assemblies.

    Eight turns, then the whole and a half-budget assembly, each of these two made twice in a
    row (byte-identical, epoch included). A second instance on a fresh store, driven through
    the same turns, must produce the same ten assemblies, byte for byte but for the epoch,
    whose changes must fall on the same assemblies.
    """

    async def drive() -> list[AssembleResult]:
        engine = await run.engine()
        session = run.session("determinism", 8)
        seen = [await engine.turn(session) for _ in session.turns]
        full = await engine.assemble(session)
        _same("assembled twice in a row", full, await engine.assemble(session))
        half = max(1, full.estimated_tokens // 2)
        halved = await engine.assemble(session, budget=half)
        again = await engine.assemble(session, budget=half)
        _same("assembled twice in a row at half budget", halved, again)
        return [*seen, full, halved]

    first, second = await drive(), await drive()
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        _alike(f"assembly {index} of two identical runs on two stores", a, b)
    if epoch_pattern(first) != epoch_pattern(second):
        raise CheckFailed(
            f"the epoch changed at different assemblies in two identical runs: "
            f"{epoch_pattern(first)} != {epoch_pattern(second)}"
        )
    run.note(
        f"{len(first)} assemblies: byte-identical when repeated, and across two stores "
        "(there the epoch only by where it changes)"
    )


async def _prefix_stable(run: _Run) -> None:
    """Each turn's assembly extends the previous one (prompt caches survive) until a
    compaction.

    The 48-turn conversation with nothing to leave out (a huge budget): every turn's assembled
    messages start with the previous turn's. With ``info.owns_compaction``, one forced
    compaction follows; if it compacted, the chain restarts after it and three more turns must
    extend it again.
    """
    engine = await run.engine()
    session = run.session("prefix", 51, words=10, large_turns=24, large_words=90)
    previous: AssembleResult | None = None
    for _ in range(48):
        current = await engine.turn(session)
        if previous is not None and not is_prefix(previous.messages, current.messages):
            raise CheckFailed(
                f"turn {session.mirrored - 1}: the previous assembly is not a prefix "
                f"({first_difference(previous, current)})"
            )
        previous = current
    run.note("48 turns: each assembly starts with the previous one")
    if not engine.info.owns_compaction:
        run.note("no compaction step: info.owns_compaction is false")
        return
    result = await engine.compact(session, budget=_small_budget(previous), force=True)
    run.note(f"forced compaction: compacted={result.compacted}")
    if result.compacted:
        previous = None
    for _ in range(3):
        current = await engine.turn(session)
        if previous is not None and not is_prefix(previous.messages, current.messages):
            raise CheckFailed(
                f"turn {session.mirrored - 1} (after a compaction that compacted "
                f"{result.compacted}): the previous assembly is not a prefix "
                f"({first_difference(previous, current)})"
            )
        previous = current


def _small_budget(result: AssembleResult | None) -> int:
    return max(1000, (result.estimated_tokens if result else 0) // 5)


async def _epoch_stable(run: _Run) -> None:
    """A ``thread_bootstrap`` engine keeps its epoch while only raw messages are added.

    The 48-turn conversation at a huge budget: every non-empty assembly carries
    ``thread_bootstrap`` with the same non-empty epoch (bootstraps, maintenance and new turns
    in between). With ``info.owns_compaction``, a forced compaction that compacted must change
    the epoch (the summary layer changed, so the thread must be replaced), and three more turns
    keep the new one.
    """
    engine = await run.engine()
    session = run.session("epoch", 51, words=10, large_turns=24, large_words=90)
    seen: list[AssembleResult] = []
    for index in range(48):
        seen.append(await engine.turn(session))
        if index == 2 and not any(
            r.context_projection and r.context_projection.mode == "thread_bootstrap" for r in seen
        ):
            modes = sorted(
                {r.context_projection.mode if r.context_projection else "none" for r in seen}
            )
            raise NotApplicable(f"observed projection modes: {', '.join(modes)}")
    epoch = _one_epoch(seen, "without a compaction")
    run.note(f"epoch {epoch!r} stable over {len(seen)} turns")
    if not engine.info.owns_compaction:
        run.note("no compaction step: info.owns_compaction is false")
        return
    result = await engine.compact(session, budget=_small_budget(seen[-1]), force=True)
    if not result.compacted:
        run.note("the forced compaction compacted nothing: epoch change not checked")
        return
    after = [await engine.turn(session) for _ in range(3)]
    new_epoch = _one_epoch(after, "after a compaction")
    if new_epoch == epoch:
        raise CheckFailed(f"a compaction that compacted kept the epoch {epoch!r}")
    run.note("a compaction changed the epoch, then it stayed stable")


def _one_epoch(results: Sequence[AssembleResult], when: str) -> str:
    epochs: set[str | None] = set()
    for result in results:
        if not result.messages:
            continue
        projection = result.context_projection
        if projection is None or projection.mode != "thread_bootstrap":
            raise CheckFailed(f"{when}: an assembly without a thread_bootstrap projection")
        epochs.add(projection.epoch)
    if None in epochs or "" in epochs:
        raise CheckFailed(f"{when}: a thread_bootstrap projection without an epoch")
    if len(epochs) != 1:
        raise CheckFailed(f"{when}: the epoch changed: {sorted(e or '' for e in epochs)}")
    return str(next(iter(epochs)))


async def _compaction_honest(run: _Run) -> None:
    """``compact`` tells the truth: compacted iff tokens_after < tokens_before, and the
    assembly agrees.

    The 48-turn conversation; a budget compaction (current count over the budget), then two
    forced ones. For each: ``ok=false`` implies ``compacted=false``; ``compacted=true``
    requires both token counts with after < before and a whole-conversation assembly smaller
    than before; ``compacted=false`` forbids after < before and leaves the assembly
    byte-identical.
    """
    engine = await run.engine()
    session = await _long_session(run, engine)
    before = await engine.assemble(session)
    budget = _small_budget(before)
    outcomes: list[str] = []
    for force in (False, True, True):
        current = max(before.estimated_tokens, 2 * budget)
        result = await engine.compact(
            session, budget=budget, force=force, current_token_count=current
        )
        kind = "forced" if force else "budget"
        problem = _honesty_problem(result)
        if problem:
            raise CheckFailed(f"{kind} compaction: {problem}")
        after = await engine.assemble(session)
        if result.compacted and after.estimated_tokens >= before.estimated_tokens:
            raise CheckFailed(
                f"{kind} compaction reported compacted=true, but the whole assembly went "
                f"from {before.estimated_tokens} to {after.estimated_tokens} tokens"
            )
        if not result.compacted:
            _same(f"{kind} compaction that reported compacted=false", before, after)
        outcomes.append(f"{kind}: compacted={result.compacted}")
        before = after
    run.note("; ".join(outcomes))


async def _compaction_converges(run: _Run) -> None:
    """An engine that owns compaction compacts when forced, converges, and stays intact.

    The 48-turn conversation, forced compactions at a fifth of its size: the first compacts,
    one reports compacted=false within 16 calls, the whole assembly shrank, and the assembly at
    that budget fits it, keeps the newest user message, duplicates nothing and keeps tool pairs.
    """
    engine = await run.engine()
    if not engine.info.owns_compaction:
        raise NotApplicable("info.owns_compaction is false")
    session = await _long_session(run, engine)
    whole = await engine.assemble(session)
    budget = _small_budget(whole)
    calls = 0
    for calls in range(1, _MAX_COMPACTIONS + 1):
        result = await engine.compact(session, budget=budget, force=True)
        problem = _honesty_problem(result)
        if problem:
            raise CheckFailed(f"compaction {calls}: {problem}")
        if calls == 1 and not result.compacted:
            raise CheckFailed(
                f"a forced compaction at budget {budget} of a conversation of "
                f"{whole.estimated_tokens} tokens compacted nothing ({result.reason})"
            )
        if not result.compacted:
            break
    else:
        raise CheckFailed(f"still compacting after {_MAX_COMPACTIONS} forced compactions")
    after = await engine.assemble(session)
    if after.estimated_tokens >= whole.estimated_tokens:
        raise CheckFailed(
            f"the whole assembly did not shrink ({whole.estimated_tokens} -> "
            f"{after.estimated_tokens})"
        )
    fitted = await engine.assemble(session, budget=budget)
    if fitted.estimated_tokens > budget:
        raise CheckFailed(f"after compaction, budget {budget}: {fitted.estimated_tokens}")
    if missing(fitted.messages, [_newest_user(session)]):
        raise CheckFailed("after compaction the newest user message is not in the assembly")
    _no_duplicates("after compaction", fitted, session.source())
    problems = tool_pair_problems(fitted.messages, session.source())
    if problems:
        raise CheckFailed(f"after compaction: {'; '.join(problems[:3])}")
    run.note(
        f"converged after {calls} calls; whole assembly {whole.estimated_tokens} -> "
        f"{after.estimated_tokens} tokens"
    )


async def _sessions_isolated(run: _Run) -> None:
    """Sessions sharing one instance do not see or disturb each other.

    Three sessions run their 16 turns concurrently on one instance; each one's assembly
    holds nothing of the others and is byte-identical to the same session run alone on a fresh
    store. With ``info.owns_compaction``, a forced compaction of one leaves the others'
    assemblies byte-identical.
    """
    engine = await run.engine()
    root = run.host.new_sessions_dir()
    sessions = [
        run.session(f"iso{name}", 16, root=root, large_turns=8, large_words=90) for name in "abc"
    ]

    async def drive(session: Session) -> None:
        for _ in session.turns:
            await engine.turn(session)
            await anyio.lowlevel.checkpoint()

    await concurrently(*(functools.partial(drive, session) for session in sessions))
    assembled = {s.id: await engine.assemble(s) for s in sessions}
    for session in sessions:
        text = canonical_json(list(assembled[session.id].messages))
        foreign = [o.id for o in sessions if o is not session and f"[{o.id}:" in text]
        if foreign:
            raise CheckFailed(f"session {session.id}'s assembly holds messages of {foreign}")
        alone = run.fresh_copy(session)
        solo = await run.engine()
        await solo.turns(alone, len(alone.turns))
        expected = await solo.assemble(alone)
        _alike(f"session {session.id} compared with a run alone", expected, assembled[session.id])
    run.note("three concurrent sessions: disjoint, and each identical to a run alone")
    if not engine.info.owns_compaction:
        run.note("no compaction step: info.owns_compaction is false")
        return
    result = await engine.compact(sessions[0], budget=1000, force=True)
    for other in sessions[1:]:
        unchanged = await engine.assemble(other)
        _same(f"session {other.id} after compacting another", assembled[other.id], unchanged)
    if result.compacted:
        run.note("compacting one session left the others unchanged")
    else:
        run.note("the forced compaction of one session compacted nothing: not shown to isolate")


async def _commit_turn_exactly_once(run: _Run) -> None:
    """Each turn is applied once per advancement key, and assembled behind the current-turn
    fence.

    Three turns are settled with ``commit_turn``; before each, the assembly of the history
    before its entry holds no message of that turn (the fence: the current prompt is never both
    in history and in the prompt). Turn 4's prompt is made durable and its host dies; its
    retry's assembly (after a bootstrap) holds no copy of that prompt either. Turn 4 is then
    mirrored and never committed (the host was killed between the reply and the commit); its
    commit (on a new instance when the storage is durable: the host's recovery after a restart)
    answers ``committed``, a replay of it ``duplicate``, and the replay leaves the assembly
    byte-identical. Turn 5 is committed twice concurrently (two hosts recovering it): one
    ``committed``, one ``duplicate``. The final assembly has no duplicate, lacks nothing, and
    equals (epoch aside) a replay of the five turns on a fresh store.
    """
    store = run.host.new_store()
    engine = await run.engine(store)
    if not engine.durable_turns:
        raise NotApplicable("info.transcript_semantics is not declared")
    session = run.session("commit", 5)
    for index in range(3):
        assembled = await engine.turn(session)
        held = {message_key(m) for m in assembled.messages}
        if any(message_key(m) in held for m in session.turns[index].messages):
            raise CheckFailed(f"turn {index + 1}'s assembly holds its own prompt or reply")
    before = await session.history()
    # Turn 4's first host died once its prompt was durable: its retry assembles (after a
    # bootstrap, as the harness does) behind the fence, its own prompt in the transcript.
    turn = session.turns[session.mirrored]
    await session.mirror(turn, prompt_only=True)
    if engine.has("bootstrap") or engine.has("maintain"):
        await engine.bootstrap(session)
    fenced = await engine.assemble(session, messages=before, prompt=turn.prompt)
    if message_key(turn.messages[0]) in {message_key(m) for m in fenced.messages}:
        raise CheckFailed("the retry of a turn in flight assembled its own prompt")
    await engine.turn(session, finalize=False)  # killed between the reply and the commit
    after = await session.history()
    if run.storage == "durable":
        engine = await run.engine(store)
        run.note("turn 4 was committed by a new instance on the same store (a restart)")
    first = await engine.commit_turn(session, before, after)
    if first.status != "committed":
        raise CheckFailed(f"the first commit of turn 4 answered {first.status!r}")
    once = await engine.assemble(session)
    again = await engine.commit_turn(session, before, after)
    if again.status != "duplicate":
        raise CheckFailed(f"a replayed commit of turn 4 answered {again.status!r}")
    _same("after a replayed commit", once, await engine.assemble(session))
    before = await session.history()
    await engine.turn(session, finalize=False)
    after = await session.history()
    statuses: list[str] = []

    async def commit() -> None:
        statuses.append((await engine.commit_turn(session, before, after)).status)

    await concurrently(commit, commit)
    if sorted(statuses) != ["committed", "duplicate"]:
        raise CheckFailed(f"two concurrent commits of turn 5 answered {sorted(statuses)}")
    final = await engine.assemble(session)
    _no_duplicates("after the commits", final, session.source())
    lost = missing(final.messages, session.source())
    if lost:
        raise CheckFailed(f"after the commits, lost: {lost[0]}")
    replay_session = run.fresh_copy(session)
    replay = await run.engine()
    await replay.turns(replay_session, len(session.turns))
    _alike("compared with a replay without crashes", await replay.assemble(replay_session), final)


# --- The checks of the contract's later part (host capabilities, hooks, control) -----------


async def _host_requirements_met(run: _Run) -> None:
    """The engine needs nothing the Codex harness does not offer.

    ``info.host_requirements`` is read as every load reads it: each name must be a known
    capability that this harness offers (``CODEX_HOST_CAPABILITIES``), else ``run_codex_turn``
    refuses the engine before any turn (``HostRequirementsUnmet``).
    """
    engine = await run.engine()
    needs = engine.info.host_requirements
    try:
        check_host_requirements(engine.info.id, needs)
    except HostRequirementsUnmet as err:
        raise CheckFailed(str(err)) from None
    run.note(f"requires: {', '.join(sorted(needs)) or 'nothing beyond the original contract'}")


async def _model_access_declared(run: _Run) -> None:
    """The host's model is used only when declared, and only with valid requests.

    The kit lends a model in every runtime context (``after_turn``, ``maintain``, ``compact``)
    that answers with a fixed text. Over six turns and a forced compaction at a small budget:
    an engine that calls it must declare ``runtime-llm-complete`` in
    ``info.host_requirements`` (a host without the capability lends none: the engine would
    break there), and every request must pass the harness's own check (a known purpose, a
    conversation that ends with the user, a bounded size).
    """
    engine = await run.engine()
    session = run.session("llm", 6, large_turns=3, large_words=90)
    await engine.turns(session, 6)
    whole = await engine.assemble(session)
    await engine.compact(session, budget=_small_budget(whole), force=True)
    llm = engine.llm
    if llm.problems:
        raise CheckFailed(f"an invalid model request: {llm.problems[0]}")
    declared = "runtime-llm-complete" in engine.info.host_requirements
    if llm.requests and not declared:
        raise CheckFailed(
            f"the engine asked the host's model {len(llm.requests)} times without declaring "
            '"runtime-llm-complete" in info.host_requirements'
        )
    purposes = sorted({r.purpose for r in llm.requests})
    run.note(
        f"model requests: {len(llm.requests)}"
        + (f" (purposes: {', '.join(purposes)})" if purposes else "")
        + f"; declared: {declared}"
    )


def _present(messages: Sequence[AgentMessage], expected: Sequence[AgentMessage]) -> int:
    """How many of ``expected`` are in ``messages`` (recognised by content)."""
    return len(expected) - len(missing(messages, expected))


async def _reset_archives_or_keeps(run: _Run) -> None:
    """A reset tells the engine, which archives the session's state or keeps it, and says so.

    Five turns, then ``before_session_reset``: a ``SessionResetResult``. ``archived``: an
    assembly with an empty live history holds none of the session's messages (its state no
    longer reaches the model); ``kept``: an engine that stores still assembles them all. Then
    the session starts over on the same key (a new transcript): three turns, each new message
    assembled once, and nothing from before the reset unless it was kept.
    """
    engine = await run.engine()
    if not engine.has("before_session_reset"):
        raise NotApplicable("the engine has no before_session_reset")
    session = run.session("reset", 5)
    await engine.turns(session, 5)
    old = session.source()
    result = await engine.reset(session)
    after = await engine.assemble(session, messages=[])
    if result.action == "archived" and _present(after.messages, old):
        raise CheckFailed(
            f"reset answered archived, yet an assembly holds {_present(after.messages, old)} "
            f"of the session's {len(old)} messages"
        )
    if result.action == "kept" and run.storage != "none" and missing(after.messages, old):
        raise CheckFailed("reset answered kept, yet the stored messages are no longer assembled")
    again = Session(run.host.new_sessions_dir(), session.id, conversation("reset-anew", 3))
    await engine.turns(again, 3)
    assembled = await engine.assemble(again)
    _no_duplicates("after the reset", assembled, again.source())
    lost = missing(assembled.messages, again.source())
    if lost:
        raise CheckFailed(f"after the reset a new message is not assembled: {lost[0]}")
    if result.action == "archived" and _present(assembled.messages, old):
        raise CheckFailed("after an archiving reset, the next turns assemble old messages")
    run.note(f"reset answered {result.action}; the session went on under the same key")


async def _session_end_releases_only(run: _Run) -> None:
    """``session_end`` releases, it does not forget: the session resumes as it was.

    Four turns, ``session_end`` (which returns nothing); the same instance then assembles
    byte-identically to before (and, for a durable store, so does a new instance on it), and
    a fifth turn runs with every message assembled once.
    """
    store = run.host.new_store()
    engine = await run.engine(store)
    if not engine.has("session_end"):
        raise NotApplicable("the engine has no session_end")
    session = run.session("end", 5)
    await engine.turns(session, 4)
    before = await engine.assemble(session)
    await engine.end(session)
    _same("after session_end", before, await engine.assemble(session))
    if run.storage == "durable":
        restarted = await run.engine(store)
        _same("a new instance after session_end", before, await restarted.assemble(session))
    await engine.turn(session)
    fifth = await engine.assemble(session)
    _no_duplicates("a turn after session_end", fifth, session.source())
    run.note("the session resumed after session_end as it was")


async def _subagent_round_trip(run: _Run) -> None:
    """A child session seeded by the engine runs apart, and its end is taken back cleanly.

    Applies when the engine has ``prepare_subagent_spawn`` or ``on_subagent_ended``; it must
    have both. The parent runs four turns; ``prepare_subagent_spawn`` answers a
    ``SubagentSpawnPreparation`` (or nothing); the child (its own key and transcript) runs
    three turns, each of its messages assembled once; ``on_subagent_ended`` (completed, with
    an answer) returns nothing. The parent then still assembles each of its messages once
    with its tool pairs intact, a bystander session is untouched byte for byte, and a second
    child that ended ``spawn_failed`` changes nothing at all.
    """
    engine = await run.engine()
    has = [engine.has(m) for m in ("prepare_subagent_spawn", "on_subagent_ended")]
    if not any(has):
        raise NotApplicable("the engine has neither prepare_subagent_spawn nor on_subagent_ended")
    if not all(has):
        raise CheckFailed("the engine has only one of prepare_subagent_spawn, on_subagent_ended")
    root = run.host.new_sessions_dir()
    parent = run.session("parent", 4, root=root)
    bystander = run.session("bystander", 3, root=root)
    await engine.turns(parent, 4)
    await engine.turns(bystander, 3)
    quiet = await engine.assemble(bystander)
    child = run.session("child", 3, root=root)
    preparation = await engine.prepare_subagent(parent, child, "summarise the parent's work")
    await engine.turns(child, 3)
    assembled = await engine.assemble(child)
    _no_duplicates("the child's assembly", assembled, child.source())
    if missing(assembled.messages, child.source()):
        raise CheckFailed("the child's own messages are not all assembled")
    await engine.subagent_ended(parent, child, "completed", "the child's answer")
    folded = await engine.assemble(parent)
    _no_duplicates("the parent after its child ended", folded, parent.source())
    if missing(folded.messages, parent.source()):
        raise CheckFailed("after its child ended, the parent lost messages")
    problems = tool_pair_problems(folded.messages, parent.source())
    if problems:
        raise CheckFailed(f"the parent after its child ended: {'; '.join(problems[:3])}")
    _same("a bystander session after a child ended", quiet, await engine.assemble(bystander))
    failed = run.session("child-failed", 1, root=root)
    await engine.prepare_subagent(parent, failed, "a task that never ran")
    await engine.subagent_ended(parent, failed, "spawn_failed", None)
    _same("the parent after a child that never ran", folded, await engine.assemble(parent))
    seeded = preparation is not None and (
        preparation.seeded or bool(preparation.system_prompt_addition)
    )
    run.note(f"child seeded: {seeded}; the parent took the end back without damage")


async def _control_answers(run: _Run) -> None:
    """``control`` answers every action it declares, in the contract's shape.

    Applies when the engine has ``control``. ``control_capabilities`` declares a subset of
    status, doctor and rotate; after three turns each declared action answers a
    ``ControlResult`` naming it (doctor without repair). After ``rotate`` of the session's
    key, an assembly with an empty live history holds none of its messages, and the session
    goes on: two more turns, each message assembled once.
    """
    engine = await run.engine()
    if not engine.has("control"):
        raise NotApplicable("the engine has no control")
    try:
        declared = control_capabilities(engine.engine)
    except Exception as err:
        raise CheckFailed(f"control_capabilities: {err}") from None
    unknown = sorted(declared.actions - set(CONTROL_ACTIONS))
    if unknown:
        raise CheckFailed(f"control_capabilities declares unknown actions: {unknown}")
    session = run.session("control", 5)
    await engine.turns(session, 3)
    answered: list[str] = []
    for action in ("status", "doctor", "rotate"):
        if action not in declared.actions:
            continue
        result = await engine.control(ControlRequest(action=action, session_key=session.key))
        if result.action != action:
            raise CheckFailed(f"control({action}) answered for {result.action!r}")
        answered.append(f"{action}: ok={result.ok}")
    if "rotate" in declared.actions:
        old = session.source()
        after = await engine.assemble(session, messages=[])
        if _present(after.messages, old):
            raise CheckFailed("after rotate, an assembly still holds the session's old messages")
        again = Session(run.host.new_sessions_dir(), session.id, conversation("control-anew", 2))
        await engine.turns(again, 2)
        _no_duplicates("after rotate", await engine.assemble(again), again.source())
    run.note("; ".join(answered) or "no actions declared")


async def _compaction_abortable(run: _Run) -> None:
    """An aborted compaction stops at once and says so honestly.

    Applies to ``info.owns_compaction``. Sixteen turns; a forced compaction whose abort signal
    is already set compacts nothing (``compacted=false``, the assembly byte for byte as
    before), then a compaction with a ``preflight_trigger`` compacts honestly.
    """
    engine = await run.engine()
    if not engine.info.owns_compaction:
        raise NotApplicable("info.owns_compaction is false")
    session = run.session("abort", 16, large_turns=8, large_words=90)
    await engine.turns(session, 16)
    before = await engine.assemble(session)
    budget = _small_budget(before)
    signal = AbortSignal()
    signal.abort("conformance")
    result = await engine.compact(session, budget=budget, force=True, abort_signal=signal)
    problem = _honesty_problem(result)
    if problem:
        raise CheckFailed(f"an aborted compaction: {problem}")
    if result.compacted:
        raise CheckFailed("a compaction aborted before it began compacted all the same")
    unchanged = await engine.assemble(session)
    _same("an aborted compaction", before, unchanged)
    preflight = await engine.compact(
        session,
        budget=budget,
        force=False,
        current_token_count=2 * budget,
        preflight_trigger="budget",
    )
    problem = _honesty_problem(preflight)
    if problem:
        raise CheckFailed(f"a preflight compaction: {problem}")
    run.note(f"aborted: compacted={result.compacted}; preflight: compacted={preflight.compacted}")


def _check(
    body: _Body,
    applies_to: str,
    requires: Callable[[Storage], str | None],
    because: str,
    **matters: tuple[Severity, str],
) -> ConformanceCheck:
    """A check from its body (name and docs from the function), its rule and why, and what
    a failure does per projection mode (``per_turn=...``, ``thread_bootstrap=...``; one
    keyword ``both`` for the same in each)."""
    doc = inspect.cleandoc(body.__doc__ or "")
    both = matters.pop("both", None)
    impact: dict[ProjectionKind, tuple[Severity, str]] = (
        {"per_turn": both, "thread_bootstrap": both} if both is not None else {}
    )
    impact.update(matters)  # type: ignore[arg-type]
    return ConformanceCheck(
        name=body.__name__.lstrip("_"),
        title=" ".join(doc.split("\n\n")[0].split()),
        description=doc,
        applies_to=applies_to,
        body=body,
        requires=requires,
        because=because,
        matters=tuple((mode, *impact[mode]) for mode in PROJECTIONS if mode in impact),
    )


_REFUSED: Final[tuple[Severity, str]] = (
    "breaks",
    "the harness refuses the result: the turn goes on without the engine's context (strict "
    "mode fails it)",
)
_TWICE: Final[tuple[Severity, str]] = (
    "breaks",
    "the model sees a message twice (after a crash, a retry or a bootstrap)",
)

#: Every check, in the order a report lists them.
CONFORMANCE_CHECKS: Final[tuple[ConformanceCheck, ...]] = (
    _check(
        _storage_declaration,
        _EVERY,
        _always,
        "the declaration selects the checks below; a false one would choose the wrong ones",
        both=("breaks", "the report checked the wrong things: it cannot be relied on"),
    ),
    _check(
        _results_valid,
        _EVERY,
        _always,
        "the harness validates every answer of every engine at its boundary",
        both=_REFUSED,
    ),
    _check(
        _reingest_adds_nothing,
        _STORES,
        _stores,
        "an engine that keeps nothing (verified by storage_declaration) holds nothing twice",
        both=_TWICE,
    ),
    _check(
        _retried_after_turn_adds_nothing,
        _STORES,
        _stores,
        "an engine that keeps nothing has nothing a retried finalize could add to",
        both=_TWICE,
    ),
    _check(
        _restart_adds_nothing,
        _DURABLE,
        _durable,
        "only a store that outlives its instance meets itself again after a restart",
        both=("breaks", "after a host restart the model sees messages twice, or misses one"),
    ),
    _check(
        _within_budget,
        _CALLED,
        _always,
        "every assembly the harness asks for carries the turn's token budget, however the "
        "engine builds it (from its store or from the history it is handed)",
        both=(
            "breaks",
            "the context may not fit the model's window: Codex refuses the request or "
            "compacts the thread natively, behind the engine's back",
        ),
    ),
    _check(
        _tool_pairs_intact,
        _EVERY,
        _always,
        "any engine that leaves messages out can cut a tool call from its result",
        per_turn=(
            "breaks",
            "a structured turn cannot inject an orphan: it falls back to the text frame on "
            "a fresh thread, and the model sees a call without its result",
        ),
        thread_bootstrap=("breaks", "the model sees a tool call without its result"),
    ),
    _check(
        _deterministic,
        _EVERY,
        _always,
        "the harness compares assemblies (the kept fork, the projection epoch) by their bytes",
        per_turn=(
            "costs",
            "identical turns project differently: the kept fork is not continued and the "
            "prompt cache is lost",
        ),
        thread_bootstrap=(
            "costs",
            "the projection differs for the same state: the thread can be rotated for nothing",
        ),
    ),
    _check(
        _prefix_stable,
        _EVERY,
        _always,
        "a conversation that only grows is the case prompt caches and continued forks serve, "
        "whatever the engine stores",
        per_turn=(
            "costs",
            "each turn forks the session's base afresh and injects the whole assembly "
            "instead of continuing the kept fork: slower turns, the prompt cache reused only "
            "up to the first difference; the context itself is right (a sliding window fails "
            "here by design)",
        ),
        thread_bootstrap=(
            "harmless",
            "the context reaches a thread once per epoch; a later assembly need not extend "
            "an earlier one",
        ),
    ),
    _check(
        _epoch_stable,
        _THREAD_BOOTSTRAP,
        _always,
        "only a thread_bootstrap projection is keyed by its epoch",
        per_turn=("harmless", "a per-turn projection has no epoch"),
        thread_bootstrap=(
            "breaks",
            "an epoch that changes rotates the thread every turn; one kept after a "
            "compaction leaves the old context in the thread",
        ),
    ),
    _check(
        _compaction_honest,
        _EVERY,
        _always,
        "the harness acts on every engine's compaction report (clears the projection, "
        "reports it to the host)",
        both=("breaks", "the harness and the host act on a false compaction report"),
    ),
    _check(
        _compaction_converges,
        _OWNS,
        _always,
        "only an engine that owns compaction is asked to compact; others leave it to Codex",
        both=("breaks", "a forced compaction never ends, does not shrink, or damages the context"),
    ),
    _check(
        _sessions_isolated,
        _EVERY,
        _always,
        "one instance serves every session of a directory, stored or not",
        both=("breaks", "one session's messages reach another's model"),
    ),
    _check(
        _host_requirements_met,
        _EVERY,
        _always,
        "every engine is loaded by the same check of what it requires against what the host offers",
        both=("breaks", "the harness refuses the engine before any turn"),
    ),
    _check(
        _model_access_declared,
        _EVERY,
        _always,
        "the host lends its model in every engine's runtime context; a host without it lends "
        "none, and only a declaration lets it refuse the engine up front",
        both=(
            "breaks",
            "on a host that cannot lend its model the engine fails mid-session, or a request "
            "the host refuses leaves it without its summary",
        ),
    ),
    _check(
        _reset_archives_or_keeps,
        "engines with before_session_reset",
        _always,
        "only an engine with the hook hears of a reset; one without it keeps its state by "
        "default, which the host then knows",
        both=("breaks", "a reset session still sees its old conversation, or loses what it kept"),
    ),
    _check(
        _session_end_releases_only,
        "engines with session_end",
        _always,
        "only an engine with the hook is told a session ended",
        both=("breaks", "a session resumed after its end lost or doubled its context"),
    ),
    _check(
        _subagent_round_trip,
        "engines with prepare_subagent_spawn or on_subagent_ended (both required)",
        _always,
        "only an engine with the hooks seeds children and takes their results back",
        both=(
            "breaks",
            "a child's run damages its parent's context or another session's, or a child "
            "sees what it should not",
        ),
    ),
    _check(
        _control_answers,
        "engines with control",
        _always,
        "only an engine with control is offered to operators",
        both=("breaks", "an operator's status, doctor or rotate fails or lies"),
    ),
    _check(
        _compaction_abortable,
        _OWNS,
        _always,
        "only an engine that owns compaction is asked to compact, and so to stop",
        both=("costs", "an aborted compaction runs on, holding the session meanwhile"),
    ),
)

#: The checks of durable turns (``commit_turn``), run by :func:`check_engine_conformance` for
#: an engine that declares transcript semantics, and only for one: they are part of what such
#: an engine promises, and say nothing of the others (which keep after_turn and the ingests).
DURABLE_TURN_CHECKS: Final[tuple[ConformanceCheck, ...]] = (
    _check(
        _commit_turn_exactly_once,
        _COMMITS,
        _always,
        "only an engine that declares transcript semantics is settled with commit_turn; the "
        "others keep after_turn, ingest_batch or ingest (checked above)",
        both=(
            "breaks",
            "a turn recovered after a crash is applied twice or lost, or the model sees the "
            "current prompt twice",
        ),
    ),
)
