"""The structured projection against the real binary: items injected into an ephemeral fork.

What the model receives is asserted on the offline model's recorded requests:

* the injected history arrives as role items, in order, right before the raw prompt, with no
  text frame anywhere; identical assemblies give byte-identical items;
* ``prompt_cache_key`` is the base thread's id on every turn (10 projected turns);
* over 20 turns of a growing conversation the request stays bounded: each assembled message
  appears once (turn 1's prompt at most once in the 20th request);
* a base with no rollout is anchored (the anchor never reaches the model);
* a rejected injection or an unknown base gives a typed failure (the turn's text fallback).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from codex_turn import AppServer
from codex_turn.harness.appserver import ThreadSettings, tool
from codex_turn.harness.turn.structured import (
    ForkFailed,
    PreparedFork,
    prepare_fork,
    supports_structured,
)
from codex_turn.projection import CONTEXT_HEADER
from codex_turn.projection.items import ConvertedItems, convert_messages
from codex_turn.testing import OfflineModel, RecordedRequest

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

DEV = "DEV-MARKER-structured-15"


def convert(messages: list[dict[str, Any]], prompt: str = "") -> list[dict[str, Any]]:
    converted = convert_messages(messages, prompt=prompt, payload_policy="shape-only")
    assert isinstance(converted, ConvertedItems), converted
    return list(converted.items)


async def base_thread(server: AppServer, workspace: Path, **kwargs: Any) -> str:
    settings = ThreadSettings(cwd=str(workspace), developer_instructions=DEV, **kwargs)
    return (await server.start_thread(settings)).thread_id


async def forked_turn(
    server: AppServer,
    model: OfflineModel,
    base: str,
    items: list[dict[str, Any]],
    prompt: str,
    workspace: Path,
) -> tuple[PreparedFork, RecordedRequest]:
    seen = len(model.turn_requests())
    prepared = await prepare_fork(
        server, base, items, ThreadSettings(developer_instructions=DEV, cwd=str(workspace))
    )
    assert isinstance(prepared, PreparedFork), prepared
    result = await server.run_turn(prepared.fork_thread_id, prompt, timeout=60)
    assert result.outcome.value == "completed"
    server.forget_thread(prepared.fork_thread_id)
    requests = model.turn_requests()
    assert len(requests) == seen + 1
    return prepared, requests[-1]


def injected_segment(request: RecordedRequest, count: int) -> list[dict[str, Any]]:
    """The ``count`` items right before the final user prompt."""
    items = request.input_items
    return items[len(items) - 1 - count : len(items) - 1]


CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "INJ_U1 list the files"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "INJ_A1 looking"},
            {"type": "toolCall", "id": "c1", "name": "exec", "arguments": {"command": "ls"}},
        ],
    },
    {"role": "toolResult", "toolCallId": "c1", "content": "a.py"},
    {"role": "assistant", "content": [{"type": "text", "text": "INJ_A2 one file"}]},
    {"role": "compactionSummary", "summary": "INJ_SUMMARY earlier work"},
    {"role": "user", "content": "RAW_PROMPT_1"},
]


async def test_items_arrive_in_order_before_the_raw_prompt_without_a_frame(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    assert supports_structured(appserver)
    base = await base_thread(appserver, workspace)
    items = convert(CONVERSATION, "RAW_PROMPT_1")
    prepared, request = await forked_turn(
        appserver, offline_model, base, items, "RAW_PROMPT_1", workspace
    )
    assert prepared.anchored  # a fresh base has no rollout
    sent = request.input_items
    assert sent[-1]["role"] == "user"
    assert request.user_messages[-1] == "RAW_PROMPT_1"
    assert injected_segment(request, len(items)) == items  # ids, order and content verbatim
    assert [i["type"] for i in items] == [
        "message",
        "message",
        "function_call",
        "function_call_output",
        "message",
        "message",
    ]
    body = json.dumps(request.body)
    assert CONTEXT_HEADER not in body
    assert "item_reference" not in body
    assert "RAW_PROMPT_1" not in json.dumps(sent[:-1])  # the duplicate prompt was dropped
    assert any(DEV in part for part in request.developer_parts)


async def test_identical_assembly_gives_byte_identical_items(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    base = await base_thread(appserver, workspace)
    first = convert(CONVERSATION, "RAW_PROMPT_1")
    second = convert(json.loads(json.dumps(CONVERSATION)), "RAW_PROMPT_1")
    assert json.dumps(first) == json.dumps(second)
    _, one = await forked_turn(appserver, offline_model, base, first, "RAW_PROMPT_1", workspace)
    _, two = await forked_turn(appserver, offline_model, base, second, "RAW_PROMPT_1", workspace)
    assert json.dumps(injected_segment(one, len(first))) == json.dumps(
        injected_segment(two, len(second))
    )


async def test_cache_key_is_stable_and_the_request_bounded_over_20_turns(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    base = await base_thread(appserver, workspace)
    history: list[dict[str, Any]] = list(CONVERSATION[:-1])
    requests: list[RecordedRequest] = []
    for k in range(1, 21):
        prompt = f"TURN_{k}_PROMPT"
        items = convert([*history, {"role": "user", "content": prompt}], prompt)
        _, request = await forked_turn(appserver, offline_model, base, items, prompt, workspace)
        requests.append(request)
        history += [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": [{"type": "text", "text": f"ECHO: {prompt}"}]},
        ]
    keys = {r.body.get("prompt_cache_key") for r in requests[:10]}
    assert keys == {base}
    assert {r.body.get("prompt_cache_key") for r in requests} == {base}
    last = requests[-1]
    assert sum("TURN_1_PROMPT" in text for text in last.user_messages) == 1
    assert sum("INJ_U1" in text for text in last.user_messages) == 1
    # Bounded: the growth from turn 1 to turn 20 is the 19 new exchanges, nothing more.
    sizes = [len(r.input_items) for r in requests]
    assert sizes == [sizes[0] + 2 * i for i in range(20)]
    # The content before the prompt is the previous request's, item for item (ids aside:
    # Codex names each fork's copy of the base instructions anew).
    for before, after in itertools.pairwise(requests):
        strip = [{k: v for k, v in i.items() if k != "id"} for i in before.input_items[:-1]]
        now = [{k: v for k, v in i.items() if k != "id"} for i in after.input_items]
        assert now[: len(strip)] == strip


async def test_fork_keeps_the_base_threads_dynamic_tools(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    @tool("lookup_weather", "Look up the weather", {"type": "object", "properties": {}})
    async def lookup(_arguments: dict[str, Any]) -> str:
        return "sunny"

    base = await base_thread(appserver, workspace, tools=[lookup])
    _, request = await forked_turn(
        appserver, offline_model, base, convert(CONVERSATION[:1]), "P", workspace
    )
    assert "lookup_weather" in json.dumps(request.tools)


async def test_rejected_injection_and_unknown_base_are_typed_failures(
    appserver: AppServer, offline_model: OfflineModel, workspace: Path
) -> None:
    base = await base_thread(appserver, workspace)
    bad = [{"type": "message", "role": "user", "content": "plain string"}]
    failed = await prepare_fork(appserver, base, bad)
    assert isinstance(failed, ForkFailed)
    assert failed.step == "inject"
    assert failed.fork_thread_id is not None
    assert "not a valid response item" in failed.error
    appserver.forget_thread(failed.fork_thread_id)
    gone = await prepare_fork(appserver, "01a22b2a-0000-7000-8000-000000000000", [])
    assert isinstance(gone, ForkFailed)
    assert gone.step in {"fork", "anchor"}
    assert not offline_model.turn_requests()  # nothing reached the model
