"""Placement of in-memory checkpoint replicas, and recovery planning (pure Python).

Which hosts keep a copy of each host's checkpoint shards, whether a set of host
failures can be recovered from memory and from which holders, and the exact chance
of recovering from memory when ``k`` hosts fail (GEMINI, SOSP 2023).

>>> import placement
>>> p = placement.make("group", hosts=16, replicas=2)
>>> p.holders(3)
(3, 2)
>>> placement.survives(p, failed={2, 3})
False
>>> placement.recovery_probability(p, k=2)
Fraction(14, 15)

``python -m placement report --hosts 16 --replicas 2`` compares the strategies;
``placement.advise(hosts=1024)`` (``python -m placement advise --hosts 1024``) prices
checkpoint settings by the training time they keep under failures (``docs/advise.md``).
"""

from ._advise import Advice, advise
from ._errors import PlacementError
from ._planner import (
    RecoveryPlan,
    expected_steps_lost,
    fatal_count,
    fatal_sets,
    minimal_fatal_sets,
    plan_recovery,
    recovery_probability,
    survives,
)
from ._strategies import LAYOUTS as LAYOUTS, STRATEGIES, Placement, domain_violations, make

__all__ = [  # LAYOUTS too is importable: the strategies' names without "auto"
    "STRATEGIES",
    "Advice",
    "Placement",
    "PlacementError",
    "RecoveryPlan",
    "advise",
    "domain_violations",
    "expected_steps_lost",
    "fatal_count",
    "fatal_sets",
    "minimal_fatal_sets",
    "make",
    "plan_recovery",
    "recovery_probability",
    "survives",
]
