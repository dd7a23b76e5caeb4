"""Opening one step in the tiers that hold it: verified views, best first, of which a later one is
kept only when it holds the same version as the first (a durable copy written from that memory
version), and a later tier behind a memory version opened only when an item is read from it.
"""

from __future__ import annotations

from typing import Optional


def open_views(tiers: list, step: int, key, namespace: Optional[str] = None) -> tuple[list, list[str]]:
    """Verified views of ``step`` in every tier that holds it (best first), and why the others
    could not be opened. An item the first cannot produce is read from the next (see
    :mod:`.direct`), so a later view is kept only when it holds the same version as the
    first: a durable copy written from that memory version (its manifest names the memory
    version's fingerprint). With a signing key, a durable version signed for another namespace
    (copied from another run) is refused."""
    views, problems = [], []
    for tier in tiers:
        if views and views[0].tier == "memory":
            # A restore from memory rarely reads an item from a later tier: open it when it does
            # (reading and verifying a durable version's metadata costs tens of milliseconds).
            views.append(
                _Deferred(tier.name, step, lambda tier=tier: open_views([tier], step, key, namespace), views[0])
            )
            continue
        try:
            view = tier.open(step, key=key)
        except Exception as exc:  # noqa: BLE001 - whatever fails reading a version means "skip it"
            problems.append(f"{tier.name}: {type(exc).__name__}: {exc}")
            continue
        written_for = _durable_job(view).get("namespace")
        if key is not None and namespace is not None and written_for is not None and written_for != namespace:
            view.close()
            problems.append(
                f"{tier.name}: step {step} is signed for namespace {written_for!r}, not this job's "
                f"{namespace!r} (copied from another run?); refused. CheckpointConfig.init_from "
                f"starts a job from another run's version"
            )
            continue
        if views and not _same_version(views[0], view):
            view.close()
            problems.append(
                f"{tier.name}: holds another version of step {step} than {views[0].tier} (not written "
                f"from it); not mixed in"
            )
            continue
        views.append(view)
    return views, problems


class _Deferred:
    """A later tier's view of the step, opened on the first read of an item from it; an item it
    cannot give (it does not open, or holds another version of the step) is a ``LookupError``,
    so the reader moves on, as with any view that lacks the item."""

    def __init__(self, tier: str, step: int, opener, first) -> None:
        self.tier, self.step = tier, step
        self._opener, self._first = opener, first
        self._view = None
        self._problem: Optional[str] = None

    def read(self, index):
        if self._view is None and self._problem is None:
            opened, problems = self._opener()
            view = opened[0] if opened else None
            if view is not None and not _same_version(self._first, view):
                view.close()
                view, problems = (
                    None,
                    [
                        f"{self.tier}: holds another version of step {self.step} than "
                        f"{self._first.tier} (not written from it); not mixed in"
                    ],
                )
            self._view, self._problem = view, "; ".join(problems) if view is None else None
        if self._view is None:
            raise LookupError(self._problem or f"{self.tier}: step {self.step} could not be opened")
        return self._view.read(index)

    @property
    def bytes_by_source(self) -> dict:
        return self._view.bytes_by_source if self._view is not None else {}

    @property
    def problems(self) -> list[str]:
        return self._view.problems if self._view is not None else []

    def close(self) -> None:
        if self._view is not None:
            self._view.close()


def _durable_job(view) -> dict:
    job = getattr(getattr(view, "manifest", None), "job", None)
    return job if isinstance(job, dict) else {}


def _same_version(first, other) -> bool:
    """Whether ``other`` holds the version of ``first`` (so its items may stand in for them)."""
    if first.tier == other.tier:
        return first.fingerprint == other.fingerprint
    if first.tier == "memory" and other.tier == "durable":
        return _durable_job(other).get("memory_fingerprint") == first.fingerprint
    return False
