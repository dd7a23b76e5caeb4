"""The training rank: a Ray actor pinned to one simulated host, running the user's job with a
``Checkpointer`` and the harness's fault hook.

A :class:`~gemini_ckpt.testing.ranks.TrainingRank` (the process group's join, the Checkpointer,
the teardown) with the job, its error stages, the fault hook and the storage switch.

Threaded (``max_concurrency=4``) so the driver can ask whether a rank is held at a phase, and
let it go, while ``run`` is busy. Everything it returns is plain data (and, for the
reference run, CPU tensors).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ..testing.ranks import TrainingRank
from ._phases import HookRule


def describe_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    while cause is not None and len(text) < 2000:
        text += f" <- {type(cause).__name__}: {cause}"
        cause = cause.__cause__
    return text


class RankWorker(TrainingRank):
    """One training process (see the module docstring)."""

    def __init__(self) -> None:
        import gemini_ckpt  # noqa: F401  (imported now: a restart should not pay for it)
        from gemini_ckpt.hoststore.fence import fence_when_node_lost

        # a trainer's supervisor ends a process whose node the cluster gave up (Ray's own check of
        # the raylet's pid was seen to miss it once): the old machine's rank process must not train on
        fence_when_node_lost("chaos rank process")

        super().__init__()
        self.state = None
        self.job = None
        self._rules: list[HookRule] = []
        self._release = threading.Event()
        self._paused: Optional[dict] = None
        self._fs_handler = None
        self._hold_limit_s = 300.0
        self._broken = False  # this process's torch.distributed state is not to be trusted again
        self._stage: Optional[str] = None

    # --- a job (re)start --------------------------------------------------------------------------
    def setup(self, spec: dict) -> dict:
        """Join a new process group and build the job and its Checkpointer. ``spec``: rank,
        world_size, rendezvous (host, port of the driver's store), config (CheckpointConfig
        fields), job, seed, timeout_s, durable_root, chaos_fs, storage_mode, keep_durable, rules,
        store_factory.

        Returns :meth:`info`, or ``{"error": ..., "stage": ...}`` where ``stage`` says what
        failed: ``"rendezvous"`` (joining the process group) or ``"build"`` (the job's
        ``build``) are the harness's machinery; ``"checkpointer"`` is the library under test.
        After a failed rendezvous or build this process is not reused (see :meth:`teardown`)."""
        from .. import CheckpointConfig
        from ..faults import set_hook
        from ..durable.tier import DurableTier

        self.teardown()
        stage = self._stage = "rendezvous"
        if self._broken:
            return {
                "error": "an earlier setup of this process failed in its rendezvous or build; "
                "the harness replaces such a process",
                "stage": stage,
            }
        try:
            self.timeout_s = spec["timeout_s"]
            host, port = spec["rendezvous"]
            self.join(spec["rank"], spec["world_size"], (host, port), self.timeout_s)
            stage = self._stage = "build"
            self.job = spec["job"]
            self.state = self.job.build(self.rank, self.world_size, spec["seed"])
            stage = self._stage = "checkpointer"
            config = CheckpointConfig(**spec["config"])
            durable = None
            if spec.get("chaos_fs"):
                from ._storage import faulty_filesystem

                fs, self._fs_handler = faulty_filesystem()
                self._fs_handler.set_mode(spec.get("storage_mode", "ok"))
                # Built here, as a user would build it; with storage unreachable this may already fail.
                durable = DurableTier(filesystem=fs, root=spec["durable_root"], keep=spec["keep_durable"])
            store = None
            if spec.get("store_factory") is not None:
                store = spec["store_factory"](config, self.rank, self.world_size)
            self.replace_checkpointer(self.state, config, store=store, durable=durable)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if stage != "checkpointer":
                # A failed init_process_group still used up a group name in this process (the next
                # one would not match its peers'), and a job's build may have left anything behind.
                self._broken = True
            self._stage = None
            return {"error": describe_error(exc), "stage": stage}
        self.persist_every = config.persist_every
        self._rules = list(spec.get("rules") or ())
        self._release = threading.Event()
        self._paused = None
        set_hook(self._hook if self._rules else None)
        self._stage = None
        return {**self.info(), "rendezvous": [host, port]}

    def setup_stage(self) -> Optional[str]:
        """Where a ``setup`` still running is (None when none is)."""
        return self._stage

    def _hook(self, phase: str, **ctx) -> None:
        step = ctx.get("step")
        for rule in self._rules:
            if not rule.matches(phase, step):
                continue
            if rule.action == "delay":
                time.sleep(rule.seconds)
            elif rule.action in ("pause", "hold"):
                if rule.action == "pause":
                    self._paused = {"phase": phase, "step": step, "rank": self.rank, "unix": time.time()}
                self._release.wait(timeout=self._hold_limit_s)

    def paused(self) -> Optional[dict]:
        return self._paused

    def release(self) -> None:
        self._release.set()

    def set_storage(self, mode: str) -> None:
        if self._fs_handler is not None:
            self._fs_handler.set_mode(mode)

    # --- training -------------------------------------------------------------------------------
    def restore(self) -> dict:
        """``Checkpointer.restore()`` and what was loaded (all ranks call it together)."""
        from ._job import digest, full_tensor_state

        t0 = time.perf_counter()
        try:
            result = self.ckpt.restore()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            return {"error": describe_error(exc), "seconds": time.perf_counter() - t0}
        out: dict[str, Any] = {"step": None, "source": None, "seconds": time.perf_counter() - t0}
        if result is not None:
            out.update(
                step=result.step,
                source=result.source,
                sources=dict(result.sources),
                bytes_read=dict(result.bytes_read),
                restore_s=result.seconds,
                skipped_steps=list(result.skipped_steps),
                saved_world_size=result.saved_world_size,
            )
        out["digest"] = digest(full_tensor_state(self.state))
        out["extra"] = dict(self.state.extra)
        return out

    def load_reference(self, full: dict, opaque: dict, source_rank: int, step: int) -> dict:
        """Load a captured state without gemini_ckpt's restore (the resize reference)."""
        from ._job import digest, full_tensor_state, load_full_state

        load_full_state(self.state, full, opaque, rank=self.rank, source_rank=source_rank, step=step)
        return {"digest": digest(full_tensor_state(self.state)), "extra": dict(self.state.extra)}

    def run(
        self,
        steps: list[int],
        outage_steps: tuple[int, ...] = (),
        capture: bool = False,
        poison_steps: tuple[int, ...] = (),
    ) -> list[dict]:
        """Train, save and wait for each step's commit (and, on rank 0, its persist when due).
        Stops at the first step that raises (a dead peer): the records so far come back.
        ``poison_steps``: after their optimizer step, a NaN is written into this rank's
        optimizer state before the version is saved (:func:`poison_optimizer_state`)."""
        from .. import BackgroundError
        from ._job import digest, full_tensor_state

        out: list[dict] = []
        for step in steps:
            rec: dict[str, Any] = {"step": step, "committed": False, "persisted": None, "error": None}
            out.append(rec)
            try:
                if self._fs_handler is not None and outage_steps:
                    self._fs_handler.set_mode("fail_writes" if step in outage_steps else "ok")
                rec["loss"] = self.job.step(step)
                if step in poison_steps:
                    rec["poisoned"] = poison_optimizer_state(self.state)
                full = full_tensor_state(self.state)
                rec["digest"] = digest(full)
                rec["extra"] = dict(self.state.extra)
                if capture:
                    rec["opaque"] = self.state.opaque_state(self.rank)
                    if self.rank == 0:
                        rec["full"] = full
                handle = self.ckpt.save(step)
            except BaseException as exc:  # noqa: BLE001 - a dead peer fails the collective
                rec["error"] = describe_error(exc)
                break
            try:
                handle.committed.result(timeout=self.timeout_s)
                rec["committed"] = True
            except BaseException as exc:  # noqa: BLE001
                rec["error"] = describe_error(exc)
                try:
                    self.ckpt.wait(timeout=self.timeout_s)  # the stored error is raised here once
                except BackgroundError:
                    pass
                except BaseException:  # noqa: BLE001
                    pass
                continue
            if self.rank == 0 and self.persist_every and (step + 1) % self.persist_every == 0:
                try:
                    rec["persisted"] = handle.persisted.result(timeout=self.timeout_s) is not None
                except BaseException as exc:  # noqa: BLE001
                    rec["persisted"] = False
                    rec["persist_error"] = describe_error(exc)
        return out

    def close(self) -> Optional[str]:
        try:
            self.ckpt.close()
            return None
        except BaseException as exc:  # noqa: BLE001
            return describe_error(exc)

    def teardown(self, limit_s: float = 10.0) -> bool:
        """Stop the Checkpointer and leave the process group. False when background work did
        not stop within ``limit_s`` (stuck in a collective with a dead peer) or a setup failed
        in its rendezvous or build: the process is then not safe to reuse and the driver
        replaces it."""
        from ..faults import set_hook

        set_hook(None)
        self._rules = []
        self._release.set()
        clean = super().teardown(limit_s)
        self.state = self.job = None
        self._fs_handler = None
        return clean and not self._broken


def poison_optimizer_state(state) -> str:
    """Write a NaN into the first value of the biggest floating-point optimizer-state tensor this
    rank holds (a DTensor's local shard): what a bad step or silent data corruption leaves.
    Returns where (``"<param index>.<state name>"``)."""
    import torch
    from torch.distributed.tensor import DTensor

    best = None
    for o, opt in enumerate(state.optimizers):
        for i, (param, per_param) in enumerate(opt.state.items()):
            for name, value in per_param.items():
                local = value.to_local() if isinstance(value, DTensor) else value
                if isinstance(local, torch.Tensor) and local.is_floating_point() and local.dim() and local.numel():
                    if best is None or local.numel() > best[0].numel():
                        best = (local, f"{o}.{i}.{name}")
    if best is None:
        raise RuntimeError("this rank holds no floating-point optimizer state to poison")
    with torch.no_grad():
        best[0].view(-1)[0] = float("nan")
    return best[1]
