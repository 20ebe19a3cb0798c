"""Thread strategies for the structured projection, measured on the real ``codex app-server``.

    .venv/bin/python benchmarks/bench_inject.py [--sizes 10,100,1000] [--turns 12]
        [--only S1,S2] [--probe-only] [--json FILE]

How to hand Codex an engine's assembled history as Responses items
(``thread/inject_items``) without paying a new thread per turn, while keeping the prompt
cache warm (Codex's ``prompt_cache_key`` is the thread id; an ephemeral fork keeps its
parent's) and never letting projected context pile up in Codex's native history.

The workload: a conversation that only grows. Turn k's assembly is a base of N messages
(``bench_projection.make_messages``: user text, assistant text with tool calls, tool results,
images) plus every earlier turn of this run (its prompt and Codex's echo reply); turn k's raw
prompt is ``PROMPT_<k>_<nonce>``. The offline model (:class:`codex_turn.testing.OfflineModel`,
in process) records every request.

Strategies (each on its own app-server process, same config and developer instructions):

* ``floor``: one thread, raw prompts, Codex's own history (the bare protocol floor of a
  conversation; no engine).
* ``floor-ctx``: one thread, the base N messages injected once before turn 1, then raw
  prompts on Codex's own history (the floor carrying the same context: same request size).
* ``text-fresh``: today's per-turn projection: ``thread/start`` every turn, the text frame in
  ``turn/start``.
* ``inject-fresh``: ``thread/start`` every turn, all items injected, the raw prompt.
* ``revert-delta``: one base thread. Turn 1 injects the items; turn k reverts turn k-1
  (``thread/revert``: Codex's history is then exactly what was injected) and injects only the
  new suffix of the assembly (it extends the previous one), then the raw prompt.
* ``revert-full``: like ``revert-delta`` but re-injects the whole assembly after the revert
  (what "reset and re-inject" costs when items injected before the first turn survive a
  revert, which the probe checks).
* ``fork-full``: one idle base thread holding only :data:`ANCHOR` (a thread with neither a
  turn nor an injection has no rollout, and ``thread/fork`` refuses it: "no rollout found";
  an ``item_reference`` is accepted, written, and never sent to the model); per turn
  ``thread/fork {ephemeral:true, excludeTurns:true}``, all items injected into the fork, the
  raw prompt; the fork is discarded.
* ``fork-delta``: the base thread accumulates the assembly (the new suffix injected into the
  idle base before each turn); per turn an ephemeral fork of it runs the raw prompt.

Through the library (``codex_turn.run_codex_turn``, one session each, the engine's assembly
is the conversation above, per-turn projection):

* ``bare``: the bare JSON-RPC floor (``bench_floor.BareClient``, a minimal client independent
  of the library): one thread, raw prompts. Ratios are to it when it runs (else ``floor``).
* ``turn-none``: no engine (Codex's own history).
* ``turn-text``: ``projection_format="text"``: the text frame on a fresh thread every turn.
* ``turn-structured``: the default: the assembly as items in an ephemeral fork of the
  session's base thread (what ``fork-full`` does, with every stage of the turn around it).

All strategies of one size run interleaved, turn by turn (the order rotates every turn), so
machine noise hits them alike.

Reported per strategy and size: median per-turn wall time (all RPCs of the turn: start /
fork / revert / inject / turn) and its ratio to the floor's; distinct ``prompt_cache_key``
values over the turns; the last request's size; the mean share of each request's ``input``
(bytes, item by item) that is a byte-identical prefix of the previous request's (the
cacheable part; turns 2..K); and how often turn 1's prompt appears as a user message in the
last request (1 = no snowball). A probe first checks the protocol facts the strategies rely
on (ids kept verbatim, what a revert keeps, what a fork inherits).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_floor import BareClient
from bench_projection import make_messages

from codex_turn import TurnParams, run_codex_turn
from codex_turn.harness.appserver import AppServer, AppServerConfig, ThreadSettings
from codex_turn.harness.engine import (
    AssembleParams,
    AssembleResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    IngestParams,
    IngestResult,
)
from codex_turn.projection import project_context_engine_assembly
from codex_turn.projection.items import ConvertedItems, convert_messages
from codex_turn.testing import OfflineModel, RecordedRequest

DEV = "DEV_INSTR_BENCH_INJECT: you are a helpful assistant."
ANCHOR = {"type": "item_reference", "id": "msg_codex_turn_anchor"}
STRATEGIES = (
    "floor",
    "floor-ctx",
    "text-fresh",
    "inject-fresh",
    "revert-delta",
    "revert-full",
    "fork-full",
    "fork-delta",
    "bare",
    "turn-none",
    "turn-text",
    "turn-structured",
)


def items_for(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    converted = convert_messages(messages, prompt=prompt, payload_policy="shape-only")
    assert isinstance(converted, ConvertedItems), converted
    return list(converted.items)


class Harness:
    """One app-server process and the raw calls the strategies make."""

    def __init__(self, server: AppServer, cwd: str) -> None:
        self.server = server
        self.cwd = cwd

    async def start(self) -> str:
        result = await self.server.start_thread(
            ThreadSettings(cwd=self.cwd, developer_instructions=DEV)
        )
        return result.thread_id

    async def inject(self, thread_id: str, items: Sequence[dict[str, Any]]) -> None:
        for start in range(0, len(items), 2000):
            await self.server.request(
                "thread/inject_items",
                {"threadId": thread_id, "items": list(items[start : start + 2000])},
            )

    async def revert(self, thread_id: str, before_turn_id: str) -> None:
        await self.server.request(
            "thread/revert", {"threadId": thread_id, "beforeTurnId": before_turn_id}
        )

    async def fork(self, thread_id: str) -> str:
        raw = await self.server.request(
            "thread/fork",
            {
                "threadId": thread_id,
                "ephemeral": True,
                "excludeTurns": True,
                "developerInstructions": DEV,
                "cwd": self.cwd,
            },
        )
        fork_id: str = raw["thread"]["id"]
        return fork_id

    async def turn(self, thread_id: str, text: str) -> tuple[str, str]:
        result = await self.server.run_turn(thread_id, text, timeout=120)
        assert result.turn_id is not None, result
        reply = "".join(m.get("content", "") for m in [] if m)  # not used
        del reply
        return result.turn_id, result.outcome.value

    def forget(self, thread_id: str) -> None:
        self.server.forget_thread(thread_id)


class Conversation:
    """The growing assembly: a base of N messages plus every earlier turn of this run."""

    def __init__(self, base: int) -> None:
        self.nonce = uuid.uuid4().hex[:8]
        messages = make_messages(base)
        # make_messages puts an image message every 25th slot, sometimes in place of the
        # assistant call a tool result answers: drop those orphans (a sound conversation).
        calls = {
            part.get("id")
            for m in messages
            if m["role"] == "assistant" and isinstance(m["content"], list)
            for part in m["content"]
        }
        self.messages: list[dict[str, Any]] = [
            m for m in messages if m["role"] != "toolResult" or m["toolCallId"] in calls
        ]

    def prompt(self, k: int) -> str:
        return f"PROMPT_{k}_{self.nonce}"

    def record(self, k: int) -> None:
        prompt = self.prompt(k)
        self.messages.append({"role": "user", "content": prompt})
        self.messages.append(
            {"role": "assistant", "content": [{"type": "text", "text": f"ECHO: {prompt}"}]}
        )


Step = Callable[[int, Conversation], Awaitable[None]]


def strategy_steps(name: str, h: Harness) -> Step:
    state: dict[str, Any] = {"injected": 0, "last_turn": None, "base": None}

    async def floor(k: int, conv: Conversation) -> None:
        if state["base"] is None:
            state["base"] = await h.start()
        await h.turn(state["base"], conv.prompt(k))

    async def floor_ctx(k: int, conv: Conversation) -> None:
        if state["base"] is None:
            state["base"] = await h.start()
            items = items_for(conv.messages, conv.prompt(k))
            if items:
                await h.inject(state["base"], items)
        await h.turn(state["base"], conv.prompt(k))

    async def text_fresh(k: int, conv: Conversation) -> None:
        thread = await h.start()
        framed = project_context_engine_assembly(
            assembled_messages=conv.messages,
            original_history_messages=conv.messages,
            prompt=conv.prompt(k),
            token_budget=1_000_000,
        ).prompt_text
        await h.turn(thread, framed)
        h.forget(thread)

    async def inject_fresh(k: int, conv: Conversation) -> None:
        thread = await h.start()
        items = items_for(conv.messages, conv.prompt(k))
        if items:
            await h.inject(thread, items)
        await h.turn(thread, conv.prompt(k))
        h.forget(thread)

    async def revert(k: int, conv: Conversation, *, delta: bool) -> None:
        if state["base"] is None:
            state["base"] = await h.start()
        thread = state["base"]
        items = items_for(conv.messages, conv.prompt(k))
        if state["last_turn"] is not None:
            await h.revert(thread, state["last_turn"])
        new = items[state["injected"] :] if delta else items
        if new:
            await h.inject(thread, new)
        state["injected"] = len(items)
        state["last_turn"], _ = await h.turn(thread, conv.prompt(k))

    async def fork(k: int, conv: Conversation, *, delta: bool) -> None:
        items = items_for(conv.messages, conv.prompt(k))
        if state["base"] is None:
            state["base"] = await h.start()
            if not delta:
                # A thread with neither a turn nor an injection has no rollout to fork; an
                # item_reference is accepted (the rollout is written) and never reaches
                # the model, so the base stays empty as the model sees it.
                await h.inject(state["base"], [ANCHOR])
        if delta:
            new = items[state["injected"] :]
            if new:
                await h.inject(state["base"], new)
            state["injected"] = len(items)
        child = await h.fork(state["base"])
        if not delta and items:
            await h.inject(child, items)
        await h.turn(child, conv.prompt(k))
        h.forget(child)

    steps: dict[str, Step] = {
        "floor": floor,
        "floor-ctx": floor_ctx,
        "text-fresh": text_fresh,
        "inject-fresh": inject_fresh,
        "revert-delta": lambda k, c: revert(k, c, delta=True),
        "revert-full": lambda k, c: revert(k, c, delta=False),
        "fork-full": lambda k, c: fork(k, c, delta=False),
        "fork-delta": lambda k, c: fork(k, c, delta=True),
    }
    return steps[name]


# --- metrics ----------------------------------------------------------------------------------


def _item_bytes(request: RecordedRequest, *, ids: bool = True) -> list[bytes]:
    return [
        json.dumps(
            i if ids else {k: v for k, v in i.items() if k != "id"}, ensure_ascii=False
        ).encode()
        for i in request.input_items
    ]


def prefix_share(previous: RecordedRequest, current: RecordedRequest, *, ids: bool = True) -> float:
    """Bytes of ``current``'s input that equal ``previous``'s input item by item, from the
    start, over all of ``current``'s input bytes (the prompt-cacheable part). ``ids=False``
    compares the items without their ``id`` (metadata, not model tokens)."""
    before, now = _item_bytes(previous, ids=ids), _item_bytes(current, ids=ids)
    shared = 0
    for a, b in zip(before, now, strict=False):
        if a != b:
            break
        shared += len(b)
    total = sum(len(b) for b in now)
    return shared / total if total else 1.0


def user_occurrences(request: RecordedRequest, needle: str) -> int:
    return sum(needle in text for text in request.user_messages)


class ConversationEngine:
    """A per-turn engine whose assembly is the benchmark's conversation (whatever the
    transcript holds): the library's turn around the same model input as the strategies."""

    info = ContextEngineInfo(id="bench-inject", name="Bench conversation engine", version="1")

    def __init__(self, conv: Conversation) -> None:
        self.conv = conv

    async def ingest(self, params: IngestParams) -> IngestResult:
        return IngestResult(ingested=True)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        return AssembleResult(messages=list(self.conv.messages), estimated_tokens=0)

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(ok=True, compacted=False)


class Runner:
    """One strategy at one size: its own app-server (or bare client), conversation and
    measurements."""

    def __init__(self, name: str, base: int, root: Path, model: OfflineModel) -> None:
        self.name = name
        self.base = base
        self.root = root
        self.model = model
        self.conv = Conversation(base)
        self.walls: list[float] = []
        self.requests: list[RecordedRequest] = []
        self.stack = contextlib.AsyncExitStack()
        self.step: Callable[[int], Awaitable[None]]

    async def __aenter__(self) -> Runner:
        config = AppServerConfig.offline(
            self.root / f"{self.name}-{self.base}",
            self.model.base_url,
            home=self.root / "home",
            env=self.model.proxy_env(),
        )
        if self.name == "bare":
            client = await self.stack.enter_async_context(BareClient(config))
            thread = await client.start_thread(str(self.root / "workspace"))

            async def bare(k: int) -> None:
                await client.run_turn(thread, self.conv.prompt(k))

            self.step = bare
            return self
        server = await self.stack.enter_async_context(AppServer.start(config))
        if self.name.startswith("turn-"):
            engine = None if self.name == "turn-none" else ConversationEngine(self.conv)
            form = "text" if self.name == "turn-text" else "structured"
            session = self.root / f"{self.name}-{self.base}.jsonl"

            async def library(k: int) -> None:
                params = TurnParams(
                    session_id=f"{self.name}-{self.base}",
                    session_file=session,
                    workspace_dir=self.root / "workspace",
                    prompt=self.conv.prompt(k),
                    extra_developer_instructions=DEV,
                    projection_format=form,
                    tool_payloads="shape-only",
                    # Large enough that the whole assembly is sent, in either form.
                    context_token_budget=1_000_000,
                )
                result = await run_codex_turn(params, app_server=server, engine=engine)
                assert result.outcome.value == "completed", result.prompt_error

            self.step = library
            return self
        harness = Harness(server, str(self.root / "workspace"))
        raw = strategy_steps(self.name, harness)

        async def protocol(k: int) -> None:
            await raw(k, self.conv)

        self.step = protocol
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stack.aclose()

    async def turn(self, k: int) -> None:
        seen = len(self.model.requests)
        started = time.perf_counter()
        await self.step(k)
        self.walls.append(time.perf_counter() - started)
        made = [r for r in self.model.requests[seen:] if not r.is_compaction]
        assert made, f"{self.name}: turn {k} made no model request"
        self.requests.append(made[-1])
        self.conv.record(k)

    def row(self) -> dict[str, Any]:
        requests = self.requests
        keys = [r.body.get("prompt_cache_key") for r in requests]
        pairs = list(itertools.pairwise(requests))
        shares = [prefix_share(a, b) for a, b in pairs]
        content = [prefix_share(a, b, ids=False) for a, b in pairs]
        last = requests[-1]
        # The first turn of each strategy pays its own setup (a first thread, a base): the
        # median is over the later turns.
        return {
            "strategy": self.name,
            "base": self.base,
            "turns": len(self.walls),
            "median_ms": statistics.median(self.walls[1:] or self.walls) * 1000,
            "first_ms": self.walls[0] * 1000,
            "cache_keys": len(set(keys[1:])) if len(keys) > 1 else len(set(keys)),
            "last_request_kb": len(json.dumps(last.body)) / 1024,
            "first_request_kb": len(json.dumps(requests[0].body)) / 1024,
            "prefix_share": statistics.mean(shares[1:] or shares) if shares else 1.0,
            "content_prefix_share": statistics.mean(content[1:] or content) if content else 1.0,
            "turn1_in_last": user_occurrences(last, self.conv.prompt(1)),
            "last_input_items": len(last.input_items),
        }


async def run_size(
    names: Sequence[str], base: int, turns: int, root: Path, model: OfflineModel
) -> list[dict[str, Any]]:
    """Every strategy at one size, interleaved turn by turn (the order rotates)."""
    async with contextlib.AsyncExitStack() as stack:
        runners = [
            await stack.enter_async_context(Runner(name, base, root, model)) for name in names
        ]
        for k in range(1, turns + 1):
            shift = k % len(runners)
            for runner in runners[shift:] + runners[:shift]:
                await runner.turn(k)
        return [runner.row() for runner in runners]


# --- the probe: protocol facts the strategies rely on ----------------------------------------


async def probe(root: Path, model: OfflineModel) -> dict[str, Any]:
    config = AppServerConfig.offline(
        root / "probe", model.base_url, home=root / "home", env=model.proxy_env()
    )
    facts: dict[str, Any] = {}
    async with AppServer.start(config) as server:
        h = Harness(server, str(root / "workspace"))
        items = items_for(
            [
                {"role": "user", "content": "PROBE_U"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "PROBE_A"},
                        {"type": "toolCall", "id": "pc1", "name": "exec", "arguments": {"x": 1}},
                    ],
                },
                {"role": "toolResult", "toolCallId": "pc1", "content": "PROBE_OUT"},
            ],
            "",
        )
        thread = await h.start()
        await h.inject(thread, items)
        seen = len(model.requests)
        t1, _ = await h.turn(thread, "PROBE_T1")
        sent = model.requests[seen].input_items
        ours = {i["id"] for i in items}
        facts["own_ids_kept"] = {
            kind: any(i.get("id") in ours for i in sent if i.get("type") == kind)
            for kind in ("message", "function_call", "function_call_output")
        }
        await h.revert(thread, t1)
        seen = len(model.requests)
        await h.turn(thread, "PROBE_T2")
        after = model.requests[seen]
        facts["revert_before_first_turn_keeps_pre_turn_injection"] = "PROBE_U" in "".join(
            after.user_messages
        )
        facts["revert_drops_reverted_turn"] = "PROBE_T1" not in "".join(after.user_messages)
        # Fork: inherits history and the parent's cache key?
        child = await h.fork(thread)
        seen = len(model.requests)
        await h.turn(child, "PROBE_FORK")
        forked = model.requests[seen]
        facts["fork_inherits_history"] = "PROBE_T2" in "".join(forked.user_messages)
        facts["fork_inherits_injected_items"] = "PROBE_U" in "".join(forked.user_messages)
        facts["fork_cache_key_is_parent"] = forked.body.get("prompt_cache_key") == thread
        seen = len(model.requests)
        await h.turn(thread, "PROBE_T3")
        parent = model.requests[seen]
        facts["fork_turn_absent_from_parent"] = "PROBE_FORK" not in "".join(parent.user_messages)
        # Timings of the raw calls on an idle thread.
        timings: dict[str, list[float]] = {"thread/start": [], "thread/fork": [], "revert": []}
        for _ in range(5):
            t0 = time.perf_counter()
            other = await h.start()
            timings["thread/start"].append(time.perf_counter() - t0)
            h.forget(other)
            t0 = time.perf_counter()
            fork_id = await h.fork(thread)
            timings["thread/fork"].append(time.perf_counter() - t0)
            h.forget(fork_id)
            last, _ = await h.turn(thread, "PROBE_R")
            t0 = time.perf_counter()
            await h.revert(thread, last)
            timings["revert"].append(time.perf_counter() - t0)
        facts["median_ms"] = {k: round(statistics.median(v) * 1000, 1) for k, v in timings.items()}
    return facts


def report(rows: list[dict[str, Any]]) -> None:
    floors = {r["base"]: r["median_ms"] for r in rows if r["strategy"] == "floor"}
    # The bare JSON-RPC floor, when it ran, is the reference.
    floors.update({r["base"]: r["median_ms"] for r in rows if r["strategy"] == "bare"})
    head = (
        f"{'strategy':<13} {'N':>5} {'ms/turn':>8} {'x floor':>8} {'1st ms':>7} {'keys':>5} "
        f"{'1st KB':>7} {'last KB':>8} {'prefix':>7} {'no-id':>7} {'T1 in last':>10}"
    )
    print(head)
    for r in rows:
        ratio = r["median_ms"] / floors[r["base"]] if r["base"] in floors else float("nan")
        r["ratio"] = ratio
        print(
            f"{r['strategy']:<13} {r['base']:>5} {r['median_ms']:>8.1f} {ratio:>8.2f} "
            f"{r['first_ms']:>7.1f} {r['cache_keys']:>5} {r['first_request_kb']:>7.1f} "
            f"{r['last_request_kb']:>8.1f} {r['prefix_share']:>7.1%} "
            f"{r['content_prefix_share']:>7.1%} {r['turn1_in_last']:>10}"
        )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    names = args.only.split(",") if args.only else list(STRATEGIES)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, OfflineModel() as model:
        root = Path(tmp)
        (root / "workspace").mkdir()
        facts = await probe(root, model)
        out["probe"] = facts
        print("probe:", json.dumps(facts, indent=1))
        if args.probe_only:
            return out
        rows = []
        for base in sizes:
            rows += await run_size(names, base, args.turns, root, model)
            model.requests.clear()
        report(rows)
        print(
            "goals: turn-structured <= 1.25x the floor at 1000 messages; "
            "prefix >= 90% for a conversation that only grows"
        )
        out["rows"] = rows
        assert not model.proxy_attempts, model.proxy_attempts
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--only", default="")
    parser.add_argument("--probe-only", action="store_true")
    parser.add_argument("--json", default="")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        results = asyncio.run(main(arguments))
        if arguments.json:
            Path(arguments.json).write_text(json.dumps(results, indent=1))
