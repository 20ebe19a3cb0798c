"""The login check made when an app-server process starts: fail in seconds, not at a timeout.

Without credentials, a configuration that talks to OpenAI (the built-in ``openai`` provider)
does not fail a turn: Codex retries ``api.openai.com`` until the turn times out (ten minutes
by default). So right after ``initialize`` the manager asks the binary itself, with
``account/read`` (schema ``GetAccountParams``/``GetAccountResponse``, Codex 0.163.0):

* ``requiresOpenaiAuth`` is ``false`` (any custom ``model_providers`` entry, as in
  ``AppServerConfig.offline()``, with or without ``env_key``): nothing to check;
* it is ``true`` and ``account`` is an account (``apiKey``, ``chatgpt``,
  ``amazonBedrock``): logged in;
* it is ``true`` and ``account`` is ``null``: :class:`~.errors.CodexLoginRequired`, whose
  message names ``codex login`` and the CODEX_HOME in use.

``refreshToken`` is never sent, so the check makes no network call (it is answered from the
home's ``auth.json`` in about 2 ms). ``OPENAI_API_KEY`` in the environment is not a login for
``codex app-server`` (measured: no ``Authorization`` header is sent), so it does not pass the
check; ``codex login --with-api-key`` stores one. A binary that does not know the method (an
older or a fake app-server), or does not answer in time, is not refused: the check is logged
as skipped. Nothing about the account is logged but its type (never the e-mail address).

When it runs (:attr:`~.config.AppServerConfig.login_check`): ``None`` (the default) checks
every process the library spawns from the real binary, and skips injected transports and
``command`` replacements (test doubles); ``True``/``False`` force it on or off.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from codex_turn._log import format_error, get_logger

from .config import AppServerConfig
from .errors import AppServerRpcError, AppServerTimeout, CodexLoginRequired
from .logsafe import capped

__all__ = ["ACCOUNT_READ", "AccountState", "check_login"]

log = get_logger(__name__)

ACCOUNT_READ = "account/read"
LOGIN_CHECK_TIMEOUT_S = 10.0
"""The longest the check waits for ``account/read`` (it answers in milliseconds)."""


class _Requester(Protocol):
    async def request(
        self,
        method: str,
        params: Any = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any: ...


@attrs.frozen
class AccountState:
    """What ``account/read`` says: whether OpenAI auth is needed, and the account's type
    (``"apiKey"``, ``"chatgpt"``, ``"amazonBedrock"``, ...; ``None``: no account)."""

    requires_openai_auth: bool
    account_type: str | None = None

    @property
    def login_missing(self) -> bool:
        return self.requires_openai_auth and self.account_type is None

    @classmethod
    def from_response(cls, raw: Any) -> AccountState:
        """Read a ``GetAccountResponse`` leniently (unknown fields are ignored)."""
        body = raw if isinstance(raw, dict) else {}
        account = body.get("account")
        kind: str | None = None
        if isinstance(account, dict):
            kind = str(account.get("type") or "unknown")
        elif account is not None:
            kind = "unknown"
        return cls(bool(body.get("requiresOpenaiAuth", False)), kind)


def should_check(config: AppServerConfig, *, injected_transport: bool) -> bool:
    """Whether the login check runs for a process started with ``config``."""
    if config.login_check is not None:
        return config.login_check
    return not injected_transport and config.command is None


async def check_login(client: _Requester, config: AppServerConfig) -> AccountState | None:
    """Ask the running app-server for its account state; raise
    :class:`~.errors.CodexLoginRequired` when a login is needed and missing.

    Returns the state, or ``None`` when the binary could not say (logged, not refused)."""
    timeout = min(config.request_timeout, LOGIN_CHECK_TIMEOUT_S)
    try:
        raw = await client.request(ACCOUNT_READ, {}, timeout=timeout)
    except (AppServerRpcError, AppServerTimeout) as exc:
        log.warning("appserver.login_check_skipped", error=format_error(exc))
        return None
    state = AccountState.from_response(raw)
    log.info(
        "appserver.login_check",
        openai_login_required=state.requires_openai_auth,
        account_type=capped(state.account_type, 40),
    )
    if state.login_missing:
        raise CodexLoginRequired(config.codex_home)
    return state
