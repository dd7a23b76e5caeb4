"""``examples/ray_train_fsdp.py`` runs as the README says, in a fast mode, on the session cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import paths

ROOT = str(paths.ROOT)
EXAMPLES = os.path.join(ROOT, "examples")


def _run(args: list[str], cwd: str, timeout: float) -> str:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_ray_train_fsdp_runs_on_a_cluster_without_a_run_name(ray_cluster, tmp_path):
    """No ``--name``: Ray names the run, and the example's ``host_stores(run_config=...)``
    stops that run's stores when ``fit()`` ends."""
    from gemini_ckpt.hoststore.cluster import named_actors

    before = set(named_actors())
    out = _run(
        [
            os.path.join(EXAMPLES, "ray_train_fsdp.py"),
            "--address",
            ray_cluster.address,
            "--workers",
            "2",
            "--steps",
            "12",
            "--storage",
            str(tmp_path / "runs"),
        ],
        str(tmp_path),
        timeout=600,
    )
    assert "final metrics" in out and "'step': 11" in out
    runs = os.listdir(tmp_path / "runs")
    assert len(runs) == 1 and runs[0].startswith("ray_train_run-"), runs
    assert os.path.isdir(tmp_path / "runs" / runs[0] / "gemini" / "step_000000011")
    assert set(named_actors()) - before == set(), "the run's host stores outlived fit()"
