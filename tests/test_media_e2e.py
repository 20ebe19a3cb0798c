"""Media, end to end: files Codex saved reach ``TurnResult.files``.

The real ``codex app-server`` 0.163 runs against the offline model. How Codex produces a
generated image offline (found by probing the binary):

* Codex's built-in image tool is the namespaced function ``image_gen.imagegen``. Codex runs it
  itself: it POSTs ``{base_url}/images/generations`` through the *model provider* (the offline
  model serves that Images API: :class:`~codex_turn.testing.ImageReply`), writes the PNG to
  ``$CODEX_HOME/generated_images/<thread id>/<call id>.png`` and reports an
  ``imageGeneration`` item (``item/started`` in progress, ``item/completed`` with
  ``savedPath``), then hands the image and the saved path back to the model.
* Codex offers that tool to a custom provider only when the provider is "actor authorised":
  ``requires_openai_auth = false`` (the default) and a non-empty
  ``x-openai-actor-authorization`` in its ``http_headers``. ``features.image_generation`` is on
  by default. Without the header the tool is not offered (also not with
  ``features.image_generation = true``, the model slug ``gpt-5.2`` or an
  ``experimental_bearer_token``), and an ``image_generation_call`` output item streamed by the
  model is only recorded in the rollout: no item, no file. The header only ever goes to the
  offline model on ``127.0.0.1``.
* ``view_image`` (offered by default) reports an ``imageView`` item with the ``path`` it read;
  that is a tool call (an event), not a file Codex saved, so it is not in ``files``.

Every test asserts that nothing tried to reach the internet (the proxy trap stayed empty).
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn import AppServer, TurnParams, TurnResult, run_codex_turn
from codex_turn.harness.appserver import AppServerConfig
from codex_turn.harness.appserver.config import OFFLINE_PROVIDER_ID
from codex_turn.harness.turn.streaming import (
    FileSaved,
    ToolCall,
    TurnEvent,
    TurnEventStream,
    TurnFile,
)
from codex_turn.testing import ImageReply, OfflineModel, RecordingEngine, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]

ACTOR_HEADER = {"x-openai-actor-authorization": "codex-turn-offline-tests"}
IMAGE_PROMPT = "A red dot on a white background"


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A valid PNG of one colour (distinct from the offline model's default image)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


@pytest.fixture
def params(tmp_path: Path, workspace: Path, private_texts: set[str]) -> Callable[..., TurnParams]:
    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "s-media",
            "session_key": "agent:main:s-media",
            "session_file": tmp_path / "s-media.jsonl",
            "workspace_dir": workspace,
            "prompt": "Draw me a red dot please",
        }
        values.update(overrides)
        private_texts.add(values["prompt"])
        return TurnParams(**values)

    return make


@pytest.fixture
def image_config(make_appserver_config: Callable[..., AppServerConfig]) -> AppServerConfig:
    """The offline config, with the provider header that makes Codex offer ``image_gen``."""
    return make_appserver_config(
        extra_config={"model_providers": {OFFLINE_PROVIDER_ID: {"http_headers": ACTOR_HEADER}}}
    )


@pytest.fixture
async def image_appserver(image_config: AppServerConfig) -> AsyncIterator[AppServer]:
    async with AppServer.start(image_config) as server:
        yield server


async def run_turn(
    server: AppServer, turn_params: TurnParams
) -> tuple[TurnResult, list[TurnEvent], RecordingEngine]:
    engine = RecordingEngine()
    events = TurnEventStream(max_buffered=math.inf)
    seen: list[TurnEvent] = []

    async def collect() -> None:
        async for event in events:
            seen.append(event)

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect)
        result = await run_codex_turn(turn_params, app_server=server, engine=engine, events=events)
    return result, seen, engine


def image_tools(offline_model: OfflineModel) -> list[list[str]]:
    """The ``image_gen`` namespace's function names, per request the model received."""
    return [
        [str(t.get("name")) for t in tool.get("tools", [])]
        for request in offline_model.turn_requests()
        for tool in request.tools
        if tool.get("type") == "namespace" and tool.get("name") == "image_gen"
    ]


@pytest.mark.parametrize(
    ("final", "text"),
    [(Reply.empty(), None), (Reply.fixed("Here is your red dot."), "Here is your red dot.")],
    ids=["no-assistant-text", "with-assistant-text"],
)
async def test_a_generated_image_is_returned_as_a_file(
    image_appserver: AppServer,
    image_config: AppServerConfig,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    final: Reply,
    text: str | None,
) -> None:
    picture = png(3, 2, (200, 10, 10))
    offline_model.script(
        Reply.function_call(
            "imagegen", {"prompt": IMAGE_PROMPT}, namespace="image_gen", call_id="call_img_1"
        ),
        final,
    )
    offline_model.script_images(ImageReply.png(picture))

    result, seen, engine = await run_turn(image_appserver, params())

    assert result.outcome.value == "completed"
    assert result.assistant_text == text
    assert result.thread_id is not None
    # Codex offered its image tool, called the Images API once with the model's prompt ...
    assert image_tools(offline_model) == [["imagegen"], ["imagegen"]]
    (image_request,) = offline_model.image_requests()
    assert image_request.path == "/v1/images/generations"
    assert image_request.body["prompt"] == IMAGE_PROMPT
    assert (
        image_request.headers["x-openai-actor-authorization"]
        == ACTOR_HEADER["x-openai-actor-authorization"]
    )
    # ... saved the bytes it got under $CODEX_HOME/generated_images/<thread>/<call>.png ...
    expected = image_config.codex_home / "generated_images" / result.thread_id / "call_img_1.png"
    assert result.files == (
        TurnFile(
            path=str(expected),
            kind="generated_image",
            item_id="call_img_1",
            mime_type="image/png",
            revised_prompt=IMAGE_PROMPT,
        ),
    )
    assert await anyio.Path(result.files[0].path).read_bytes() == picture
    # ... and told the model where (the tool output carries the image and the saved path).
    follow_up = offline_model.turn_requests()[-1]
    (output,) = follow_up.function_call_outputs
    assert output["call_id"] == "call_img_1"
    parts = output["output"]
    assert parts[0]["type"] == "input_image"
    assert str(expected) in parts[1]["text"]
    # The event stream delivered the item: the tool call (started, completed), then the file.
    calls = [(e.phase, e.kind, e.item_id, e.status) for e in seen if isinstance(e, ToolCall)]
    assert calls == [
        ("started", "imageGeneration", "call_img_1", "in_progress"),
        ("completed", "imageGeneration", "call_img_1", "completed"),
    ]
    (saved,) = [e for e in seen if isinstance(e, FileSaved)]
    assert saved.file == result.files[0]
    completed = next(
        i for i, e in enumerate(seen) if isinstance(e, ToolCall) and e.phase == "completed"
    )
    assert seen.index(saved) > completed
    # The engine finalized the turn as usual, and nothing left the machine.
    assert engine.calls_to("after_turn")
    assert offline_model.proxy_attempts == []


async def test_without_the_actor_header_codex_offers_no_image_tool_and_saves_nothing(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    """The gate, pinned: a plain custom provider gets no ``image_gen`` tool; a model that calls
    it anyway gets an error back, the Images API is never called and no file is reported."""
    offline_model.script(
        Reply.function_call(
            "imagegen", {"prompt": IMAGE_PROMPT}, namespace="image_gen", call_id="call_img_2"
        ),
        Reply.fixed("I could not draw it."),
    )

    result, seen, _ = await run_turn(appserver, params())

    assert result.outcome.value == "completed"
    assert result.assistant_text == "I could not draw it."
    assert image_tools(offline_model) == []
    assert offline_model.image_requests() == []
    assert result.files == ()
    assert not [e for e in seen if isinstance(e, FileSaved)]
    assert offline_model.proxy_attempts == []


async def test_view_image_is_an_image_view_tool_call_not_a_saved_file(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    """``view_image`` reports an ``imageView`` item (the path it read) in 0.163 offline; it
    reaches the stream as a tool call and stays out of ``files`` (Codex saved nothing)."""
    picture = workspace / "dot.png"
    await anyio.Path(picture).write_bytes(png(1, 1, (0, 0, 255)))
    offline_model.script(
        Reply.function_call("view_image", {"path": str(picture)}, call_id="call_view_1"),
        Reply.fixed("It is a blue dot."),
    )

    result, seen, _ = await run_turn(appserver, params(prompt="What is in dot.png?"))

    assert result.outcome.value == "completed"
    assert result.assistant_text == "It is a blue dot."
    calls = [(e.phase, e.kind, e.item_id, e.name) for e in seen if isinstance(e, ToolCall)]
    assert calls == [
        ("started", "imageView", "call_view_1", str(picture)),
        ("completed", "imageView", "call_view_1", str(picture)),
    ]
    assert result.files == ()
    # The model got the image itself back as the tool output.
    (output,) = offline_model.turn_requests()[-1].function_call_outputs
    assert output["output"][0]["type"] == "input_image"
    assert offline_model.proxy_attempts == []


async def test_a_failed_image_generation_reports_the_tool_call_but_no_file(
    image_appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    """The Images API refuses: Codex completes the item as ``failed`` without a ``savedPath``,
    the model is told why, and the turn reports no file."""
    offline_model.script(
        Reply.function_call(
            "imagegen", {"prompt": IMAGE_PROMPT}, namespace="image_gen", call_id="call_img_3"
        ),
        Reply.empty(),
    )
    offline_model.script_images(ImageReply.http_error(403, "image generation is unavailable"))

    result, seen, _ = await run_turn(image_appserver, params())

    assert result.outcome.value == "completed"
    assert result.assistant_text is None
    assert len(offline_model.image_requests()) == 1
    calls = [(e.phase, e.kind, e.status) for e in seen if isinstance(e, ToolCall)]
    assert calls == [
        ("started", "imageGeneration", "in_progress"),
        ("completed", "imageGeneration", "failed"),
    ]
    assert result.files == ()
    assert not [e for e in seen if isinstance(e, FileSaved)]
    (output,) = offline_model.turn_requests()[-1].function_call_outputs
    assert output["output"].startswith("image generation failed: http 403")
    assert "image generation is unavailable" in output["output"]
    assert offline_model.proxy_attempts == []
