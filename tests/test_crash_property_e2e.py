"""Crash and fault property over the whole turn, against the real binary.

Hypothesis draws a session of a few turns; each turn meets one fault at a random stage: the
app-server killed (SIGKILL) or stopped (SIGSTOP, a wedged process) while the model answers,
the model failing, the disk failing when the prompt is made durable (before ``turn/start``)
or when the reply is mirrored, or the host "restarting"
after the turn (a new ``AppServer`` on the same Codex home, with every in-process cache
dropped, as a new host process would start). After the faults, one clean turn runs. Then:

* every turn that returned ``completed`` has its prompt and its reply in the transcript, each
  exactly once; every turn that reached Codex has its prompt there exactly once (the user's
  words are durable before the model sees them, and the mirror is idempotent);
* the binding names a thread of this session (its session id, and the thread of the last
  turn);
* the clean turn's model request carries every earlier completed turn: the model did not
  lose the conversation.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.transcripts import transcript_texts

from codex_turn import AppServer, AppServerConfig, TurnOutcome, TurnParams, read_binding
from codex_turn.harness.appserver import AppServerProcess
from codex_turn.harness.session import clear_session_cache
from codex_turn.harness.turn import context as turn_context
from codex_turn.harness.turn import stages
from codex_turn.testing import OfflineModel, Reply

pytestmark = pytest.mark.codex

FAULTS = ("none", "kill", "stall", "model_error", "disk", "disk_early", "host_restart")
SESSION = "crash-session"


def _disk_full(*_args: Any, **_kwargs: Any) -> Any:
    raise OSError(28, "No space left on device")


def _signal_current(server: AppServer, sig: signal.Signals) -> None:
    client = server.current
    assert client is not None
    process = client.transport
    assert isinstance(process, AppServerProcess)
    if sig is signal.SIGKILL:
        process.kill()
    else:
        os.kill(process.pid, sig)


class Host:
    """One host process's view: an app-server, and the turns it ran."""

    def __init__(self, config: Callable[[], AppServerConfig]) -> None:
        self.config = config
        self.server: AppServer | None = None
        self.stack: Any = None

    async def start(self) -> AppServer:
        self.stack = AppServer.start(self.config())
        self.server = await self.stack.__aenter__()
        return self.server

    async def stop(self) -> None:
        if self.stack is not None:
            await self.stack.__aexit__(None, None, None)
        self.stack = self.server = None


async def _session(plan: list[str], workdir: Path, codex_binary: Path) -> None:
    session_file = str(workdir / "session.jsonl")
    workspace = workdir / "workspace"
    workspace.mkdir()
    with OfflineModel() as model:
        home = workdir / "home"
        home.mkdir()

        def config() -> AppServerConfig:
            # One Codex home for the whole session: a "restarted host" finds its threads.
            return AppServerConfig.offline(
                workdir / "codex_home",
                model.base_url,
                env=dict(model.proxy_env()),
                codex_bin=codex_binary,
                home=home,
                request_timeout=10.0,
                liveness_timeout=1.0,
            )

        host = Host(config)
        server = await host.start()
        completed: list[tuple[str, str]] = []  # (prompt, reply) of every completed turn
        reached_codex: list[str] = []
        last_thread: str | None = None
        try:
            for index, fault in enumerate([*plan, "none"]):
                prompt = f"turn {index} ({fault}) marker-{index}-x"
                params = TurnParams(
                    session_id=SESSION,
                    session_file=session_file,
                    workspace_dir=str(workspace),
                    prompt=prompt,
                    idle_timeout=3.0,
                    turn_timeout=20.0,
                    cleanup_timeout=5.0,
                )
                real_mirror, real_prompt_mirror = stages.mirror_turn, stages.mirror_prompt
                if fault == "model_error":
                    model.script(Reply.http_error(400, "model refused"), user_contains=prompt)
                elif fault in ("kill", "stall"):
                    model.script(Reply.fixed("never", delay=30.0), user_contains=prompt)
                elif fault == "disk":
                    stages.mirror_turn = _disk_full  # type: ignore[assignment]
                elif fault == "disk_early":
                    # The disk fails when the prompt is made durable, before turn/start.
                    stages.mirror_prompt = _disk_full  # type: ignore[assignment]
                requests_before = len(model.turn_requests())

                async def fault_soon(
                    fault: str = fault, before: int = requests_before, srv: AppServer = server
                ) -> None:
                    if fault not in ("kill", "stall"):
                        return
                    await anyio.to_thread.run_sync(model.wait_for_requests, before + 1)
                    _signal_current(srv, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

                try:
                    async with anyio.create_task_group() as group:
                        group.start_soon(fault_soon)
                        with anyio.fail_after(60):
                            result = await run(params, server)
                finally:
                    stages.mirror_turn = real_mirror  # type: ignore[assignment]
                    stages.mirror_prompt = real_prompt_mirror  # type: ignore[assignment]
                if fault == "disk_early":
                    # Nothing reached the model: the turn failed and says why.
                    assert result.outcome is TurnOutcome.FAILED
                    assert len(model.turn_requests()) == requests_before
                if any(
                    e.trigger in ("turn_completed", "turn_failed", "turn_aborted", "turn_timed_out")
                    for e in result.trace
                ):
                    reached_codex.append(prompt)
                if result.outcome is TurnOutcome.COMPLETED:
                    assert result.assistant_text
                    completed.append((prompt, result.assistant_text))
                    last_thread = result.thread_id
                if fault == "none" and index == len(plan):
                    # The clean turn after every fault: it completes and sees the conversation.
                    assert result.outcome is TurnOutcome.COMPLETED, result.outcome
                    request = model.turn_requests()[-1]
                    seen = "\n".join(request.user_messages)
                    for earlier, _reply in completed[:-1]:
                        assert earlier in seen, f"the model lost {earlier!r}"
                if fault == "host_restart":
                    await host.stop()
                    clear_session_cache()
                    turn_context.stripped_histories = turn_context.StrippedHistories()
                    server = await host.start()
        finally:
            await host.stop()

    clear_session_cache(session_file)
    texts = transcript_texts(session_file)
    for prompt in reached_codex:
        assert texts.count(prompt) == 1, f"prompt {prompt!r} {texts.count(prompt)}x in transcript"
    for prompt, reply in completed:
        assert texts.count(reply) == 1, f"reply of {prompt!r}: {texts.count(reply)}x"
    binding = read_binding(session_file, session_id=SESSION)
    assert binding is not None
    assert binding.session_id == SESSION
    assert binding.thread_id == last_thread


async def run(params: TurnParams, server: AppServer) -> Any:
    from codex_turn import run_codex_turn

    return await run_codex_turn(params, app_server=server)


@settings(
    max_examples=int(os.environ.get("CODEX_TURN_CRASH_EXAMPLES", "4")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=st.lists(st.sampled_from(FAULTS), min_size=2, max_size=4))
# Every fault at least once, whatever the generator draws.
@example(plan=["stall", "none"])
@example(plan=["kill", "host_restart", "disk", "disk_early"])
@example(plan=["model_error", "host_restart", "kill"])
def test_no_fault_loses_the_conversation(plan: list[str], codex_binary: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="codex-turn-crash-") as directory:
        anyio.run(_session, plan, Path(directory), codex_binary)
