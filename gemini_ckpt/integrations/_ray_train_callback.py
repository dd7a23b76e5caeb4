"""The one adapter to a Ray Train hook Ray keeps internal: the :class:`HostStores` callback.

Ray Train v2's controller callbacks (``ray.train.v2._internal.execution.callback``, a
DeveloperAPI) let a run start its host stores before a worker group trains and stop them when
``fit()`` ends or is aborted. Nothing needs it: workers start their node's store lazily and
:func:`gemini_ckpt.integrations.ray_train.host_stores` stops them after ``fit()``. It is kept for
the convenience of one line in ``RunConfig(callbacks=[...])``, behind a version check: on a Ray
it does not know, constructing it fails with a message naming the public path instead.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ._ray_train_run import resolve_config, stop_host_stores

log = logging.getLogger("gemini_ckpt")

SUPPORTED_RAY = (2, 45)  # the first Ray 2.x with these callback interfaces (checked up to 2.60)
_PUBLIC_PATH = (
    "start nothing on the driver (workers start their node's store) and wrap fit() in "
    "`with gemini_ckpt.integrations.ray_train.host_stores(ckpt_config, run_name=...):`"
)


def ray_version() -> tuple[int, int]:
    """The installed Ray's (major, minor); (0, 0) when it cannot be read."""
    import ray

    try:
        major, minor = (int(p) for p in ray.__version__.split(".")[:2])
    except ValueError:
        return (0, 0)
    return major, minor


def _callback_bases() -> tuple[Optional[str], tuple[type, ...]]:
    """``(why the hook is unavailable or None, base classes)``."""
    version = ray_version()
    if version < SUPPORTED_RAY or version[0] != SUPPORTED_RAY[0]:
        return (
            f"Ray {'.'.join(map(str, version))} is outside the versions this callback supports "
            f"(2.x from {'.'.join(map(str, SUPPORTED_RAY))})"
        ), (object,)
    try:
        from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
    except ImportError as exc:  # Ray Train v1, or the internal module moved
        return f"Ray Train v2's callback interfaces cannot be imported ({exc})", (object,)
    return None, (ControllerCallback, WorkerGroupCallback)


_UNAVAILABLE, _BASES = _callback_bases()


class HostStores(*_BASES):  # type: ignore[misc]
    """Ray Train callback: host stores for the run, from its start to the end of ``fit()``.

    Example::

        RunConfig(name="lm-7", callbacks=[HostStores(CheckpointConfig(replicas=2))])

    Runs in Ray Train's controller actor. ``config`` must be the ``CheckpointConfig`` the
    workers use (its ``namespace`` defaults to the run name on both sides; its
    ``host_memory_budget_bytes`` sizes the stores). ``keep=True`` leaves the stores and their
    versions alive after ``fit()`` (a later run with the same name and ``keep`` resumes from
    them; stop them with ``gemini_ckpt.integrations.ray_train.stop_host_stores(namespace)``).
    """

    def __init__(self, config: Optional[CheckpointConfig] = None, *, keep: bool = False) -> None:
        if _UNAVAILABLE is not None:
            raise CheckpointError(
                f"gemini_ckpt.integrations.ray_train.HostStores is unavailable: {_UNAVAILABLE}; {_PUBLIC_PATH}"
            )
        self.config = config if config is not None else CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise TypeError(
                f"HostStores(config=...) must be a gemini_ckpt.CheckpointConfig, got {type(self.config).__name__}"
            )
        self.keep = keep
        self.namespace: Optional[str] = self.config.namespace
        self._resolved: Optional[CheckpointConfig] = None
        self._stopped = False

    # ControllerCallback
    def after_controller_start(self, train_run_context) -> None:
        from ..hoststore.cluster import start_host_stores

        self._resolved, _ = resolve_config(self.config, run_name=train_run_context.run_config.name)
        self.namespace = self._resolved.resolved_namespace
        start_host_stores(self._resolved, node_ids=())  # the registry: slots outlive worker restarts
        log.info("gemini_ckpt: run %s uses host-store namespace %r", train_run_context.run_config.name, self.namespace)

    async def before_controller_shutdown(self) -> None:
        self._stop()

    def before_controller_abort(self) -> None:
        self._stop()

    # WorkerGroupCallback
    def after_worker_group_start(self, worker_group) -> None:
        # Workers exist but the training function has not started: every node of this group
        # (a replacement node included) gets its store, with the job's budget, before a rank uses it.
        from ..hoststore.cluster import start_host_stores

        nodes = sorted({w.metadata.node_id for w in worker_group.get_workers()})
        start_host_stores(self._resolved, node_ids=nodes)

    def _stop(self) -> None:
        if self.keep or self._stopped or self.namespace is None:
            return
        self._stopped = True
        stop_host_stores(self.namespace)
