"""A PNG timeline of a training run: steps, saves, commits, persists, a failure and the restore.

Input is a list of events (plain dicts, as the demo's workers and driver record them), each
with ``t`` (seconds since the run started) and ``kind``:

=========== =====================================================================
``step``    ``step``, ``stall_s`` (the save's blocking time), ``attempt``
``commit``  ``step``: the version is committed in memory (every copy acknowledged)
``persist`` ``step``: the version is complete on durable storage
``failure`` ``host``: a host was killed
``restore`` ``step``, ``source``, ``seconds`` (``t`` is when the restore finished)
``stage``   ``what``, ``whose``: a recovery stage ended at ``t`` (the demo report's stages)
=========== =====================================================================

Between the failure and the next step, each stage is drawn as a band from the end of the one
before it, coloured by whose it is (the library's, Ray's, Ray Train's, the user code's).

Matplotlib runs with the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional


def plot_timeline(events: Sequence[dict], path: str, *, title: str = "") -> str:
    """Draw ``events`` into a PNG at ``path`` (returned)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    by_kind: dict[str, list[dict]] = {}
    for e in events:
        by_kind.setdefault(e["kind"], []).append(e)
    steps = sorted(by_kind.get("step", []), key=lambda e: e["t"])
    fig, (ax_step, ax_stall, ax_ev) = plt.subplots(
        3, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4, 1.2]}
    )

    # 1. progress: the step each attempt reached over time; a rollback shows as a drop.
    attempts = sorted({e.get("attempt", 0) for e in steps})
    for i, attempt in enumerate(attempts):
        pts = [e for e in steps if e.get("attempt", 0) == attempt]
        ax_step.plot(
            [e["t"] for e in pts],
            [e["step"] for e in pts],
            ".-",
            ms=3,
            lw=1,
            color=f"C{i}",
            label=f"training (attempt {attempt + 1})",
        )
    persists = by_kind.get("persist", [])
    if persists:
        ax_step.plot(
            [e["t"] for e in persists],
            [e["step"] for e in persists],
            "D",
            color="black",
            ms=5,
            label="persisted to durable storage",
        )
    ax_step.set_ylabel("step")

    # 2. cost: what each save blocked training for, and when each version committed.
    if steps:
        ax_stall.plot(
            [e["t"] for e in steps],
            [1e3 * e.get("stall_s", 0.0) for e in steps],
            "|",
            color="C2",
            ms=8,
            label="save stall (ms)",
        )
    commits = by_kind.get("commit", [])
    if commits:
        ax_stall.plot(
            [e["t"] for e in commits],
            [1e3 * e.get("latency_s", 0.0) for e in commits],
            ".",
            color="C4",
            ms=3,
            label="save -> committed (ms)",
        )
    ax_stall.set_ylabel("ms")
    ax_stall.legend(loc="upper left", fontsize=8)

    # 3. events, one row each.
    rows = [
        ("saves", [e["t"] for e in steps], "C2"),
        ("commits", [e["t"] for e in commits], "C4"),
        ("persists", [e["t"] for e in persists], "black"),
    ]
    for y, (name, ts, color) in enumerate(rows):
        ax_ev.vlines(ts, y - 0.35, y + 0.35, color=color, lw=1)
    ax_ev.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax_ev.set_ylim(-0.6, len(rows) - 0.4)
    ax_ev.set_xlabel("seconds since start")

    failure = _first(by_kind.get("failure"))
    restore = _first(by_kind.get("restore"))
    stages = sorted(by_kind.get("stage", []), key=lambda e: e["t"])
    for ax in (ax_step, ax_stall, ax_ev):
        if failure is not None:
            ax.axvline(failure["t"], color="red", ls="--", lw=1.5)
    if failure is not None:
        ax_step.plot(
            [],
            [],
            color="red",
            ls="--",
            label=f"{failure.get('fault', 'host')} fault on host {failure.get('host', '?')}",
        )
        _draw_stages(failure["t"], stages, (ax_step, ax_stall, ax_ev))
    if restore is not None:
        ax_step.plot(
            [restore["t"]],
            [restore["step"]],
            "o",
            mfc="none",
            mec="C1",
            ms=10,
            mew=2,
            label=f"restored step {restore['step']} from {restore.get('source', '?')}",
        )
    ax_step.legend(loc="upper left", fontsize=8)
    ax_step.grid(alpha=0.3)
    if title:
        ax_step.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


WHOSE_COLOURS = {"gemini": "C0", "Ray": "C3", "Ray Train": "C5", "cluster": "C7", "user code": "C1"}


def _draw_stages(start: float, stages: list[dict], axes) -> None:
    """Each stage as a band from the end of the one before, coloured by whose it is; the stage's
    name on the event axis."""
    seen = set()
    before = start
    for i, stage in enumerate(stages):
        colour = WHOSE_COLOURS.get(stage["whose"], "grey")
        for ax in axes:
            ax.axvspan(before, max(before, stage["t"]), color=colour, alpha=0.18 + 0.1 * (i % 2), lw=0)
        axes[-1].text(
            stage["t"], axes[-1].get_ylim()[1], f" {stage['what']}", rotation=90, fontsize=6, va="top", ha="right"
        )
        if stage["whose"] not in seen:
            seen.add(stage["whose"])
            axes[0].fill_between([], [], color=colour, alpha=0.3, label=f"recovery: {stage['whose']}")
        before = max(before, stage["t"])


def _first(items: Optional[list[dict]]) -> Optional[dict]:
    return min(items, key=lambda e: e["t"]) if items else None
