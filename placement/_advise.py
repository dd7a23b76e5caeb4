"""``advise``: every candidate setting's ETTR, durable-only at its optimum, and the pick.

The model lives in ``_ettr`` (analytic) and ``_simulate`` (Monte-Carlo); this module
chooses which settings to price and which one to recommend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._errors import PlacementError
from ._ettr import Estimate, Layout, Survival, estimate, survival
from ._inputs import HOUR, KEEP_IN_MEMORY, Costs, FailureModel, Setting, check_int, check_number
from ._simulate import Simulation, simulate

__all__ = ["Advice", "advise"]

#: Wall-time persist intervals every in-memory candidate is also shown at (seconds).
PERSIST_GRID_S = (600.0, 1800.0, 3600.0, 10800.0)

#: Candidates within this much ETTR of the best count as equal; fewer replicas win.
#: 1e-4 is about 9 seconds of training a day.
TIE_ETTR = 1e-4


@dataclass(frozen=True)
class Advice:
    """The answer of :func:`advise`: every candidate, durable-only, and the pick.

    ``candidates`` and ``recommended`` are in-memory settings (``.setting``, ``.ettr``,
    ``.wasted_h_per_day``, the waste breakdown); ``durable_only`` is the baseline at its
    optimal interval, ``young_daly_s`` Young/Daly's first-order interval for it.
    ``evaluate(...)`` prices any other setting, ``simulate(estimate)`` replays it.

    >>> a = advise(hosts=1024)
    >>> a.recommended.setting.replicas, a.recommended.ettr > a.durable_only.ettr
    (2, True)
    """

    failures: FailureModel
    costs: Costs
    max_persist_h: float
    durable_only: Estimate
    young_daly_s: float
    candidates: tuple[Estimate, ...]
    recommended: Estimate
    notes: tuple[str, ...] = ()
    _cache: dict[tuple[int, str], Survival] = field(default_factory=dict, compare=False, repr=False)

    @property
    def system_mtbf_h(self) -> float:
        """Hours between failures of any kind anywhere in the job."""
        return 1.0 / (sum(self.failures.rates()) * HOUR)

    def evaluate(
        self,
        *,
        replicas: int,
        placement: str = "auto",
        persist_every: int,
        keep_in_memory: int = KEEP_IN_MEMORY,
        save_every: int = 1,
    ) -> Estimate:
        """The analytic estimate for any setting; ``replicas=0`` is durable only, a blocking
        durable checkpoint every ``persist_every`` steps."""
        setting = Setting(
            replicas, placement if replicas else "none", persist_every, keep_in_memory if replicas else 0, save_every
        )
        return estimate(self.failures, self.costs, setting, _survival(self._cache, self, setting))

    def simulate(self, what: Estimate | Setting, *, events: int = 20000, seed: int = 0) -> Simulation:
        """Monte-Carlo replay of ``events`` failures through the real placement and planner."""
        setting = what.setting if isinstance(what, Estimate) else what
        return simulate(
            self.failures, self.costs, setting, _survival(self._cache, self, setting), events=events, seed=seed
        )

    def to_json(self) -> dict[str, Any]:
        d, r = self.durable_only, self.recommended
        return {
            "durable_only": {
                "interval_steps": d.setting.persist_every,
                "interval_s": d.setting.persist_every * self.costs.step_s,
                "ettr": d.ettr,
                "young_daly_s": self.young_daly_s,
                "wasted_h_per_day": d.wasted_h_per_day,
                "system_mtbf_h": self.system_mtbf_h,
            },
            "recommended": {
                "replicas": r.setting.replicas,
                "placement": r.setting.placement,
                "persist_every": r.setting.persist_every,
                "keep_in_memory": r.setting.keep_in_memory,
                "save_every": r.setting.save_every,
                "ettr": r.ettr,
                "wasted_h_per_day": r.wasted_h_per_day,
                "config": r.setting.config_line(),
            },
            "candidates": [c.to_json() for c in self.candidates],
            "notes": list(self.notes),
        }


def _survival(
    cache: dict[tuple[int, str], Survival], where: Advice | tuple[FailureModel, Costs], setting: Setting
) -> Survival:
    # One planner pricing per (replicas, strategy); every persist interval shares it.
    key = (setting.replicas, setting.placement)
    if key not in cache:
        model, costs = (where.failures, where.costs) if isinstance(where, Advice) else where
        cache[key] = survival(model, costs, *key)
    return cache[key]


# ---- search -------------------------------------------------------------------


def _argmax(f: Callable[[int], float], lo: int, hi: int) -> int:
    """The integer in [lo, hi] maximising a unimodal ``f`` (smallest on ties)."""
    if hi - lo <= 40:
        return max(range(lo, hi + 1), key=lambda n: (f(n), -n))
    points = sorted({lo, hi, *(round(lo * (hi / lo) ** (i / 40)) for i in range(41))})
    values = [f(n) for n in points]
    i = max(range(len(points)), key=lambda k: (values[k], -k))
    a, b = points[max(0, i - 1)], points[min(len(points) - 1, i + 1)]
    while b - a > 8:  # ternary search inside the bracket
        m1, m2 = a + (b - a) // 3, b - (b - a) // 3
        if f(m1) < f(m2):
            a = m1 + 1
        else:
            b = m2
    return max(range(a, b + 1), key=lambda n: (f(n), -n))


def _candidates(
    price: Callable[[Setting], Estimate], costs: Costs, cap_s: float, m: int, strategy: str
) -> list[Estimate]:
    """One (replicas, strategy): the best save_every and persist_every, then the grid.

    Saving less often trades the stall per save (and the wait for the previous commit)
    against work lost on a memory recovery; persisting less often trades the persist stall
    against work lost on a durable fallback.  The two barely interact once the persist
    interval is held in wall time, so a few rounds of coordinate ascent settle them:
    the interval at one version per step, then save_every at that interval, and so on.
    """

    def bounds(k: int) -> tuple[float, float, int, int]:
        probe = Layout.of(Setting(m, strategy, 1, save_every=k), costs)
        w, extra = probe.version_wall, probe.extra
        # Persists run one at a time: the interval must cover one (else they queue up).
        lo = max(1, math.ceil((costs.persist_s - extra) / w - 1e-9))
        return w, extra, lo, max(lo, math.floor((cap_s - extra) / w + 1e-9))

    def versions(k: int, interval_s: float) -> int:
        w, extra, lo, hi = bounds(k)
        return min(hi, max(lo, round((interval_s - extra) / w)))

    def ettr(k: int, n: int) -> float:
        return price(Setting(m, strategy, n, save_every=k)).ettr

    k_hi = max(1, math.floor(cap_s / (2 * costs.step_s)))  # at least two versions per interval
    k = 1
    n = _argmax(lambda n: ettr(1, n), *bounds(1)[2:])
    for _ in range(3):
        w, extra, _lo, _hi = bounds(k)
        interval = n * w + extra
        k = _argmax(lambda k: ettr(k, versions(k, interval)), 1, k_hi)
        n = _argmax(lambda n: ettr(k, n), *bounds(k)[2:])
    picks = {n, *(versions(k, t) for t in (*PERSIST_GRID_S, cap_s) if t <= cap_s)}
    return [price(Setting(m, strategy, n, save_every=k)) for n in sorted(picks)]


def _strategies(hosts: int, replicas: int) -> tuple[str, ...]:
    if replicas == 1:
        return ("auto",)  # one copy: every strategy is the same
    # mixed equals group when replicas divides hosts; group needs it to.
    return ("group", "ring") if hosts % replicas == 0 else ("mixed", "ring")


def advise(
    hosts: int,
    *,
    ranks_per_host: int = FailureModel.ranks_per_host,
    host_mtbf_h: float = FailureModel.host_mtbf_h,
    process_mtbf_h: float | None = FailureModel.process_mtbf_h,
    domain_size: int | None = None,
    domain_mtbf_h: float | None = None,
    domain_layout: str = FailureModel.domain_layout,
    step_s: float = Costs.step_s,
    stall_s: float = Costs.stall_s,
    commit_s: tuple[float, ...] = Costs.commit_s,
    persist_s: float = Costs.persist_s,
    persist_stall_s: float = Costs.persist_stall_s,
    restore_local_s: float = Costs.restore_local_s,
    restore_peer_s: float = Costs.restore_peer_s,
    restore_durable_s: float = Costs.restore_durable_s,
    restart_process_s: float = Costs.restart_process_s,
    restart_host_s: float = Costs.restart_host_s,
    durable_save_s: float = Costs.durable_save_s,
    max_persist_h: float = 3.0,
    replicas: tuple[int, ...] = (1, 2, 3),
) -> Advice:
    """ETTR of every checkpoint setting for this cluster and failure rate, and the best one.

    Candidates: each count in ``replicas`` x each distinct strategy x persist intervals
    (10 min, 30 min, 1 h and 3 h of wall time, capped at ``max_persist_h``, plus the
    model's optimum under that cap), and durable-only checkpointing at its optimal
    interval (Young/Daly's ``sqrt(2 C M)`` to first order).  The recommended setting has
    the highest ETTR, preferring fewer replicas among those within 1e-4 of it.  The
    arguments are the fields of ``FailureModel`` and ``Costs`` (``placement._inputs``);
    ``docs/advise.md`` explains the model and its defaults.

    >>> best = advise(hosts=1024).recommended.setting
    >>> best.replicas, best.placement, best.save_every, best.persist_every
    (2, 'group', 5, 215)
    >>> best.config_line()
    'CheckpointConfig(replicas=2, placement="group", keep_in_memory=2, persist_every=215, durable_uri="runs/my-job")'
    """
    model = FailureModel(
        hosts=hosts,
        ranks_per_host=ranks_per_host,
        host_mtbf_h=host_mtbf_h,
        process_mtbf_h=process_mtbf_h,
        domain_size=domain_size,
        domain_mtbf_h=domain_mtbf_h,
        domain_layout=domain_layout,
    )
    costs = Costs(
        step_s=step_s,
        stall_s=stall_s,
        commit_s=commit_s,
        persist_s=persist_s,
        persist_stall_s=persist_stall_s,
        restore_local_s=restore_local_s,
        restore_peer_s=restore_peer_s,
        restore_durable_s=restore_durable_s,
        restart_process_s=restart_process_s,
        restart_host_s=restart_host_s,
        durable_save_s=durable_save_s,
    )
    cap_s = check_number("max_persist_h", max_persist_h, fix="the longest persist interval, in hours") * HOUR
    if not isinstance(replicas, (tuple, list)) or not replicas:
        raise PlacementError(f"replicas: expected copy counts to compare, e.g. (1, 2, 3), got {replicas!r}")
    replicas = tuple(replicas)
    for m in replicas:
        check_int("replicas", m, minimum=1, fix="copies in memory, the local one included")
    return advise_models(model, costs, cap_s, replicas)


def advise_models(model: FailureModel, costs: Costs, cap_s: float, replicas: tuple[int, ...]) -> Advice:
    """:func:`advise` on checked models (the command line builds them itself)."""
    cache: dict[tuple[int, str], Survival] = {}

    def price(setting: Setting) -> Estimate:
        return estimate(model, costs, setting, _survival(cache, (model, costs), setting))

    notes: list[str] = []
    # Durable only: the exact optimum; Young/Daly's first-order one is reported beside it.
    young_daly = math.sqrt(2 * costs.durable_save_s / sum(model.rates()))
    guess = max(1, round(young_daly / costs.step_s))
    n_durable = _argmax(lambda n: price(Setting(0, "none", n, 0)).ettr, 1, max(64, 16 * guess))
    durable_only = price(Setting(0, "none", n_durable, 0))

    candidates: list[Estimate] = []
    for m in sorted(set(replicas)):
        if m > model.hosts:
            notes.append(f"replicas={m}: needs {m} hosts, only {model.hosts}")
            continue
        for strategy in _strategies(model.hosts, m):
            candidates += _candidates(price, costs, cap_s, m, strategy)
    if costs.persist_s > cap_s:
        notes.append(
            f"persist takes {costs.persist_s:g} s, longer than max_persist_h: "
            "candidates persist as often as persists can keep up"
        )
    if not candidates:
        raise PlacementError("replicas: no candidate fits these hosts; use fewer replicas")

    best = max(c.ettr for c in candidates)
    close = [c for c in candidates if c.ettr >= best - TIE_ETTR]
    fewest = min(c.setting.replicas for c in close)
    recommended = max((c for c in close if c.setting.replicas == fewest), key=lambda c: c.ettr)
    if durable_only.ettr > recommended.ettr:
        notes.append(
            f"durable-only checkpointing every {durable_only.setting.persist_every} steps "
            f"(ETTR {durable_only.ettr:.4f}) beats every in-memory setting here "
            f"(best {recommended.ettr:.4f}): the stall of a save every step costs more "
            "than memory recovery saves"
        )
    if model.domain_size is not None and model.domain_layout == "contiguous":
        if any(c.p_memory_domain == 0 for c in candidates if c.setting.replicas > 1):
            notes.append(
                "with contiguous slots a whole-domain failure takes every copy of some host: "
                "it falls back to the durable tier; CheckpointConfig(failure_domain='rack') spreads "
                "the copies over the nodes' rack labels (domain_layout='spread' shows what that saves)"
            )
    return Advice(
        failures=model,
        costs=costs,
        max_persist_h=cap_s / HOUR,
        durable_only=durable_only,
        young_daly_s=young_daly,
        candidates=tuple(candidates),
        recommended=recommended,
        notes=tuple(notes),
        _cache=cache,
    )
