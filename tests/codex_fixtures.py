"""Pytest fixtures for end-to-end tests against the real Codex app-server binary.

Registered by ``tests/conftest.py`` (``pytest_plugins = ["codex_fixtures"]``). Nothing here
skips: if the pinned binary (``openai-codex-cli-bin``) is missing, every fixture that needs it
**fails** loudly, because a silently skipped end-to-end suite proves nothing.

Fixtures
--------
``codex_binary`` (session)
    Path of the pinned ``codex`` binary.
``codex_schema_dir`` (session)
    ``codex app-server generate-json-schema --experimental --out DIR``, generated once.
``codex_schema`` (session)
    A :class:`CodexSchema` that validates client messages (requests, notifications, responses
    to server requests) against that schema: ``codex_schema.validate_sent(messages)``.
``offline_model`` (function)
    A started :class:`~codex_turn.testing.OfflineModel` (closed afterwards).
``workspace`` (function)
    An empty directory to use as the thread ``cwd``.
``make_appserver_config`` (function)
    ``make_appserver_config(**overrides) -> AppServerConfig``: an offline config pointing at
    ``offline_model``, with the proxy variables routed into its 403 trap and a **fresh private
    CODEX_HOME per call** (so no two processes ever start at once on one fresh home). Pass
    ``codex_home=cfg.codex_home`` to reuse a home that a finished process already initialised
    (e.g. to resume a thread in a fresh process).
``appserver`` (function, async; use with ``@pytest.mark.anyio``)
    A started :class:`~codex_turn.harness.appserver.AppServer` on that config, recording every
    message it sends in ``appserver.sent``.

The tests run on the anyio pytest plugin: mark async tests ``@pytest.mark.anyio``. They run on
asyncio (``anyio_backend`` in ``tests/conftest.py``); a module marked
``pytest.mark.both_backends`` runs each of its async tests on asyncio *and* trio.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from codex_turn.harness.appserver import AppServer, AppServerConfig
from codex_turn.testing import OfflineModel

__all__ = ["CodexSchema"]


@pytest.fixture(scope="session")
def codex_binary() -> Path:
    try:
        import codex_cli_bin
    except ImportError:
        pytest.fail(
            "openai-codex-cli-bin==0.163.0 is not installed: the end-to-end tests need the real "
            "binary (pip install -e '.[codex]'); they are never skipped",
            pytrace=False,
        )
    path = Path(codex_cli_bin.bundled_codex_path())
    if not path.is_file() or not os.access(path, os.X_OK):
        pytest.fail(f"the Codex binary is missing or not executable: {path}", pytrace=False)
    return path


@pytest.fixture(scope="session")
def codex_schema_dir(codex_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("codex_schema")
    out = root / "schema"
    env = dict(os.environ, HOME=str(root), CODEX_HOME=str(root / "codex_home"))
    (root / "codex_home").mkdir()
    proc = subprocess.run(
        [
            str(codex_binary),
            "app-server",
            "generate-json-schema",
            "--experimental",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0 or not (out / "ClientRequest.json").is_file():
        pytest.fail(f"generate-json-schema failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return out


class CodexSchema:
    """Validators built from the binary's own generated JSON schema."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._validators: dict[str, Any] = {}
        request = json.loads((root / "ClientRequest.json").read_text())
        self.client_methods = {o["properties"]["method"]["enum"][0] for o in request["oneOf"]}
        server = json.loads((root / "ServerRequest.json").read_text())
        self._server_request_types = {
            o["properties"]["method"]["enum"][0]: o["properties"]["params"]["$ref"].split("/")[-1]
            for o in server["oneOf"]
        }

    def validator(self, name: str) -> Any:
        if name not in self._validators:
            path = self.root / f"{name}.json"
            if not path.is_file():
                path = self.root / "v2" / f"{name}.json"
            schema = json.loads(path.read_text())
            cls = jsonschema.validators.validator_for(schema)
            cls.check_schema(schema)
            self._validators[name] = cls(schema)
        return self._validators[name]

    def response_schema_for(self, server_method: str) -> str:
        """``item/tool/call`` -> ``DynamicToolCallResponse`` (Params -> Response)."""
        params = self._server_request_types[server_method]
        return params.removesuffix("Params") + "Response"

    def validate_request(self, message: Mapping[str, Any]) -> None:
        self.validator("ClientRequest").validate(dict(message))

    def validate_notification(self, message: Mapping[str, Any]) -> None:
        self.validator("ClientNotification").validate(dict(message))

    def validate_response(self, result: Any, server_method: str) -> None:
        self.validator(self.response_schema_for(server_method)).validate(result)

    def validate_sent(
        self, messages: Iterable[Mapping[str, Any]], server_methods: Mapping[Any, str]
    ) -> dict[str, int]:
        """Validate every sent message; ``server_methods`` maps server-request ids to their
        methods (for responses). Returns a count per kind/method."""
        counts: dict[str, int] = {}
        for message in messages:
            if "method" in message and "id" in message:
                self.validate_request(message)
                key = str(message["method"])
            elif "method" in message:
                self.validate_notification(message)
                key = f"notify:{message['method']}"
            else:
                method = server_methods[message["id"]]
                assert "result" in message, f"error response sent for {method}"
                self.validate_response(message["result"], method)
                key = f"respond:{method}"
            counts[key] = counts.get(key, 0) + 1
        return counts


@pytest.fixture(scope="session")
def codex_schema(codex_schema_dir: Path) -> CodexSchema:
    return CodexSchema(codex_schema_dir)


@pytest.fixture
def offline_model() -> Iterator[OfflineModel]:
    with OfflineModel() as model:
        yield model


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
def make_appserver_config(
    tmp_path: Path, offline_model: OfflineModel, codex_binary: Path
) -> Callable[..., AppServerConfig]:
    counter = itertools.count(1)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)

    def make(**overrides: Any) -> AppServerConfig:
        codex_home = overrides.pop("codex_home", None) or tmp_path / f"codex_home_{next(counter)}"
        env = dict(offline_model.proxy_env())
        env.update(overrides.pop("env", {}))
        overrides.setdefault("codex_bin", codex_binary)
        overrides.setdefault("home", home)
        overrides.setdefault("request_timeout", 30.0)
        return AppServerConfig.offline(codex_home, offline_model.base_url, env=env, **overrides)

    return make


@pytest.fixture
async def appserver(
    make_appserver_config: Callable[..., AppServerConfig],
) -> AsyncIterator[AppServer]:
    async with AppServer.start(make_appserver_config(), record_sent=True) as server:
        yield server
