"""Loading one version on every rank: open its views, target the live state, check its structure,
agree (one collective), load it directly or through DCP's planner, apply it, agree again.
Every rank takes the same decision: a structure or configuration problem anywhere is raised
everywhere; any other failure skips the version on every rank (:class:`UnreadableCandidate`).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..collective import everyones
from ..settings import RestoreSettings
from ..errors import (
    CheckpointError,
    ChecksumError,
    ConfigError,
    ReadNotStoppedError,
    StructureMismatchError,
    UnhealthyCandidate,
    UnreadableCandidate,
)
from ..results import RestoreResult
from ..state.dcp import flatten, live_storages
from ..state.train_state import GRADS, MODEL, OPTIM, TrainState, derive_rng_state, restore_rng_state
from .direct import direct_load, direct_plan
from .loader import load as dcp_load
from .opening import open_views

log = logging.getLogger("gemini_ckpt")


@dataclass(frozen=True)
class Restored:
    """What a restore found: ``result`` (None: nothing to restore), the steps the tiers held
    (``held``: the survey every rank walked, for the lineage) and, when the version loaded is a
    memory version saved at this world size, this rank's shard plan (``plan``: the first save
    may take it over)."""

    result: Optional[RestoreResult]
    held: tuple[int, ...] = ()
    plan: Any = None


class WorldSizeChangeWarning(UserWarning):
    """Rank-local state was mapped to a different world size by the documented rule."""


def load_version(
    state: TrainState,
    tiers: list,
    step: int,
    *,
    rank: int,
    world_size: int,
    group,
    settings: RestoreSettings,
    t0: float,
    marks: Optional[list] = None,
    allow_unhealthy: bool = False,
) -> Restored:
    marks = marks if marks is not None else []
    outcome: Optional[tuple[str, str]] = None  # (kind, why): "skip", "unhealthy", "structure" or "config"
    fingerprint = None
    direct = None
    health = None
    views, problems = open_views(tiers, step, settings.key, settings.namespace)
    marks.append(("fetched", time.time()))  # the version's plans and records, verified
    if not views:
        outcome = ("skip", "; ".join(problems))
    else:
        primary = views[0]
        fingerprint = (primary.tier, primary.fingerprint)
        health = primary.health  # from the verified records (memory) or the checked manifest (durable)
    if views and health.unhealthy and not allow_unhealthy:
        outcome = ("unhealthy", health.reason)
    elif views:
        try:
            metadata: Metadata = primary.metadata
            saved_keys = set(metadata.state_dict_metadata)
            saved_ws = primary.world_size
            source_rank = source_rank_of(rank, saved_ws, world_size, settings)
            target = state.load_target(
                rank=rank, saved_keys=saved_keys, source_rank=source_rank, saved=metadata.state_dict_metadata
            )
            check_structure(target, metadata)
            marks.append(("targeted", time.time()))  # the live state's load target, checked against it
            if primary.tier == "memory" and saved_ws == world_size:
                direct, why_not = direct_plan(target, primary, live_storages(state))
                if direct is None:
                    log.info("rank %d: step %d is loaded through DCP's planner: %s", rank, step, why_not)
                marks.append(("planned", time.time()))  # the direct plan (or why not), on this rank alone
        except StructureMismatchError as exc:
            outcome = ("structure", str(exc))
        except ConfigError as exc:
            outcome = ("config", str(exc))
        except (AttributeError, TypeError) as exc:  # crafted metadata of the wrong shape
            outcome = ("skip", f".metadata does not have DCP's structure ({type(exc).__name__}: {exc})")
    try:
        everyone = _gather_outcomes(rank, outcome, fingerprint, world_size, group, direct is not None)
        raise_agreed(everyone, rank)
    except BaseException:
        for view in views:
            view.close()
        raise
    marks.append(("opened", time.time()))

    # Every rank loads directly, or every rank goes through DCP's load (a collective).
    path = "direct" if all(e[3] for e in everyone) else "dcp"
    outcome = None
    bytes_read: dict[str, int] = {}
    try:
        if path == "direct":
            try:
                bytes_read = direct_load(direct, views)
            except ReadNotStoppedError:
                raise  # something may still write into the live state: no other version may be loaded into it
            except (ChecksumError, LookupError, OSError, ValueError, CheckpointError) as exc:
                # Told to every rank below, so that all of them move to the next version together.
                outcome = ("skip", f"{type(exc).__name__}: {exc}")
        else:
            try:
                bytes_read = dcp_load(target, views, group=group, world_size=world_size).bytes_by_source
            except CheckpointException as exc:
                raise UnreadableCandidate(_first_failure(exc)) from exc
            except StructureMismatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed read of this version: try the next one
                raise UnreadableCandidate(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for view in views:
            view.close()
    marks.append(("loaded", time.time()))
    derived = source_rank != rank
    if outcome is None:
        try:
            state.apply(
                target,
                source_rank=source_rank,
                restore_rng=not derived,
                tensors_in_place=path == "direct" and direct.in_place,
            )
            if derived:
                restore_rng_state(derive_rng_state(rank, step))
        except Exception as exc:  # noqa: BLE001 - values the live objects reject: an older version may fit
            outcome = ("skip", f"the loaded state could not be applied ({type(exc).__name__}: {exc})")
    bytes_read = {k: v for k, v in bytes_read.items() if v}
    # A rank's source is the farthest tier it had to reach: durable > peer > local.
    where = next((k for k in ("durable", "peer") if bytes_read.get(k)), "local")
    sources = {rank: where}
    gathered = everyones((rank, where, outcome), world_size=world_size, group=group)
    sources = {r: w for r, w, _ in gathered}
    raise_agreed([(r, o, None) for r, _, o in gathered], rank)
    marks.append(("done", time.time()))
    # a memory version saved at this world size: the first save may take this rank's plan over
    takeover = primary.plans.get(rank) if primary.tier == "memory" and saved_ws == world_size else None
    result = RestoreResult(
        step=step,
        source=primary.tier,
        sources=sources,
        bytes_read=bytes_read,
        seconds=time.perf_counter() - t0,
        world_size=world_size,
        saved_world_size=saved_ws,
        timeline=tuple(marks),
        path=path,
        health=health,
    )
    return Restored(result, plan=takeover)


def check_structure(target: dict[str, Any], metadata: Metadata) -> None:
    """Raise StructureMismatchError naming the model/optimizer keys (and shapes) that differ."""
    flat = flatten(target)
    saved = metadata.state_dict_metadata
    tensor_prefixes = (MODEL + ".", OPTIM + ".", GRADS + ".")
    missing = sorted(k for k in flat if k not in saved)
    unexpected = sorted(
        k for k in saved if k.startswith(tensor_prefixes) and k not in flat and not k.startswith(GRADS + ".")
    )
    shapes = []
    for key, value in flat.items():
        md = saved.get(key)
        if isinstance(md, TensorStorageMetadata) and hasattr(value, "shape"):
            shape = tuple(value.size()) if isinstance(value, DTensor) else tuple(value.shape)
            if tuple(md.size) != shape:
                shapes.append(f"{key}: saved {tuple(md.size)}, now {shape}")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint ({len(missing)}): {_few(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in this state ({len(unexpected)}): {_few(unexpected)}")
        if shapes:
            parts.append(f"different shapes ({len(shapes)}): {_few(shapes)}")
        raise StructureMismatchError(
            "the state being restored does not match the saved version: "
            + "; ".join(parts)
            + ". Build the same model/optimizer/scheduler as the run that saved it."
        )


def source_rank_of(rank: int, saved_ws: int, world_size: int, settings: RestoreSettings) -> int:
    if saved_ws == world_size:
        return rank
    if not settings.derive_world_size:
        raise ConfigError(
            f"the version was saved at world size {saved_ws} and this job has {world_size}; "
            f"CheckpointConfig.world_size_change='error' forbids mapping rank-local state; "
            f"use world_size_change='derive' to apply the documented rule"
        )
    if rank == 0:
        warnings.warn(
            f"world size changed {saved_ws} -> {world_size}: model and optimizer are resharded; "
            f"rank-local state follows the 'derive' rule: rank r takes the data-loader state and "
            f"extra values of saved rank r mod {saved_ws}, and ranks >= {saved_ws} get RNG streams "
            f"derived from (step, rank)",
            WorldSizeChangeWarning,
            stacklevel=4,
        )
    return rank % saved_ws


def _gather_outcomes(rank: int, outcome, fingerprint, world_size: int, group, direct: bool = False) -> list:
    """Every rank's ``(rank, outcome, fingerprint, can load directly)`` for one candidate version."""
    return everyones((rank, outcome, fingerprint, direct), world_size=world_size, group=group)


def raise_agreed(everyone: list, rank: int) -> None:
    """The same decision on every rank: a structure or configuration problem anywhere is
    raised everywhere; otherwise any rank's failure, or ranks that read different manifests,
    skips the version (``UnreadableCandidate``)."""
    fatal = [(e[0], e[1]) for e in everyone if e[1] is not None and e[1][0] in ("structure", "config")]
    if fatal:
        r, (kind, why) = fatal[0]
        error = StructureMismatchError if kind == "structure" else ConfigError
        raise error(why if r == rank else f"rank {r}: {why}")
    bad = [e[1][1] for e in everyone if e[1] is not None and e[1][0] == "unhealthy"]
    if bad:  # every rank read the same verified records: the same verdict
        raise UnhealthyCandidate(bad[0])
    failed = [(e[0], e[1][1]) for e in everyone if e[1] is not None]
    if failed:
        raise UnreadableCandidate(
            "; ".join(why if r == rank or len(everyone) == 1 else f"rank {r}: {why}" for r, why in failed[:4])
        )
    if len({e[2] for e in everyone}) > 1:
        raise UnreadableCandidate("the ranks read different manifests for this step (copies disagree)")


def _first_failure(exc: CheckpointException) -> str:
    """Why DCP's load failed (every rank gets the same exception). Structure mismatches are
    raised; anything else means this version cannot be read."""
    failures = []
    for rank, failure in sorted(exc.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, StructureMismatchError):
            raise inner
        failures.append((rank, inner))
    preferred = [f for f in failures if isinstance(f[1], (ChecksumError, OSError))] or failures
    if not preferred:
        return str(exc)
    rank, inner = preferred[0]
    return f"rank {rank}: {type(inner).__name__}: {inner}"


def short(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... (+{len(items) - n} more)" if len(items) > n else "")
