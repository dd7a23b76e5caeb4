"""The pool of training ranks on a local cluster of simulated hosts
(:class:`gemini_ckpt.testing.cluster.LocalCluster`: ``remove_hosts`` is a machine loss, ``add_host``
brings a replacement with the same ``host{i}`` resource).

- :class:`RankPool`: at most one :class:`~gemini_ckpt.chaos._worker.RankWorker` per host, reused
  across jobs; a dead or unclean worker is replaced on the same host.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray.exceptions import GetTimeoutError, RayError  # noqa: E402

from ..testing.cluster import LocalCluster  # noqa: E402
from ._worker import RankWorker  # noqa: E402

RAY_NAMESPACE = "gemini_chaos"


class RankPool:
    """Rank actors by host (see the module docstring)."""

    def __init__(self, sim: LocalCluster) -> None:
        self.sim = sim
        self.workers: dict[int, object] = {}
        self.infos: dict[int, dict] = {}

    def _start(self, host: int):
        return (
            ray.remote(RankWorker)
            .options(num_cpus=0, resources={f"host{host}": 0.01}, max_restarts=0, max_concurrency=4)
            .remote()
        )

    def alive(self, host: int, timeout: float = 10.0) -> bool:
        w = self.workers.get(host)
        if w is None:
            return False
        try:
            ray.get(w.info.remote(), timeout=timeout)
            return True
        except GetTimeoutError:
            return True  # busy, not dead
        except RayError:
            return False

    def ensure(self, hosts: tuple[int, ...], timeout: float = 180.0) -> list[int]:
        """A live worker on each of ``hosts``; returns the hosts that got a new one."""
        fresh = []
        for h in hosts:
            if not self.alive(h):
                self.workers[h] = self._start(h)
                fresh.append(h)
        refs = {h: self.workers[h].info.remote() for h in hosts}
        for h, ref in refs.items():
            self.infos[h] = ray.get(ref, timeout=timeout)
        return fresh

    def respawn(self, hosts: tuple[int, ...]) -> None:
        """Start new workers on ``hosts`` now, without waiting (their processes are dead or about
        to be replaced): a job controller starts replacements at once, so should we."""
        for h in hosts:
            self.forget(h)
            self.workers[h] = self._start(h)

    def pid(self, host: int) -> int:
        return self.infos[host]["pid"]

    def sigkill(self, host: int) -> None:
        try:
            os.kill(self.pid(host), signal.SIGKILL)
        except ProcessLookupError:
            pass

    def forget(self, host: int) -> None:
        w = self.workers.pop(host, None)
        self.infos.pop(host, None)
        if w is not None:
            try:
                ray.kill(w, no_restart=True)
            except RayError:
                pass

    def call(self, hosts: tuple[int, ...], method: str, *args, timeout: float, **kwargs) -> dict[int, object]:
        """Call ``method`` on the workers of ``hosts`` at once; host -> result, or the exception
        (``TimeoutError`` for a worker that did not answer in time)."""
        refs = {h: getattr(self.workers[h], method).remote(*args, **kwargs) for h in hosts}
        return self.collect(refs, timeout=timeout)

    @staticmethod
    def collect(refs: dict[int, object], *, timeout: float) -> dict[int, object]:
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        ready = set(ready)
        out: dict[int, object] = {}
        for h, ref in refs.items():
            if ref not in ready:
                out[h] = TimeoutError(f"host {h} did not answer within {timeout:.0f}s")
                continue
            try:
                out[h] = ray.get(ref)
            except RayError as exc:
                out[h] = exc
        return out

    def teardown(self, hosts: Optional[tuple[int, ...]] = None, *, limit_s: float = 2.0) -> list[int]:
        """Stop every job on ``hosts`` (default: all); workers that are dead, stuck or unclean
        are killed (and replaced at the next :meth:`ensure`). Returns the hosts killed."""
        hosts = tuple(self.workers) if hosts is None else hosts
        hosts = tuple(h for h in hosts if h in self.workers)
        results = self.call(hosts, "teardown", limit_s, timeout=limit_s + 15)
        dropped = []
        for h, r in results.items():
            if r is not True:
                self.forget(h)
                dropped.append(h)
        return dropped

    def kill_all(self) -> None:
        for h in list(self.workers):
            self.forget(h)
