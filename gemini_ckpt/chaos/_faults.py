"""What a chaos scenario does when it strikes (faults: kill, remove, corrupt) and what holds
around it (conditions: a slow holder, durable storage failing, a poisoned step): each a frozen
dataclass validated at construction, with a label for the report. Nothing here starts a
process or touches Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ._phases import ScenarioError, host_indices, nonneg_int


# --- faults: what happens at the trigger ------------------------------------------------------------
@dataclass(frozen=True)
class KillWorker:
    """SIGKILL the training process of each of ``ranks`` (its host and host store survive)."""

    ranks: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", host_indices("KillWorker.ranks", self.ranks))

    def label(self) -> str:
        return f"kill worker {','.join(map(str, self.ranks))}"


@dataclass(frozen=True)
class KillStore:
    """``ray.kill`` the host store of each of ``hosts`` (every copy it held is gone)."""

    hosts: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", host_indices("KillStore.hosts", self.hosts))

    def label(self) -> str:
        return f"kill store {','.join(map(str, self.hosts))}"


@dataclass(frozen=True)
class RemoveHosts:
    """Remove whole hosts at once (``cluster.remove_node(..., allow_graceful=False)``): their
    training processes and host stores die with them. ``replace``: add a new node with the same
    ``host{i}`` resource, so the job restarts at the same world size."""

    hosts: tuple[int, ...] = (1,)
    replace: bool = True
    during_rereplication: bool = False
    """Remove these hosts only once the host stores noticed the scenario's other losses, while
    the copies those losses cost are being made again (the registry holds that work until this
    removal is done): a second failure inside the window that re-replication closes."""
    during_restore: bool = False
    """Remove these hosts (replacements of the scenario's other losses) again while their ranks
    restore, after the job restarted: the job restarts once more, on a new replacement."""
    domain: Optional[str] = None
    """These hosts are every host of this failure domain (a rack lost at once: :func:`kill_rack`;
    ``ChaosConfig.check`` holds it to ``ChaosConfig.domains``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", host_indices("RemoveHosts.hosts", self.hosts))
        if self.domain is not None and (not isinstance(self.domain, str) or not self.domain):
            raise ScenarioError(f"RemoveHosts.domain must be a failure-domain label or None, got {self.domain!r}")
        for name in ("replace", "during_rereplication", "during_restore"):
            if not isinstance(getattr(self, name), bool):
                raise ScenarioError(f"RemoveHosts.{name} must be True or False, got {getattr(self, name)!r}")
        if self.during_restore and not self.replace:
            raise ScenarioError(
                "RemoveHosts(during_restore=True) needs replace=True: the job restarts on the same hosts once more"
            )

    @property
    def at_fault(self) -> bool:
        """Removed when the scenario strikes (not later)."""
        return not (self.during_rereplication or self.during_restore)

    def label(self) -> str:
        text = f"remove host{'s' if len(self.hosts) > 1 else ''} {','.join(map(str, self.hosts))}"
        if self.domain is not None:
            text = f"kill rack {self.domain} ({text})"
        return (
            text
            + (" during re-replication" if self.during_rereplication else "")
            + (" during its restore" if self.during_restore else "")
        )


@dataclass(frozen=True)
class CorruptReplica:
    """Flip one byte of ``host``'s in-memory copy of rank ``owner``'s shard of the newest
    committed version (a bad DIMM, a stray write). The copy must be skipped, never loaded."""

    host: int = 1
    owner: int = 1
    nan: bool = False
    """Write a NaN's bits over the first value of the biggest floating-point item instead of
    flipping a byte (memory poisoned after commit: the checksum, not the health check, must
    catch it, since the version was healthy when it was checked)."""

    def __post_init__(self) -> None:
        nonneg_int("CorruptReplica.host", self.host)
        nonneg_int("CorruptReplica.owner", self.owner)
        if not isinstance(self.nan, bool):
            raise ScenarioError(f"CorruptReplica.nan must be True or False, got {self.nan!r}")

    def label(self) -> str:
        return f"{'NaN in' if self.nan else 'corrupt'} host {self.host}'s copy of shard {self.owner}"


@dataclass(frozen=True)
class CorruptDurable:
    """Flip one byte of rank ``rank``'s data file of the newest persisted version on disk."""

    rank: int = 0

    def __post_init__(self) -> None:
        nonneg_int("CorruptDurable.rank", self.rank)

    def label(self) -> str:
        return f"corrupt durable file of rank {self.rank}"


def kill_rack(domains: tuple[str, ...], domain: str, *, replace: bool = True) -> RemoveHosts:
    """Every host of failure domain ``domain`` at once (``domains``: each host's, as
    ``ChaosConfig.domains`` gives them to the cluster's node labels)."""
    hosts = tuple(h for h, d in enumerate(domains) if d == domain)
    if not hosts:
        raise ScenarioError(f"kill_rack: no host is in domain {domain!r} (domains: {domains})")
    return RemoveHosts(hosts, replace=replace, domain=domain)


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ScenarioError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


# --- the network (ChaosConfig.network="netns"): a host cut off or slowed, but alive ------------------
@dataclass(frozen=True)
class PartitionHost:
    """Host ``host``'s link down (a switch failure: the host and its processes live on, cut off
    from every other host and the head). Once Ray declares it dead, a new machine replaces it
    (in a namespace of its own, with the host's label and resource), the job restarts and
    restores; then, no sooner than ``seconds`` after the cut, the old machine's link comes back.
    Its raylet, rank process and host store come back into a job with a newer epoch: they must
    be fenced (Ray keeps the node dead; none of them rejoins, nothing of theirs is mixed in)."""

    host: int = 1
    seconds: float = 20.0

    def __post_init__(self) -> None:
        nonneg_int("PartitionHost.host", self.host)
        object.__setattr__(self, "seconds", _positive("PartitionHost.seconds", self.seconds))

    @property
    def hosts(self) -> tuple[int, ...]:
        return (self.host,)

    def label(self) -> str:
        return f"partition host {self.host} (>= {self.seconds:g}s; replaced once declared dead)"


Fault = Union[KillWorker, KillStore, RemoveHosts, CorruptReplica, CorruptDurable, PartitionHost]
FAULT_TYPES = (KillWorker, KillStore, RemoveHosts, CorruptReplica, CorruptDurable, PartitionHost)


# --- conditions: what holds around the fault ----------------------------------------------------------
@dataclass(frozen=True)
class SlowReplication:
    """Rank ``rank`` waits ``seconds`` before handing its shard to its host store (a slow
    holder: every acknowledgement of its copies comes that much later), for ``steps`` (all
    steps before the fault when empty)."""

    rank: int = 1
    seconds: float = 1.0
    steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        nonneg_int("SlowReplication.rank", self.rank)
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or self.seconds <= 0:
            raise ScenarioError(f"SlowReplication.seconds must be a positive number, got {self.seconds!r}")
        object.__setattr__(self, "steps", tuple(nonneg_int("SlowReplication.steps", s) for s in self.steps))

    def label(self) -> str:
        return f"slow holder (rank {self.rank} +{self.seconds:g}s)"


@dataclass(frozen=True)
class DurableWriteOutage:
    """Every write to durable storage fails while the versions of ``steps`` are persisted (a
    full disk, an unreachable bucket for a while); reads keep working."""

    steps: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ScenarioError("DurableWriteOutage.steps must name at least one step")
        object.__setattr__(self, "steps", tuple(nonneg_int("DurableWriteOutage.steps", s) for s in self.steps))

    def label(self) -> str:
        return f"durable writes fail while persisting step {','.join(map(str, self.steps))}"


@dataclass(frozen=True)
class DurableUnreachable:
    """Durable storage refuses every operation (reads included) while the job restarts and
    restores; it comes back before training continues."""

    def label(self) -> str:
        return "durable unreachable at restart"


@dataclass(frozen=True)
class NanInState:
    """The fault step itself goes bad on rank ``rank``: after its optimizer step, a NaN lands in
    the first value of that rank's optimizer state (a bad step, silent data corruption) before
    the version is saved. The version commits but is unhealthy: it must never be persisted or
    restored, nor push a healthy version out of memory or the durable tier. Needs
    ``At(phase="step")``."""

    rank: int = 1

    def __post_init__(self) -> None:
        nonneg_int("NanInState.rank", self.rank)

    def label(self) -> str:
        return f"NaN in rank {self.rank}'s optimizer state at the fault step"


@dataclass(frozen=True)
class SlowLink:
    """Host ``host``'s link shaped to ``rate`` (both ways) for the whole run, training before the
    fault, restart and continuation (a degraded NIC or an oversubscribed uplink). Versions must
    commit or fail cleanly, and nothing may wait past its timeout."""

    host: int = 0
    rate: str = "10mbit"

    def __post_init__(self) -> None:
        from ..testing.netns import parse_rate

        nonneg_int("SlowLink.host", self.host)
        try:
            parse_rate(self.rate)
        except ValueError as exc:
            raise ScenarioError(f"SlowLink.rate: {exc}") from None

    def label(self) -> str:
        return f"host {self.host}'s link at {self.rate}"


@dataclass(frozen=True)
class FlappingLink:
    """Host ``host``'s link down for ``down_s``, up for ``up_s``, ``outages`` times, while the job
    trains up to the fault. Each outage is shorter than Ray's dead-node threshold (~15 s,
    :data:`gemini_ckpt.testing.cluster.HEALTH_CHECKS`): the host must not be declared dead, versions
    commit (late) or fail cleanly, and training goes on."""

    host: int = 2
    outages: int = 3
    down_s: float = 2.0
    up_s: float = 2.0

    def __post_init__(self) -> None:
        nonneg_int("FlappingLink.host", self.host)
        if isinstance(self.outages, bool) or not isinstance(self.outages, int) or self.outages < 1:
            raise ScenarioError(f"FlappingLink.outages must be an int >= 1, got {self.outages!r}")
        object.__setattr__(self, "down_s", _positive("FlappingLink.down_s", self.down_s))
        object.__setattr__(self, "up_s", _positive("FlappingLink.up_s", self.up_s))
        if self.down_s >= DEAD_AFTER_S:
            raise ScenarioError(
                f"FlappingLink.down_s={self.down_s:g} is not a short outage: Ray declares a silent "
                f"host dead after ~{DEAD_AFTER_S:g}s; use PartitionHost for that"
            )

    def label(self) -> str:
        return f"host {self.host}'s link flapping ({self.outages} x {self.down_s:g}s down, {self.up_s:g}s up)"


DEAD_AFTER_S = 15.0
"""About how long a silent host lives before Ray declares it dead (``LocalCluster``'s health checks)."""

Condition = Union[SlowReplication, DurableWriteOutage, DurableUnreachable, NanInState, SlowLink, FlappingLink]
CONDITION_TYPES = (SlowReplication, DurableWriteOutage, DurableUnreachable, NanInState, SlowLink, FlappingLink)
NETWORK_TYPES = (PartitionHost, SlowLink, FlappingLink)
"""Faults and conditions that need hosts with their own links (``ChaosConfig.network="netns"``)."""
