"""Tests for ``placement advise``, the command line of the ETTR model: its report and JSON,
costs taken from benchmark results (``--from-bench``), plots, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import paths

ROOT = paths.ROOT


# ---- CLI ------------------------------------------------------------------------------


def run_cli(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "placement", "advise", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_defaults_need_only_hosts():
    out = run_cli("--hosts", "1024")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Young/Daly sqrt(2 C M) = 1154 s" in text
    assert (
        'CheckpointConfig(replicas=2, placement="group", keep_in_memory=2, persist_every=215, '
        'durable_uri="runs/my-job")' in text
    )
    assert "save every 5 steps" in text
    assert "ETTR 97.55% vs 92.37% durable only" in text
    assert "monte carlo (seed 0, 20000 failures" in text
    starred = [line for line in text.splitlines() if line.startswith("*")]
    assert len(starred) == 1 and starred[0].split()[1:5] == ["2", "group", "5", "215"]


def test_cli_json_has_the_documented_shape():
    out = run_cli("--hosts", "1024", "--json", "--simulate", "2000")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc["durable_only"]) >= {"interval_steps", "interval_s", "ettr"}
    assert doc["durable_only"]["interval_steps"] == 113
    assert set(doc["recommended"]) >= {"replicas", "placement", "persist_every", "keep_in_memory", "ettr"}
    assert (doc["recommended"]["replicas"], doc["recommended"]["placement"]) == (2, "group")
    assert len(doc["candidates"]) == 21
    assert {c["replicas"] for c in doc["candidates"]} == {1, 2, 3}
    mc = doc["monte_carlo"]["recommended"]
    assert mc["events"] == 2000 and abs(mc["relative_error"]) < 0.01
    assert doc["inputs"]["cost_sources"]["stall_s"] == "default"


def _bench_results(directory: Path) -> None:
    """Files shaped exactly as the benchmark scripts write them (values invented)."""
    (directory / "save.json").write_text(
        json.dumps(
            {
                "state_bytes": 1,
                "seconds": {"gemini_ckpt save() stall": 0.094, "dcp.save to local disk": 1.68},
            }
        )
    )
    (directory / "replicate.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"method": "gemini_ckpt replicas=2", "replicas": 2, "stall_s": 0.1, "commit_s": 3.09, "put_s": 2.0},
                    {"method": "gemini_ckpt replicas=3", "replicas": 3, "stall_s": 0.1, "commit_s": 4.09, "put_s": 3.0},
                    {"method": "DCP async_save to local disk", "replicas": 1, "stall_s": 0.5, "commit_s": 1.82},
                ]
            }
        )
    )
    (directory / "restore.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"method": "gemini_ckpt: local memory (same hosts)", "seconds": 0.89},
                    {"method": "stock dcp.load, local disk, page cache warm", "seconds": 0.4},
                    {"method": "gemini_ckpt: peer memory (ranks moved to other hosts)", "seconds": 2.26},
                    {"method": "gemini_ckpt: durable tier, page cache warm", "seconds": 0.7},
                    {"method": "gemini_ckpt: durable tier, page cache dropped", "seconds": 1.11},
                ]
            }
        )
    )
    (directory / "recovery.json").write_text(
        json.dumps(
            {
                "ratio_with_restart": 1.9,
                "costs": {"restart_host_s": 21.5, "restore_peer_s": 0.3},
            }
        )
    )


def test_cli_from_bench_takes_measured_costs_and_names_the_rest(tmp_path):
    _bench_results(tmp_path)
    out = run_cli("--hosts", "64", "--from-bench", str(tmp_path), "--restore-peer", "9", "--json", "--simulate", "0")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    costs, sources = doc["inputs"]["costs"], doc["inputs"]["cost_sources"]
    assert costs["stall_s"] == 0.094 and costs["durable_save_s"] == 1.68
    assert costs["commit_s"] == [1.0, 3.09, 4.09]  # replicas 1 not measured: the default
    assert "replicas 1: default" in sources["commit_s"]
    assert costs["restore_local_s"] == 0.89 and costs["restore_durable_s"] == 1.11
    assert costs["restore_peer_s"] == 9.0 and sources["restore_peer_s"] == "--restore-peer"
    assert costs["restart_host_s"] == 21.5 and sources["restart_host_s"] == "bench: recovery.json costs.restart_host_s"
    assert doc["inputs"]["bench_missing"] == ["persist_s", "persist_stall_s"]
    assert sources["persist_s"] == "default (not in the bench results)"
    text = run_cli("--hosts", "64", "--from-bench", str(tmp_path / "restore.json"), "--simulate", "0")
    assert text.returncode == 0, text.stderr
    assert "not in the bench results, default used: stall_s, commit_s, persist_s" in text.stdout


def test_cli_from_bench_refuses_hostile_sizes_and_nesting_with_one_line(tmp_path):
    """A benchmark file is not trusted to size the work: a row claiming 10^8
    copies took 141 s and 10.5 GB, a deeply nested file was a RecursionError traceback."""
    (tmp_path / "replicate.json").write_text(
        json.dumps(
            {"rows": [{"method": "gemini_ckpt replicas=huge", "replicas": 100_000_000, "commit_s": 1.0, "put_s": 1.0}]}
        )
    )
    t0 = time.monotonic()
    out = run_cli("--hosts", "16", "--from-bench", str(tmp_path / "replicate.json"), "--simulate", "0")
    assert out.returncode == 2 and time.monotonic() - t0 < 30, (out.returncode, out.stderr[-2000:])
    assert "replicas=100000000; a benchmark measures 1 to 64 copies" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "replicate.json").write_text("[" * 100_000 + "]" * 100_000)
    out = run_cli("--hosts", "16", "--from-bench", str(tmp_path / "replicate.json"), "--simulate", "0")
    assert out.returncode == 2 and "nested too deeply" in out.stderr and "Traceback" not in out.stderr, out.stderr[
        -2000:
    ]
    (tmp_path / "replicate.json").write_text(
        json.dumps(
            {"rows": [{"method": "gemini_ckpt replicas=2", "replicas": 2, "commit_s": float("inf"), "put_s": 1.0}]}
        )
    )
    doc = json.loads(
        run_cli("--hosts", "16", "--from-bench", str(tmp_path / "replicate.json"), "--json", "--simulate", "0").stdout
    )
    assert "commit_s" in doc["inputs"]["bench_missing"]  # an infinite cost is not a measurement


def test_cli_from_bench_reads_persist_stalls(tmp_path):
    (tmp_path / "persist.json").write_text(
        json.dumps(
            {
                "persist": {"committed_to_persisted_s": 4.0, "save_to_persisted_s": 5.0, "gbps": 0.25},
                "stall": {"memory_only_s": 0.10, "persisting_step_s": 0.25, "next_step_during_persist_s": 0.15},
            }
        )
    )
    doc = json.loads(
        run_cli("--hosts", "16", "--from-bench", str(tmp_path / "persist.json"), "--json", "--simulate", "0").stdout
    )
    assert doc["inputs"]["costs"]["persist_s"] == 4.0
    assert doc["inputs"]["costs"]["persist_stall_s"] == pytest.approx(0.20)


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ettr.png"
    out = run_cli("--hosts", "256", "--plot", str(path), "--simulate", "0")
    assert out.returncode == 0, out.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in out.stdout


def test_cli_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from placement._cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as info:
        main(["advise", "--hosts", "16", "--simulate", "0", "--plot", str(tmp_path / "x.png")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--plot: matplotlib is not installed" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--hosts", "0"], "--hosts"),
        (["--hosts", "8", "--domain-size", "4"], "--domain-size: correlated failures need both --domain-size"),
        (["--hosts", "8", "--domain-size", "16", "--domain-mtbf", "100"], "--domain-size: 16 hosts"),
        (["--hosts", "8", "--stall", "-1"], "--stall"),
        (["--hosts", "8", "--step-time", "nan"], "--step-time"),
        (["--hosts", "8", "--host-mtbf", "5", "--failures-per-day", "1"], "--failures-per-day"),
        (["--hosts", "8", "--commit-time", "2=x"], "--commit-time"),
        (["--hosts", "8", "--from-bench", "/no/such/results"], "--from-bench: '/no/such/results' does not exist"),
        (["--hosts", "8", "--domain-layout", "racks"], "--domain-layout"),
    ],
)
def test_cli_errors_are_one_line_naming_the_flag(args, needle):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr


def test_cli_4096_hosts_under_five_seconds():
    start = time.perf_counter()
    out = run_cli("--hosts", "4096")
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert elapsed < 5.0, f"{elapsed:.2f}s"


def test_failures_per_day_is_host_mtbf():
    out = run_cli("--hosts", "64", "--failures-per-day", "0.003", "--json", "--simulate", "0")
    a = json.loads(out.stdout)
    assert a["inputs"]["failures"]["host_mtbf_h"] == pytest.approx(8000.0)
