"""Metrics in Ray's Prometheus export: 4 ranks, one per host, save 6 versions (every 2nd persisted)
and restore one; the test scrapes every node's metrics endpoint over HTTP (what Prometheus does)
and finds what the job did: 6 versions committed per rank, the staged bytes, 3 persisted, the
newest steps, the restore, each host store's held bytes and budget and the bytes it replicated."""

from __future__ import annotations

import os
import re
import time
import urllib.request
import uuid

import pytest
import ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>.*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _scrape() -> list[tuple[str, dict, float]]:
    """Every gemini_ckpt sample of every node's metrics endpoint."""
    out = []
    for node in ray.nodes():
        if not node["Alive"] or not node.get("MetricsExportPort"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            body = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for line in body.splitlines():
            m = SAMPLE.match(line)
            if m and "gemini_ckpt_" in m["name"]:
                out.append((m["name"], dict(LABEL.findall(m["labels"] or "")), float(m["value"])))
    return out


def _value(samples, name: str, **labels) -> list[float]:
    return [v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]


def _wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        samples = _scrape()
        if predicate(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(1.0)


@pytest.mark.ray
def test_the_job_is_visible_in_rays_prometheus_export(ray_cluster, ranks, tmp_path):
    ns = f"metrics-{uuid.uuid4().hex[:8]}"
    ranks.restart(ns, persist_every=2, durable_uri=str(tmp_path / ns), keep_in_memory=2)
    ranks.call("train", list(range(6)))
    ray.get([w.__ray_call__.remote(lambda w: w.ckpt.wait_persisted()) for w in ranks.workers], timeout=300)
    ranks.restart(ns, persist_every=2, durable_uri=str(tmp_path / ns), keep_in_memory=2)
    restored = ranks.call("restore")
    assert all(r["step"] == 5 for r in restored), restored

    def complete(samples) -> bool:
        committed = [_value(samples, "ray_gemini_ckpt_versions_total", namespace=ns, rank=r, outcome="committed")
                     for r in range(4)]
        restores = _value(samples, "ray_gemini_ckpt_restores_total", namespace=ns, source="memory")
        stores = _value(samples, "ray_gemini_ckpt_host_budget_bytes", namespace=ns)
        return all(c == [6.0] for c in committed) and len(restores) == 4 and len(stores) == 4

    samples = _wait_for(complete)
    assert complete(samples), sorted({(n, lab.get("namespace")) for n, lab, _ in samples})
    for r in range(4):
        tags = dict(namespace=ns, rank=r)
        assert _value(samples, "ray_gemini_ckpt_persisted_total", **tags) == [3.0]  # steps 1, 3, 5
        assert _value(samples, "ray_gemini_ckpt_newest_committed_step", **tags) == [5.0]
        assert _value(samples, "ray_gemini_ckpt_newest_durable_step", **tags) == [5.0]
        assert _value(samples, "ray_gemini_ckpt_save_stall_seconds_count", **tags) == [6.0]
        assert _value(samples, "ray_gemini_ckpt_commit_seconds_count", **tags) == [6.0]
        staged = _value(samples, "ray_gemini_ckpt_staged_bytes_total", **tags)
        assert len(staged) == 1 and staged[0] > 0, staged
        assert _value(samples, "ray_gemini_ckpt_restored_step", **tags) == [5.0]
        assert _value(samples, "ray_gemini_ckpt_restore_stage_seconds", stage="done", **tags)
    budgets = _value(samples, "ray_gemini_ckpt_host_budget_bytes", namespace=ns)
    held = _value(samples, "ray_gemini_ckpt_host_held_bytes", namespace=ns)
    assert all(b > 0 for b in budgets) and len(held) == 4 and all(0 < h <= b for h, b in zip(held, budgets))
    replicated = _value(samples, "ray_gemini_ckpt_host_replicated_bytes_total", namespace=ns)
    assert len(replicated) == 4 and all(r > 0 for r in replicated)  # replicas=2: every host sent copies
