"""Properties of the Codex projection, checked with Hypothesis.

* identical input gives byte-identical output, in this interpreter and in fresh interpreters
  with different ``PYTHONHASHSEED`` values (no hash-order dependence anywhere);
* the current prompt is always the final actionable request;
* role order is preserved;
* the rendered context never exceeds the cap, whatever the budget;
* with a large enough budget nothing is truncated;
* no secret-like string placed in tool arguments ever appears, in either payload mode;
* the projection never mutates its input.
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
import re
import string
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from codex_turn.projection import (
    CodexContextProjection,
    dynamic_tools_fingerprint,
    max_rendered_context_chars,
    project_context_engine_assembly,
    project_thread_bootstrap_assembly,
    render_context,
    render_message,
    truncate_older,
)
from codex_turn.projection.frame import _FRAME_HEAD, _FRAME_TAIL, _JS_WHITESPACE

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("user", "assistant", "toolResult", "custom", "compactionSummary")

# Text without brackets, so a line "[role]" can only be a label the projection wrote.
plain_text = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="[]"), max_size=40
)
# Long enough to overflow the 24,000-character default cap, short enough that 12 messages of
# 4 parts never reach the 1,000,000-character ceiling of the largest budget.
long_text = st.builds(lambda s, n: s * n, plain_text.filter(bool), st.integers(1, 400))
any_text = st.one_of(plain_text, plain_text, plain_text, long_text)

_SECRET_BODY = st.text(alphabet=string.ascii_letters + string.digits, min_size=20, max_size=32)
secrets_ = st.one_of(
    st.builds("sk-{}".format, _SECRET_BODY),
    st.builds("Bearer {}".format, _SECRET_BODY),
    st.builds("ghp_{}".format, _SECRET_BODY),
    st.builds(
        "AKIA{}".format,
        st.text(alphabet=string.ascii_uppercase + string.digits, min_size=16, max_size=16),
    ),
)

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), plain_text
)


def arguments_with(secret: str) -> st.SearchStrategy[Any]:
    """A JSON value for tool arguments with ``secret`` planted somewhere in it (value or key)."""
    leaves = st.one_of(json_leaf, st.just(secret))
    keys = st.one_of(plain_text, st.just(secret))
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)
        ),
        max_leaves=8,
    ).map(lambda value: {"payload": value, "also": secret})


def parts(arguments: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, any_text),
        st.just({"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"}),
        st.builds(lambda t: {"type": "thinking", "thinking": t}, plain_text),
        st.builds(
            lambda name, args, i: {"type": "toolCall", "id": i, "name": name, "arguments": args},
            st.sampled_from(["exec", "read", "write"]),
            arguments,
            st.sampled_from(["call-1", "call-2"]),
        ),
        st.builds(
            lambda name, args: {"type": "tool_use", "name": name, "input": args},
            st.sampled_from(["exec", "grep"]),
            arguments,
        ),
        st.builds(
            lambda i: {"type": "toolResult", "toolUseId": i, "content": "ok"},
            st.sampled_from(["call-1", "call-2"]),
        ),
        st.builds(lambda t: {"type": t}, plain_text),
        st.one_of(st.none(), st.integers(), plain_text),
    )


def messages_with(arguments: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(ROLES),
            "content": st.one_of(any_text, st.lists(parts(arguments), max_size=4), st.integers()),
        },
        optional={"timestamp": st.integers(0, 2**40), "extra": json_leaf},
    )
    return st.lists(message, max_size=12)


messages = messages_with(st.dictionaries(plain_text, json_leaf, max_size=3))
prompts = st.text(alphabet=string.ascii_letters + string.digits + " \n\t.?", max_size=30)
budgets = st.one_of(
    st.none(),
    st.integers(-10, 2_000_000),
    st.floats(allow_nan=True, allow_infinity=True),
)
reserves = st.one_of(st.none(), st.integers(0, 100_000))


def context_of(result: CodexContextProjection) -> str:
    if result.context_range is None:
        return ""
    start, end = result.context_range
    return result.prompt_text[start:end]


@given(messages, prompts, st.one_of(st.none(), plain_text), budgets, st.booleans())
def test_identical_input_gives_byte_identical_output(
    assembled: list[Any], prompt: str, addition: str | None, budget: Any, preserve: bool
) -> None:
    snapshot = copy.deepcopy(assembled)
    project = project_thread_bootstrap_assembly if preserve else project_context_engine_assembly
    first = project(
        assembled_messages=assembled,
        original_history_messages=assembled,
        prompt=prompt,
        system_prompt_addition=addition,
        token_budget=budget,
    )
    second = project(
        assembled_messages=copy.deepcopy(snapshot),
        original_history_messages=snapshot,
        prompt=prompt,
        system_prompt_addition=addition,
        token_budget=budget,
    )
    assert first.prompt_text.encode("utf-8", "surrogatepass") == second.prompt_text.encode(
        "utf-8", "surrogatepass"
    )
    assert first == second
    assert assembled == snapshot  # the input was not mutated


@given(messages, prompts)
def test_the_current_prompt_is_always_the_final_actionable_request(
    assembled: list[Any], prompt: str
) -> None:
    result = project_context_engine_assembly(
        assembled_messages=assembled, original_history_messages=[], prompt=prompt
    )
    trimmed = prompt.strip(_JS_WHITESPACE)
    if result.context_range is None:
        assert result.prompt_text == trimmed
    else:
        start, end = result.context_range
        assert result.prompt_text[:start] == _FRAME_HEAD
        assert result.prompt_text[end:] == _FRAME_TAIL + trimmed
        assert result.prompt_text.endswith("\n\nCurrent user request:\n" + trimmed)


LABEL = re.compile(r"^\[(" + "|".join(ROLES) + r")\]$", re.MULTILINE)


@given(messages, prompts)
def test_role_order_is_preserved(assembled: list[Any], prompt: str) -> None:
    result = project_context_engine_assembly(
        assembled_messages=assembled,
        original_history_messages=[],
        prompt=prompt,
        token_budget=1_000_000,
    )
    assert result.truncated_chars == 0
    expected = [m["role"] for m in result.assembled_messages if render_message(m, part_max=10)]
    assert LABEL.findall(context_of(result)) == expected
    # The kept messages are the assembly, in order, minus at most the trailing duplicate.
    assert result.assembled_messages == assembled[: len(result.assembled_messages)]
    assert len(assembled) - len(result.assembled_messages) in (0, 1)


@given(messages, prompts, budgets, reserves)
def test_the_rendered_context_never_exceeds_the_cap(
    assembled: list[Any], prompt: str, budget: Any, reserve: int | None
) -> None:
    result = project_context_engine_assembly(
        assembled_messages=assembled,
        original_history_messages=[],
        prompt=prompt,
        token_budget=budget,
        reserve_tokens=reserve,
    )
    cap = max_rendered_context_chars(budget, reserve)
    assert result.max_context_chars == cap
    assert len(context_of(result)) <= cap
    assert len(result.prompt_text) <= len(_FRAME_HEAD) + cap + len(_FRAME_TAIL) + len(prompt)


@given(st.text(max_size=300), st.integers(0, 400))
def test_truncate_older_respects_any_cap(text: str, cap: int) -> None:
    cut, dropped = truncate_older(text, cap)
    assert len(cut) <= cap
    if len(text) <= cap:
        assert (cut, dropped) == (text, 0)
    else:
        assert dropped > 0
        marker = f"[truncated {dropped} chars from older context]\n"
        if cut.startswith(marker):
            tail = cut[len(marker) :]
            assert text.endswith(tail)
            assert dropped == len(text) - len(tail)
        else:
            assert marker.startswith(cut)  # only the cut marker fitted


@given(messages, st.integers(0, 3_000), st.sampled_from(["elide", "preserve"]))
def test_streaming_truncation_equals_truncating_the_whole_rendering(
    assembled: list[Any], cap: int, mode: Any
) -> None:
    """The renderer keeps only the newest blocks in memory; the result must not notice."""
    whole = "\n\n".join(
        r for m in assembled if (r := render_message(m, part_max=500, tool_payload_mode=mode))
    )
    expected = truncate_older(whole, cap)
    assert render_context(assembled, max_chars=cap, part_max=500, tool_payload_mode=mode) == (
        expected
    )


@given(messages, prompts)
def test_with_a_large_budget_nothing_is_truncated(assembled: list[Any], prompt: str) -> None:
    result = project_context_engine_assembly(
        assembled_messages=assembled,
        original_history_messages=[],
        prompt=prompt,
        token_budget=1_000_000,
    )
    assert result.truncated_chars == 0
    assert "[truncated " not in result.prompt_text
    rendered = [render_message(m, part_max=10**9) for m in result.assembled_messages]
    assert context_of(result) == "\n\n".join(r for r in rendered if r)


@settings(max_examples=150)
@given(st.data(), secrets_, prompts, st.booleans())
def test_secrets_in_tool_arguments_never_appear(
    data: st.DataObject, secret: str, prompt: str, preserve: bool
) -> None:
    assembled = data.draw(messages_with(arguments_with(secret)))
    # Make sure at least one tool call carries the secret.
    assembled.append(
        {
            "role": "assistant",
            "content": [{"type": "toolCall", "name": "exec", "arguments": {"token": secret}}],
        }
    )
    project = project_thread_bootstrap_assembly if preserve else project_context_engine_assembly
    result = project(
        assembled_messages=assembled,
        original_history_messages=[],
        prompt=prompt,
        token_budget=1_000_000,
    )
    assert secret not in result.prompt_text
    if preserve:
        assert "inputShape" in result.prompt_text
    else:
        assert "tool call: exec [input omitted]" in result.prompt_text


# --- Across interpreters --------------------------------------------------------------------

_WORDS = ["alpha", "beta", "gamma", "delta", "é", "中文", "sk-notasecret"]


def _corpus_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(_WORDS)
    if kind == 1:
        return rng.randrange(-1000, 1000)
    if kind == 2:
        return rng.random() < 0.5
    if kind == 3:
        return None
    if kind == 4:
        return [_corpus_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    # Dicts with many keys: their order must come from insertion, never from hashing.
    return {rng.choice(_WORDS) + str(i): _corpus_value(rng, depth + 1) for i in range(5)}


def _corpus_part(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(5)
    if kind == 0:
        return {"type": "text", "text": " ".join(rng.choices(_WORDS, k=rng.randrange(1, 50)))}
    if kind == 1:
        return {
            "type": "toolCall",
            "id": f"c{rng.randrange(9)}",
            "name": rng.choice(_WORDS),
            "arguments": _corpus_value(rng, 0),
        }
    if kind == 2:
        return {
            "type": "toolResult",
            "toolUseId": "c1",
            "content": [{"type": "text", "text": "token=abc"}],
            "meta": _corpus_value(rng, 0),
        }
    if kind == 3:
        return {"type": "image", "data": "AAAA", "mimeType": "image/png"}
    return {"type": "thinking", "thinking": "x"}


def corpus_digest() -> str:
    """SHA-256 over the projections and fingerprints of a fixed, seeded corpus."""
    rng = random.Random(20240601)
    digest = hashlib.sha256()
    for case in range(40):
        msgs = [
            {
                "role": rng.choice(["user", "assistant", "toolResult"]),
                "content": [_corpus_part(rng) for _ in range(rng.randrange(4))],
                "t": case,
            }
            for _ in range(rng.randrange(30))
        ]
        budget = rng.choice([None, 5_000, 80_000])
        for project in (project_context_engine_assembly, project_thread_bootstrap_assembly):
            out = project(
                assembled_messages=msgs,
                original_history_messages=msgs,
                prompt=f"go {case}",
                token_budget=budget,
            )
            digest.update(out.prompt_text.encode("utf-8"))
        specs = [
            {"name": w, "description": w, "inputSchema": _corpus_value(rng, 0)}
            for w in rng.sample(_WORDS, 3)
        ]
        digest.update(dynamic_tools_fingerprint(specs).encode("utf-8"))
    return digest.hexdigest()


def _digest_with_hash_seed(seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    )
    return done.stdout.strip()


def test_output_is_byte_identical_across_interpreters_with_different_hash_seeds() -> None:
    digests = {seed: _digest_with_hash_seed(seed) for seed in ("0", "1", "4242")}
    assert len(set(digests.values())) == 1, digests
    assert re.fullmatch(r"[0-9a-f]{64}", digests["0"])
    # And the same as in this interpreter, whatever its seed.
    assert corpus_digest() == digests["0"]


if __name__ == "__main__":
    print(corpus_digest())
