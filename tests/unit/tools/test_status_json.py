"""``gemini_ckpt status --json`` is strict JSON: a non-finite number (a rate over no time, a
counter a store computed from nothing) is written as null, never ``NaN``/``Infinity``."""

from __future__ import annotations

import json

from gemini_ckpt.cli.status import ClusterStatus, HostStatus, NamespaceStatus, finite_json


def test_status_json_has_no_nan_or_infinity():
    host = HostStatus(
        slot=0,
        node_id="n0",
        node_alive=True,
        store_alive=True,
        interleave={"yield_rate": float("nan"), "waits": [1.5, float("inf")]},
        memory={"ratio": float("-inf")},
    )
    status = ClusterStatus(namespaces=[NamespaceStatus(namespace="job", hosts=(host,), versions=())])
    text = json.dumps(status.to_dict(), sort_keys=True, default=str, allow_nan=False)  # raises on NaN
    doc = json.loads(text)
    [h] = doc["namespaces"][0]["hosts"]
    assert h["interleave"] == {"yield_rate": None, "waits": [1.5, None]}
    assert h["memory"] == {"ratio": None}
    assert h["slot"] == 0 and h["node_alive"] is True


def test_finite_json_keeps_finite_values_and_types():
    assert finite_json({"a": 1, "b": "x", "c": [0.25, None, True]}) == {"a": 1, "b": "x", "c": [0.25, None, True]}
