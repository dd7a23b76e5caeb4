"""Overlapped staging (``staging="overlap"``, :mod:`gemini_ckpt.save.overlap`) on the trainer.

``save()`` copies what may change before the next optimizer step itself and leaves the
parameters and optimizer state to a copying thread while the next step runs; each optimizer's
pre-step hook waits for that copy. One :class:`OverlapCopier` per Checkpointer holds the
copying thread, the copy in progress and the hooks.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from ..errors import CheckpointError, CheckpointTimeoutError
from ..faults import fire
from ..results import CheckpointStats, Phases, SaveHandle, StageInfo
from ..save import overlap
from ..save.sources import Sources
from ..save.stager import Stager
from ..state.train_state import TrainState
from ..stores.base import MemoryTier

log = logging.getLogger("gemini_ckpt")


class OverlapCopier:
    """The copying thread, the copy it is doing, the optimizers' hooks."""

    def __init__(
        self,
        state: TrainState,
        sources: Sources,
        stager: Stager,
        stats: CheckpointStats,
        *,
        rank: int,
        timeout_s: float,
    ) -> None:
        self.state = state
        self.sources = sources
        self.stager = stager
        self.stats = stats
        self.rank = rank
        self.timeout_s = timeout_s
        self._copier: Optional[ThreadPoolExecutor] = None
        self._copying: Optional[Future] = None
        self._step_hooks: list = []  # (optimizer, its pre-step hook's handle)
        self._split: Optional[tuple[int, list[int], list[int]]] = None  # (generation, now, behind)

    def behind(self, tensors: list) -> list[int]:
        """The tensor items the copying thread copies (cached per generation of the sources)."""
        gen = self.sources.generation
        if self._split is None or self._split[0] != gen:
            now, behind = overlap.split(self.state, tensors, self.sources.volatile)
            self._split = (gen, now, behind)
            hooked = {id(opt) for opt, _ in self._step_hooks}
            self._step_hooks += [
                (opt, opt.register_step_pre_hook(self._before_optimizer_step))
                for opt in self.state.optimizers
                if id(opt) not in hooked
            ]
            log.info(
                "rank %d: overlapped staging: %d tensor item(s) copied while the next step runs, %d by save()",
                self.rank,
                len(behind),
                len(now),
            )
        if not self._step_hooks:  # no optimizer: nothing would wait for the copy
            return []
        return self._split[2]

    def stage(
        self,
        store: MemoryTier,
        step: int,
        plan,
        segment,
        tensors: list,
        blobs: list,
        behind: list[int],
        due: bool,
        verdict,
        handle: SaveHandle,
        phases: Phases,
        t0: float,
    ) -> Future:
        """Copy what may change before the next optimizer step now, queue the rest on the
        copying thread; the future resolves as the store's outcome does."""
        now = self._split[1]
        after = None
        if any(tensors[i].device.type == "cuda" for i in behind):
            after = torch.cuda.Event()
            after.record()  # the sources are final here on the training stream
        versions = [overlap.version_of(tensors[i]) for i in behind]
        self.stager.copy_items(plan.shard, segment, tensors, now)
        phases.mark("copy")
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-ckpt-copy-behind")
        outcome: Future = Future()
        info = dict(
            step=step, stall_s=time.perf_counter() - t0, staged_bytes=plan.shard.region_bytes, phases=phases.done()
        )
        self._copying = self._copier.submit(
            self._copy_behind,
            store,
            step,
            plan,
            segment,
            tensors,
            blobs,
            behind,
            versions,
            due,
            verdict,
            handle,
            outcome,
            after,
            info,
        )
        return outcome

    def _copy_behind(
        self,
        store: MemoryTier,
        step: int,
        plan,
        segment,
        tensors: list,
        blobs: list,
        behind: list[int],
        versions: list[int],
        due: bool,
        verdict,
        handle: SaveHandle,
        outcome: Future,
        after,
        info: dict,
    ) -> None:
        t0 = time.perf_counter()
        try:
            fire("copy_behind", step=step, rank=self.rank)
            self.stager.copy_items(plan.shard, segment, tensors, behind, after=after)
            changed = [
                plan.tensor_index[i].fqn for i, v in zip(behind, versions) if overlap.version_of(tensors[i]) != v
            ]
            if changed:
                raise CheckpointError(
                    f"rank {self.rank}: version {step} is torn: {', '.join(changed[:5])}"
                    f"{f' and {len(changed) - 5} more' if len(changed) > 5 else ''} changed in place while "
                    f"staging='overlap' was copying it. Only optimizer.step() may change parameters and optimizer "
                    f"state between save() and the next step (it waits for the copy); change them after it, or use "
                    f"CheckpointConfig(staging='copy'). The previous version is kept"
                )
            fire("replicate", step=step, rank=self.rank)
            store_outcome = store.hand_off(step, plan.shard, segment, blobs, persist=due, verdict=verdict)
            segment = None
        except BaseException as exc:  # noqa: BLE001 - reported through the version's futures
            if segment is not None:
                try:
                    store.give_back(segment)
                except Exception as give_exc:  # noqa: BLE001 - a closing store takes it back itself
                    log.debug("could not give back a segment: %s", give_exc)
            handle.staged.set_exception(exc)
            outcome.set_exception(exc)
            return
        handle.staged.set_result(StageInfo(**info, behind_s=time.perf_counter() - t0))
        store_outcome.add_done_callback(
            lambda f: (
                outcome.set_exception(f.exception()) if f.exception() is not None else outcome.set_result(f.result())
            )
        )

    def wait_copy(self) -> float:
        """Wait for the overlapped copy in progress, if any; the seconds waited."""
        copying = self._copying
        if copying is None or copying.done():
            return 0.0
        t0 = time.perf_counter()
        try:
            copying.result(timeout=self.timeout_s)
        except TimeoutError as exc:
            raise CheckpointTimeoutError(
                f"rank {self.rank}: the overlapped copy of a version did not finish within {self.timeout_s}s"
            ) from exc
        return time.perf_counter() - t0

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        waited = self.wait_copy()
        if waited:
            self.stats.overlap_wait_s += waited
            self.stats.total_stall_s += waited

    def stop(self) -> None:
        """The overlapped copy in progress finishes before the store (and its segments) close."""
        for _, hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
