"""Restore: pick the newest healthy committed version, verify it, check its structure, load it
through DCP.

Any failure reading a version (a missing or damaged marker, manifest or ``.metadata``, a bad
signature, an item that fails its checksum or the allow-lists, a value the live objects
reject) skips it, with a warning naming why, for the next older one; so does a version whose
state failed its health checks, as its verified records (or manifest) say
(:mod:`gemini_ckpt.health`), unless it was asked for by name (``restore(step=...)``). Every
rank takes the same decision: ranks walk rank 0's survey, exchange their outcome for each
candidate before loading (one ``all_gather_object``) and after applying it, and DCP's load
raises on every rank. Only a structure mismatch (the job changed, not the version) is raised
instead.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Optional

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .collective import everyones, rank0s
from .config import CheckpointConfig
from .errors import (
    CheckpointError,
    ChecksumError,
    ConfigError,
    StructureMismatchError,
    UnhealthyVersionError,
    VersionNotFoundError,
)
from .faults import fire
from .results import RestoreResult
from .save.dcp import load as dcp_load
from .save.direct import direct_load, direct_plan
from .save.sources import flatten, live_storages
from .state.train_state import (
    GRADS,
    MODEL,
    OPTIM,
    TrainState,
    derive_rng_state,
    restore_rng_state,
)
from .trust import resolve_key

log = logging.getLogger("gemini_ckpt")


class WorldSizeChangeWarning(UserWarning):
    """Rank-local state was mapped to a different world size by the documented rule."""


class UnhealthyRestoreWarning(UserWarning):
    """``restore(step=...)`` loaded a version whose state failed its health checks, as asked."""


def survey(tiers: list) -> tuple[list[tuple[int, tuple[int, ...]]], dict[str, str]]:
    """What every tier holds: ``([(step, tier indices holding it, in tier order)] newest first,
    {tier name: why it could not be listed})``. A tier that cannot be listed (storage
    unreachable) is left out and named, never taken for an empty one."""
    held: dict[int, list[int]] = {}
    unreachable: dict[str, str] = {}
    for i, tier in enumerate(tiers):
        try:
            steps = tier.committed_steps()
        except OSError as exc:
            unreachable[tier.name] = f"{type(exc).__name__}: {exc}"
            log.warning("the %s tier cannot be listed: %s", tier.name, unreachable[tier.name])
            continue
        for step in steps:
            held.setdefault(step, []).append(i)
    return [(step, tuple(held[step])) for step in sorted(held, reverse=True)], unreachable


def restore_newest(state: TrainState, tiers: list, *, rank: int, world_size: int, group,
                   config: CheckpointConfig, marks: Optional[list] = None,
                   step: Optional[int] = None, plans: Optional[dict] = None) -> Optional[RestoreResult]:
    """Try versions newest first (memory before durable at equal steps) until a healthy one loads.

    Every rank walks rank 0's survey of the tiers (one collective), and DCP's load raises on
    every rank when any rank's read fails, so all ranks move to the next candidate together.
    A tier that cannot be listed is skipped; if nothing can be restored while one could not be
    listed, this raises :class:`CheckpointError` rather than report "no checkpoint" (which
    would start the job from scratch over versions it cannot see).

    ``marks``: the restore's timeline so far (``(stage, unix time)``), continued here and
    returned in :attr:`RestoreResult.timeline`. ``step``: only that version, healthy or not
    (every rank must ask for the same one); ``VersionNotFoundError`` when no tier holds it.
    ``plans``: given a dict, the version loaded leaves this rank's shard plan in it (``"restored"``)
    when it is a memory version saved at this world size (its plan may be taken over), and the
    steps the tiers held (``"held"``, the survey every rank walked)."""
    t0 = time.perf_counter()
    marks = list(marks) if marks else [("called", time.time())]
    named = _agree_step(step, rank, world_size, group)
    if rank == 0 or world_size == 1:
        order, unreachable = survey(tiers)
        states = [t.survey_state() if t.name not in unreachable else None for t in tiers] if world_size > 1 else []
    else:
        order = unreachable = states = None
    order, unreachable, states = _agree((order, unreachable, states), world_size, group)
    if rank != 0:
        for tier, shared in zip(tiers, states):
            tier.use_survey_state(shared)
    marks.append(("surveyed", time.time()))
    if plans is not None:
        plans["held"] = tuple(sorted(s for s, _ in order))  # every rank walks the same survey
    fire("restore", step=order[0][0] if order else None, rank=rank)
    if named is not None:
        held = [s for s, _ in order]
        order = [(s, holding) for s, holding in order if s == named]
        if not order:
            blind = "".join(f"; the {n} tier could not be listed ({why})" for n, why in unreachable.items())
            raise VersionNotFoundError(f"restore(step={named}): no tier holds a committed version of step {named} "
                                       f"(they hold {sorted(held)}){blind}")
    skipped: list[int] = []
    reasons: list[str] = []
    why_skipped: dict[int, str] = {}
    unhealthy: list[int] = []
    for step, holding in order:
        name = tiers[holding[0]].name
        try:
            result = load_version(state, [tiers[i] for i in holding], step, rank=rank, world_size=world_size,
                                  group=group, config=config, t0=t0, marks=marks, allow_unhealthy=named is not None,
                                  plans=plans)
        except _Unhealthy as exc:
            if rank == 0:
                log.warning("skipping step %d from %s: it is unhealthy: %s", step, name, exc)
            skipped.append(step)
            unhealthy.append(step)
            why_skipped[step] = f"unhealthy: {_short(str(exc))}"
            reasons.append(f"step {step} ({name}): unhealthy: {_short(str(exc))}")
            continue
        except _Unreadable as exc:
            warnings.warn(f"step {step} ({name}) could not be restored and was skipped: {exc}; "
                          f"falling back to the next newest complete version", stacklevel=3)
            log.warning("rank %d: skipping step %d from %s: %s", rank, step, name, exc)
            skipped.append(step)
            why_skipped[step] = _short(str(exc))
            reasons.append(f"step {step} ({name}): {_short(str(exc))}")
            continue
        if unreachable and rank == 0:
            log.warning("restored step %d although the %s tier could not be listed (%s)", step,
                        " and ".join(unreachable), "; ".join(unreachable.values()))
        if result.health is not None and result.health.unhealthy:
            warnings.warn(f"restored step {step}, whose state is UNHEALTHY ({result.health.reason}), because "
                          f"restore(step={step}) asked for it; training on from it trains on that state",
                          UnhealthyRestoreWarning, stacklevel=3)
        return _with_skipped(result, skipped, why_skipped)
    blind = "".join(f"; the {n} tier could not be listed ({why})" for n, why in unreachable.items())
    if skipped and len(unhealthy) == len(skipped) and not unreachable:
        raise UnhealthyVersionError(
            f"no healthy version to restore: step(s) {skipped} are unhealthy: " + "; ".join(reasons)
            + f". restore(step={skipped[0]}) loads one anyway (for debugging); CheckpointConfig(overwrite=True) "
              f"starts afresh over them", step=skipped[0])
    if skipped:
        raise ChecksumError(f"no committed version could be restored; tried steps {skipped}{blind}: "
                            + "; ".join(reasons))
    if unreachable:
        raise CheckpointError(
            f"nothing to restore from the readable tiers{blind}. Refusing to report 'no checkpoint' "
            f"(which would start training from scratch): make the storage reachable and restore "
            f"again, or remove CheckpointConfig.durable_uri to start without it")
    return None


def _open_views(tiers: list, step: int, key, namespace: Optional[str] = None) -> tuple[list, list[str]]:
    """Verified views of ``step`` in every tier that holds it (best first), and why the others
    could not be opened. An item the first cannot produce is read from the next (see
    :mod:`.save.direct`), so a later view is kept only when it holds the same version as the
    first: a durable copy written from that memory version (its manifest names the memory
    version's fingerprint). With a signing key, a durable version signed for another namespace
    (copied from another run) is refused."""
    views, problems = [], []
    for tier in tiers:
        if views and views[0].tier == "memory":
            # A restore from memory rarely reads an item from a later tier: open it when it does
            # (reading and verifying a durable version's metadata costs tens of milliseconds).
            views.append(_Deferred(tier.name, step, lambda tier=tier: _open_views([tier], step, key, namespace),
                                   views[0]))
            continue
        try:
            view = tier.open(step, key=key)
        except Exception as exc:  # noqa: BLE001 - whatever fails reading a version means "skip it"
            problems.append(f"{tier.name}: {type(exc).__name__}: {exc}")
            continue
        written_for = _durable_job(view).get("namespace")
        if key is not None and namespace is not None and written_for is not None and written_for != namespace:
            view.close()
            problems.append(f"{tier.name}: step {step} is signed for namespace {written_for!r}, not this job's "
                            f"{namespace!r} (copied from another run?); refused. CheckpointConfig.init_from "
                            f"starts a job from another run's version")
            continue
        if views and not _same_version(views[0], view):
            view.close()
            problems.append(f"{tier.name}: holds another version of step {step} than {views[0].tier} (not written "
                            f"from it); not mixed in")
            continue
        views.append(view)
    return views, problems


class _Deferred:
    """A later tier's view of the step, opened on the first read of an item from it; an item it
    cannot give (it does not open, or holds another version of the step) is a ``LookupError``,
    so the reader moves on, as with any view that lacks the item."""

    def __init__(self, tier: str, step: int, opener, first) -> None:
        self.tier, self.step = tier, step
        self._opener, self._first = opener, first
        self._view = None
        self._problem: Optional[str] = None

    def read(self, index):
        if self._view is None and self._problem is None:
            opened, problems = self._opener()
            view = opened[0] if opened else None
            if view is not None and not _same_version(self._first, view):
                view.close()
                view, problems = None, [f"{self.tier}: holds another version of step {self.step} than "
                                        f"{self._first.tier} (not written from it); not mixed in"]
            self._view, self._problem = view, "; ".join(problems) if view is None else None
        if self._view is None:
            raise LookupError(self._problem or f"{self.tier}: step {self.step} could not be opened")
        return self._view.read(index)

    @property
    def bytes_by_source(self) -> dict:
        return self._view.bytes_by_source if self._view is not None else {}

    @property
    def problems(self) -> list[str]:
        return self._view.problems if self._view is not None else []

    def close(self) -> None:
        if self._view is not None:
            self._view.close()


def _durable_job(view) -> dict:
    job = getattr(getattr(view, "manifest", None), "job", None)
    return job if isinstance(job, dict) else {}


def _same_version(first, other) -> bool:
    """Whether ``other`` holds the version of ``first`` (so its items may stand in for them)."""
    if first.tier == other.tier:
        return first.fingerprint == other.fingerprint
    if first.tier == "memory" and other.tier == "durable":
        return _durable_job(other).get("memory_fingerprint") == first.fingerprint
    return False


def load_version(state: TrainState, tiers: list, step: int, *, rank: int, world_size: int, group,
                 config: CheckpointConfig, t0: float, marks: Optional[list] = None,
                 allow_unhealthy: bool = False, plans: Optional[dict] = None) -> RestoreResult:
    marks = marks if marks is not None else []
    outcome: Optional[tuple[str, str]] = None  # (kind, why): "skip", "unhealthy", "structure" or "config"
    fingerprint = None
    direct = None
    health = None
    views, problems = _open_views(tiers, step, resolve_key(config.signing_key), config.resolved_namespace)
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
            source_rank = _source_rank(rank, saved_ws, world_size, config)
            target = state.load_target(rank=rank, saved_keys=saved_keys, source_rank=source_rank,
                                       saved=metadata.state_dict_metadata)
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
        _raise_agreed(everyone, rank)
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
            except (ChecksumError, LookupError, OSError, ValueError, CheckpointError) as exc:
                # Told to every rank below, so that all of them move to the next version together.
                outcome = ("skip", f"{type(exc).__name__}: {exc}")
        else:
            try:
                bytes_read = dcp_load(target, views, group=group, world_size=world_size).bytes_by_source
            except CheckpointException as exc:
                raise _Unreadable(_first_failure(exc)) from exc
            except StructureMismatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed read of this version: try the next one
                raise _Unreadable(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for view in views:
            view.close()
    marks.append(("loaded", time.time()))
    derived = source_rank != rank
    if outcome is None:
        try:
            state.apply(target, source_rank=source_rank, restore_rng=not derived,
                        tensors_in_place=path == "direct" and direct.in_place)
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
    _raise_agreed([(r, o, None) for r, _, o in gathered], rank)
    marks.append(("done", time.time()))
    if plans is not None and primary.tier == "memory" and saved_ws == world_size:
        plans["restored"] = primary.plans.get(rank)
    return RestoreResult(step=step, source=primary.tier, sources=sources,
                         bytes_read=bytes_read, seconds=time.perf_counter() - t0,
                         world_size=world_size, saved_world_size=saved_ws, timeline=tuple(marks), path=path,
                         health=health)


def check_structure(target: dict[str, Any], metadata: Metadata) -> None:
    """Raise StructureMismatchError naming the model/optimizer keys (and shapes) that differ."""
    flat = flatten(target)
    saved = metadata.state_dict_metadata
    tensor_prefixes = (MODEL + ".", OPTIM + ".", GRADS + ".")
    missing = sorted(k for k in flat if k not in saved)
    unexpected = sorted(k for k in saved if k.startswith(tensor_prefixes) and k not in flat
                        and not k.startswith(GRADS + "."))
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
            "the state being restored does not match the saved version: " + "; ".join(parts)
            + ". Build the same model/optimizer/scheduler as the run that saved it.")


def _source_rank(rank: int, saved_ws: int, world_size: int, config: CheckpointConfig) -> int:
    if saved_ws == world_size:
        return rank
    if config.world_size_change == "error":
        raise ConfigError(
            f"the version was saved at world size {saved_ws} and this job has {world_size}; "
            f"CheckpointConfig.world_size_change='error' forbids mapping rank-local state; "
            f"use world_size_change='derive' to apply the documented rule")
    if rank == 0:
        warnings.warn(
            f"world size changed {saved_ws} -> {world_size}: model and optimizer are resharded; "
            f"rank-local state follows the 'derive' rule: rank r takes the data-loader state and "
            f"extra values of saved rank r mod {saved_ws}, and ranks >= {saved_ws} get RNG streams "
            f"derived from (step, rank)", WorldSizeChangeWarning, stacklevel=4)
    return rank % saved_ws


def _gather_outcomes(rank: int, outcome, fingerprint, world_size: int, group, direct: bool = False) -> list:
    """Every rank's ``(rank, outcome, fingerprint, can load directly)`` for one candidate version."""
    return everyones((rank, outcome, fingerprint, direct), world_size=world_size, group=group)


def _raise_agreed(everyone: list, rank: int) -> None:
    """The same decision on every rank: a structure or configuration problem anywhere is
    raised everywhere; otherwise any rank's failure, or ranks that read different manifests,
    skips the version (``_Unreadable``)."""
    fatal = [(e[0], e[1]) for e in everyone if e[1] is not None and e[1][0] in ("structure", "config")]
    if fatal:
        r, (kind, why) = fatal[0]
        error = StructureMismatchError if kind == "structure" else ConfigError
        raise error(why if r == rank else f"rank {r}: {why}")
    bad = [e[1][1] for e in everyone if e[1] is not None and e[1][0] == "unhealthy"]
    if bad:  # every rank read the same verified records: the same verdict
        raise _Unhealthy(bad[0])
    failed = [(e[0], e[1][1]) for e in everyone if e[1] is not None]
    if failed:
        raise _Unreadable("; ".join(why if r == rank or len(everyone) == 1 else f"rank {r}: {why}"
                                    for r, why in failed[:4]))
    if len({e[2] for e in everyone}) > 1:
        raise _Unreadable("the ranks read different manifests for this step (copies disagree)")


def _agree_step(step: Optional[int], rank: int, world_size: int, group) -> Optional[int]:
    """``restore(step=...)``: every rank must name the same step (one collective, so that all
    raise together when they do not)."""
    everyone = everyones(step, world_size=world_size, group=group)
    if len(set(everyone)) > 1:
        raise ConfigError(f"restore(step=...) was called with different steps on different ranks "
                          f"({dict(enumerate(everyone))}); every rank must name the same version")
    return step


def _agree(survey_result, world_size: int, group):
    """All ranks walk rank 0's survey (one collective)."""
    return rank0s(survey_result, world_size=world_size, group=group)


class _Unreadable(Exception):
    """This version cannot be read (corrupt bytes); an older one may still be."""


class _Unhealthy(_Unreadable):
    """This version's state failed its health checks; an older one may be healthy."""


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


def _short(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... (+{len(items) - n} more)" if len(items) > n else "")


def _with_skipped(result: RestoreResult, skipped: list[int], reasons: dict[int, str]) -> RestoreResult:
    if not skipped:
        return result
    from dataclasses import replace

    return replace(result, skipped_steps=tuple(skipped), skipped_reasons=dict(reasons))
