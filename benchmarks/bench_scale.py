"""Queue-to-result overhead of :mod:`codex_turn.scale` against a direct ``run_codex_turn``.

    .venv/bin/python benchmarks/bench_scale.py [--pairs 30] [--warmup 3] [--tmp DIR]

One real ``codex app-server`` and one offline model (a fixed reply) serve every turn; one
in-process :class:`~codex_turn.scale.TurnWorker` on an embedded SQLite system database runs
the queued ones. Pairs of turns, the order inside a pair alternating, on two sessions of their
own (so both kinds resume a bound thread every turn):

* **direct**: ``await run_codex_turn(params, app_server=server)``;
* **queued**: ``await (await queue.submit_async(params, turn_id=...)).result_async()``: the
  enqueue, the worker's dequeue (queue polling every 5 ms), the workflow and step
  checkpoints, and the handle's polling of the result (every 5 ms).

Overhead = queued - direct of the same pair (median, p90); ratio = median queued / median
direct. Goal: overhead <= 10 ms per turn on SQLite. No engine (plain Codex) in both, so the
figure is the queue's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

from codex_turn import AppServer, AppServerConfig, TurnParams, run_codex_turn
from codex_turn.scale import TurnQueue, TurnWorker
from codex_turn.testing import OfflineModel, Reply


def _params(tmp: Path, session: str, prompt: str) -> TurnParams:
    return TurnParams(
        session_id=session,
        session_file=tmp / f"{session}.jsonl",
        workspace_dir=tmp,
        prompt=prompt,
    )


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench(tmp: Path, model: OfflineModel, pairs: int, warmup: int) -> None:
    url = f"sqlite:///{tmp}/turns.sqlite"
    config = AppServerConfig.offline(
        tmp / "codex-home", model.base_url, env=model.proxy_env(), home=tmp
    )
    queue = await asyncio.to_thread(TurnQueue, url)
    direct: list[float] = []
    queued: list[float] = []
    async with AppServer.start(config) as server, TurnWorker(url, app_server=server):
        for i in range(warmup + pairs):
            order = ("direct", "queued") if i % 2 == 0 else ("queued", "direct")
            for kind in order:
                start = time.perf_counter()
                if kind == "direct":
                    await run_codex_turn(_params(tmp, "direct", f"d{i}"), app_server=server)
                else:
                    handle = await queue.submit_async(
                        _params(tmp, "queued", f"q{i}"), turn_id=f"q-{i}"
                    )
                    await handle.result_async()
                took = (time.perf_counter() - start) * 1000
                if i >= warmup:
                    (direct if kind == "direct" else queued).append(took)
    queue.close()
    overhead = [q - d for q, d in zip(queued, direct, strict=True)]
    print(f"turns: {pairs} pairs (+{warmup} warm-up), embedded SQLite, offline model, no engine")
    print(f"direct run_codex_turn  median {statistics.median(direct):7.2f} ms")
    print(f"queued (TurnQueue)     median {statistics.median(queued):7.2f} ms")
    print(
        f"overhead per turn      median {statistics.median(overhead):7.2f} ms, "
        f"p90 {_quantile(overhead, 0.9):7.2f} ms (goal <= 10 ms)"
    )
    print(f"ratio queued/direct    {statistics.median(queued) / statistics.median(direct):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tmp", help="where the database, Codex home and sessions live")
    args = parser.parse_args()
    logging.getLogger("codex_turn").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp, OfflineModel() as model:
        model.script(Reply.fixed("ok"), times=1_000_000)
        asyncio.run(bench(Path(tmp), model, args.pairs, args.warmup))


if __name__ == "__main__":
    main()
