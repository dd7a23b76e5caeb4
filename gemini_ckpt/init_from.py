"""``CheckpointConfig(init_from=PATH)``: start a job from a stock DCP checkpoint.

A user migrating from plain ``dcp.save`` (or torchtitan) points ``init_from`` at one of
their checkpoint directories; when this job has no version of its own yet, ``restore()``
loads the model (and the optimizer, when the checkpoint has it) from there, resharding as DCP
always does, and the job goes on from step 0 under our own versions.

The directory is not ours, so nothing in it is trusted: ``.metadata`` is decoded through the
metadata allow-list and non-tensor items with ``weights_only=True`` (see
:mod:`gemini_ckpt.trust`); nothing there is ever written or deleted. Keys follow
``dcp.save({"model": ..., "optim": ...})``: ``model.<fqn>`` and ``optim.<...>``, the
layout ``get_state_dict`` produces (and ``TrainState`` saves).
"""

from __future__ import annotations

import logging
import os
import time

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .errors import CheckpointError
from .restore import check_structure
from .results import RestoreResult
from .save.dcp import SafeLoadPlanner
from .state.train_state import MODEL, OPTIM, TrainState
from .stores.layout import METADATA_FILE
from .trust import metadata_loads

log = logging.getLogger("gemini_ckpt")

INIT_STEP = -1
"""``RestoreResult.step`` of an init: the loop ``range(result.step + 1, ...)`` starts at 0."""


class _VettedReader(FileSystemReader):
    """DCP's own file reader, except that ``.metadata`` goes through the allow-list."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(str(self.path), METADATA_FILE)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CheckpointError(f"CheckpointConfig.init_from={self.path}: {path} cannot be read ({exc}); "
                                  f"point init_from at a DCP checkpoint directory") from exc
        metadata = metadata_loads(data)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def init_from(state: TrainState, uri: str, *, rank: int, world_size: int, group) -> RestoreResult:
    """Load model (and optimizer, when saved) from the stock DCP checkpoint at ``uri``."""
    t0 = time.perf_counter()
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    if "://" in path or not os.path.isdir(path):
        raise CheckpointError(f"CheckpointConfig.init_from={uri!r} is not a local DCP checkpoint directory "
                              f"(a path, or file://...)")
    reader = _VettedReader(path)
    saved = reader.read_metadata().state_dict_metadata
    module = state.module
    model_sd, optim_sd = get_state_dict(module, state.optimizers)
    target = {MODEL: model_sd}
    with_optim = bool(state.optimizers) and any(k.startswith(OPTIM + ".") for k in saved)
    if with_optim:
        target[OPTIM] = optim_sd
    elif state.optimizers:
        log.warning("init_from %s holds no optimizer state; the optimizer starts fresh", uri)
    check_structure(target, reader.read_metadata())
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
    set_state_dict(module, state.optimizers, model_state_dict=target[MODEL],
                   optim_state_dict=target.get(OPTIM, {}))
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
    log.info("rank %d: initialised model%s from the DCP checkpoint %s", rank, " and optimizer" if with_optim else "",
             uri)
    return RestoreResult(step=INIT_STEP, source="init", sources={rank: "init"}, bytes_read={"init": nbytes},
                         seconds=time.perf_counter() - t0, world_size=world_size, saved_world_size=world_size)
