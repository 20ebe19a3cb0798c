"""Test kit for context-engine authors: run the *real* ``codex app-server`` with no network.

Everything here is public and meant for code that tests an engine (or the harness itself)
end to end: :class:`OfflineModel` is a local, scriptable Responses-API server on
``127.0.0.1`` that the real binary talks to instead of OpenAI (point
``AppServerConfig.offline(home, model.base_url)`` at it). It records every request Codex
sends (:class:`RecordedRequest`: developer and user messages, tools, function-call outputs,
turn or compaction), answers each from a FIFO script of :class:`Reply` values (echo by
default), and traps any attempt to reach the internet through the proxy variables
(:meth:`OfflineModel.proxy_env`, :attr:`OfflineModel.proxy_attempts`).

Nothing in the product imports this package; it has no dependencies beyond the library's.

Usage sketch::

    with running_model() as model:
        model.script(Reply.fixed("hello"))
        async with AppServer.start(AppServerConfig.offline(home, model.base_url,
                                                           env=model.proxy_env())) as server:
            ...
        assert model.turn_requests()[-1].last_user_text == "hi"
        assert model.proxy_attempts == []
"""

from __future__ import annotations

from .offline_model import OfflineModel, RecordedRequest, Reply, ReplyKind, running_model

__all__ = ["OfflineModel", "RecordedRequest", "Reply", "ReplyKind", "running_model"]
