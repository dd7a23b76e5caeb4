"""The Grafana dashboard in docs/grafana is valid dashboard JSON, and every panel's query names only
metrics gemini_ckpt exports (as Ray's Prometheus export names them)."""

from __future__ import annotations

import json
import os
import re
import paths

ROOT = str(paths.ROOT)


def test_the_grafana_dashboard_queries_only_exported_metrics():
    from gemini_ckpt.hoststore.metrics import STORE, TRAINER

    with open(os.path.join(ROOT, "docs", "grafana", "gemini_ckpt.json")) as f:
        board = json.load(f)
    exported = set()
    for name, (kind, _, _) in {**TRAINER, **STORE}.items():
        base = f"ray_gemini_ckpt_{name}"
        exported |= (
            {base + "_total"}
            if kind == "counter"
            else {base + "_bucket", base + "_sum", base + "_count"}
            if kind == "histogram"
            else {base}
        )
    assert board["panels"] and board.get("title") and "schemaVersion" in board
    for panel in board["panels"]:
        assert panel.get("title") and panel.get("targets"), panel
        for target in panel["targets"]:
            named = set(re.findall(r"ray_gemini_ckpt_\w+", target["expr"]))
            assert named and named <= exported, (panel["title"], named - exported)
