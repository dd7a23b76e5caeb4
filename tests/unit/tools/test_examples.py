"""``examples/train_local.py`` runs as the README says, in a fast mode (the Ray example:
``tests/integration/integrations/test_examples_ray.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import paths


ROOT = str(paths.ROOT)
EXAMPLES = os.path.join(ROOT, "examples")


def _run(args: list[str], cwd: str, timeout: float) -> str:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def test_train_local_crashes_rebuilds_and_resumes_bit_identically(tmp_path):
    out = _run(
        [os.path.join(EXAMPLES, "train_local.py"), "--steps", "16", "--crash-at", "9", "--log-every", "5"],
        str(tmp_path),
        timeout=300,
    )
    assert "restored step 8" in out
    assert "losses identical: True; final parameters identical: True" in out
