"""Elastic from memory on Ray Train: a host lost with no node to take its place, the run goes on
with the others in their own processes (renumbered, restoring the newest committed version
resharded from the host stores' memory), and grows back when the host returns.

On the session's cluster (head without CPUs + 4 simulated hosts). Run:
``python -m pytest tests/integration/integrations/test_ray_elastic.py -m slow -q``
"""

from __future__ import annotations

import json
import os

import pytest

from gemini_ckpt.demo.options import DemoOptions

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HOSTS = 4


def _events(report) -> list[dict]:
    with open(os.path.join(report.run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
def test_a_lost_host_nobody_replaces_shrinks_the_run_in_place_and_it_grows_back_from_memory(ray_cluster, tmp_path):
    """The demo, elastic (2 to 4 workers, one per host, no pinning): host 2 is removed after step
    8 and no node takes its place. The three survivors go on in their own processes, renumbered
    0..2, every one restoring from memory (no durable read) the newest committed version,
    resharded to 3 ranks: the whole model and optimizer state each rank then holds equals the
    version's as it was saved at 4 ranks, bit for bit. The host then joins again and the run
    grows back to 4 workers (Ray Train's elastic resize, a full restart), again from memory and
    equal to the version saved at 3 ranks; no committed step is lost, and the run ends."""
    from gemini_ckpt.demo.driver import run_demo

    options = DemoOptions(
        hosts=HOSTS,
        kill_host=2,
        kill_at_step=8,
        steps=90,
        persist_every=50,
        out=str(tmp_path),
        replacement=False,
        host_returns_s=4.0,
        full_digests=True,
    )
    report = run_demo(options, cluster=ray_cluster)
    text = report.format()
    print(text)
    events = _events(report)
    failure = next(e for e in events if e["kind"] == "failure")
    restores = [e for e in events if e["kind"] == "restore" and e["unix"] > failure["unix"]]
    shrink = [e for e in restores if e["world"] == HOSTS - 1]
    grow = [e for e in restores if e["world"] == HOSTS and e["unix"] > shrink[-1]["unix"]] if shrink else []
    assert len(shrink) == HOSTS - 1 and len(grow) == HOSTS, restores
    for recovery in (shrink, grow):
        assert {e["source"] for e in recovery} == {"memory"} and len({e["step"] for e in recovery}) == 1, recovery
        assert all(e["bytes_durable"] == 0 for e in recovery), recovery
    # the survivors kept their processes: the three pids of the shrink were workers before it
    before = {e["pid"] for e in events if e["kind"] == "start" and e["unix"] < failure["unix"]}
    assert {e["pid"] for e in shrink} <= before and len({e["pid"] for e in shrink}) == HOSTS - 1
    assert {e["rank"] for e in shrink} == set(range(HOSTS - 1))
    # no committed step lost: the shrink restored the newest version committed before the failure
    committed = [e["step"] for e in events if e["kind"] == "commit" and e["unix"] <= failure["unix"]]
    assert shrink[0]["step"] >= max(committed), (shrink[0]["step"], max(committed))
    # the state restored, whole, is the version's as it was saved (at the other world size)
    saved = {(e["step"], e["world"]): e["digest"] for e in events if e["kind"] == "saved_full"}
    for recovery, world_saved in ((shrink, HOSTS), (grow, HOSTS - 1)):
        step = recovery[0]["step"]
        restored = {e["digest"] for e in events if e["kind"] == "restored_full" and e["step"] == step}
        assert restored == {saved[(step, world_saved)]}, (step, world_saved)
    steps_before_grow = [
        e["step"] for e in events if e["kind"] == "step" and e["unix"] < min(e["t_start"] for e in grow)
    ]
    assert grow[0]["step"] >= max(steps_before_grow) - 1
    assert report.world_after == HOSTS - 1 and report.grow is not None and report.grow["world"] == HOSTS, text
    assert report.final_loss is not None, text
