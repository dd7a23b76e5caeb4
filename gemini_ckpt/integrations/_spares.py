"""Warm spare processes for in-place replacement (in Ray Train's controller process).

A replacement worker spends most of its start importing (torch, Ray Train, the training
function's modules): seconds on a busy host, while the survivors wait. Each host's raylet can
start idle worker processes ahead of need (its ``PrestartWorkers`` call): a process started with
the Train workers' runtime env is the one the raylet hands to the next Train worker placed on
that host, and it has already run their runtime env's warm-up hook
(:func:`gemini_ckpt.integrations.ray_train.warm_runtime_env`) or the cluster's
``RAY_preload_python_modules`` (``preload_env``). Without either it still saves the
Ray worker's own start.

A host that joins while the run lasts (a replacement for a lost one, a standby) gets its spares
as soon as it is seen (the node table is read every ``WATCH_S``): Ray declares the lost host dead
seconds after it stopped answering, and only then places its replacement worker, which finds a
process that has been importing meanwhile instead of starting one. Such a host's spares are not
renewed unless a Train worker is placed there.

The call is internal to Ray (2.60), like the rest of the in-place path: when it fails, spares are
turned off with one warning and replacements start cold, as without them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

log = logging.getLogger("gemini_ckpt")

KEEP_ALIVE_S = 3600  # how long the raylet keeps an unused spare; they are started again before it
REFILL_DELAY_S = 15.0  # a replacement's spare is made again this long after: its imports would
# otherwise take a core from the recovery they are meant to shorten
CALL_TIMEOUT_S = 5.0
WATCH_S = 0.5  # how often the node table is read for hosts that joined


def describe() -> tuple[str, str]:
    """(the serialized runtime env, the job id) of the worker this runs on."""
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_runtime_env_string(), ctx.get_job_id()


class Spares:
    """Keeps ``per_node`` idle, warm worker processes on every host that runs a Train worker."""

    def __init__(self, per_node: int, *, keep_alive_s: int = KEEP_ALIVE_S) -> None:
        self.per_node = per_node
        self.keep_alive_s = keep_alive_s
        self._runtime_env: Optional[str] = None
        self._job_id: Optional[str] = None
        self._nodes: set[str] = set()
        self._off: Optional[str] = None if per_node > 0 else "spares=0"
        self._timer: Optional[threading.Timer] = None
        self._stopped = False
        self._lock = threading.Lock()
        self._seen: Optional[set[str]] = None  # the live nodes the watch knows of (None: not watching)

    def learn(self, runtime_env: str, job_id: str) -> None:
        self._runtime_env, self._job_id = runtime_env, job_id

    def start(self, node_ids, count: Optional[int] = None, *, delay_s: float = 0.0) -> None:
        """Ask each node's raylet for ``count`` (default ``per_node``) spares (after ``delay_s``),
        and keep them renewed while the run lasts."""
        if delay_s > 0:
            timer = threading.Timer(delay_s, self._refill, args=(set(node_ids), count))
            timer.daemon = True
            timer.start()
            return
        with self._lock:
            self._stopped = False
            self._start(node_ids, count)

    def _refill(self, node_ids, count: Optional[int]) -> None:
        with self._lock:
            if not self._stopped:  # the run did not end meanwhile
                self._start(node_ids, count)

    def _start(self, node_ids, count: Optional[int]) -> None:
        """Ask for the spares (the caller holds the lock); the first failure turns spares off."""
        if self._off is not None or self._runtime_env is None:
            return
        try:
            raylets = _live_raylets()  # one read of the node table for all the hosts
            for node in set(node_ids) & raylets.keys():
                _prestart(
                    raylets[node],
                    self._runtime_env,
                    self._job_id,
                    self.per_node if count is None else count,
                    self.keep_alive_s,
                )
        except Exception as exc:  # noqa: BLE001 - an internal call of Ray's: any failure turns spares off
            self._off = f"{type(exc).__name__}: {exc}"
            log.warning(
                "gemini_ckpt: warm spare processes are off (Ray's PrestartWorkers failed: %s); a replaced "
                "worker starts a new process",
                self._off,
            )
            return
        self._nodes = (self._nodes | set(node_ids)) & raylets.keys()  # a lost host's spares went with it
        if self._timer is None:
            self._arm()
        if self._seen is None:
            self._seen = set(raylets)
            threading.Thread(target=self._watch, name="gemini-ckpt-spares-watch", daemon=True).start()

    def _watch(self) -> None:
        """Spares on every host that joins while the run lasts, as soon as it is seen."""
        while True:
            time.sleep(WATCH_S)
            with self._lock:
                if self._stopped or self._off is not None:
                    self._seen = None
                    return
                try:
                    raylets = _live_raylets()
                    for node in raylets.keys() - self._seen:
                        _prestart(raylets[node], self._runtime_env, self._job_id, self.per_node, self.keep_alive_s)
                        log.info("gemini_ckpt: %d warm spare(s) on host %s, which joined", self.per_node, node[:12])
                    self._seen = set(raylets)
                except Exception as exc:  # noqa: BLE001 - an internal call of Ray's: the watch ends, spares stay
                    log.warning("gemini_ckpt: hosts that join get no warm spare (%s: %s)", type(exc).__name__, exc)
                    self._seen = None
                    return

    def stop(self) -> None:
        """Stop renewing (the run's worker group ended; spares left die with the job or expire)."""
        with self._lock:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _arm(self) -> None:
        self._timer = threading.Timer(self.keep_alive_s * 0.9, self._renew)
        self._timer.daemon = True
        self._timer.start()

    def _renew(self) -> None:
        with self._lock:
            self._timer = None
            if not self._stopped:
                self._start(set(self._nodes), None)


def _live_raylets() -> dict[str, str]:
    """node id -> its raylet's gRPC address, for the live nodes."""
    import ray

    return {n["NodeID"]: f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}" for n in ray.nodes() if n.get("Alive")}


def _prestart(address: str, runtime_env: str, job_id: str, count: int, keep_alive_s: int) -> None:
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

    channel = init_grpc_channel(address)
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
            node_manager_pb2.PrestartWorkersRequest(
                language=common_pb2.PYTHON,
                job_id=bytes.fromhex(job_id),
                runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=runtime_env),
                keep_alive_duration_secs=int(keep_alive_s),
                num_workers=count,
            ),
            timeout=CALL_TIMEOUT_S,
        )
    finally:
        channel.close()
