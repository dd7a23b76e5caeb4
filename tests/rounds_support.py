"""What the in-place rounds tests share: a round's membership, written as the backend writes it."""

from __future__ import annotations

from gemini_ckpt.integrations import _members


def world(**ranks: int) -> _members.Membership:
    """A membership of the incarnations named, each at its rank (one per node)."""
    return _members.membership({t: (r, 0, 1, r) for t, r in ranks.items()})
