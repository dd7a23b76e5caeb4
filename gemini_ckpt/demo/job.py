"""The demo's training side: the function every Ray Train worker runs, and the progress
channel from the workers to the driver (an actor on the head node)."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ..state.digest import digest as digest_state

RAY_NAMESPACE = "gemini_demo"


# --- progress: workers -> an actor on the head node -> the driver --------------------------------
class Progress:
    """Events of one run, in arrival order. A ``start`` event from rank 0 opens a new attempt."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.attempt = -1

    def emit(self, event: dict) -> None:
        if event["kind"] == "start" and event.get("rank") == 0:
            self.attempt += 1
        event.setdefault("attempt", max(self.attempt, 0))
        self.events.append(event)

    def since(self, index: int) -> list[dict]:
        return self.events[index:]


def _emitter(name: Optional[str], rank: int) -> Callable[..., None]:
    if not name:
        return lambda kind, **fields: None
    import ray

    actor = ray.get_actor(name, namespace=RAY_NAMESPACE)

    def emit(kind: str, **fields) -> None:
        actor.emit.remote({"kind": kind, "rank": rank, "unix": time.time(), **fields})

    return emit


# --- the training function (runs in every Ray Train worker) --------------------------------------
def train_loop(config: dict) -> dict:
    """Train the tiny LM with FSDP2 and a ``gemini_ckpt.integrations.ray_train`` checkpointer
    (``config["checkpoint"]=False``: no checkpointing at all, the baseline of a restart).

    ``config``: ``ckpt`` (a CheckpointConfig), ``steps``, ``progress`` (actor name or None),
    ``seed``, optional ``kill`` = ``{"rank", "step", "marker"}`` (that rank SIGKILLs itself
    after saving that step, once: the marker file records it happened), ``step_sleep``,
    ``full_digests`` (every rank gathers the whole model and optimizer state before each save and after
    each restore, and emits its digest: ``saved_full``, ``restored_full``; costly, for tests).
    Returns a digest of the final model and optimizer state, the restore and reported steps.
    """
    import signal

    import ray.train
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torchdata.stateful_dataloader import StatefulDataLoader

    from .. import TrainState
    from ..integrations import ray_train as gray
    from ..toy import TokenDataset, build_training, lm_loss

    from ..integrations.ray_train import recovery_info

    global _RUNS_HERE
    _RUNS_HERE += 1
    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    emit = _emitter(config.get("progress"), rank)
    emit(
        "start",
        pid=os.getpid(),
        node_id=ray.get_runtime_context().get_node_id(),
        process_t=_process_start(),
        in_place=recovery_info(),
        world=context.get_world_size(),
    )
    steps, seed = config["steps"], config.get("seed", 0)
    # FSDP2 over the process group TorchTrainer set up: each rank holds (and saves) its shard.
    mesh = init_device_mesh("cpu", (context.get_world_size(),))
    t = build_training(seed=seed, total_steps=steps, dataset_size=config.get("dataset_size", 512), mesh=mesh)
    model = t.model
    # Each rank shuffles its own way: a different slice of data per rank and step.
    loader = StatefulDataLoader(
        TokenDataset(n=config.get("dataset_size", 512)),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(1000 * (seed + 1) + rank),
    )
    torch.manual_seed(7919 * (seed + 1) + rank)  # dropout streams differ per rank
    extra = {"tokens": 0}
    state = TrainState(model=model, optimizer=t.optimizer, scheduler=t.scheduler, dataloader=loader, extra=extra)
    checkpointing = config.get("checkpoint", True)
    ckpt = gray.checkpointer(state, config["ckpt"]) if checkpointing else None

    _kill_in_restore(config.get("kill_in_restore"), rank)
    t0 = time.time()
    result = ckpt.restore() if checkpointing else None
    restored = None
    if result is not None:
        restored = {
            "step": result.step,
            "source": result.source,
            "seconds": result.seconds,
            "bytes_local": result.bytes_read.get("local", 0),
            "bytes_peer": result.bytes_read.get("peer", 0),
            "bytes_durable": result.bytes_read.get("durable", 0),
            "path": result.path,
            "timeline": [list(m) for m in result.timeline],
            "recovery": list(result.recovery),
            "world": context.get_world_size(),
        }
        emit("restore", t_start=t0, pid=os.getpid(), **restored)
        if config.get("full_digests"):
            emit(
                "restored_full",
                step=result.step,
                world=context.get_world_size(),
                digest=_full_digest(model, t.optimizer),
            )

    def on_commit(step: int, saved_at: float):
        def done(fut) -> None:
            if fut.exception() is None:
                emit("commit", step=step, latency_s=time.time() - saved_at)

        return done

    def on_persist(step: int):
        def done(fut) -> None:
            if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                emit("persist", step=step, location=fut.result())

        return done

    kill = config.get("kill")
    batches = _endless(loader)
    loss_value = float("nan")
    # {"step" (or "end": after the last step, once the others returned), "rank" (None: every rank)}:
    # the user's code fails there, always
    bug = config.get("raise_at")
    for step in range(result.step + 1 if result else 0, steps):
        if bug and step == bug["step"] and bug.get("rank") in (None, rank):
            raise ValueError(f"the training code fails at step {step} on rank {rank}")
        batch = next(batches)
        loss = lm_loss(model, batch)
        loss.backward()
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        extra["tokens"] += batch.numel()
        loss_value = loss.item()
        saved_at = time.time()
        if not checkpointing:
            if rank == 0:
                emit("step", step=step, loss=loss_value, stall_s=0.0)
        else:
            if config.get("full_digests"):  # what the version will hold, whole (a collective of every rank)
                emit("saved_full", step=step, world=context.get_world_size(), digest=_full_digest(model, t.optimizer))
            handle = ckpt.save(step, metrics={"loss": loss_value})
            if rank == 0:
                emit("step", step=step, loss=loss_value, stall_s=ckpt.stats.last_stall_s)
                handle.committed.add_done_callback(on_commit(step, saved_at))
                handle.persisted.add_done_callback(on_persist(step))

        if kill and rank == kill["rank"] and step == kill["step"] and not os.path.exists(kill["marker"]):
            with open(kill["marker"], "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        if config.get("step_sleep"):
            time.sleep(config["step_sleep"])
    reported = []
    stall = 0.0
    if checkpointing:
        ckpt.close()
        stall = ckpt.stats.total_stall_s / max(1, ckpt.stats.saves)
        reported = list(ckpt.reported_steps)
    emit("done", loss=loss_value, mean_stall_s=stall, reported=reported)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # collective
    if bug and bug["step"] == "end" and bug.get("rank") in (None, rank):
        time.sleep(1.0)  # the others have returned
        raise ValueError(f"the training code fails after its last step on rank {rank}")
    return {
        "digest": digest_state([state.tensor_state(), extra]),
        "restore": restored,
        "rank": rank,
        "model_digest": digest_state(full),
        "reported": reported,
        "loss": loss_value,
    }


_RUNS_HERE = 0  # the training function's starts in this process (a survivor of in-place recovery: > 1)


def _full_digest(model, optimizer) -> str:
    """A digest of the whole model and optimizer state (full tensors, by name): the same at any
    world size. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return digest_state(full)


def _kill_in_restore(spec: Optional[dict], rank: int) -> None:
    """``spec`` = ``{"rank", "after", "marker"}``: the first run of the training function by a new
    process of ``rank`` once the file ``after`` exists (a replacement, possibly in a warm spare
    started before it) SIGKILLs itself inside ``restore()``, once (``marker``)."""
    if not spec or rank != spec["rank"] or not os.path.exists(spec["after"]) or os.path.exists(spec["marker"]):
        return
    if _RUNS_HERE > 1:
        return  # a survivor of the first failure, running the function again in its own process

    def hook(phase: str, **ctx) -> None:
        if phase == "restore" and not os.path.exists(spec["marker"]):
            with open(spec["marker"], "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), 9)

    from ..faults import set_hook

    set_hook(hook)


def _process_start() -> float:
    """When this process started (unix time)."""
    import psutil

    return psutil.Process().create_time()


def _endless(loader):
    while True:
        yield from loader
