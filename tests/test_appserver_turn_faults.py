"""Turn lifecycle faults, against an in-process fake Codex (exact message control, no process).

* A caller that leaves (cancelled, ``turn/start`` timed out) while ``turn/start`` is in flight
  interrupts the turn Codex started, exactly once (B8).
* ``collect``'s idle/turn timeouts bound receiving only, never the ``on_event`` callback (B9).
* A timed-out turn stays ``TIMED_OUT`` when its interrupt times out or hits a dead process (B15).
* Per-thread state is released by ``forget_thread`` and the manager's memo is an LRU (B11).
* The timing defaults have one source (D8).
* A turn's lifecycle is one :class:`CodexTurnPhase`, moved only by its table: an interrupt is
  queued until ``turn/started`` and sent once; a given-up turn is not waited for twice.
* The runtime policy is sent on ``thread/start``/``thread/resume`` under the schema's names,
  and re-sent when the manager re-resumes a thread after a restart.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import json
import math
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn.harness.appserver import (
    INTERRUPT_GRACE_S,
    LIVENESS_TIMEOUT_S,
    MAX_REMEMBERED_THREADS,
    NATIVE_COMPACTION_TIMEOUT_S,
    AppServer,
    AppServerClient,
    AppServerClosed,
    AppServerConfig,
    AppServerRpcError,
    AppServerTimeout,
    CodexTurnPhase,
    CodexTurnStatus,
    DynamicTool,
    NoActiveTurn,
    Notification,
    TextInput,
    ThreadSettings,
    TurnHandle,
    TurnNotRunning,
    TurnProjector,
)
from codex_turn.harness.appserver.turn import _TURN_TABLE, _TurnInput
from codex_turn.harness.compaction import CompactSessionParams

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

GRACE = 0.3  # the interrupt grace of these tests (Codex itself answers within milliseconds)


Message = dict[str, Any]


class FakeCodex:
    """A :class:`~codex_turn.harness.appserver.LineTransport` playing Codex in-process.

    It answers ``initialize``, ``config/read``, ``thread/start`` and ``thread/resume`` itself;
    any other request goes to ``handlers[method]`` when there is one and is otherwise left
    unanswered, for the test to answer (:meth:`reply`, :meth:`notify`) or to ignore."""

    def __init__(self) -> None:
        self._out, self._in = anyio.create_memory_object_stream[bytes](math.inf)
        self.sent: list[Message] = []
        self.handlers: dict[str, Callable[[Message], None]] = {}
        self.returncode: int | None = None
        self.killed = False
        self.active_turns: set[str] = set()  # started (turn/started sent), not completed
        self.interrupted: list[str] = []  # turns a turn/interrupt was accepted for
        self._threads = itertools.count(1)
        self._changed = anyio.Event()

    # -- LineTransport ---------------------------------------------------------------------

    async def send_line(self, line: bytes) -> None:
        if self.returncode is not None:
            raise AppServerClosed("fake codex is dead", returncode=self.returncode)
        message = json.loads(line)
        self.sent.append(message)
        method = message.get("method")
        if method == "initialize":
            self.reply(message, {"userAgent": "fake/1", "codexHome": "/fake"})
        elif method == "thread/start":
            self.reply(message, {"thread": {"id": f"thread-{next(self._threads)}"}})
        elif method == "thread/resume":
            self.reply(message, {"thread": {"id": message["params"]["threadId"]}})
        elif method == "config/read":  # the thread's configured turn defaults: none
            self.reply(message, {"config": {}, "origins": {}})
        elif method in self.handlers:
            self.handlers[method](message)
        elif method == "thread/loaded/list":  # the client's liveness probe
            self.reply(message, {"data": [], "nextCursor": None})
        self._changed.set()
        self._changed = anyio.Event()

    async def receive_line(self) -> bytes:
        try:
            return await self._in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise AppServerClosed("fake codex exited", returncode=self.returncode) from None

    async def run_background(self) -> None:
        return

    async def aclose(self) -> None:
        self._out.close()

    def kill(self) -> None:
        self.killed = True
        self.die()

    # -- scripting -------------------------------------------------------------------------

    def _emit(self, message: Message) -> None:
        self._out.send_nowait(json.dumps(message).encode())

    def reply(self, request: Message, result: Any) -> None:
        self._emit({"id": request["id"], "result": result})

    def refuse(self, request: Message, code: int = -32600, text: str = "refused") -> None:
        self._emit({"id": request["id"], "error": {"code": code, "message": text}})

    def notify(self, method: str, **params: Any) -> None:
        turn_id = str((params.get("turn") or {}).get("id"))
        if method == "turn/started":
            self.active_turns.add(turn_id)
        elif method == "turn/completed":
            self.active_turns.discard(turn_id)
        self._emit({"method": method, "params": params})

    def start_turn(self, request: Message, turn_id: str, *, respond: bool = True) -> None:
        """Codex's side of a turn/start: the response (optional) and ``turn/started``."""
        thread_id = request["params"]["threadId"]
        if respond:
            self.reply(request, {"turn": {"id": turn_id, "status": "inProgress", "items": []}})
        self.notify("turn/started", threadId=thread_id, turn={"id": turn_id})

    def complete_turn(self, thread_id: str, turn_id: str, status: str = "completed") -> None:
        self.notify(
            "turn/completed",
            threadId=thread_id,
            turn={"id": turn_id, "status": status, "items": [], "error": None},
        )

    def die(self) -> None:
        self.returncode = 1
        self._out.close()

    def requests(self, method: str) -> list[Message]:
        return [m for m in self.sent if m.get("method") == method and "id" in m]

    async def wait_sent(self, method: str, count: int = 1) -> list[Message]:
        with anyio.fail_after(3):
            while len(found := self.requests(method)) < count:
                await self._changed.wait()
        return found


@pytest.fixture
def config(tmp_path: Path) -> AppServerConfig:
    return AppServerConfig(codex_home=tmp_path / "home", write_config=False, interrupt_grace=GRACE)


@pytest.fixture
def fake() -> FakeCodex:
    return FakeCodex()


@pytest.fixture
async def client(config: AppServerConfig, fake: FakeCodex) -> AsyncIterator[AppServerClient]:
    async with AppServerClient.connect(config, transport=fake) as c:
        yield c


def acknowledge_interrupts(fake: FakeCodex) -> None:
    """Codex's answer to ``turn/interrupt``: ``{}``, then ``turn/completed(interrupted)``; but
    only for an *active* turn: before its ``turn/started`` (right after the turn/start
    response), Codex 0.163 refuses the interrupt and the turn runs on."""

    def on_interrupt(request: Message) -> None:
        params = request["params"]
        if params["turnId"] not in fake.active_turns:
            fake.refuse(request, text="no active turn to interrupt")
            return
        fake.reply(request, {})
        fake.interrupted.append(params["turnId"])
        fake.complete_turn(params["threadId"], params["turnId"], "interrupted")

    fake.handlers["turn/interrupt"] = on_interrupt


async def let_the_client_run() -> None:
    """Let the client react to what the fake just sent, until it waits for Codex again."""
    await anyio.wait_all_tasks_blocked()
    # On asyncio, wait_all_tasks_blocked may return while a just-woken task has not run yet.
    await anyio.sleep(0.05)


# --- B8: leaving while turn/start is in flight ---------------------------------------------


@pytest.mark.parametrize("codex_answers_with", ["response", "turn/started", "refusal"])
async def test_cancelled_while_turn_start_is_in_flight_interrupts_the_started_turn(
    client: AppServerClient, fake: FakeCodex, codex_answers_with: str
) -> None:
    tid = (await client.start_thread()).thread_id
    acknowledge_interrupts(fake)
    caught: list[bool] = []
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def caller() -> None:
            with scope:
                await client.run_turn(tid, "orphan me")
            caught.append(scope.cancelled_caught)

        tg.start_soon(caller)
        (start,) = await fake.wait_sent("turn/start")
        scope.cancel()  # the request is out, its response is not in yet
        if codex_answers_with == "refusal":
            fake.refuse(start)
        elif codex_answers_with == "response":
            # The response names the turn before it is active: an interrupt now is refused.
            fake.reply(start, {"turn": {"id": "turn-1", "status": "inProgress", "items": []}})
            await let_the_client_run()
            fake.notify("turn/started", threadId=tid, turn={"id": "turn-1"})
        else:
            fake.start_turn(start, "turn-1", respond=False)  # the response is lost
    assert caught == [True]  # the cancellation propagated
    if codex_answers_with == "refusal":
        assert fake.requests("turn/interrupt") == []  # nothing was started
    else:
        (interrupt,) = fake.requests("turn/interrupt")  # once, never twice
        assert interrupt["params"] == {"threadId": tid, "turnId": "turn-1"}
        assert fake.interrupted == ["turn-1"]
        assert not fake.active_turns


async def test_leaving_a_turn_before_turn_started_interrupts_once_it_is_active(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    acknowledge_interrupts(fake)
    fake.handlers["turn/start"] = lambda request: fake.reply(
        request, {"turn": {"id": "turn-1", "status": "inProgress", "items": []}}
    )
    async with anyio.create_task_group() as tg:

        async def codex_activates_the_turn_later() -> None:
            await fake.wait_sent("turn/start")
            await let_the_client_run()
            fake.notify("turn/started", threadId=tid, turn={"id": "turn-1"})

        tg.start_soon(codex_activates_the_turn_later)
        with anyio.CancelScope() as scope:
            async with client.turn(tid, "leave at once") as handle:
                scope.cancel()
                await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert fake.interrupted == ["turn-1"]  # accepted: sent after turn/started
    assert len(fake.requests("turn/interrupt")) == 1
    assert handle.projector.done


async def test_turn_start_timeout_interrupts_the_started_turn_and_raises(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    acknowledge_interrupts(fake)
    # Codex starts the turn but its response never arrives in time.
    fake.handlers["turn/start"] = lambda request: fake.start_turn(request, "turn-1", respond=False)
    with pytest.raises(AppServerTimeout):
        async with client.turn(tid, "slow start", timeout=0.1):
            pytest.fail("no handle without a turn/start response")
    (interrupt,) = fake.requests("turn/interrupt")
    assert interrupt["params"]["turnId"] == "turn-1"


async def test_unacknowledged_interrupt_of_an_abandoned_start_is_sent_once(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    fake.handlers["turn/start"] = lambda request: fake.start_turn(request, "turn-1", respond=False)
    # turn/interrupt is never answered (a second one would hang in Codex): the abandonment is
    # bounded by the grace, and the interrupt is not retried.
    with anyio.fail_after(4 * GRACE + 2):
        with anyio.move_on_after(0.05) as scope:
            await client.run_turn(tid, "never answered")
    assert scope.cancelled_caught
    assert len(fake.requests("turn/interrupt")) == 1


# --- B9: a slow on_event is not Codex being idle -------------------------------------------


async def test_slow_on_event_callback_is_neither_cancelled_nor_idle_time(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id

    def whole_turn(request: Message) -> None:
        fake.start_turn(request, "turn-1")
        fake.complete_turn(tid, "turn-1")

    fake.handlers["turn/start"] = whole_turn
    acknowledge_interrupts(fake)  # so that a wrongly timed-out turn ends cleanly as TIMED_OUT
    finished: list[str] = []

    async def slow_hook(n: Notification) -> None:
        await anyio.sleep(0.3)  # e.g. a compaction hook; longer than the idle timeout
        finished.append(n.method)

    result = await client.run_turn(tid, "hi", on_event=slow_hook, idle_timeout=0.1)
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert finished == ["turn/started", "turn/completed"]
    assert fake.requests("turn/interrupt") == []


class _LateStream:
    """Hands over each notification only after the wait's deadline passed, shielded: the
    notification is there in the very round the wait times out."""

    def __init__(self, notifications: list[Notification], delay: float) -> None:
        self._notifications = notifications
        self._delay = delay

    async def receive(self) -> Notification:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(self._delay)
        return self._notifications.pop(0)


async def test_a_notification_that_arrives_as_the_wait_times_out_is_handed_over(
    anyio_backend: str,
) -> None:
    # collect bounds its waits with one cancel scope; a notification received in the round
    # its deadline passed is not idleness, and on_event sees it outside the cancelled scope
    # (never cancelled itself).
    notes = [
        Notification("turn/started", {"threadId": "t", "turn": {"id": "u"}}),
        Notification(
            "turn/completed", {"threadId": "t", "turn": {"id": "u", "status": "completed"}}
        ),
    ]
    projector = TurnProjector(thread_id="t", prompt="p", turn_id="u")
    handle = TurnHandle(_NoClient(), "t", "u", _LateStream(list(notes), 0.15), projector)
    seen: list[str] = []

    async def on_event(n: Notification) -> None:
        await anyio.sleep(0.01)  # a checkpoint: a cancelled scope around it would cut it
        seen.append(n.method)

    result = await handle.collect(on_event=on_event, idle_timeout=0.05, timeout=5)
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert seen == ["turn/started", "turn/completed"]


# --- B15: a timed-out turn stays TIMED_OUT when its interrupt fails -------------------------


@pytest.mark.parametrize("interrupt_fails_by", ["timeout", "process death"])
async def test_timeout_result_survives_a_failing_interrupt(
    client: AppServerClient, fake: FakeCodex, interrupt_fails_by: str
) -> None:
    tid = (await client.start_thread()).thread_id
    fake.handlers["turn/start"] = lambda request: fake.start_turn(request, "turn-1")
    if interrupt_fails_by == "process death":
        fake.handlers["turn/interrupt"] = lambda request: fake.die()
    result = await client.run_turn(tid, "hang", idle_timeout=0.1)
    assert result.outcome is CodexTurnStatus.TIMED_OUT
    assert result.prompt_error is not None
    assert "idle" in result.prompt_error
    assert len(fake.requests("turn/interrupt")) == 1  # sent once, not retried
    assert client.closed is (interrupt_fails_by == "process death")


# --- B11: per-thread state is released ------------------------------------------------------


def _tool_holding(payload: object) -> DynamicTool:
    async def handler(args: dict[str, Any]) -> str:
        return repr(payload)

    return DynamicTool("hold", "Holds a payload.", {"type": "object"}, handler)


class _Payload:
    """Stands in for a whole turn object kept alive by a tool closure."""


async def test_client_forget_thread_releases_tools_and_loaded_mark(
    client: AppServerClient,
) -> None:
    payload = _Payload()
    alive = weakref.ref(payload)
    tid = (await client.start_thread(ThreadSettings(tools=[_tool_holding(payload)]))).thread_id
    other = (await client.start_thread(ThreadSettings(tools=[_tool_holding(_Payload())]))).thread_id
    del payload
    gc.collect()
    assert alive() is not None
    assert client.is_loaded(tid)
    client.forget_thread(tid)
    client.forget_thread(tid)  # idempotent
    client.forget_thread("never-seen")
    gc.collect()
    assert alive() is None
    assert not client.is_loaded(tid)
    assert client.is_loaded(other)  # only that thread


async def test_manager_forget_thread_and_lru_bound(
    config: AppServerConfig, fake: FakeCodex
) -> None:
    async def factory(_: AppServerConfig) -> FakeCodex:
        return fake

    async with AppServer.start(config, transport_factory=factory, max_threads=2) as server:
        payload = _Payload()
        alive = weakref.ref(payload)
        t1 = (await server.start_thread(ThreadSettings(tools=[_tool_holding(payload)]))).thread_id
        del payload
        t2 = (await server.start_thread()).thread_id
        await server.resume_thread(
            t1, ThreadSettings(developer_instructions="again")
        )  # t1 is now the newest
        t3 = (await server.start_thread()).thread_id
        assert server.remembered_threads == [t1, t3]  # t2 was least recently used
        client = server.current
        assert client is not None
        assert client.is_loaded(t2)  # an eviction drops only the memo
        server.forget_thread(t1)
        gc.collect()
        assert alive() is None  # neither the memo nor the client keeps t1's tools
        assert server.remembered_threads == [t3]
        assert not client.is_loaded(t1)
        with pytest.raises(ValueError, match="max_threads"):
            AppServer(config, max_threads=0)
    assert AppServer(config).max_threads == MAX_REMEMBERED_THREADS == 256


# --- D8: one source for the timing defaults -------------------------------------------------


def _default(function: Callable[..., Any], name: str) -> Any:
    return inspect.signature(function).parameters[name].default


def test_timing_defaults_have_one_source(tmp_path: Path) -> None:
    assert INTERRUPT_GRACE_S == 5.0
    assert NATIVE_COMPACTION_TIMEOUT_S == 300.0  # OpenClaw's default: 5 minutes
    params = CompactSessionParams(session_id="s", session_file=str(tmp_path / "s.jsonl"))
    assert params.native_timeout == NATIVE_COMPACTION_TIMEOUT_S
    assert params.interrupt_grace == INTERRUPT_GRACE_S
    for compact in (AppServerClient.compact_thread, AppServer.compact_thread):
        assert _default(compact, "timeout") == NATIVE_COMPACTION_TIMEOUT_S
        assert _default(compact, "interrupt_grace") == INTERRUPT_GRACE_S
    for interrupt in (AppServerClient.interrupt_turn, AppServer.interrupt_turn):
        assert _default(interrupt, "timeout") == INTERRUPT_GRACE_S
    assert _default(AppServerClient, "interrupt_grace") == INTERRUPT_GRACE_S
    assert _default(TurnHandle, "interrupt_grace") == INTERRUPT_GRACE_S
    assert AppServerConfig(codex_home=tmp_path).interrupt_grace == INTERRUPT_GRACE_S
    assert LIVENESS_TIMEOUT_S == 10.0
    assert _default(AppServerClient, "liveness_timeout") == LIVENESS_TIMEOUT_S
    assert AppServerConfig(codex_home=tmp_path).liveness_timeout == LIVENESS_TIMEOUT_S


# --- the turn phase -------------------------------------------------------------------------

P = CodexTurnPhase


def test_turn_table_covers_every_phase_and_only_an_interrupted_turn_is_abandoned() -> None:
    assert set(_TURN_TABLE) == set(P)
    for phase in set(P) - {P.COMPLETED}:
        assert _TURN_TABLE[phase][_TurnInput.COMPLETED] is P.COMPLETED
    assert set(_TURN_TABLE[P.COMPLETED].values()) == {P.COMPLETED}  # terminal
    # Giving up always interrupts first: never from a phase without an interrupt decision.
    assert _TurnInput.ABANDON not in _TURN_TABLE[P.STARTING]
    assert _TurnInput.ABANDON not in _TURN_TABLE[P.RUNNING]
    # The interrupt is decided once.
    deciding = [phase for phase in P if _TurnInput.INTERRUPT in _TURN_TABLE[phase]]
    assert deciding == [P.STARTING, P.RUNNING]


class _NoClient:
    closed_error: AppServerClosed | None = None

    async def interrupt_turn(
        self,
        thread_id: str,
        turn_id: str,
        *,
        timeout: float = INTERRUPT_GRACE_S,  # noqa: ASYNC109
    ) -> None:
        raise AssertionError("no interrupt expected")


class _NoStream:
    async def receive(self) -> Notification:
        raise AssertionError("no receive expected")


def test_an_input_the_table_does_not_list_raises_and_changes_nothing() -> None:
    projector = TurnProjector(thread_id="t", prompt="p", turn_id="u")
    handle = TurnHandle(_NoClient(), "t", "u", _NoStream(), projector)
    assert handle.phase is P.STARTING
    for event in (_TurnInput.ABANDON, _TurnInput.GRACE_PASSED):
        with pytest.raises(RuntimeError, match="not allowed in phase STARTING"):
            handle._fire(event)
        assert handle.phase is P.STARTING
    assert "phase=STARTING" in repr(handle)


def answer_turn_start(fake: FakeCodex, turn_id: str = "turn-1") -> None:
    """Codex answers turn/start (the turn is not active yet: no turn/started)."""
    fake.handlers["turn/start"] = lambda request: fake.reply(
        request, {"turn": {"id": turn_id, "status": "inProgress", "items": []}}
    )


async def test_a_turn_moves_from_starting_through_running_to_completed(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    answer_turn_start(fake)
    async with client.turn(tid, "hi") as handle:
        assert handle.phase is P.STARTING
        fake.notify("turn/started", threadId=tid, turn={"id": "turn-1"})
        assert (await handle.__anext__()).method == "turn/started"
        assert handle.phase is P.RUNNING
        fake.complete_turn(tid, "turn-1")
        result = await handle.collect()
        assert handle.phase is P.COMPLETED
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert fake.requests("turn/interrupt") == []


async def test_an_interrupt_before_turn_started_is_queued_and_sent_once(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    answer_turn_start(fake)
    acknowledge_interrupts(fake)
    async with client.turn(tid, "stop soon") as handle:
        async with anyio.create_task_group() as tg:
            # Short sleeps, not let_the_client_run: the queue waits only GRACE for turn/started
            # (wait_all_tasks_blocked can outlast that on asyncio).
            tg.start_soon(handle.interrupt)
            await anyio.sleep(0.02)
            assert handle.phase is P.INTERRUPT_QUEUED
            tg.start_soon(handle.interrupt)  # joins the queued one, sends nothing itself
            await anyio.sleep(0.02)
            assert fake.requests("turn/interrupt") == []  # Codex would refuse it now
            fake.notify("turn/started", threadId=tid, turn={"id": "turn-1"})
        assert len(fake.requests("turn/interrupt")) == 1
        result = await handle.collect()
        assert handle.phase is P.COMPLETED
        await handle.interrupt()  # over: nothing more is sent
    assert result.outcome is CodexTurnStatus.INTERRUPTED
    assert fake.interrupted == ["turn-1"]
    assert len(fake.requests("turn/interrupt")) == 1


async def test_a_timed_out_turn_is_abandoned_and_leaving_it_does_not_wait_again(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    fake.handlers["turn/start"] = lambda request: fake.start_turn(request, "turn-1")
    fake.handlers["turn/interrupt"] = lambda request: fake.reply(request, {})  # never ends it
    async with client.turn(tid, "hang") as handle:
        result = await handle.collect(idle_timeout=0.1)
        assert handle.phase is P.ABANDONED
        left = anyio.current_time()
    assert anyio.current_time() - left < GRACE / 2  # no second grace on the way out
    assert result.outcome is CodexTurnStatus.TIMED_OUT
    assert len(fake.requests("turn/interrupt")) == 1


# --- turn/steer: Codex's answers, typed where they come back --------------------------------


@pytest.mark.parametrize(
    ("code", "message", "over"),
    [
        (-32600, "no active turn to steer", True),  # Codex 0.163, the turn ended
        (-32600, "expected active turn id nope but found turn-2", False),
        (-32600, "cannot steer a review turn", False),
        (-32601, "no active turn to steer", False),
    ],
)
def test_only_codexs_no_active_turn_is_a_turn_not_running(
    code: int, message: str, over: bool
) -> None:
    error = AppServerRpcError(code, message, method="turn/steer")
    found = NoActiveTurn.match(error)
    assert (found is not None) is over
    if found is not None:
        assert isinstance(found, TurnNotRunning)
        assert isinstance(found, AppServerRpcError)
        assert (found.code, found.method, found.phase) == (code, "turn/steer", None)


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        ("no active turn to steer", NoActiveTurn),
        ("expected active turn id nope but found turn-2", AppServerRpcError),
        (None, None),
    ],
)
async def test_the_handle_types_codexs_answer_to_a_steer(
    client: AppServerClient, fake: FakeCodex, answer: str | None, raised: type | None
) -> None:
    tid = (await client.start_thread()).thread_id
    fake.handlers["turn/start"] = lambda request: fake.start_turn(request, "turn-1")

    def on_steer(request: Message) -> None:
        if answer is None:
            fake.reply(request, {"turnId": "turn-1"})
        else:
            fake.refuse(request, text=answer)

    fake.handlers["turn/steer"] = on_steer
    async with client.turn(tid, "hi") as handle:
        assert (await handle.__anext__()).method == "turn/started"
        if raised is None:
            assert await handle.steer([TextInput("more")]) == "turn-1"
        else:
            with pytest.raises(AppServerRpcError) as refused:
                await handle.steer([TextInput("more")])
            assert type(refused.value) is raised
            assert isinstance(refused.value, TurnNotRunning) is (raised is NoActiveTurn)
        fake.complete_turn(tid, "turn-1")
        await handle.collect()
    (sent,) = fake.requests("turn/steer")
    assert sent["params"]["expectedTurnId"] == "turn-1"


async def test_a_steer_for_a_turn_that_is_over_is_refused_without_asking_codex(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    fake.handlers["turn/start"] = lambda request: fake.start_turn(request, "turn-1")
    async with client.turn(tid, "hi") as handle:
        fake.complete_turn(tid, "turn-1")
        await handle.collect()
        with pytest.raises(TurnNotRunning) as over:
            await handle.steer([TextInput("too late")])
    assert over.value.phase == "completed"
    assert not isinstance(over.value, AppServerRpcError)
    assert fake.requests("turn/steer") == []


# --- the runtime policy ---------------------------------------------------------------------

POLICY_WIRE = ("approvalPolicy", "sandbox", "approvalsReviewer", "serviceTier")


async def test_runtime_policy_is_sent_under_the_schema_names_only_when_given(
    client: AppServerClient, fake: FakeCodex
) -> None:
    tid = (await client.start_thread()).thread_id
    await client.resume_thread(tid, ThreadSettings(developer_instructions=None))
    await client.start_thread(
        ThreadSettings(
            approval_policy="never",
            sandbox="read-only",
            approvals_reviewer="user",
            service_tier="flex",
        )
    )
    await client.resume_thread(
        tid,
        ThreadSettings(
            developer_instructions=None,
            approval_policy={
                "granular": {"sandbox_approval": True, "rules": False, "mcp_elicitations": False}
            },
            sandbox="workspace-write",
            approvals_reviewer="auto_review",
            service_tier="flex",
        ),
    )
    plain_start, start = (m["params"] for m in fake.requests("thread/start"))
    plain_resume, resume = (m["params"] for m in fake.requests("thread/resume"))
    for params in (plain_start, plain_resume):
        assert not set(POLICY_WIRE) & set(params)
    assert {k: start[k] for k in POLICY_WIRE} == {
        "approvalPolicy": "never",
        "sandbox": "read-only",
        "approvalsReviewer": "user",
        "serviceTier": "flex",
    }
    assert {k: resume[k] for k in POLICY_WIRE} == {
        "approvalPolicy": {
            "granular": {"sandbox_approval": True, "rules": False, "mcp_elicitations": False}
        },
        "sandbox": "workspace-write",
        "approvalsReviewer": "auto_review",
        "serviceTier": "flex",
    }


async def test_auto_resume_after_a_restart_re_sends_the_runtime_policy(
    config: AppServerConfig,
) -> None:
    fakes: list[FakeCodex] = []

    async def factory(_: AppServerConfig) -> FakeCodex:
        fakes.append(FakeCodex())
        return fakes[-1]

    async with AppServer.start(config, transport_factory=factory) as server:
        tid = (
            await server.start_thread(
                ThreadSettings(
                    developer_instructions="dev", sandbox="workspace-write", approval_policy="never"
                )
            )
        ).thread_id
        await server.resume_thread(
            tid,
            ThreadSettings(
                developer_instructions="dev",
                sandbox="danger-full-access",
                approvals_reviewer="user",
                service_tier="flex",
            ),
        )  # what a later auto-resume re-sends: the last resume's policy
        fakes[0].die()
        with anyio.fail_after(3):
            while not server.current or not server.current.closed:  # noqa: ASYNC110
                await anyio.sleep(0.01)

        def whole_turn(request: Message) -> None:
            fakes[1].start_turn(request, "turn-1")
            fakes[1].complete_turn(tid, "turn-1")

        await server.client()
        fakes[1].handlers["turn/start"] = whole_turn
        result = await server.run_turn(tid, "after the crash")
    assert result.outcome is CodexTurnStatus.COMPLETED
    (resume,) = fakes[1].requests("thread/resume")
    assert resume["params"]["developerInstructions"] == "dev"
    assert {k: resume["params"].get(k) for k in POLICY_WIRE} == {
        "approvalPolicy": None,
        "sandbox": "danger-full-access",
        "approvalsReviewer": "user",
        "serviceTier": "flex",
    }
