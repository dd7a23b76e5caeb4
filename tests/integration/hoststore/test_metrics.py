"""Metrics in Ray's Prometheus export: 4 ranks, one per host, save 6 versions (every 2nd persisted)
and restore one. The first test scrapes every node's metrics endpoint over HTTP (what Prometheus
does) and finds what the job did: 6 versions committed per rank, the staged bytes, 3 persisted, the
newest steps, the restore, each host store's held bytes and budget and the bytes it replicated.
The second lets a real Prometheus server (Debian's ``prometheus``, where installed) scrape the
nodes and asks it every query of the Grafana dashboard in docs/grafana."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest
import ray
import paths

ROOT = str(paths.ROOT)
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>.*)\})? (?P<value>\S+)$")
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


@pytest.fixture(scope="module")
def job(ray_cluster, ranks, tmp_path_factory) -> str:
    """The job both tests look at; its namespace."""
    ns = f"metrics-{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp("durable")
    ranks.restart(ns, persist_every=2, durable_uri=str(root / ns), keep_in_memory=2)
    ranks.call("train", list(range(6)))
    ray.get([w.__ray_call__.remote(lambda w: w.ckpt.wait_persisted()) for w in ranks.workers], timeout=300)
    ranks.restart(ns, persist_every=2, durable_uri=str(root / ns), keep_in_memory=2)
    restored = ranks.call("restore")
    assert all(r["step"] == 5 for r in restored), restored
    return ns


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci  # the job's setup takes ~35 s on a busy machine: CI runs both after the default suite
def test_the_job_is_visible_in_rays_prometheus_export(job):
    ns = job

    def complete(samples) -> bool:
        committed = [
            _value(samples, "ray_gemini_ckpt_versions_total", namespace=ns, rank=r, outcome="committed")
            for r in range(4)
        ]
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expr: str) -> list[dict]:
    """One instant PromQL query; raises with Prometheus' own message when it is not valid."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = json.load(urllib.request.urlopen(url, timeout=10))
    except urllib.error.HTTPError as e:  # 400 / 422: a bad query, with the reason in the body
        raise AssertionError(f"{expr}: {e.read().decode()}") from None
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Debian's prometheus server is not installed (.ci/run installs it where it can: apt-get install prometheus)",
)
def test_a_prometheus_server_scrapes_the_nodes_and_answers_every_dashboard_query(job, tmp_path):
    ns = job
    targets = [
        f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}"
        for n in ray.nodes()
        if n["Alive"] and n.get("MetricsExportPort")
    ]
    assert len(targets) >= 4, ray.nodes()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
            }
        )
    )
    port = _free_port()
    log = open(tmp_path / "prometheus.log", "w")
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        committed = f'sum(ray_gemini_ckpt_versions_total{{namespace="{ns}",outcome="committed"}})'
        deadline = time.monotonic() + 90
        result: list = []
        while time.monotonic() < deadline and server.poll() is None:
            try:
                result = _query(port, committed)
                if result and float(result[0]["value"][1]) == 24.0:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(1.0)
        assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
        assert result and float(result[0]["value"][1]) == 24.0, result  # 6 versions x 4 ranks
        time.sleep(3.0)  # a few more scrapes, so rate() has two samples of every series

        with open(os.path.join(ROOT, "docs", "grafana", "gemini_ckpt.json")) as f:
            board = json.load(f)
        answers = {}
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$namespace", ns)  # a regex; the name has no special characters
                answers[target["expr"]] = _query(port, expr)  # every query is valid PromQL
        by_title = {p["title"]: [answers[t["expr"]] for t in p["targets"]] for p in board["panels"]}

        def panel(start: str) -> list[list[dict]]:
            (found,) = [v for k, v in by_title.items() if k.startswith(start)]
            return found

        (lag,) = panel("How far behind is durable")
        assert [float(r["value"][1]) for r in lag] == [0.0]  # newest committed 5, newest durable 5
        (fill,) = panel("Is a host running out of memory")
        assert len(fill) == 4 and all(0 < float(r["value"][1]) <= 1 for r in fill), fill
        (held,) = panel("Bytes held per host")
        assert len(held) == 4 and all(float(r["value"][1]) > 0 for r in held), held
        (stages,) = panel("What did the last failure cost")
        assert "done" in {r["metric"].get("stage") for r in stages}, stages
        (versions,) = panel("Versions held per host")
        assert {r["metric"].get("host") for r in versions} and all(float(r["value"][1]) >= 0 for r in versions)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
