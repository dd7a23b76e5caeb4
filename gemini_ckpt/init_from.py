"""``CheckpointConfig(init_from=PATH)``: start a job from a stock DCP checkpoint.

A user migrating from plain ``dcp.save`` (or torchtitan) points ``init_from`` at one of
their checkpoint directories; when this job has no version of its own yet, ``restore()``
loads the model (and the optimizer, when the checkpoint has it) from there, resharding as DCP
always does, and the job goes on from step 0 under our own versions. A checkpoint without
optimizer state loads the model and leaves the optimizer as it is (fresh), and says so.

The directory is not ours, so nothing in it is trusted: ``.metadata`` is decoded through the
metadata allow-list, every path it names must lie inside the directory, every file is opened
without following links and only if it is a regular file (a FIFO cannot block the load), every
item is read with a cap (its recorded length, inside its file) and ``torch.load``-ed with
``weights_only=True`` only after its archive was checked against what the metadata says it holds
(see :mod:`gemini_ckpt.trust`); nothing there is ever written or deleted. Any failure is a
:class:`~gemini_ckpt.errors.CheckpointError` naming the directory (never DCP's
``CheckpointException``, a ``BaseException``). Keys follow ``dcp.save({"model": ..., "optim":
...})``: ``model.<fqn>`` and ``optim.<...>``, the layout ``get_state_dict`` produces (and
``TrainState`` saves).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .errors import CheckpointError, DamagedFileError, VerificationError
from .restore import check_structure
from .results import RestoreResult
from .restore.loader import load as dcp_load
from .state.train_state import MODEL, OPTIM, TrainState
from .durable.fs import MAX_UNRECORDED_METADATA_BYTES
from .durable.layout import METADATA_FILE, path_parts
from .durable.local_files import LocalFiles
from .trust.items import item_nbytes, safe_opaque, torch_load_value
from .trust.metadata import metadata_loads

log = logging.getLogger("gemini_ckpt")

INIT_STEP = -1
"""``RestoreResult.step`` of an init: the loop ``range(result.step + 1, ...)`` starts at 0."""


class StockVersion:
    """A stock DCP directory as a view :func:`gemini_ckpt.restore.loader.load` reads, item by item."""

    tier = "init"

    def __init__(self, path: str, where: str) -> None:
        self.step, self.where = INIT_STEP, where
        self.files = LocalFiles(path)
        self.bytes_by_source: dict[str, int] = {}
        self.problems: list[str] = []
        try:
            raw = self.files.read(METADATA_FILE, cap=MAX_UNRECORDED_METADATA_BYTES)
            self.metadata = metadata_loads(raw)
        except (OSError, CheckpointError) as exc:
            raise CheckpointError(
                f"{where}: {METADATA_FILE} cannot be read ({type(exc).__name__}: {exc}); point "
                f"init_from at a DCP checkpoint directory"
            ) from None
        self.world_size = 1
        for index, info in (self.metadata.storage_data or {}).items():
            rel = getattr(info, "relative_path", None)
            try:
                if not isinstance(rel, str) or not path_parts(rel):
                    raise DamagedFileError(f"{rel!r} is not a file name")
            except DamagedFileError:
                raise CheckpointError(
                    f"{where}: {METADATA_FILE} places {index.fqn} in {rel!r}, outside the checkpoint "
                    f"directory {path}; refused"
                ) from None
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{where}: {index.fqn} was saved through DCP storage transforms "
                    f"({info.transform_descriptors}), which init_from does not read"
                )

    def close(self) -> None:
        pass

    def read(self, index: MetadataIndex) -> Any:
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise LookupError(f"{self.where}: no item {index.fqn}")
        what = f"{self.where}: {index.fqn} ({info.relative_path}@{info.offset})"
        try:
            raw = self.files.read_range(info.relative_path, info.offset, info.length)
        except (OSError, ValueError) as exc:  # missing, not a regular file, truncated
            raise DamagedFileError(f"{what} cannot be read ({type(exc).__name__}: {exc})") from None
        self.bytes_by_source["init"] = self.bytes_by_source.get("init", 0) + len(raw)
        value = torch_load_value(raw, what, storage_bytes=item_nbytes(self.metadata, index))
        if isinstance(self.metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            return safe_opaque(index.fqn, value)
        if not isinstance(value, torch.Tensor):
            raise VerificationError(f"{what} holds a {type(value).__name__}, not a tensor")
        return value


def _why(exc: CheckpointException) -> str:
    failures = sorted(getattr(exc, "failures", {}).items())
    if not failures:
        return str(exc)
    rank, failure = failures[0]
    inner = failure[0] if isinstance(failure, tuple) else failure
    return f"rank {rank}: {type(inner).__name__}: {inner}"


def init_from(state: TrainState, uri: str, *, rank: int, world_size: int, group) -> RestoreResult:
    """Load model (and optimizer, when saved) from the stock DCP checkpoint at ``uri``."""
    t0 = time.perf_counter()
    where = f"CheckpointConfig.init_from={uri!r}"
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    if "://" in path or not os.path.isdir(path):
        raise CheckpointError(f"{where} is not a local DCP checkpoint directory (a path, or file://...)")
    view = StockVersion(os.path.abspath(path), where)
    saved = view.metadata.state_dict_metadata
    module = state.module
    with_optim = bool(state.optimizers) and any(k.startswith(OPTIM + ".") for k in saved)
    if with_optim:
        model_sd, optim_sd = get_state_dict(module, state.optimizers)
        target = {MODEL: model_sd, OPTIM: optim_sd}
    else:
        # get_state_dict would give the optimizer state of its own (a zero step): leave it alone
        target = {MODEL: get_model_state_dict(module)}
    if not with_optim and state.optimizers:
        log.warning("init_from %s holds no optimizer state; the model is loaded and the optimizer starts fresh", uri)
    check_structure(target, view.metadata)
    try:
        report = dcp_load(target, [view], group=group, world_size=world_size)
    except CheckpointException as exc:  # a BaseException: never let it past ``except Exception``
        raise CheckpointError(f"{where}: the checkpoint could not be loaded ({_why(exc)})") from None
    if with_optim:
        set_state_dict(module, state.optimizers, model_state_dict=target[MODEL], optim_state_dict=target[OPTIM])
    else:
        set_model_state_dict(module, target[MODEL])
    nbytes = report.bytes_by_source.get("init", 0)
    log.info(
        "rank %d: initialised model%s from the DCP checkpoint %s", rank, " and optimizer" if with_optim else "", uri
    )
    return RestoreResult(
        step=INIT_STEP,
        source="init",
        sources={rank: "init"},
        bytes_read={"init": nbytes},
        seconds=time.perf_counter() - t0,
        world_size=world_size,
        saved_world_size=world_size,
    )
