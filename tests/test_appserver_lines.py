"""The client's line and notification plumbing without a process: the asyncio stdout reader
(:class:`~codex_turn.harness.appserver.process._StdoutLines`, lines handed over from the read
callback) and a turn's queue (:class:`~codex_turn.harness.appserver.client.TurnNotifications`,
which must end, and lose nothing, exactly as an anyio memory object stream would)."""

from __future__ import annotations

import pickle

import anyio
import attrs
import pytest

from codex_turn.harness.appserver import process
from codex_turn.harness.appserver.client import TurnNotifications
from codex_turn.harness.appserver.projector import Notification


@pytest.mark.anyio
async def test_lines_are_split_across_chunks_and_wait_for_a_sink() -> None:
    lines = process._StdoutLines()
    lines.data_received(b'{"a":1}\n{"b"')
    lines.data_received(b":2}\r\n")
    assert list(lines.queued) == [b'{"a":1}', b'{"b":2}\r']  # the client strips the line
    lines.queued.clear()
    got: list[bytes] = []
    lines.sink = got.append
    lines.data_received(b"x\ny\nz")
    lines.data_received(b"z\n")
    assert got == [b"x", b"y", b"zz"]
    lines.eof_received()
    assert lines.ended == "exited"
    lines.data_received(b"late\n")
    assert got == [b"x", b"y", b"zz"]


@pytest.mark.anyio
async def test_a_failing_sink_ends_the_reading() -> None:
    lines = process._StdoutLines()
    got: list[bytes] = []

    def sink(line: bytes) -> None:
        if line == b"bad":
            raise ValueError("boom")
        got.append(line)

    lines.sink = sink
    lines.data_received(b"ok\nbad\nafter\n")
    lines.data_received(b"more\n")
    assert got == [b"ok"]
    assert isinstance(lines.sink_error, ValueError)
    assert lines.sink is None


class _HostBug(BaseException):
    """What a host listener might raise that is no Exception (a test framework's failure)."""


@pytest.mark.anyio
async def test_a_sink_raising_any_base_exception_ends_the_reading_and_is_re_raised() -> None:
    # The event loop does not guard data_received: a BaseException must not drop the rest of
    # the read while the client stays open (a response lost, its request hanging).
    lines = process._StdoutLines()
    got: list[bytes] = []

    def sink(line: bytes) -> None:
        if line == b"bad":
            raise _HostBug
        got.append(line)

    lines.sink = sink
    lines.data_received(b"ok\nbad\nresponse\n")
    assert got == [b"ok"]
    assert isinstance(lines.sink_error, _HostBug)
    assert lines.changed.is_set()  # serve_lines wakes and re-raises it
    lines.sink = sink
    lines.data_received(b"more\n")
    assert got == [b"ok"]  # nothing is handed over after a failed line


def test_a_notification_caches_its_ids_without_new_fields() -> None:
    note = Notification("turn/started", {"threadId": "t1", "turn": {"id": "u1"}})
    assert (note.thread_id, note.turn_id) == ("t1", "u1")
    assert attrs.asdict(note) == {"method": "turn/started", "params": note.params}
    fresh = pickle.loads(pickle.dumps(Notification("x", {"threadId": "t2"})))
    assert (fresh.thread_id, fresh.turn_id) == ("t2", None)


@pytest.mark.anyio
async def test_an_oversized_line_ends_the_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "MAX_LINE_BYTES", 10)
    lines = process._StdoutLines()
    lines.data_received(b"short\n0123456789")
    assert list(lines.queued) == [b"short"]
    assert lines.ended == "sent an oversized line"


@pytest.mark.anyio
async def test_a_turn_queue_ends_like_a_memory_stream() -> None:
    queue = TurnNotifications("t1")
    first, second = Notification("a", {"threadId": "t1"}), Notification("b", {"threadId": "t1"})
    with pytest.raises(anyio.WouldBlock):
        queue.receive_nowait()
    queue.push(first)
    assert await queue.receive() is first  # taken at once
    async with anyio.create_task_group() as tg:
        received: list[Notification] = []

        async def reader() -> None:
            received.append(await queue.receive())

        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        queue.push(second)
    assert received == [second]
    # A receiver cancelled while waiting loses nothing: the next push is still queued.
    with anyio.move_on_after(0.01):
        await queue.receive()
    queue.push(first)
    queue.close_send()
    queue.push(second)  # after the client closed: dropped, as a closed stream would
    assert [n async for n in queue] == [first]  # drained, then EndOfStream
    with pytest.raises(anyio.EndOfStream):
        queue.receive_nowait()
    queue.close()
    queue.push(second)  # dropped once the subscription ended
    with pytest.raises(anyio.ClosedResourceError):
        await queue.receive()


@pytest.mark.anyio
async def test_a_waiting_turn_queue_wakes_when_closed() -> None:
    queue = TurnNotifications("t1")
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            outcome: list[type[BaseException]] = []

            async def reader() -> None:
                try:
                    await queue.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError) as error:
                    outcome.append(type(error))

            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            queue.close_send()
    assert outcome == [anyio.EndOfStream]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_bounded_wait_on_a_turn_queue_says_whether_something_came(
    anyio_backend: str,
) -> None:
    """``wait(deadline)`` (what a turn's collect bounds its waits with) takes nothing: True at
    once when something is queued, True when a push comes before the deadline, False only
    once the clock reached the deadline; a cancelled wait leaves nothing behind."""
    queue = TurnNotifications("t1")
    n = Notification("a", {"threadId": "t1"})
    started = anyio.current_time()
    assert await queue.wait(started + 0.05) is False
    assert anyio.current_time() >= started + 0.05  # not a timer's early wake-up
    async with anyio.create_task_group() as tg:
        woke: list[bool] = []

        async def waiter() -> None:
            woke.append(await queue.wait(anyio.current_time() + 30))

        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        queue.push(n)
    assert woke == [True]
    assert await queue.wait(anyio.current_time() + 30) is True  # queued: at once
    assert queue.receive_nowait() is n  # the waits took nothing
    with anyio.move_on_after(0.01):
        await queue.wait()
    assert queue._waiters == []  # the cancelled wait is forgotten
    queue.push(n)
    assert queue.receive_nowait() is n
    queue.close_send()
    assert await queue.wait(anyio.current_time() + 30) is True  # ended: the receive says so


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_bounded_wait_that_expires_with_something_queued_is_not_idle(
    anyio_backend: str,
) -> None:
    """A notification queued in the very round the deadline passed: the wait says True (Codex
    was not idle), on trio's event-and-scope path as on asyncio's future."""
    queue = TurnNotifications("t1")
    n = Notification("a", {"threadId": "t1"})
    async with anyio.create_task_group() as tg:
        woke: list[bool] = []

        async def waiter() -> None:
            woke.append(await queue.wait(anyio.current_time() + 0.05))

        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        queue._items.append(n)  # queued without a wake-up: as if in the deadline's round
    assert woke == [True]
    assert queue.receive_nowait() is n
