"""The offline Responses-API model on its own (plain HTTP clients; no Codex binary)."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import time
from typing import Any

import pytest

from codex_turn.testing import OFFLINE_PNG, ImageReply, OfflineModel, Reply


def post(
    model: OfflineModel,
    body: dict[str, Any],
    *,
    kind: str = "turn",
    path: str = "/v1/responses",
) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", model.port, timeout=10)
    headers = {
        "Content-Type": "application/json",
        "x-codex-turn-metadata": json.dumps({"turn_id": "t1", "request_kind": kind}),
    }
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    return resp.status, data


def events(sse: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ")]


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


BODY = {
    "model": "mock-model",
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "BASE"}],
        },
        {
            "type": "message",
            "role": "developer",
            "content": [
                {"type": "input_text", "text": "DEV_A"},
                {"type": "input_text", "text": "DEV_B"},
            ],
        },
        user("first"),
        user("second"),
    ],
    "tools": [{"type": "function", "name": "lookup"}, {"type": "namespace", "name": "crm"}],
}


def test_echo_and_recording(offline_model: OfflineModel) -> None:
    status, sse = post(offline_model, BODY)
    assert status == 200
    evs = events(sse)
    assert next(e["type"] for e in evs) == "response.created"
    assert evs[-1]["type"] == "response.completed"
    assert evs[-1]["response"]["usage"]["input_tokens"] == 100
    done = [e for e in evs if e["type"] == "response.output_item.done"]
    assert done[-1]["item"]["content"][0]["text"] == "ECHO: second"
    (req,) = offline_model.requests
    assert req.developer_messages == ["BASE", "DEV_A\nDEV_B"]
    assert req.developer_parts == ["BASE", "DEV_A", "DEV_B"]
    assert req.user_messages == ["first", "second"]
    assert req.tool_names == ["lookup", "crm"]
    assert req.request_kind == "turn"
    assert not req.is_compaction


def test_scripts_match_in_order_and_by_marker(offline_model: OfflineModel) -> None:
    offline_model.script(Reply.fixed("for B"), user_contains="[B]")
    offline_model.script(Reply.fixed("one"), Reply.fixed("two"))
    body_a = dict(BODY, input=[user("[A] hi")])
    body_b = dict(BODY, input=[user("[B] hi")])

    def text(sse: str) -> str:
        done = [e for e in events(sse) if e["type"] == "response.output_item.done"]
        return str(done[-1]["item"]["content"][0]["text"])

    assert text(post(offline_model, body_a)[1]) == "one"
    assert text(post(offline_model, body_b)[1]) == "for B"
    assert text(post(offline_model, body_b)[1]) == "two"
    assert text(post(offline_model, body_b)[1]) == "ECHO: [B] hi"


def test_compaction_detected_by_header(offline_model: OfflineModel) -> None:
    status, sse = post(offline_model, BODY, kind="compaction")
    assert status == 200
    done = [e for e in events(sse) if e["type"] == "response.output_item.done"]
    assert done[-1]["item"]["content"][0]["text"] == "LOCAL_COMPACTED_SUMMARY_1"
    assert offline_model.compaction_requests()[0].is_compaction
    assert offline_model.turn_requests() == []


def test_function_call_reasoning_and_http_error(offline_model: OfflineModel) -> None:
    offline_model.script(
        Reply.function_call("lookup", {"q": "x"}, call_id="call_1"),
        Reply.with_reasoning("hmm", "done"),
        Reply.http_error(400, "bad request body"),
    )
    evs = events(post(offline_model, BODY)[1])
    item = next(e["item"] for e in evs if e["type"] == "response.output_item.done")
    assert item == {
        "type": "function_call",
        "id": "fc-1",
        "call_id": "call_1",
        "name": "lookup",
        "arguments": '{"q": "x"}',
    }
    evs = events(post(offline_model, BODY)[1])
    kinds = [e["type"] for e in evs]
    assert "response.reasoning_summary_text.delta" in kinds
    assert post(offline_model, BODY) == (400, "bad request body")
    # After a tool call, the echo answers with the tool output.
    body = dict(
        BODY, input=[user("q"), {"type": "function_call_output", "call_id": "c", "output": "42"}]
    )
    done = [
        e for e in events(post(offline_model, body)[1]) if e["type"] == "response.output_item.done"
    ]
    assert done[-1]["item"]["content"][0]["text"] == "TOOL RESULT: 42"


def test_connect_is_refused_and_recorded(offline_model: OfflineModel) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", offline_model.port, timeout=5)
    conn.request("CONNECT", "github.com:443")
    resp = conn.getresponse()
    assert resp.status == 403
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", offline_model.port, timeout=5)
    conn.request("GET", "http://example.com/telemetry")
    assert conn.getresponse().status == 403
    conn.close()
    assert offline_model.proxy_attempts == [
        "CONNECT github.com:443",
        "GET http://example.com/telemetry",
    ]


def test_delay_stalls_after_created_and_notices_disconnect(offline_model: OfflineModel) -> None:
    offline_model.script(Reply.fixed("late", delay=5.0, partial_text="PART "))
    body = json.dumps(dict(BODY, input=[user("slow")])).encode()
    sock = socket.create_connection(("127.0.0.1", offline_model.port), timeout=5)
    sock.sendall(
        b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    deadline = time.monotonic() + 3
    while b"PART" not in received and time.monotonic() < deadline:
        received += sock.recv(65536)
    assert b"response.created" in received
    assert b"PART " in received
    assert b"response.completed" not in received
    started = time.monotonic()
    sock.close()
    # The handler notices the disconnect during its stall (not after the 5 s delay).
    while offline_model.disconnects == 0 and time.monotonic() - started < 2.0:
        time.sleep(0.01)
    assert offline_model.disconnects == 1
    assert time.monotonic() - started < 1.0
    status, sse = post(offline_model, dict(BODY, input=[user("after")]))
    assert status == 200
    assert "ECHO: after" in sse


def test_first_byte_delay_holds_back_every_answer_until_its_first_byte() -> None:
    """``first_byte_delay``: nothing (not even the status line) before it; settable while the
    server runs; the Images API is not the model and answers at once."""
    with OfflineModel(first_byte_delay=0.3) as model:
        body = json.dumps(dict(BODY, input=[user("slow start")])).encode()
        sock = socket.create_connection(("127.0.0.1", model.port), timeout=5)
        sock.sendall(
            b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        started = time.monotonic()
        first = sock.recv(1)
        waited = time.monotonic() - started
        sock.close()
        assert first == b"H"  # the status line, only after the delay
        assert 0.25 <= waited < 2.0
        started = time.monotonic()
        status, sse = post(model, dict(BODY, input=[user("again")]))
        assert status == 200
        assert "ECHO: again" in sse
        assert time.monotonic() - started >= 0.25
        started = time.monotonic()
        assert post(model, {"prompt": "x"}, path="/v1/images/generations")[0] == 200
        assert time.monotonic() - started < 0.25
        model.first_byte_delay = 0.0
        started = time.monotonic()
        assert post(model, BODY)[0] == 200
        assert time.monotonic() - started < 0.25
    with pytest.raises(ValueError, match="first_byte_delay"):
        OfflineModel(first_byte_delay=-1)


@pytest.mark.parametrize("count", [3])
def test_wait_for_requests(offline_model: OfflineModel, count: int) -> None:
    for _ in range(count):
        post(offline_model, BODY)
    assert len(offline_model.wait_for_requests(count, timeout=1)) == count
    with pytest.raises(TimeoutError):
        offline_model.wait_for_requests(count + 1, timeout=0.1)


def test_an_empty_reply_has_no_output_item(offline_model: OfflineModel) -> None:
    """``Reply.empty()``: created, then completed; no message, so no assistant text."""
    offline_model.script(Reply.empty(usage={"input": 7, "output": 0}))
    evs = events(post(offline_model, BODY)[1])
    assert [e["type"] for e in evs] == ["response.created", "response.completed"]
    assert evs[-1]["response"]["usage"]["input_tokens"] == 7
    # The script is used up: the next request is echoed again.
    assert "ECHO: second" in post(offline_model, BODY)[1]


def test_a_failed_stream_and_usage_overrides(offline_model: OfflineModel) -> None:
    """``Reply.context_length_exceeded()``: created, then ``response.failed`` with the
    Responses API's code (HTTP 200, no output item); ``usage`` can set ``total_tokens`` or
    report no usage at all."""
    offline_model.script(
        Reply.context_length_exceeded(),
        Reply.echo(usage={"input": 50, "cached": 20, "output": 5, "total": 7}),
        Reply.echo(usage={}),
    )
    status, sse = post(offline_model, BODY)
    evs = events(sse)
    assert status == 200
    assert [e["type"] for e in evs] == ["response.created", "response.failed"]
    error = evs[-1]["response"]["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("Your input exceeds the context window of this model.")
    usage = events(post(offline_model, BODY)[1])[-1]["response"]["usage"]
    assert usage["input_tokens"] == 50
    assert usage["input_tokens_details"] == {"cached_tokens": 20}
    assert usage["total_tokens"] == 7
    completed = events(post(offline_model, BODY)[1])[-1]
    assert completed["type"] == "response.completed"
    assert "usage" not in completed["response"]


def test_the_images_api_is_served_scripted_then_by_default(offline_model: OfflineModel) -> None:
    """What Codex's ``image_gen.imagegen`` tool calls: ``/images/generations`` and
    ``/images/edits``, answered in order from ``script_images``, then with OFFLINE_PNG."""
    picture = b"\x89PNG\r\n\x1a\nnot-really-a-png"
    offline_model.script_images(ImageReply.png(picture), ImageReply.http_error(403, "no images"))
    prompt = {"prompt": "a red dot", "model": "gpt-image-2"}
    status, body = post(offline_model, prompt, path="/v1/images/generations")
    assert status == 200
    (data,) = json.loads(body)["data"]
    assert base64.b64decode(data["b64_json"]) == picture
    status, body = post(offline_model, prompt, path="/v1/images/edits")
    assert status == 403
    assert json.loads(body)["error"]["message"] == "no images"
    status, body = post(offline_model, prompt, path="/v1/images/generations")
    assert status == 200
    assert base64.b64decode(json.loads(body)["data"][0]["b64_json"]) == OFFLINE_PNG
    assert OFFLINE_PNG.startswith(b"\x89PNG\r\n\x1a\n")
    # Recorded as image requests, never as turns; the responses script is untouched.
    images = offline_model.image_requests()
    assert [(r.path, r.body["prompt"]) for r in images] == [
        ("/v1/images/generations", "a red dot"),
        ("/v1/images/edits", "a red dot"),
        ("/v1/images/generations", "a red dot"),
    ]
    assert all(r.is_image_request for r in images)
    assert offline_model.turn_requests() == []
    assert "ECHO: second" in post(offline_model, BODY)[1]
    assert not offline_model.turn_requests()[0].is_image_request


def test_clear_script_drops_queued_images_and_other_paths_stay_404(
    offline_model: OfflineModel,
) -> None:
    offline_model.script_images(ImageReply.http_error(500, "queued"))
    offline_model.clear_script()
    status, body = post(offline_model, {"prompt": "p"}, path="/v1/images/generations")
    assert status == 200
    assert base64.b64decode(json.loads(body)["data"][0]["b64_json"]) == OFFLINE_PNG
    assert post(offline_model, BODY, path="/v1/embeddings")[0] == 404


def test_a_burst_of_connections_is_accepted_at_once(offline_model: OfflineModel) -> None:
    """128 concurrent turns open their streams at once: none may wait for a SYN retransmit
    (1 s), which a listen backlog of 5 (the standard library's) imposes on all beyond it."""
    sockets = []
    try:
        # Opened faster than the server's one accepting thread takes them: with a backlog of
        # 5, a connect beyond it waits 1 s for its SYN's retransmission (past this timeout).
        for _ in range(256):
            sockets.append(socket.create_connection(("127.0.0.1", offline_model.port), timeout=0.5))
        for sock in sockets:
            sock.sendall(b"GET /nothing HTTP/1.1\r\nHost: model\r\nConnection: close\r\n\r\n")
        for sock in sockets:
            sock.settimeout(10)
            head = b""
            while len(head) < 7 and (chunk := sock.recv(64)):
                head += chunk
            assert head.startswith(b"HTTP/1.")
    finally:
        for sock in sockets:
            sock.close()
