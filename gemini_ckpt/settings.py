"""``CheckpointConfig`` compiled once into what each part of the library is told.

The public :class:`~gemini_ckpt.CheckpointConfig` stays flat: it is the contract users write.
A ``Checkpointer`` compiles it once, at construction (:func:`compile_config`), and each part
gets only its own settings: the snapshot :class:`SaveSettings`, restore
:class:`RestoreSettings`, the host stores' client :class:`StoreSettings`, the durable tier
:class:`DurableSettings`. Modes arrive as what the part branches on (an :class:`Interleave`, a
flag), defaults and the signing key are resolved here and nowhere else, and what a job tells
its registry (:meth:`StoreSettings.job`) is built from these settings only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .config import CheckpointConfig, Interleave
from .health import HealthCheck
from .signing import resolve_key


@dataclass(frozen=True)
class StoreSettings:
    """What the host stores' client side needs (:mod:`gemini_ckpt.hoststore`)."""

    namespace: str
    named: bool  # the namespace was given (a signing key needs one: it binds the namespace)
    timeout_s: float
    replicas: int
    placement: str
    keep: int  # committed versions kept in memory
    budget_bytes: Optional[int]
    failure_domain: Optional[str]
    bandwidth: Optional[int]
    interleave: Interleave
    metrics: bool
    key: Optional[bytes] = field(default=None, repr=False)

    def job(self) -> dict:
        """What a job tells its registry about itself at every rendezvous (plain values: it
        travels over Ray and is kept there); the registry tells stores from it outside a
        rendezvous (:func:`gemini_ckpt.hoststore.actors.state.store_config`) and budgets
        replacements' by it."""
        return {
            "replicas": self.replicas,
            "strategy": self.placement,
            "budget": self.budget_bytes,
            "key": self.key.hex() if self.key else None,
            "bandwidth": self.bandwidth,
            "domain": self.failure_domain,
            "interleave": self.interleave,
            "metrics": self.metrics,
        }


@dataclass(frozen=True)
class SaveSettings:
    """What the snapshot and the versions in flight need (:mod:`gemini_ckpt.checkpointer`)."""

    timeout_s: float
    overlap: bool  # staging="overlap"
    health_check: Optional[HealthCheck]
    max_inflight: int
    skip_when_busy: bool  # inflight_policy="skip"
    keep: int  # committed versions kept in memory: with max_inflight, the segments a rank reuses
    namespace: str  # with replicas and placement, what a version says of its job
    replicas: int
    placement: str


@dataclass(frozen=True)
class RestoreSettings:
    """What restore needs to choose and read a version (:mod:`gemini_ckpt.restore`)."""

    namespace: str
    key: Optional[bytes] = field(repr=False)
    derive_world_size: bool  # world_size_change="derive"
    init_from: Optional[str]


@dataclass(frozen=True)
class DurableSettings:
    """What the durable tier's writer and its policy need (:mod:`gemini_ckpt.durable`)."""

    uri: Optional[str]
    every: int  # persist every Nth committed version; 0: never
    keep: int
    on_close: bool
    raise_errors: bool  # persist_errors="raise"
    timeout_s: float
    key: Optional[bytes] = field(repr=False)


@dataclass(frozen=True)
class Settings:
    """A ``CheckpointConfig`` compiled (:func:`compile_config`): one part per concern."""

    local: bool  # store="local": versions kept in this process
    namespace: str
    timeout_s: float
    overwrite: bool
    save: SaveSettings
    restore: RestoreSettings
    store: StoreSettings
    durable: DurableSettings


def store_settings(config: CheckpointConfig) -> StoreSettings:
    """The host stores' part of ``config`` alone (for a caller that connects to them itself)."""
    return _store(config, resolve_key(config.signing_key))


def _store(config: CheckpointConfig, key: Optional[bytes]) -> StoreSettings:
    return StoreSettings(
        namespace=config.resolved_namespace,
        named=config.namespace is not None,
        timeout_s=config.timeout_s,
        replicas=config.replicas,
        placement=config.placement,
        keep=config.keep_in_memory,
        budget_bytes=config.host_memory_budget_bytes,
        failure_domain=config.failure_domain,
        bandwidth=config.replication_bandwidth,
        interleave=config.interleave_mode,
        metrics=config.metrics,
        key=key,
    )


def compile_config(config: CheckpointConfig) -> Settings:
    """``config`` compiled into per-concern settings; the signing key (``signing_key``, else
    ``$GEMINI_CKPT_SIGNING_KEY``) is resolved here, once."""
    key = resolve_key(config.signing_key)
    timeout_s = config.timeout_s
    return Settings(
        local=config.store == "local",
        namespace=config.resolved_namespace,
        timeout_s=timeout_s,
        overwrite=config.overwrite,
        save=SaveSettings(
            timeout_s=timeout_s,
            overlap=config.staging == "overlap",
            health_check=config.health_check,
            max_inflight=config.max_inflight,
            skip_when_busy=config.inflight_policy == "skip",
            keep=config.keep_in_memory,
            namespace=config.resolved_namespace,
            replicas=config.replicas,
            placement=config.placement,
        ),
        restore=RestoreSettings(
            namespace=config.resolved_namespace,
            key=key,
            derive_world_size=config.world_size_change == "derive",
            init_from=config.init_from,
        ),
        store=_store(config, key),
        durable=DurableSettings(
            uri=config.durable_uri,
            every=config.persist_every,
            keep=config.keep_durable,
            on_close=config.persist_on_close,
            raise_errors=config.persist_errors == "raise",
            timeout_s=timeout_s,
            key=key,
        ),
    )
