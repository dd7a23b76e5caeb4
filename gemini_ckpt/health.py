"""Version health: whether a version's state is fit to be a recovery point.

A checksum proves that bytes were copied faithfully; it cannot tell that they were poisoned
before the copy (a step that left NaN in a weight, silent data corruption). So every version
also gets a **health** verdict, a :class:`Health`:

- **the tensor check** (default on): every parameter and optimizer-state tensor is finite,
  checked off the training thread on the raw bits (:mod:`gemini_ckpt.format.finite`); which items
  it covers the trainer decides and signs into the shard plan (buffers are not checked: attention
  masks legitimately hold ``-inf``);
- **checks on the trainer**, optional: predicates on ``save(step, metrics=...)`` (:class:`Finite`,
  :class:`NoSpike`, any :class:`MetricCheck`) and a user ``validator``.

An **unhealthy** version still commits but is never the restore choice, never persisted, never
reported and never counted by retention; ``restore(step=...)`` loads one on purpose.
``health_check=None`` turns every check off (versions are ``unchecked``). docs/health.md has the
whole story.

This module imports only the standard library: host-store actors decode verdicts with it.

Example::

    from gemini_ckpt import CheckpointConfig, HealthCheck
    from gemini_ckpt.health import Finite, NoSpike

    CheckpointConfig(health_check=HealthCheck(metrics=(Finite(metric="loss"), NoSpike(metric="loss", factor=5)),
                                              on_unhealthy="raise"))
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

from .errors import ConfigError

HEALTHY, UNHEALTHY, UNCHECKED = "healthy", "unhealthy", "unchecked"
STATUSES = (HEALTHY, UNHEALTHY, UNCHECKED)
ON_UNHEALTHY = ("warn", "raise")
CHECKS = ("finite", "metric", "validator", "verdict")
"""Which check found a version unhealthy: ``finite`` (the tensor check), ``metric`` (a
predicate on ``save(metrics=...)``), ``validator`` (the user's), ``verdict`` (health checks were
on, but a shard's verdict is missing: a missing verdict is never a healthy one)."""
_MAX_TEXT = 1000  # a verdict's strings come from peers and storage: bounded


# --- the verdict ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Health:
    """One shard's or one version's verdict: ``status`` is ``healthy``, ``unhealthy`` or
    ``unchecked`` (no check ran); an unhealthy one names the ``check`` that failed, the ``item``
    (a tensor's key such as ``model.layers.0.weight``, or a metric's name), a ``detail`` and
    the ``rank`` whose shard failed."""

    status: str
    check: str = ""
    item: str = ""
    detail: str = ""
    rank: Optional[int] = None

    @property
    def unhealthy(self) -> bool:
        return self.status == UNHEALTHY

    @property
    def reason(self) -> str:
        """One line for people: ``rank 0: model.w failed the finite check (1 NaN of 4,096 values)``."""
        if not self.unhealthy:
            return self.status
        where = f"rank {self.rank}: " if self.rank is not None else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{where}{self.item or 'the state'} failed the {self.check} check{detail}"

    def with_rank(self, rank: int) -> "Health":
        return Health(self.status, self.check, self.item, self.detail, rank)

    def to_json(self) -> dict:
        return {"status": self.status, "check": self.check, "item": self.item, "detail": self.detail, "rank": self.rank}

    @classmethod
    def from_json(cls, data: Any) -> "Health":
        """Decode a verdict from a record, a manifest or a peer: ``ValueError`` if malformed."""
        if not isinstance(data, dict) or set(data) - {"status", "check", "item", "detail", "rank"}:
            raise ValueError(
                f"a health verdict must be an object with status, check, item, detail, rank; got {data!r:.200}"
            )
        status = data.get("status")
        if status not in STATUSES:
            raise ValueError(f"unknown health status {status!r:.100}")
        texts = [data.get(k, "") for k in ("check", "item", "detail")]
        if not all(isinstance(t, str) and len(t) <= _MAX_TEXT for t in texts):
            raise ValueError("a health verdict's check, item and detail must be short strings")
        if status == UNHEALTHY and texts[0] not in CHECKS:
            raise ValueError(f"unknown health check {texts[0]!r:.100}")
        rank = data.get("rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"a health verdict's rank must be an int >= 0 or null, got {rank!r:.100}")
        return cls(status, *texts, rank)

    def to_text(self) -> str:
        """Canonical JSON (what the commit protocol carries for an unhealthy version)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> "Health":
        try:
            return cls.from_json(json.loads(text))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"a health verdict is not JSON ({exc})") from None


HEALTHY_VERDICT = Health(HEALTHY)
UNCHECKED_VERDICT = Health(UNCHECKED)


def no_verdict(detail: str, rank: Optional[int] = None) -> Health:
    """What a version is when health checks were on but a verdict is missing (a host store that
    did not check, as one of another gemini_ckpt version would not): unhealthy, never healthy
    by default, so never the restore choice, persisted or reported."""
    return Health(UNHEALTHY, "verdict", "", detail, rank)


def combine(verdicts: Iterable[Optional[Health]]) -> Health:
    """A version's verdict from its shards' (in rank order; None: unchecked): the first
    unhealthy one, else ``healthy`` when every shard was checked, else ``unchecked``."""
    verdicts = [v or UNCHECKED_VERDICT for v in verdicts]
    bad = next((v for v in verdicts if v.unhealthy), None)
    if bad is not None:
        return bad
    if verdicts and all(v.status == HEALTHY for v in verdicts):
        return HEALTHY_VERDICT
    return UNCHECKED_VERDICT


# --- checks on the metrics of save(step, metrics=...) -------------------------------------------------
@runtime_checkable
class MetricCheck(Protocol):
    """A predicate on one metric of ``save(step, metrics=...)``: :meth:`check` returns why this
    step's ``value`` is unhealthy, or None. ``history`` holds the metric's values of earlier
    saves that passed every metric check, oldest first (at most :attr:`window`)."""

    metric: str
    window: int

    def check(self, value: float, history: Sequence[float]) -> Optional[str]: ...


@dataclass(frozen=True, kw_only=True)
class Finite:
    """The metric is a finite number (not NaN, not +-Inf)."""

    metric: str = "loss"
    window: int = 0  # needs no history

    def __post_init__(self) -> None:
        _metric_name(self)

    def check(self, value: float, history: Sequence[float]) -> Optional[str]:
        return None if math.isfinite(value) else f"{self.metric} is {value!r}"


@dataclass(frozen=True, kw_only=True)
class NoSpike:
    """The metric is finite and at most ``factor`` times the median of its last ``window``
    values (for a positive metric such as a loss); not judged until ``min_history`` values are
    known, nor while that median is not positive."""

    metric: str = "loss"
    factor: float = 3.0
    window: int = 20
    min_history: int = 5

    def __post_init__(self) -> None:
        _metric_name(self)
        if (
            isinstance(self.factor, bool)
            or not isinstance(self.factor, (int, float))
            or not math.isfinite(self.factor)
            or self.factor <= 1
        ):
            raise ConfigError(
                f"NoSpike.factor must be a finite number > 1 (a spike is factor x the running "
                f"median), got {self.factor!r}"
            )
        for name, low in (("window", 1), ("min_history", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"NoSpike.{name} must be an int >= {low}, got {value!r}")
        if self.min_history > self.window:
            raise ConfigError(
                f"NoSpike.min_history={self.min_history} cannot exceed window={self.window}; "
                f"lower min_history or raise window"
            )

    def check(self, value: float, history: Sequence[float]) -> Optional[str]:
        if not math.isfinite(value):
            return f"{self.metric} is {value!r}"
        recent = list(history)[-self.window :]
        if len(recent) < self.min_history:
            return None
        median = statistics.median(recent)
        if median > 0 and value > self.factor * median:
            return (
                f"{self.metric} is {value:.6g}, over {self.factor:g} x its running median {median:.6g} "
                f"(last {len(recent)} healthy saves)"
            )
        return None


def _metric_name(check) -> None:
    if not isinstance(check.metric, str) or not check.metric:
        raise ConfigError(
            f"{type(check).__name__}.metric must be the name of a metric given to "
            f"save(step, metrics=...), e.g. 'loss'; got {check.metric!r}"
        )


class MetricHistory:
    """Recent values of each checked metric, of saves that passed every metric check (the
    trainer's, one per Checkpointer)."""

    def __init__(self, checks: Sequence[MetricCheck]) -> None:
        self._values: dict[str, collections.deque] = {}
        for c in checks:
            longest = max(c.window, self._values[c.metric].maxlen if c.metric in self._values else 0)
            self._values[c.metric] = collections.deque(maxlen=max(1, longest))

    def of(self, metric: str) -> Sequence[float]:
        return tuple(self._values.get(metric, ()))

    def add(self, values: Mapping[str, float]) -> None:
        for metric, value in values.items():
            if metric in self._values:
                self._values[metric].append(value)


# --- the setting -------------------------------------------------------------------------------------
Validator = Callable[[int, Any, Mapping[str, Any]], Optional[str]]
"""``validator(step, state, metrics)``: None when the state is healthy, else a short reason.
Called by ``save`` on the training thread with the live :class:`~gemini_ckpt.TrainState`
(before it is staged), so it must be cheap; it never travels to a host store."""


@dataclass(frozen=True, kw_only=True)
class HealthCheck:
    """What makes a version healthy (``CheckpointConfig.health_check``; ``None`` turns it off).

    Example::

        HealthCheck()                                              # the default
        HealthCheck(metrics=(Finite(metric="loss"),), on_unhealthy="raise")
        HealthCheck(validator=lambda step, state, metrics: None if metrics.get("acc", 1) > 0 else "acc is 0")

    Fields:
        parameters: every floating-point parameter tensor must be finite.
        optimizer_state: every floating-point optimizer-state tensor must be finite, and the
            optimizers' hyper-parameters (a NaN ``lr``, an infinite ``weight_decay``; checked on
            the trainer at ``save``, :func:`nonfinite_hyperparameter`).
        buffers: also the model's buffers (off: masks may hold ``-inf``).
        gradients: also the saved gradients (``TrainState(grads=True)``).
        metrics: :class:`MetricCheck` predicates on ``save(step, metrics=...)``; a metric a
            save does not report is not judged at that save.
        validator: a :data:`Validator`, run by ``save`` on the training thread.
        on_unhealthy: ``warn`` (log the first unhealthy version loudly, train on) or ``raise``
            (:class:`~gemini_ckpt.UnhealthyVersionError` at the next ``save``/``wait``/``close``,
            so the job can stop and restart from the last healthy version).

    Tensors of other dtypes (integers, bool, float8, complex) are not checked.
    """

    parameters: bool = True
    optimizer_state: bool = True
    buffers: bool = False
    gradients: bool = False
    metrics: tuple = field(default=())
    validator: Optional[Validator] = None
    on_unhealthy: str = "warn"

    def __post_init__(self) -> None:
        for name in ("parameters", "optimizer_state", "buffers", "gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"HealthCheck.{name} must be True or False, got {getattr(self, name)!r}")
        metrics = self.metrics
        if isinstance(metrics, MetricCheck):
            metrics = (metrics,)
        if isinstance(metrics, (str, bytes, Mapping)) or not isinstance(metrics, Iterable):
            raise ConfigError(
                f"HealthCheck.metrics must be a tuple of metric checks such as "
                f"(Finite(metric='loss'),), got {metrics!r}"
            )
        metrics = tuple(metrics)
        for m in metrics:
            if not isinstance(m, MetricCheck) or not isinstance(m.window, int):
                raise ConfigError(
                    f"HealthCheck.metrics: {m!r} is not a metric check (it needs metric, window "
                    f"and check(value, history)); use gemini_ckpt.health.Finite or NoSpike"
                )
        object.__setattr__(self, "metrics", metrics)
        if self.validator is not None and not callable(self.validator):
            raise ConfigError(
                f"HealthCheck.validator must be callable (step, state, metrics) -> None or a reason, "
                f"got {self.validator!r}"
            )
        if self.on_unhealthy not in ON_UNHEALTHY:
            raise ConfigError(
                f"HealthCheck.on_unhealthy={self.on_unhealthy!r} is not valid; use one of "
                f"{', '.join(map(repr, ON_UNHEALTHY))}"
            )

    def judge(self, step: int, state: Any, metrics: Mapping[str, Any], history: MetricHistory) -> Health:
        """The trainer's verdict on this save: the optimizers' hyper-parameters (with
        ``optimizer_state``), the metric checks (in order), then the validator. Updates
        ``history`` with the metrics of a save that passed the metric checks."""
        if self.optimizer_state:
            bad = nonfinite_hyperparameter(getattr(state, "optimizers", ()))
            if bad is not None:
                return Health(UNHEALTHY, "finite", bad[0], _short(bad[1]))
        values = {}
        for c in self.metrics:
            if c.metric not in metrics:
                continue
            value = _number(c.metric, metrics[c.metric])
            values[c.metric] = value
            why = c.check(value, history.of(c.metric))
            if why:
                return Health(UNHEALTHY, "metric", c.metric, _short(str(why)))
        history.add(values)
        if self.validator is not None:
            why = self.validator(step, state, metrics)
            if why is not None and not isinstance(why, str):
                raise TypeError(f"HealthCheck.validator must return None (healthy) or a reason string, got {why!r}")
            if why:
                return Health(UNHEALTHY, "validator", "", _short(why))
        return HEALTHY_VERDICT


FINITE_HYPERPARAMETERS = frozenset(
    "lr initial_lr weight_decay momentum dampening betas eps alpha rho lr_decay initial_accumulator_value lambd etas".split()
)
"""Optimizer hyper-parameters that must be finite (an infinity in any other key is allowed)."""


def nonfinite_hyperparameter(optimizers: Iterable[Any]) -> Optional[tuple[str, str]]:
    """The first optimizer hyper-parameter that is not finite, as (item, detail), else None.

    A NaN learning rate or an infinite weight decay sits in ``param_groups``, not in the state
    tensors, and one more step makes every parameter non-finite. Checked: a NaN in any number
    of any group, and an infinity in the hyper-parameters torch's optimizers multiply by
    (:data:`FINITE_HYPERPARAMETERS`; other keys may use ``inf`` for "no limit"), each of a
    tuple's numbers (``betas``), a one-element CPU tensor's value (a tensor ``lr``); a tensor
    on an accelerator is left alone (reading it would wait for the device on the training
    thread). Items are named as in the checkpoint, ``optim.param_groups.<group>.<key>``, the
    groups of several optimizers numbered on from one to the next (as DCP merges them).
    """
    groups = (group for opt in optimizers for group in getattr(opt, "param_groups", ()))
    for g, group in enumerate(groups):
        for key, value in group.items():
            if key == "params":
                continue
            for v in value if isinstance(value, (tuple, list)) else (value,):
                number = _scalar(v)
                if number is not None and (
                    math.isnan(number) or (math.isinf(number) and key in FINITE_HYPERPARAMETERS)
                ):
                    return f"optim.param_groups.{g}.{key}", f"{key} is {number}"
    return None


def _scalar(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    numel, device = getattr(value, "numel", None), getattr(value, "device", None)
    if callable(numel) and getattr(device, "type", None) == "cpu" and numel() == 1 and value.is_floating_point():
        return float(value.item())
    return None


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"save(metrics=...): metric {name!r} is {value!r}, not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"save(metrics=...): metric {name!r} is {value!r:.100}, not a number") from None


def _short(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."
