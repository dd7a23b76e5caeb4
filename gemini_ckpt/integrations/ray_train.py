"""Ray Train integration: what a ``TorchTrainer`` job adds to checkpoint every step in memory.

Two pieces, one per side of the job::

    from ray.train import CheckpointConfig as RayCheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from gemini_ckpt import CheckpointConfig, TrainState
    from gemini_ckpt import ray_train as gray

    ckpt_config = CheckpointConfig(replicas=2, persist_every=10)

    def train_loop_per_worker(config):
        ...                                             # model, optimizer, data loader
        ckpt = gray.checkpointer(TrainState(model=model, optimizer=opt), ckpt_config)
        result = ckpt.restore()                         # memory first, then durable; None if fresh
        for step in range(result.step + 1 if result else 0, total_steps):
            ...                                         # forward, backward, optimizer.step()
            ckpt.save(step, metrics={"loss": loss.item()})
        ckpt.close()

    trainer = TorchTrainer(
        train_loop_per_worker,
        scaling_config=ScalingConfig(num_workers=4, label_selector=gray.ranks_on_hosts(4)),
        run_config=RunConfig(storage_path="/mnt/shared/runs", name="lm-7",
                             failure_config=FailureConfig(max_failures=3),
                             checkpoint_config=RayCheckpointConfig(num_to_keep=3)))
    with gray.host_stores(ckpt_config, run_name="lm-7"):  # host stores live as long as fit()
        result = trainer.fit()                          # result.checkpoint: the newest durable version

**Driver side** (:func:`host_stores`): nothing starts on the driver. Each worker's first
``save``/``restore`` creates the run's slot registry and its node's host store if missing (a
replacement node's worker creates that node's store), so stores and versions outlive worker
restarts; when the ``with`` block ends, the run's stores and registry are stopped, unless
``keep=True``. Only public Ray APIs are used. (:class:`HostStores`, a Ray Train v2 controller
callback, does the same from inside ``RunConfig(callbacks=[...])``; it rests on a hook Ray keeps
internal, so it lives in one adapter with a version check.)

**Worker side** (:func:`checkpointer`): a :class:`~gemini_ckpt.Checkpointer` whose rank,
world size, node and process group come from Ray Train (``TorchTrainer`` initializes
``torch.distributed``), and whose settings default from the run:

- ``namespace``: the run's name (``RunConfig(name)``), so driver and workers agree and two
  runs never share versions;
- ``durable_uri``: ``<run directory>/gemini`` on the run's storage (``RunConfig(storage_path)``)
  when ``persist_every > 0``;
- every persisted version is reported with ``ray.train.report(metrics,
  checkpoint=Checkpoint(<version directory>))`` without a copy (the directory is already on the
  run's storage), so ``Result.checkpoint`` and Ray's checkpoint list name it. Memory-only
  versions are not reported: ``report`` is a barrier of all workers through the controller.

Decisions worth knowing:

- **Which rank reports what, and when.** Ray Train v2 needs every rank to call ``report`` the
  same number of times, and ``report`` is a barrier through the controller. So the reports are
  made by a thread of the checkpointer's, never the training thread: rank 0's decides, once
  each persisted version is durable, in step order, and tells the other ranks over a small
  gloo group of this module's own; every rank's thread then reports it. ``result.checkpoint``
  (and Ray's checkpoint list) therefore name a version a moment after it became durable;
  ``close`` reports the rest (``persist_on_close``'s version included) and waits for them. A
  ``restore`` reports durable versions that a crash kept from being reported.
- **Retention belongs to Ray.** Reported versions are Ray's checkpoints, so Ray's
  ``CheckpointConfig(num_to_keep)`` decides which durable versions stay (it never deletes the
  newest); gemini_ckpt's ``keep_durable`` is not applied. Two owners deleting the same
  directories would leave Ray's run snapshot naming deleted checkpoints.
- **Restarts.** Under ``FailureConfig(max_failures=...)`` Ray Train restarts every worker;
  ``restore()`` loads the newest version that survives in the host stores' memory, else the
  newest durable one. A replacement node takes over the dead node's slot.
"""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch.distributed as dist

from ..checkpointer import Checkpointer
from ..config import CheckpointConfig
from ..errors import CheckpointError, ConfigError, RecoveryGaveUpError
from ..state.train_state import TrainState
from ..durable.tier import DurableTier
from ..retention import LeftToRayTrain
from ..durable.backends import open_uri
from ..hoststore.slots import HOST_LABEL
from . import _warm
from ._inplace_worker import recoverable, recovery_info
from ._ray_train_callback import HostStores
from ._ray_train_report import RayTrainReporting
from ._ray_train_run import DURABLE_DIR, host_stores, resolve_config, stop_host_stores

__all__ = [
    "DURABLE_DIR",
    "HOST_LABEL",
    "HostStores",
    "RayTrainCheckpointer",
    "RayTrainReporting",
    "RecoveryGaveUpError",
    "checkpointer",
    "detection_env",
    "host_stores",
    "preload_env",
    "ranks_on_hosts",
    "recoverable",
    "recovery_info",
    "resolve_config",
    "stop_host_stores",
    "torch_config",
    "warm_runtime_env",
]

log = logging.getLogger("gemini_ckpt")


def ranks_on_hosts(num_workers: int, *, ranks_per_host: int = 1) -> list[dict[str, str]]:
    """Per-worker label selectors that put rank ``r`` on host ``r // ranks_per_host`` after
    every restart, so each rank restores from its own host's memory, not a peer's:
    ``ScalingConfig(num_workers=n, label_selector=gray.ranks_on_hosts(n))``.

    The hosts are the nodes labelled :data:`HOST_LABEL` (``ray start --labels
    gemini-ckpt.io/host=0``; :class:`~gemini_ckpt.testing.cluster.LocalCluster` labels its
    hosts); a replacement started with a lost host's label takes over its slot. A worker group
    waits until every labelled host is there, so give each lost host a replacement (or leave
    the selectors out). Why Ray Train needs this: docs/recovery.md.

    >>> ranks_on_hosts(4, ranks_per_host=2)
    [{'gemini-ckpt.io/host': '0'}, {'gemini-ckpt.io/host': '0'}, {'gemini-ckpt.io/host': '1'}, {'gemini-ckpt.io/host': '1'}]
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"ranks_on_hosts(num_workers=...) needs a positive int, got {num_workers!r}")
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1:
        raise ValueError(f"ranks_on_hosts(ranks_per_host=...) needs a positive int, got {ranks_per_host!r}")
    return [{HOST_LABEL: str(rank // ranks_per_host)} for rank in range(num_workers)]


# --- in-place recovery (docs/recovery.md) ---------------------------------------------------------
def torch_config(
    *,
    backend: Optional[str] = None,
    timeout_s: int = 1800,
    reform_timeout_s: float = 120.0,
    max_stuck: int = 3,
    spares: int = 1,
    replace_within_s: float = 3.0,
    in_place: bool = True,
):
    """The ``TorchTrainer(torch_config=...)`` for in-place recovery: when a worker fails, Ray
    Train replaces only that worker, and the others (their processes, imports, CUDA context and
    host-store connections) stay; with :func:`recoverable` around the training function, every
    rank then forms the process group again with the newcomer and restores the newest committed
    version. Example::

        os.environ.update(gray.detection_env())       # on the driver, before fit()
        trainer = TorchTrainer(gray.recoverable(train_loop_per_worker),
                               torch_config=gray.torch_config(),
                               scaling_config=ScalingConfig(num_workers=4, label_selector=gray.ranks_on_hosts(4)),
                               run_config=RunConfig(failure_config=FailureConfig(max_failures=-1), ...))

    ``backend``, ``timeout_s``: as Ray's ``TorchConfig`` (``timeout_s`` bounds a collective on a
    peer that vanished without closing its connections). ``reform_timeout_s``: how long the
    survivors wait for a replacement to join; past it they end, and Ray Train restarts every
    worker. ``max_stuck``: recoveries in a row after which no newer version was committed before
    the run ends with :class:`RecoveryGaveUpError` (the same failure again and again); every
    in-place replacement also counts against ``FailureConfig(max_failures)``. ``spares``: idle
    worker processes kept started on each host with a worker, so a replacement does not wait for a
    new process and its imports (give the Train workers :func:`warm_runtime_env` for the imports;
    0: none). ``replace_within_s``: in an elastic run (``ScalingConfig(num_workers=(min, max))``),
    how long a lost host's place is kept for a node to take it (a standby host, a replacement that
    joins at once) after Ray Train finds its worker dead; then the run goes on without it, the
    survivors renumbered in their own processes, restoring from memory (docs/recovery.md, "Elastic").

    The path relies on Ray Train internals (replica groups, Ray 2.60): on a Ray it was not tested
    with, or with ``in_place=False``, this returns Ray's plain ``TorchConfig`` (every failure
    restarts all workers, as without it) and warns once.
    """
    from ._inplace_backend import GeminiTorchConfig, support

    for name, value in (
        ("timeout_s", timeout_s),
        ("reform_timeout_s", reform_timeout_s),
        ("replace_within_s", replace_within_s),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"torch_config({name}={value!r}): a positive number of seconds")
    if isinstance(max_stuck, bool) or not isinstance(max_stuck, int) or max_stuck < 1:
        raise ConfigError(
            f"torch_config(max_stuck={max_stuck!r}): a positive int (recoveries in a row without "
            f"progress before the run ends)"
        )
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise ConfigError(f"torch_config(spares={spares!r}): an int >= 0 (warm processes kept per host; 0 for none)")
    why = support() if in_place else "in_place=False"
    if why is None:
        return GeminiTorchConfig(
            backend=backend,
            timeout_s=timeout_s,
            reform_timeout_s=float(reform_timeout_s),
            max_stuck=max_stuck,
            spares=spares,
            replace_within_s=float(replace_within_s),
        )
    from ray.train.torch import TorchConfig

    if in_place:
        warnings.warn(
            f"gemini_ckpt: in-place recovery is unavailable ({why}); every failure restarts all workers "
            f"(Ray Train's full restart), and restore() still resumes from memory",
            stacklevel=2,
        )
    return TorchConfig(backend=backend, timeout_s=timeout_s)


def detection_env(*, poll_s: float = 0.25, hang_s: float = 30.0) -> dict[str, str]:
    """Ray Train's failure detection for in-place recovery, as the environment variables its
    controller reads (set them in the driver's environment before ``fit()``; Ray Train passes them
    on): poll the workers every ``poll_s`` (Ray's default is 2 s), and count a worker whose poll
    has not answered for ``hang_s`` (a stopped or wedged process; Ray's default is 600 s) as failed,
    so it is replaced like a dead one.

    >>> sorted(detection_env())
    ['RAY_TRAIN_HEALTH_CHECK_INTERVAL_S', 'RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S']
    """
    for name, value in (("poll_s", poll_s), ("hang_s", hang_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"detection_env({name}={value!r}): a positive number of seconds")
    return {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": repr(float(poll_s)),
        "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": repr(float(hang_s)),
    }


# What every Train worker imports sooner or later. Beyond the obvious, three modules imported lazily
# (in a replacement's training function otherwise, while the survivors wait): torch._dynamo, by the
# first DTensor made (FSDP2's fully_shard; 0.35-0.4 s alone, 0.7-1.0 s with four workers on two
# cores); Ray Tune's session check, by the first ray.train.get_context() (0.39 s in a replacement
# during a host fault's recovery); and the rank's side of the host-store connection, by
# Checkpointer's first start (0.09 s alone).
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "ray.train.torch",
    "ray.tune.trainable.trainable_fn_utils",
    "gemini_ckpt.integrations.ray_train",
    "gemini_ckpt.hoststore.client",
)


def preload_env(*modules: str) -> dict[str, str]:
    """The environment that makes every Ray worker process import ``modules`` (and torch, Ray
    Train and gemini_ckpt) when it starts, before it is given work: set it where Ray starts
    (``ray start`` on each host, or the driver before a local ``ray.init()``). Every worker pays
    for it, host stores and Ray's own actors included: prefer :func:`warm_runtime_env`, which
    warms only the Train workers.

    >>> preload_env("numpy")["RAY_preload_python_modules"].split(",")[-1]
    'numpy'
    """
    _warm.check_modules("preload_env", modules)
    return {"RAY_preload_python_modules": ",".join(dict.fromkeys(PRELOAD + modules))}


def warm_runtime_env(*modules: str, runtime_env: Optional[dict] = None) -> dict:
    """The runtime env for ``RunConfig(worker_runtime_env=...)`` that makes each Train worker
    process import torch, DCP, Ray Train, gemini_ckpt and ``modules`` as it starts, before it is
    given work. With :func:`torch_config`'s warm spares, a replacement worker then reaches the
    training function without importing them (seconds of a recovery). Name the modules the
    training function imports, e.g. ``warm_runtime_env("transformers")``; ``runtime_env``: a
    runtime env of your own to add to (not changed). Only Train workers pay for the imports (see
    :mod:`gemini_ckpt.integrations._warm`).

    >>> sorted(warm_runtime_env("numpy", runtime_env={"env_vars": {"A": "1"}}).get("env_vars"))
    ['A', 'GEMINI_CKPT_WARM_MODULES', '__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR']
    """
    _warm.check_modules("warm_runtime_env", modules)
    return _warm.runtime_env(PRELOAD + modules, runtime_env)


# --- worker side ---------------------------------------------------------------------------------
def checkpointer(
    state: TrainState, config: Optional[CheckpointConfig] = None, *, report: bool = True
) -> "RayTrainCheckpointer":
    """A :class:`RayTrainCheckpointer` for this Ray Train worker (call it on every worker).

    Example::

        ckpt = gemini_ckpt.integrations.ray_train.checkpointer(state, CheckpointConfig(replicas=2, persist_every=10))
        result = ckpt.restore()

    ``report=False`` keeps durable versions out of Ray's checkpoint list (then ``durable_uri``
    may point anywhere and ``keep_durable`` applies).
    """
    ctx = _train_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    initialized = dist.is_available() and dist.is_initialized()
    if world_size > 1 and not initialized:
        raise CheckpointError(
            f"rank {rank}: torch.distributed is not initialized in this Ray Train worker; run the loop "
            f"with ray.train.torch.TorchTrainer (it sets up the process group) or call "
            f"torch.distributed.init_process_group before gemini_ckpt.integrations.ray_train.checkpointer"
        )
    if initialized and (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise CheckpointError(
            f"torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()} but Ray Train says "
            f"{rank} of {world_size}; the process group must be the one TorchTrainer set up"
        )
    try:
        storage = ctx.get_storage()
    except NotImplementedError:  # Ray Train's local mode (num_workers=0): nothing to report to
        storage = None
    resolved, durable = resolve_config(config, run_name=ctx.get_experiment_name(), storage=storage, report=report)
    return RayTrainCheckpointer(state, resolved, durable=durable, report=report, storage=storage)


def _train_context():
    try:
        import ray.train

        return ray.train.get_context()
    except (RuntimeError, ImportError) as exc:
        raise CheckpointError(
            "gemini_ckpt.integrations.ray_train.checkpointer must be called inside a Ray Train "
            "training function (train_loop_per_worker)"
        ) from exc


class RayTrainCheckpointer(Checkpointer):
    """A :class:`~gemini_ckpt.Checkpointer` that reports persisted versions to Ray Train.

    Build it with :func:`checkpointer`. ``save(step, metrics=...)`` records the metrics Ray
    attaches to the version if it is persisted (rank 0's, as Ray Train keeps only those);
    ``reported_steps`` lists what was reported.

    It is a Checkpointer with one listener (:class:`RayTrainReporting`) and nothing overridden.
    Reports are made by a thread of the listener's, never by the training thread:
    ``ray.train.report`` is a barrier of every worker through Ray Train's controller, and on
    the training thread it stalled the step after each persisted version, for many times a
    step's length (docs/ray-train.md). A version is reported once it is durable, in step order;
    ``close`` waits for the last reports. While it reports, the job must not call ``ray.train.report`` itself
    (two threads of one worker reporting could pair up differently on different ranks): pass
    ``report=False`` to :func:`checkpointer` to report yourself.
    """

    def __init__(
        self,
        state: TrainState,
        config: CheckpointConfig,
        *,
        durable: Optional[DurableTier] = None,
        report: bool = True,
        storage=None,
    ) -> None:
        reporting = bool(
            report and storage is not None and config.persist_every > 0 and (config.durable_uri or durable is not None)
        )
        self.reporting: Optional[RayTrainReporting] = None
        if reporting:
            uri = config.durable_uri or durable.uri
            root = durable.store.root if durable is not None else open_uri(uri)[1]
            self.reporting = RayTrainReporting(storage=storage, report_root=root, timeout_s=config.timeout_s)
        super().__init__(
            state,
            config,
            durable=durable,
            durable_retention=LeftToRayTrain() if report and storage is not None else None,
            listeners=[self.reporting] if self.reporting is not None else [],
        )

    @property
    def reported_steps(self) -> list[int]:
        """The versions reported to Ray Train by this process, in order."""
        return list(self.reporting.reported_steps) if self.reporting is not None else []
