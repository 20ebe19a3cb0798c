"""ThreadSettings: one value for what a thread is started, resumed or forked with, and what
each request sends of it (the wire names, ``None`` omitted, the per-request table)."""

from __future__ import annotations

from typing import Any

import attrs

from codex_turn.harness.appserver import ThreadSettings, tool
from codex_turn.harness.appserver.thread_settings import RUNTIME_POLICY


@tool("lookup", "look up")
async def _lookup(args: Any) -> str:
    return "x"


EVERYTHING = ThreadSettings(
    developer_instructions="dev",
    cwd="/w",
    model="m",
    tools=[_lookup],
    approval_policy="never",
    sandbox="read-only",
    approvals_reviewer="user",
    service_tier="flex",
    base_instructions="base",
    model_provider="p",
    personality="friendly",
)


def test_a_start_sends_every_setting_under_its_wire_name() -> None:
    wire = EVERYTHING.wire("thread/start")
    assert wire == {
        "developerInstructions": "dev",
        "cwd": "/w",
        "model": "m",
        "dynamicTools": [
            {
                "name": "lookup",
                "description": "look up",
                "inputSchema": wire["dynamicTools"][0]["inputSchema"],
                "type": "function",
            }
        ],
        "approvalPolicy": "never",
        "sandbox": "read-only",
        "approvalsReviewer": "user",
        "serviceTier": "flex",
        "baseInstructions": "base",
        "modelProvider": "p",
        "personality": "friendly",
    }


def test_a_resume_sends_no_tools_and_a_fork_only_what_it_uses() -> None:
    start = EVERYTHING.wire("thread/start")
    assert EVERYTHING.wire("thread/resume") == {
        k: v for k, v in start.items() if k != "dynamicTools"
    }
    assert EVERYTHING.wire("thread/fork") == {
        "developerInstructions": "dev",
        "cwd": "/w",
        "model": "m",
        "approvalsReviewer": "user",
        "serviceTier": "flex",
    }


def test_unset_settings_and_an_empty_tool_set_are_not_sent() -> None:
    assert ThreadSettings().wire("thread/start") == {"personality": "none"}
    assert ThreadSettings(tools=[]).wire("thread/start") == {"personality": "none"}
    assert ThreadSettings().wire("thread/fork") == {}


def test_the_runtime_policy_keeps_only_its_fields() -> None:
    policy = EVERYTHING.runtime_policy()
    assert attrs.asdict(policy, recurse=False) == {
        **attrs.asdict(ThreadSettings(), recurse=False),
        **{name: getattr(EVERYTHING, name) for name in RUNTIME_POLICY},
    }
    assert policy.developer_instructions is None
    assert policy.approvals_reviewer == "user"


def test_neutral_instructions_change_the_key_and_nothing_else() -> None:
    neutral = attrs.evolve(EVERYTHING, developer_instructions=None)
    assert neutral.key != EVERYTHING.key
    assert neutral.tools is EVERYTHING.tools
    assert "developerInstructions" not in neutral.wire("thread/fork")
