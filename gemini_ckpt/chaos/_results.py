"""What a scenario produced: checks, the result of one scenario, and the reference run's trace."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ._predict import Prediction, outcome_label
from ._spec import Scenario

PASS, MISMATCH, HARNESS_ERROR, INFRA_ERROR = "PASS", "MISMATCH", "ERROR", "INFRA-ERROR"


class HarnessError(RuntimeError):
    """The harness could not run a scenario as written (not a verdict on the library)."""


class InfraError(HarnessError):
    """The harness's own machinery failed: a rank process, the process group's rendezvous, the
    job's ``build``, the simulated cluster. Not a verdict on the library: the scenario is
    reported ``INFRA-ERROR``, its processes are replaced, and the matrix goes on."""


@contextmanager
def infrastructure(what: str) -> Iterator[None]:
    """Report any failure inside as an :class:`InfraError` about ``what``."""
    try:
        yield
    except InfraError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke, it was the harness's machinery
        raise InfraError(f"{what}: {type(exc).__name__}: {exc}") from exc


# --- results -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """One property checked after a scenario; ``ok`` is None when it did not apply."""

    name: str
    ok: Optional[bool]
    detail: str = ""


@dataclass
class ScenarioResult:
    """Everything one scenario predicted, observed and checked (``to_json`` for the report)."""

    scenario: Scenario
    prediction: Optional[Prediction] = None
    observed: dict = field(default_factory=dict)
    steps_lost: Optional[int] = None
    recovery_s: Optional[float] = None
    restore_s: Optional[float] = None
    checks: list[Check] = field(default_factory=list)
    error: Optional[str] = None
    infra: bool = False  # ``error`` is the harness's machinery failing (INFRA-ERROR), not a verdict
    duration_s: float = 0.0
    timings: dict = field(default_factory=dict)  # seconds per stage of the recovery
    notes: list[str] = field(default_factory=list)  # things worth knowing that are not a verdict

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return INFRA_ERROR if self.infra else HARNESS_ERROR
        return PASS if all(c.ok is not False for c in self.checks) else MISMATCH

    @property
    def ok(self) -> bool:
        return self.verdict == PASS

    @property
    def observed_label(self) -> str:
        if not self.observed:
            return "-"
        return outcome_label(self.observed.get("outcome"), self.observed.get("step"))

    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    def to_json(self) -> dict:
        s = self.scenario
        return {
            "name": s.name,
            "description": s.describe(),
            "placement": s.placement,
            "note": s.note,
            "at": {"step": s.at.step, "phase": s.at.phase, "rank": s.at.rank},
            "faults": [repr(f) for f in s.faults],
            "conditions": [repr(c) for c in s.conditions],
            "restart_hosts": list(s.restart_hosts) if s.restart_hosts is not None else None,
            "predicted": self.prediction.to_json() if self.prediction else None,
            "observed": self.observed,
            "observed_label": self.observed_label,
            "steps_lost": self.steps_lost,
            "recovery_s": self.recovery_s,
            "restore_s": self.restore_s,
            "timings": self.timings,
            "notes": self.notes,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "verdict": self.verdict,
            "error": self.error,
            "duration_s": round(self.duration_s, 2),
        }


@dataclass
class Trace:
    """One job's records: step -> rank -> what ``RankWorker.run`` returned."""

    losses: dict[int, dict[int, float]] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    extras: dict[int, dict[int, dict]] = field(default_factory=dict)

    def add(self, records: dict[int, list[dict]]) -> None:
        for rank, recs in records.items():
            for rec in recs:
                if "loss" in rec:
                    self.losses.setdefault(rec["step"], {})[rank] = rec["loss"]
                    self.extras.setdefault(rec["step"], {})[rank] = rec["extra"]
                    self.digests[rec["step"]] = rec["digest"]


@dataclass
class Reference:
    """The uninterrupted run every scenario is compared with."""

    world_size: int
    initial_digest: str
    initial_extras: dict[int, dict]
    trace: Trace
    full: dict[int, dict] = field(default_factory=dict)  # step -> full model/optim state
    opaque: dict[int, dict[int, dict]] = field(default_factory=dict)  # step -> rank -> opaque state
    seconds: float = 0.0


def short(text: str, limit: int = 400) -> str:
    """One line, at most ``limit`` characters (tracebacks stay in the logs)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def err(value: Any) -> Optional[str]:
    if isinstance(value, BaseException):
        cause = getattr(value, "cause", None)  # a RayTaskError: the rank's own exception
        if isinstance(cause, BaseException):
            value = cause
        return f"{type(value).__name__}: {value}"
    if isinstance(value, dict) and value.get("error"):
        return value["error"]
    return None
