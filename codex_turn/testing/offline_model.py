"""An offline, scriptable Responses-API model server for the real ``codex app-server``.

Codex talks to its model over HTTP: it POSTs ``{base_url}/responses`` and reads a
Server-Sent-Events stream back. This module is the only stand-in in the whole system: the
app-server binary is real, and it talks to :class:`OfflineModel` on ``127.0.0.1`` with an
ephemeral port, with no internet involved. The demo and every end-to-end test use it.

Layering (h11 style: one job per layer)

* **HTTP** is the standard library's ``ThreadingHTTPServer`` speaking HTTP/1.1 with chunked
  transfer encoding, so a reply can be streamed event by event and can stall half-way (the
  interrupt and timeout tests need that). Its listen backlog is the system's largest
  (``socket.SOMAXCONN``), not the standard library's 5: with a backlog of 5, a burst of
  connections (128 concurrent turns) overflows it and each connection beyond it waits for a
  SYN retransmission (1 s, then 3 s, ...), which Codex reports as a dropped stream.
* **Recording**: every request is parsed once, on arrival, into a :class:`RecordedRequest`
  (developer messages, user messages, tools, function-call outputs, request kind), so a test
  asserts on *what the real binary actually sent*, not on what the client meant to send.
* **Scripting**: each request is answered by the first matching entry of a FIFO script
  (:meth:`OfflineModel.script`), else by a default: an echo of the last user text (or of the
  last tool output) for turns, a ``LOCAL_COMPACTED_SUMMARY_<n>`` for compactions. Codex marks a
  compaction request with ``request_kind: "compaction"`` in the ``x-codex-turn-metadata``
  header; that is the only detection used.
* **Images**: ``POST {base_url}/images/generations`` (and ``/images/edits``) is the Images API
  Codex's built-in ``image_gen.imagegen`` tool calls through the model provider. Each is
  recorded (:meth:`OfflineModel.image_requests`) and answered from its own FIFO
  (:meth:`OfflineModel.script_images`), else with :data:`OFFLINE_PNG` as ``b64_json``. Codex
  0.163 offers that tool to a custom provider only when the provider sends a non-empty
  ``x-openai-actor-authorization`` header (``http_headers``); it then saves the image under
  ``$CODEX_HOME/generated_images`` and reports an ``imageGeneration`` item with ``savedPath``.
* **Latency**: ``first_byte_delay`` (seconds, settable while the server runs) holds every
  ``/responses`` answer back that long before its first byte, the status line: a real
  model's time to first token, for benchmarks that must not flatter a client by answering
  instantly. A scripted :attr:`Reply.delay` stalls *after* ``response.created`` on top of it.
* **Proxy trap**: the tests point ``HTTPS_PROXY``/``HTTP_PROXY``/``ALL_PROXY`` at this server.
  Any internet attempt then arrives as ``CONNECT host:443`` (or an absolute-URI request), is
  answered 403 and recorded in :attr:`OfflineModel.proxy_attempts`: zero entries proves that
  nothing tried to leave the machine.

Nothing here logs request content; the recorded requests live in memory only.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal, Self

import attrs

__all__ = [
    "OFFLINE_PNG",
    "ImageReply",
    "OfflineModel",
    "RecordedRequest",
    "Reply",
    "ReplyKind",
    "running_model",
]

ReplyKind = Literal[
    "echo", "text", "computed", "reasoning", "function_call", "http_error", "failed", "empty"
]
RequestKind = Literal["turn", "compaction"]

#: A valid 1x1 PNG (one red pixel): what the Images endpoint answers when nothing is scripted.
OFFLINE_PNG: bytes = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
_IMAGE_PATHS = ("/images/generations", "/images/edits")

DEFAULT_USAGE: Mapping[str, int] = {"input": 100, "cached": 0, "output": 10}
#: The Responses API's error code and message for a prompt longer than the model's window.
_CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_CONTEXT_LENGTH_MESSAGE = (
    "Your input exceeds the context window of this model. Please adjust your input and try again."
)
_POLL_S = 0.02  # granularity of stalls: how fast a client disconnect is noticed


@attrs.frozen
class Reply:
    """One scripted answer. Build it with the class methods, not the constructor.

    ``delay`` stalls the stream *after* ``response.created`` (headers and the first event are
    already sent, like a slow model); the stall ends early when Codex closes the connection.
    ``usage`` overrides the token counts reported in ``response.completed``: ``input`` (the
    whole prompt, cached part included), ``cached``, ``output``, ``reasoning`` and ``total``
    (``input + output`` when absent); an empty mapping reports no ``usage`` at all. Codex 0.163
    needs ``input_tokens``, ``output_tokens`` and ``total_tokens`` in a ``usage`` it gets (it
    fails the stream without one of them) and sends no ``thread/tokenUsage/updated`` for a
    response without ``usage``.
    """

    kind: ReplyKind
    text: str = ""
    reasoning: str = ""
    name: str = ""
    arguments: str = "{}"
    call_id: str = ""
    namespace: str | None = None
    status: int = 200
    error_code: str = ""
    delay: float = 0.0
    usage: Mapping[str, int] | None = None
    partial_text: str = ""
    compute: Callable[[RecordedRequest], str] | None = None

    @classmethod
    def echo(cls, *, delay: float = 0.0, usage: Mapping[str, int] | None = None) -> Reply:
        """``ECHO: <last user text>``, or ``TOOL RESULT: <output>`` right after a tool call."""
        return cls("echo", delay=delay, usage=usage)

    @classmethod
    def fixed(
        cls,
        text: str,
        *,
        delay: float = 0.0,
        usage: Mapping[str, int] | None = None,
        partial_text: str = "",
    ) -> Reply:
        """A fixed assistant message. ``partial_text`` is streamed as a delta *before* the
        delay, so an interrupt during the delay leaves a dangling, partial agent message."""
        return cls("text", text=text, delay=delay, usage=usage, partial_text=partial_text)

    @classmethod
    def computed(
        cls,
        answer: Callable[[RecordedRequest], str],
        *,
        delay: float = 0.0,
        usage: Mapping[str, int] | None = None,
    ) -> Reply:
        """An assistant message computed from the request Codex sent (``answer(request)``,
        called on the server's thread), so a reply can show what the model received."""
        return cls("computed", compute=answer, delay=delay, usage=usage)

    @classmethod
    def with_reasoning(
        cls, reasoning: str, text: str, *, usage: Mapping[str, int] | None = None
    ) -> Reply:
        """A reasoning item (streamed as summary deltas), then an assistant message."""
        return cls("reasoning", text=text, reasoning=reasoning, usage=usage)

    @classmethod
    def function_call(
        cls,
        name: str,
        arguments: Mapping[str, Any] | str,
        *,
        call_id: str | None = None,
        namespace: str | None = None,
        delay: float = 0.0,
    ) -> Reply:
        """A ``function_call`` output item; Codex runs the tool and POSTs again."""
        args = arguments if isinstance(arguments, str) else json.dumps(dict(arguments))
        return cls(
            "function_call",
            name=name,
            arguments=args,
            call_id=call_id or "",
            namespace=namespace,
            delay=delay,
        )

    @classmethod
    def http_error(cls, status: int, body: str, *, delay: float = 0.0) -> Reply:
        """A plain HTTP error. Codex passes a 400 body through as the turn's error message."""
        return cls("http_error", text=body, status=status, delay=delay)

    @classmethod
    def failed(cls, code: str, message: str, *, delay: float = 0.0) -> Reply:
        """A stream that fails mid-way, as the Responses API reports a refused request:
        ``response.created``, then ``response.failed`` whose ``response.error`` is
        ``{"code": code, "message": message}`` (HTTP 200; no output item)."""
        return cls("failed", text=message, error_code=code, delay=delay)

    @classmethod
    def context_length_exceeded(cls, *, delay: float = 0.0) -> Reply:
        """The Responses API's answer to a prompt longer than the model's context window:
        ``response.failed`` with code ``context_length_exceeded``."""
        return cls.failed(_CONTEXT_LENGTH_EXCEEDED, _CONTEXT_LENGTH_MESSAGE, delay=delay)

    @classmethod
    def empty(cls, *, delay: float = 0.0, usage: Mapping[str, int] | None = None) -> Reply:
        """A response with no output item at all: after a tool call, the turn ends with no
        assistant text (a turn whose only result is, say, a generated image)."""
        return cls("empty", delay=delay, usage=usage)


@attrs.frozen
class ImageReply:
    """One scripted answer of the Images API (``/images/generations`` or ``/images/edits``).

    ``png`` answers ``{"created": ..., "data": [{"b64_json": <data>}]}``; ``http_error``
    answers ``status`` with an OpenAI-style ``{"error": {"message": ...}}`` body (Codex 0.163
    then completes its ``imageGeneration`` item as ``failed``, saves nothing, and tells the
    model ``image generation failed: http <status> ...`` with that body)."""

    data: bytes = OFFLINE_PNG
    status: int = 200
    message: str = ""

    @classmethod
    def png(cls, data: bytes = OFFLINE_PNG) -> ImageReply:
        return cls(data=data)

    @classmethod
    def http_error(cls, status: int, message: str) -> ImageReply:
        return cls(data=b"", status=status, message=message)

    def body(self) -> dict[str, Any]:
        if self.status != 200:
            return {"error": {"message": self.message, "type": "invalid_request_error"}}
        return {
            "created": 1_700_000_000,
            "data": [{"b64_json": base64.b64encode(self.data).decode("ascii")}],
        }


@attrs.frozen
class RecordedRequest:
    """One request as Codex sent it, parsed once."""

    index: int
    method: str
    path: str
    headers: Mapping[str, str]
    body: Mapping[str, Any]
    received_at: float

    @property
    def turn_metadata(self) -> dict[str, Any]:
        raw = self.headers.get("x-codex-turn-metadata")
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    @property
    def request_kind(self) -> str:
        kind = self.turn_metadata.get("request_kind")
        return kind if isinstance(kind, str) else "turn"

    @property
    def is_compaction(self) -> bool:
        return self.request_kind == "compaction"

    @property
    def is_image_request(self) -> bool:
        """A call of the Images API (``/images/generations``, ``/images/edits``)."""
        return self.path.split("?", 1)[0].rstrip("/").endswith(_IMAGE_PATHS)

    @property
    def input_items(self) -> list[dict[str, Any]]:
        items = self.body.get("input")
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    def messages(self, role: str) -> list[str]:
        """Each message of ``role`` as one string (its text parts joined by newlines)."""
        return ["\n".join(parts) for parts in self.message_parts(role)]

    def message_parts(self, role: str) -> list[list[str]]:
        """Each message of ``role`` as its list of text parts, in request order."""
        out: list[list[str]] = []
        for item in self.input_items:
            if item.get("type", "message") != "message" or item.get("role") != role:
                continue
            content = item.get("content")
            if isinstance(content, str):
                out.append([content])
            elif isinstance(content, list):
                out.append(
                    [str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p]
                )
        return out

    @property
    def developer_messages(self) -> list[str]:
        return self.messages("developer")

    @property
    def developer_parts(self) -> list[str]:
        """Every developer text part, flattened (developer instructions are one of them)."""
        return [p for parts in self.message_parts("developer") for p in parts]

    @property
    def user_messages(self) -> list[str]:
        return self.messages("user")

    @property
    def assistant_messages(self) -> list[str]:
        return self.messages("assistant")

    @property
    def last_user_text(self) -> str:
        users = self.user_messages
        return users[-1] if users else ""

    @property
    def tools(self) -> list[dict[str, Any]]:
        tools = self.body.get("tools")
        return [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []

    @property
    def tool_names(self) -> list[str]:
        return [str(t.get("name", t.get("type", ""))) for t in self.tools]

    @property
    def function_calls(self) -> list[dict[str, Any]]:
        return [i for i in self.input_items if i.get("type") == "function_call"]

    @property
    def function_call_outputs(self) -> list[dict[str, Any]]:
        return [i for i in self.input_items if i.get("type") == "function_call_output"]

    @property
    def last_item_is_tool_output(self) -> bool:
        items = self.input_items
        return bool(items) and items[-1].get("type") == "function_call_output"


@attrs.define
class _ScriptEntry:
    reply: Reply
    kind: RequestKind
    remaining: int
    match: Callable[[RecordedRequest], bool] | None


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "\n".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
    return json.dumps(output)


class _ClientGone(Exception):
    """Codex closed the connection while we were streaming (it does on turn/interrupt)."""


class _Server(ThreadingHTTPServer):
    request_queue_size = socket.SOMAXCONN  # the module header says why not the default 5


class OfflineModel:
    """A local Responses-API server. Use as a context manager (or :meth:`start`/:meth:`close`).

    ``base_url`` (``http://127.0.0.1:<port>/v1``) goes into the Codex provider config, and
    ``proxy_url`` into the proxy environment variables.
    """

    def __init__(
        self, *, default_usage: Mapping[str, int] | None = None, first_byte_delay: float = 0.0
    ) -> None:
        if first_byte_delay < 0:
            raise ValueError("first_byte_delay must be >= 0")
        self.requests: list[RecordedRequest] = []
        #: Seconds before the first byte of every ``/responses`` answer (module header).
        self.first_byte_delay = first_byte_delay
        self.proxy_attempts: list[str] = []
        self.disconnects = 0  # streams the client closed mid-reply (e.g. on turn/interrupt)
        self.default_usage: Mapping[str, int] = dict(default_usage or DEFAULT_USAGE)
        self._script: list[_ScriptEntry] = []
        self._images: list[ImageReply] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._ids = itertools.count(1)
        self._compactions = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> Self:
        handler = _make_handler(self)
        server = _Server(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("OfflineModel is not started")
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def proxy_env(self) -> dict[str, str]:
        """Proxy variables that route every non-local connection into the 403 trap."""
        env = {}
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
            env[name] = self.proxy_url
            env[name.lower()] = self.proxy_url
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        return env

    # -- scripting -----------------------------------------------------------------------

    def script(
        self,
        *replies: Reply,
        kind: RequestKind = "turn",
        user_contains: str | None = None,
        match: Callable[[RecordedRequest], bool] | None = None,
        times: int = 1,
    ) -> None:
        """Queue replies for the next matching requests, in order.

        ``user_contains`` matches on the last user message, which makes concurrent scripts
        deterministic (each thread's prompt carries its own marker). ``match`` is a free
        predicate; both must hold when given.
        """
        predicate = _combine(user_contains, match)
        with self._lock:
            for reply in replies:
                self._script.append(_ScriptEntry(reply, kind, times, predicate))

    def clear_script(self) -> None:
        """Drop every queued reply (responses and images)."""
        with self._lock:
            self._script.clear()
            self._images.clear()

    def script_images(self, *replies: ImageReply) -> None:
        """Queue answers for the next Images API calls, in order (then :data:`OFFLINE_PNG`)."""
        with self._lock:
            self._images.extend(replies)

    def _pick_image(self) -> ImageReply:
        with self._lock:
            return self._images.pop(0) if self._images else ImageReply.png()

    def _pick(self, request: RecordedRequest) -> Reply:
        with self._lock:
            for entry in self._script:
                if entry.kind != request.request_kind:
                    continue
                if entry.match is not None and not entry.match(request):
                    continue
                entry.remaining -= 1
                if entry.remaining <= 0:
                    self._script.remove(entry)
                return entry.reply
        if request.is_compaction:
            return Reply.fixed(f"LOCAL_COMPACTED_SUMMARY_{next(self._compactions)}")
        return Reply.echo()

    # -- recording -----------------------------------------------------------------------

    def _record(self, request: RecordedRequest) -> None:
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()

    def _record_proxy(self, target: str) -> None:
        with self._changed:
            self.proxy_attempts.append(target)
            self._changed.notify_all()

    def turn_requests(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if not r.is_compaction and not r.is_image_request]

    def image_requests(self) -> list[RecordedRequest]:
        """The Images API calls (Codex's ``image_gen.imagegen`` tool), in arrival order."""
        with self._lock:
            return [r for r in self.requests if r.is_image_request]

    def compaction_requests(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.is_compaction]

    def last_request(self) -> RecordedRequest:
        with self._lock:
            if not self.requests:
                raise LookupError("the offline model has received no request")
            return self.requests[-1]

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> list[RecordedRequest]:
        """Block (in a thread, not in the event loop) until ``count`` requests arrived."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"only {len(self.requests)} of {count} requests arrived")
                self._changed.wait(left)
            return list(self.requests)

    # -- streaming -----------------------------------------------------------------------

    def _stall(self, conn: socket.socket, seconds: float) -> None:
        """Sleep, but notice a client disconnect (Codex closes the stream on interrupt)."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._closing.is_set():
                return
            readable, _, _ = select.select([conn], [], [], min(_POLL_S, left))
            if readable:
                try:
                    data = conn.recv(1, socket.MSG_PEEK)
                except OSError as exc:
                    raise _ClientGone from exc
                if not data:
                    raise _ClientGone


def _combine(
    user_contains: str | None, match: Callable[[RecordedRequest], bool] | None
) -> Callable[[RecordedRequest], bool] | None:
    if user_contains is None:
        return match
    marker = user_contains

    def predicate(request: RecordedRequest) -> bool:
        users = request.user_messages
        ok = any(marker in u for u in users[-1:])
        return ok and (match is None or match(request))

    return predicate


def _sse(event: Mapping[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _usage(values: Mapping[str, int]) -> dict[str, Any] | None:
    if not values:
        return None  # Reply's docstring: an empty mapping reports no usage
    inp = int(values.get("input", 100))
    out = int(values.get("output", 10))
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": int(values.get("cached", 0))},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": int(values.get("reasoning", 0))},
        "total_tokens": int(values.get("total", inp + out)),
    }


def _reply_events(
    model: OfflineModel, request: RecordedRequest, reply: Reply, n: int
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The SSE events for one reply; ``("stall", {})`` marks where the delay goes."""
    yield "event", {"type": "response.created", "response": {"id": f"resp-{n}"}}
    msg_id = f"msg-{n}"
    if reply.partial_text:
        yield (
            "event",
            {
                "type": "response.output_item.added",
                "item": {"type": "message", "role": "assistant", "id": msg_id, "content": []},
            },
        )
        yield (
            "event",
            {
                "type": "response.output_text.delta",
                "item_id": msg_id,
                "output_index": 0,
                "content_index": 0,
                "delta": reply.partial_text,
            },
        )
    if reply.delay > 0:
        yield "stall", {}
    if reply.kind == "failed":
        error = {"code": reply.error_code, "message": reply.text, "type": "invalid_request_error"}
        failed = {"id": f"resp-{n}", "status": "failed", "error": error}
        yield "event", {"type": "response.failed", "response": failed}
        return
    index = 0
    if reply.kind == "reasoning":
        rs_id = f"rs-{n}"
        yield (
            "event",
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": {"type": "reasoning", "id": rs_id, "summary": []},
            },
        )
        yield (
            "event",
            {
                "type": "response.reasoning_summary_part.added",
                "item_id": rs_id,
                "output_index": index,
                "summary_index": 0,
                "part": {"type": "summary_text", "text": ""},
            },
        )
        yield (
            "event",
            {
                "type": "response.reasoning_summary_text.delta",
                "item_id": rs_id,
                "output_index": index,
                "summary_index": 0,
                "delta": reply.reasoning,
            },
        )
        yield (
            "event",
            {
                "type": "response.output_item.done",
                "output_index": index,
                "item": {
                    "type": "reasoning",
                    "id": rs_id,
                    "summary": [{"type": "summary_text", "text": reply.reasoning}],
                },
            },
        )
        index += 1
    if reply.kind == "function_call":
        call_id = reply.call_id or f"call_{n}"
        item: dict[str, Any] = {
            "type": "function_call",
            "id": f"fc-{n}",
            "call_id": call_id,
            "name": reply.name,
            "arguments": reply.arguments,
        }
        if reply.namespace is not None:
            item["namespace"] = reply.namespace
        yield (
            "event",
            {"type": "response.output_item.added", "output_index": index, "item": item},
        )
        yield "event", {"type": "response.output_item.done", "output_index": index, "item": item}
    elif reply.kind != "empty":
        if reply.kind == "echo":
            if request.last_item_is_tool_output:
                text = "TOOL RESULT: " + _output_text(request.function_call_outputs[-1]["output"])
            else:
                text = "ECHO: " + request.last_user_text
        elif reply.kind == "computed" and reply.compute is not None:
            text = reply.compute(request)
        else:
            text = reply.text
        if not reply.partial_text:
            yield (
                "event",
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": {"type": "message", "role": "assistant", "id": msg_id, "content": []},
                },
            )
        rest = text[len(reply.partial_text) :] if text.startswith(reply.partial_text) else text
        yield (
            "event",
            {
                "type": "response.output_text.delta",
                "item_id": msg_id,
                "output_index": index,
                "content_index": 0,
                "delta": rest,
            },
        )
        yield (
            "event",
            {
                "type": "response.output_item.done",
                "output_index": index,
                "item": {
                    "type": "message",
                    "role": "assistant",
                    "id": msg_id,
                    "content": [{"type": "output_text", "text": text}],
                },
            },
        )
    response: dict[str, Any] = {"id": f"resp-{n}"}
    usage = _usage(reply.usage if reply.usage is not None else model.default_usage)
    if usage is not None:
        response["usage"] = usage
    yield "event", {"type": "response.completed", "response": response}


def _make_handler(model: OfflineModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Silence http.server's stderr access log (it would print request lines)."""

        # Proxy trap: an absolute URI or CONNECT means something tried to reach the internet.
        def do_CONNECT(self) -> None:
            self._refuse_proxy()

        def _refuse_proxy(self) -> None:
            model._record_proxy(f"{self.command} {self.path}")
            body = b"offline: internet access refused"
            self.send_response(403)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def do_GET(self) -> None:
            if self.path.startswith(("http://", "https://")):
                self._refuse_proxy()
                return
            self._send_plain(404, "not found")

        def do_POST(self) -> None:
            if self.path.startswith(("http://", "https://")):
                self._refuse_proxy()
                return
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {}
            request = RecordedRequest(
                index=next(model._ids),
                method="POST",
                path=self.path,
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body if isinstance(body, dict) else {},
                received_at=time.monotonic(),
            )
            model._record(request)
            if request.is_image_request:
                self._send_image(model._pick_image())
                return
            if not self.path.rstrip("/").endswith("/responses"):
                self._send_plain(404, "only /v1/responses and /v1/images/* are served")
                return
            reply = model._pick(request)
            try:
                if model.first_byte_delay > 0:
                    model._stall(self.connection, model.first_byte_delay)
                self._answer(request, reply)
            except (_ClientGone, BrokenPipeError, ConnectionResetError):
                with model._lock:
                    model.disconnects += 1
                self.close_connection = True

        def _send_plain(self, status: int, text: str) -> None:
            body = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _send_image(self, reply: ImageReply) -> None:
            body = json.dumps(reply.body()).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _answer(self, request: RecordedRequest, reply: Reply) -> None:
            if reply.kind == "http_error":
                if reply.delay:
                    model._stall(self.connection, reply.delay)
                body = reply.text.encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for what, event in _reply_events(model, request, reply, request.index):
                if what == "stall":
                    model._stall(self.connection, reply.delay)
                else:
                    self._chunk(_sse(event))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


@contextlib.contextmanager
def running_model(**kwargs: Any) -> Iterator[OfflineModel]:
    """``with running_model() as model:`` — a started :class:`OfflineModel`, closed after."""
    model = OfflineModel(**kwargs)
    model.start()
    try:
        yield model
    finally:
        model.close()


def texts(requests: Sequence[RecordedRequest]) -> list[str]:
    """The last user text of each request (handy in assertions)."""
    return [r.last_user_text for r in requests]
