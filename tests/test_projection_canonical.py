"""Every JSON text a projection renders is canonical: key order is not part of the input.

Codex's prompt cache keys on the bytes of the turn text, so the same logical history must
project to the same bytes however its mappings happen to be ordered (an engine that rebuilds a
message, a JSON round trip through another runtime ...). The thread-bootstrap projection renders
tool-call shapes and tool results as JSON; that JSON has its keys sorted at every depth, fixed
separators and non-ASCII kept as is, and secrets are still masked in it.
"""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from codex_turn.projection import (
    project_context_engine_assembly,
    project_thread_bootstrap_assembly,
    render_message,
)
from codex_turn.projection.payload import input_shape, redacted_payload, render_json

PROJECTIONS = (project_context_engine_assembly, project_thread_bootstrap_assembly)

# Secret-shaped texts; each must be masked wherever it is planted (key or value).
SECRETS = (
    "sk-live-abcdefghijklmnopqrstuvwxyz",
    "sk-live-zyxwvutsrqponmlkjihgfedcba",
    "ghp_0123456789abcdefghijABCDEFGHIJ",
    "AKIAIOSFODNN7EXAMPLE",
)

plain_text = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="[]"), max_size=12
)
# Keys that collide once redacted (two secrets, two ``token=`` assignments, ``1`` and ``"1"``)
# next to ordinary ones: the surviving entry must not depend on which came first.
keys = st.one_of(
    plain_text,
    st.sampled_from(
        [*SECRETS, "token=abc", "token=xyz", "apiKey", "password", "type", "id", "1", "é"]
    ),
    st.integers(0, 2),
)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    plain_text,
    st.sampled_from(SECRETS),
)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(keys, inner, min_size=1, max_size=4)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(keys, json_values, max_size=5)
call_ids = st.sampled_from(["call-1", "call-2", "toolu_01"])


def _with_extra(base: dict[str, Any], extra: dict[Any, Any]) -> dict[Any, Any]:
    return {**extra, **base}


text_parts = st.builds(lambda t: {"type": "text", "text": t}, plain_text)
pi_tool_calls = st.builds(
    lambda i, name, args, extra: _with_extra(
        {"type": "toolCall", "id": i, "name": name, "arguments": args}, extra
    ),
    call_ids,
    st.sampled_from(["exec", "read", "write"]),
    json_objects,
    st.dictionaries(st.sampled_from(["callId", "toolCallId", "partialJson"]), json_values),
)
tool_uses = st.builds(
    lambda i, name, args: {"type": "tool_use", "id": i, "name": name, "input": args},
    call_ids,
    st.sampled_from(["exec", "grep"]),
    json_objects,
)
tool_result_blocks = st.one_of(
    st.builds(
        lambda i, content, extra: _with_extra(
            {"type": "toolResult", "toolUseId": i, "content": content}, extra
        ),
        call_ids,
        st.one_of(json_values, st.lists(text_parts, max_size=2)),
        st.dictionaries(st.sampled_from(["isError", "details", "meta"]), json_values),
    ),
    st.builds(
        lambda i, content: {"type": "tool_result", "tool_use_id": i, "content": content},
        call_ids,
        json_values,
    ),
)
assistant_messages = st.fixed_dictionaries(
    {
        "role": st.just("assistant"),
        "content": st.lists(st.one_of(text_parts, pi_tool_calls, tool_uses), max_size=4),
    },
    optional={"usage": json_objects, "timestamp": st.integers(0, 2**40)},
)
user_messages = st.fixed_dictionaries(
    {
        "role": st.just("user"),
        "content": st.lists(st.one_of(text_parts, tool_result_blocks), max_size=3),
    },
    optional={"timestamp": st.integers(0, 2**40)},
)
# A pi ``toolResult`` message: text parts plus JSON-ish details and blocks.
tool_result_messages = st.fixed_dictionaries(
    {
        "role": st.just("toolResult"),
        "toolCallId": call_ids,
        "content": st.lists(st.one_of(text_parts, tool_result_blocks), max_size=3),
    },
    optional={"toolName": st.just("exec"), "details": json_values, "isError": st.booleans()},
)
histories = st.lists(
    st.one_of(assistant_messages, user_messages, tool_result_messages), min_size=1, max_size=6
)


def permuted(value: Any, rng: random.Random) -> Any:
    """``value`` with the keys of every mapping, at every depth, in a shuffled order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: permuted(v, rng) for k, v in items}
    if isinstance(value, list):
        return [permuted(v, rng) for v in value]
    return value


def reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(v) for v in value]
    return value


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, indent=2, separators=(",", ": "), ensure_ascii=False)


# --- the property -------------------------------------------------------------------------


@settings(max_examples=200)
@given(histories, st.randoms(use_true_random=False), st.sampled_from([None, 1_000_000]))
def test_key_order_never_changes_the_projected_bytes(
    assembled: list[Any], rng: random.Random, budget: int | None
) -> None:
    shuffled = permuted(assembled, rng)
    assert shuffled == assembled  # the same logical history
    for project in PROJECTIONS:
        outputs = [
            project(
                assembled_messages=history,
                original_history_messages=[],
                prompt="continue",
                token_budget=budget,
            ).prompt_text.encode("utf-8")
            for history in (assembled, shuffled, reversed_keys(assembled))
        ]
        assert outputs[0] == outputs[1] == outputs[2], project.__name__
        text = outputs[0].decode("utf-8")
        for secret in SECRETS:
            assert secret not in text


@given(json_values, st.randoms(use_true_random=False))
def test_payload_json_is_canonical_and_order_free(value: Any, rng: random.Random) -> None:
    shuffled = permuted(value, rng)
    for transform in (input_shape, redacted_payload):
        rendered = render_json(transform(value))
        assert rendered == render_json(transform(shuffled))
        assert rendered == canonical(json.loads(rendered))
        for secret in SECRETS:
            assert secret not in rendered


# --- examples -----------------------------------------------------------------------------


def test_a_preserved_tool_call_renders_sorted_indented_json() -> None:
    part = {
        "type": "toolCall",
        "name": "exec",
        "id": "c1",
        "arguments": {"zeta": 1, "alpha": {"y": "é", "b": [True, None]}},
    }
    expected = (
        "[assistant]\ntool call: exec\n"
        "{\n"
        '  "id": "c1",\n'
        '  "inputShape": {\n'
        '    "alpha": {\n'
        '      "b": [\n'
        '        "[boolean]",\n'
        '        "[null]"\n'
        "      ],\n"
        '      "y": "[string]"\n'
        "    },\n"
        '    "zeta": "[number]"\n'
        "  },\n"
        '  "name": "exec",\n'
        '  "type": "toolCall"\n'
        "}"
    )
    for candidate in (part, reversed_keys(part)):
        message = {"role": "assistant", "content": [candidate]}
        assert render_message(message, part_max=10_000, tool_payload_mode="preserve") == expected


def test_a_preserved_tool_result_renders_sorted_json_with_non_ascii_kept() -> None:
    part = {
        "type": "toolResult",
        "toolUseId": "c1",
        "content": {"z": "é", "a": [1, {"d": 2, "c": 3}]},
    }
    expected = "[user]\ntool result: c1\n" + canonical(
        {"content": {"a": [1, {"c": 3, "d": 2}], "z": "é"}, "toolUseId": "c1", "type": "toolResult"}
    )
    assert '"z": "é"' in expected
    for candidate in (part, reversed_keys(part)):
        message = {"role": "user", "content": [candidate]}
        assert render_message(message, part_max=10_000, tool_payload_mode="preserve") == expected


def test_colliding_redacted_keys_keep_an_order_free_winner() -> None:
    first, second = SECRETS[0], SECRETS[1]
    forward = {first: "one", second: "two", "token=abc": 1, "token=xyz": 2, 1: "int", "1": "str"}
    backward = reversed_keys(forward)
    for transform in (input_shape, redacted_payload):
        rendered = render_json(transform(forward))
        assert rendered == render_json(transform(backward))
        assert first not in rendered
        assert second not in rendered
        assert "abc" not in rendered
        assert "xyz" not in rendered


def test_secrets_are_masked_in_the_canonical_rendering() -> None:
    secret = SECRETS[0]
    assembled = [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "toolCall",
                    "name": "exec",
                    "id": "call-1",
                    "arguments": {"token": secret, "command": f"curl -H 'Authorization: {secret}'"},
                }
            ],
        },
        {
            "role": "toolResult",
            "toolCallId": "call-1",
            "content": [
                {
                    "type": "toolResult",
                    "toolUseId": "call-1",
                    "content": {"password": "hunter2hunter2", "out": f"key {secret}"},
                }
            ],
        },
    ]
    texts = {
        project_thread_bootstrap_assembly(
            assembled_messages=history, original_history_messages=[], prompt="go"
        ).prompt_text
        for history in (assembled, reversed_keys(assembled))
    }
    assert len(texts) == 1
    (text,) = texts
    assert secret not in text
    assert "hunter2hunter2" not in text
    assert '"command": "[string]",\n    "token": "[string]"' in text
    assert '"out": "key [redacted]",\n    "password": "[redacted]"' in text
