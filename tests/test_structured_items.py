"""The structured projection (``codex_turn.projection.items``): assembled messages -> items.

Examples pin the mapping; Hypothesis checks the properties:

* identical input (deep copies, keys in any order) gives byte-identical canonical JSON and ids;
* any input converts to a sound injection (:func:`check_items`) or to a typed refusal, never
  an exception, and never mutates its input;
* every function_call is answered exactly once, after it; results keep their call's order;
* a conversation that only grows keeps every earlier item, ids included (the cache prefix);
* no secret planted in tool arguments or results appears, in any payload policy.
"""

from __future__ import annotations

import copy
import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codex_turn.projection.items import (
    ELIDED_ARGUMENTS,
    ELIDED_OUTPUT,
    SUMMARY_HEADER,
    UNANSWERED_OUTPUT,
    ConversionCache,
    ConvertedItems,
    Unconvertible,
    UnconvertibleReason,
    canonical_json,
    check_items,
    convert_messages,
    newest_items,
)

POLICIES = ("elide", "shape-only", "full")


def ok(result: ConvertedItems | Unconvertible) -> ConvertedItems:
    assert isinstance(result, ConvertedItems), result
    return result


def stripped(items: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


CONVERSATION = [
    {"role": "user", "content": "list the files", "timestamp": 1},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "hmm"},
            {"type": "text", "text": "Looking."},
            {"type": "toolCall", "id": "c1", "name": "exec", "arguments": {"command": "ls"}},
        ],
    },
    {
        "role": "toolResult",
        "toolCallId": "c1",
        "toolName": "exec",
        "content": [{"type": "text", "text": "a.py\nb.py"}],
        "isError": False,
    },
    {"role": "assistant", "content": [{"type": "text", "text": "Two files."}]},
    {"role": "compactionSummary", "summary": "earlier: set up the repo"},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "see this"},
            {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
        ],
    },
    {"role": "user", "content": "what now?"},
]


def test_the_mapping_full_policy() -> None:
    result = ok(convert_messages(CONVERSATION, prompt=" what now? ", payload_policy="full"))
    assert result.dropped_prompt
    assert result.message_count == 6
    assert stripped(result.items) == [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "list the files"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Looking."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "exec", "arguments": '{"command":"ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py\nb.py"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Two files."}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": f"{SUMMARY_HEADER}\nearlier: set up the repo"}
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "see this"},
                {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
            ],
        },
    ]
    prefixes = [i["id"].split("_")[0] for i in result.items]
    assert prefixes == ["msg", "msg", "fc", "fco", "msg", "msg", "msg"]
    assert check_items(result.items) is None
    assert result.canonical == canonical_json(list(result.items))


def test_payload_policies() -> None:
    call = {
        "role": "assistant",
        "content": [
            {"type": "toolCall", "id": "c", "name": "exec", "arguments": {"cmd": "cat x", "n": 3}}
        ],
    }
    result_message = {"role": "toolResult", "toolCallId": "c", "content": "secret-free output"}
    by_policy = {
        p: stripped(ok(convert_messages([call, result_message], payload_policy=p)).items)
        for p in POLICIES
    }
    assert by_policy["elide"][0]["arguments"] == ELIDED_ARGUMENTS
    assert by_policy["elide"][1]["output"] == ELIDED_OUTPUT
    assert json.loads(by_policy["shape-only"][0]["arguments"]) == {
        "cmd": "[string]",
        "n": "[number]",
    }
    assert by_policy["shape-only"][1]["output"] == ELIDED_OUTPUT
    assert json.loads(by_policy["full"][0]["arguments"]) == {"cmd": "cat x", "n": 3}
    assert by_policy["full"][1]["output"] == "secret-free output"
    with pytest.raises(ValueError, match="policy"):
        convert_messages([], payload_policy="raw")  # type: ignore[arg-type]


def test_secrets_are_redacted_in_full_mode() -> None:
    token = "sk-" + "A1b2C3d4" * 4
    messages = [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "toolCall",
                    "id": "c",
                    "name": "http",
                    "arguments": json.dumps({"apiKey": "hunter2hunter2", "url": f"x?k={token}"}),
                }
            ],
        },
        {"role": "toolResult", "toolCallId": "c", "content": f"Authorization: Bearer {token}"},
    ]
    text = ok(convert_messages(messages, payload_policy="full")).canonical
    assert token not in text
    assert "hunter2hunter2" not in text
    assert "[redacted]" in text


def test_unanswered_calls_get_an_output_before_the_next_message() -> None:
    messages = [
        {"role": "assistant", "content": [{"type": "toolCall", "id": "c", "name": "exec"}]},
        {"role": "user", "content": "never mind"},
    ]
    items = stripped(ok(convert_messages(messages)).items)
    assert [i["type"] for i in items] == ["function_call", "function_call_output", "message"]
    assert items[1]["output"] == UNANSWERED_OUTPUT


def test_anthropic_style_tool_use_and_tool_result_blocks() -> None:
    messages = [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "grep", "input": {"q": "x"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "found"},
                {"type": "text", "text": "thanks"},
            ],
        },
    ]
    items = stripped(ok(convert_messages(messages, payload_policy="full")).items)
    assert [i["type"] for i in items] == ["function_call", "function_call_output", "message"]
    assert items[1] == {"type": "function_call_output", "call_id": "t1", "output": "found"}


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ({"role": "user"}, UnconvertibleReason.NOT_A_LIST),
        (["text"], UnconvertibleReason.MESSAGE_NOT_A_MAPPING),
        ([{"role": "system", "content": "x"}], UnconvertibleReason.ROLE_NOT_INJECTABLE),
        ([{"role": "developer", "content": "x"}], UnconvertibleReason.ROLE_NOT_INJECTABLE),
        ([{"content": "x"}], UnconvertibleReason.ROLE_NOT_INJECTABLE),
        (
            [{"role": "toolResult", "toolCallId": "c", "content": "x"}],
            UnconvertibleReason.ORPHAN_TOOL_RESULT,
        ),
        (
            [{"role": "assistant", "content": [{"type": "toolCall", "name": "exec"}]}],
            UnconvertibleReason.MISSING_CALL_ID,
        ),
        (
            [{"role": "assistant", "content": [{"type": "toolCall", "id": "c"}]}],
            UnconvertibleReason.MISSING_TOOL_NAME,
        ),
        (
            [
                {"role": "assistant", "content": [{"type": "toolCall", "id": "c", "name": "a"}]},
                {"role": "assistant", "content": [{"type": "toolCall", "id": "c", "name": "a"}]},
            ],
            UnconvertibleReason.DUPLICATE_CALL_ID,
        ),
        ([{"role": "user", "content": 42}], UnconvertibleReason.INVALID_CONTENT),
    ],
)
def test_unconvertible_input_gives_a_typed_reason(
    messages: Any, reason: UnconvertibleReason
) -> None:
    result = convert_messages(messages)
    assert isinstance(result, Unconvertible)
    assert result.reason is reason
    assert reason.value in str(result)


def _call_then_result(arguments: object, content: object) -> list[dict[str, Any]]:
    return [
        {
            "role": "assistant",
            "content": [{"type": "toolCall", "id": "c", "name": "exec", "arguments": arguments}],
        },
        {"role": "toolResult", "toolCallId": "c", "content": content},
    ]


@pytest.mark.parametrize(
    ("arguments", "content"),
    [
        ({"ratio": float("nan")}, "ok"),
        ('{"ratio": NaN}', "ok"),  # JSON text with a bare NaN: Python's json reads it
        ({"limit": float("inf")}, "ok"),
        ({}, {"score": float("-inf")}),
        ({}, [{"type": "json", "value": float("nan")}]),
    ],
)
def test_a_payload_holding_a_non_json_number_is_unconvertible_not_an_error(
    arguments: object, content: object
) -> None:
    messages = _call_then_result(arguments, content)
    for cache in (None, ConversionCache()):
        result = convert_messages(messages, payload_policy="full", cache=cache)
        assert isinstance(result, Unconvertible)
        assert result.reason is UnconvertibleReason.NON_JSON_NUMBER
        assert result.index is not None
        assert "non_json_number" in str(result)
    # A policy that never encodes the value converts it: only "full" keeps payloads as JSON.
    for policy in ("elide", "shape-only"):
        ok(convert_messages(messages, payload_policy=policy))


def test_canonical_json_refuses_nan_everywhere() -> None:
    with pytest.raises(ValueError, match="not JSON compliant"):
        canonical_json({"x": float("nan")})
    with pytest.raises(ValueError, match="not JSON compliant"):
        canonical_json([float("inf")])
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'


def test_canonical_json_refuses_a_value_nested_too_deeply_as_a_value_error() -> None:
    # Before: a RecursionError, which no caller maps (they map ValueError and TypeError).
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested too deeply"):
        canonical_json({"x": deep})


@pytest.mark.parametrize("policy", POLICIES)
def test_deeply_nested_tool_arguments_convert(policy: Any) -> None:
    # Before: arguments as a JSON string nested past what json parses raised RecursionError
    # out of convert_messages, which never raises on odd messages.
    as_text = "[" * 100_000 + "]" * 100_000
    as_value: Any = {}
    for _ in range(5000):
        as_value = {"a": as_value}
    for arguments in (as_text, as_value):
        messages = _call_then_result(arguments, "ok")
        for cache in (None, ConversionCache()):
            converted = ok(convert_messages(messages, payload_policy=policy, cache=cache))
            assert [item["type"] for item in converted.items][:2] == [
                "function_call",
                "function_call_output",
            ]


def test_empty_assembly_converts_to_no_items() -> None:
    result = ok(convert_messages([]))
    assert result.items == ()
    assert result.canonical == "[]"
    assert check_items(result.items) == "empty"


# --- properties -------------------------------------------------------------------------------

plain = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=30)
leaf = st.one_of(st.none(), st.booleans(), st.integers(), plain)
args = st.recursive(
    leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(plain, inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Well-formed conversations: unique call ids, results after their calls (some missing)."""
    out: list[dict[str, Any]] = []
    next_id = 0
    for _ in range(draw(st.integers(0, 6))):
        out.append({"role": "user", "content": draw(plain) or "u"})
        parts: list[dict[str, Any]] = []
        calls: list[str] = []
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.booleans()):
                parts.append({"type": "text", "text": draw(plain)})
            else:
                call_id = f"call-{next_id}"
                next_id += 1
                calls.append(call_id)
                parts.append(
                    {"type": "toolCall", "id": call_id, "name": "exec", "arguments": draw(args)}
                )
        out.append({"role": "assistant", "content": parts})
        for call_id in calls:
            if draw(st.booleans()):
                out.append({"role": "toolResult", "toolCallId": call_id, "content": draw(plain)})
        if draw(st.booleans()):
            out.append({"role": "compactionSummary", "summary": draw(plain)})
    return out


junk_part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, plain),
    st.just({"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}),
    st.just({"type": "image"}),
    st.builds(
        lambda i, a: {"type": "toolCall", "id": i, "name": "exec", "arguments": a},
        st.sampled_from(["a", "b"]),
        args,
    ),
    st.builds(
        lambda i: {"type": "tool_result", "tool_use_id": i, "content": "r"},
        st.sampled_from(["a", "b"]),
    ),
    st.builds(lambda t: {"type": t}, plain),
    leaf,
)
junk = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(
                    ["user", "assistant", "toolResult", "custom", "branchSummary", "system", "x"]
                ),
                "content": st.one_of(plain, st.lists(junk_part, max_size=4), st.integers()),
            },
            optional={"toolCallId": st.sampled_from(["a", "b"]), "summary": plain},
        ),
        leaf,
    ),
    max_size=8,
)
policies = st.sampled_from(POLICIES)


def reorder(value: Any) -> Any:
    """The same value with every mapping's keys in reverse order."""
    if isinstance(value, dict):
        return {k: reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reorder(v) for v in value]
    return value


@settings(max_examples=150)
@given(st.one_of(conversations(), junk), plain, policies)
def test_identical_input_gives_byte_identical_items(
    messages: Any, prompt: str, policy: Any
) -> None:
    snapshot = copy.deepcopy(messages)
    first = convert_messages(messages, prompt=prompt, payload_policy=policy)
    again = convert_messages(copy.deepcopy(messages), prompt=prompt, payload_policy=policy)
    shuffled = convert_messages(reorder(messages), prompt=prompt, payload_policy=policy)
    assert messages == snapshot  # never mutated
    assert first == again == shuffled
    if isinstance(first, ConvertedItems):
        assert isinstance(shuffled, ConvertedItems)
        assert first.canonical.encode("utf-8") == shuffled.canonical.encode("utf-8")


@settings(max_examples=150)
@given(junk, policies)
def test_any_input_is_sound_items_or_a_typed_refusal(messages: Any, policy: Any) -> None:
    result = convert_messages(messages, payload_policy=policy)
    if isinstance(result, Unconvertible):
        assert isinstance(result.reason, UnconvertibleReason)
    elif result.items:
        assert check_items(result.items) is None


@settings(max_examples=200)
@given(conversations(), policies)
def test_calls_and_outputs_pair_up_in_order(messages: list[dict[str, Any]], policy: Any) -> None:
    result = ok(convert_messages(messages, payload_policy=policy))
    if not result.items:
        return
    assert check_items(result.items) is None
    calls = [i["call_id"] for i in result.items if i["type"] == "function_call"]
    outputs = [i["call_id"] for i in result.items if i["type"] == "function_call_output"]
    assert sorted(calls) == sorted(outputs)  # each answered once (after it: check_items)
    expected_calls = [
        p["id"]
        for m in messages
        if m["role"] == "assistant"
        for p in m["content"]
        if p.get("type") == "toolCall"
    ]
    assert calls == expected_calls
    answered = {m["toolCallId"] for m in messages if m["role"] == "toolResult"}
    unanswered = [
        i["call_id"]
        for i in result.items
        if i["type"] == "function_call_output" and i["output"] == UNANSWERED_OUTPUT
    ]
    assert set(unanswered).isdisjoint(answered)
    ids = [i["id"] for i in result.items]
    assert len(set(ids)) == len(ids)


@settings(max_examples=100)
@given(conversations(), conversations(), policies)
def test_a_growing_conversation_keeps_its_prefix(
    head: list[dict[str, Any]], tail: list[dict[str, Any]], policy: Any
) -> None:
    # Renumber the tail's calls so the whole stays well-formed.
    tail = json.loads(json.dumps(tail).replace('"call-', '"tail-call-'))
    before = ok(convert_messages(head, payload_policy=policy))
    after = ok(convert_messages(head + tail, payload_policy=policy))
    # Calls still open at the end of ``head`` are closed there; compare up to the last message.
    stable = len(before.items)
    while stable and before.items[stable - 1].get("output") == UNANSWERED_OUTPUT:
        stable -= 1
    assert after.items[:stable] == before.items[:stable]


_SECRET = st.text(alphabet=string.ascii_letters + string.digits, min_size=20, max_size=28).map(
    "sk-{}".format
)


@settings(max_examples=100)
@given(_SECRET, policies, st.sampled_from(["value", "key", "apiKey", "result"]))
def test_no_secret_survives_any_policy(secret: str, policy: Any, where: str) -> None:
    arguments: Any = {
        "value": {"command": f"curl -H 'x: {secret}'"},
        "key": {secret: 1},
        "apiKey": {"apiKey": secret},
        "result": {},
    }[where]
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": [{"type": "toolCall", "id": "c", "name": "exec", "arguments": arguments}],
        },
        {"role": "toolResult", "toolCallId": "c", "content": f"token={secret}"},
    ]
    assert secret not in ok(convert_messages(messages, payload_policy=policy)).canonical


@settings(max_examples=150)
@given(conversations(), policies, st.one_of(st.none(), st.integers(2, 3000)))
def test_the_newest_items_within_a_cap_are_a_sound_suffix(
    messages: list[dict[str, Any]], policy: Any, cap: int | None
) -> None:
    converted = ok(convert_messages(messages, payload_policy=policy))
    cut = newest_items(converted, cap)
    items = converted.items
    assert cut.items == items[len(items) - len(cut.items) :]  # a suffix, ids unchanged
    assert cut.canonical == canonical_json(list(cut.items))
    if cap is None or converted.chars <= cap:
        assert cut == converted
        return
    assert cut.chars <= cap
    if cut.items:
        assert cut.items[0]["type"] == "message"  # a history starts at a message
        assert check_items(cut.items) is None  # no call or output cut from its pair
    # Maximal: no longer suffix that is a sound history (starts at a message, no orphan
    # output) fits.
    for start in range(len(items) - len(cut.items)):
        if items[start]["type"] == "message" and check_items(items[start:]) is None:
            assert len(canonical_json(list(items[start:]))) > cap
    assert newest_items(converted, cap) == cut  # deterministic


def test_a_cut_never_separates_a_call_from_its_output() -> None:
    # Text after a tool call in one assistant message puts a message between the call and
    # its output: the cut must not start there.
    messages = [
        {"role": "user", "content": "u" * 50},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "before"},
                {"type": "toolCall", "id": "c1", "name": "exec", "arguments": {}},
                {"type": "text", "text": "after the call"},
            ],
        },
        {"role": "toolResult", "toolCallId": "c1", "content": "out"},
        {"role": "user", "content": "last"},
    ]
    converted = ok(convert_messages(messages, payload_policy="full"))
    kinds = [i["type"] for i in converted.items]
    call_then_text = ["message", "function_call", "message", "function_call_output"]
    assert kinds == ["message", *call_then_text, "message"]
    tail = len(canonical_json(list(converted.items[3:]))) + 1
    cut = newest_items(converted, tail)
    assert [i["type"] for i in cut.items] == ["message"]  # not from the text after the call
    assert check_items(cut.items) is None
