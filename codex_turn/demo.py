"""The offline demo: three turns of a session through the real Codex app-server.

Everything is real except the model: the pinned ``codex app-server`` binary runs the loop and
talks to the offline Responses-API server on 127.0.0.1, with every proxy variable pointed at
that server's 403 trap, so any attempt to reach the internet would be counted (and the demo
prints the count). The context engine is the embedded default, the reference
:class:`~codex_turn.engines.SqliteContextEngine` with its store next to the transcript: it
keeps every message losslessly and projects its context once per epoch
(``thread_bootstrap``). The demo shows the thread decision of each turn, the FSM trace with
the time spent per state, a dynamic tool call, what the model was actually sent, and what the
engine's store holds at the end.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog

from codex_turn.engines import SqliteContextEngine
from codex_turn.harness.appserver import AppServer, AppServerConfig, DynamicTool
from codex_turn.harness.orchestrator import TurnParams, TurnResult, run_codex_turn
from codex_turn.testing import OfflineModel, Reply

__all__ = ["run_demo"]


async def _weather(arguments: dict[str, Any]) -> str:
    return f"{arguments.get('city', 'somewhere')}: 21 C, clear"


WEATHER = DynamicTool(
    name="lookup_weather",
    description="Current weather for a city.",
    input_schema={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    fn=_weather,
)

PROMPTS: Sequence[str] = (
    "Hi! Please remember that my favourite city is Lisbon.",
    "What is the weather in my favourite city?",
    "Thanks. Summarise what we talked about.",
)


def _print_turn(index: int, result: TurnResult, request: Any) -> None:
    decision = result.thread_decision
    print(f"\nturn {index}: outcome={result.outcome.value} thread={result.thread_id}")
    if decision is not None:
        print(
            f"  thread decision: {decision.action.value} ({decision.reason}), "
            f"context projected: {result.projected}"
        )
    durations = result.durations_ms
    for entry in result.trace:
        spent = durations.get(entry.dest)
        timing = f"{spent:8.2f} ms in {entry.dest}" if spent is not None else ""
        print(f"    {entry.state:<16} --{entry.trigger:<27}--> {entry.dest:<16} {timing}")
    print(
        f"  maintenance: {result.maintenance.status}"
        + (f" ({result.maintenance.skip_reason})" if result.maintenance.skip_reason else "")
    )
    print(
        f"  model was sent: {len(request.developer_parts)} developer parts, "
        f"{len(request.user_messages)} user messages, tools={request.tool_names}"
    )
    print(f"  assistant: {result.assistant_text}")


async def _main(workdir: Path) -> int:
    model = OfflineModel().start()
    try:
        model.script(Reply.echo())
        model.script(Reply.function_call("lookup_weather", {"city": "Lisbon"}), Reply.echo())
        model.script(Reply.fixed("We talked about Lisbon and its weather (21 C, clear)."))
        config = AppServerConfig.offline(
            workdir / "codex-home", model.base_url, env=model.proxy_env(), home=workdir
        )
        workspace = workdir / "workspace"
        workspace.mkdir()
        session_file = workdir / "session.jsonl"
        engine = SqliteContextEngine.next_to(session_file)  # the embedded default
        print(f"offline model on {model.base_url}; session transcript {session_file.name}")
        async with AppServer.start(config) as server:
            for index, prompt in enumerate(PROMPTS, start=1):
                result = await run_codex_turn(
                    TurnParams(
                        session_id="demo-session",
                        session_key="agent:demo:main",
                        session_file=session_file,
                        workspace_dir=workspace,
                        prompt=prompt,
                        base_developer_instructions="You are a concise assistant.",
                    ),
                    app_server=server,
                    engine=engine,
                    tools=[WEATHER],
                )
                _print_turn(index, result, model.turn_requests()[-1])
        lines = session_file.read_text(encoding="utf-8").splitlines()
        store = await engine.doctor(repair=False)
        engine.close()
        print(
            f"\ntranscript: {len(lines)} lines (OpenClaw JSONL v3); engine store "
            f"context.sqlite: {store.messages} messages, {store.summaries} summaries, "
            f"{'healthy' if store.ok else 'problems: ' + ', '.join(store.problems)}"
        )
        print(
            f"model requests: {len(model.requests)}; internet attempts (proxy CONNECTs): "
            f"{len(model.proxy_attempts)}"
        )
        return 0 if not model.proxy_attempts else 1
    finally:
        model.close()


def run_demo() -> int:
    """Run the demo in a throwaway directory; quiet logs (warnings only)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="codex-turn-demo-") as directory:
        return anyio.run(_main, Path(directory))
