"""Orchestration overhead of :func:`codex_turn.run_codex_turn` against a raw client turn.

    .venv/bin/python benchmarks/bench_orchestrator.py [--pairs 30] [--warmup 3]
        [--sizes 100,1000,10000] [--tmp DIR] [--profile out.prof] [--log]

One real ``codex app-server`` process and one offline (echo) model serve every turn. For each
session-history size N (messages already in the transcript) and each engine mode, the script
runs *pairs* of turns, interleaved round-robin across all configurations (so machine noise
hits every size alike), with the order inside each pair alternating:

* **raw**: ``server.run_turn(thread_id, prompt)`` on a thread of its own, already started and
  loaded (plain client use);
* **orchestrated**: ``run_codex_turn(TurnParams(...), app_server=server, engine=engine)`` on a
  session transcript pre-populated with N messages, whose thread is bound (the first, warm-up
  turn starts it) and resumed every later turn.

Engine modes: ``engine`` is a trivial in-process engine (every method returns at once; its
``assemble`` returns a fixed two-message list with ``context_projection`` mode
``thread_bootstrap`` and a constant epoch, so after the first turn every turn resumes the
thread with the raw prompt: the model input is the raw turn's); ``none`` is no engine.

Overhead = orchestrated - raw of the same pair (median and p90 over pairs); ratio = median
orchestrated / median raw. Growth compares the median overhead at 1k and 10k messages
(target: <= 20 %). The raw turn varies by several ms from turn to turn (it is a real Codex
turn over HTTP), so the paired difference is noisy at the 1 ms scale; ``outside-turn`` is the
low-noise complement: orchestrated wall time minus its RUNNING_TURN state, i.e. everything
the orchestrator does around the Codex turn (it still includes the ``thread/resume`` round
trip, which is Codex time). ``resume rpc`` is a bare ``thread/resume`` of a loaded thread,
measured in the same rounds, to show how much of that is Codex's. The breakdown is the
median of ``TurnResult.durations_ms`` per FSM state; ``outside`` is the wall time not covered
by the FSM trace (session gate, ``had_session_file`` stat, engine detection, result building,
the final log line). RUNNING_TURN is where the Codex turn happens: compare it with the raw
median. Each orchestrated turn mirrors two messages, so a transcript
grows by ``2 * (warmup + pairs)`` messages during the run.

``--tmp`` chooses where CODEX_HOME and the transcripts live (the mirror and the binding
``fsync``: ``--tmp /dev/shm`` removes the disk from the figures). ``--profile`` writes a
cProfile of the orchestrated turns (all sizes) and prints its top functions.
Logging is filtered to warnings, as an embedding application would run it (``--log`` keeps
info lines; they go to stdout).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codex_turn import TurnParams, run_codex_turn
from codex_turn.harness.appserver import (
    AppServer,
    AppServerConfig,
    ThreadSettings,
    bundled_codex_path,
)
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
from codex_turn.testing import OfflineModel

INSTRUCTIONS = "You are a benchmark assistant."
SCOPE = "codex-app-server:bench-thread"

# --- a trivial engine ---------------------------------------------------------------------


class NoopEngine:
    """Every method returns immediately; assemble returns the same small list each turn."""

    info = ContextEngineInfo(id="bench-noop", name="Bench no-op engine", version="1")

    def __init__(self) -> None:
        self._assembly = AssembleResult(
            messages=[
                {"role": "user", "content": "remember: the sky is blue", "timestamp": 1},
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "noted"}],
                    "timestamp": 2,
                },
            ],
            estimated_tokens=20,
            context_projection=ContextProjection(mode="thread_bootstrap", epoch="epoch-1"),
        )

    async def ingest(self, params: IngestParams) -> IngestResult:
        return IngestResult(ingested=True)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        return self._assembly

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(ok=True, compacted=False)

    async def after_turn(self, params: AfterTurnParams) -> None:
        return None


# --- transcripts ---------------------------------------------------------------------------


def write_transcript(path: Path, count: int, session_id: str) -> None:
    """A v3 transcript of ``count`` chained message entries (user/assistant alternating),
    as the mirror writes them."""
    header = {
        "type": "session",
        "version": 3,
        "id": session_id,
        "timestamp": "2026-04-24T00:00:00.000Z",
        "cwd": "/",
    }
    lines = [json.dumps(header, separators=(",", ":"))]
    parent: str | None = None
    for index in range(count):
        ts = 1_774_000_000_000 + index
        turn, kind = divmod(index, 2)
        if kind == 0:
            message: dict[str, Any] = {
                "role": "user",
                "content": f"please look at item {turn} " + "x" * 120,
                "timestamp": ts,
            }
        else:
            message = {
                "role": "assistant",
                "content": [{"type": "text", "text": f"done with {turn} " + "a" * 300}],
                "api": "openai-codex-responses",
                "provider": "openai",
                "model": "gpt-5.5",
                "usage": {"input": 1200, "output": 300, "totalTokens": 1500},
                "stopReason": "stop",
                "timestamp": ts,
            }
        identity = f"turn-{turn}:{'prompt' if kind == 0 else 'assistant'}"
        entry_id = f"{index:08x}"
        entry = {
            "type": "message",
            "id": entry_id,
            "parentId": parent,
            "timestamp": "2026-04-24T00:00:01.000Z",
            "message": {**message, "idempotencyKey": f"{SCOPE}:{identity}"},
        }
        lines.append(json.dumps(entry, separators=(",", ":")))
        parent = entry_id
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- measurement ---------------------------------------------------------------------------


class Config:
    """One (size, engine mode) configuration: a raw thread and an orchestrated session."""

    def __init__(self, size: int, mode: str, root: Path, workspace: Path) -> None:
        self.size = size
        self.mode = mode
        self.name = f"{mode}-{size}"
        self.session_file = root / f"{self.name}.jsonl"
        self.workspace = workspace
        self.engine: object | None = NoopEngine() if mode == "engine" else None
        write_transcript(self.session_file, size, self.name)
        self.raw_thread = ""
        self.raw: list[float] = []
        self.orch: list[float] = []
        self.states: list[dict[str, float]] = []
        self.resume: list[float] = []
        self.turn = 0

    def params(self, prompt: str) -> TurnParams:
        return TurnParams(
            session_id=self.name,
            session_key=f"agent:bench:{self.name}",
            session_file=self.session_file,
            workspace_dir=self.workspace,
            prompt=prompt,
            base_developer_instructions=INSTRUCTIONS,
        )


async def raw_turn(server: AppServer, config: Config, prompt: str) -> float:
    started = time.perf_counter()
    result = await server.run_turn(config.raw_thread, prompt)
    elapsed = time.perf_counter() - started
    assert result.final_text == f"ECHO: {prompt}", result
    return elapsed


async def orchestrated_turn(
    server: AppServer, config: Config, prompt: str, profiler: cProfile.Profile | None
) -> tuple[float, dict[str, float], Any]:
    params = config.params(prompt)
    if profiler is not None:
        profiler.enable()
    started = time.perf_counter()
    result = await run_codex_turn(params, app_server=server, engine=config.engine)
    elapsed = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
    text = result.assistant_text or ""
    assert text.startswith("ECHO: "), (result.outcome, result.prompt_error)
    states = dict(result.durations_ms)
    states["outside"] = elapsed * 1000 - sum(states.values())
    return elapsed, states, result


async def resume_rpc(server: AppServer, thread_id: str, workspace: Path) -> float:
    """A bare ``thread/resume`` of a loaded thread: the Codex round trip every resumed
    orchestrated turn pays (developer instructions are re-sent on resume by design)."""
    started = time.perf_counter()
    await server.resume_thread(
        thread_id, ThreadSettings(developer_instructions=INSTRUCTIONS, cwd=str(workspace), tools=[])
    )
    return time.perf_counter() - started


async def one_pair(
    server: AppServer,
    config: Config,
    *,
    probe_thread: str,
    record: bool,
    raw_first: bool,
    profiler: cProfile.Profile | None,
) -> None:
    config.turn += 1
    prompt = f"turn {config.turn} of {config.name}"
    if raw_first:
        raw = await raw_turn(server, config, prompt)
        orch, states, result = await orchestrated_turn(server, config, prompt, profiler)
    else:
        orch, states, result = await orchestrated_turn(server, config, prompt, profiler)
        raw = await raw_turn(server, config, prompt)
    resume = await resume_rpc(server, probe_thread, config.workspace)
    if config.turn > 1:
        # Same model input as the raw turn: a resumed thread, the raw prompt.
        decision = result.thread_decision
        assert decision is not None
        assert decision.action.value == "resume", decision
        assert not result.projected
        assert result.assistant_text == f"ECHO: {prompt}", result.assistant_text
    if record:
        config.raw.append(raw)
        config.orch.append(orch)
        config.states.append(states)
        config.resume.append(resume)


def _p(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _overheads(config: Config) -> list[float]:
    return [(o - r) * 1000 for o, r in zip(config.orch, config.raw, strict=True)]


def _outside_turn(config: Config) -> list[float]:
    """Orchestrated wall time minus the RUNNING_TURN state (the Codex turn itself)."""
    return [
        o * 1000 - states.get("RUNNING_TURN", 0.0)
        for o, states in zip(config.orch, config.states, strict=True)
    ]


def report(configs: list[Config]) -> None:
    print()
    header = (
        f"{'engine':>6} {'N':>6} | {'raw ms':>7} {'orch ms':>8} | "
        f"{'overhead ms med':>15} {'p90':>6} | {'ratio':>5} | "
        f"{'outside-turn ms med':>19} {'p90':>6} | {'resume rpc':>10}"
    )
    print(header)
    print("-" * len(header))
    medians: dict[tuple[str, int], float] = {}
    accounted: dict[tuple[str, int], float] = {}
    for config in configs:
        over = _overheads(config)
        outside = _outside_turn(config)
        medians[config.mode, config.size] = statistics.median(over)
        accounted[config.mode, config.size] = statistics.median(outside)
        print(
            f"{config.mode:>6} {config.size:>6} | "
            f"{statistics.median(config.raw) * 1000:7.2f} "
            f"{statistics.median(config.orch) * 1000:8.2f} | "
            f"{statistics.median(over):15.2f} {_p(over, 0.9):6.2f} | "
            f"{statistics.median(config.orch) / statistics.median(config.raw):5.2f} | "
            f"{statistics.median(outside):19.2f} {_p(outside, 0.9):6.2f} | "
            f"{statistics.median(config.resume) * 1000:10.2f}"
        )
    print()
    for label, table in (("paired overhead", medians), ("outside-turn time", accounted)):
        for mode in dict.fromkeys(c.mode for c in configs):
            small, large = table.get((mode, 1000)), table.get((mode, 10000))
            if small is None or large is None:
                continue
            growth = (large - small) / abs(small) * 100 if small else float("nan")
            verdict_1k = "ok" if small <= 2.0 else "MISSED"
            verdict_growth = "ok" if growth <= 20.0 else "MISSED"
            print(
                f"{label:>17} [{mode:>6}]: 1k = {small:6.2f} ms (<= 2 ms: {verdict_1k:6}); "
                f"10k = {large:6.2f} ms; growth 1k->10k = {growth:+6.1f} % "
                f"(<= 20 %: {verdict_growth})"
            )
    print()
    print("median time per FSM state of the orchestrated turn (ms):")
    states = list(dict.fromkeys(s for c in configs for sample in c.states for s in sample))
    short = {s: s.lower()[:11] for s in states}
    print(f"{'engine':>6} {'N':>6} | " + " ".join(f"{short[s]:>11}" for s in states))
    for config in configs:
        cells = []
        for state in states:
            values = [sample.get(state, 0.0) for sample in config.states]
            cells.append(f"{statistics.median(values):11.3f}")
        print(f"{config.mode:>6} {config.size:>6} | " + " ".join(cells))
    print(
        "(running_tur(n) is the Codex turn itself: compare it with the raw median; "
        "starting_th(read) holds the thread/resume round trip and the binding write;\n"
        " outside = wall time not covered by the FSM trace)"
    )


async def main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    profiler = cProfile.Profile() if args.profile else None
    with (
        OfflineModel() as model,
        tempfile.TemporaryDirectory(prefix="bench-orch-", dir=args.tmp) as tmp,
    ):
        root = Path(tmp)
        workspace = root / "workspace"
        workspace.mkdir()
        config = AppServerConfig.offline(
            root / "codex_home", model.base_url, home=root / "home", env=model.proxy_env()
        )
        print(f"codex app-server {bundled_codex_path()}")
        print(f"temp dir {root} ; sizes {sizes} ; modes {modes} ; pairs {args.pairs}")
        configs = [Config(size, mode, root, workspace) for size in sizes for mode in modes]
        started = time.perf_counter()
        async with AppServer.start(config) as server:
            for c in configs:
                thread = await server.start_thread(
                    ThreadSettings(cwd=str(workspace), developer_instructions=INSTRUCTIONS)
                )
                c.raw_thread = thread.thread_id
            probe = await server.start_thread(
                ThreadSettings(cwd=str(workspace), developer_instructions=INSTRUCTIONS)
            )
            await server.run_turn(probe.thread_id, "probe")  # a rollout exists from now on
            for round_ in range(args.warmup + args.pairs):
                record = round_ >= args.warmup
                for index, c in enumerate(configs):
                    await one_pair(
                        server,
                        c,
                        record=record,
                        probe_thread=probe.thread_id,
                        raw_first=(round_ + index) % 2 == 0,
                        profiler=profiler if record else None,
                    )
        elapsed = time.perf_counter() - started
        report(configs)
        print(
            f"\n{len(configs) * (args.warmup + args.pairs) * 2} turns in {elapsed:.1f} s; "
            f"proxy CONNECT attempts: {len(model.proxy_attempts)}"
        )
    if profiler is not None:
        profiler.dump_stats(args.profile)
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        print(f"\ncProfile of the orchestrated turns (written to {args.profile}):")
        print(out.getvalue())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--modes", default="engine,none", help="engine,none (comma-separated)")
    parser.add_argument("--tmp", default=None, help="parent dir of the temp dir (e.g. /dev/shm)")
    parser.add_argument("--profile", default=None, help="write a cProfile here and print it")
    parser.add_argument("--log", action="store_true", help="keep info/debug logging on")
    arguments = parser.parse_args()
    if not arguments.log:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, arguments)
