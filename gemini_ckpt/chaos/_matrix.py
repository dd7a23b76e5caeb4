"""Running the fault matrix, and its report (table + JSON); the scenarios are :mod:`._scenarios`."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ._harness import Harness, as_job
from ._jobrun import StoreFactory
from ._results import ScenarioResult
from ._runner import run_scenario
from ._scenarios import full_matrix
from ._spec import ChaosConfig, Scenario


# --- the report -------------------------------------------------------------------------------------
@dataclass
class MatrixReport:
    """The outcome of :func:`run_matrix`: one :class:`ScenarioResult` per scenario."""

    results: list[ScenarioResult]
    config: ChaosConfig
    seconds: float = 0.0
    reference_s: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.verdict] = out.get(r.verdict, 0) + 1
        return out

    def format_table(self) -> str:
        rows = [("scenario", "predicted", "observed", "steps lost", "recovery s", "verdict")]
        for r in self.results:
            rows.append(
                (
                    r.scenario.name,
                    r.prediction.label() if r.prediction else "-",
                    r.observed_label,
                    "-" if r.steps_lost is None else str(r.steps_lost),
                    "-" if r.recovery_s is None else f"{r.recovery_s:.1f}",
                    r.verdict,
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for r in self.results:
            if r.error:
                kind = "infrastructure error (not a verdict on the library)" if r.infra else "harness error"
                lines.append(f"{r.scenario.name}: {kind}: {r.error}")
            for c in r.failed_checks():
                lines.append(f"{r.scenario.name}: {c.name}: {c.detail}")
        counts = ", ".join(f"{v} {k}" for k, v in sorted(self.counts().items()))
        lines.append(
            f"{len(self.results)} scenarios: {counts} in {self.seconds:.0f}s (reference run {self.reference_s:.0f}s)"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {
            "ok": self.ok,
            "counts": self.counts(),
            "seconds": round(self.seconds, 1),
            "reference_s": round(self.reference_s, 1),
            "config": asdict(self.config),
            **self.meta,
            "scenarios": [r.to_json() for r in self.results],
        }

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(self.to_json(), fh, indent=1, default=str)


def run_matrix(
    scenarios: Optional[Sequence[Scenario]] = None,
    *,
    config: Optional[ChaosConfig] = None,
    harness: Optional[Harness] = None,
    job: Any = None,
    store_factory: Optional[StoreFactory] = None,
    json_path: Optional[str] = None,
    log: Optional[Callable[[str], None]] = None,
) -> MatrixReport:
    """Run ``scenarios`` (default: :func:`full_matrix`) and return the report; with
    ``json_path`` also write it as JSON. A scenario that fails, for whatever reason, is
    reported and torn down, and the next one runs; ``exit_code`` is 1 unless every one passed.

    Starts (and stops) its own :class:`Harness` unless one is given. Example::

        report = run_matrix(ci_matrix(), json_path="chaos.json")
        print(report.format_table())
        raise SystemExit(report.exit_code)
    """
    own = harness is None
    if own:
        harness = Harness(config, job=job, log=log)
        train_job = harness.job
    else:
        if config is not None and config != harness.config:
            raise ValueError("run_matrix: pass config= or harness=, not both (the harness has its own config)")
        train_job = as_job(job) if job is not None else harness.job
    cfg = harness.config
    scenarios = list(full_matrix(cfg) if scenarios is None else scenarios)
    for s in scenarios:
        cfg.check(s)  # fail before starting anything
    t0 = time.perf_counter()
    results: list[ScenarioResult] = []
    try:
        harness.start()
        try:
            harness.reference(train_job)
        except Exception as exc:  # noqa: BLE001 - every scenario tries again and reports it
            harness.log(f"the reference run failed ({type(exc).__name__}: {exc}); each scenario retries it")
        for i, s in enumerate(scenarios, 1):
            harness.log(f"[{i}/{len(scenarios)}] {s.name}: {s.describe()}")
            results.append(run_scenario(s, harness, job=train_job, store_factory=store_factory))
    finally:
        if own:
            harness.close()
    report = MatrixReport(
        results=results, config=cfg, seconds=time.perf_counter() - t0, reference_s=harness.reference_seconds
    )
    if json_path:
        report.write_json(json_path)
    return report
