"""Typed, validated configuration.

``CheckpointConfig`` is the only settings object users build. Unknown or impossible values
raise :class:`~gemini_ckpt.ConfigError` (a ``ValueError``) naming the field and the fix, at
construction time, before any memory is allocated or any actor started.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from placement import LAYOUTS

from .errors import ConfigError
from .health import HealthCheck
from .timeouts import TIMEOUTS

STORES = ("local", "ray")
PLACEMENTS = ("auto", *LAYOUTS)
PERSIST_ERRORS = ("log", "raise")
INFLIGHT_POLICIES = ("wait", "skip")
WORLD_SIZE_CHANGE_RULES = ("derive", "error")
STAGINGS = ("copy", "overlap")


class Interleave(StrEnum):
    """How replication shares the network with training (``CheckpointConfig.interleave``, see
    docs/interleave.md): ``gate`` (a host store sends only while its ranks are not inside a
    collective), ``network`` (its traffic marked lower-effort), ``off``. A ``str``: it travels
    and compares as its word."""

    GATE = "gate"
    NETWORK = "network"
    OFF = "off"


INTERLEAVE_MODES = tuple(Interleave)  # CheckpointConfig.interleave; True is "gate", False is "off"


def interleave_mode(value) -> Interleave:
    """``CheckpointConfig.interleave``, or what a registry or a client of another version passed
    on for it, as an :class:`Interleave`: ``True`` is ``gate``, ``False`` is ``off``, anything
    unknown ``gate`` (the default). The one place the setting is normalized."""
    if value is True or value is False:
        return Interleave.GATE if value else Interleave.OFF
    return Interleave(value) if value in INTERLEAVE_MODES else Interleave.GATE


DEFAULT_NAMESPACE = "gemini_ckpt"


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How, where and how often versions are kept.

    Example::

        CheckpointConfig(replicas=2, placement="group", keep_in_memory=2,
                         persist_every=10, durable_uri="runs/demo")

    Fields:
        store: ``"ray"`` (host-store actors, one per Ray node; the default) or ``"local"``
            (versions kept in this process's memory; single-process jobs and rollback).
        namespace: versions are shared by every ``Checkpointer`` using the same namespace
            (a new ``Checkpointer`` over rebuilt objects finds earlier versions).
        replicas: copies of each shard kept in memory, the local one included (GEMINI's m).
        placement: where copies go: ``auto`` (group when replicas divides hosts, else
            mixed), ``group``, ``ring`` or ``mixed``.
        keep_in_memory: committed versions kept in memory (K); older ones are released.
        persist_every: persist every Nth committed version to ``durable_uri``; 0 disables.
        durable_uri: a ``pyarrow.fs`` URI or local path for the durable tier.
        keep_durable: complete durable versions retained.
        persist_on_close: on ``close()``, persist the newest committed version if it is not
            durable yet (only with a durable tier).
        persist_errors: a failed persist is ``log``-ged (training and the memory tier go on;
            ``handle.persisted`` raises; the next persist retries) or also ``raise``-d on the
            training thread like a commit failure.
        max_inflight: versions whose background work may run at once.
        inflight_policy: when ``max_inflight`` versions are busy: ``wait`` blocks ``save``
            until one finishes; ``skip`` drops this save (counted and logged).
        staging: ``"copy"`` (``save`` returns once the whole state is copied) or ``"overlap"``
            (``save`` copies buffers, gradients and values and returns; the parameters and
            optimizer state are copied on a copying thread while the next step's forward and
            backward run, and the next ``optimizer.step()`` waits for that copy: the stall of
            a save shrinks to the small part. A parameter or optimizer-state tensor changed in
            place before its copy is done (anything but ``optimizer.step()``) fails that version
            with an error naming it; see :mod:`gemini_ckpt.save.overlap`).
        host_memory_budget_bytes: per-host memory budget for kept shards; None = 30% of the
            node's RAM, less where other namespaces' stores on the node take their 60% share
            (see :mod:`gemini_ckpt.hoststore.actors.budget`).
        world_size_change: rank-local state at a new world size: ``derive`` (documented rule,
            with a warning) or ``error``.
        timeout_s: limit for every blocking call (waits, collectives, store calls).
        signing_key: bytes or str; signs every version's manifest (HMAC-SHA256) and refuses
            unsigned or wrongly signed ones at restore. None: ``$GEMINI_CKPT_SIGNING_KEY`` if set.
        replication_bandwidth: cap on the bytes per second each host store sends to the other
            holders over the data plane (None: unlimited), so replication stays out of the way
            of training's own traffic.
        interleave: how replication stays out of training's way (docs/interleave.md).
            ``True`` or ``"gate"``: a host store sends only while its ranks are not inside a
            collective (DDP and FSDP2 marked by ``gemini_ckpt.interleave(model, checkpointer)``,
            anything else by ``checkpointer.communicating()``), in pieces that delay a
            collective by at most 2% of its measured time; with nothing marked it changes
            nothing. ``"network"``: no gate; the data plane's packets are marked lower-effort
            (DSCP CS1, bulk socket priority) and a network that honours priority (switches with
            a scavenger class; ``LocalCluster(qos=True)``) sends them after training's, in the
            link time training leaves, packet by packet. Only ``"network"`` marks.
            ``replication_bandwidth`` still caps. False or ``"off"``: send regardless.
        overwrite: a job that starts without restoring, while the store or the durable tier
            already holds versions at or after its first step (an earlier run's), is refused;
            ``overwrite=True`` discards those versions instead (memory and durable).
        init_from: a stock DCP checkpoint directory (e.g. written by ``dcp.save`` or
            torchtitan) whose model and optimizer are loaded by ``restore()`` when no version
            of this job exists yet (resharded as usual); ``RestoreResult.source`` is ``"init"``.
        health_check: what makes a version healthy (:class:`~gemini_ckpt.HealthCheck`; by
            default every parameter and optimizer-state tensor finite); ``None`` turns the
            checks off. Only healthy versions are restored, persisted, reported to Ray Train
            and counted by ``keep_in_memory``/``keep_durable`` (see :mod:`gemini_ckpt.health`).
        failure_domain: the name of a Ray node label that says which failure domain (rack,
            power feed, zone) each host is in, e.g. ``"rack"`` for nodes started with ``ray start
            --labels rack=r1``. Placement then keeps each shard's copies in different domains
            where the hosts allow it (a warning when they do not); a node without the label is
            its own domain. None: copies follow slot order (see ``docs/placement.md``).
        metrics: with ``store="ray"``, publish metrics through Ray's metrics API (each node's
            Prometheus export, the dashboard's Grafana; docs/metrics.md): the save stall, commit
            and persist times, versions by outcome, restores per rank, memory against the budget and
            bytes replicated per host store. Recorded off the training thread; False turns them off.
    """

    store: str = "ray"
    namespace: Optional[str] = None
    replicas: int = 2
    placement: str = "auto"
    keep_in_memory: int = 2
    persist_every: int = 0
    durable_uri: Optional[str] = None
    keep_durable: int = 3
    persist_on_close: bool = True
    persist_errors: str = "log"
    max_inflight: int = 1
    inflight_policy: str = "wait"
    staging: str = "copy"
    host_memory_budget_bytes: Optional[int] = None
    world_size_change: str = "derive"
    timeout_s: float = TIMEOUTS.version_s
    signing_key: Optional[bytes | str] = dataclasses.field(default=None, repr=False)
    replication_bandwidth: Optional[int] = None
    interleave: bool | str = True
    overwrite: bool = False
    init_from: Optional[str] = None
    health_check: Optional[HealthCheck] = dataclasses.field(default_factory=HealthCheck)
    failure_domain: Optional[str] = None
    metrics: bool = True

    def __post_init__(self) -> None:
        _choice(self, "store", STORES)
        _choice(self, "placement", PLACEMENTS)
        _choice(self, "inflight_policy", INFLIGHT_POLICIES)
        _choice(self, "world_size_change", WORLD_SIZE_CHANGE_RULES)
        _choice(self, "persist_errors", PERSIST_ERRORS)
        _choice(self, "staging", STAGINGS)
        if not isinstance(self.persist_on_close, bool):
            raise ConfigError(f"CheckpointConfig.persist_on_close must be True or False, got {self.persist_on_close!r}")
        _int_at_least(self, "replicas", 1, "keep at least the local copy: replicas=1")
        _int_at_least(self, "keep_in_memory", 1, "keep at least the newest version")
        _int_at_least(self, "persist_every", 0, "use 0 to disable the durable tier")
        _int_at_least(self, "keep_durable", 1, "keep at least the newest durable version")
        _int_at_least(self, "max_inflight", 1, "use 1 to allow one version in flight")
        if self.namespace is not None and (not isinstance(self.namespace, str) or not self.namespace):
            raise ConfigError(f"CheckpointConfig.namespace must be a non-empty string or None, got {self.namespace!r}")
        if self.durable_uri is not None and (not isinstance(self.durable_uri, str) or not self.durable_uri):
            raise ConfigError(f"CheckpointConfig.durable_uri must be a path or URI string, got {self.durable_uri!r}")
        if self.host_memory_budget_bytes is not None:
            _int_at_least(self, "host_memory_budget_bytes", 1, "or None for the default budget")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            raise ConfigError(
                f"CheckpointConfig.timeout_s must be a positive, finite number of seconds "
                f"(e.g. 300), got {self.timeout_s!r}"
            )
        if self.replication_bandwidth is not None:
            _int_at_least(
                self, "replication_bandwidth", 1 << 20, "bytes per second, e.g. 2_000_000_000; None for unlimited"
            )
        if not isinstance(self.interleave, bool) and self.interleave not in INTERLEAVE_MODES:
            raise ConfigError(
                f"CheckpointConfig.interleave must be True or 'gate' (replication yields to training's "
                f"marked collectives), 'network' (it is marked lower-effort and a network that honours "
                f"priority interleaves it packet by packet) or False / 'off' (neither), "
                f"got {self.interleave!r}"
            )
        if not isinstance(self.metrics, bool):
            raise ConfigError(f"CheckpointConfig.metrics must be True or False, got {self.metrics!r}")
        if not isinstance(self.overwrite, bool):
            raise ConfigError(f"CheckpointConfig.overwrite must be True or False, got {self.overwrite!r}")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ConfigError(
                f"CheckpointConfig.init_from must be the path of a DCP checkpoint directory, got {self.init_from!r}"
            )
        if self.signing_key is not None and (not isinstance(self.signing_key, (bytes, str)) or not self.signing_key):
            raise ConfigError(
                "CheckpointConfig.signing_key must be non-empty bytes or str (a secret shared by "
                "every rank of the job), or None"
            )
        if self.health_check is not None and not isinstance(self.health_check, HealthCheck):
            raise ConfigError(
                f"CheckpointConfig.health_check must be a gemini_ckpt.HealthCheck (e.g. HealthCheck() "
                f"for the default checks) or None to turn the checks off, got {self.health_check!r}"
            )
        if self.failure_domain is not None and (
            not isinstance(self.failure_domain, str) or not self.failure_domain.strip()
        ):
            raise ConfigError(
                f"CheckpointConfig.failure_domain must be the name of a Ray node label (e.g. 'rack' "
                f"for nodes started with `ray start --labels rack=r1`) or None, "
                f"got {self.failure_domain!r}"
            )

    @property
    def interleave_mode(self) -> Interleave:
        """``interleave`` as an :class:`Interleave`."""
        return interleave_mode(self.interleave)

    @property
    def resolved_namespace(self) -> str:
        return self.namespace or DEFAULT_NAMESPACE


def _choice(cfg: CheckpointConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(f"CheckpointConfig.{name}={value!r} is not valid; use one of {', '.join(map(repr, allowed))}")


def _int_at_least(cfg: CheckpointConfig, name: str, low: int, hint: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"CheckpointConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ConfigError(f"CheckpointConfig.{name}={value} must be >= {low} ({hint})")


def _reject_unknown_fields(cls):
    # A dataclass raises TypeError for an unknown keyword; we promise a ValueError that names
    # the field and suggests the closest real one, so a typo is obvious.
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls)]

    def __init__(self, *args, **kwargs):
        if args:
            raise ConfigError(f"{cls.__name__} takes keyword arguments only, e.g. {cls.__name__}(replicas=2)")
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(names)}"
                raise ConfigError(f"{cls.__name__} has no field {key!r}{hint}")
        init(self, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # help() and tools see the fields, not *args
    cls.__init__ = __init__
    return cls


_reject_unknown_fields(CheckpointConfig)
