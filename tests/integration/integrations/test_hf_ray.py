"""``examples/hf_trainer_ray.py`` on the session cluster: a Hugging Face ``Trainer`` under Ray Train
(2 gloo workers, Ray's ``prepare_trainer`` and gemini_ckpt's), rank 1 SIGKILLed right after a
committed version; Ray Train restarts the workers, ``train()`` resumes from peer memory with no step
lost, and the run ends where an uninterrupted one does, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import paths

pytest.importorskip("transformers")

ROOT = str(paths.ROOT)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_a_killed_trainer_worker_resumes_from_memory_bit_identically(ray_cluster, tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "hf_trainer_ray.py"),
            "--address",
            ray_cluster.address,
            "--steps",
            "12",
            "--kill-at",
            "5",
            "--storage",
            str(tmp_path),
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "killed run: restored step 5 from memory" in out, out[-4000:]
    assert "losses after the failure identical: True; final parameters identical: True" in out, out[-4000:]
    assert os.path.exists(tmp_path / "killed" / "killed"), "the worker was never killed"
