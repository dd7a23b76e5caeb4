"""The text ``python -m placement advise`` prints: the failure model, the settings' ETTR and the advice."""

from __future__ import annotations

import argparse
from typing import Any

from ._advise import Advice
from ._bench import BenchCosts
from ._inputs import HOUR


def advice_text(
    advice: Advice,
    args: argparse.Namespace,
    origin: dict[str, str],
    bench: BenchCosts | None,
    sims: dict[str, Any],
    plot: str | None,
) -> str:
    m, c = advice.failures, advice.costs
    d, r = advice.durable_only, advice.recommended
    per_day = 24 / advice.system_mtbf_h
    ranks = m.hosts * m.ranks_per_host
    lines = [
        f"hosts={m.hosts} x {m.ranks_per_host} ranks, step {c.step_s:g} s",
        "failures per host: lost every {:g} h{}{}; the job fails every {:.2f} h of running ({:.2f} a day)".format(
            m.host_mtbf_h,
            "" if m.process_mtbf_h is None else f", processes crash every {m.process_mtbf_h:g} h",
            ""
            if m.domain_size is None
            else f"; per {m.domain_size}-host domain ({m.domain_layout}): every {m.domain_mtbf_h:g} h",
            advice.system_mtbf_h,
            per_day,
        ),
        "costs (s): stall {:g}/save, commit {} (replicas {}), persist {:g} (+{:g} stall), "
        "restore local {:g} / peer {:g} / durable {:g}, restart process {:g} / host {:g}, "
        "durable-only save {:g}".format(
            c.stall_s,
            "/".join(f"{x:g}" for x in c.commit_s),
            "/".join(str(i) for i in range(1, len(c.commit_s) + 1)) + "+",
            c.persist_s,
            c.persist_stall_s,
            c.restore_local_s,
            c.restore_peer_s,
            c.restore_durable_s,
            c.restart_process_s,
            c.restart_host_s,
            c.durable_save_s,
        ),
    ]
    if bench is not None:
        lines.append(
            "  from bench: "
            + ", ".join(f"{k} ({v[len('bench: ') :]})" for k, v in origin.items() if v.startswith("bench"))
        )
        if bench.missing:
            lines.append("  not in the bench results, default used: " + ", ".join(bench.missing))
    lines += [
        "",
        f"durable only (no memory tier): a blocking checkpoint every {d.setting.persist_every} "
        f"steps ({d.setting.persist_every * c.step_s:.0f} s of training; Young/Daly "
        f"sqrt(2 C M) = {advice.young_daly_s:.0f} s)",
        f"  ETTR {pct(d.ettr)}, wasted {d.wasted_h_per_day:.2f} h/day ({d.wasted_h_per_day * ranks:,.0f} rank-hours)",
        "",
        "in memory (a version saved every save_every steps, every persist_every-th persisted):",
        "  replicas  placement  save_every  persist_every    interval  P(memory | host lost)"
        + ("  P(memory | domain lost)" if m.domain_size else "")
        + "     ETTR  wasted h/day  rank-h/day",
    ]
    for e in advice.candidates:
        s = e.setting
        mark = "*" if e is r else " "
        domain = f"  {pct(e.p_memory_domain or 0.0, 4):>23}" if m.domain_size else ""
        lines.append(
            f"{mark} {s.replicas:>8}  {s.placement:<9}  {s.save_every:>10}  {s.persist_every:>13}  "
            f"{dur(e.interval_s):>10}  {pct(e.p_memory_host, 4):>21}{domain}  {pct(e.ettr):>7}  "
            f"{e.wasted_h_per_day:>12.2f}  {e.wasted_h_per_day * ranks:>10,.0f}"
        )
    gain = d.wasted_h_per_day - r.wasted_h_per_day
    s = r.setting
    lines += [
        "",
        f"recommended: replicas={s.replicas}, placement={s.placement!r}, "
        f"persist_every={s.persist_every}, keep_in_memory={s.keep_in_memory}; "
        + (
            "save every step"
            if s.save_every == 1
            else f"save every {s.save_every} steps (ckpt.save(step) when step % {s.save_every} == 0)"
        ),
        f"  ETTR {pct(r.ettr)} vs {pct(d.ettr)} durable only: {gain:+.2f} h/day "
        f"({gain * ranks:+,.0f} rank-hours) of training kept",
        f"  waste: stalls {pct(r.waste_checkpoint)}, lost work {pct(r.waste_lost)}, "
        f"restarts and restores {pct(r.waste_recovery)}; {r.durable_fallbacks_per_day:.4f} "
        "durable fallbacks a day",
        f"  memory per host: {r.memory_shards} x one host's checkpoint ({s.keep_in_memory} kept + 1 in "
        f"flight{' + 1 being persisted' if r.memory_shards > (s.keep_in_memory + 1) * s.replicas else ''})"
        f" x {s.replicas} replicas",
        "  " + s.config_line(args.durable_uri),
    ]
    if sims:
        parts = []
        for name, label in (("recommended", "recommended"), ("durable_only", "durable only")):
            sim, est = sims[name]
            parts.append(
                f"{label} {pct(sim.ettr)} (analytic {pct(est.ettr)}, "
                f"{(sim.ettr - est.ettr) / est.ettr * 100:+.3f}% relative)"
            )
        sim = sims["recommended"][0]
        lines += [
            "",
            f"monte carlo (seed {sim.seed}, {sim.events} failures, "
            f"{sim.simulated_days:,.0f} simulated days each): " + "; ".join(parts),
        ]
    for note in advice.notes:
        lines.append(f"note: {note}")
    if plot:
        lines.append(f"wrote {plot}")
    return "\n".join(lines) + "\n"


def pct(x: float, digits: int = 2) -> str:
    # Never print a certainty that is not one.
    text = f"{x * 100:.{digits}f}%"
    if x < 1 and text == f"{100:.{digits}f}%":
        return ">" + f"{100 - 10**-digits:.{digits}f}%"
    return text


def dur(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / HOUR:.1f} h"
