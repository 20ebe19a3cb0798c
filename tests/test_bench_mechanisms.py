"""``benchmarks/bench_mechanisms.py``: its figures and verdict rule, and its quick mode end to end.

The benchmark measures every mechanism that exists for speed on and off (the rule: it stays
only if it saves 5 % of a turn at a realistic model delay, or of the input bill or Codex's
memory). Its arithmetic is checked here on made-up numbers; the quick run (real binary, the
offline model in a child process) must print a row per mechanism and delay whose path checks
show that ON took the fast path and OFF did not, and a verdict per mechanism.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_mechanisms.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_mechanisms", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_uncached_input_is_what_follows_the_previous_requests_identical_prefix(
    bench: ModuleType,
) -> None:
    summaries = bench.RequestSummaries()
    first = [{"id": "a", "role": "user", "content": "x" * 100}, {"role": "user", "content": "p"}]
    summaries.add({"input": first, "prompt_cache_key": "k"}, "turn 1 of cfg")
    # The same items under other ids, then new ones: the ids are metadata, not tokens.
    second = [{"id": "b", "role": "user", "content": "x" * 100}, {"role": "user", "content": "q"}]
    summaries.add({"input": second, "prompt_cache_key": "k"}, "ctx ... turn 2 of cfg")
    # Another cache key serves nothing from the prefix.
    summaries.add({"input": second, "prompt_cache_key": "other"}, "turn 3 of cfg")
    summaries.add({"input": second}, "prime cfg")  # untagged: not counted, not compared
    one, two, three = summaries.out
    assert (one["tag"], one["n"], one["uncached"]) == ("cfg", 1, one["input"])
    head = len(b'{"role":"user","content":"' + b"x" * 100 + b'"}')
    assert (two["n"], two["input"] - two["uncached"]) == (2, head)
    assert three["uncached"] == three["input"]
    assert len(summaries.out) == 3


def test_the_verdict_keeps_a_mechanism_only_for_a_five_percent_saving(bench: ModuleType) -> None:
    nan = float("nan")
    assert bench.verdict(0.049, 0.0, nan) == "remove"
    assert bench.verdict(0.05, -0.2, nan) == "keep (wall +5.0%)"
    assert bench.verdict(0.01, 0.08, 0.061) == "keep (tokens +8.0%, memory +6.1%)"
    assert bench.verdict(nan, nan, -0.5) == "remove"
    assert bench.relative_saving(95.0, 100.0) == pytest.approx(0.05)
    assert bench.relative_saving(1.0, nan) != bench.relative_saving(1.0, nan)  # unknown
    figures = bench.Figures(1.0, 1.0, {}, input_kb=100.0, uncached_kb=10.0, rss_mb=nan, paths={})
    assert bench.billed_kb(figures) == pytest.approx(10.0 + bench.CACHED_INPUT_PRICE * 90.0)
    on = bench.Figures(90.0, 1.0, {0: 90.0, 1: 100.0}, 0.0, 0.0, nan, {})
    off = bench.Figures(100.0, 1.0, {0: 100.0, 1: 100.0, 2: 50.0}, 0.0, 0.0, nan, {})
    median, low, high = bench.saving(on, off)  # paired by round, rounds of one side ignored
    assert (low, high) == (pytest.approx(0.0), pytest.approx(0.1))
    assert median == pytest.approx(0.05)


def test_every_mechanism_has_an_on_and_an_off_configuration(bench: ModuleType) -> None:
    rows = bench.mechanisms(1000, 10000)
    assert {row.key for row in rows} == set(bench.MECHANISM_KEYS)
    for row in rows:
        assert row.on.off is None
        assert row.off.off in bench.SWITCHES
        assert row.on.kind == row.off.kind
        assert row.on.messages == row.off.messages
        assert row.on.name != row.off.name
    assert len(bench.instructions(8)) >= 8 * 1024
    args = bench.parse_args(["--quick"])
    assert (args.delays, args.sizes, args.idle_wait) == ([0.0, 0.3], (200, 1000), 0)
    assert bench.parse_args([]).delays == [0.0, bench.REALISTIC_DELAY_S]


@pytest.mark.codex
def test_the_quick_run_prints_every_mechanism_on_its_paths_with_a_verdict(
    tmp_path: Path, codex_binary: Path, bench: ModuleType
) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--tmp", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "proxy CONNECT attempts (internet): 0" in out
    assert "turns off the assumed path" not in out
    rows = [line for line in out.splitlines() if " | " in line and re.search(r"\d+s \|", line)]
    # Each row's path check: ON took the mechanism's fast path, OFF did not.
    paths = {
        "kept forks": ("fork-continue:2", "fork-new:2"),
        "conversion memo": ("fork-continue:2", "fork-continue:2"),
        "lazy projection": ("lazy:2", "framed:2"),
        "session read cache": ("lazy:2", "lazy:2"),
        "stripped-history cache": ("lazy:2", "lazy:2"),
    }
    for title, (on, off) in paths.items():
        mine = [line for line in rows if line.startswith(title)]
        sizes = 2 if title in ("kept forks", "conversion memo") else 1
        assert len(mine) == 2 * sizes, (title, mine)  # at 0 s and at 0.3 s
        for line in mine:
            path_on, path_off = line.split(" | ")[-2].split(" / ")
            assert (path_on, path_off) == (on, off), line
    # The kept fork of a 200-message session that only grows: the whole assembly is sent
    # both ways, and the figures of what the model was sent are there.
    kept = next(line for line in rows if line.startswith("kept forks") and " 200 " in line)
    sent_on, sent_off = kept.split(" | ")[5].split("/")
    assert float(sent_on) > 50
    assert float(sent_off) > 50
    verdicts = re.findall(r"^  (\S+)\s+.+\s(keep|remove)$", out, re.MULTILINE)
    assert sorted(key for key, _ in verdicts) == sorted(bench.MECHANISM_KEYS)
    assert set(paths) == {title for _, title, *_ in bench.MECHANISM_TABLE}
