"""A Ray Train run's checkpoint settings and host stores, as the driver and Ray Train's
controller see them (used by :mod:`gemini_ckpt.integrations.ray_train` and its callback): the
driver's :func:`host_stores` block around ``fit()`` lives here, and users reach it as
``gemini_ckpt.integrations.ray_train.host_stores``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import posixpath
from typing import Any, Iterator, Optional

from ..config import CheckpointConfig
from ..errors import ConfigError
from ..retention import LeftToRayTrain
from ..durable.tier import DurableTier
from ..durable.backends import open_uri

log = logging.getLogger("gemini_ckpt")

DURABLE_DIR = "gemini"
"""Durable versions go to ``<Ray Train run directory>/gemini/step_XXXXXXXXX``."""


def resolve_config(
    config: Optional[CheckpointConfig], *, run_name: str, storage=None, report: bool = True
) -> tuple[CheckpointConfig, Optional[DurableTier]]:
    """The run's settings: ``namespace`` defaults to ``run_name``; with a durable tier and
    ``storage`` (Ray Train's ``StorageContext``), ``durable_uri`` defaults to the run's
    directory. Returns ``(config, durable tier or None)``; the tier is built here only when the
    storage filesystem cannot be named by a URI string (a custom ``storage_filesystem``)."""
    config = config if config is not None else CheckpointConfig()
    if not isinstance(config, CheckpointConfig):
        raise TypeError(f"expected a gemini_ckpt.CheckpointConfig, got {type(config).__name__}")
    changes: dict[str, Any] = {}
    if config.namespace is None:
        changes["namespace"] = run_name
    durable = None
    if config.persist_every > 0 and storage is not None:
        root = posixpath.join(storage.experiment_fs_path, DURABLE_DIR)
        if config.durable_uri is None:
            if _is_local(storage.storage_filesystem):
                changes["durable_uri"] = root
            else:
                durable = DurableTier(
                    filesystem=storage.storage_filesystem,
                    root=root,
                    keep=LeftToRayTrain() if report else config.keep_durable,
                )
        elif report and not _inside(config.durable_uri, storage):
            raise ConfigError(
                f"CheckpointConfig.durable_uri={config.durable_uri!r} is outside this Ray Train run's "
                f"directory ({storage.experiment_fs_path}), so its versions cannot be reported as Ray "
                f"checkpoints; leave durable_uri=None (versions go to <run directory>/{DURABLE_DIR}) or "
                f"pass report=False"
            )
    if changes:
        config = dataclasses.replace(config, **changes)
    return config, durable


def _is_local(fs) -> bool:
    import pyarrow.fs as pafs

    return isinstance(fs, pafs.LocalFileSystem)


def _inside(uri: str, storage) -> bool:
    fs, path = open_uri(uri)
    if type(fs) is not type(storage.storage_filesystem):
        return False
    run_dir = storage.experiment_fs_path.rstrip("/")
    if _is_local(fs):
        path, run_dir = os.path.realpath(path), os.path.realpath(run_dir)
    return path == run_dir or path.startswith(run_dir + "/")


def stop_host_stores(namespace: str) -> list[str]:
    """Stop the host stores and registry of ``namespace`` (a run's name); their versions are gone.
    Returns the names of the actors stopped. Needs a connected Ray (the driver after ``fit()``)."""
    from ..hoststore.cluster import shutdown_host_stores

    killed = shutdown_host_stores(namespace)
    log.info("gemini_ckpt: stopped %d host-store actor(s) of namespace %r", len(killed), namespace)
    return killed


# --- driver side ---------------------------------------------------------------------------------
@contextlib.contextmanager
def host_stores(
    config: Optional[CheckpointConfig] = None, *, run_name: Optional[str] = None, run_config=None, keep: bool = False
) -> Iterator[Optional[str]]:
    """Around ``trainer.fit()`` on the driver: when the block ends (normally or by an error), the
    run's host stores and slot registry are stopped, unless ``keep=True``. Yields the namespace
    (None when it is not known before ``fit()``: see below).

    Example::

        run_config = RunConfig(name="lm-7", storage_path="/mnt/shared/runs")
        with gray.host_stores(ckpt_config, run_config=run_config):
            result = TorchTrainer(..., run_config=run_config).fit()

    The namespace the workers use is ``CheckpointConfig.namespace``, else the run's name
    (:func:`~gemini_ckpt.integrations.ray_train.checkpointer` resolves it the same way): pass
    ``run_name=`` or the ``run_config=`` given to the trainer (a ``RunConfig`` without a name
    gets one Ray generates when it is built, and that is the one used). With neither, the block
    stops the namespaces whose stores first appeared while it ran (the run's, whatever its
    name): don't run two trainers of the same Ray cluster inside such blocks at once.

    The stores themselves are started by the workers: each rank's first ``save``/``restore``
    creates the registry and its node's store (with ``host_memory_budget_bytes``) if they do
    not exist, so a replacement node gets its store from its own worker. Only public Ray APIs
    are involved.
    """
    name = run_name or (getattr(run_config, "name", None) if run_config is not None else None)
    if (config is not None and getattr(config, "namespace", None)) or name:
        namespace = resolve_config(config, run_name=name or "")[0].resolved_namespace
        before = None
    elif not _connected():
        raise ConfigError(
            "host_stores() needs the run's name to know which host stores to stop: pass the trainer's "
            "RunConfig (host_stores(ckpt_config, run_config=run_config); a RunConfig without a name has "
            "the one Ray generated), run_name=RunConfig.name, or CheckpointConfig.namespace; or connect "
            "to Ray (ray.init) before the block, so the stores that appear during it can be told apart"
        )
    else:
        namespace, before = None, _namespaces()
    try:
        yield namespace
    finally:
        if not keep and _connected():
            for ns in [namespace] if namespace is not None else sorted(_namespaces() - before):
                stop_host_stores(ns)


def _connected() -> bool:
    import ray

    return ray.is_initialized()


def _namespaces() -> set[str]:
    if not _connected():
        return set()
    from ..hoststore.cluster import named_actors

    return set(named_actors())
