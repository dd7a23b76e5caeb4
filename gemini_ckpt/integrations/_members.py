"""Who belongs to a round of the process group: each worker process's incarnation and its rank.

Every start of a worker process is an *incarnation*, named by a token the controller draws from
the round store (``i1``, ``i2``, ...; a replaced worker's replacement gets a new one, a survivor
keeps its own across rounds). Each round the controller opens carries its **membership**: the
world size and, per current incarnation, its rank, local rank, local world size and node rank.
A round forms only with its members, each at its own rank:

- a zombie (a replaced worker's process that still runs: stopped and resumed, or on a host Ray
  declared dead) finds its token in no newer membership and is refused; it can neither be counted
  in its replacement's place nor train as that rank;
- a survivor takes its rank and the world size from the membership, so the controller can
  renumber the ranks when a lost host is not replaced (an elastic shrink) without a new process.

Pure Python: no torch or Ray here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from ..errors import SupersededError

__all__ = ["GRACE_S", "Member", "Membership", "SupersededError", "Told", "membership", "worker_env"]

MAX_TEXT = 1 << 20  # a membership's text is refused past this (a stranger's value, not ours)
GRACE_S = 10.0  # how long a rank whose checkpointing failed (a version that did not commit, say)
# waits for the controller to find a failed peer before it counts the error as its own


@dataclass(frozen=True)
class Member:
    """One incarnation's place in a round."""

    rank: int
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0


@dataclass(frozen=True)
class Membership:
    """A round's world: ``members`` maps each current incarnation's token to its place."""

    world_size: int
    members: Mapping[str, Member]

    def __post_init__(self) -> None:
        ranks = sorted(m.rank for m in self.members.values())
        if ranks != list(range(self.world_size)):
            raise ValueError(
                f"a round of {self.world_size} ranks needs ranks 0..{self.world_size - 1} once each, got {ranks}"
            )

    def of(self, token: str) -> Member:
        """``token``'s place; :class:`SupersededError` when it has none."""
        try:
            return self.members[token]
        except KeyError:
            raise SupersededError(
                f"incarnation {token} is not a member of this round (world of {self.world_size}: "
                f"{', '.join(sorted(self.members))}): a newer process took its rank"
            ) from None

    def token_of(self, rank: int) -> str:
        return next(t for t, m in self.members.items() if m.rank == rank)

    def to_text(self) -> str:
        return json.dumps(
            {
                "world_size": self.world_size,
                "members": {
                    t: [m.rank, m.local_rank, m.local_world_size, m.node_rank] for t, m in sorted(self.members.items())
                },
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_text(text: str) -> "Membership":
        """Parse what :meth:`to_text` wrote; ValueError on anything else."""
        if len(text) > MAX_TEXT:
            raise ValueError(f"a membership of {len(text)} characters")
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("members"), dict):
            raise ValueError("a membership is an object with 'members'")
        world_size = data.get("world_size")
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"a membership's world_size: {world_size!r}")
        members = {}
        for token, place in data["members"].items():
            if not isinstance(place, list) or len(place) != 4 or not all(_is_int(v) and v >= 0 for v in place):
                raise ValueError(f"incarnation {token!r}: {place!r}")
            members[str(token)] = Member(*place)
        return Membership(world_size, members)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def membership(places: Mapping[str, tuple[int, int, int, int]]) -> Membership:
    """A membership from ``{token: (rank, local rank, local world size, node rank)}``."""
    return Membership(len(places), {t: Member(*p) for t, p in places.items()})


def worker_env(
    *,
    host: str,
    port: int,
    round_: int,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    backend: str,
    timeout_s: float,
    reform_timeout_s: float,
    token: str,
    secret: str,
    grace_s: float = GRACE_S,
    max_stuck: int = 3,
) -> dict[str, str]:
    """What a worker is told (environment variables) to join the job's rounds; ``secret`` seals
    what it writes to the round store (:mod:`._round_store`)."""
    return {
        "GEMINI_ROUNDS_ADDR": host,
        "GEMINI_INCARNATION": token,
        "GEMINI_ROUNDS_SECRET": secret,
        "GEMINI_ROUNDS_PORT": str(port),
        "GEMINI_ROUND": str(round_),
        "GEMINI_ROUNDS_BACKEND": backend,
        "GEMINI_ROUNDS_TIMEOUT_S": str(timeout_s),
        "GEMINI_ROUNDS_REFORM_S": str(reform_timeout_s),
        "GEMINI_ROUNDS_GRACE_S": str(grace_s),
        "GEMINI_ROUNDS_MAX_STUCK": str(max_stuck),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),
    }


@dataclass(frozen=True)
class Told:
    """What :func:`worker_env` told this process (None outside an in-place job)."""

    host: str
    port: int
    round: int
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    reform_timeout_s: float
    token: str = ""
    grace_s: float = GRACE_S
    max_stuck: int = 3  # recoveries in a row without a newer committed version before a rank gives up
    secret: str = ""  # the run's round-store secret

    @staticmethod
    def from_env() -> Optional["Told"]:
        env = os.environ
        if "GEMINI_ROUNDS_ADDR" not in env:
            return None
        return Told(
            env["GEMINI_ROUNDS_ADDR"],
            int(env["GEMINI_ROUNDS_PORT"]),
            int(env["GEMINI_ROUND"]),
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            env["GEMINI_ROUNDS_BACKEND"],
            float(env["GEMINI_ROUNDS_TIMEOUT_S"]),
            float(env["GEMINI_ROUNDS_REFORM_S"]),
            env.get("GEMINI_INCARNATION", f"rank{env['RANK']}"),
            float(env.get("GEMINI_ROUNDS_GRACE_S", GRACE_S)),
            int(env.get("GEMINI_ROUNDS_MAX_STUCK", 3)),
            env.get("GEMINI_ROUNDS_SECRET", ""),
        )

    def placed(self, member: Member, world_size: int) -> "Told":
        """This process at ``member``'s place in a world of ``world_size`` (a round renumbered the
        ranks); the process's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) says so too."""
        os.environ.update(
            RANK=str(member.rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(member.local_rank),
            LOCAL_WORLD_SIZE=str(member.local_world_size),
            NODE_RANK=str(member.node_rank),
        )
        return replace(self, rank=member.rank, world_size=world_size)
