"""The per-turn shortcuts of ``harness._fs`` and the session lease.

* :func:`run_in_worker`, the worker-thread hop (anyio's, under a limiter of the CPUs + 2):
  results and errors, the caller's context, never abandoned (a cancelled caller still gets
  the work done, then its cancellation, also when it waited for a free slot), not started
  for a caller already cancelled, more hops than slots (never more at once, every one run,
  none left holding a slot), many turns on a small limiter, trio, a forked child, and
  anyio's four event-loop rounds a hop on asyncio, no more.
* :func:`pinned_session_path`: one resolution per turn, for every spelling of the file, in
  worker threads too; a symlinked directory swapped mid-turn keeps the turn on its name.
* The lease: a turn's lease wakes no renewal thread; its lock file is OpenClaw's pretty JSON,
  byte for byte.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
from structlog.testing import capture_logs

from codex_turn.harness import _fs
from codex_turn.harness._fs import pinned_session_path, run_in_worker, session_path
from codex_turn.harness.session import _lease, _lockfile

_var: contextvars.ContextVar[str] = contextvars.ContextVar("test_fs_worker_var", default="unset")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_run_in_worker_returns_raises_and_carries_the_context(backend: str) -> None:
    async def main() -> None:
        _var.set("caller")
        caller = threading.get_ident()
        assert await run_in_worker(lambda a, b: a + b, 2, 3) == 5
        assert await run_in_worker(_var.get) == "caller"
        assert await run_in_worker(threading.get_ident) != caller
        with pytest.raises(KeyError, match="missing"):
            await run_in_worker({}.__getitem__, "missing")

    anyio.run(main, backend=backend)


def test_a_worker_is_not_in_the_event_loop_thread_for_sniffio() -> None:
    import sniffio

    async def main() -> None:
        def library() -> str | None:
            try:
                return sniffio.current_async_library()
            except sniffio.AsyncLibraryNotFoundError:
                return None

        assert await run_in_worker(library) is None

    anyio.run(main, backend="asyncio")


def test_a_cancelled_caller_still_gets_the_work_done_then_is_cancelled() -> None:
    done = threading.Event()

    async def main() -> None:
        def slow() -> str:
            time.sleep(0.2)
            done.set()
            return "done"

        with anyio.move_on_after(0.02) as scope:
            await run_in_worker(slow)
            await anyio.lowlevel.checkpoint()  # where the cancellation lands
            pytest.fail("not cancelled")
        assert scope.cancelled_caught
        assert done.is_set()  # waited for, never abandoned

    anyio.run(main, backend="asyncio")


def test_a_caller_already_cancelled_does_not_start_the_work() -> None:
    started: list[bool] = []

    async def main() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await run_in_worker(lambda: started.append(True))
        assert scope.cancelled_caught

    anyio.run(main, backend="asyncio")
    assert started == []


def test_more_hops_at_once_than_workers_all_complete() -> None:
    count = _fs.MAX_WORKERS * 3
    results: list[int] = []
    running = most = 0
    lock = threading.Lock()

    async def main() -> None:
        def work(i: int) -> int:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            time.sleep(0.002)
            with lock:
                running -= 1
            return i

        async def one(i: int) -> None:
            results.append(await run_in_worker(work, i))

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)

    anyio.run(main, backend="asyncio")
    assert sorted(results) == list(range(count))
    assert most <= _fs.MAX_WORKERS


def test_a_hop_costs_anyios_four_event_loop_rounds_on_asyncio() -> None:
    """anyio's checkpoint and its limiter's each take a round, the worker's wake-up and the
    waiting task's the other two; the shield and the pre-check add none."""

    async def main() -> int:
        await run_in_worker(lambda: None)  # a worker exists
        loop = asyncio.get_running_loop()
        rounds = 0
        original = loop._run_once  # type: ignore[attr-defined]

        def counted() -> None:
            nonlocal rounds
            rounds += 1
            original()

        loop._run_once = counted  # type: ignore[attr-defined]
        try:
            for _ in range(10):
                await run_in_worker(lambda: None)
        finally:
            loop._run_once = original  # type: ignore[attr-defined]
        return rounds

    assert anyio.run(main, backend="asyncio") <= 40 + 1


def test_a_forked_child_starts_its_own_workers() -> None:
    async def main() -> int:
        return await run_in_worker(os.getpid)

    assert anyio.run(main, backend="asyncio") == os.getpid()  # workers exist now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if anyio.run(main, backend="asyncio") == os.getpid() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --- the limiter: more hops than slots --------------------------------------------------------


@pytest.fixture
def slots(monkeypatch: pytest.MonkeyPatch) -> Callable[[], anyio.CapacityLimiter]:
    """3 slots for the event loops started from here on; the running loop's limiter."""
    monkeypatch.setattr(_fs, "MAX_WORKERS", 3)
    return _fs._worker_limiter


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_limiter_is_the_pool_size_one_per_event_loop(
    slots: Callable[[], anyio.CapacityLimiter], backend: str
) -> None:
    async def main() -> tuple[float, bool]:
        await run_in_worker(lambda: None)
        limiter = slots()
        return limiter.total_tokens, limiter is slots()

    assert anyio.run(main, backend=backend) == (3, True)


def test_bursts_beyond_the_limit_all_run_and_leave_no_slot_taken(
    slots: Callable[[], anyio.CapacityLimiter],
) -> None:
    """Random bursts of blocking hops, more than the 3 slots, with pauses between bursts:
    every hop runs, never more than 3 at once, and afterwards no slot is held."""
    rng = random.Random(13)
    running = 0
    most = 0
    lock = threading.Lock()

    def job(pause: float) -> float:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(pause)
        with lock:
            running -= 1
        return pause

    async def burst(size: int) -> list[float]:
        pauses = [rng.random() * 0.01 for _ in range(size)]
        results: list[float] = []

        async def one(pause: float) -> None:
            results.append(await run_in_worker(job, pause))

        async with anyio.create_task_group() as tg:
            for pause in pauses:
                tg.start_soon(one, pause)
        assert sorted(results) == sorted(pauses)
        return results

    async def main() -> float:
        for size in (1, 7, 2, 12, 3, 1, 9):
            await burst(size)
            if rng.random() < 0.5:
                await anyio.sleep(0.08)
        return slots().borrowed_tokens

    assert anyio.run(main, backend="asyncio") == 0
    assert most <= 3


def test_a_hop_queued_behind_busy_slots_runs_when_the_first_one_frees(
    slots: Callable[[], anyio.CapacityLimiter],
) -> None:
    """With all 3 slots blocked, a 4th hop waits; the first hop to finish lets it run."""
    gates = [threading.Event() for _ in range(3)]
    started = threading.Semaphore(0)

    def blocked(gate: threading.Event) -> str:
        started.release()
        assert gate.wait(10)
        return "blocked"

    async def main() -> list[str]:
        results: list[str] = []

        async def one(func: Callable[..., str], *args: Any) -> None:
            results.append(await run_in_worker(func, *args))

        async with anyio.create_task_group() as tg:
            for gate in gates:
                tg.start_soon(one, blocked, gate)
            for _ in gates:
                await anyio.to_thread.run_sync(started.acquire)
            tg.start_soon(one, lambda: "queued")
            await anyio.sleep(0.05)
            assert results == []  # every slot busy: it waits
            stats = slots().statistics()
            assert (stats.borrowed_tokens, stats.tasks_waiting) == (3, 1)
            gates[0].set()
            await anyio.sleep(0.2)
            assert sorted(results) == ["blocked", "queued"]
            for gate in gates[1:]:
                gate.set()
        assert slots().borrowed_tokens == 0
        return results

    assert sorted(anyio.run(main, backend="asyncio")) == ["blocked"] * 3 + ["queued"]


def test_a_caller_cancelled_while_waiting_for_a_slot_still_gets_its_hop_run(
    slots: Callable[[], anyio.CapacityLimiter],
) -> None:
    """A hop asked for is a hop done (a lease given back by a cancelled turn, say): the
    cancellation reaches the caller once the hop ran."""
    gate = threading.Event()
    started = threading.Semaphore(0)
    ran: list[str] = []

    def blocked() -> None:
        started.release()
        assert gate.wait(10)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(run_in_worker, blocked)
            for _ in range(3):
                await anyio.to_thread.run_sync(started.acquire)
            freed = threading.Timer(0.2, gate.set)  # the slots free after the cancellation
            freed.start()
            with anyio.move_on_after(0.05) as scope:
                await run_in_worker(ran.append, "given back")
                await anyio.lowlevel.checkpoint()
                pytest.fail("not cancelled")
            assert scope.cancelled_caught
            assert gate.is_set()  # it waited for a slot past the cancellation
            assert ran == ["given back"]  # and then ran

    anyio.run(main, backend="asyncio")


def test_many_turns_drain_a_limiter_of_two(
    slots: Callable[[], anyio.CapacityLimiter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limiter is small (CPUs + 2) and a turn takes several hops, one of them the
    prompt's write and fsync: no hop waits for another, so 16 turns on 2 slots all end and
    leave no slot held."""
    monkeypatch.setattr(_fs, "MAX_WORKERS", 2)
    done: list[int] = []

    def prompt_written_and_synced() -> None:
        time.sleep(0.005)  # the prompt's fsync

    async def turn(i: int) -> None:
        await run_in_worker(lambda: None)  # the lease
        await run_in_worker(prompt_written_and_synced)
        await run_in_worker(prompt_written_and_synced)  # the mirror
        await run_in_worker(lambda: None)  # the lease given back
        done.append(i)

    async def main() -> float:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(turn, i)
        return slots().borrowed_tokens

    assert anyio.run(main, backend="asyncio") == 0
    assert sorted(done) == list(range(16))


# --- one name per turn ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_pinned_session_path_answers_every_spelling_without_resolving_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    raw = os.path.join("link", "s.jsonl")  # relative: its absolute spelling is pinned too
    expected = str(real / "s.jsonl")
    monkeypatch.chdir(tmp_path)
    resolved: list[str] = []
    original = _fs._resolve

    def counting(path: str) -> str:
        resolved.append(path)
        return original(path)

    monkeypatch.setattr(_fs, "_resolve", counting)

    async def main() -> None:
        with pinned_session_path(raw) as key:
            assert key == expected
            for spelling in (raw, Path(raw), str(tmp_path / "link" / "s.jsonl"), expected):
                assert session_path(spelling) == expected
            assert await run_in_worker(session_path, raw) == expected
            assert session_path(str(tmp_path / "other.jsonl")) == str(tmp_path / "other.jsonl")
        assert session_path(raw) == expected  # resolved again, outside the pin

    anyio.run(main, backend=backend)
    assert resolved == [raw, str(tmp_path / "other.jsonl"), raw]


def test_a_directory_swapped_mid_turn_keeps_the_turn_on_its_name(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    link = tmp_path / "link"
    link.symlink_to(first)
    raw = str(link / "s.jsonl")
    with pinned_session_path(raw):
        link.unlink()
        link.symlink_to(second)
        # The turn's gate, lease, mirror and binding stay on the file its lease covers.
        assert session_path(raw) == str(first / "s.jsonl")
    assert session_path(raw) == str(second / "s.jsonl")


# --- the lease ---------------------------------------------------------------------------------


def test_a_turn_lease_wakes_no_renewal_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A renewer of its own: the process-wide one may be lingering near the end of its 30 s
    # from an earlier test, and then wakes before any lease is due (nothing to notify).
    monkeypatch.setattr(_lease, "_renewer", _lease._Renewer())
    session = str(tmp_path / "s.jsonl")
    first = _lease.try_acquire_lease(session)  # the renewal thread runs from here on
    assert isinstance(first, _lease.SessionLease)
    _lease.release_lease(first)
    time.sleep(0.05)  # it lingers, in slices
    notified: list[bool] = []
    condition = _lease._renewer._wake
    original = condition.notify

    def counting(n: int = 1) -> None:
        notified.append(True)
        original(n)

    monkeypatch.setattr(condition, "notify", counting)
    for _ in range(5):
        lease = _lease.try_acquire_lease(session)
        assert isinstance(lease, _lease.SessionLease)
        _lease.release_lease(lease)
    assert notified == []
    short = _lease.try_acquire_lease(session, ttl=0.2)  # due within the slice: woken
    assert isinstance(short, _lease.SessionLease)
    _lease.release_lease(short)
    assert notified == [True]


@pytest.mark.parametrize("ttl", [None, 60.0, 0.0001])
def test_the_lock_file_is_openclaws_pretty_json_byte_for_byte(ttl: float | None) -> None:
    data = _lockfile.lock_payload(ttl)
    payload = json.loads(data)
    assert data == (json.dumps(payload, indent=2) + "\n").encode()
    assert payload["pid"] == os.getpid()
    assert ("ttlMs" in payload) is (ttl is not None)


@pytest.mark.parametrize(("cpus", "expected"), [(1, 3), (2, 4), (8, 10), (64, 32)])
def test_the_pool_is_the_cpus_plus_two_at_most_32(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    monkeypatch.delenv(_fs.ENV_WORKERS, raising=False)
    monkeypatch.setattr(_fs, "_usable_cpus", lambda: cpus)
    assert _fs._max_workers() == expected


@pytest.mark.parametrize(("raw", "expected"), [("1", 1), (" 12 ", 12), ("256", 256)])
def test_the_pool_size_is_overridden_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: int
) -> None:
    monkeypatch.setenv(_fs.ENV_WORKERS, raw)
    monkeypatch.setattr(_fs, "_usable_cpus", lambda: 2)
    assert _fs._max_workers() == expected


@pytest.mark.parametrize("raw", ["0", "-3", "257", "many", "4.5"])
def test_an_invalid_pool_size_is_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(_fs.ENV_WORKERS, raw)
    monkeypatch.setattr(_fs, "_usable_cpus", lambda: 2)
    with capture_logs() as logs:
        assert _fs._max_workers() == 4
    assert [(e["event"], e["variable"]) for e in logs] == [
        ("invalid worker thread count ignored", _fs.ENV_WORKERS)
    ]
