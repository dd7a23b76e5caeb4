"""Monte-Carlo replay of the advise model, failure by failure, through the real planner.

The analytic estimate in ``advise_models`` integrates over failure phases and counts failure
sets; this replays the same rules one event at a time instead: draw when the next failure
strikes and what it hits, draw the hosts that also fail within its recovery window, ask
:func:`~placement.survives` whether memory still holds every shard, and move the work
clock back to the version that recovery would load.  Agreement between the two checks the
algebra (phase density, binomial windows, the step layout), not the assumptions they share.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ._errors import PlacementError
from ._ettr import Layout, Survival
from ._inputs import DAY, Costs, FailureModel, Setting
from ._planner import survives

__all__ = ["Simulation", "simulate"]


@dataclass(frozen=True)
class Simulation:
    """What one seeded replay saw."""

    setting: Setting
    ettr: float
    events: int
    memory_recoveries: int
    durable_fallbacks: int
    simulated_days: float
    seed: int


def simulate(
    model: FailureModel,
    costs: Costs,
    setting: Setting,
    surv: Survival,
    *,
    events: int = 20000,
    seed: int = 0,
) -> Simulation:
    """Replay ``events`` failures with ``random.Random(seed)``; ETTR = training kept / wall time.

    The run ends right after a recovery, a renewal point, so the ratio has no end effect.
    """
    if isinstance(events, bool) or not isinstance(events, int) or events < 1:
        raise PlacementError(f"events: expected an int >= 1 (failures to replay), got {events!r}")
    layout = Layout.of(setting, costs)
    lam_p, lam_h, lam_d = model.rates()
    lam = lam_p + lam_h + lam_d
    rng = random.Random(seed)
    hosts = model.hosts
    memory_tier = setting.replicas > 0
    x = wall = 0.0
    from_memory = fallbacks = 0
    for _ in range(events):
        up = rng.expovariate(lam)
        x += up
        wall += up
        pick = rng.random() * lam
        if pick < lam_p:  # the process dies, its host (and host store) lives
            restart, fast = costs.restart_process_s, costs.restore_local_s
            in_memory = memory_tier
        else:
            if pick < lam_p + lam_h:
                failed = {rng.randrange(hosts)}
            else:
                failed = set(surv.domains[rng.randrange(len(surv.domains))])
            _fail_within_window(rng, failed, hosts, surv.window_p)
            restart, fast = costs.restart_host_s, costs.restore_peer_s
            in_memory = memory_tier and survives(surv.placement, failed)
        if in_memory:
            from_memory += 1
            x = _newest_committed(layout, x)
            wall += restart + fast
        else:
            fallbacks += 1
            x = _newest_durable(layout, x)
            wall += restart + costs.restore_durable_s
    return Simulation(setting, _training(layout, x) / wall, events, from_memory, fallbacks, wall / DAY, seed)


def _fail_within_window(rng: random.Random, failed: set[int], hosts: int, p: float) -> None:
    """Add each other host independently with probability ``p`` (binomial count, then which)."""
    others = hosts - len(failed)
    if p <= 0 or others <= 0:
        return
    k = _binomial(rng, others, p)
    while k:
        h = rng.randrange(hosts)
        if h not in failed:
            failed.add(h)
            k -= 1


def _binomial(rng: random.Random, trials: int, p: float) -> int:
    pj = (1 - p) ** trials
    if pj == 0.0:  # far from zero failures: count them one by one
        return sum(rng.random() < p for _ in range(trials))
    u, j, cdf = rng.random(), 0, pj
    while u > cdf and j < trials:
        pj *= (trials - j) / (j + 1) * p / (1 - p)
        j += 1
        cdf += pj
    return j


def _newest_committed(layout: Layout, x: float) -> float:
    """Where a memory restore resumes: the end of the stall of the newest version committed by x.

    Version ``g`` (period ``k``, index ``i``) is taken at ``k*tau + i*wall + compute``,
    after its compute; its stall follows (the last one's is ``extra`` longer) and it
    commits ``background`` seconds after the stall ends.
    """
    n, tau, w = layout.n, layout.period, layout.version_wall

    def stall_end(g: int) -> float:
        k, i = divmod(g, n)
        return k * tau + i * w + layout.compute + layout.stall + (layout.extra if i == n - 1 else 0.0)

    g = math.floor((x + layout.extra) * n / tau) + 1  # past x: taken after x
    while g >= 0 and stall_end(g) + layout.background > x:
        g -= 1
    return stall_end(g) if g >= 0 else 0.0


def _newest_durable(layout: Layout, x: float) -> float:
    """Where a durable restore resumes: the newest period start whose version is durable."""
    k = math.floor((x - layout.available) / layout.period)
    return max(0, k) * layout.period  # the job's start counts as durable


def _training(layout: Layout, x: float) -> float:
    """Seconds of training compute in the work clock's first ``x`` seconds."""
    k, y = divmod(x, layout.period)
    i = min(layout.n, math.floor(y / layout.version_wall))
    partial = min(layout.compute, y - i * layout.version_wall) if i < layout.n else 0.0
    return (k * layout.n + i) * layout.compute + partial
