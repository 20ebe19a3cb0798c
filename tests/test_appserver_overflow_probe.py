"""Protocol facts of the REAL ``codex app-server`` 0.163.0: context-window overflow and a
thread's token usage, pinned for the code that builds on them.

Overflow. The Responses API refuses an over-long prompt inside the stream:
``response.failed`` whose ``response.error.code`` is ``context_length_exceeded``
(:meth:`Reply.context_length_exceeded`). Codex fails the turn with ``codexErrorInfo``
``"contextWindowExceeded"`` (:data:`~codex_turn.harness.appserver.types.CONTEXT_WINDOW_EXCEEDED`,
read by ``CodexTurnResult.context_window_exceeded``) on ``error`` and on ``turn/completed``,
never retries it (retries are on here, and a generic stream failure *is* retried), reports the
window as full, and compacts the thread before its next turn. An HTTP 400 carrying the same
code is just a 400: ``"other"``, its body as the message.

Token usage. ``thread/tokenUsage/updated`` follows each model response that carries
``usage``: ``last`` is that response's counts (``inputTokens`` the whole prompt, cached part
included; ``totalTokens`` copied from the response, not recomputed), ``total`` their sum over
the thread, ``modelContextWindow`` 95% of the configured window (``model_context_window``,
in config.toml or a thread's ``config``; the offline ``mock-model`` has no metadata, so
272000, reported as 258400). A response without ``usage`` produces no notification. A
``thread/resume`` that loads the thread in a new process replays the last notification from
the rollout (after the response, which has no usage field; the last turn's ``turnId``); a
thread that never had usage gets none, and a thread this process holds gets none either.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn.harness.appserver import (
    AppServer,
    AppServerConfig,
    CodexTurnStatus,
    ModelProviderConfig,
    Notification,
    ThreadSettings,
)
from codex_turn.harness.appserver.types import CONTEXT_WINDOW_EXCEEDED
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

ConfigFactory = Callable[..., AppServerConfig]

#: ``modelContextWindow`` for ``mock-model`` (no model metadata: Codex's fallback window).
FALLBACK_WINDOW = 258_400
OVERFLOW_MESSAGE = (
    "Codex ran out of room in the model's context window. "
    "Start a new thread or clear earlier history before retrying."
)
TOKEN_USAGE = "thread/tokenUsage/updated"


def of_thread(seen: list[Notification], thread_id: str, method: str) -> list[dict[str, Any]]:
    return [dict(n.params) for n in seen if n.method == method and n.thread_id == thread_id]


def counts(
    *, input: int, cached: int, output: int, total: int, reasoning: int = 0
) -> dict[str, int]:
    """A ``TokenUsageBreakdown`` as Codex reports it (camelCase; no cache writes offline)."""
    return {
        "totalTokens": total,
        "inputTokens": input,
        "cachedInputTokens": cached,
        "cacheWriteInputTokens": 0,
        "outputTokens": output,
        "reasoningOutputTokens": reasoning,
    }


async def test_context_length_exceeded_fails_the_turn_once_and_the_next_turn_compacts(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    retrying = ModelProviderConfig(
        base_url=offline_model.base_url, request_max_retries=2, stream_max_retries=2
    )
    seen: list[Notification] = []
    settings = ThreadSettings(cwd=str(workspace))
    async with AppServer.start(make_appserver_config(provider=retrying)) as server:
        server.add_listener(seen.append)
        # The stream form: one request, no retry, typed as an overflow.
        thread = (await server.start_thread(settings)).thread_id
        offline_model.script(Reply.context_length_exceeded(), times=3)
        result = await server.run_turn(thread, "too long")
        offline_model.clear_script()
        assert len(offline_model.turn_requests()) == 1
        assert result.outcome is CodexTurnStatus.FAILED
        assert result.error_info == CONTEXT_WINDOW_EXCEEDED == "contextWindowExceeded"
        assert result.context_window_exceeded
        assert result.prompt_error == OVERFLOW_MESSAGE
        (error,) = of_thread(seen, thread, "error")
        assert error["willRetry"] is False
        assert error["error"]["codexErrorInfo"] == "contextWindowExceeded"
        assert error["error"]["message"] == OVERFLOW_MESSAGE
        (completed,) = of_thread(seen, thread, "turn/completed")
        assert completed["turn"]["status"] == "failed"
        assert completed["turn"]["error"]["codexErrorInfo"] == "contextWindowExceeded"
        # Codex reports the window as full: every count zero, the total the window.
        (usage,) = of_thread(seen, thread, TOKEN_USAGE)
        full = counts(input=0, cached=0, output=0, total=FALLBACK_WINDOW)
        assert usage["tokenUsage"] == {
            "total": full,
            "last": full,
            "modelContextWindow": FALLBACK_WINDOW,
        }
        # ... so the thread's next turn compacts it first, then answers.
        again = await server.run_turn(thread, "again")
        assert again.outcome is CodexTurnStatus.COMPLETED
        assert again.final_text == "ECHO: again"
        assert [r.request_kind for r in offline_model.requests] == ["turn", "compaction", "turn"]
        assert len(again.compaction_item_ids) == 1

        # Retries are live: any other stream failure is retried (1 + 2 requests).
        other = (await server.start_thread(settings)).thread_id
        before = len(offline_model.requests)
        offline_model.script(Reply.failed("server_error", "boom"), times=3)
        flaky = await server.run_turn(other, "flaky")
        assert len(offline_model.requests) - before == 3
        assert flaky.outcome is CodexTurnStatus.FAILED
        assert flaky.error_info == "other"
        assert not flaky.context_window_exceeded

        # The HTTP form is not an overflow to Codex: a plain 400, not retried.
        refused = (await server.start_thread(settings)).thread_id
        body = json.dumps(
            {
                "error": {
                    "message": "Your input exceeds the context window of this model.",
                    "type": "invalid_request_error",
                    "code": "context_length_exceeded",
                }
            }
        )
        before = len(offline_model.requests)
        offline_model.script(Reply.http_error(400, body), times=3)
        bad = await server.run_turn(refused, "too long over http")
        offline_model.clear_script()
        assert len(offline_model.requests) - before == 1
        assert bad.outcome is CodexTurnStatus.FAILED
        assert bad.error_info == "other"
        assert not bad.context_window_exceeded
        assert bad.prompt_error == body
        assert of_thread(seen, refused, TOKEN_USAGE) == []


async def test_token_usage_reports_the_response_usage_and_the_configured_window(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    seen: list[Notification] = []
    appserver.add_listener(seen.append)
    settings = ThreadSettings(cwd=str(workspace))
    # The response's usage, as Codex reports it: inputTokens includes the cached part,
    # totalTokens is the response's total_tokens as sent (7, not 1030).
    thread = (await appserver.start_thread(settings)).thread_id
    offline_model.script(Reply.echo(usage={"input": 1000, "cached": 200, "output": 30, "total": 7}))
    result = await appserver.run_turn(thread, "count me")
    (usage,) = of_thread(seen, thread, TOKEN_USAGE)
    last = counts(input=1000, cached=200, output=30, total=7)
    assert usage["turnId"] == result.turn_id
    assert usage["tokenUsage"] == {
        "total": last,
        "last": last,
        "modelContextWindow": FALLBACK_WINDOW,
    }
    assert result.usage is not None
    assert (result.usage.input, result.usage.cache_read, result.usage.output) == (800, 200, 30)
    assert result.context_window == FALLBACK_WINDOW

    # No usage in the response: no notification at all.
    silent = (await appserver.start_thread(settings)).thread_id
    offline_model.script(Reply.echo(usage={}))
    quiet = await appserver.run_turn(silent, "no usage")
    assert quiet.outcome is CodexTurnStatus.COMPLETED
    assert of_thread(seen, silent, TOKEN_USAGE) == []
    assert (quiet.usage, quiet.context_window) == (None, None)

    # model_context_window sets the window; Codex reports 95% of it (a thread's config here,
    # the same key as in config.toml).
    sized = (
        await appserver.start_thread(settings, config={"model_context_window": 20_000})
    ).thread_id
    assert (await appserver.run_turn(sized, "sized")).context_window == 19_000


async def test_a_resume_in_a_new_process_replays_the_last_token_usage(
    make_appserver_config: ConfigFactory, offline_model: OfflineModel, workspace: Path
) -> None:
    settings = ThreadSettings(cwd=str(workspace))
    first = make_appserver_config()
    seen: list[Notification] = []
    async with AppServer.start(first) as server:
        server.add_listener(seen.append)
        used = (
            await server.start_thread(settings, config={"model_context_window": 20_000})
        ).thread_id
        offline_model.script(Reply.echo(usage={"input": 1000, "cached": 200, "output": 30}))
        await server.run_turn(used, "one")
        await server.run_turn(used, "two")  # the default usage: 100 in, 10 out
        silent = (await server.start_thread(settings)).thread_id
        offline_model.script(Reply.echo(usage={}))
        await server.run_turn(silent, "no usage")
        # A resume of a thread this process holds replays nothing.
        await server.resume_thread(used, settings)
        third = await server.run_turn(used, "three")
        assert len(of_thread(seen, used, TOKEN_USAGE)) == 3  # one per model response

    replayed: list[Notification] = []
    async with AppServer.start(make_appserver_config(codex_home=first.codex_home)) as server:
        server.add_listener(replayed.append)
        # Resumed first: a replay for it would arrive before the other thread's.
        await server.resume_thread(silent, settings)
        raw = await server.request("thread/resume", {"threadId": used, "excludeTurns": True})
        assert not any("usage" in key.lower() for key in raw)
        with anyio.fail_after(10):
            while not of_thread(replayed, used, TOKEN_USAGE):  # noqa: ASYNC110 - from the reader
                await anyio.sleep(0.01)
        (replay,) = of_thread(replayed, used, TOKEN_USAGE)
        assert of_thread(replayed, silent, TOKEN_USAGE) == []
        total = counts(input=1200, cached=200, output=50, total=1250)
        assert replay["tokenUsage"] == {
            "total": total,
            "last": counts(input=100, cached=0, output=10, total=110),
            "modelContextWindow": 19_000,  # as recorded: the thread's config of process one
        }
        assert replay["turnId"] == third.turn_id
        # The thread's config did not survive the resume: the next turn has the default window.
        after = await server.run_turn(used, "four")
        assert after.context_window == FALLBACK_WINDOW
