"""``examples/lightning_ray.py`` runs as its docstring says: Lightning on Ray Train (2 gloo workers,
``RayDDPStrategy``), one worker SIGKILLed after a committed step, Ray restarts the workers, ``fit()``
resumes from peer memory, and the final parameters equal an uninterrupted run's bit for bit. On the
session cluster (``--address``), in a subprocess, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import paths

ROOT = str(paths.ROOT)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_lightning_on_ray_train_resumes_from_memory_bit_identically(ray_cluster, tmp_path):
    pytest.importorskip("lightning")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "lightning_ray.py"),
            "--quick",
            "--address",
            ray_cluster.address,
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "VERDICT: PASS" in out, out[-4000:]
    restored = re.search(r"restored step (\d+) from memory", out)
    assert restored is not None and int(restored.group(1)) >= 1, out[-4000:]
    assert "identical to the uninterrupted run's" in out
