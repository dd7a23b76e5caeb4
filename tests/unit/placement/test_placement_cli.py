"""Tests for the pure ``placement`` package as shipped: its CLI (``python -m placement``), its
docstring examples, its standard-library-only imports and its public surface."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from math import comb

import pytest

import placement
from placement import PlacementError, recovery_probability
from placement_support import brute_survivable
import paths

ROOT = paths.ROOT


def test_docstring_examples():
    import placement._planner
    import placement._strategies

    for module in (placement, placement._planner, placement._strategies):
        result = doctest.testmod(module, extraglobs=vars(placement), verbose=False)
        assert result.failed == 0 and (module is placement or result.attempted > 0)


# ---- CLI and packaging ------------------------------------------------------


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "placement", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_report_json():
    out = run_cli("report", "--hosts", "16", "--replicas", "2", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["strategies"] == ["group", "ring", "mixed"]
    assert [row["k"] for row in doc["rows"]] == [1, 2, 3, 4]  # min(N, m + 2)
    k2 = doc["rows"][1]
    assert k2["strategies"]["group"] == {"probability": "14/15", "percent": 93.33, "fatal_sets": 8}
    assert k2["strategies"]["ring"]["probability"] == "13/15"
    assert k2["best"] == ["group", "mixed"]


def test_cli_report_table_and_missing_group():
    out = run_cli("report", "--hosts", "16", "--replicas", "3", "--max-failures", "5")
    assert out.returncode == 0, out.stderr
    assert "98.57%" in out.stdout and "group: n/a" in out.stdout
    lines = [line.split() for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [line[0] for line in lines] == ["1", "2", "3", "4", "5"]
    assert lines[2][-1] == "mixed"


def test_cli_explains_a_failure():
    out = run_cli("report", "--hosts", "16", "--replicas", "2", "--failed", "3,4")
    assert out.returncode == 0, out.stderr
    assert "host 3: read from host 2" in out.stdout
    assert "host 4: read from host 5" in out.stdout
    lost = run_cli("report", "--hosts", "16", "--replicas", "2", "--strategy", "group", "--failed", "2,3")
    assert "host 2: LOST" in lost.stdout and "durable tier is needed" in lost.stdout
    doc = json.loads(
        run_cli("report", "--hosts", "5", "--replicas", "2", "--strategy", "auto", "--failed", "2", "--json").stdout
    )
    plan = doc["plans"]["mixed"]
    assert plan["sources"]["2"] == 3 and plan["tier"] == "memory"


def test_cli_show_with_domains():
    out = run_cli("show", "--hosts", "8", "--replicas", "2", "--strategy", "ring", "--domains", "a*4,b*4")
    assert out.returncode == 0, out.stderr
    assert "no host has two copies in one domain" in out.stdout
    assert "who holds whom" in out.stdout
    doc = json.loads(run_cli("show", "--hosts", "5", "--replicas", "2", "--json").stdout)
    assert doc["strategy"] == "mixed" and doc["holders"]["4"] == [4, 2]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["report", "--hosts", "16", "--replicas", "3", "--strategy", "group"], "strategy:"),
        (["report", "--hosts", "4", "--replicas", "5"], "replicas:"),
        (["report", "--hosts", "four", "--replicas", "2"], "--hosts"),
        (["report", "--hosts", "4", "--replicas", "2", "--failed", "7"], "failed:"),
        (["show", "--hosts", "4", "--replicas", "2", "--domains", "a,b"], "domains:"),
        (["show", "--hosts", "4", "--replicas", "2", "--strategy", "star"], "--strategy"),
    ],
)
def test_cli_errors_are_one_line_exit_2(args, needle):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr


def test_import_pulls_in_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import placement, placement._cli; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'placement'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_public_surface_is_small():
    assert len(placement.__all__) <= 15
    assert all(hasattr(placement, name) for name in placement.__all__)


def test_hand_built_placement_with_several_rings():
    """Placement is a public dataclass: custom cells are validated and counted exactly."""
    p = placement.Placement(strategy="custom", hosts=9, replicas=2, groups=((0, 1),), rings=((2, 4, 3), (5, 6, 7, 8)))
    assert p.holders(4) == (4, 3) and p.holders(8) == (8, 5)
    counts = brute_survivable(p)
    assert [recovery_probability(p, k) * comb(9, k) for k in range(10)] == counts
    with pytest.raises(PlacementError, match="^groups/rings:"):
        placement.Placement(strategy="custom", hosts=4, replicas=2, groups=((0, 1), (1, 2)))
    with pytest.raises(PlacementError, match="^rings:"):
        placement.Placement(strategy="custom", hosts=3, replicas=2, groups=((0, 1),), rings=((2,),))


def test_cli_never_rounds_to_a_false_certainty(capsys):
    from placement._cli import main

    assert main(["report", "--hosts", "4096", "--replicas", "3", "--max-failures", "3"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("   3")]
    assert row and ">99.99%" in row[0] and "100.00%" not in row[0]
