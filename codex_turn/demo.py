"""The offline demo: three turns of a session through the real Codex app-server.

Everything is real except the model: the pinned ``codex app-server`` binary runs the loop and
talks to the offline Responses-API server on 127.0.0.1, with every proxy variable pointed at
that server's 403 trap, so any attempt to reach the internet would be counted (and the demo
prints the count). A small in-memory context engine projects its memory once per epoch
(``thread_bootstrap``); the demo shows the thread decision of each turn, the FSM trace with
the time spent per state, a dynamic tool call, and what the model was actually sent.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog

from codex_turn.harness.appserver import AppServer, AppServerConfig, DynamicTool
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
    MaintainParams,
    MaintenanceResult,
)
from codex_turn.harness.orchestrator import TurnParams, TurnResult, run_codex_turn
from codex_turn.testing import OfflineModel, Reply

__all__ = ["DemoMemoryEngine", "run_demo"]


class DemoMemoryEngine:
    """A tiny context engine: remembers every message it is given, recalls the newest ones.

    It projects with ``thread_bootstrap``: the recalled context enters a Codex thread once per
    epoch, and resumed turns get the raw prompt (no quadratic re-sending).
    """

    info = ContextEngineInfo(id="demo-memory", name="Demo memory", version="1.0")

    def __init__(self, *, recall: int = 6) -> None:
        self.memory: list[dict[str, Any]] = []
        self.recall = recall
        self.epoch = 1

    async def ingest(self, params: IngestParams) -> IngestResult:
        self.memory.append(params.message)
        return IngestResult(ingested=True)

    async def after_turn(self, params: AfterTurnParams) -> None:
        self.memory.extend(params.messages[params.pre_prompt_message_count :])

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        recalled = list(params.messages[-self.recall :])
        return AssembleResult(
            messages=recalled,
            estimated_tokens=sum(len(str(m.get("content", ""))) for m in recalled) // 4,
            system_prompt_addition=f"You remember {len(self.memory)} earlier messages.",
            context_projection=ContextProjection(mode="thread_bootstrap", epoch=f"e{self.epoch}"),
        )

    async def maintain(self, params: MaintainParams) -> MaintenanceResult:
        return MaintenanceResult(changed=False, bytes_freed=0, rewritten_entries=0)

    async def compact(self, params: CompactParams) -> CompactResult:
        self.epoch += 1  # a compacted memory is a new epoch: the next turn re-projects
        return CompactResult(ok=True, compacted=True)


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
        engine = DemoMemoryEngine()
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
        print(
            f"\ntranscript: {len(lines)} lines (OpenClaw JSONL v3); "
            f"engine memory: {len(engine.memory)} messages"
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
