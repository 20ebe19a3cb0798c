"""Secret-shaped text, masked: the one redactor behind both logs and projections.

Pure and deterministic (the projection's byte stability depends on it): the same input
always gives the same output, whoever calls it. Logging adds its own per-task sensitive
values on top (``codex_turn._log.sensitive``); projections never do.

Two mechanisms, applied in this order:

1. **Shapes** that are secret wherever they occur: ``Bearer <token>``, ``sk-...`` keys, GitHub
   and Slack tokens, AWS access key ids, Stripe secret and restricted keys (``sk_live_...``,
   ``rk_test_...``), Google API keys (``AIza...``), GitLab tokens (``glpat-...`` and its
   sibling prefixes), Hugging Face tokens (``hf_...``), PEM private keys, and the password
   (or a long, token-like user) in ``scheme://user:password@host``.
2. **Assignments** ``key=value`` / ``key: value`` / ``"key": "value"`` / ``'key': 'value'`` /
   ``?key=value&...`` whose *key* names a credential (:func:`is_secret_key`). The key and any
   quotes stay, so a log line still says *what* was masked; the value goes:
   ``{"apiKey": "[redacted]"}``. A list value goes whole (``"api_keys": [redacted]``); an
   object value is not masked as such, its own keys are examined. Two header families take
   more than one word of value:
   ``Authorization`` / ``Proxy-Authorization`` lose the scheme *and* the credential (``Basic
   dXNl...``, ``Digest username="a", response="..."``), ``Cookie`` / ``Set-Cookie`` lose every
   ``name=value; ...`` pair.

:func:`is_secret_key` is the one credential-key vocabulary of the package: the projection's
tool-result redaction (``codex_turn.projection.payload``) and the log scrubber
(``codex_turn._log``) both use it, so logs and projections agree on what a secret key is.
It names ``api_key``/``apiKey``, ``access_key``, ``private_key``, ``secret`` (``client_secret``
...), ``password``/``passwd``/``passphrase``, ``credential``, ``cookie``, ``authorization``,
``auth`` and any word ending in ``token`` (``access_token``, ``session_token``, ``csrftoken``).
Counters are not secrets: the plural ``tokens`` is not a secret word (``input_tokens=42``,
``estimated_tokens``, ``max_tokens: 100``), and a key with a quantity word (``token_count``,
``token_budget``, ``password_length``) is never secret. ``author`` is not ``auth``.

Every pattern is linear in the input (no nested quantifiers that can backtrack over the same
text twice; scans start only at word starts), so a megabyte of adversarial text is redacted
in a fraction of a second (``tests/test_secrets.py`` holds the adversarial cases).
"""

from __future__ import annotations

import functools
import re
from typing import Final

__all__ = ["REDACTED", "is_secret_key", "redact_secrets"]

REDACTED: Final = "[redacted]"

# --- the key vocabulary -----------------------------------------------------------------------

# Words of a key: ``OPENAI_API_KEY`` -> openai/api/key, ``apiKey`` -> api/key, ``APIKey`` ->
# api/key, ``X-Auth-Token`` -> x/auth/token.
_KEY_WORD: Final = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# Substrings of the joined, lower-cased words that make a key secret.
_SECRET_FRAGMENTS: Final = (
    "apikey",
    "accesskey",
    "privatekey",
    "secret",
    "password",
    "passwd",
    "passphrase",
    "credential",
    "cookie",
    "authorization",
)
# A key with one of these words counts or describes a secret, it does not hold one.
_QUANTITY_WORDS: Final = frozenset(
    {
        "count",
        "counts",
        "budget",
        "limit",
        "limits",
        "usage",
        "estimate",
        "estimated",
        "length",
        "len",
        "size",
        "max",
        "min",
        "total",
        "num",
        "type",
        "expires",
        "expiry",
        "ttl",
    }
)


# Cheap pre-check on the ASCII letters of the name (a superset of what the word rules below
# can accept): no fragment and no token/auth among them, no secret.
_NOT_A_LETTER: Final = bytes(b for b in range(256) if not chr(b).isascii() or not chr(b).isalpha())
_ANY_FRAGMENT: Final = re.compile("|".join((*_SECRET_FRAGMENTS, "token", "auth")).encode())


@functools.lru_cache(maxsize=4096)
def is_secret_key(name: str) -> bool:
    """Whether a field, header, parameter or variable called ``name`` holds a credential."""
    letters = name.encode("ascii", "ignore").translate(None, _NOT_A_LETTER).lower()
    return _ANY_FRAGMENT.search(letters) is not None and _names_a_credential(name)


def _names_a_credential(name: str) -> bool:
    """The word rules of :func:`is_secret_key`, without its pre-check."""
    words = [w.lower() for w in _KEY_WORD.findall(name)]
    if not words or any(w in _QUANTITY_WORDS for w in words):
        return False
    joined = "".join(words)
    return (
        any(fragment in joined for fragment in _SECRET_FRAGMENTS)
        or any(w.endswith("token") for w in words)
        or any(w.endswith("auth") for w in words)
    )


def _is_authorization_header(name: str) -> bool:
    return "authorization" in name.lower().replace("_", "").replace("-", "")


def _is_cookie_header(name: str) -> bool:
    return "cookie" in name.lower()


# --- shapes -----------------------------------------------------------------------------------

# The most specific shapes first, so a bearer token is masked as one unit. A shape whose
# body can contain its own prefix (``glpat-glpat-...``) starts only where no body character
# precedes, so a long run is scanned once, not once per prefix in it.
_SECRET_PATTERNS: Final[tuple[re.Pattern[str], ...]] = (
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{6,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"),
    re.compile(r"\b(?:ghp|gho|ghu|ghs|github_pat|xox[abpr])_[A-Za-z0-9_-]{8,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    # Stripe secret / restricted keys (publishable pk_ keys are public by design).
    re.compile(r"(?<![A-Za-z0-9_])[sr]k_(?:live|test)_[A-Za-z0-9]{10,}"),
    # Google API keys: AIza + 35 characters.
    re.compile(r"(?<![A-Za-z0-9_-])AIza[A-Za-z0-9_-]{35,}"),
    # GitLab personal, deploy, runner, trigger, feed, OAuth, CI job, ... tokens.
    re.compile(
        r"(?<![A-Za-z0-9_.-])gl(?:pat|dt|rt|ptt|ft|imt|agent|oas|soat|cbt|wt|cuifr)-"
        r"[A-Za-z0-9_.-]{20,}"
    ),
    # Hugging Face user and organisation tokens.
    re.compile(r"(?<![A-Za-z0-9_])(?:hf|api_org)_[A-Za-z0-9]{30,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"),
)

# scheme://user:password@  (password masked, user kept) or scheme://<long token>@  (masked).
# The scheme starts a run of scheme characters (a lookbehind, not ``\b``: ``\b`` would start a
# fresh scan at every ``.`` of ``a.a.a.a...``).
_URL_USERINFO: Final = re.compile(
    r"(?i)(?<![\w+.-])([a-z][a-z0-9+.-]*://)"
    r"(?:([^\s/?#@:]*):([^\s/?#]*)|[A-Za-z0-9._~-]{20,})@"
)


def _mask_userinfo(match: re.Match[str]) -> str:
    scheme, user = match.group(1), match.group(2)
    if user is None:
        return f"{scheme}{REDACTED}@"
    return f"{scheme}{user}:{REDACTED}@"


# --- assignments ------------------------------------------------------------------------------

# A candidate key: a whole word (``[\w.-]``, optionally after ``-`` or ``--``) that contains a
# hint of the vocabulary (not ``tokens``: counters never reach the Python-level check),
# followed by an optional closing quote and ``=`` or ``:`` (or, in code, ``==``, ``=>``,
# ``:=``). Scans start only where no word character precedes, and the quantifiers are
# possessive, so each word is examined once.
_CANDIDATE: Final = re.compile(
    r"(?<![\w.-])-{0,2}+"
    r"(?=[\w.-]*?(?i:token(?!s)|auth|key|secret|pass|credential|cookie))"
    r"([A-Za-z_][\w.-]*+)"
    r"((?:\\?[\"'])?[ \t]*[=:][=>]{0,2}[ \t]*)"
)
_ALREADY: Final = r"(?P<done>" + re.escape(REDACTED) + r")"
# Quoted values keep their quotes; an unterminated quote masks to the end of the line.
_QUOTED: Final = (
    r"(?P<dq>\")(?:[^\"\\\n]|\\.)*(?P<dqe>\")?"
    r"|(?P<sq>')(?:[^'\\\n]|\\.)*(?P<sqe>')?"
    r"|(?P<eq>\\\")(?:[^\"\\\n]|\\[^\"\n])*(?P<eqe>\\\")?"  # JSON inside a JSON string
)
# RFC 9110 auth-param: name=token or name="quoted".
_AUTH_PARAM: Final = r"[\w!#$%&*+.^`|~-]+=(?:\"(?:[^\"\\\n]|\\.)*\"?|[^\s,;\"']*)"
# A list value (``["a", "b"]``) goes whole, to its first ``]`` or the end of the line, and so
# do ``(...)`` and a ``{...}`` without keys in it (``{abc}``); an object with keys is not a
# value: its own keys are examined instead. An unquoted value ends at whitespace, a quote, or a
# delimiter of its container (``,;&)}]``).
_GROUPED: Final = r"\[[^\]\n]*\]?|\([^)\n]*\)?|\{[^{}:=\n]*\}"
_VALUE: Final = re.compile(
    rf"{_ALREADY}|{_QUOTED}|{_GROUPED}|[^\s\"',;&)}}\]{{\[(][^\s\"',;&)}}\]]*"
)
_AUTHORIZATION_VALUE: Final = re.compile(
    rf"{_ALREADY}|{_QUOTED}"
    rf"|[^\s\"',;]+(?:[ \t]+(?:{_AUTH_PARAM}|[^\s\"',;]+))?(?:[ \t]*,[ \t]*{_AUTH_PARAM})*"
)
_COOKIE_VALUE: Final = re.compile(rf"{_ALREADY}|{_QUOTED}|[^\s\"',;]+(?:[ \t]*;[ \t]*[^\s\"',;]+)*")


def _masked_value(value: re.Match[str]) -> str:
    if value.group("done") is not None:
        return REDACTED
    for opening, closing in (("dq", "dqe"), ("sq", "sqe"), ("eq", "eqe")):
        if value.group(opening) is not None:
            return f"{value.group(opening)}{REDACTED}{value.group(closing) or ''}"
    return REDACTED


def _mask_assignments(text: str) -> str:
    pieces: list[str] = []
    done = 0  # text[:done] is already in pieces
    pos = 0
    while (key := _CANDIDATE.search(text, pos)) is not None:
        pos = key.end()
        name = key.group(1)
        if not is_secret_key(name):
            continue
        if _is_authorization_header(name):
            value_pattern = _AUTHORIZATION_VALUE
        elif _is_cookie_header(name):
            value_pattern = _COOKIE_VALUE
        else:
            value_pattern = _VALUE
        value = value_pattern.match(text, pos)
        if value is None or not value.group():
            continue
        pieces.append(text[done:pos])
        pieces.append(_masked_value(value))
        done = pos = value.end()
    pieces.append(text[done:])
    return "".join(pieces)


# Each pattern above needs one of these literals (case-folded: ``(?i)`` also matches the
# Kelvin sign and the long s, which casefold() maps to k and s). A text without any of them,
# which is most of what a log line holds ("done", ids, masked keys), is returned after one
# pass of substring checks instead of a dozen regex scans (~0.5 us instead of ~5).
_TRIGGERS: Final = (
    *("token", "key", "auth", "pass", "secret", "credential", "cookie", "://"),
    *("bearer", "sk-", "gh", "xox", "akia", "k_live_", "k_test_", "aiza", "gl", "hf_"),
    *("api_org_", "-----begin"),
)


def _may_hold_a_secret(text: str) -> bool:
    return any(map(text.casefold().__contains__, _TRIGGERS))


def redact_secrets(text: str) -> str:
    """Mask secret-shaped substrings and the values of credential-named keys in ``text``."""
    if not _may_hold_a_secret(text):
        return text
    return _redact(text)


def _redact(text: str) -> str:
    """:func:`redact_secrets` without its pre-check."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(REDACTED, text)
    text = _URL_USERINFO.sub(_mask_userinfo, text)
    return _mask_assignments(text)
