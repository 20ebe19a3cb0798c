"""Native hooks: which hook events a thread gets, and what each hook call answers Codex.

Rule 1: the decisions live here, as rule tables (:func:`codex_turn.fsm.thread.decide`).
:mod:`codex_turn.harness.appserver.native_hooks` injects the per-thread hook config, relays
each hook call to the host's typed callback and writes back the answer these tables choose;
it never chooses itself. Rule 2: no I/O, nothing of Codex's wording.

Theory. Codex runs command hooks at PreToolUse, PostToolUse, PermissionRequest and Stop; the
host injects them per thread (no global or project ``hooks.json``), and each one calls the
host back. Which events are injected (:data:`INJECT_RULES`): all the host asks for, except
PermissionRequest while app-server approvals are on (``approvalPolicy`` not ``never``: the
host answers those approvals already), unless the host lists it explicitly.

What a call answers (:data:`ANSWER_RULES`), in order:

* a PermissionRequest whose exact fingerprint (session, tool, input, cwd) the host allowed
  "always" within the window: allow, without asking again;
* a callback that failed or did not answer in time: a PreToolUse is *blocked* (fail
  closed: the tool must not run unchecked), anything else gets no decision;
* a PreToolUse the host wants approved while the hooks run in *report* mode: no native
  decision, the requirement is recorded (``defer``) and the app-server approval Codex sends
  for the same tool use opens the host's approval;
* an explicit deny: PreToolUse blocked, PermissionRequest denied, Stop continued (the turn
  goes on with the host's reason); an explicit allow of a PermissionRequest: allowed;
* anything else: *no decision*, which is never an allow: Codex continues on its own path
  (its guardian or its user for a PermissionRequest, the tool for a PreToolUse).
"""

from __future__ import annotations

import enum

import attrs

from codex_turn.fsm.thread import Choice, Rule

__all__ = [
    "ANSWER_RULES",
    "INJECT_RULES",
    "AnswerFacts",
    "HookAnswer",
    "HookEvent",
    "InjectFacts",
    "Injection",
]


class HookEvent(enum.StrEnum):
    """The hook events the host relays (Codex's names, as its config spells them)."""

    PRE_TOOL_USE = "PreToolUse"
    POST_TOOL_USE = "PostToolUse"
    PERMISSION_REQUEST = "PermissionRequest"
    STOP = "Stop"


class Injection(enum.Enum):
    INJECT = "inject"
    OMIT = "omit"


class HookAnswer(enum.Enum):
    NO_DECISION = "no_decision"  # Codex continues on its own path
    BLOCK_TOOL = "block_tool"  # PreToolUse: the tool does not run
    ALLOW = "allow"  # PermissionRequest: allowed
    DENY = "deny"  # PermissionRequest: denied
    CONTINUE_TURN = "continue_turn"  # Stop: the turn goes on
    DEFER = "defer"  # report mode: the app-server approval decides


@attrs.frozen
class InjectFacts:
    event: HookEvent
    approvals_on: bool  # approvalPolicy is not "never"
    listed: bool  # the host listed this event explicitly

    @property
    def permission_request(self) -> bool:
        return self.event is HookEvent.PERMISSION_REQUEST


INJECT_RULES: tuple[Rule[Choice[Injection]], ...] = (
    Rule(
        Choice(Injection.OMIT, "app-server-approvals-answer-permission-requests"),
        when=("permission_request", "approvals_on"),
        unless=("listed",),
    ),
    Rule(Choice(Injection.INJECT, "requested")),
)


@attrs.frozen
class AnswerFacts:
    event: HookEvent
    allowed: bool = False  # the callback said allow
    denied: bool = False  # the callback said deny
    needs_approval: bool = False  # the callback asked for the host's approval
    failed: bool = False  # the callback raised or did not answer in time
    remembered: bool = False  # an allow-always of this exact fingerprint is in its window
    report_mode: bool = False  # the hooks run in report mode
    traceable: bool = True  # the call names its tool use (an approval can be matched to it)

    @property
    def pre_tool_use(self) -> bool:
        return self.event is HookEvent.PRE_TOOL_USE

    @property
    def permission_request(self) -> bool:
        return self.event is HookEvent.PERMISSION_REQUEST

    @property
    def stop(self) -> bool:
        return self.event is HookEvent.STOP


A = HookAnswer

ANSWER_RULES: tuple[Rule[Choice[HookAnswer]], ...] = (
    Rule(Choice(A.ALLOW, "allowed-always"), when=("permission_request", "remembered")),
    Rule(Choice(A.BLOCK_TOOL, "callback-failed"), when=("pre_tool_use", "failed")),
    Rule(Choice(A.NO_DECISION, "callback-failed"), when=("failed",)),
    Rule(
        Choice(A.DEFER, "report-mode-approval"),
        when=("pre_tool_use", "report_mode", "needs_approval", "traceable"),
    ),
    # Approval asked for and no approval that can be matched to the call: the tool waits
    # for nobody, so it does not run (no decision is never an allow).
    Rule(Choice(A.BLOCK_TOOL, "needs-approval"), when=("pre_tool_use", "needs_approval")),
    Rule(Choice(A.BLOCK_TOOL, "denied"), when=("pre_tool_use", "denied")),
    Rule(Choice(A.DENY, "denied"), when=("permission_request", "denied")),
    Rule(Choice(A.ALLOW, "allowed"), when=("permission_request", "allowed")),
    Rule(Choice(A.CONTINUE_TURN, "stop-denied"), when=("stop", "denied")),
    Rule(Choice(A.NO_DECISION, "no-decision")),
)
