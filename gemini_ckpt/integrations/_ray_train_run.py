"""A Ray Train run's checkpoint settings and host stores, as the driver and Ray Train's
controller see them (used by :mod:`gemini_ckpt.integrations.ray_train` and its callback)."""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
from typing import Any, Optional

from ..config import CheckpointConfig
from ..errors import ConfigError
from ..retention import LeftToRayTrain
from ..stores.durable import DurableTier
from ..format.layout import resolve_filesystem

log = logging.getLogger("gemini_ckpt")

DURABLE_DIR = "gemini"
"""Durable versions go to ``<Ray Train run directory>/gemini/step_XXXXXXXXX``."""


def resolve_config(config: Optional[CheckpointConfig], *, run_name: str, storage=None,
                   report: bool = True) -> tuple[CheckpointConfig, Optional[DurableTier]]:
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
                durable = DurableTier(filesystem=storage.storage_filesystem, root=root,
                                      keep=LeftToRayTrain() if report else config.keep_durable)
        elif report and not _inside(config.durable_uri, storage):
            raise ConfigError(
                f"CheckpointConfig.durable_uri={config.durable_uri!r} is outside this Ray Train run's "
                f"directory ({storage.experiment_fs_path}), so its versions cannot be reported as Ray "
                f"checkpoints; leave durable_uri=None (versions go to <run directory>/{DURABLE_DIR}) or "
                f"pass report=False")
    if changes:
        config = dataclasses.replace(config, **changes)
    return config, durable


def _is_local(fs) -> bool:
    import pyarrow.fs as pafs

    return isinstance(fs, pafs.LocalFileSystem)


def _inside(uri: str, storage) -> bool:
    fs, path = resolve_filesystem(uri)
    if type(fs) is not type(storage.storage_filesystem):
        return False
    run_dir = storage.experiment_fs_path.rstrip("/")
    if _is_local(fs):
        path, run_dir = os.path.realpath(path), os.path.realpath(run_dir)
    return path == run_dir or path.startswith(run_dir + "/")


def stop_host_stores(namespace: str) -> list[str]:
    """Stop the host stores and registry of ``namespace`` (a run's name); their versions are gone.
    Returns the names of the actors stopped. Needs a connected Ray (the driver after ``fit()``)."""
    from ..ray.cluster import shutdown_host_stores

    killed = shutdown_host_stores(namespace)
    log.info("gemini_ckpt: stopped %d host-store actor(s) of namespace %r", len(killed), namespace)
    return killed
