"""One training job on the harness's rank pool (:class:`JobRun`), its rendezvous store
(:class:`~gemini_ckpt.testing.ranks.Rendezvous`), and telling infrastructure failures from the
library's."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any, Callable, Optional, Protocol

from ..testing.ranks import Rendezvous
from ._results import HarnessError, InfraError, err, infrastructure
from ._phases import HookRule
from ._spec import DOMAIN_LABEL, ChaosConfig


class Harness(Protocol):
    """What a job needs of the harness that runs it (:class:`~gemini_ckpt.chaos._harness.Harness`)."""

    workdir: str
    pool: Any  # the rank pool (:class:`~gemini_ckpt.chaos._sim.RankPool`)
    config: ChaosConfig
    rendezvous_host: str  # where the ranks reach the driver (the head's address)


StoreFactory = Callable[[Any, int, int], Any]
"""``store_factory(config, rank, world_size) -> Store``, called in each rank process; the store
is passed to ``Checkpointer(store=...)`` (e.g. a wrapper around ``connect_ray_store``)."""


# --- one job on the pool -------------------------------------------------------------------------------
class JobRun:
    """One training job (a namespace, a durable directory) on some hosts of the pool."""

    def __init__(
        self,
        harness: "Harness",
        label: str,
        *,
        job: Any,
        placement: str = "group",
        persist: bool = True,
        store_factory: Optional[StoreFactory] = None,
        chaos_fs: bool = False,
    ) -> None:
        self.h = harness
        self.job = job
        self.namespace = f"chaos-{label}-{uuid.uuid4().hex[:8]}"
        self.durable_root = os.path.join(harness.workdir, self.namespace)
        self.placement = placement
        self.persist = persist
        self.store_factory = store_factory
        self.chaos_fs = chaos_fs
        self.world_size = 0
        self.notes: list[str] = []
        self.rendezvous: Optional[Rendezvous] = None

    def _config(self) -> dict:
        cfg = self.h.config
        out = {
            "store": "ray",
            "namespace": self.namespace,
            "replicas": cfg.replicas,
            "placement": self.placement,
            "keep_in_memory": cfg.keep_in_memory,
            "timeout_s": float(cfg.timeout_s),
            "host_memory_budget_bytes": cfg.host_memory_budget_bytes,
        }
        if cfg.domains is not None:
            out["failure_domain"] = DOMAIN_LABEL
        if self.persist:
            out.update(persist_every=cfg.persist_every, keep_durable=cfg.keep_durable)
            if not self.chaos_fs:
                out["durable_uri"] = self.durable_root
        return out

    def setup(
        self,
        hosts: tuple[int, ...],
        *,
        rules: Optional[dict[int, list[HookRule]]] = None,
        storage_mode: str = "ok",
        strict: bool = True,
    ) -> dict[int, Any]:
        """Start the job on ``hosts`` (rank ``i`` on ``hosts[i]``) in a new process group.

        By rank: :meth:`RankWorker.setup`'s answer. A rank that failed in its rendezvous or its
        job's ``build``, died or did not answer is the harness's failure: every rank process of
        this start is killed (replaced at the next :meth:`Harness.ensure`) and
        :class:`InfraError` is raised. A rank whose ``Checkpointer`` could not be built is the
        library's: :class:`HarnessError` when ``strict``, else in the answer."""
        cfg = self.h.config
        os.makedirs(self.durable_root, exist_ok=True)
        self.close_rendezvous()
        with infrastructure("starting the rendezvous store"):
            self.rendezvous = Rendezvous(len(hosts), cfg.timeout_s, host=self.h.rendezvous_host)
        self.world_size = len(hosts)
        refs = {}
        with infrastructure("starting the job on the rank processes"):
            for rank, host in enumerate(hosts):
                spec = {
                    "rank": rank,
                    "world_size": len(hosts),
                    "rendezvous": self.rendezvous.address,
                    "config": self._config(),
                    "job": self.job,
                    "seed": cfg.seed,
                    "timeout_s": float(cfg.timeout_s),
                    "durable_root": self.durable_root,
                    "chaos_fs": self.chaos_fs and self.persist,
                    "storage_mode": storage_mode,
                    "keep_durable": cfg.keep_durable,
                    "rules": (rules or {}).get(rank, []),
                    "store_factory": self.store_factory,
                }
                refs[rank] = self.h.pool.workers[host].setup.remote(spec)
        timeout = cfg.timeout_s + 120
        results = _collect_until_infra_failure(refs, timeout=timeout)
        stuck = [r for r, v in results.items() if isinstance(v, TimeoutError) and not isinstance(v, _Abandoned)]
        if stuck:
            stages = self.h.pool.collect(
                {r: self.h.pool.workers[hosts[r]].setup_stage.remote() for r in stuck}, timeout=10
            )
            for r, stage in stages.items():
                if stage == "checkpointer":  # the library under test hangs: an observation, not ours
                    results[r] = {
                        "error": f"building the Checkpointer did not finish within {timeout:.0f}s",
                        "stage": stage,
                    }
                    self.kill((hosts[r],))
        failed = {r: why for r, v in results.items() if (why := infra_problem(v))}
        if failed:
            self.kill(hosts)
            self.close_rendezvous()
            rank = min(failed, key=lambda r: (isinstance(results[r], TimeoutError), r))
            raise InfraError(
                f"{self.namespace}: the job could not start on {len(hosts)} ranks: rank {rank} "
                f"(host {hosts[rank]}): {failed[rank]}; its rank processes are replaced"
            )
        if strict:
            self.expect_all(results, "setup")
        return results

    def call(self, hosts: tuple[int, ...], method: str, *args, timeout: float) -> dict[int, Any]:
        """By rank."""
        refs = {rank: getattr(self.h.pool.workers[host], method).remote(*args) for rank, host in enumerate(hosts)}
        return self.h.pool.collect(refs, timeout=timeout)

    def run_async(self, hosts: tuple[int, ...], steps: list[int], **kwargs) -> dict[int, Any]:
        return {rank: self.h.pool.workers[host].run.remote(steps, **kwargs) for rank, host in enumerate(hosts)}

    def run(self, hosts: tuple[int, ...], steps: list[int], **kwargs) -> dict[int, Any]:
        refs = self.run_async(hosts, steps, **kwargs)
        return self.h.pool.collect(refs, timeout=self.run_timeout(len(steps)))

    def run_timeout(self, steps: int) -> float:
        return self.h.config.timeout_s + 30.0 * max(1, steps)

    @staticmethod
    def expect_all(results: dict[int, Any], what: str) -> dict[int, Any]:
        """``results`` unless a rank failed (an exception, an error record, or an error string
        from ``close``): then :class:`HarnessError`."""
        for rank, r in sorted(results.items()):
            problem = err(r) or (r if isinstance(r, str) else None)
            if problem:
                raise HarnessError(f"{what} failed on rank {rank}: {problem}")
        return results

    def kill(self, hosts: tuple[int, ...]) -> None:
        """Kill the rank processes of ``hosts`` (new ones start at the next :meth:`Harness.ensure`)."""
        for host in hosts:
            self.h.pool.forget(host)

    def close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            rendezvous, self.rendezvous = self.rendezvous, None
            rendezvous.close()

    def cleanup(self, hosts: tuple[int, ...], *, kill: bool = False) -> None:
        """Stop the job whatever state it is in: its ranks leave the process group (or, with
        ``kill`` or when they cannot, their processes are killed), the rendezvous port is
        released, the namespace's host stores and the durable directory are removed."""
        from ..hoststore.cluster import shutdown_host_stores

        try:
            present = tuple(h for h in hosts if h in self.h.pool.workers)
            if kill:
                self.kill(present)
            else:
                self.h.pool.teardown(present)
        finally:
            try:
                self.close_rendezvous()
                shutdown_host_stores(self.namespace)
            finally:
                shutil.rmtree(self.durable_root, ignore_errors=True)


def infra_problem(answer: Any) -> Optional[str]:
    """Why a rank's answer to ``setup`` is the harness's failure rather than the library's
    (None when it is not): the rank died or did not answer, or failed in its rendezvous or
    in the job's ``build``."""
    if isinstance(answer, BaseException):
        return err(answer)
    if isinstance(answer, dict) and answer.get("error") and answer.get("stage") in ("rendezvous", "build"):
        return f"{answer['stage']} failed: {answer['error']}"
    return None


def _collect_until_infra_failure(refs: dict[int, Any], *, timeout: float) -> dict[int, Any]:
    """Like ``RankPool.collect``, but stops waiting at the first rank that failed for the
    harness's reasons (its peers would only wait for it until the rendezvous times out); the
    ranks not heard from are answered with ``TimeoutError`` (``_Abandoned`` when it stopped
    early)."""
    import ray
    from ray.exceptions import RayError

    rank_of = {ref: rank for rank, ref in refs.items()}
    pending = list(refs.values())
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        stop = False
        for ref in ready:
            try:
                out[rank_of[ref]] = ray.get(ref)
            except RayError as exc:
                out[rank_of[ref]] = exc
            stop = stop or infra_problem(out[rank_of[ref]]) is not None
        if stop:
            break
    for ref in pending:
        out[rank_of[ref]] = (
            TimeoutError(f"no answer within {timeout:.0f}s")
            if time.monotonic() >= deadline
            else _Abandoned("not waited for: another rank failed to start")
        )
    return dict(sorted(out.items()))


class _Abandoned(TimeoutError):
    """A rank not waited for once another one failed to start."""
