"""Benchmark the app-server client against the real binary and the offline model.

Prints, in one run against the same offline model:

* turn round trip (turn/start -> turn/completed, echo model) through our anyio client and
  through the official ``openai-codex`` Python SDK (``AsyncCodex``), and their ratio
  (ours / SDK; below 1.0 means we are faster);
* initialize latency (spawn -> ``initialize`` response) on a warm CODEX_HOME;
* resident memory (VmRSS, and the peak VmHWM) of one app-server process serving 1, 8 and 32
  threads, each having run one turn concurrently.

Usage: ``.venv/bin/python benchmarks/bench_appserver.py [--turns 30] [--inits 5]``.
The SDK is the ``sdk`` extra: ``.venv/bin/pip install openai-codex==0.163.0``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codex_turn.harness.appserver import (
    AppServer,
    AppServerClient,
    AppServerConfig,
    AppServerProcess,
    ThreadSettings,
    bundled_codex_path,
)
from codex_turn.testing import OfflineModel


def _summary(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    return (
        f"median {statistics.median(ms):6.1f} ms  min {ms[0]:6.1f}  max {ms[-1]:6.1f}  n={len(ms)}"
    )


def _rss_kb(pid: int) -> tuple[int, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


async def bench_round_trip(
    ours_config: AppServerConfig, sdk_config: AppServerConfig, workspace: Path, turns: int
) -> tuple[list[float], list[float] | None]:
    """Both clients up at once, turns interleaved (ours, SDK, ours, …): machine noise and
    warm-up hit both sides alike. The first 3 turns of each are warm-up."""
    try:
        from openai_codex import ApprovalMode, AsyncCodex, CodexConfig
    except ImportError:
        print("  (openai-codex SDK not installed: pip install openai-codex==0.163.0)")
        AsyncCodex = None
    ours: list[float] = []
    sdk: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(AppServer.start(ours_config))
        thread = await server.start_thread(
            ThreadSettings(cwd=str(workspace), developer_instructions="bench")
        )
        sdk_thread = None
        if AsyncCodex is not None:
            sdk_config.write()
            codex = await stack.enter_async_context(
                AsyncCodex(
                    config=CodexConfig(
                        codex_bin=str(bundled_codex_path()), env=sdk_config.environment()
                    )
                )
            )
            sdk_thread = await codex.thread_start(
                approval_mode=ApprovalMode.deny_all,
                cwd=str(workspace),
                developer_instructions="bench",
            )
        for i in range(turns + 3):
            started = time.perf_counter()
            result = await server.run_turn(thread.thread_id, f"turn {i}")
            elapsed = time.perf_counter() - started
            assert result.final_text == f"ECHO: turn {i}", result
            if i >= 3:
                ours.append(elapsed)
            if sdk_thread is not None:
                started = time.perf_counter()
                sdk_result = await sdk_thread.run(f"turn {i}")
                elapsed = time.perf_counter() - started
                assert sdk_result.final_response == f"ECHO: turn {i}", sdk_result
                if i >= 3:
                    sdk.append(elapsed)
    return ours, (sdk if AsyncCodex is not None else None)


async def bench_initialize(config: AppServerConfig, runs: int) -> list[float]:
    samples: list[float] = []
    for i in range(runs + 1):
        started = time.perf_counter()
        async with AppServerClient.connect(config):
            elapsed = time.perf_counter() - started
        if i >= 1:  # the first start initialises a fresh CODEX_HOME
            samples.append(elapsed)
    return samples


async def bench_rss(config: AppServerConfig, workspace: Path, counts: list[int]) -> None:
    for count in counts:
        async with AppServer.start(config) as server:
            client = server.current
            assert client is not None
            assert isinstance(client.transport, AppServerProcess)
            pid = client.transport.pid
            idle_rss, _ = _rss_kb(pid)

            async def one(i: int) -> None:
                thread = await server.start_thread(ThreadSettings(cwd=str(workspace)))
                result = await server.run_turn(thread.thread_id, f"thread {i}")
                assert result.final_text == f"ECHO: thread {i}"

            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(count):
                    tg.start_soon(one, i)
            elapsed = time.perf_counter() - started
            rss, hwm = _rss_kb(pid)
            print(
                f"  {count:2d} threads: RSS {rss / 1024:6.1f} MB (peak {hwm / 1024:6.1f} MB, "
                f"after initialize {idle_rss / 1024:6.1f} MB); "
                f"all turns done in {elapsed * 1000:6.0f} ms"
            )


async def main(turns: int, inits: int) -> None:
    with OfflineModel() as model, tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        root = Path(tmp)
        workspace = root / "workspace"
        workspace.mkdir()

        def config(name: str) -> AppServerConfig:
            return AppServerConfig.offline(
                root / name, model.base_url, home=root / "home", env=model.proxy_env()
            )

        print(f"codex app-server {bundled_codex_path()}")
        print("turn round trip (turn/start -> turn/completed, echo model):")
        ours, sdk = await bench_round_trip(config("ours"), config("sdk"), workspace, turns)
        print(f"  codex_turn client : {_summary(ours)}")
        if sdk:
            print(f"  openai-codex SDK  : {_summary(sdk)}")
            ratio = statistics.median(ours) / statistics.median(sdk)
            print(f"  ratio ours/SDK (median): {ratio:.2f}  (target <= 1.0)")
        print("initialize latency (spawn -> initialize response, warm CODEX_HOME):")
        print(f"  {_summary(await bench_initialize(config('init'), inits))}")
        print("resident memory of one app-server process:")
        await bench_rss(config("rss"), workspace, [1, 8, 32])
        print(f"proxy CONNECT attempts during the run: {len(model.proxy_attempts)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--inits", type=int, default=5)
    parser.add_argument("--log", action="store_true", help="keep info/debug logging on")
    args = parser.parse_args()
    if not args.log:
        # As an embedding application would: the per-turn info lines are not free.
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, args.turns, args.inits)
