"""codex-turn against the protocol floor: one interleaved run on one ``codex app-server`` binary.

    .venv/bin/python benchmarks/bench_floor.py [--quick] [--rounds 30] [--warmup 3]
        [--only A,B,C|CONFIG,...] [--max-history 100000] [--others-messages 1000] [--touch N]
        [--active-rounds 10] [--conc-rounds 8] [--tmp DIR] [--log]
    .venv/bin/python benchmarks/bench_floor.py --profile CONFIG [--profile-turns 40]
        [--profile-clock cpu|wall] [--profile-out FILE]

CONFIG is one of floor, durable-floor, sdk, no-engine, passthrough-1k|10k|100k, active-1|32|1000,
concurrent-32|128. ``--only`` takes phases (A, B, C) or configuration names (e.g.
``--only floor,no-engine,concurrent-32``: phase A with those two, phase C with 32 only; the
floor is always measured beside a phase). ``CODEX_TURN_SESSION_CACHE_BYTES`` (the harness's
cache ceiling) is read from the environment as usual.

What is measured
----------------
Every turn is a real Codex turn (``turn/start`` -> ``turn/completed``) of the bundled binary
against the offline echo model (:class:`codex_turn.testing.OfflineModel`, run in a *child
process* so that its HTTP and JSON work is not counted as client CPU; its proxy trap proves
nothing reaches the internet). Each client has its own app-server process and CODEX_HOME,
all written by ``AppServerConfig.offline`` (one config, ``features.plugins=false``), and
every thread carries the same developer instructions.

A. Single turns, interleaved round by round (the order rotates every round, so machine noise
   hits every configuration alike), each on a thread that is already started and loaded:

   * ``floor``: the bare JSON-RPC floor, a minimal client written here (asyncio subprocess,
     newline-delimited JSON; initialize/initialized, thread/start once, then per turn
     ``turn/start`` and wait for the thread's ``turn/completed``; other lines are skipped
     unparsed, nothing is answered). Independent of the library's client.
   * ``durable-floor``: the floor plus the least a durable turn must do, written here as
     cheaply as Python allows, on a thread of its own of the floor's app-server: take an
     OpenClaw-style lock file (``O_CREAT|O_EXCL``, pid and time), append the prompt to a
     transcript and start its ``fsync`` in a thread (overlapping the turn, as codex-turn
     does), run the turn, wait for that ``fsync``, append the reply, ``fsync`` it in a thread,
     remove the lock file. All file work but the fsyncs runs inline on the event loop (the
     library keeps it off the loop, so that a hung filesystem cannot stall other sessions).
     No FSM, no engine, no validation, no logging: its ratio is what durability alone costs on
     this machine, the bound under any durable client's.
   * ``sdk``: the official SDK, ``openai_codex.AsyncCodex`` ``thread.run(prompt)``
     (``pip install openai-codex==0.163.0``, extra ``sdk``; skipped when missing).
   * ``no-engine``: ``codex_turn.run_codex_turn`` with no engine, on a session whose binding
     names a thread this process already loaded.
   * ``passthrough-1k|10k|100k``: ``run_codex_turn`` with a pass-through engine
     (``thread_bootstrap`` projection with a fixed epoch; ``assemble`` returns the messages it
     was given unchanged; ``after_turn``/``ingest`` do nothing) on a transcript of 1k, 10k or
     100k messages (``bench_engine.conversation``: prompts, tool calls, tool results and
     replies, ~0.7 KB a line). The thread is seeded by one priming turn whose assembly is only
     the last two messages (same engine, same epoch), so every measured turn resumes the
     thread with the raw prompt and Codex's model input stays the size of the floor's: what
     grows with N is only the library's work (read, strip, assemble, project, finalize).

B. Many sessions: the per-turn cost of one session (10k messages, pass-through engine) when
   1, 32 or 1,000 other sessions are active in the process. Active = its transcript was read
   by the harness exactly as a turn's ``reading_history`` stage reads it
   (``ensure_transcript_writable`` + ``turn_context.stripped_histories.read`` +
   ``read_binding``; the read cache and the stripped-history cache share one byte ceiling,
   ``CODEX_TURN_SESSION_CACHE_BYTES``). The others are read once when their block starts (the
   process RSS is printed before and after); then, before each measured turn, untimed, the
   others run their reads again, as their own turns would between two turns of the measured
   session: all of them (``--touch N``: only the next N, round-robin). The others'
   transcripts use short messages (~0.2 KB a line; 1,000 messages each, ``--quick`` 200;
   sizes are printed). With 1,000 others of 1,000 messages that outgrow the ceiling, reading
   all of them takes ~30 s per round on a busy 2-core box, hence ``--active-rounds`` (10).
   Each K runs as its own block, interleaved with the floor (the caches are process-wide:
   blocks run together would be each other's "others"); the ratio to the block's floor makes
   the blocks comparable.

C. Concurrency: 32 and 128 sessions running a turn at once on ONE app-server (codex-turn, no
   engine, bound loaded threads) against the bare client running the same number of turns at
   once on its own threads of its own app-server; throughput = turns / batch wall time,
   rounds alternating the two.

For every configuration: median wall time per turn, the ratio to the floor of the same rounds
(ratio of medians, and the median of per-round ratios), client CPU per turn
(``time.process_time()`` delta of this process, all threads, divided by turns) and, for
codex-turn, the median time per FSM state (``TurnResult.durations_ms``; ``outside`` = wall
time not covered by the trace). Goals, printed beside each figure:

* no engine <= 1.03x floor; pass-through 1k <= 1.10x, 10k <= 1.15x, 100k <= 1.25x;
* client CPU <= 2.5 ms/turn with no engine, <= 4 ms/turn pass-through at 10k;
* no cliff across 1/32/1,000 active sessions (here: each ratio within 10 % of K=1's);
* 32 concurrent sessions >= 0.97x the floor's throughput (128 shown too).

``--quick`` (a smoke run, < 3 minutes) shrinks rounds and the other sessions' transcripts and
leaves out ``passthrough-100k`` (``--max-history 100000`` puts it back). The caches of the
harness are process-wide (one byte ceiling), so a session too large for them evicts the
others' entries on every turn: with 100k in the rounds, 1k and 10k pay for it too (run
``--max-history 10000`` to see them alone).
``--profile CONFIG`` sets up one configuration only, measures it unprofiled, then runs
``--profile-turns`` turns under cProfile (the event-loop thread and, through a wrapper around
``anyio.to_thread.run_sync``, the worker threads) and prints the top 25 functions by
cumulative and by own time, in ms per turn; ``--profile-clock cpu`` (default) times each
thread's CPU (where client CPU goes), ``wall`` includes blocking waits (``fsync``, the event
loop's ``epoll``). Logging is filtered to warnings, as an embedding application would run it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import itertools
import json
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.to_thread
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import conversation

from codex_turn import TurnParams, TurnResult, run_codex_turn
from codex_turn.harness.appserver import AppServer, AppServerConfig, bundled_codex_path
from codex_turn.harness.binding import read_binding
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    ContextProjection,
    IngestParams,
    IngestResult,
)
from codex_turn.harness.session import ensure_transcript_writable
from codex_turn.harness.turn.context import stripped_histories

INSTRUCTIONS = "You are a benchmark assistant."
PASSTHROUGH_SIZES = {
    "passthrough-1k": 1_000,
    "passthrough-10k": 10_000,
    "passthrough-100k": 100_000,
}
ACTIVE_COUNTS = {"active-1": 1, "active-32": 32, "active-1000": 1_000}
CONCURRENCY = {"concurrent-32": 32, "concurrent-128": 128}
ACTIVE_SESSION_MESSAGES = 10_000
CONFIG_NAMES = (
    "floor",
    "durable-floor",
    "sdk",
    "no-engine",
    *PASSTHROUGH_SIZES,
    *ACTIVE_COUNTS,
    *CONCURRENCY,
)
RATIO_GOALS = {
    "no-engine": 1.03,
    "passthrough-1k": 1.10,
    "passthrough-10k": 1.15,
    "passthrough-100k": 1.25,
}
CPU_GOALS_MS = {"no-engine": 2.5, "passthrough-10k": 4.0}
CLIFF_TOLERANCE = 1.10
CONCURRENCY_GOALS = {32: 0.97}
TURN_TIMEOUT_S = 180.0


# --- the offline model, in a child process ---------------------------------------------------


def serve_model() -> None:
    """``--serve-model``: run the offline model here; report on ``stats``; exit on EOF."""
    from codex_turn.testing import OfflineModel

    with OfflineModel() as model:
        print(json.dumps({"base_url": model.base_url, "proxy_env": model.proxy_env()}), flush=True)
        seen = 0
        stop = threading.Event()

        def drop_requests() -> None:  # it records every request; nobody here reads them
            nonlocal seen
            while not stop.wait(1.0):
                batch, model.requests = model.requests, []
                seen += len(batch)

        dropper = threading.Thread(target=drop_requests, daemon=True)
        dropper.start()
        for line in sys.stdin:
            if line.strip() == "stats":
                report = {
                    "requests": seen + len(model.requests),
                    "proxy_attempts": len(model.proxy_attempts),
                }
                print(json.dumps(report), flush=True)
        stop.set()


class ModelProcess:
    """The offline model in a child process (``SCRIPT --serve-model``, this script unless
    another benchmark names its own, whose model answers more commands)."""

    def __init__(self, script: Path | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(script or Path(__file__).resolve()), "--serve-model"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        info = json.loads(self._out.readline())
        self.base_url: str = info["base_url"]
        self.proxy_env: dict[str, str] = info["proxy_env"]

    @property
    def _out(self) -> IO[str]:
        assert self._proc.stdout is not None
        return self._proc.stdout

    def ask(self, command: str) -> Any:
        """Send one command line; its one JSON line back."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return json.loads(self._out.readline())

    def stats(self) -> dict[str, int]:
        result: dict[str, int] = self.ask("stats")
        return result

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# --- the floor: a bare JSON-RPC client --------------------------------------------------------


class BareClient:
    """The least a client can do: newline-delimited JSON-RPC over the app-server's stdio.

    Lines that are notifications other than ``turn/completed`` are skipped without parsing;
    server requests are not answered (with ``approval_policy = never`` Codex sends none)."""

    def __init__(self, config: AppServerConfig) -> None:
        self._config = config
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._turns: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._turn_requests: dict[int, str] = {}

    async def __aenter__(self) -> BareClient:
        self._config.write()
        self._proc = await asyncio.create_subprocess_exec(
            *self._config.argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=self._config.environment(),
            limit=1 << 26,
        )
        self._reader = asyncio.create_task(self._read())
        await self.request(
            "initialize",
            {
                "clientInfo": {"name": "bench_floor", "title": "Bench floor", "version": "0.0.1"},
                "capabilities": {"experimentalApi": True},
            },
        )
        await self._send({"method": "initialized"})
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        await self._proc.stdin.drain()

    async def request(self, method: str, params: dict[str, Any]) -> Any:
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        await self._send({"id": request_id, "method": method, "params": params})
        return await asyncio.wait_for(future, TURN_TIMEOUT_S)

    async def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        stdout = self._proc.stdout
        while line := await stdout.readline():
            if line.startswith(b'{"method":"') and not line.startswith(
                b'{"method":"turn/completed"'
            ):
                continue
            message = json.loads(line)
            method = message.get("method")
            if method == "turn/completed":
                params = message["params"]
                waiter = self._turns.pop(params["threadId"], None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(params["turn"])
            elif method is not None:
                continue  # a server request: answered by nothing, by design
            elif (request_id := message.get("id")) in self._turn_requests:
                thread_id = self._turn_requests.pop(request_id)
                if "error" in message:
                    turn_waiter = self._turns.pop(thread_id, None)
                    if turn_waiter is not None and not turn_waiter.done():
                        turn_waiter.set_exception(RuntimeError(str(message["error"])))
            elif (future := self._pending.pop(request_id, None)) is not None:
                if "error" in message:
                    future.set_exception(RuntimeError(str(message["error"])))
                else:
                    future.set_result(message.get("result"))
        error = RuntimeError("codex app-server closed its stdout")
        for pending in [*self._pending.values(), *self._turns.values()]:
            if not pending.done():
                pending.set_exception(error)

    async def start_thread(self, cwd: str) -> str:
        result = await self.request(
            "thread/start",
            {"cwd": cwd, "developerInstructions": INSTRUCTIONS, "personality": "none"},
        )
        thread_id: str = result["thread"]["id"]
        return thread_id

    async def run_turn(self, thread_id: str, text: str) -> dict[str, Any]:
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._turns[thread_id] = waiter
        request_id = next(self._ids)
        self._turn_requests[request_id] = thread_id
        await self._send(
            {
                "id": request_id,
                "method": "turn/start",
                "params": {"threadId": thread_id, "input": [{"type": "text", "text": text}]},
            }
        )
        turn = await asyncio.wait_for(waiter, TURN_TIMEOUT_S)
        if turn.get("status") != "completed":
            raise RuntimeError(f"bare turn ended {turn.get('status')}: {turn.get('error')}")
        return turn


# --- the pass-through engine ------------------------------------------------------------------


class PassThroughEngine:
    """``assemble`` hands back the messages it was given; nothing else does anything.

    ``seeding`` (the priming turn only): assemble just the last two messages, so the thread
    the epoch is projected into starts as small as the floor's."""

    info = ContextEngineInfo(id="bench-passthrough", name="Bench pass-through engine", version="1")
    projection = ContextProjection(mode="thread_bootstrap", epoch="bench-epoch-1")

    def __init__(self) -> None:
        self.seeding = True

    async def ingest(self, params: IngestParams) -> IngestResult:
        return IngestResult(ingested=True)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        messages = params.messages
        if self.seeding:
            messages = list(messages[-2:])
        return AssembleResult(
            messages=messages, estimated_tokens=0, context_projection=self.projection
        )

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(ok=True, compacted=False)

    async def after_turn(self, params: AfterTurnParams) -> None:
        return None


# --- transcripts ------------------------------------------------------------------------------


def write_session(path: Path, session_id: str, messages: Iterable[dict[str, Any]]) -> int:
    """A pi v3 transcript: the header, then the messages as one chain. Returns its bytes."""
    header = {
        "type": "session",
        "version": 3,
        "id": session_id,
        "timestamp": "2026-04-24T00:00:00.000Z",
        "cwd": "/bench",
    }
    parent: str | None = None
    with path.open("w", encoding="utf-8") as out:
        out.write(json.dumps(header, separators=(",", ":")) + "\n")
        for index, message in enumerate(messages):
            entry_id = f"{index:08x}"
            entry = {
                "type": "message",
                "id": entry_id,
                "parentId": parent,
                "timestamp": "2026-04-24T00:00:01.000Z",
                "message": message,
            }
            out.write(json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n")
            parent = entry_id
    return path.stat().st_size


def short_conversation(count: int, seed: int) -> Iterable[dict[str, Any]]:
    """Short user/assistant pairs, for the many other sessions."""
    for index in range(count):
        ts = 1_774_000_000_000 + index
        if index % 2 == 0:
            yield {"role": "user", "content": f"q{seed}.{index} check it", "timestamp": ts}
        else:
            yield {
                "role": "assistant",
                "content": [{"type": "text", "text": f"a{seed}.{index} done"}],
                "stopReason": "stop",
                "timestamp": ts,
            }


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- samples and configurations ---------------------------------------------------------------


@dataclass
class Sample:
    wall: float  # seconds for the whole step (one turn, or one concurrent batch)
    cpu: float  # process CPU seconds over the step, all threads
    turns: int = 1
    states: list[dict[str, float]] = field(default_factory=list)  # codex-turn: ms per state


@dataclass
class Anomalies:
    """Turns that did not take the path the benchmark assumes (they are still counted)."""

    counts: dict[str, int] = field(default_factory=dict)

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


ANOMALIES = Anomalies()


class Config:
    """One measured configuration: ``step`` runs one unit (a turn, or a concurrent batch)."""

    name: str
    codex_turn = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.samples: list[Sample] = []
        self.rounds: list[int] = []
        self.calls = 0

    async def before(self) -> None:
        """Untimed work before each step (the other sessions' reads)."""

    async def step(self, prompt: str) -> Sample:
        raise NotImplementedError

    async def measure(self, round_: int, *, record: bool) -> Sample:
        self.calls += 1
        await self.before()
        sample = await self.step(f"turn {self.calls} of {self.name}")
        if record:
            self.samples.append(sample)
            self.rounds.append(round_)
        return sample

    def per_turn_ms(self) -> list[float]:
        return [s.wall / s.turns * 1000 for s in self.samples]

    def cpu_ms(self) -> float:
        turns = sum(s.turns for s in self.samples)
        return sum(s.cpu for s in self.samples) / turns * 1000 if turns else float("nan")


async def _timed(call: Awaitable[Any]) -> tuple[Any, float, float]:
    cpu = time.process_time()
    started = time.perf_counter()
    result = await call
    return result, time.perf_counter() - started, time.process_time() - cpu


class FloorConfig(Config):
    def __init__(self, name: str, client: BareClient, thread_id: str) -> None:
        super().__init__(name)
        self.client, self.thread_id = client, thread_id

    async def step(self, prompt: str) -> Sample:
        turn, wall, cpu = await _timed(self.client.run_turn(self.thread_id, prompt))
        reply = _reply(turn)
        if reply is not None and reply != f"ECHO: {prompt}":
            ANOMALIES.note(f"{self.name}: unexpected reply")
        return Sample(wall, cpu)


def _reply(turn: dict[str, Any]) -> str | None:
    """The turn's last agent message (``turn/completed``'s items), if it lists one."""
    texts = [i.get("text") for i in turn.get("items") or () if i.get("type") == "agentMessage"]
    return str(texts[-1]) if texts else None


class DurableFloorConfig(Config):
    """The floor plus the least durability a turn needs (module docstring, ``durable-floor``)."""

    def __init__(self, client: BareClient, thread_id: str, directory: Path) -> None:
        super().__init__("durable-floor")
        self.client, self.thread_id = client, thread_id
        self.transcript = directory / "durable-floor.jsonl"
        self.lock = directory / "durable-floor.jsonl.lock"

    async def step(self, prompt: str) -> Sample:
        _, wall, cpu = await _timed(self._turn(prompt))
        return Sample(wall, cpu)

    async def _turn(self, prompt: str) -> None:
        lock = os.open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(lock, json.dumps({"pid": os.getpid(), "createdAt": time.time()}).encode())
        finally:
            os.close(lock)
        try:
            with self.transcript.open("ab") as transcript:
                transcript.write(_line("user", prompt))
                transcript.flush()
                synced = asyncio.get_running_loop().run_in_executor(
                    None, os.fsync, transcript.fileno()
                )
                turn = await self.client.run_turn(self.thread_id, prompt)
                await synced
                reply = _reply(turn)
                if reply != f"ECHO: {prompt}":
                    ANOMALIES.note("durable-floor: unexpected reply")
                transcript.write(_line("assistant", reply or ""))
                transcript.flush()
                await asyncio.get_running_loop().run_in_executor(
                    None, os.fsync, transcript.fileno()
                )
        finally:
            os.unlink(self.lock)


def _line(role: str, text: str) -> bytes:
    message = {"role": role, "content": [{"type": "text", "text": text}]}
    return json.dumps({"type": "message", "message": message}).encode() + b"\n"


class SdkConfig(Config):
    def __init__(self, thread: Any) -> None:
        super().__init__("sdk")
        self.thread = thread

    async def step(self, prompt: str) -> Sample:
        result, wall, cpu = await _timed(self.thread.run(prompt))
        if result.final_response != f"ECHO: {prompt}":
            ANOMALIES.note("sdk: unexpected reply")
        return Sample(wall, cpu)


class Session:
    """A codex-turn session: its transcript, engine and params."""

    def __init__(self, name: str, path: Path, workspace: Path, engine: Any) -> None:
        self.name, self.path, self.workspace, self.engine = name, path, workspace, engine

    def params(self, prompt: str) -> TurnParams:
        return TurnParams(
            session_id=self.name,
            session_key=f"agent:bench:{self.name}",
            session_file=str(self.path),
            workspace_dir=str(self.workspace),
            prompt=prompt,
            base_developer_instructions=INSTRUCTIONS,
        )

    async def run(self, server: AppServer, prompt: str, *, echo: bool = True) -> TurnResult:
        """One turn; its reply must be the echo of the raw prompt (``echo``) or at least
        a completed turn (a projected prompt is echoed with its context)."""
        result = await run_codex_turn(self.params(prompt), app_server=server, engine=self.engine)
        text = result.assistant_text or ""
        if result.outcome.value != "completed" or (echo and text != f"ECHO: {prompt}"):
            raise RuntimeError(f"{self.name}: turn ended {result.outcome}: {result.prompt_error}")
        return result

    async def prime(self, server: AppServer) -> None:
        """The first turn: starts (and binds) the thread; a seeding engine stops seeding."""
        await self.run(server, f"prime {self.name}", echo=False)
        if isinstance(self.engine, PassThroughEngine):
            self.engine.seeding = False

    def touch(self) -> None:
        """What a turn's reading_history stage reads (see stages.read_history)."""
        path = str(self.path)
        ensure_transcript_writable(path, session_id=self.name, cwd=str(self.workspace))
        stripped_histories.read(path)
        read_binding(path, session_id=self.name)


def turn_states(name: str, result: TurnResult, wall: float) -> dict[str, float]:
    """ms per FSM state, plus ``outside`` (wall time the trace does not cover)."""
    decision = result.thread_decision
    if decision is None or decision.action.value != "resume" or result.projected:
        ANOMALIES.note(f"{name}: not a plain resume ({decision})")
    states = dict(result.durations_ms)
    states["outside"] = wall * 1000 - sum(states.values())
    return states


class TurnConfig(Config):
    codex_turn = True

    def __init__(
        self,
        name: str,
        server: AppServer,
        session: Session,
        before: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name)
        self.server, self.session, self._before = server, session, before

    async def before(self) -> None:
        if self._before is not None:
            self._before()

    async def step(self, prompt: str) -> Sample:
        result, wall, cpu = await _timed(self.session.run(self.server, prompt))
        return Sample(wall, cpu, states=[turn_states(self.name, result, wall)])


class BareBatch(Config):
    def __init__(self, name: str, client: BareClient, threads: list[str]) -> None:
        super().__init__(name)
        self.client, self.threads = client, threads

    async def step(self, prompt: str) -> Sample:
        async def one(thread_id: str, index: int) -> None:
            await self.client.run_turn(thread_id, f"{prompt} #{index}")

        async def batch() -> None:
            async with anyio.create_task_group() as tg:
                for index, thread_id in enumerate(self.threads):
                    tg.start_soon(one, thread_id, index)

        _, wall, cpu = await _timed(batch())
        return Sample(wall, cpu, turns=len(self.threads))


class TurnBatch(Config):
    codex_turn = True

    def __init__(self, name: str, server: AppServer, sessions: list[Session]) -> None:
        super().__init__(name)
        self.server, self.sessions = server, sessions

    async def step(self, prompt: str) -> Sample:
        states: list[dict[str, float]] = []

        async def one(session: Session, index: int) -> None:
            started = time.perf_counter()
            result = await session.run(self.server, f"{prompt} #{index}")
            states.append(turn_states(self.name, result, time.perf_counter() - started))

        async def batch() -> None:
            async with anyio.create_task_group() as tg:
                for index, session in enumerate(self.sessions):
                    tg.start_soon(one, session, index)

        _, wall, cpu = await _timed(batch())
        return Sample(wall, cpu, turns=len(self.sessions), states=states)


async def interleave(configs: Sequence[Config], *, rounds: int, warmup: int) -> None:
    """Run every configuration once per round, the order rotating round by round."""
    count = len(configs)
    for round_ in range(warmup + rounds):
        shift = round_ % count
        for config in [*configs[shift:], *configs[:shift]]:
            await config.measure(round_, record=round_ >= warmup)


# --- the world: processes, threads, sessions --------------------------------------------------


@dataclass
class World:
    args: argparse.Namespace
    stack: contextlib.AsyncExitStack
    model: ModelProcess
    root: Path
    workspace: Path
    _bare: tuple[BareClient, str] | None = None
    _server: AppServer | None = None

    def app_config(self, name: str) -> AppServerConfig:
        return AppServerConfig.offline(
            self.root / name,
            self.model.base_url,
            home=self.root / "home",
            env=self.model.proxy_env,
        )

    async def bare(self) -> tuple[BareClient, str]:
        """The floor's client and its (loaded, primed) thread."""
        if self._bare is None:
            client = await self.stack.enter_async_context(BareClient(self.app_config("bare")))
            thread_id = await client.start_thread(str(self.workspace))
            await client.run_turn(thread_id, "prime")
            self._bare = client, thread_id
        return self._bare

    async def durable_floor(self) -> DurableFloorConfig:
        """The durable floor, on a (loaded, primed) thread of its own of the floor's client."""
        client, _ = await self.bare()
        thread_id = await client.start_thread(str(self.workspace))
        await client.run_turn(thread_id, "prime")
        return DurableFloorConfig(client, thread_id, self.root)

    async def server(self) -> AppServer:
        if self._server is None:
            self._server = await self.stack.enter_async_context(
                AppServer.start(self.app_config("codex_turn"))
            )
        return self._server

    async def sdk(self) -> SdkConfig | None:
        try:
            from openai_codex import ApprovalMode, AsyncCodex, CodexConfig
        except ImportError:
            print("  (openai-codex SDK not installed: pip install openai-codex==0.163.0)")
            return None
        config = self.app_config("sdk")
        config.write()
        codex = await self.stack.enter_async_context(
            AsyncCodex(
                config=CodexConfig(codex_bin=str(bundled_codex_path()), env=config.environment())
            )
        )
        thread = await codex.thread_start(
            approval_mode=ApprovalMode.deny_all,
            cwd=str(self.workspace),
            developer_instructions=INSTRUCTIONS,
        )
        await thread.run("prime")
        return SdkConfig(thread)

    def session(self, name: str, messages: int, *, engine: bool) -> Session:
        directory = self.root / "sessions"
        directory.mkdir(exist_ok=True)
        path = directory / f"{name}.jsonl"
        if messages:
            started = time.perf_counter()
            size = write_session(path, name, conversation(messages))
            print(
                f"  transcript {name}: {messages:,} messages, {_mb(size)} "
                f"(written in {time.perf_counter() - started:.1f} s)",
                flush=True,
            )
        return Session(name, path, self.workspace, PassThroughEngine() if engine else None)

    async def turn_config(
        self, name: str, messages: int, *, engine: bool, before: Callable[[], None] | None = None
    ) -> TurnConfig:
        server = await self.server()
        session = self.session(name, messages, engine=engine)
        started = time.perf_counter()
        await session.prime(server)
        if messages:
            print(f"  primed {name} in {time.perf_counter() - started:.1f} s", flush=True)
        return TurnConfig(name, server, session, before)

    def others(self, count: int) -> list[Session]:
        """``count`` other sessions with short transcripts (written, not read yet)."""
        directory = self.root / "others"
        directory.mkdir(exist_ok=True)
        per = self.args.others_messages
        started, total = time.perf_counter(), 0
        sessions = []
        for index in range(count):
            name = f"other-{index:04d}"
            path = directory / f"{name}.jsonl"
            total += write_session(path, name, short_conversation(per, index))
            sessions.append(Session(name, path, self.workspace, None))
        print(
            f"  {count:,} other sessions x {per:,} messages: {_mb(total)} on disk, "
            f"{total / max(1, count) / 1e3:.0f} KB each "
            f"(written in {time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        return sessions

    def activate(self, others: Sequence[Session]) -> None:
        """Read each of ``others`` once, as a turn of theirs would: they become active."""
        before = rss_mb()
        started = time.perf_counter()
        for session in others:
            session.touch()
        print(
            f"  {len(others):,} other sessions active (read in "
            f"{time.perf_counter() - started:.1f} s); process RSS {before:.0f} MB before, "
            f"{rss_mb():.0f} MB after",
            flush=True,
        )


class Toucher:
    """Before each measured turn: the others' reads (all, or the next ``limit``; 0 = all)."""

    def __init__(self, others: list[Session], limit: int) -> None:
        self.others = others
        self.limit = limit if 0 < limit < len(others) else len(others)
        self.position = 0
        self.seconds: list[float] = []

    def __call__(self) -> None:
        started = time.perf_counter()
        count = len(self.others)
        for offset in range(self.limit):
            self.others[(self.position + offset) % count].touch()
        self.position = (self.position + self.limit) % count
        self.seconds.append(time.perf_counter() - started)


async def concurrent_configs(world: World, counts: Sequence[int]) -> list[Config]:
    """For each count C, a bare batch and a codex-turn batch of C turns at once."""
    largest = max(counts)
    client, _ = await world.bare()
    server = await world.server()
    threads: list[str] = []
    sessions: list[Session] = []
    for index in range(largest):
        sessions.append(world.session(f"conc-{index:03d}", 0, engine=False))

    async def start_bare(index: int) -> None:
        thread_id = await client.start_thread(str(world.workspace))
        await client.run_turn(thread_id, f"prime {index}")
        threads.append(thread_id)

    started = time.perf_counter()
    for first in range(0, largest, 32):
        async with anyio.create_task_group() as tg:
            for index in range(first, min(largest, first + 32)):
                tg.start_soon(start_bare, index)
                tg.start_soon(sessions[index].prime, server)
    print(
        f"  {largest} bare threads and {largest} codex-turn sessions primed in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    configs: list[Config] = []
    for count in counts:
        configs.append(BareBatch(f"bare-{count}", client, threads[:count]))
        configs.append(TurnBatch(f"concurrent-{count}", server, sessions[:count]))
    return configs


# --- reports ----------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _ratios(config: Config, floor: Config) -> tuple[float, float]:
    """Ratio of medians, and median of per-round ratios."""
    per_round = dict(zip(floor.rounds, floor.per_turn_ms(), strict=True))
    paired = [
        value / per_round[round_]
        for round_, value in zip(config.rounds, config.per_turn_ms(), strict=True)
        if round_ in per_round
    ]
    ratio = statistics.median(config.per_turn_ms()) / statistics.median(floor.per_turn_ms())
    return ratio, statistics.median(paired) if paired else float("nan")


def report_turns(configs: Sequence[Config], floor: Config) -> dict[str, float]:
    header = (
        f"{'config':<18} {'median ms':>9} {'p90':>7} | {'x floor':>7} {'paired':>6} "
        f"{'goal':>14} | {'cpu ms/turn':>11} {'goal':>13}"
    )
    print(header)
    print("-" * len(header))
    ratios: dict[str, float] = {}
    for config in configs:
        ms = config.per_turn_ms()
        ratio, paired = _ratios(config, floor)
        ratios[config.name] = ratio
        goal = RATIO_GOALS.get(config.name)
        goal_text = f"<= {goal:.2f} {_verdict(ratio <= goal)}" if goal else ""
        cpu = config.cpu_ms()
        cpu_goal = CPU_GOALS_MS.get(config.name)
        cpu_text = f"<= {cpu_goal:.1f} {_verdict(cpu <= cpu_goal)}" if cpu_goal else ""
        print(
            f"{config.name:<18} {statistics.median(ms):9.2f} {_p90(ms):7.2f} | "
            f"{ratio:7.3f} {paired:6.3f} {goal_text:>14} | {cpu:11.2f} {cpu_text:>13}"
        )
    return ratios


def _p90(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def report_states(configs: Sequence[Config]) -> None:
    turn_configs = [c for c in configs if c.codex_turn and c.samples]
    if not turn_configs:
        return
    # The trace order of the fullest turn first, then anything else; ``outside`` last.
    everything = [d for c in turn_configs for sample in c.samples for d in sample.states]
    if not everything:
        return
    fullest = max(everything, key=len)
    states = list(dict.fromkeys([*fullest, *(s for d in everything for s in d)]))
    states = [s for s in states if s != "outside"] + ["outside"]
    short = {s: s.lower()[:9] for s in states}
    print("median ms per FSM state (codex-turn; outside = wall time not covered by the trace):")
    print(f"{'config':<18} | " + " ".join(f"{short[s]:>9}" for s in states))
    for config in turn_configs:
        cells = []
        for state in states:
            values = [d.get(state, 0.0) for sample in config.samples for d in sample.states]
            cells.append(f"{statistics.median(values):9.3f}")
        print(f"{config.name:<18} | " + " ".join(cells))


# --- phases -----------------------------------------------------------------------------------

PHASE_CONFIGS = {
    "A": ("floor", "durable-floor", "sdk", "no-engine", *PASSTHROUGH_SIZES),
    "B": tuple(ACTIVE_COUNTS),
    "C": tuple(CONCURRENCY),
}


def selected(args: argparse.Namespace) -> tuple[list[str], set[str] | None]:
    """``--only``: the phases to run, in order, and the configurations named (``None``: all
    of each phase's)."""
    items = [item.strip() for item in args.only.split(",") if item.strip()]
    names = {item for item in items if item in CONFIG_NAMES}
    unknown = [item for item in items if item not in names and item.upper() not in PHASE_CONFIGS]
    if unknown:
        raise SystemExit(f"--only: unknown phase or configuration {', '.join(unknown)}")
    phases = [
        phase
        for phase, members in PHASE_CONFIGS.items()
        if phase in {item.upper() for item in items} or names & set(members)
    ]
    explicit = {item.upper() for item in items if item not in names}
    if not names:
        return phases, None
    # A phase named as a whole keeps all its configurations.
    return phases, names | {n for phase in explicit for n in PHASE_CONFIGS.get(phase, ())}


def wanted(args: argparse.Namespace, name: str) -> bool:
    names: set[str] | None = selected(args)[1]
    return names is None or name in names


async def phase_single(world: World) -> None:
    args = world.args
    print("\n== A. single turns on a loaded thread, interleaved ==", flush=True)
    client, thread_id = await world.bare()
    floor = FloorConfig("floor", client, thread_id)
    configs: list[Config] = [floor]
    if wanted(args, "durable-floor"):
        configs.append(await world.durable_floor())
    sdk = await world.sdk() if wanted(args, "sdk") else None
    if sdk is not None:
        configs.append(sdk)
    if wanted(args, "no-engine"):
        configs.append(await world.turn_config("no-engine", 0, engine=False))
    for name, size in PASSTHROUGH_SIZES.items():
        if not wanted(args, name):
            continue
        if size <= args.max_history:
            configs.append(await world.turn_config(name, size, engine=True))
        else:
            print(f"  {name} skipped (--max-history {args.max_history})")
    started = time.perf_counter()
    await interleave(configs, rounds=args.rounds, warmup=args.warmup)
    print(
        f"{args.warmup} + {args.rounds} rounds in {time.perf_counter() - started:.1f} s\n",
        flush=True,
    )
    report_turns(configs, floor)
    print()
    report_states(configs)


async def phase_active(world: World) -> None:
    args = world.args
    counts = [c for name, c in ACTIVE_COUNTS.items() if c <= args.max_active and wanted(args, name)]
    print(
        f"\n== B. one session ({ACTIVE_SESSION_MESSAGES:,} messages, pass-through) with "
        f"{', '.join(map(str, counts))} other active sessions ==",
        flush=True,
    )
    others = world.others(max(counts))
    client, thread_id = await world.bare()
    results: list[tuple[int, Config, Config]] = []
    active = 0
    for count in counts:
        name = f"active-{count}"
        world.activate(others[active:count])
        active = count
        touch = Toucher(others[:count], args.touch)
        config = await world.turn_config(name, ACTIVE_SESSION_MESSAGES, engine=True, before=touch)
        floor = FloorConfig("floor", client, thread_id)
        started = time.perf_counter()
        await interleave([floor, config], rounds=args.active_rounds, warmup=args.warmup)
        print(
            f"  block {name}: {time.perf_counter() - started:.1f} s; {touch.limit} other "
            f"sessions read before each measured turn (median "
            f"{statistics.median(touch.seconds) * 1000:.0f} ms, untimed); "
            f"RSS {rss_mb():.0f} MB",
            flush=True,
        )
        results.append((count, floor, config))
    print()
    header = (
        f"{'config':<12} {'median ms':>9} {'floor ms':>9} | {'x floor':>7} {'paired':>6} | "
        f"{'cpu ms/turn':>11} | {'vs K=1':>6} {'no cliff':>9}"
    )
    print(header)
    print("-" * len(header))
    base: float | None = None
    for count, block_floor, block in results:
        ratio, paired = _ratios(block, block_floor)
        base = ratio if base is None else base
        relative = ratio / base
        verdict = _verdict(relative <= CLIFF_TOLERANCE) if count != counts[0] else ""
        print(
            f"{block.name:<12} {statistics.median(block.per_turn_ms()):9.2f} "
            f"{statistics.median(block_floor.per_turn_ms()):9.2f} | {ratio:7.3f} {paired:6.3f} | "
            f"{block.cpu_ms():11.2f} | {relative:6.3f} {verdict:>9}"
        )
    print(f"(no cliff: each K's x floor within {CLIFF_TOLERANCE:.2f}x of the first K's)\n")
    report_states([block for _, _, block in results])


async def phase_concurrent(world: World) -> None:
    args = world.args
    counts = [
        c for name, c in CONCURRENCY.items() if c <= args.max_concurrency and wanted(args, name)
    ]
    print(
        f"\n== C. concurrency: {', '.join(map(str, counts))} turns at once on one app-server ==",
        flush=True,
    )
    configs = await concurrent_configs(world, counts)
    started = time.perf_counter()
    await interleave(configs, rounds=args.conc_rounds, warmup=1)
    print(f"  {1 + args.conc_rounds} rounds in {time.perf_counter() - started:.1f} s\n")
    header = (
        f"{'C':>4} | {'bare turns/s':>12} {'cpu ms/turn':>11} | {'codex-turn turns/s':>18} "
        f"{'cpu ms/turn':>11} | {'ratio':>5} {'goal':>11}"
    )
    print(header)
    print("-" * len(header))
    for bare, ours in zip(configs[::2], configs[1::2], strict=True):
        count = bare.samples[0].turns
        bare_tps = statistics.median(s.turns / s.wall for s in bare.samples)
        ours_tps = statistics.median(s.turns / s.wall for s in ours.samples)
        ratio = ours_tps / bare_tps
        goal = CONCURRENCY_GOALS.get(count)
        goal_text = f">= {goal:.2f} {_verdict(ratio >= goal)}" if goal else "(shown)"
        print(
            f"{count:>4} | {bare_tps:12.1f} {bare.cpu_ms():11.2f} | {ours_tps:18.1f} "
            f"{ours.cpu_ms():11.2f} | {ratio:5.3f} {goal_text:>11}"
        )
    print()
    report_states([c for c in configs if c.codex_turn])


# --- profile ----------------------------------------------------------------------------------


class ThreadProfiles:
    """cProfile in the worker threads too: wraps ``anyio.to_thread.run_sync`` (every worker
    hop of the library goes through it) so each call runs under its thread's profiler."""

    def __init__(self, make: Callable[[], cProfile.Profile]) -> None:
        self.make = make
        self.enabled = False
        self.hops = 0  # worker-thread calls while enabled
        self.profiles: list[cProfile.Profile] = []
        self._local = threading.local()
        self._original = anyio.to_thread.run_sync

    def install(self) -> None:
        original = self._original

        async def run_sync(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return await original(func, *args, **kwargs)
            self.hops += 1

            def profiled(*inner: Any) -> Any:
                profile: cProfile.Profile | None = getattr(self._local, "profile", None)
                if profile is None:
                    profile = self.make()
                    self._local.profile = profile
                    self.profiles.append(profile)
                profile.enable()
                try:
                    return func(*inner)
                finally:
                    profile.disable()

            return await original(profiled, *args, **kwargs)

        anyio.to_thread.run_sync = run_sync  # type: ignore[assignment]

    def uninstall(self) -> None:
        anyio.to_thread.run_sync = self._original


_ROOT = str(Path(__file__).resolve().parents[1]) + "/"  # the checkout, cut from profile paths


def _where(key: tuple[str, int, str]) -> str:
    filename, line, function = key
    if filename == "~":
        return function
    for marker in ("site-packages/", "/lib/python3", _ROOT):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return f"{filename}:{line}({function})"


#: Event-loop machinery and this script's own frames: left out of the cumulative ranking.
_PLUMBING = (
    "bench_floor.py",
    "asyncio/base_events.py",
    "asyncio/events.py",
    "asyncio/runners.py",
    "selectors.py",
    "_contextvars.Context",
    "select.epoll",
    "anyio/_backends/_asyncio.py:2",
    "anyio/_core/_eventloop.py",
)


def print_profile(stats: pstats.Stats, turns: int, clock: str) -> None:
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for _, _, tt, _, _ in raw.values())
    print(f"profiled {clock} time (own, all profiled threads): {total / turns * 1000:.2f} ms/turn")
    print("(calls: entries per turn; a coroutine counts once per resumption)")
    for title, index in (("cumulative", 3), ("own (total) time", 2)):
        print(f"\ntop 25 by {title} ({clock}), per turn:")
        print(f"{'calls':>8} {'own ms':>8} {'cum ms':>8}  function")
        entries = list(raw.items())
        if index == 3:
            entries = [e for e in entries if not any(p in _where(e[0]) for p in _PLUMBING)]
        ranked = sorted(entries, key=lambda item: item[1][index], reverse=True)[:25]
        for key, (_, calls, tt, ct, _) in ranked:
            print(
                f"{calls / turns:8.1f} {tt / turns * 1000:8.3f} {ct / turns * 1000:8.3f}  "
                f"{_where(key)}"
            )


async def build_one(world: World, name: str) -> Config:
    if name == "floor":
        client, thread_id = await world.bare()
        return FloorConfig("floor", client, thread_id)
    if name == "durable-floor":
        return await world.durable_floor()
    if name == "sdk":
        sdk = await world.sdk()
        if sdk is None:
            raise SystemExit("the openai-codex SDK is not installed")
        return sdk
    if name == "no-engine":
        return await world.turn_config(name, 0, engine=False)
    if name in PASSTHROUGH_SIZES:
        return await world.turn_config(name, PASSTHROUGH_SIZES[name], engine=True)
    if name in ACTIVE_COUNTS:
        others = world.others(ACTIVE_COUNTS[name])
        world.activate(others)
        touch = Toucher(others, world.args.touch)
        return await world.turn_config(name, ACTIVE_SESSION_MESSAGES, engine=True, before=touch)
    count = CONCURRENCY[name]
    return (await concurrent_configs(world, [count]))[1]


async def run_profile(world: World, name: str) -> None:
    args = world.args
    print(f"\n== profile of {name} ==", flush=True)
    config = await build_one(world, name)
    for round_ in range(max(2, args.warmup)):
        await config.measure(round_, record=False)
    steps = max(1, args.profile_turns // (CONCURRENCY.get(name, 1)))
    for round_ in range(steps):
        await config.measure(round_, record=True)
    turns = sum(s.turns for s in config.samples)
    print(
        f"unprofiled: median {statistics.median(config.per_turn_ms()):.2f} ms/turn, "
        f"client CPU {config.cpu_ms():.2f} ms/turn over {turns} turns"
    )
    report_states([config])
    config.samples.clear()
    config.rounds.clear()

    def make() -> cProfile.Profile:
        # cpu: each thread's own CPU time (waiting in epoll or fsync is not counted).
        if args.profile_clock == "cpu":
            return cProfile.Profile(time.thread_time)
        return cProfile.Profile()

    threads = ThreadProfiles(make)
    threads.install()
    main = make()
    original_step = config.step

    async def profiled_step(prompt: str) -> Sample:
        threads.enabled = True
        main.enable()
        try:
            return await original_step(prompt)
        finally:
            main.disable()
            threads.enabled = False

    config.step = profiled_step  # type: ignore[method-assign]
    for round_ in range(steps):
        await config.measure(round_, record=True)
    threads.uninstall()
    turns = sum(s.turns for s in config.samples)
    print(
        f"profiled: median {statistics.median(config.per_turn_ms()):.2f} ms/turn, "
        f"client CPU {config.cpu_ms():.2f} ms/turn over {turns} turns "
        f"({len(threads.profiles)} worker thread(s) profiled, "
        f"{threads.hops / max(1, turns):.1f} worker-thread hops per turn)"
    )
    stats = pstats.Stats(main)
    for profile in threads.profiles:
        stats.add(profile)
    if args.profile_out:
        stats.dump_stats(args.profile_out)
        print(f"(written to {args.profile_out})")
    print_profile(stats, turns, args.profile_clock)


# --- main -------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    model = ModelProcess()
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-floor-", dir=args.tmp) as tmp:
            root = Path(tmp)
            workspace = root / "workspace"
            workspace.mkdir()
            print(f"codex app-server {bundled_codex_path()}")
            print(
                f"temp dir {root}; rounds {args.rounds} (+{args.warmup} warm-up); "
                f"cpus {os.cpu_count()}; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            async with contextlib.AsyncExitStack() as stack:
                world = World(args, stack, model, root, workspace)
                if args.profile:
                    await run_profile(world, args.profile)
                else:
                    phases: dict[str, Callable[[World], Awaitable[None]]] = {
                        "A": phase_single,
                        "B": phase_active,
                        "C": phase_concurrent,
                    }
                    for phase in selected(args)[0]:
                        await phases[phase](world)
            stats = model.stats()
    finally:
        model.close()
    print_run_end(started, stats)


def print_run_end(started: float, stats: dict[str, int]) -> None:
    """The lines every run ends with: turns off their assumed path, the time, the model's
    request count and the attempts to reach the internet (always 0)."""
    if ANOMALIES.counts:
        print("\nturns off the assumed path:")
        for what, count in sorted(ANOMALIES.counts.items()):
            print(f"  {count:4d}  {what}")
    print(
        f"\ntotal {time.perf_counter() - started:.1f} s; model requests {stats['requests']}; "
        f"proxy CONNECT attempts (internet): {stats['proxy_attempts']}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (< 3 minutes)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (30; quick 8)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (3; quick 2)")
    parser.add_argument("--only", default="A,B,C", help="phases (A,B,C) or configurations to run")
    parser.add_argument(
        "--others-messages", type=int, default=None, help="messages per other session (1000; 200)"
    )
    parser.add_argument(
        "--touch",
        type=int,
        default=0,
        help="other sessions read before each measured turn (0: all of them)",
    )
    parser.add_argument(
        "--active-rounds",
        type=int,
        default=None,
        help="rounds of each many-sessions block (10; quick: --rounds)",
    )
    parser.add_argument("--conc-rounds", type=int, default=None, help="concurrency rounds (8; 2)")
    parser.add_argument(
        "--max-history", type=int, default=None, help="skip larger N (100000; quick 10000)"
    )
    parser.add_argument("--max-active", type=int, default=1_000, help="skip more others")
    parser.add_argument("--max-concurrency", type=int, default=128, help="skip larger C")
    parser.add_argument("--tmp", default=None, help="parent of the temp dir (e.g. /dev/shm)")
    parser.add_argument("--profile", choices=CONFIG_NAMES, help="cProfile one configuration")
    parser.add_argument("--profile-turns", type=int, default=40)
    parser.add_argument("--profile-out", default=None, help="also write the pstats here")
    parser.add_argument(
        "--profile-clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: per-thread CPU time (where client CPU goes); wall: includes blocking waits",
    )
    parser.add_argument("--log", action="store_true", help="keep info/debug logging on")
    parser.add_argument("--serve-model", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    if args.rounds is None:
        args.rounds = 8 if quick else 30
    if args.warmup is None:
        args.warmup = 2 if quick else 3
    if args.others_messages is None:
        args.others_messages = 200 if quick else 1000
    if args.active_rounds is None:
        args.active_rounds = args.rounds if quick else 10
    if args.max_history is None:
        args.max_history = 10_000 if quick else 100_000
    if args.conc_rounds is None:
        args.conc_rounds = 2 if quick else 8
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.serve_model:
        serve_model()
        sys.exit(0)
    if not arguments.log:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, arguments)
