"""How the structured projection's fork fails, in process, no binary needed.

* Codex refusing (a JSON-RPC error) is definitive: the turn falls back to the text frame
  (``fork_failed`` -> ``reprojecting``); no answer (a timeout, a closed process) is not: the
  turn fails ``thread_start_failed`` and the binding to the base is kept (state is destroyed
  only on a definitive answer, never on a timeout).
* Codex's refusal quotes the item it could not parse; the reported error never does.
* A fork created before a failure or a cancellation is forgotten locally.
* An app-server that answers "method not found" stops offering the structured form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from support.fake_appserver import CodexScript, FakeAppServer
from support.recording_engine import RecordingEngine

from codex_turn.harness.appserver import (
    AppServer,
    AppServerClosed,
    AppServerConfig,
    AppServerError,
    AppServerRpcError,
    AppServerTimeout,
    ThreadSettings,
)
from codex_turn.harness.appserver.types import ThreadInfo, ThreadResult
from codex_turn.harness.binding import read_binding
from codex_turn.harness.turn.orchestrator import TurnParams, run_codex_turn
from codex_turn.harness.turn.structured import (
    ANCHOR,
    ForkFailed,
    PreparedFork,
    prepare_fork,
    supports_structured,
)

pytestmark = pytest.mark.anyio

ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}


class ForkingFake(FakeAppServer):
    """The fake app-server with fork and inject, failing as told."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fork_error: AppServerError | None = None
        self.inject_error: AppServerError | BaseException | None = None
        self.forks: list[str] = []
        self.injected: list[list[Mapping[str, Any]]] = []

    async def fork_thread(self, thread_id: str, settings: ThreadSettings) -> ThreadResult:
        if self.fork_error is not None:
            raise self.fork_error
        fork_id = f"fork-{len(self.forks) + 1}"
        self.forks.append(fork_id)
        return ThreadResult(thread=ThreadInfo(id=fork_id), model=settings.model or self.model)

    async def inject_items(self, thread_id: str, items: Sequence[Mapping[str, Any]]) -> None:
        if self.inject_error is not None:
            raise self.inject_error
        self.injected.append(list(items))


async def test_a_refusal_is_definitive_and_a_timeout_is_not() -> None:
    fake = ForkingFake()
    fake.fork_error = AppServerRpcError(-32600, "no rollout found for thread id base-1")
    refused = await prepare_fork(fake, "base-1", [ITEM])
    assert isinstance(refused, ForkFailed)
    assert refused.definitive
    fake.fork_error = AppServerTimeout("thread/fork timed out after 30s")
    timed_out = await prepare_fork(fake, "base-1", [ITEM])
    assert isinstance(timed_out, ForkFailed)
    assert not timed_out.definitive
    fake.fork_error = AppServerClosed("codex app-server closed")
    closed = await prepare_fork(fake, "base-1", [ITEM])
    assert isinstance(closed, ForkFailed)
    assert not closed.definitive


@pytest.mark.parametrize(
    ("refusal", "anchored"),
    [
        # A base without a rollout yet (loaded here, no turn or injection): anchored, forked.
        ("no rollout found for thread id base-1", True),
        # An id Codex cannot read: anchoring would not help.
        ("invalid session id: invalid character", False),
        ("expected active turn id nope but found base-1", False),
    ],
)
async def test_only_a_base_without_a_rollout_is_anchored(refusal: str, anchored: bool) -> None:
    fake = ForkingFake()
    fork = fake.fork_thread
    refusals = [AppServerRpcError(-32600, refusal, method="thread/fork")]

    async def refused_once(thread_id: str, settings: ThreadSettings) -> ThreadResult:
        if refusals:
            raise refusals.pop()
        return await fork(thread_id, settings)

    fake.fork_thread = refused_once  # type: ignore[method-assign]
    outcome = await prepare_fork(fake, "base-1", [ITEM])
    if anchored:
        assert isinstance(outcome, PreparedFork)
        assert outcome.anchored
        assert fake.injected[0] == [ANCHOR]
    else:
        assert isinstance(outcome, ForkFailed)
        assert (outcome.step, outcome.definitive) == ("fork", True)
        assert fake.injected == []


async def test_a_rejected_item_is_never_quoted_and_its_fork_is_forgotten() -> None:
    fake = ForkingFake()
    fake.inject_error = AppServerRpcError(
        -32600,
        'items[0] is not a valid response item: invalid type: string "Ana s4cret", expected a'
        " sequence",
    )
    failed = await prepare_fork(fake, "base-1", [ITEM])
    assert isinstance(failed, ForkFailed)
    assert failed.step == "inject"
    assert "items[0] is not a valid response item" in failed.error
    assert "s4cret" not in failed.error
    assert failed.fork_thread_id == "fork-1"
    assert fake.forgotten == ["fork-1"]


async def test_a_cancelled_injection_forgets_its_fork() -> None:
    fake = ForkingFake()
    fake.inject_error = anyio.get_cancelled_exc_class()()
    with pytest.raises(anyio.get_cancelled_exc_class()):
        await prepare_fork(fake, "base-1", [ITEM])
    assert fake.forgotten == ["fork-1"]


async def test_a_fork_injects_the_items_in_one_idle_fork() -> None:
    fake = ForkingFake()
    prepared = await prepare_fork(fake, "base-1", [ITEM, ITEM])
    assert isinstance(prepared, PreparedFork)
    assert prepared.fork_thread_id == "fork-1"
    assert fake.injected == [[ITEM, ITEM]]


@pytest.mark.parametrize(
    ("error", "outcome", "kept"),
    [
        (AppServerTimeout("thread/fork timed out"), "thread_start_failed", True),
        (AppServerClosed("codex app-server closed"), "thread_start_failed", True),
        (AppServerRpcError(-32600, "no rollout found for thread id base-1"), "completed", False),
    ],
)
async def test_a_turn_keeps_its_base_unless_codex_refused_it(
    tmp_path: Path, error: AppServerError, outcome: str, kept: bool
) -> None:
    session_file = tmp_path / "s.jsonl"
    engine = RecordingEngine()
    fake = ForkingFake(default=CodexScript())
    params = TurnParams(
        session_id="s", session_file=session_file, workspace_dir=tmp_path, prompt="hi"
    )
    # One turn binds a base (the fake forks); then the base is refused or does not answer.
    first = await run_codex_turn(params, app_server=fake, engine=engine)
    second_params = attrs.evolve(params, prompt="again")
    second = await run_codex_turn(second_params, app_server=fake, engine=engine)
    assert "thread_forked" in [e.trigger for e in second.trace], (first.trace, second.trace)
    base = read_binding(session_file, session_id="s")
    assert base is not None
    assert base.fork_base
    fake.fork_error = error
    third = await run_codex_turn(
        attrs.evolve(params, prompt="third"), app_server=fake, engine=engine
    )
    assert third.outcome.value == outcome
    after = read_binding(session_file, session_id="s")
    assert after is not None
    assert (after.thread_id == base.thread_id) is kept
    triggers = [e.trigger for e in third.trace]
    if kept:
        assert "fork_failed" not in triggers
    else:
        assert triggers.count("fork_failed") == 1
        assert "reprojected" in triggers
        assert not after.fork_base  # a fresh thread with the text frame


def test_method_not_found_turns_the_structured_form_off(tmp_path: Path) -> None:
    server = AppServer(AppServerConfig.offline(tmp_path / "home", "http://127.0.0.1:9/v1"))
    assert supports_structured(server)
    with pytest.raises(AppServerRpcError), server._learning_structured():
        raise AppServerRpcError(-32601, "method not found: thread/inject_items")
    assert server.can_fork is False
    assert not supports_structured(server)
    # Any other refusal teaches nothing.
    other = AppServer(AppServerConfig.offline(tmp_path / "home2", "http://127.0.0.1:9/v1"))
    with pytest.raises(AppServerRpcError), other._learning_structured():
        raise AppServerRpcError(-32600, "items must not be empty")
    assert supports_structured(other)


def test_kept_forks_are_one_per_base_in_a_bounded_lru(tmp_path: Path) -> None:
    from codex_turn.harness.appserver import KeptFork
    from codex_turn.harness.turn.structured import drop_kept_fork

    server = AppServer(
        AppServerConfig.offline(tmp_path / "home", "http://127.0.0.1:9/v1"), max_kept_forks=2
    )
    released: list[str] = []
    server.release_fork = released.append  # type: ignore[method-assign]

    def kept(base: str, fork: str) -> KeptFork:
        return KeptFork(
            base_thread_id=base, fork_thread_id=fork, holds=(), settings="s", completed=True
        )

    server.keep_fork(kept("b1", "f1"))
    server.keep_fork(kept("b1", "f2"))  # replaces (and releases) the one kept for b1
    assert released == ["f1"]
    server.keep_fork(kept("b2", "f3"))
    server.keep_fork(kept("b3", "f4"))  # beyond 2: the least recently kept goes
    assert released == ["f1", "f2"]
    assert server.kept_fork("b2") == kept("b2", "f3")  # a look leaves it kept
    assert server.take_kept_fork("b2") == kept("b2", "f3")  # taken: no longer kept
    assert server.take_kept_fork("b2") is None
    assert drop_kept_fork(server, "b3")
    assert released == ["f1", "f2", "f4"]
    assert not drop_kept_fork(server, "b3")
    none = AppServer(
        AppServerConfig.offline(tmp_path / "home2", "http://127.0.0.1:9/v1"), max_kept_forks=0
    )
    none.release_fork = released.append  # type: ignore[method-assign]
    none.keep_fork(kept("b9", "f9"))  # keeps nothing: released at once
    assert released[-1] == "f9"
    assert none.kept_fork("b9") is None
    with pytest.raises(ValueError, match="max_kept_forks"):
        AppServer(
            AppServerConfig.offline(tmp_path / "home3", "http://127.0.0.1:9/v1"),
            max_kept_forks=-1,
        )
