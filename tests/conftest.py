"""Shared test configuration: Hypothesis profiles and the Codex end-to-end fixtures."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["codex_fixtures"]

# CI=true activates Hypothesis' built-in "ci" profile (derandomized, no deadline, no database).
# Keep it, but explore more: the ordering proofs only mean something with enough examples.
settings.register_profile(
    "ci",
    settings.get_profile("ci"),
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
