"""The login check at start: no credentials fail in seconds, not at turn_timeout.

Against the real binary: an empty CODEX_HOME with Codex's default (OpenAI) configuration is
refused with :class:`CodexLoginRequired` right after ``initialize``, before any thread or
model request, with nothing reaching the internet (every proxy variable points at the offline
model's 403 trap, plugins are off, and the parent's environment is not inherited, so no stray
credential or proxy setting leaks in). A home with a stored API key, the offline provider
(also with an ``env_key`` whose variable is unset) and ``login_check=False`` all start. The
decision itself (:class:`AccountState`, skipping a binary that cannot answer) is unit-tested
on an in-process fake.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from codex_turn.harness.appserver import AppServer, AppServerConfig, ModelProviderConfig
from codex_turn.harness.appserver.account import AccountState, should_check
from codex_turn.harness.appserver.errors import (
    AppServerClosed,
    AppServerStartError,
    CodexLoginRequired,
)
from codex_turn.testing import OfflineModel

pytestmark = pytest.mark.both_backends

SECRET = "sk-proj-NOT-A-REAL-KEY-0123456789abcdef"
FAST_S = 10.0  # the check answers in milliseconds; a start is about 0.2 s


def user_config(
    codex_home: Path, home: Path, model: OfflineModel, codex_binary: Path, **kwargs: Any
) -> AppServerConfig:
    """The user's own (default, OpenAI) configuration, with the network sealed off."""
    env = dict(model.proxy_env())
    env["PATH"] = os.defpath
    env.update(kwargs.pop("env", {}))
    return AppServerConfig.user(
        codex_home,
        codex_bin=codex_binary,
        home=home,
        env=env,
        inherit_env=False,
        config_overrides={"features.plugins": False, "analytics.enabled": False},
        request_timeout=10.0,
        **kwargs,
    )


@pytest.fixture
def homes(tmp_path: Path) -> tuple[Path, Path]:
    codex_home, home = tmp_path / "codex_home", tmp_path / "home"
    codex_home.mkdir()
    home.mkdir()
    return codex_home, home


@pytest.mark.anyio
async def test_no_credentials_fail_at_start_in_seconds(
    homes: tuple[Path, Path], offline_model: OfflineModel, codex_binary: Path
) -> None:
    codex_home, home = homes
    # An API key in the environment is not a login for codex app-server (and must not leak).
    config = user_config(
        codex_home, home, offline_model, codex_binary, env={"OPENAI_API_KEY": SECRET}
    )
    started = time.monotonic()
    with capture_logs() as records, pytest.raises(CodexLoginRequired) as caught:
        async with AppServer.start(config) as server:
            await server.start_thread()  # never reached
    elapsed = time.monotonic() - started
    assert elapsed < FAST_S, f"took {elapsed:.1f}s"
    error = caught.value
    assert isinstance(error, AppServerStartError)
    assert error.codex_home == codex_home
    text = str(error)
    assert "codex login" in text
    assert str(codex_home) in text
    assert "--with-api-key" in text
    assert SECRET not in text
    assert SECRET not in repr(records)
    assert any(r["event"] == "appserver.login_check" for r in records)
    # Nothing was attempted: no model request, no CONNECT through the proxy trap.
    assert offline_model.requests == []
    assert offline_model.proxy_attempts == []


@pytest.mark.anyio
async def test_a_stored_api_key_passes_the_check(
    homes: tuple[Path, Path], offline_model: OfflineModel, codex_binary: Path
) -> None:
    codex_home, home = homes
    (codex_home / "auth.json").write_text(json.dumps({"OPENAI_API_KEY": SECRET}))
    (codex_home / "auth.json").chmod(0o600)
    config = user_config(codex_home, home, offline_model, codex_binary)
    with capture_logs() as records:
        async with AppServer.start(config, record_sent=True) as server:
            assert server.current is not None
    assert [m["method"] for m in server.sent if "id" in m] == ["initialize", "account/read"]
    checks = [r for r in records if r["event"] == "appserver.login_check"]
    assert [(r["openai_login_required"], r["account_type"]) for r in checks] == [(True, "apiKey")]
    assert SECRET not in repr(records)
    # A logged-in Codex refreshes its model list from OpenAI at startup by itself (with or
    # without the check): those calls end in the proxy trap (403), never on the internet.
    assert all(a.startswith("CONNECT ") for a in offline_model.proxy_attempts)


@pytest.mark.anyio
async def test_the_offline_provider_is_never_refused(
    make_appserver_config: Callable[..., AppServerConfig], offline_model: OfflineModel
) -> None:
    """No OpenAI auth needed, also with an ``env_key`` whose variable is missing (a turn would
    fail on its own, at once, with Codex's "Missing environment variable")."""
    provider = ModelProviderConfig(base_url=offline_model.base_url, env_key="CODEX_TURN_NO_SUCH")
    with capture_logs() as records:
        async with AppServer.start(make_appserver_config(provider=provider)) as server:
            await server.start_thread()
    checks = [r for r in records if r["event"] == "appserver.login_check"]
    assert [(r["openai_login_required"], r["account_type"]) for r in checks] == [(False, None)]


@pytest.mark.anyio
async def test_login_check_false_keeps_the_old_behaviour(
    homes: tuple[Path, Path], offline_model: OfflineModel, codex_binary: Path
) -> None:
    codex_home, home = homes
    config = user_config(codex_home, home, offline_model, codex_binary, login_check=False)
    async with AppServer.start(config, record_sent=True) as server:
        assert server.current is not None  # started: the login is not asked about
    assert [m["method"] for m in server.sent if "id" in m] == ["initialize"]


# --- the decision, on a fake --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "state", "missing"),
    [
        ({"account": None, "requiresOpenaiAuth": True}, AccountState(True, None), True),
        ({"account": None, "requiresOpenaiAuth": False}, AccountState(False, None), False),
        (
            {"account": {"type": "apiKey"}, "requiresOpenaiAuth": True},
            AccountState(True, "apiKey"),
            False,
        ),
        (
            {
                "account": {"type": "chatgpt", "email": "me@example.com", "planType": "plus"},
                "requiresOpenaiAuth": True,
            },
            AccountState(True, "chatgpt"),
            False,
        ),
        ({"account": {}, "requiresOpenaiAuth": True}, AccountState(True, "unknown"), False),
        ({}, AccountState(False, None), False),
        (None, AccountState(False, None), False),
    ],
)
def test_account_state(raw: Any, state: AccountState, missing: bool) -> None:
    assert AccountState.from_response(raw) == state
    assert state.login_missing is missing


def test_when_the_check_runs(tmp_path: Path) -> None:
    real = AppServerConfig.user(tmp_path)
    assert should_check(real, injected_transport=False)
    assert not should_check(real, injected_transport=True)
    assert not should_check(
        AppServerConfig.user(tmp_path, command=("x",)), injected_transport=False
    )
    forced = AppServerConfig.user(tmp_path, command=("x",), login_check=True)
    assert should_check(forced, injected_transport=True)
    off = AppServerConfig.user(tmp_path, login_check=False)
    assert not should_check(off, injected_transport=False)


class AccountCodex:
    """Just enough of Codex: ``initialize`` and a scripted ``account/read`` answer."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self._out, self._in = anyio.create_memory_object_stream[bytes](math.inf)
        self.answer = answer
        self.returncode: int | None = None

    async def send_line(self, line: bytes) -> None:
        message = json.loads(line)
        if "id" not in message:
            return
        if message["method"] == "initialize":
            reply: dict[str, Any] = {"result": {"userAgent": "fake/1"}}
        else:
            reply = self.answer
        self._out.send_nowait(json.dumps({"id": message["id"], **reply}).encode())

    async def receive_line(self) -> bytes:
        try:
            return await self._in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise AppServerClosed("fake codex exited") from None

    async def run_background(self) -> None:
        return

    async def aclose(self) -> None:
        self._out.close()

    def kill(self) -> None:
        self._out.close()


async def start_on(answer: dict[str, Any], tmp_path: Path) -> AppServer:
    config = AppServerConfig(codex_home=tmp_path, write_config=False, login_check=True)

    async def factory(_: AppServerConfig) -> AccountCodex:
        return AccountCodex(answer)

    async with AppServer.start(config, transport_factory=factory) as server:
        return server


@pytest.mark.anyio
async def test_a_missing_login_is_refused_on_a_fake(tmp_path: Path) -> None:
    with pytest.raises(CodexLoginRequired):
        await start_on({"result": {"account": None, "requiresOpenaiAuth": True}}, tmp_path)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "answer",
    [
        {"error": {"code": -32601, "message": "method not found"}},  # an older binary
        {"result": {"account": {"type": "apiKey"}, "requiresOpenaiAuth": True}},
    ],
)
async def test_what_the_binary_cannot_refuse_starts(answer: dict[str, Any], tmp_path: Path) -> None:
    with capture_logs() as records:
        await start_on(answer, tmp_path)
    events = {r["event"] for r in records}
    assert events & {"appserver.login_check", "appserver.login_check_skipped"}
