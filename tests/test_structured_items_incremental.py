"""The incremental structured projection: ``first_index``, :class:`ConversionCache`, and
:func:`check_items` skipping a prefix already checked.

The property that matters: whatever happened to the assemblies before (grown, an earlier
message replaced or dropped, the policy changed, a plain message mutated in place after its
conversion, a value swapped for an equal one of another type, the prompt repeated last), a
conversion through a cache is byte for byte the conversion from scratch: items, ids,
canonical JSON, sizes, ``end``, counts, refusals, and what :func:`check_items` and
:func:`newest_items` make of it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_structured_items import conversations, policies

from codex_turn.frozen import FrozenDict, freeze, thaw
from codex_turn.projection.items import (
    ConversionCache,
    ConvertedItems,
    Unconvertible,
    canonical_json,
    check_items,
    convert_messages,
    newest_items,
)

TEXTS = ("", "hi", "what now?", " what now? ", "é ü", "x" * 40)
SCALARS = (True, False, 1, 0, 1.0, 0.0, -0.0, None, "1", "true")
#: Values equal under ``==`` that the conversion tells apart (canonical JSON, ``is True``).
SWAPS: tuple[tuple[Any, Any], ...] = ((True, 1), (1, 1.0), (1.0, True), (False, 0), (0, 0.0))


def _swap(value: Any) -> Any:
    if type(value) is float and value == 0.0 and str(value).startswith("-"):
        return False
    if type(value) is float and value == 0.0:
        return -0.0
    for old, new in SWAPS:
        if type(value) is type(old) and value == old:
            return new
    return value


def _retyped(value: Any) -> tuple[Any, bool]:
    """A plain copy of ``value`` with every swappable scalar swapped (and whether one was)."""
    if isinstance(value, dict):
        pairs = [(key, _retyped(item)) for key, item in value.items()]
        return {key: item for key, (item, _) in pairs}, any(done for _, (_, done) in pairs)
    if isinstance(value, list | tuple):
        swapped = [_retyped(item) for item in value]
        items = [item for item, _ in swapped]
        done = any(done for _, done in swapped)
        return (tuple(items) if isinstance(value, tuple) else items), done
    new = _swap(value)
    return new, new is not value or type(new) is not type(value)


def _mutate_in_place(message: dict[str, Any], how: int) -> None:
    """Edit a plain message the way a careless engine could, after it was converted."""
    content = message.get("content")
    if how == 0 and isinstance(content, list) and content and isinstance(content[0], dict):
        part = content[0]
        if isinstance(part.get("text"), str):
            part["text"] += " (edited)"
        else:
            part["type"] = "text"
            part["text"] = "now text"
    elif how == 1:
        swapped, done = _retyped(message)
        if done:
            message.clear()
            message.update(swapped)
    elif how == 2 and isinstance(content, list):
        content.append({"type": "text", "text": "appended"})
    elif how == 3:
        message["isError"] = _swap(message.get("isError", True))
    else:
        message["content"] = "replaced"


@st.composite
def a_message(draw: st.DrawFn, calls: list[str]) -> Any:
    """One assembled message; tool calls get fresh ids (or, rarely, a repeated one), results
    answer a call made so far (or, rarely, none)."""

    def call_id() -> str:
        if calls and draw(st.integers(0, 19)) == 0:
            return draw(st.sampled_from(calls))  # a duplicate id: a refusal
        made = f"call-{len(calls)}-{draw(st.integers(0, 99))}"
        calls.append(made)
        return made

    def answered() -> str:
        if not calls or draw(st.integers(0, 19)) == 0:
            return "nobody"  # an orphan result: a refusal
        return draw(st.sampled_from(calls))

    text = st.sampled_from(TEXTS)
    scalar = st.sampled_from(SCALARS)
    kind = draw(st.integers(0, 23))
    if kind <= 5:
        content: Any = draw(text)
        if draw(st.booleans()):
            content = [
                draw(
                    st.sampled_from(
                        [
                            {"type": "text", "text": draw(text)},
                            {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
                            {"type": "image"},
                            {"type": "audio"},
                        ]
                    )
                )
                for _ in range(draw(st.integers(0, 3)))
            ]
            if draw(st.integers(0, 5)) == 0:
                content.append(
                    {"type": "tool_result", "tool_use_id": answered(), "content": draw(text)}
                )
            if draw(st.integers(0, 5)) == 0:
                content = tuple(content)
        return {"role": draw(st.sampled_from(["user", "user", "custom"])), "content": content}
    if kind <= 13:
        parts: list[Any] = []
        for _ in range(draw(st.integers(0, 3))):
            which = draw(st.integers(0, 4))
            if which == 0:
                parts.append({"type": "text", "text": draw(text)})
            elif which == 1:
                parts.append({"type": "thinking", "thinking": draw(text)})
            elif which == 2:
                parts.append({"type": "image", "data": "AAAA", "mimeType": "image/png"})
            else:
                arguments = {"x": draw(scalar), "y": [draw(scalar)], "z": {"w": draw(scalar)}}
                if draw(st.booleans()):
                    arguments = json.dumps(arguments)  # type: ignore[assignment]
                parts.append(
                    {"type": "toolCall", "id": call_id(), "name": "exec", "arguments": arguments}
                )
        return {"role": "assistant", "content": parts, "timestamp": draw(st.integers(0, 9))}
    if kind <= 19:
        result: Any = draw(st.one_of(text, st.just([{"type": "text", "text": "out"}])))
        if draw(st.integers(0, 4)) == 0:
            result = {"value": draw(scalar), "items": [draw(scalar), draw(scalar)]}
        return {
            "role": "toolResult",
            "toolCallId": answered(),
            "content": result,
            "isError": draw(scalar),
        }
    if kind <= 22:
        if draw(st.booleans()):
            return {"role": "compactionSummary", "summary": draw(text)}
        return {"role": "branchSummary", "content": [{"type": "text", "text": draw(text)}]}
    return draw(
        st.sampled_from([{"role": "system", "content": "x"}, {"role": "assistant", "content": 3}])
    )


def _maybe_frozen(draw: Any, message: Any) -> Any:
    return freeze(message) if draw(st.booleans()) else message


def _fingerprint(result: ConvertedItems | Unconvertible) -> Any:
    """Everything observable about a conversion, exactly (types included)."""
    if isinstance(result, Unconvertible):
        return ("unconvertible", result.reason, result.index, result.detail)
    text = canonical_json(list(result.items))
    assert result.canonical == text
    assert result.chars == len(text)
    assert result.sizes == tuple(len(canonical_json(item)) for item in result.items)
    return (
        text,
        result.end,
        result.message_count,
        result.dropped_prompt,
        check_items(result.items),
    )


def _same(
    cached: ConvertedItems | Unconvertible,
    fresh: ConvertedItems | Unconvertible,
    cache: ConversionCache,
    cap: int,
) -> None:
    assert _fingerprint(cached) == _fingerprint(fresh)
    if isinstance(cached, ConvertedItems):
        assert isinstance(fresh, ConvertedItems)
        assert cached.items == fresh.items
        assert check_items(cached.items, cache=cache) == check_items(fresh.items)
        assert check_items(cached.items, cache=cache) == check_items(fresh.items)  # recorded
        cut, plain_cut = newest_items(cached, cap), newest_items(fresh, cap)
        assert canonical_json(list(cut.items)) == canonical_json(list(plain_cut.items))
        assert (cut.end, cut.chars, cut.sizes) == (plain_cut.end, plain_cut.chars, plain_cut.sizes)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_cached_conversion_is_the_conversion_from_scratch(data: st.DataObject) -> None:
    draw = data.draw
    cache = ConversionCache()
    calls: list[str] = []
    messages: list[Any] = []
    policy: Any = draw(policies)
    prompt = draw(st.sampled_from(TEXTS))
    first_index = 0
    for _ in range(draw(st.integers(1, 12))):
        op = draw(st.sampled_from((0, 0, 0, 4, 5, 6, 7, 7, 8, 8, 8, 9, 10, 11)))
        if op == 0 or not messages:  # grow
            for _ in range(draw(st.integers(1, 4))):
                messages.append(_maybe_frozen(draw, draw(a_message(calls))))
        elif op == 4:  # replace an earlier message
            at = draw(st.integers(0, len(messages) - 1))
            messages[at] = _maybe_frozen(draw, draw(a_message(calls)))
        elif op == 5:  # drop one
            del messages[draw(st.integers(0, len(messages) - 1))]
        elif op == 6:  # another policy, another prompt, another numbering
            policy = draw(policies)
            prompt = draw(st.sampled_from(TEXTS))
            if draw(st.integers(0, 3)) == 0:
                first_index = draw(st.integers(0, 5))
        elif op == 7:  # a plain message edited in place after its conversion
            plain = [m for m in messages if isinstance(m, dict) and type(m) is not FrozenDict]
            if plain:
                _mutate_in_place(draw(st.sampled_from(plain)), draw(st.integers(0, 4)))
        elif op == 8:  # an equal message of other types (== cannot tell), frozen or not
            at = draw(st.integers(0, len(messages) - 1))
            if isinstance(messages[at], dict):
                swapped, _ = _retyped(thaw(messages[at]))
                messages[at] = _maybe_frozen(draw, swapped)
        elif op == 9:  # the prompt repeated as the last message
            messages.append(_maybe_frozen(draw, {"role": "user", "content": prompt}))
        elif op == 10:  # the same message, as a new object (frozen, thawed or copied)
            at = draw(st.integers(0, len(messages) - 1))
            if isinstance(messages[at], dict):
                messages[at] = draw(
                    st.sampled_from([freeze(thaw(messages[at])), thaw(messages[at])])
                )
        # op 11: the same assembly again
        snapshot = copy.deepcopy(messages)
        cached = convert_messages(
            messages, prompt=prompt, payload_policy=policy, first_index=first_index, cache=cache
        )
        assert messages == snapshot  # never mutated
        fresh = convert_messages(
            messages, prompt=prompt, payload_policy=policy, first_index=first_index
        )
        _same(cached, fresh, cache, draw(st.integers(2, 600)))


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(["full", "shape-only"]), st.booleans())
def test_values_swapped_for_equal_ones_of_other_types_are_seen(
    data: st.DataObject, policy: Any, in_place: bool
) -> None:
    calls: list[str] = []
    messages = [data.draw(a_message(calls)) for _ in range(data.draw(st.integers(1, 8)))]
    cache = ConversionCache()
    convert_messages(messages, payload_policy=policy, cache=cache)
    at = data.draw(st.integers(0, len(messages) - 1))
    if not isinstance(messages[at], dict):
        return
    swapped, _ = _retyped(messages[at])
    if in_place:
        messages[at].clear()
        messages[at].update(swapped)
    else:
        messages[at] = swapped
    cached = convert_messages(messages, payload_policy=policy, cache=cache)
    assert _fingerprint(cached) == _fingerprint(convert_messages(messages, payload_policy=policy))


def test_equal_values_of_other_types_are_not_reused() -> None:
    # True == 1 == 1.0: a cache keyed on == would give the first conversion's items.
    cache = ConversionCache()
    call = {
        "role": "assistant",
        "content": [{"type": "toolCall", "id": "c", "name": "t", "arguments": {"n": 1}}],
    }
    result = {"role": "toolResult", "toolCallId": "c", "content": "out", "isError": True}
    first = convert_messages([call, result], payload_policy="full", cache=cache)
    assert isinstance(first, ConvertedItems)
    assert "[tool error]" in first.canonical
    call["content"][0]["arguments"]["n"] = 1.0  # type: ignore[index]
    result["isError"] = 1
    again = convert_messages([call, result], payload_policy="full", cache=cache)
    fresh = convert_messages([call, result], payload_policy="full")
    assert isinstance(again, ConvertedItems)
    assert isinstance(fresh, ConvertedItems)
    assert again.canonical == fresh.canonical
    assert "[tool error]" not in again.canonical
    assert '\\"n\\":1.0' in again.canonical


def test_the_cache_reuses_a_frozen_prefix_and_converts_only_the_rest() -> None:
    base = [freeze(m) for m in _conversation(40)]
    cache = ConversionCache()
    first = convert_messages(base, prompt="p", cache=cache)
    assert isinstance(first, ConvertedItems)
    grown = [*base, freeze({"role": "user", "content": "next"})]
    second = convert_messages(grown, prompt="p", cache=cache)
    assert isinstance(second, ConvertedItems)
    assert len(second.items) == len(first.items) + 1
    assert all(a is b for a, b in zip(first.items, second.items, strict=False))  # reused
    assert second == convert_messages(grown, prompt="p")
    with pytest.raises(TypeError):  # shared with the next conversion: read-only
        second.items[0]["id"] = "msg_mine"


def test_a_user_message_closes_the_calls_left_open_before_it() -> None:
    # The previous conversion closed the open call at its end; the grown one closes it where
    # the next message starts: the reused prefix must stop before those closing outputs.
    call = {
        "role": "assistant",
        "content": [{"type": "toolCall", "id": "c", "name": "t", "arguments": {}}],
    }
    cache = ConversionCache()
    assemblies: list[list[dict[str, Any]]] = [
        [call],
        [call, {"role": "user", "content": "u"}],
        [call, {"role": "toolResult", "toolCallId": "c", "content": "late"}],
        [call, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c"}]}],
    ]
    for messages in assemblies:
        cached = convert_messages(messages, payload_policy="full", cache=cache)
        assert _fingerprint(cached) == _fingerprint(
            convert_messages(messages, payload_policy="full")
        )


def test_the_prompt_dropped_last_time_is_converted_when_it_is_no_longer_last() -> None:
    cache = ConversionCache()
    base = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    asked = [*base, {"role": "user", "content": "next?"}]
    first = convert_messages(asked, prompt="next?", cache=cache)
    assert isinstance(first, ConvertedItems)
    assert first.dropped_prompt
    grown = [*asked, {"role": "assistant", "content": "answer"}]
    for messages, prompt in ((grown, "later"), (asked, "next?"), (asked, "other")):
        cached = convert_messages(messages, prompt=prompt, cache=cache)
        assert _fingerprint(cached) == _fingerprint(convert_messages(messages, prompt=prompt))


def test_a_refusal_is_the_same_and_its_prefix_is_reused() -> None:
    cache = ConversionCache()
    good = _conversation(10)
    orphan = {"role": "toolResult", "toolCallId": "nobody", "content": "x"}
    for messages in ([*good, orphan], [*good, orphan, *good[:2]], [*good, *good[:1]]):
        cached = convert_messages(messages, cache=cache)
        assert cached == convert_messages(messages)
    refused = convert_messages([*good, orphan], cache=cache)
    assert isinstance(refused, Unconvertible)
    assert refused.index == len(good)


# --- first_index --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(conversations(), conversations(), policies)
def test_a_turn_converted_alone_gets_the_ids_it_has_after_the_assembly(
    head: list[dict[str, Any]], turn: list[dict[str, Any]], policy: Any
) -> None:
    # The turn's calls are its own (no result of the turn answers a call of the head), so
    # the boundary is clean: the head's open calls are closed where the turn starts.
    turn = json.loads(json.dumps(turn).replace('"call-', '"turn-call-'))
    assembly = convert_messages(head, payload_policy=policy)
    whole = convert_messages(head + turn, payload_policy=policy)
    assert isinstance(assembly, ConvertedItems)
    assert isinstance(whole, ConvertedItems)
    alone = convert_messages(turn, payload_policy=policy, first_index=assembly.end)
    assert isinstance(alone, ConvertedItems)
    assert alone.items == whole.items[len(assembly.items) :]
    assert alone.end == whole.end == assembly.end + len(alone.items)
    assert assembly.end == len(assembly.items)


def test_first_index_zero_keeps_the_ids_and_numbers_from_it_otherwise() -> None:
    messages = _conversation(6)
    zero = convert_messages(messages)
    default = convert_messages(messages, first_index=0)
    moved = convert_messages(messages, first_index=7)
    assert isinstance(zero, ConvertedItems)
    assert isinstance(moved, ConvertedItems)
    assert zero == default
    assert zero.end == len(zero.items)
    assert moved.end == 7 + len(moved.items)
    ids = [item["id"] for item in moved.items]
    assert ids != [item["id"] for item in zero.items]
    assert [{k: v for k, v in i.items() if k != "id"} for i in moved.items] == [
        {k: v for k, v in i.items() if k != "id"} for i in zero.items
    ]
    with pytest.raises(ValueError, match="first_index"):
        convert_messages(messages, first_index=-1)


def test_a_cut_keeps_end_and_sizes() -> None:
    converted = convert_messages(_conversation(30), payload_policy="full")
    assert isinstance(converted, ConvertedItems)
    cut = newest_items(converted, converted.chars // 3)
    assert cut.items
    assert cut.end == converted.end
    assert cut.sizes == converted.sizes[len(converted.items) - len(cut.items) :]
    assert cut.chars == len(cut.canonical) == len(canonical_json(list(cut.items)))


def test_a_canonical_text_given_explicitly_is_kept() -> None:
    converted = convert_messages(_conversation(3))
    assert isinstance(converted, ConvertedItems)
    import attrs

    bad = ({"type": "message", "role": "user", "content": "x"},)
    evolved = attrs.evolve(converted, items=bad, canonical=json.dumps(bad))
    assert evolved.canonical == json.dumps(bad)
    assert evolved.chars == len(json.dumps(bad))
    assert attrs.evolve(converted, items=bad).canonical == canonical_json(list(bad))


# --- check_items with a prefix already checked --------------------------------------------


def _conversation(size: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(size):
        if i % 3 == 0:
            out.append({"role": "user", "content": f"ask {i}"})
        elif i % 3 == 1:
            out.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": f"doing {i}"},
                        {"type": "toolCall", "id": f"c{i}", "name": "exec", "arguments": {}},
                    ],
                }
            )
        else:
            out.append({"role": "toolResult", "toolCallId": f"c{i - 1}", "content": "done"})
    return out


BAD_TAILS: dict[str, list[dict[str, Any]]] = {
    "bad part": [{"type": "message", "role": "user", "content": [{"type": "output_text"}]}],
    "empty message": [{"type": "message", "role": "assistant", "content": []}],
    "duplicate call id": [
        {"type": "function_call", "call_id": "c1", "name": "exec", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "again"},
    ],
    "answered twice": [{"type": "function_call_output", "call_id": "c1", "output": "again"}],
    "unanswered": [{"type": "function_call", "call_id": "new", "name": "x", "arguments": "{}"}],
    "unknown type": [{"type": "reasoning"}],
}


@pytest.mark.parametrize("tail", list(BAD_TAILS))
def test_a_skipped_prefix_still_rejects_a_bad_item_after_it(tail: str) -> None:
    converted = convert_messages(_conversation(12), payload_policy="full")
    assert isinstance(converted, ConvertedItems)
    prefix = len(converted.items)
    items = [*converted.items, *BAD_TAILS[tail]]
    problem = check_items(items)
    assert problem is not None
    for checked in (0, 1, prefix // 2, prefix, prefix + 5):
        assert check_items(items, checked=min(checked, prefix)) == problem


@settings(max_examples=200, deadline=None)
@given(conversations(), st.data())
def test_skipping_any_sound_prefix_gives_the_same_answer(
    messages: list[dict[str, Any]], data: st.DataObject
) -> None:
    converted = convert_messages(messages, payload_policy="full")
    assert isinstance(converted, ConvertedItems)
    ids = [i["call_id"] for i in converted.items if i["type"] == "function_call"] + ["new"]
    extra = data.draw(
        st.lists(
            st.one_of(
                st.builds(
                    lambda c: {"type": "function_call", "call_id": c, "name": "n", "arguments": ""},
                    st.sampled_from(ids),
                ),
                st.builds(
                    lambda c: {"type": "function_call_output", "call_id": c, "output": ""},
                    st.sampled_from(ids),
                ),
                st.just({"type": "message", "role": "user", "content": [{"type": "input_text"}]}),
                st.just({"type": "message", "role": "user", "content": "not a list"}),
            ),
            max_size=4,
        )
    )
    items = [*converted.items, *extra]
    checked = data.draw(st.integers(0, len(converted.items)))
    assert check_items(items, checked=checked) == check_items(items)


@pytest.mark.parametrize("tail", list(BAD_TAILS))
def test_a_cache_skips_only_what_it_checked(tail: str) -> None:
    # White box: a cache's items followed by bad ones (conversions never make such items);
    # the second conversion reuses the first one's items, so its check starts where the
    # conversion did, from the calls made and still open there.
    cache = ConversionCache()
    messages = _conversation(9)
    first = convert_messages(messages, payload_policy="full", cache=cache)
    assert isinstance(first, ConvertedItems)
    assert check_items(first.items, cache=cache) is None
    assert cache._checked == len(first.items)
    messages.append({"role": "user", "content": "more"})
    second = convert_messages(messages, payload_policy="full", cache=cache)
    assert isinstance(second, ConvertedItems)
    assert cache._checked == len(first.items)  # still true of the shared prefix
    bad = (*second.items, *map(freeze, BAD_TAILS[tail]))
    cache._items = bad
    problem = check_items(bad, cache=cache)
    assert problem is not None
    assert problem == check_items(bad)
    assert check_items(bad, cache=cache) == problem  # what it recorded skips no fault
