"""The ETTR model: effective training time of a checkpoint setting under failures.

GEMINI frames checkpointing by what failures cost: wasted time per failure and the effective
training time ratio (ETTR, the share of wall time that ends up as kept training progress).
The planner already knows exactly which failure sets memory survives; this module prices
each choice of ``replicas``, ``placement`` and ``persist_every`` over a long run, against
durable-only checkpointing at its Young/Daly interval.  ``docs/advise.md`` derives the
formulas; the short version:

* **Time.** Training runs on a *work clock* that only moves while the job is up.  Failures
  (host losses, process crashes, whole failure domains) arrive as Poisson processes on it.
  A failure rolls the work clock back to the newest restorable version and costs a restart
  plus a restore in wall time.  Net progress per up-second is ``1 - Lambda * E[loss]``,
  wall time per up-second ``1 + Lambda * E[recovery]``, and of the progress only the
  compute share of the step layout is training: ``ETTR = (1 - Lambda E[L]) /
  (1 + Lambda E[R]) * n * step / tau``.
* **Which tier.** A process crash keeps its host store: local memory.  A host failure is
  recovered from memory with the planner's exact probability for the number of hosts down
  at once: the failed host plus every other host that fails within the recovery window
  (``restart_host_s + restore_peer_s``), a binomial count, each count's sets equally
  likely.  A domain failure asks the planner about the domain's hosts plus up to two more.
* **Loss.** From memory: back to the newest committed version (a few seconds).  From the
  durable tier: back to the newest persisted version; the phase within the persist period
  at a failure follows the exact stationary density ``~ exp(-mu y)`` (``mu`` = rate of
  durable fallbacks, which restart the period), which makes durable-only checkpointing
  the classic exact renewal model, whose optimum is Young/Daly's ``sqrt(2 C M)`` to first
  order.

``_simulate`` replays the same model event by event through the real placement and
``survives``, as an independent check of this algebra.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from math import comb
from typing import Any

from ._inputs import DAY, Costs, FailureModel, Setting
from ._planner import minimal_fatal_sets, recovery_probability, survives
from ._strategies import Placement, make

__all__ = ["Estimate", "Layout", "Survival", "build_placement", "estimate", "survival"]


@dataclass(frozen=True)
class Layout:
    """Where a setting's compute, stalls and versions sit on the work clock (one period).

    A period is ``persist_every`` versions, each ``compute`` seconds of training
    (``save_every`` steps) then a stall; the last version is persisted and its stall is
    ``persist_stall_s`` longer.  Phase 0 is the end of that stall, where a restore from
    the persisted version resumes.  With one version in flight (``max_inflight=1``) a
    save waits for the previous commit, so the stall is ``stall_s + max(0, background -
    compute)``, ``background = commit - stall``.  Durable only: ``persist_every`` steps,
    then a blocking checkpoint of ``durable_save_s``, durable when it ends.
    """

    durable_only: bool
    n: int
    compute: float  # training seconds between versions (save_every steps)
    stall: float  # every version's stall
    extra: float  # added to the persisted version's stall
    background: float  # save() return -> committed
    available: float  # after phase 0, when the newest persisted version is durable

    @property
    def version_wall(self) -> float:
        return self.compute + self.stall

    @property
    def period(self) -> float:
        return self.n * self.version_wall + self.extra

    @property
    def useful(self) -> float:
        return self.n * self.compute / self.period

    @classmethod
    def of(cls, setting: Setting, costs: Costs) -> Layout:
        if setting.replicas == 0:
            return cls(True, setting.persist_every, costs.step_s, 0.0, costs.durable_save_s, 0.0, 0.0)
        compute = setting.save_every * costs.step_s
        background = max(0.0, costs.commit(setting.replicas) - costs.stall_s)
        stall = costs.stall_s + max(0.0, background - compute)
        return cls(
            False,
            setting.persist_every,
            compute,
            stall,
            costs.persist_stall_s,
            background,
            background + costs.persist_s,
        )


@dataclass(frozen=True)
class Estimate:
    """Expected outcome of one setting over a long run (fractions are of wall time).

    ``ettr`` is the effective training time ratio; ``waste_checkpoint``, ``waste_lost`` and
    ``waste_recovery`` (stalls; work redone after rollbacks; restarts and restores) make up
    the rest.  ``p_memory_host``/``p_memory_domain``: chance a host/domain failure is
    recovered from memory.  ``memory_shards`` is host-store memory in units of one host's
    checkpoint: ``(keep_in_memory + 1 + pinned) * replicas``.
    """

    setting: Setting
    ettr: float
    interval_s: float
    waste_checkpoint: float
    waste_lost: float
    waste_recovery: float
    failures_per_day: float
    durable_fallbacks_per_day: float
    p_memory_host: float
    p_memory_domain: float | None
    memory_shards: int
    feasible: bool
    note: str = ""

    @property
    def wasted_h_per_day(self) -> float:
        return (1.0 - self.ettr) * 24.0

    def to_json(self) -> dict[str, Any]:
        s = self.setting
        return {
            "replicas": s.replicas,
            "placement": s.placement,
            "persist_every": s.persist_every,
            "keep_in_memory": s.keep_in_memory,
            "save_every": s.save_every,
            "persist_steps": s.persist_steps,
            "interval_s": self.interval_s,
            "ettr": self.ettr,
            "wasted_h_per_day": self.wasted_h_per_day,
            "waste": {
                "checkpoint": self.waste_checkpoint,
                "lost_work": self.waste_lost,
                "recovery": self.waste_recovery,
            },
            "failures_per_day": self.failures_per_day,
            "durable_fallbacks_per_day": self.durable_fallbacks_per_day,
            "p_memory_host": self.p_memory_host,
            "p_memory_domain": self.p_memory_domain,
            "memory_shards_per_host": self.memory_shards,
            "feasible": self.feasible,
            "note": self.note,
        }


@dataclass(frozen=True)
class Survival:
    """What memory survives for one placement: the planner's answers, priced once."""

    placement: Placement | None
    domains: tuple[tuple[int, ...], ...]
    window_p: float  # chance another given host fails within the recovery window
    p_host: float
    p_domain: float | None


# ---- survival: the planner, priced -------------------------------------------


def build_placement(model: FailureModel, replicas: int, strategy: str) -> Placement:
    """The placement the job would run: with domains spread only for ``spread`` layout."""
    labels = None
    if model.domain_size is not None and model.domain_layout == "spread":
        labels = [h // model.domain_size for h in range(model.hosts)]
    return make(strategy, hosts=model.hosts, replicas=replicas, domains=labels)


def _binomial(trials: int, p: float) -> Callable[[int], float]:
    log_p, log_q = (math.log(p) if p > 0 else -math.inf), math.log1p(-p) if p < 1 else -math.inf

    def pmf(j: int) -> float:
        if j < 0 or j > trials:
            return 0.0
        if p == 0:
            return 1.0 if j == 0 else 0.0
        return math.exp(
            math.lgamma(trials + 1)
            - math.lgamma(j + 1)
            - math.lgamma(trials - j + 1)
            + (j * log_p if j else 0.0)
            + ((trials - j) * log_q if trials - j else 0.0)
        )

    return pmf


def survival(model: FailureModel, costs: Costs, replicas: int, strategy: str) -> Survival:
    """Price the planner's answers for one placement (``replicas=0``: no memory tier)."""
    window = costs.restart_host_s + costs.restore_peer_s
    window_p = -math.expm1(-window * model.host_rate)
    if replicas == 0:
        return Survival(None, model.domains(), window_p, 0.0, 0.0 if model.domain_size else None)
    p = build_placement(model, replicas, strategy)
    n = model.hosts
    # P(memory | host failure) = sum_j P(j others fail within the window) * P(recover | j+1 down).
    # recovery_probability is non-increasing in k, so stop when either factor is negligible.
    pmf = _binomial(n - 1, window_p)
    mean = (n - 1) * window_p
    p_host = 0.0
    for j in range(n):
        w = pmf(j)
        r = float(recovery_probability(p, j + 1))
        p_host += w * r
        if (j > mean and w < 1e-17) or r < 1e-17:
            break
    p_domain = _domain_survival(model, p, window_p) if model.domain_size else None
    return Survival(p, model.domains(), window_p, p_host, p_domain)


def _domain_survival(model: FailureModel, p: Placement, window_p: float) -> float:
    """Mean over domains of P(memory | the domain fails), exact for up to two more hosts
    lost in the window; three or more (third order in the window) count as lost."""
    all_sets = len(minimal_fatal_sets(p)) if p.replicas == 2 else 0
    total = 0.0
    domains = model.domains()
    for members in domains:
        if survives(p, members):
            others = model.hosts - len(members)
            singles, pairs = _fatal_additions(p, members, all_sets)
            pmf = _binomial(others, window_p)
            total += pmf(0)
            if others >= 1:
                total += pmf(1) * (1 - singles / others)
            if others >= 2:
                total += pmf(2) * (1 - pairs / comb(others, 2))
    return total / len(domains)


def _fatal_additions(p: Placement, members: tuple[int, ...], all_sets: int) -> tuple[int, int]:
    """How many single hosts, and how many pairs, outside a failed domain make it fatal.

    After the domain is down, host ``h`` is lost once ``holders(h)`` minus the domain has
    failed: a *requirement set*.  Only hosts with a holder in the domain have shrunken
    requirement sets; every other host's is its whole holder set, of size ``replicas``
    (a pair only when replicas is 2; ``all_sets`` counts those for the whole placement).
    """
    down = set(members)
    touched = set(members)
    for h in members:
        touched.update(x for x in p.held_by(h) if x not in down)
    needs = {frozenset(g for g in p.holders(h) if g not in down) for h in touched}
    critical = {x for r in needs if len(r) == 1 for x in r}
    small_pairs = {r for r in needs if len(r) == 2 and not r & critical}
    others = p.hosts - len(members)
    pairs = comb(others, 2) - comb(others - len(critical), 2) + len(small_pairs)
    if p.replicas == 2:
        # Whole holder pairs of untouched hosts (dropping those that share a holder set with
        # a touched host, and those already fatal through a critical host).
        mine = {frozenset(p.holders(h)) for h in touched}
        blocked = {frozenset(p.holders(y)) for c in critical for y in p.held_by(c)} - mine
        pairs += all_sets - len(mine) - len(blocked)
    return len(critical), pairs


# ---- the analytic model --------------------------------------------------------


def _mean_phase(mu: float, tau: float) -> float:
    """E[y] for density ~ exp(-mu y) on [0, tau): tau * (1/z - 1/expm1(z)), z = mu tau."""
    z = mu * tau
    if z < 1e-3:
        return tau * (0.5 - z / 12 + z**3 / 720)
    return tau * (1 / z - (1 / math.expm1(z) if z < 700 else 0.0))


def _below(mu: float, tau: float, r: float) -> float:
    """P(y < r) for the same density."""
    if mu * tau < 1e-12:
        return r / tau
    return math.expm1(-mu * r) / math.expm1(-mu * tau)


def durable_loss(mu: float, layout: Layout) -> float:
    """Expected work-clock seconds lost by a durable fallback.

    Durable fallbacks (rate ``mu``) restart the period at phase 0, so the phase at a
    failure has the stationary density ``mu e^(-mu y) / (1 - e^(-mu tau))``.  The newest
    persisted version becomes durable ``available`` seconds into the next period: a failure
    at phase ``y`` loses ``y`` plus one period for each persisted version not yet durable.
    """
    tau = layout.period
    whole, r = divmod(layout.available, tau)
    return _mean_phase(mu, tau) + tau * (whole + _below(mu, tau, r))


def memory_loss(layout: Layout) -> float:
    """Expected work-clock seconds lost by a memory recovery (phase taken as uniform).

    Between the commits of two consecutive versions the loss grows from ``background``
    (a version commits that long after its stall ends) by the commit spacing: each
    version's wall time, one of them ``extra`` longer per period.  Averaging the sawtooth
    over a period gives ``background + sum(spacing**2) / (2 * period)``.
    """
    if layout.durable_only:
        return math.nan
    w = layout.version_wall
    return layout.background + ((layout.n - 1) * w * w + (w + layout.extra) ** 2) / (2 * layout.period)


def estimate(model: FailureModel, costs: Costs, setting: Setting, surv: Survival) -> Estimate:
    """The analytic expectation for one setting (see the module docstring)."""
    layout = Layout.of(setting, costs)
    lam_p, lam_h, lam_d = model.rates()
    if setting.replicas == 0:
        q = (0.0, 0.0, 0.0)
        rec = (
            costs.restart_process_s + costs.restore_durable_s,
            costs.restart_host_s + costs.restore_durable_s,
            costs.restart_host_s + costs.restore_durable_s,
        )
    else:
        q = (1.0, surv.p_host, surv.p_domain or 0.0)
        rec = tuple(
            restart + qi * fast + (1 - qi) * costs.restore_durable_s
            for restart, qi, fast in (
                (costs.restart_process_s, q[0], costs.restore_local_s),
                (costs.restart_host_s, q[1], costs.restore_peer_s),
                (costs.restart_host_s, q[2], costs.restore_peer_s),
            )
        )
    rates = (lam_p, lam_h, lam_d)
    mu = sum(lam * (1 - qi) for lam, qi in zip(rates, q))
    lost_durable = durable_loss(mu, layout)
    lost_memory = 0.0 if setting.replicas == 0 else memory_loss(layout)
    lost_rate = sum(lam * (qi * lost_memory + (1 - qi) * lost_durable) for lam, qi in zip(rates, q))
    recovery_rate = sum(lam * r for lam, r in zip(rates, rec))
    up = 1 / (1 + recovery_rate)  # wall share of up time
    kept = max(0.0, 1 - lost_rate)
    ettr = kept * layout.useful * up

    feasible, note = True, ""
    if setting.replicas and costs.persist_s > layout.period:
        feasible = False
        note = (
            f"persist ({costs.persist_s:g} s) is slower than the persist interval "
            f"({layout.period:.0f} s): persists would queue up"
        )
    if kept == 0:
        note = "failures undo work faster than it is done: no progress"
    pinned = 0
    if setting.replicas:
        # The persisted version outlives its place among the newest K while it is written.
        held_for = layout.background + costs.persist_s
        pinned = int(held_for > setting.keep_in_memory * layout.version_wall)
    return Estimate(
        setting=setting,
        ettr=ettr,
        interval_s=layout.period,
        waste_checkpoint=kept * (1 - layout.useful) * up,
        waste_lost=min(lost_rate, 1.0) * up,
        waste_recovery=recovery_rate * up,
        failures_per_day=sum(rates) * up * DAY,
        durable_fallbacks_per_day=mu * up * DAY,
        p_memory_host=q[1],
        p_memory_domain=q[2] if model.domain_size else None,
        memory_shards=(setting.keep_in_memory + 1 + pinned) * setting.replicas,
        feasible=feasible,
        note=note,
    )
