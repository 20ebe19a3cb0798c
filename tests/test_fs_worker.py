"""The per-turn shortcuts of ``harness._fs`` and the session lease.

* :func:`run_in_worker`, the worker-thread hop: results and errors, the caller's context,
  never abandoned (a cancelled caller still gets the work done, then its cancellation), not
  started for a caller already cancelled, more hops than workers, trio, a forked child, and
  two event-loop rounds a hop on asyncio.
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
import threading
import time
from pathlib import Path

import anyio
import anyio.lowlevel
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

    async def main() -> None:
        def work(i: int) -> int:
            time.sleep(0.002)
            return i

        async def one(i: int) -> None:
            results.append(await run_in_worker(work, i))

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)

    anyio.run(main, backend="asyncio")
    assert sorted(results) == list(range(count))


def test_a_hop_costs_two_event_loop_rounds_on_asyncio() -> None:
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

    assert anyio.run(main, backend="asyncio") <= 20 + 1


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


# --- one name per turn ------------------------------------------------------------------------


def test_a_pinned_session_path_answers_every_spelling_without_resolving_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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

    anyio.run(main, backend="asyncio")
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
