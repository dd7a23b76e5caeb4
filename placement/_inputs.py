"""What ``advise`` takes: the cluster and its failure rates, the costs, one setting.

Frozen, keyword-only, validated on construction: a bad value raises
:class:`~placement.PlacementError` naming the field and the fix (the CLI names the flag).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ._errors import PlacementError

__all__ = [
    "DAY",
    "DOMAIN_LAYOUTS",
    "HOUR",
    "KEEP_IN_MEMORY",
    "Costs",
    "FailureModel",
    "Setting",
    "check_int",
    "check_number",
]

HOUR = 3600.0
DAY = 86400.0

#: Domain layouts: how slots sit in failure domains.  ``contiguous`` is what the library
#: does without ``CheckpointConfig.failure_domain`` (slots follow rank order, so a rack's hosts
#: are neighbours); ``spread`` is ``placement.make(..., domains=...)``, which keeps a host's
#: copies in different domains: what the library does with ``failure_domain`` set.
DOMAIN_LAYOUTS = ("contiguous", "spread")

#: keep_in_memory recommended: the model needs only the newest committed version (the
#: library releases an old version after the next one commits and pins one being
#: persisted); a second one is what restore falls back to when the newest fails its
#: checksums, for m x shard more memory per host.
KEEP_IN_MEMORY = 2


def check_number(name: str, value: object, *, fix: str, allow_zero: bool = False) -> float:
    """A finite number > 0 (or >= 0); else an error naming ``name`` and the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlacementError(f"{name}: expected a number, got {value!r}; {fix}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise PlacementError(f"{name}: must be {bound}, got {value}; {fix}")
    return float(value)


def check_int(name: str, value: object, *, minimum: int, fix: str) -> int:
    """An int (not a bool) >= ``minimum``; else an error naming ``name`` and the fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlacementError(f"{name}: expected an int, got {value!r}; {fix}")
    if value < minimum:
        raise PlacementError(f"{name}: must be >= {minimum}, got {value}; {fix}")
    return value


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """The cluster and how often its parts fail.

    Defaults follow Meta's Llama 3 report (16,384 GPUs, 8 per host: 419 unexpected
    interruptions in 54 days, about 78 % hardware): a host is lost about every 8,000 hours,
    and a training process crashes without its host (software, NCCL, a GPU reset) about
    every 30,000 hours per host.  ``process_mtbf_h=None`` leaves process crashes out;
    ``domain_size``/``domain_mtbf_h`` add correlated failures (a rack, a power feed) that
    take ``domain_size`` consecutive slots down at once.
    """

    hosts: int
    ranks_per_host: int = 8
    host_mtbf_h: float = 8000.0
    process_mtbf_h: float | None = 30000.0
    domain_size: int | None = None
    domain_mtbf_h: float | None = None
    domain_layout: str = "contiguous"

    def __post_init__(self) -> None:
        check_int("hosts", self.hosts, minimum=1, fix="pass the number of hosts")
        check_int("ranks_per_host", self.ranks_per_host, minimum=1, fix="e.g. 8 GPUs per host")
        check_number("host_mtbf_h", self.host_mtbf_h, fix="hours between failures of one host")
        if self.process_mtbf_h is not None:
            check_number(
                "process_mtbf_h", self.process_mtbf_h, fix="hours between process crashes per host, or None for none"
            )
        if (self.domain_size is None) != (self.domain_mtbf_h is None):
            raise PlacementError(
                "domain_size: correlated failures need both domain_size (hosts per domain) "
                "and domain_mtbf_h (hours between failures of one domain), or neither"
            )
        if self.domain_size is not None:
            check_int("domain_size", self.domain_size, minimum=1, fix="hosts per failure domain")
            if self.domain_size > self.hosts:
                raise PlacementError(
                    f"domain_size: {self.domain_size} hosts per domain but hosts={self.hosts}; "
                    "use at most the number of hosts"
                )
            check_number("domain_mtbf_h", self.domain_mtbf_h, fix="hours between failures of one domain")
        if self.domain_layout not in DOMAIN_LAYOUTS:
            raise PlacementError(
                f"domain_layout: unknown layout {self.domain_layout!r}; use one of "
                + ", ".join(repr(x) for x in DOMAIN_LAYOUTS)
            )

    @property
    def host_rate(self) -> float:
        """Failures per second of one host."""
        return 1.0 / (self.host_mtbf_h * HOUR)

    def rates(self) -> tuple[float, float, float]:
        """Failures per up-second of the whole job: (process, host, domain)."""
        process = 0.0 if self.process_mtbf_h is None else self.hosts / (self.process_mtbf_h * HOUR)
        domain = 0.0
        if self.domain_size is not None and self.domain_mtbf_h is not None:
            domain = len(self.domains()) / (self.domain_mtbf_h * HOUR)
        return process, self.hosts * self.host_rate, domain

    def domains(self) -> tuple[tuple[int, ...], ...]:
        """The failure domains: runs of ``domain_size`` consecutive hosts (the last may be short)."""
        if self.domain_size is None:
            return ()
        d = self.domain_size
        return tuple(tuple(range(s, min(s + d, self.hosts))) for s in range(0, self.hosts, d))


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds each checkpointing action costs.  Defaults: a large-model job (about 1 GiB
    of state per rank, 8 ranks per host) on GPU hosts; ``--from-bench`` replaces them with
    what ``python -m benchmarks`` measured.

    ``commit_s[m-1]`` is the time from ``save()`` to committed in memory with ``m`` copies;
    ``persist_stall_s`` the extra training stall a persisted version causes (its own save
    plus interference while it is written); ``durable_save_s`` the stall of one blocking
    durable checkpoint, the cost ``C`` of the durable-only baseline.
    """

    step_s: float = 10.0
    stall_s: float = 0.05
    commit_s: tuple[float, ...] = (1.0, 3.0, 5.0)
    persist_s: float = 120.0
    persist_stall_s: float = 1.0
    restore_local_s: float = 5.0
    restore_peer_s: float = 20.0
    restore_durable_s: float = 120.0
    restart_process_s: float = 60.0
    restart_host_s: float = 600.0
    durable_save_s: float = 30.0

    def __post_init__(self) -> None:
        check_number("step_s", self.step_s, fix="seconds of one training step without checkpointing")
        for name in (
            "stall_s",
            "persist_s",
            "persist_stall_s",
            "restore_local_s",
            "restore_peer_s",
            "restore_durable_s",
            "restart_process_s",
            "restart_host_s",
            "durable_save_s",
        ):
            check_number(name, getattr(self, name), fix="a time in seconds", allow_zero=True)
        commit = self.commit_s
        if isinstance(commit, (int, float)) and not isinstance(commit, bool):
            commit = (float(commit),)
        if not isinstance(commit, tuple) or not commit:
            raise PlacementError(f"commit_s: expected seconds per replicas count, e.g. (1.0, 3.0, 5.0), got {commit!r}")
        object.__setattr__(
            self,
            "commit_s",
            tuple(check_number("commit_s", c, fix="seconds from save() to committed", allow_zero=True) for c in commit),
        )

    def commit(self, replicas: int) -> float:
        """Seconds to commit with ``replicas`` copies; the last given value covers larger m."""
        return self.commit_s[min(replicas, len(self.commit_s)) - 1]


@dataclass(frozen=True)
class Setting:
    """One checkpoint setting.

    A version is saved every ``save_every`` steps (``ckpt.save(step)`` when
    ``step % save_every == 0``) and every ``persist_every``-th version is persisted.
    ``replicas=0`` means no memory tier: a blocking durable checkpoint every
    ``persist_every`` steps (the durable-only baseline).
    """

    replicas: int
    placement: str
    persist_every: int
    keep_in_memory: int = KEEP_IN_MEMORY
    save_every: int = 1

    def __post_init__(self) -> None:
        check_int("replicas", self.replicas, minimum=0, fix="0 (durable only) or 1..hosts copies")
        check_int("persist_every", self.persist_every, minimum=1, fix="versions between persisted ones")
        check_int(
            "keep_in_memory",
            self.keep_in_memory,
            minimum=0 if self.replicas == 0 else 1,
            fix="committed versions kept in memory",
        )
        check_int("save_every", self.save_every, minimum=1, fix="steps between saved versions")
        if self.replicas == 0 and self.save_every != 1:
            raise PlacementError("save_every: durable only saves every persist_every steps; leave it 1")

    @property
    def persist_steps(self) -> int:
        """Training steps between persisted versions."""
        return self.persist_every * self.save_every

    def config_line(self, durable_uri: str = "runs/my-job") -> str:
        """The ``CheckpointConfig(...)`` that runs this setting."""
        if self.replicas == 0:
            return (
                f"# durable only: a blocking durable checkpoint every {self.persist_every} steps (no CheckpointConfig)"
            )
        return (
            f"CheckpointConfig(replicas={self.replicas}, placement={json.dumps(self.placement)}, "
            f"keep_in_memory={self.keep_in_memory}, persist_every={self.persist_every}, "
            f"durable_uri={json.dumps(durable_uri)})"
        )
