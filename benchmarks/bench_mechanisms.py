"""Machinery must pay for itself: every mechanism that exists for speed, on and off.

    .venv/bin/python benchmarks/bench_mechanisms.py [--quick] [--delays 0,1.5]
        [--rounds 10] [--delay-rounds 8] [--warmup 1] [--only kept-forks,memo,...]
        [--sizes 1000,10000] [--instructions-kb 8] [--idle-wait 35] [--tmp DIR]

The rule
--------
A mechanism that exists for speed stays only if it saves at least 5 % of a turn whose model
answers after a realistic delay (first byte after 1.5 s), or 5 % of a stated cost a user
pays: the turn's input bill (tokens re-sent to the model) or the memory of Codex's
app-server. Its figures are measured here with the offline model answering instantly *and*
after that delay (:attr:`codex_turn.testing.OfflineModel.first_byte_delay`), ON (the library
as it is) against OFF (the mechanism switched off), interleaved round by round with the bare
JSON-RPC floor and the durable floor of ``bench_floor.py`` in the same run (the order rotates
every round), so machine noise hits every configuration alike.

The mechanisms (:data:`MECHANISM_TABLE`; ``--only`` takes their keys)
---------------------------------------------------------------------
(``stages``, ``executors``, ``forms``: the modules of ``codex_turn.harness.turn``.)

* ``kept-forks``: after a turn in a fork of the session's base (the structured projection),
  the fork is kept and the next turn *continues* it, injecting only new items
  (the fork table ``FORK_RULES`` in the thread plan, ``executors._continued_fork``, the keep
  table ``KEEP_RULES`` in ``forms.settle_fork``, the ``KeptFork`` record in the app-server).
  OFF: the plan's fork is always ``new`` and the fork is released after its turn (every
  turn forks the base afresh and injects the whole assembly, then the turn's instructions).
  The conversion memo, which rides in the kept fork's record, is then carried by this script
  (one per session), so the row measures the forks alone. Per-turn pass-through engine (the
  transcript as the assembly, per-turn projection), ``context_token_budget`` 1M tokens (cap:
  1M characters): at 1k messages the whole assembly fits and only grows (the case kept
  forks are for); at 10k the newest ~1M characters are sent, a window whose start moves
  every few turns (each move forks afresh, ON as OFF).
* ``memo``: the :class:`~codex_turn.projection.items.ConversionCache` carried from turn to
  turn (``forms.session_conversion``). OFF: no cache (every turn converts and checks the
  whole assembly). Same sessions as ``kept-forks``.
* ``lazy``: the text frame rendered only when a row of the thread table reads
  ``has_context`` or the decision sends it (``forms.TurnThreadFacts``,
  ``stages._frame_if_sent``): none for a thread-bootstrap engine resuming its epoch's thread,
  which gets the raw prompt. OFF: the frame is rendered before the thread decision.
  Pass-through thread-bootstrap engine (``bench_floor``'s), 10k messages.
* ``read-cache``: the session read cache (``harness/session/_cache.py``: a transcript that
  only grew is read in O(new bytes)). OFF: every access of this session's transcript (the
  preflight, the reads, the mirror) starts from a fresh parse; the stripped-history cache,
  which extends the read cache's list, rebuilds too. Same engine, 10k messages.
* ``stripped-cache``: the stripped, frozen history kept per session and extended by what was
  appended (``harness/history_cache.py``). OFF: its entry is forgotten before every read
  (the read cache stays). Same engine, 10k messages.

Removed by this rule (their rows and switches are gone with them; figures of the run that
judged them, 2026-12-03, plain sessions, no engine, ON/OFF client CPU in ms a turn):

* resume reuse (``turn/start`` straight to a thread this process held unchanged, instead of
  ``thread/resume``): 1.003 x floor ON, 1.006 OFF, saving +0.2% of a turn at 1.5 s, CPU
  5.9/6.7, the same bytes sent to the model. Every turn on a bound thread resumes.
* the prompt's fsync overlapping ``turn/start`` and the model's turn (``_PromptSync``
  through ``run_in_worker_then``), against the fsync in the write's own hop: +0.3 % of a
  turn at 1.5 s (-0.6 %..+0.6 %), CPU 5.9/5.8; +1.1 % at 0 s (-24.4 %..+13.6 %). The prompt
  is now written and fsynced in one hop before ``turn/start``.
* the harness's own worker threads (``harness/_fs.py``: a ``queue.SimpleQueue`` pool, a hop
  two event-loop rounds) against ``anyio.to_thread.run_sync`` for every hop: +0.1 % at
  1.5 s (-0.4 %..+0.4 %), CPU 5.9/5.8; +0.2 % at 0 s (-6.7 %..+28.9 %). A hop is now
  anyio's, under a limiter of the old pool's size.
* the harness's own history handed back unchanged by an engine's ``assemble`` accepted
  without the per-message type check (a list noting its own changes): 1.005 x floor ON,
  1.003 OFF at 1.5 s (10k messages, +0.1%), CPU 6.9/7.4. Every assembly is checked.

Switches are made here only: module-level names of the library are patched for the OFF
configuration's steps (``unittest.mock.patch.object``), and restored before any other
configuration runs. Every configuration has a *path check*: a counting wrapper around the
decision its mechanism switches (kept forks continued, threads resumed, frames rendered), so
a row shows that ON took the fast path and OFF did not. Every thread (the floors' too)
carries the same developer instructions, ``--instructions-kb`` (8) KB of them: a host's
workspace rules (OpenClaw sends its bootstrap files this way); in a fresh fork they follow
the injected context, so their size is what a fresh fork re-sends outside the cache.

What is measured, per configuration and delay
---------------------------------------------
* wall time per turn: the median, its ratio to the floor's median (``x fl``) and to the
  durable floor's (``x dur``); ``saving``: per round, (OFF - ON) / OFF, the median over the
  rounds and its spread (25th..75th percentile);
* client CPU per turn (``time.process_time()`` of this process, all threads; the model runs
  in a child process, as in ``bench_floor.py``): medians, noisy on a shared machine;
* what the model was sent (recorded by the offline model in its child process), means per
  turn: the request's ``input`` in KB (items serialized without their ``id``, which is
  metadata, not tokens) and the *uncached* part: the bytes after the longest item-by-item
  identical prefix of the same session's previous request with the same
  ``prompt_cache_key`` (what a prefix prompt cache cannot serve; a new key serves nothing).
  The input bill weighs a cached byte :data:`CACHED_INPUT_PRICE` of an uncached one;
* ``codex RSS``: the resident memory of the Codex app-server process of a structured
  configuration (each has its own), the median over the phase's turns (a released fork
  stays loaded ``thread_unload_delay_secs``, 30 s, so forks released by turns less than 30 s
  apart pile up; a kept fork stays until the session's next turn), and once more after
  ``--idle-wait`` seconds without turns at the end (shown, not judged: then only kept forks
  are loaded).

Verdict, per row at the realistic delay (the largest of ``--delays``): ``keep`` when the
median saving is >= 5 % of the turn, or ON's input bill or codex RSS is >= 5 % smaller;
else ``remove``. A mechanism is kept when any of its rows says so. Client CPU is shown, not
judged (it is noisy here; it matters for throughput, see ``bench_floor.py`` phase C).

``--quick`` (a smoke run, under a minute on an idle machine): delays 0 and 0.3 s, 2 rounds
(+1 warm-up), 200 and 1,000 messages instead of 1k and 10k, no idle wait.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import attrs
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_floor
from bench_engine import conversation
from bench_floor import (
    ANOMALIES,
    BareClient,
    Config,
    DurableFloorConfig,
    FloorConfig,
    ModelProcess,
    PassThroughEngine,
    Sample,
    Session,
    _timed,
    print_run_end,
    write_session,
)

import codex_turn.harness.session._cache as session_cache
import codex_turn.harness.session._mirror as session_mirror
import codex_turn.harness.session._writable as session_writable
import codex_turn.harness.turn.context as turn_context
import codex_turn.harness.turn.executors as executors
import codex_turn.harness.turn.forms as forms
import codex_turn.harness.turn.stages as stages
from codex_turn import TurnParams, TurnResult
from codex_turn.fsm.thread import Choice, ForkAction, ThreadAction, ThreadPlan
from codex_turn.harness._fs import session_path
from codex_turn.harness.appserver import AppServer, AppServerConfig, bundled_codex_path
from codex_turn.harness.appserver.config import FORK_UNLOAD_DELAY_S
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    IngestParams,
    IngestResult,
)
from codex_turn.harness.session import budget, clear_session_cache
from codex_turn.projection.items import ConversionCache

SAVING_THRESHOLD = 0.05
#: What a cached input token costs against an uncached one (OpenAI's GPT-5 family and
#: gpt-4.1: a tenth): a turn's input bill is uncached + CACHED_INPUT_PRICE x cached.
CACHED_INPUT_PRICE = 0.1
STRUCTURED_BUDGET_TOKENS = 1_000_000  # the items' cap: 1M characters (the ceiling)
REALISTIC_DELAY_S = 1.5


# --- the mechanisms, as data -----------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One configuration: a kind of session, its history, and the switch turned off."""

    kind: str  # "structured" (per-turn items), "bootstrap" (thread_bootstrap), "plain"
    messages: int
    off: str | None = None  # a key of SWITCHES; None: the library as it is

    @property
    def name(self) -> str:
        size = f"-{label(self.messages)}" if self.kind != "plain" else ""
        return f"{self.kind}{size}" + (f"-{self.off}" if self.off else "")


@dataclass(frozen=True)
class Mechanism:
    key: str
    title: str
    on: Variant
    off: Variant


def label(messages: int) -> str:
    return f"{messages // 1000}k" if messages >= 1000 and messages % 1000 == 0 else str(messages)


#: This script: its ``--serve-model`` answers ``delay`` and ``requests`` besides ``stats``.
SCRIPT = Path(__file__).resolve()

#: key, title, kind of session, history ("small", "large" or none), switch turned off.
MECHANISM_TABLE: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("kept-forks", "kept forks", "structured", ("small", "large"), "nofork"),
    ("memo", "conversion memo", "structured", ("small", "large"), "nomemo"),
    ("lazy", "lazy projection", "bootstrap", ("large",), "eager"),
    ("read-cache", "session read cache", "bootstrap", ("large",), "noreadcache"),
    ("stripped-cache", "stripped-history cache", "bootstrap", ("large",), "nostripped"),
)
MECHANISM_KEYS = tuple(row[0] for row in MECHANISM_TABLE)


def mechanisms(small: int, large: int) -> list[Mechanism]:
    """Each row: the mechanism, its ON configuration and its OFF one (``--sizes``)."""
    sizes = {"small": small, "large": large, "none": 0}
    return [
        Mechanism(key, title, Variant(kind, sizes[size]), Variant(kind, sizes[size], off))
        for key, title, kind, histories, off in MECHANISM_TABLE
        for size in histories
    ]


# --- the offline model, in a child process, with its first-byte delay and request summaries --

_TAG = re.compile(r"turn (\d+) of (\S+)")


def _item_bytes(items: Sequence[Any]) -> list[bytes]:
    """Each input item as the model reads it: its JSON without the ``id`` (metadata)."""
    out = []
    for item in items:
        if isinstance(item, dict):
            item = {k: v for k, v in item.items() if k != "id"}
        out.append(json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode())
    return out


def shared_prefix(previous: Sequence[bytes], current: Sequence[bytes]) -> int:
    """Bytes of ``current`` equal to ``previous`` item by item from the start."""
    shared = 0
    for before, now in zip(previous, current, strict=False):
        if before != now:
            break
        shared += len(now)
    return shared


class RequestSummaries:
    """Per configuration (the ``turn N of NAME`` in the request's last user message): input
    bytes and the bytes outside the previous request's identical prefix (same cache key)."""

    def __init__(self) -> None:
        self.previous: dict[str, tuple[Any, list[bytes]]] = {}
        self.out: list[dict[str, Any]] = []

    def add(self, body: Any, last_user_text: str) -> None:
        matches = _TAG.findall(last_user_text)
        if not matches or not isinstance(body, dict):
            return
        number, tag = int(matches[-1][0]), matches[-1][1]
        items = body.get("input")
        current = _item_bytes(items if isinstance(items, list) else [])
        key = body.get("prompt_cache_key")
        total = sum(map(len, current))
        before = self.previous.get(tag)
        shared = shared_prefix(before[1], current) if before and before[0] == key else 0
        self.previous[tag] = (key, current)
        self.out.append(
            {
                "tag": tag,
                "n": number,
                "input": total,
                "uncached": total - shared,
                "items": len(current),
            }
        )


def serve_model() -> None:
    """``--serve-model``: the offline model here; commands on stdin, one JSON line each back:
    ``delay S`` (first-byte delay), ``requests`` (summaries since the last call), ``stats``."""
    from codex_turn.testing import OfflineModel

    with OfflineModel() as model:
        print(json.dumps({"base_url": model.base_url, "proxy_env": model.proxy_env()}), flush=True)
        summaries = RequestSummaries()
        lock = threading.Lock()
        seen = 0
        stop = threading.Event()

        def summarise() -> None:  # the requests are large (~1 MB): keep only the figures
            nonlocal seen
            batch, model.requests = model.requests, []
            time.sleep(0.005)  # an append racing the swap lands in ``batch``
            with lock:
                seen += len(batch)
                for request in batch:
                    if not request.is_compaction and not request.is_image_request:
                        summaries.add(request.body, request.last_user_text)

        def loop() -> None:
            while not stop.wait(0.2):
                summarise()

        worker = threading.Thread(target=loop, daemon=True)
        worker.start()
        for line in sys.stdin:
            command, _, argument = line.strip().partition(" ")
            if command == "delay":
                model.first_byte_delay = float(argument)
                reply: Any = {"delay": model.first_byte_delay}
            elif command == "requests":
                summarise()
                with lock:
                    reply, summaries.out = summaries.out, []
            elif command == "stats":
                summarise()
                reply = {"requests": seen, "proxy_attempts": len(model.proxy_attempts)}
            else:
                reply = {"error": f"unknown command {command!r}"}
            print(json.dumps(reply), flush=True)
        stop.set()


# --- engines and sessions -----------------------------------------------------------------------


class PerTurnPassThrough:
    """A per-turn engine (no declared projection) whose assembly is the transcript as read:
    the conversation only grows, turn by turn, as the harness mirrors it."""

    info = ContextEngineInfo(id="bench-per-turn", name="Bench per-turn pass-through", version="1")

    async def ingest(self, params: IngestParams) -> IngestResult:
        return IngestResult(ingested=True)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        return AssembleResult(messages=params.messages, estimated_tokens=0)

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(ok=True, compacted=False)

    async def after_turn(self, params: AfterTurnParams) -> None:
        return None


class BenchSession(Session):
    """``bench_floor``'s session with a token budget (the structured items' cap)."""

    def __init__(
        self, name: str, path: Path, workspace: Path, engine: Any, budget: int | None
    ) -> None:
        super().__init__(name, path, workspace, engine)
        self.budget = budget

    def params(self, prompt: str) -> TurnParams:
        params = super().params(prompt)
        if self.budget is None:
            return params
        return attrs.evolve(params, context_token_budget=self.budget)


# --- switches and path checks -------------------------------------------------------------------

Patches = Callable[["MechanismConfig"], Sequence[AbstractContextManager[Any]]]


def _plan(
    config: MechanismConfig, override: Callable[[ThreadPlan], ThreadPlan] | None = None
) -> list[AbstractContextManager[Any]]:
    """Count how each turn's thread plan obtains the thread (a kept fork continued or a
    fresh one; a bound thread resumed), after ``override`` changed it."""
    original = executors.plan_thread

    def plan(decision: Any, facts: Any) -> ThreadPlan:
        planned = original(decision, facts)
        if override is not None:
            planned = override(planned)
        if planned.fork is not None:
            config.count(f"fork-{planned.fork.action.value}")
        elif planned.action is ThreadAction.RESUME:
            config.count("resume")
        return planned

    return [mock.patch.object(executors, "plan_thread", plan)]


def _frame(config: MechanismConfig, *, eager: bool = False) -> list[AbstractContextManager[Any]]:
    """Count whether the thread decision left the text frame unrendered (``lazy``);
    ``eager``: render it first, whatever the decision will send."""
    original = stages.decide_thread

    def decide_thread(ctx: Any) -> Any:
        projected = ctx.projected
        if eager and projected is not None and projected.items is None and not projected.framed:
            ctx.projected = forms.frame_projection(ctx)
        decision = original(ctx)
        framed = ctx.projected is not None and ctx.projected.framed
        config.count("framed" if framed else "lazy")
        return decision

    return [mock.patch.object(stages, "decide_thread", decide_thread)]


SPIES: dict[str, Patches] = {"structured": _plan, "plain": _plan, "bootstrap": _frame}


def _no_kept_forks(config: MechanismConfig) -> list[AbstractContextManager[Any]]:
    """Every turn forks the base afresh; the fork is released after its turn. The memo the
    kept fork's record carried is carried here instead (one per session)."""
    memo = config.memo

    def fresh(plan: ThreadPlan) -> ThreadPlan:
        if plan.fork is None:
            return plan
        return attrs.evolve(plan, fork=Choice(ForkAction.NEW, "bench-kept-forks-off"))

    def release(ctx: Any, ran: Any) -> None:
        forms.settle_fork(ctx, None)  # the library's own release of a fork it does not keep

    def conversion(ctx: Any) -> ConversionCache:
        return memo

    return [
        *_plan(config, fresh),
        mock.patch.object(stages, "settle_fork", release),
        mock.patch.object(stages, "session_conversion", conversion),
    ]


def _no_memo(config: MechanismConfig) -> list[AbstractContextManager[Any]]:
    """No conversion state from turn to turn: the whole assembly converted and checked."""

    def no_cache(ctx: Any) -> None:
        return None

    return [*_plan(config), mock.patch.object(stages, "session_conversion", no_cache)]


def _eager_frame(config: MechanismConfig) -> list[AbstractContextManager[Any]]:
    return _frame(config, eager=True)


def _no_read_cache(config: MechanismConfig) -> list[AbstractContextManager[Any]]:
    """Every access of this session's transcript starts from a fresh parse."""
    key = session_path(config.session.path)
    patches = [*_frame(config)]
    for module in (session_cache, session_mirror, session_writable):
        original = module.state_for

        def cold(target: str, original: Callable[[str], Any] = original) -> Any:
            if target == key:
                clear_session_cache(target)
            return original(target)

        patches.append(mock.patch.object(module, "state_for", cold))
    return patches


def _no_stripped_cache(config: MechanismConfig) -> list[AbstractContextManager[Any]]:
    """The stripped-history entry of this session forgotten before every read (private
    names of the cache: a benchmark's switch, not an API)."""
    shared = turn_context.stripped_histories
    key = session_path(config.session.path)

    class Cold:
        def read(self, session_file: str) -> Any:
            if session_path(session_file) == key:
                with shared._lock:
                    dropped = shared._entries.pop(session_file, None)
                if dropped is not None:
                    budget.release((id(shared), session_file))
            return shared.read(session_file)

    return [*_frame(config), mock.patch.object(turn_context, "stripped_histories", Cold())]


SWITCHES: dict[str, Patches] = {
    "nofork": _no_kept_forks,
    "nomemo": _no_memo,
    "eager": _eager_frame,
    "noreadcache": _no_read_cache,
    "nostripped": _no_stripped_cache,
}

#: The thread action every turn of a kind must take (else the row measures something else).
EXPECTED_ACTION = {
    "structured": ThreadAction.FORK,
    "plain": ThreadAction.RESUME,
    "bootstrap": ThreadAction.RESUME,
}


# --- configurations -----------------------------------------------------------------------------


class MechanismConfig(Config):
    codex_turn = True

    def __init__(
        self, variant: Variant, server: AppServer, session: BenchSession, own_server: bool
    ) -> None:
        super().__init__(variant.name)
        self.variant = variant
        self.server, self.session, self.own_server = server, session, own_server
        self.memo = ConversionCache()  # the OFF kept-forks switch carries it here
        self.recording = False
        self.paths: collections.Counter[str] = collections.Counter()
        self.rss: list[float] = []
        switch = SWITCHES[variant.off] if variant.off else SPIES[variant.kind]
        self._switch = switch

    def count(self, what: str) -> None:
        if self.recording:
            self.paths[what] += 1

    def reset(self) -> None:
        self.samples.clear()
        self.rounds.clear()
        self.paths.clear()
        self.rss.clear()

    async def measure(self, round_: int, *, record: bool) -> Sample:
        self.recording = record
        sample = await super().measure(round_, record=record)
        if record and self.own_server:
            self.rss.append(await codex_rss_mb(self.server))
        return sample

    async def step(self, prompt: str) -> Sample:
        with contextlib.ExitStack() as stack:
            for patch in self._switch(self):
                stack.enter_context(patch)
            result, wall, cpu = await _timed(self.session.run(self.server, prompt))
        self._check(result)
        return Sample(wall, cpu)

    def _check(self, result: TurnResult) -> None:
        decision = result.thread_decision
        expected = EXPECTED_ACTION[self.variant.kind]
        if decision is None or decision.action is not expected:
            ANOMALIES.note(f"{self.name}: {decision.action.value if decision else None}")


async def codex_rss_mb(server: AppServer) -> float:
    client = await server.client()
    pid = getattr(client.transport, "pid", None)
    if pid is None:
        return float("nan")
    return rss_mb(pid)


def rss_mb(pid: int | str = "self") -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class World:
    args: argparse.Namespace
    stack: contextlib.AsyncExitStack
    model: ModelProcess
    root: Path
    workspace: Path
    shared: AppServer | None = None
    servers: int = 0

    def app_config(self, name: str) -> AppServerConfig:
        return AppServerConfig.offline(
            self.root / name, self.model.base_url, home=self.root / "home", env=self.model.proxy_env
        )

    async def server(self, own: bool) -> AppServer:
        if own or self.shared is None:
            self.servers += 1
            server = await self.stack.enter_async_context(
                AppServer.start(self.app_config(f"server-{self.servers}"))
            )
            if own:
                return server
            self.shared = server
        return self.shared

    async def floors(self) -> tuple[FloorConfig, DurableFloorConfig]:
        client = await self.stack.enter_async_context(BareClient(self.app_config("bare")))
        threads = []
        for _ in range(2):
            thread_id = await client.start_thread(str(self.workspace))
            await client.run_turn(thread_id, "prime")
            threads.append(thread_id)
        return FloorConfig("floor", client, threads[0]), DurableFloorConfig(
            client, threads[1], self.root
        )

    async def config(self, variant: Variant) -> MechanismConfig:
        directory = self.root / "sessions"
        directory.mkdir(exist_ok=True)
        path = directory / f"{variant.name}.jsonl"
        if variant.messages:
            write_session(path, variant.name, conversation(variant.messages))
        engine: Any
        budget: int | None = None
        if variant.kind == "structured":
            engine, budget = PerTurnPassThrough(), STRUCTURED_BUDGET_TOKENS
        elif variant.kind == "bootstrap":
            engine = PassThroughEngine()
        else:
            engine = None
        session = BenchSession(variant.name, path, self.workspace, engine, budget)
        own = variant.kind == "structured"  # its app-server's memory is measured
        server = await self.server(own)
        config = MechanismConfig(variant, server, session, own)
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for patch in config._switch(config):
                stack.enter_context(patch)
            await session.prime(server)
        print(f"  {variant.name}: primed in {time.perf_counter() - started:.1f} s", flush=True)
        return config


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Phase:
    delay: float
    configs: dict[str, Config]
    requests: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    rss: dict[str, float] = field(default_factory=dict)
    paths: dict[str, collections.Counter[str]] = field(default_factory=dict)
    snapshots: dict[str, tuple[list[Sample], list[int]]] = field(default_factory=dict)


async def run_phase(
    world: World, configs: Sequence[Config], delay: float, rounds: int, warmup: int
) -> Phase:
    world.model.ask(f"delay {delay}")
    world.model.ask("requests")  # drop what earlier phases left
    for config in configs:
        if isinstance(config, MechanismConfig):
            config.reset()
        else:
            config.samples.clear()
            config.rounds.clear()
    recorded: dict[str, set[int]] = collections.defaultdict(set)
    started = time.perf_counter()
    count = len(configs)
    for round_ in range(warmup + rounds):
        shift = round_ % count
        for config in [*configs[shift:], *configs[:shift]]:
            record = round_ >= warmup
            await config.measure(round_, record=record)
            if record:
                recorded[config.name].add(config.calls)
    print(
        f"  delay {delay:g} s: {warmup} + {rounds} rounds of {count} configurations in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    phase = Phase(delay, {c.name: c for c in configs})
    for summary in world.model.ask("requests"):
        if summary["n"] in recorded.get(summary["tag"], ()):
            phase.requests.setdefault(summary["tag"], []).append(summary)
    for config in configs:
        phase.snapshots[config.name] = (list(config.samples), list(config.rounds))
        if isinstance(config, MechanismConfig):
            phase.paths[config.name] = collections.Counter(config.paths)
            if config.rss:
                phase.rss[config.name] = statistics.median(config.rss)
    return phase


# --- figures and the verdict ---------------------------------------------------------------------


@dataclass
class Figures:
    """One configuration in one phase."""

    wall_ms: float
    cpu_ms: float
    per_round: dict[int, float]
    input_kb: float
    uncached_kb: float
    rss_mb: float
    paths: collections.Counter[str]


def figures(phase: Phase, name: str) -> Figures:
    samples, rounds = phase.snapshots[name]
    walls = [s.wall / s.turns * 1000 for s in samples]
    cpus = [s.cpu / s.turns * 1000 for s in samples]
    requests = phase.requests.get(name, [])
    return Figures(
        wall_ms=statistics.median(walls) if walls else float("nan"),
        cpu_ms=statistics.median(cpus) if cpus else float("nan"),
        per_round=dict(zip(rounds, walls, strict=True)),
        input_kb=_mean_kb(r["input"] for r in requests),
        uncached_kb=_mean_kb(r["uncached"] for r in requests),
        rss_mb=phase.rss.get(name, float("nan")),
        paths=phase.paths.get(name, collections.Counter()),
    )


def _mean_kb(values: Any) -> float:
    """A mean, not a median: a bill adds up (a sliding window makes it bimodal)."""
    data = list(values)
    return statistics.fmean(data) / 1024 if data else float("nan")


def saving(on: Figures, off: Figures) -> tuple[float, float, float]:
    """Per round, (OFF - ON) / OFF: the median and the 25th and 75th percentiles."""
    paired = sorted(
        (off.per_round[r] - on.per_round[r]) / off.per_round[r]
        for r in on.per_round
        if r in off.per_round and off.per_round[r] > 0
    )
    if not paired:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(paired), _quantile(paired, 0.25), _quantile(paired, 0.75)


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def relative_saving(on: float, off: float) -> float:
    """How much smaller ON is than OFF, as a share of OFF (``nan`` when unknown)."""
    if off != off or on != on or off <= 0:
        return float("nan")
    return (off - on) / off


def verdict(wall: float, tokens: float, memory: float) -> str:
    """``keep`` when any saving reaches the threshold (wall: of the turn; tokens: of the
    uncached input; memory: of Codex's RSS), else ``remove``; with the reasons."""
    reasons = [
        f"{name} {_pct(value)}"
        for name, value in (("wall", wall), ("tokens", tokens), ("memory", memory))
        if value == value and value >= SAVING_THRESHOLD
    ]
    return "keep (" + ", ".join(reasons) + ")" if reasons else "remove"


def _pct(value: float) -> str:
    return "-" if value != value else f"{value * 100:+.1f}%"


def _num(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def _paths(counter: collections.Counter[str]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counter.items())) or "-"


def billed_kb(figures: Figures) -> float:
    """The input bill of a turn, in uncached-KB equivalents (:data:`CACHED_INPUT_PRICE`)."""
    cached = figures.input_kb - figures.uncached_kb
    return figures.uncached_kb + CACHED_INPUT_PRICE * cached


def instructions(kilobytes: int) -> str:
    """Developer instructions of about ``kilobytes`` KB, the same every turn (a host's
    workspace rules and persona: OpenClaw sends its bootstrap files this way)."""
    rules = []
    index = 0
    while sum(map(len, rules)) < kilobytes * 1024:
        index += 1
        rules.append(
            f"Rule {index}: keep the workspace tidy, explain each change before making it, "
            f"run the tests that cover it, and never touch files outside the project.\n"
        )
    return "You are a benchmark assistant.\n" + "".join(rules)


def report(
    phases: Sequence[Phase],
    rows: Sequence[Mechanism],
    realistic: float,
    idle_rss: dict[str, float] | None = None,
) -> dict[str, str]:
    header = (
        f"{'mechanism':<22} {'history':>7} {'delay':>5} | {'ON x fl':>7} {'x dur':>5} | "
        f"{'OFF x fl':>8} {'x dur':>5} | {'saving':>7} {'(p25..p75)':>17} | "
        f"{'cpu ms ON/OFF':>13} | {'input KB ON/OFF':>15} | {'uncached KB':>13} | "
        f"{'codex RSS MB':>13} | path ON / OFF | verdict"
    )
    print(header)
    print("-" * len(header))
    decided: dict[str, list[str]] = collections.defaultdict(list)
    for mechanism in rows:
        for phase in phases:
            floor = figures(phase, "floor")
            durable = figures(phase, "durable-floor")
            on = figures(phase, mechanism.on.name)
            off = figures(phase, mechanism.off.name)
            mid, low, high = saving(on, off)
            tokens = relative_saving(billed_kb(on), billed_kb(off))
            memory = relative_saving(on.rss_mb, off.rss_mb)
            if phase.delay == realistic:
                row_verdict = verdict(mid, tokens, memory)
                decided[mechanism.key].append(row_verdict)
            else:
                row_verdict = f"({verdict(mid, tokens, memory)} at {phase.delay:g} s)"
            history = label(mechanism.on.messages) if mechanism.on.messages else "-"
            print(
                f"{mechanism.title:<22} {history:>7} {phase.delay:>4g}s | "
                f"{on.wall_ms / floor.wall_ms:7.3f} {on.wall_ms / durable.wall_ms:5.2f} | "
                f"{off.wall_ms / floor.wall_ms:8.3f} {off.wall_ms / durable.wall_ms:5.2f} | "
                f"{_pct(mid):>7} {f'({_pct(low)}..{_pct(high)})':>17} | "
                f"{f'{_num(on.cpu_ms)}/{_num(off.cpu_ms)}':>13} | "
                f"{f'{_num(on.input_kb)}/{_num(off.input_kb)}':>15} | "
                f"{f'{_num(on.uncached_kb)}/{_num(off.uncached_kb)}':>13} | "
                f"{f'{_num(on.rss_mb, 0)}/{_num(off.rss_mb, 0)}':>13} | "
                f"{_paths(on.paths)} / {_paths(off.paths)} | {row_verdict}"
            )
    print()
    for phase in phases:
        floor, durable = figures(phase, "floor"), figures(phase, "durable-floor")
        print(
            f"delay {phase.delay:g} s: floor {floor.wall_ms:.1f} ms/turn "
            f"(cpu {floor.cpu_ms:.2f} ms), durable floor {durable.wall_ms:.1f} ms/turn "
            f"(cpu {durable.cpu_ms:.2f} ms)"
        )
    if idle_rss:
        print(
            "codex RSS when idle (no turn for --idle-wait seconds after the last phase; "
            f"released forks are unloaded after {FORK_UNLOAD_DELAY_S} s): "
            + ", ".join(f"{name} {mb:.0f} MB" for name, mb in idle_rss.items())
        )
    print(
        f"\nverdict at {realistic:g} s (keep: saves >= {SAVING_THRESHOLD:.0%} of the turn's "
        f"wall time, of its input bill (uncached + {CACHED_INPUT_PRICE:g} x cached input), or "
        "of Codex's RSS over the phase's turns, in any of its rows):"
    )
    final: dict[str, str] = {}
    for mechanism in rows:
        if mechanism.key in final:
            continue
        verdicts = decided.get(mechanism.key, [])
        final[mechanism.key] = "keep" if any(v.startswith("keep") for v in verdicts) else "remove"
        print(f"  {mechanism.key:<15} {mechanism.title:<24} {final[mechanism.key]}")
    return final


async def idle_memory(configs: Sequence[Config], wait: float) -> dict[str, float]:
    """Each own app-server's RSS after ``wait`` seconds without a turn: Codex has unloaded
    the forks released meanwhile (``thread_unload_delay_secs``); a kept fork stays."""
    owners = [c for c in configs if isinstance(c, MechanismConfig) and c.own_server]
    if wait <= 0 or not owners:
        return {}
    print(f"  waiting {wait:g} s without turns for the idle memory", flush=True)
    await anyio.sleep(wait)
    return {c.name: await codex_rss_mb(c.server) for c in owners}


async def main(args: argparse.Namespace) -> None:
    # Every thread (the floors' included) carries the same, realistic developer instructions.
    bench_floor.INSTRUCTIONS = instructions(args.instructions_kb)
    rows = [m for m in mechanisms(*args.sizes) if m.key in args.only]
    variants = list(dict.fromkeys(v for m in rows for v in (m.on, m.off)))
    model = ModelProcess(SCRIPT)  # its model answers delay and requests too
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-mechanisms-", dir=args.tmp) as tmp:
            root = Path(tmp)
            workspace = root / "workspace"
            workspace.mkdir()
            print(f"codex app-server {bundled_codex_path()}")
            print(
                f"temp dir {root}; delays {', '.join(f'{d:g} s' for d in args.delays)}; "
                f"rounds {args.rounds} at 0 s, {args.delay_rounds} delayed (+{args.warmup} "
                f"warm-up); cpus {os.cpu_count()}; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            async with contextlib.AsyncExitStack() as stack:
                world = World(args, stack, model, root, workspace)
                floor, durable = await world.floors()
                configs: list[Config] = [floor, durable]
                for variant in variants:
                    configs.append(await world.config(variant))
                phases = []
                for delay in args.delays:
                    rounds = args.rounds if delay == 0 else args.delay_rounds
                    phases.append(await run_phase(world, configs, delay, rounds, args.warmup))
                idle_rss = await idle_memory(configs, args.idle_wait)
            stats = model.ask("stats")
    finally:
        model.close()
    print()
    report(phases, rows, max(args.delays), idle_rss)
    print_run_end(started, stats)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (~1-2 minutes)")
    parser.add_argument("--delays", default=None, help="first-byte delays, s (0,1.5; quick 0,0.3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds at 0 s (10; quick 2)")
    parser.add_argument(
        "--delay-rounds", type=int, default=None, help="rounds at a delay (8; quick 2)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds per delay (1)")
    parser.add_argument("--only", default=",".join(MECHANISM_KEYS), help="mechanism keys")
    parser.add_argument(
        "--sizes", default=None, help="small,large history (1000,10000; quick 200,1000)"
    )
    parser.add_argument("--tmp", default=None, help="parent of the temp dir")
    parser.add_argument(
        "--instructions-kb", type=int, default=8, help="developer instructions, KB (8)"
    )
    parser.add_argument(
        "--idle-wait",
        type=float,
        default=None,
        help=f"seconds without turns before the idle RSS ({FORK_UNLOAD_DELAY_S + 5}; quick 0)",
    )
    parser.add_argument("--log", action="store_true", help="keep info/debug logging on")
    parser.add_argument("--serve-model", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.delays = [float(d) for d in (args.delays or ("0,0.3" if quick else "0,1.5")).split(",")]
    if args.rounds is None:
        args.rounds = 2 if quick else 10
    if args.delay_rounds is None:
        args.delay_rounds = 2 if quick else 8
    if args.idle_wait is None:
        args.idle_wait = 0 if quick else FORK_UNLOAD_DELAY_S + 5
    args.sizes = tuple(
        int(s) for s in (args.sizes or ("200,1000" if quick else "1000,10000")).split(",")
    )
    if len(args.sizes) != 2:
        parser.error("--sizes takes two sizes: small,large")
    only = {key.strip() for key in args.only.split(",") if key.strip()}
    unknown = only - set(MECHANISM_KEYS)
    if unknown:
        parser.error(f"--only: unknown mechanism {', '.join(sorted(unknown))}")
    args.only = only
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.serve_model:
        serve_model()
        sys.exit(0)
    if not arguments.log:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, arguments)
