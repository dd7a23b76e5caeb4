"""Fault-injection points: named phases of a version's life where a test harness can act.

The library calls :func:`fire` at each phase; by default nothing happens (one dict lookup).
The chaos harness (and tests) install a hook with :func:`set_hook` to kill a process, stall,
or raise exactly there, so a fault lands in the phase it is meant for rather than "roughly
around" it.

Phases in the training process (``ctx`` always has ``step`` and ``rank``; the host store's
own phase, its vote held before the decision, is :meth:`HostStore.hold_vote`):

- ``"admitted"``: ``save()`` took an in-flight slot for the version; nothing is captured yet.
- ``"replicate"``: a rank is about to hand its staged shard to its host store (which replicates
  it to the other holders).
- ``"copy_behind"``: with ``staging="overlap"``, the copying thread is about to copy the
  parameters and optimizer state of a version whose ``save()`` returned.
- ``"committed"``: a version was committed (the training process heard the outcome).
- ``"persist"``: the coordinator is about to write a committed version to the durable tier.
- ``"persist_commit"``: the durable data files are written; the DCP metadata and marker are next.

``admitted`` is not in :data:`PHASES` (the chaos harness's phases: a failure there loses no
more than one before ``replicate``). And one of a restore (not in :data:`PHASES` either):
``"restore"``: every rank agreed on the versions to try, none is loaded yet (``step``: the
newest candidate, or None).
"""

from __future__ import annotations

from typing import Callable, Optional

PHASES = ("replicate", "committed", "persist", "persist_commit")  # copy_behind: only with staging="overlap"
Hook = Callable[..., None]
_hook: Optional[Hook] = None


def set_hook(hook: Optional[Hook]) -> None:
    """Install ``hook(phase, **ctx)`` (or remove it with ``None``) for this process."""
    global _hook
    _hook = hook


def fire(phase: str, **ctx) -> None:
    if _hook is not None:
        _hook(phase, **ctx)
