"""The conformance suite checks what it claims: a correct storing engine passes every check,
and each deliberately broken variant of it fails the check meant to catch that defect.

``ToyStore`` is a small, correct storing engine written for this purpose only (not product):
messages deduplicated by ``idempotencyKey`` (else by content), a fresh tail from the newest
user message, older context newest-first in tool-pair units while it fits, summaries of raw
chunks on compaction, a ``thread_bootstrap`` epoch that is a hash of the summary ids, and a
JSON file at the factory's path when durable. Each flag of :class:`Defects` breaks one rule
the way real engines have (lossless-claw's bug classes); each test names the check that must
then fail. Without these the suite's green results on the real engines would prove nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from codex_turn.frozen import thaw
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    CompactDetails,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    ContextProjection,
    ControlCapabilities,
    ControlRequest,
    ControlResult,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    LlmMessage,
    LlmRequest,
    SessionEndParams,
    SessionResetParams,
    SessionResetResult,
    SubagentEndedParams,
    SubagentSpawnParams,
    SubagentSpawnPreparation,
    runtime_llm,
)
from codex_turn.harness.session import load_session_messages
from codex_turn.testing import (
    CONFORMANCE_CHECKS,
    ConformanceReport,
    Storage,
    check_engine_conformance,
)

pytestmark = pytest.mark.anyio

ALL = frozenset(check.name for check in CONFORMANCE_CHECKS)
_instances = itertools.count()


@attrs.frozen
class Defects:
    """One flag per bug class; all false is a correct engine."""

    trusts_counts: bool = False  # after_turn appends messages[pre:] without deduplicating
    instance_epoch: bool = False  # the epoch depends on the instance (not on state)
    clock_in_prompt: bool = False  # the prompt addition renders now()
    splits_pairs: bool = False  # fills the budget message by message, not by tool-pair unit
    ignores_budget: bool = False  # returns everything whatever the budget
    lies_about_compaction: bool = False  # reports compacted=true and changes nothing
    shared_store: bool = False  # one store for every session
    elides_old_tool_output: bool = False  # renders tool results outside the tail differently
    epoch_per_turn: bool = False  # the epoch changes with every message
    forgets: bool = False  # never writes its file (declared durable anyway)
    mutates_input: bool = False  # edits a message it was handed
    hangs_in_assemble: bool = False
    # The contract's later part:
    undeclared_model: bool = False  # asks the host's model without declaring it
    needs_the_moon: bool = False  # requires a capability no host offers
    reset_lies: bool = False  # answers "archived" to a reset and keeps everything
    end_forgets: bool = False  # session_end drops the session
    fold_damages_parent: bool = False  # a child's end drops the parent's oldest message
    rotate_keeps: bool = False  # control(rotate) answers and changes nothing
    ignores_abort: bool = False  # compacts although the host aborted


def tokens(message: Any) -> int:
    return math.ceil(len(json.dumps(message, sort_keys=True)) / 4)


def key_of(message: dict[str, Any]) -> str:
    key = message.get("idempotencyKey")
    return key if isinstance(key, str) else json.dumps(thaw(message), sort_keys=True)


class ToyStore:
    """See the module docstring."""

    info = ContextEngineInfo(id="toy-store", name="Toy Store", owns_compaction=True)
    TAIL = 8

    def __init__(self, path: Path | None, defects: Defects = Defects()) -> None:
        self.path = path
        self.defects = defects
        if defects.needs_the_moon:
            self.info = attrs.evolve(self.info, host_requirements=frozenset({"the-moon"}))
        self.instance = next(_instances)
        # session -> items: {"kind": "message", "key", "message"} | {"kind": "summary", ...}
        self.sessions: dict[str, list[dict[str, Any]]] = {}
        #: The outcomes of the subagents each session ran (folded into its addition).
        self.results: dict[str, list[str]] = {}
        if path is not None and path.exists():
            self.sessions = json.loads(path.read_text())

    # --- storage ----------------------------------------------------------------------

    def _items(self, session_id: str) -> list[dict[str, Any]]:
        return self.sessions.setdefault("all" if self.defects.shared_store else session_id, [])

    def _save(self) -> None:
        if self.path is not None and not self.defects.forgets:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.sessions))
            tmp.replace(self.path)

    def _add(self, session_id: str, messages: list[dict[str, Any]], *, dedupe: bool = True) -> int:
        items = self._items(session_id)
        held = {item["key"] for item in items if item["kind"] == "message"}
        held |= {k for item in items if item["kind"] == "summary" for k in item["sources"]}
        added = 0
        for message in messages:
            key = key_of(message)
            if dedupe and key in held:
                continue
            held.add(key)
            items.append({"kind": "message", "key": key, "message": thaw(message)})
            added += 1
        self._save()
        return added

    # --- the contract -----------------------------------------------------------------

    async def bootstrap(self, params: BootstrapParams) -> BootstrapResult:
        messages = [dict(m) for m in load_session_messages(params.session_file)]
        imported = self._add(params.session_id, messages)
        return BootstrapResult(bootstrapped=True, imported_messages=imported)

    async def ingest(self, params: IngestParams) -> IngestResult:
        if self.defects.mutates_input:
            params.message["seen"] = True
        return IngestResult(ingested=self._add(params.session_id, [params.message]) > 0)

    async def ingest_batch(self, params: IngestBatchParams) -> IngestBatchResult:
        return IngestBatchResult(ingested_count=self._add(params.session_id, params.messages))

    async def after_turn(self, params: AfterTurnParams) -> None:
        llm = runtime_llm(params.runtime_context)
        if self.defects.undeclared_model and llm is not None:
            await llm.complete(LlmRequest(messages=(LlmMessage("user", "hi"),), purpose="summary"))
        if self.defects.trusts_counts:
            new = params.messages[params.pre_prompt_message_count :]
            self._add(params.session_id, list(new), dedupe=False)
        else:
            self._add(params.session_id, list(params.messages))

    def _render(self, item: dict[str, Any], in_tail: bool) -> dict[str, Any]:
        if item["kind"] == "summary":
            return {"role": "user", "content": [{"type": "text", "text": item["text"]}]}
        message: dict[str, Any] = item["message"]
        elide = self.defects.elides_old_tool_output and not in_tail
        if elide and message.get("role") == "toolResult":
            return {**message, "content": [{"type": "text", "text": "[elided]"}]}
        return message

    def _units(self, items: list[dict[str, Any]]) -> list[list[int]]:
        """Item indexes grouped so a tool call and its results are one unit."""
        units: list[list[int]] = []
        for index, item in enumerate(items):
            message = item.get("message") or {}
            joins = message.get("role") == "toolResult" and not self.defects.splits_pairs
            if joins and units:
                units[-1].append(index)
            else:
                units.append([index])
        return units

    def _tail_start(self, items: list[dict[str, Any]]) -> int:
        for index in range(len(items) - 1, -1, -1):
            if items[index].get("message", {}).get("role") == "user":
                return index
        return len(items)

    def _epoch(self, items: list[dict[str, Any]]) -> str:
        ids = [item["id"] for item in items if item["kind"] == "summary"]
        if self.defects.instance_epoch:
            ids.append(str(self.instance))
        if self.defects.epoch_per_turn:
            ids.append(str(len(items)))
        return hashlib.sha256("|".join(ids).encode()).hexdigest()[:16]

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        if self.defects.hangs_in_assemble:
            await anyio.sleep_forever()
        items = self._items(params.session_id)
        budget = params.token_budget or 10**9
        tail = self._tail_start(items)
        chosen = [self._render(item, True) for item in items[tail:]]
        used = sum(map(tokens, chosen))
        older: list[dict[str, Any]] = []
        for unit in reversed(self._units(items[:tail])):
            rendered = [self._render(items[i], False) for i in unit]
            cost = sum(map(tokens, rendered))
            if used + cost > budget and not self.defects.ignores_budget:
                break
            older[:0] = rendered
            used += cost
        return AssembleResult(
            messages=older + chosen,
            estimated_tokens=used,
            system_prompt_addition=f"as of {time.time_ns()}"
            if self.defects.clock_in_prompt
            else (", ".join(self.results.get(params.session_id, ())) or None),
            context_projection=ContextProjection("thread_bootstrap", self._epoch(items)),
        )

    async def compact(self, params: CompactParams) -> CompactResult:
        aborted = params.abort_signal is not None and params.abort_signal.aborted
        if aborted and not self.defects.ignores_abort:
            return CompactResult(ok=True, compacted=False, reason="aborted")
        items = self._items(params.session_id)
        before = sum(tokens(self._render(item, False)) for item in items)
        if self.defects.lies_about_compaction:
            details = CompactDetails(tokens_before=before, tokens_after=before - 1)
            return CompactResult(ok=True, compacted=True, result=details)
        budget = params.token_budget or 10**9
        if not params.force and before <= budget:
            return CompactResult(ok=True, compacted=False, reason="under budget")
        tail = min(self._tail_start(items), len(items) - self.TAIL)
        eligible = [
            unit
            for unit in self._units(items)
            if unit[-1] < tail and all(items[i]["kind"] == "message" for i in unit)
        ]
        chunks: list[list[int]] = []
        for unit in eligible:  # runs of adjacent whole units, at most 16 messages each
            if chunks and unit[0] == chunks[-1][-1] + 1 and len(chunks[-1]) + len(unit) <= 16:
                chunks[-1].extend(unit)
            else:
                chunks.append(list(unit))
        chunks = [chunk for chunk in chunks if len(chunk) >= 2]
        if not chunks:
            return CompactResult(ok=True, compacted=False, reason="nothing eligible")
        summaries: dict[int, dict[str, Any]] = {}
        for chunk in chunks:
            sources = [items[i]["key"] for i in chunk]
            digest = hashlib.sha256("|".join(sources).encode()).hexdigest()[:12]
            text = f"[summary {digest} of {len(chunk)} messages]"
            summaries[chunk[0]] = {
                "kind": "summary",
                "id": digest,
                "sources": sources,
                "text": text,
            }
        dropped = {i for chunk in chunks for i in chunk}
        items[:] = [
            summaries.get(i, item)
            for i, item in enumerate(items)
            if i in summaries or i not in dropped
        ]
        self._save()
        after = sum(tokens(self._render(item, False)) for item in items)
        details = CompactDetails(tokens_before=before, tokens_after=after)
        return CompactResult(ok=True, compacted=after < before, result=details)

    # --- the contract's later hooks ----------------------------------------------------

    async def before_session_reset(self, params: SessionResetParams) -> SessionResetResult:
        if self.defects.reset_lies:
            return SessionResetResult(action="archived")
        self.sessions.pop(params.session_id, None)
        self.results.pop(params.session_id, None)
        self._save()
        return SessionResetResult(action="archived")

    async def session_end(self, params: SessionEndParams) -> None:
        if self.defects.end_forgets:
            self.sessions.pop(params.session_id, None)

    async def prepare_subagent_spawn(self, params: SubagentSpawnParams) -> SubagentSpawnPreparation:
        held = len(self._items(params.parent_session_id))
        return SubagentSpawnPreparation(system_prompt_addition=f"the parent holds {held} items")

    async def on_subagent_ended(self, params: SubagentEndedParams) -> None:
        if params.outcome != "spawn_failed":
            self.results.setdefault(params.parent_session_id, []).append(params.outcome)
        if self.defects.fold_damages_parent:
            del self._items(params.parent_session_id)[0]

    def control_capabilities(self) -> ControlCapabilities:
        return ControlCapabilities(actions=frozenset({"status", "rotate"}))

    async def control(self, request: ControlRequest) -> ControlResult:
        if request.action == "rotate" and not self.defects.rotate_keeps:
            session = (request.session_key or "").rpartition(":")[2]
            self.sessions.pop(session, None)
            self._save()
        return ControlResult(ok=True, action=request.action, summary=f"{len(self.sessions)}")

    async def dispose(self) -> None:
        return None


async def run(
    tmp_path: Path,
    defects: Defects = Defects(),
    *,
    storage: Storage = "durable",
    checks: frozenset[str] = ALL,
    limit: float = 60.0,
) -> ConformanceReport:
    return await check_engine_conformance(
        lambda path: ToyStore(None if storage == "memory" else path, defects),
        workdir=tmp_path,
        storage=storage,
        checks=[c for c in CONFORMANCE_CHECKS if c.name in checks],
        timeout=limit,
    )


async def test_a_correct_durable_engine_passes_every_check(tmp_path: Path) -> None:
    report = await run(tmp_path)
    report.assert_conforms()
    assert report.passed == tuple(c.name for c in CONFORMANCE_CHECKS)
    assert "a compaction changed the epoch, then it stayed stable" in (
        report.result("epoch_stable").notes
    )


async def test_a_correct_memory_engine_passes_all_but_the_restart_check(tmp_path: Path) -> None:
    report = await run(tmp_path, storage="memory")
    report.assert_conforms(not_applicable={"restart_adds_nothing"})
    assert report.result("restart_adds_nothing").reason == "declared storage 'memory', not durable"


@pytest.mark.parametrize(
    ("defects", "caught_by"),
    [
        pytest.param(
            Defects(trusts_counts=True),
            {"reingest_adds_nothing", "retried_after_turn_adds_nothing", "restart_adds_nothing"},
            id="trusts-counts",
        ),
        pytest.param(Defects(clock_in_prompt=True), {"deterministic"}, id="clock-in-prompt"),
        # Within one store the epoch must not change on a restart; across two stores
        # (deterministic) only where it changes must coincide, and it does here.
        pytest.param(
            Defects(instance_epoch=True),
            {"restart_adds_nothing", "storage_declaration"},
            id="instance-epoch",
        ),
        pytest.param(Defects(splits_pairs=True), {"tool_pairs_intact"}, id="splits-pairs"),
        pytest.param(Defects(ignores_budget=True), {"within_budget"}, id="ignores-budget"),
        pytest.param(
            Defects(lies_about_compaction=True),
            {"compaction_honest", "compaction_converges"},
            id="lies-about-compaction",
        ),
        pytest.param(Defects(shared_store=True), {"sessions_isolated"}, id="shared-store"),
        pytest.param(
            Defects(elides_old_tool_output=True), {"prefix_stable"}, id="elides-old-output"
        ),
        pytest.param(Defects(epoch_per_turn=True), {"epoch_stable"}, id="epoch-per-turn"),
        # Not restart_adds_nothing: its bootstrap re-imports the transcript, so a restart is
        # invisible; only its declaration ("durable") is false.
        pytest.param(Defects(forgets=True), {"storage_declaration"}, id="forgets"),
        pytest.param(
            Defects(undeclared_model=True), {"model_access_declared"}, id="undeclared-model"
        ),
        pytest.param(Defects(needs_the_moon=True), {"host_requirements_met"}, id="needs-moon"),
        pytest.param(Defects(reset_lies=True), {"reset_archives_or_keeps"}, id="reset-lies"),
        pytest.param(Defects(end_forgets=True), {"session_end_releases_only"}, id="end-forgets"),
        pytest.param(Defects(fold_damages_parent=True), {"subagent_round_trip"}, id="fold-damages"),
        pytest.param(Defects(rotate_keeps=True), {"control_answers"}, id="rotate-keeps"),
        pytest.param(Defects(ignores_abort=True), {"compaction_abortable"}, id="ignores-abort"),
    ],
)
async def test_each_defect_fails_the_check_meant_to_catch_it(
    tmp_path: Path, defects: Defects, caught_by: set[str]
) -> None:
    report = await run(tmp_path, defects, checks=frozenset(caught_by | {"deterministic"}))
    assert set(report.failed) == caught_by, report.format()


async def test_a_storing_engine_declared_stateless_fails_the_declaration(tmp_path: Path) -> None:
    report = await check_engine_conformance(
        lambda path: ToyStore(path),
        workdir=tmp_path,
        storage="none",
        checks=["storage_declaration"],
    )
    assert report.failed == ("storage_declaration",)
    assert 'declared storage "none"' in report.result("storage_declaration").reason


async def test_an_engine_editing_its_input_fails_on_the_read_only_message(tmp_path: Path) -> None:
    report = await check_engine_conformance(
        lambda path: ToyStore(path, Defects(mutates_input=True)),
        workdir=tmp_path,
        storage="durable",
        checks=["results_valid"],
    )
    assert report.failed == ("results_valid",)
    assert "ingest() raised TypeError" in report.result("results_valid").reason


async def test_a_hanging_engine_fails_by_timeout_and_is_still_disposed(tmp_path: Path) -> None:
    report = await run(
        tmp_path, Defects(hangs_in_assemble=True), checks=frozenset({"deterministic"}), limit=0.5
    )
    assert report.failed == ("deterministic",)
    assert report.result("deterministic").reason == "did not finish within 0.5s"


class _NaNStore(ToyStore):
    """A correct store whose assembly carries a float NaN (not JSON) in one message."""

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        result = await super().assemble(params)
        scored = {"role": "custom", "customType": "score", "content": "s", "score": math.nan}
        return attrs.evolve(result, messages=[*result.messages, scored])


async def test_an_assembly_holding_nan_fails_the_check_instead_of_raising(tmp_path: Path) -> None:
    report = await check_engine_conformance(
        lambda path: _NaNStore(path),
        workdir=tmp_path,
        storage="durable",
        checks=["results_valid", "deterministic"],
    )
    assert report.failed == ("results_valid", "deterministic"), report.format()
    for check in report.failed:
        assert "NaN or an infinity" in report.result(check).reason
