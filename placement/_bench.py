"""Costs measured by ``python -m benchmarks``, read back for ``advise --from-bench``.

The benchmark scripts write one JSON file each (``save.json``, ``replicate.json``,
``restore.json``, ``persist.json``, ``overhead.json``, ``recovery.json`` under
``benchmarks/results/``, or
``--out`` elsewhere).  Files are recognised by what they contain, not by name, so a
renamed run (``restore_1gb.json``) still counts.  Only costs are taken: failure rates and
the step time belong to the user's job, not to this machine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import PlacementError

__all__ = ["BENCH_FIELDS", "BenchCosts", "read_bench"]

#: The most copies a ``replicate.json`` row may claim (a file is not trusted to size the work).
MAX_REPLICAS = 64
#: The largest benchmark file read (the real ones are a few hundred KB).
MAX_BYTES = 16 << 20

#: Cost fields a benchmark can supply, in the order they are reported.
BENCH_FIELDS = (
    "stall_s",
    "commit_s",
    "persist_s",
    "persist_stall_s",
    "restore_local_s",
    "restore_peer_s",
    "restore_durable_s",
    "durable_save_s",
    "restart_host_s",
)

_STALL = "gemini_ckpt save() stall"
_DCP_SAVE = "dcp.save to local disk"
_LOCAL = "gemini_ckpt: local memory (same hosts)"
_PEER = "gemini_ckpt: peer memory (ranks moved to other hosts)"
_DURABLE = ("gemini_ckpt: durable tier, page cache dropped", "gemini_ckpt: durable tier, page cache warm")


@dataclass(frozen=True)
class BenchCosts:
    """Cost values found, where each came from, and the fields no file supplied.

    ``commit_s`` maps a replicas count to seconds (``replicate.json`` measures 2 and 3).
    """

    values: dict[str, Any]
    sources: dict[str, str]
    missing: tuple[str, ...]
    files: tuple[str, ...]


def read_bench(paths: Iterable[str | Path]) -> BenchCosts:
    """Read benchmark JSON files (a directory means every ``*.json`` directly in it)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(path.glob("*.json"))
        elif path.is_file():
            files.append(path)
        else:
            raise PlacementError(
                f"from_bench: {str(raw)!r} does not exist; pass a JSON file written by "
                "`python -m benchmarks` or its results directory (benchmarks/results)"
            )
    if not files:
        raise PlacementError(f"from_bench: no *.json in {', '.join(map(str, paths))}; run `python -m benchmarks` first")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(name: str, value: object, where: str) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf:
            values[name] = float(value)
            sources[name] = where

    for path in files:
        try:
            if path.stat().st_size > MAX_BYTES:
                raise ValueError(f"{path.stat().st_size} bytes, more than a benchmark writes ({MAX_BYTES})")
            doc = json.loads(path.read_text())
        except RecursionError:
            raise PlacementError(
                f"from_bench: cannot read {path}: nested too deeply to be a benchmark's JSON"
            ) from None
        except (OSError, ValueError) as exc:
            raise PlacementError(f"from_bench: cannot read {path}: {exc}") from None
        if not isinstance(doc, dict):
            continue
        name = path.name
        seconds = doc.get("seconds")
        if isinstance(seconds, dict):  # bench_save
            take("stall_s", seconds.get(_STALL), f"{name} seconds[{_STALL!r}]")
            take("durable_save_s", seconds.get(_DCP_SAVE), f"{name} seconds[{_DCP_SAVE!r}]")
        rows = [r for r in doc.get("rows", []) if isinstance(r, dict)]
        for row in rows:  # bench_replicate: one row per replicas count
            replicas = row.get("replicas")
            if "put_s" in row and isinstance(replicas, int) and not isinstance(replicas, bool):
                if not 1 <= replicas <= MAX_REPLICAS:
                    raise PlacementError(
                        f"from_bench: {name} claims a row of replicas={replicas}; a benchmark "
                        f"measures 1 to {MAX_REPLICAS} copies"
                    )
                commit = values.setdefault("commit_s", {})
                seconds = row.get("commit_s")
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < math.inf:
                    commit[row["replicas"]] = float(row["commit_s"])
                    sources["commit_s"] = f"{name} rows[replicas=*].commit_s"
        by_method = {r.get("method"): r.get("seconds") for r in rows}
        take("restore_local_s", by_method.get(_LOCAL), f"{name} rows[{_LOCAL!r}].seconds")
        take("restore_peer_s", by_method.get(_PEER), f"{name} rows[{_PEER!r}].seconds")
        for method in reversed(_DURABLE):  # page cache dropped wins over warm
            take("restore_durable_s", by_method.get(method), f"{name} rows[{method!r}].seconds")
        persist = doc.get("persist")
        if isinstance(persist, dict):  # bench_persist
            take("persist_s", persist.get("committed_to_persisted_s"), f"{name} persist.committed_to_persisted_s")
            stall = doc.get("stall")
            if isinstance(stall, dict) and all(
                isinstance(stall.get(k), (int, float))
                for k in ("memory_only_s", "persisting_step_s", "next_step_during_persist_s")
            ):
                base = stall["memory_only_s"]
                extra = max(0.0, stall["persisting_step_s"] - base) + max(
                    0.0, stall["next_step_during_persist_s"] - base
                )
                take("persist_stall_s", extra, f"{name} stall: persisting step + next step, minus twice memory-only")
        costs = doc.get("costs")
        if isinstance(costs, dict) and "ratio_with_restart" in doc:  # bench_recovery
            # From the host's loss to Ray Train's new workers in the training function, with a
            # replacement host at hand (a real cluster adds the time to provision one).
            take("restart_host_s", costs.get("restart_host_s"), f"{name} costs.restart_host_s")
        if "stall_s" not in values and "throughput_every_step" in doc:  # bench_overhead
            take("stall_s", doc.get("stall_s"), f"{name} stall_s")
    if "commit_s" in values and not values["commit_s"]:
        del values["commit_s"]
    missing = tuple(f for f in BENCH_FIELDS if f not in values)
    return BenchCosts(values, sources, missing, tuple(str(f) for f in files))
