"""The one error type of the placement package."""

from __future__ import annotations

__all__ = ["PlacementError"]


class PlacementError(ValueError):
    """A placement or planner argument is invalid.

    Derives from :class:`ValueError` so callers that already catch bad input keep
    working; the message names the offending field and says how to fix it.
    """
