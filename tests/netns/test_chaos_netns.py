"""The chaos harness on hosts with their own network namespaces (``chaos --network netns``): one
network scenario, ``partition-host``, end to end. Host 1 is cut off (alive) until Ray declares it
dead, the job restarts without it and restores what the planner predicts, the link comes back and
the old host's processes are fenced, and the run continues bit for bit.

Ray runs in a child process (a process joins one Ray cluster; the integration tier's session
cluster is another). Where namespaces can't be made, the test skips with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gemini_ckpt.testing import netns

REASON = netns.unavailable_reason()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_a_partitioned_host_is_lost_to_the_job_then_fenced_when_it_comes_back(tmp_path):
    report = tmp_path / "chaos.json"
    before = _ours()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gemini_ckpt",
            "chaos",
            "--network",
            "netns",
            "--link",
            "1gbit",
            "-k",
            "partition-host",
            "--json",
            str(report),
            "-q",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert report.exists(), done.stderr[-4000:]
    doc = json.loads(report.read_text())
    (s,) = doc["scenarios"]
    checks = {c["name"]: c for c in s["checks"]}
    assert s["verdict"] == "PASS", (done.stdout[-4000:], s)
    assert s["predicted"]["label"] == "memory@2" and checks["prediction"]["ok"]
    assert checks["fenced"]["ok"], checks["fenced"]["detail"]
    assert 5 <= s["timings"]["declared_dead_1_s"] <= 60  # silent, not refused: Ray's health checks decide
    assert done.returncode == 0
    assert _ours() <= before  # the harness's cluster removed every namespace it made


def _ours() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return {line.split()[0] for line in listed if line.startswith("gck")}
