"""Judging a scenario: what was observed, and the checks against the prediction and the
uninterrupted reference (restored state, continuation bit for bit)."""

from __future__ import annotations

from typing import Any, Optional

from ._harness import Harness
from ._predict import (
    DURABLE,
    ERROR,
    FRESH,
    MEMORY,
    Versions,
)
from ._results import (
    Check,
    Reference,
    Trace,
    err,
    short,
)


def observe(restored: dict[int, Any], errors: dict[int, str]) -> dict:
    if errors:
        rank, message = sorted(errors.items())[0]
        return {"outcome": ERROR, "step": None, "error": short(f"rank {rank}: {message}", 600)}
    r0 = restored[0]
    if r0["step"] is None:
        return {"outcome": FRESH, "step": None}
    return {
        "outcome": r0["source"],
        "step": r0["step"],
        "sources": {str(k): v for k, v in r0["sources"].items()},
        "bytes_read": r0["bytes_read"],
        "skipped_steps": r0["skipped_steps"],
        "saved_world_size": r0["saved_world_size"],
        "world_size": len(restored),
    }


def check_pre_fault(trace: Trace, ref: Reference, steps: list[int]) -> list[Check]:
    bad = [
        st
        for st in steps
        if trace.losses.get(st) != ref.trace.losses.get(st) or trace.digests.get(st) != ref.trace.digests.get(st)
    ]
    return [
        Check(
            "pre_fault",
            not bad,
            f"steps {bad} differ from the reference before any fault"
            if bad
            else f"steps 0..{steps[-1] if steps else -1} equal the reference",
        )
    ]


def check_restore(
    checks: list[Check], restored: dict[int, dict], versions: Versions, ref: Reference, saved_world_size: int
) -> None:
    pairs = {(v["step"], v["source"]) for v in restored.values()}
    checks.append(Check("agreed", len(pairs) == 1, f"ranks restored {sorted(pairs, key=str)}"))
    step, source = restored[0]["step"], restored[0]["source"]
    digests = {v["digest"] for v in restored.values()}
    expected = ref.initial_digest if step is None else ref.trace.digests.get(step)
    exact = digests == {expected}
    local_bad = []
    for rank, v in restored.items():
        want = (
            ref.initial_extras.get(rank % saved_world_size)
            if step is None
            else ref.trace.extras[step][rank % saved_world_size]
        )
        if v["extra"] != want:
            local_bad.append(rank)
    detail = (
        f"model+optimizer state {'equals' if exact else 'differs from'} the reference at "
        f"{'the start' if step is None else f'step {step}'}"
    )
    if local_bad:
        detail += f"; rank-local state of ranks {local_bad} differs"
    checks.append(Check("exact_restore", exact and not local_bad, detail))
    if step is None:
        checks.append(Check("committed_only", None, "fresh start"))
    else:
        known = versions.committed if source == MEMORY else versions.persisted if source == DURABLE else ()
        checks.append(
            Check(
                "committed_only",
                step in known,
                f"step {step} {'is' if step in known else 'is NOT'} a {source} version known committed {list(known)}",
            )
        )


def check_continuation(
    checks: list[Check],
    h: Harness,
    train_job: Any,
    ref: Reference,
    after: dict[int, Any],
    closed: dict[int, Any],
    hosts: tuple[int, ...],
    step0: Optional[int],
    rest: list[int],
) -> None:
    errors = {r: err(v) for r, v in after.items() if err(v)}
    records = {r: v for r, v in after.items() if isinstance(v, list)}
    for r, recs in records.items():
        for rec in recs:
            if rec.get("error"):
                errors[r] = f"step {rec['step']}: {rec['error']}"
            elif rec.get("persist_error"):
                errors[r] = f"step {rec['step']} was not persisted: {rec['persist_error']}"
    close_errors = {r: err(v) or v for r, v in closed.items() if err(v) or isinstance(v, str)}
    trace = Trace()
    trace.add(records)
    if len(hosts) == ref.world_size:
        want = ref.trace
    else:
        want = h.resized_reference(len(hosts), step0, train_job, hosts=hosts)["trace"]
    done = all(len(recs) == len(rest) and all(rec.get("committed") for rec in recs) for recs in records.values())
    finished = done and len(records) == len(hosts) and not errors and not close_errors
    checks.append(
        Check(
            "finished",
            finished,
            f"steps {rest[0] if rest else '-'}..{rest[-1] if rest else '-'} trained and committed, close() ok"
            if finished
            else short(f"errors {errors or close_errors}", 600),
        )
    )
    bad = [st for st in rest if trace.losses.get(st) != want.losses.get(st)]
    checks.append(
        Check(
            "continued",
            not bad and done,
            f"losses of steps {bad} differ from the reference"
            if bad
            else f"losses of {len(rest)} step(s) bit-identical to the reference",
        )
    )
    last = rest[-1] if rest else None
    same = (
        last is not None
        and trace.digests.get(last) == want.digests.get(last)
        and trace.extras.get(last) == want.extras.get(last)
    )
    checks.append(
        Check(
            "final_state",
            same if last is not None else None,
            "final model+optimizer digest and rank-local state equal the reference"
            if same
            else f"final state differs (step {last})",
        )
    )
