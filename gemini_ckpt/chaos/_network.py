"""The network faults of a scenario (``ChaosConfig.network="netns"``): a link shaped or flapping
while the job trains, a host cut off until Ray declares it dead and let back once the job has
been replaced (a new machine in its own namespace takes its place), and the checks of what the
network did (no false death; the partitioned host fenced when it comes back).

:class:`Links` is used by the runner in this order: :meth:`Links.start` (before training),
:meth:`Links.settle` (before the fault), :meth:`Links.partition` (the fault),
:meth:`Links.reconnect` (after the restarted job restored), :meth:`Links.check_fenced` (after it
trained on), and :meth:`Links.restore` (always, last: every link up and at its rate, the old
machine of a partitioned host removed).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ._faults import DEAD_AFTER_S, FlappingLink, PartitionHost, SlowLink
from ._results import Check, HarnessError, infrastructure
from ._spec import Scenario

DECLARED_DEAD_TIMEOUT_S = DEAD_AFTER_S * 4
"""How long a cut-off host may stay alive in Ray's eyes before the scenario gives up."""
OURS_EXIT_S = 10.0
"""How long a partitioned host's old host store and rank process get to exit once its link is
back. They hold shards and train, and they fence themselves (:mod:`gemini_ckpt.hoststore.fence`):
the lease ends them while the link is still down, the raylet's exit at once."""
RAY_EXIT_S = 60.0
"""How long the rest of its old processes (the raylet and Ray's agents: Ray's own) get. They end
when the raylet hears from the GCS that its node is dead, and a TCP connection that lost packets
during the outage retransmits only on exponential backoff, so this is much longer than
:data:`OURS_EXIT_S` (the times measured are in docs/chaos.md)."""
OURS = ("ray::HostStore", "ray::RankWorker")
"""The process titles of our processes on a host (a Ray actor's title is ``ray::<class>``)."""
UNSHAPED = "100gbit"
"""The rate a slowed link goes back to when the cluster's links are not shaped."""


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


class Links:
    """What the network does to one scenario (see the module docstring)."""

    def __init__(self, s: Scenario, h: Any) -> None:
        self.s, self.h = s, h
        self.cut: dict[int, dict] = {}  # host -> {"node": id, "cut": t, "dead_s": s, "up": t, "pids": [...]}
        self.flap: Optional[FlappingLink] = s.condition(FlappingLink)
        self.slow: Optional[SlowLink] = s.condition(SlowLink)
        self._flapper: Optional[threading.Thread] = None
        self._flap_node: Optional[str] = None
        self._flap_error: Optional[BaseException] = None
        self.flap_s = 0.0

    @property
    def active(self) -> bool:
        return self.s.needs_network()

    def _net(self):
        if self.h.sim.net is None:
            raise HarnessError(f"scenario {self.s.name} needs hosts with their own links: ChaosConfig.network='netns'")
        return self.h.sim

    # --- before the fault ---------------------------------------------------------------------------
    def start(self) -> None:
        """Slow the slow link; start flapping the flapping one (in a thread: the job trains meanwhile)."""
        if self.slow is not None:
            with infrastructure(f"shaping host {self.slow.host}'s link to {self.slow.rate}"):
                self._net().shape(self.slow.host, self.slow.rate)
        if self.flap is not None:
            sim = self._net()
            self._flap_node = sim.node_id(self.flap.host)
            self._flapper = threading.Thread(target=self._run_flaps, name="chaos-flapping-link", daemon=True)
            self._flapper.start()

    def _run_flaps(self) -> None:
        f, sim = self.flap, self.h.sim
        t0 = time.monotonic()
        try:
            for i in range(f.outages):
                sim.set_link(f.host, False)
                try:
                    time.sleep(f.down_s)
                finally:
                    sim.set_link(f.host, True)
                if i + 1 < f.outages:
                    time.sleep(f.up_s)
        except BaseException as exc:  # noqa: BLE001 - reported by settle()
            self._flap_error = exc
        self.flap_s = time.monotonic() - t0

    def settle(self) -> list[Check]:
        """Wait for the flapping to end; the flapped host must still be the node it was, alive."""
        if self._flapper is None:
            return []
        f = self.flap
        self._flapper.join(f.outages * (f.down_s + f.up_s) + 30)
        if self._flapper.is_alive() or self._flap_error is not None:
            raise HarnessError(f"flapping host {f.host}'s link failed: {self._flap_error or 'still running'}")
        self._flapper = None
        time.sleep(f.up_s)  # a false death would be declared within a few health checks of the last outage
        alive = self._flap_node in _alive_nodes()
        return [
            Check(
                "no_false_death",
                alive,
                f"host {f.host} (node {self._flap_node[:12]}) {'stayed alive' if alive else 'was declared DEAD'}"
                f" through {f.outages} outage(s) of {f.down_s:g}s ({self.flap_s:.1f}s of flapping)",
            )
        ]

    # --- the fault ----------------------------------------------------------------------------------
    def partition(self) -> None:
        """Cut every partitioned host's link and wait until Ray declares each dead."""
        hosts = self.s.partitioned_hosts()
        if not hosts:
            return
        sim = self._net()
        for host in hosts:
            self.cut[host] = {"node": sim.node_id(host), "netns": sim.netns_index(host)}
            self.cut[host]["pids"] = sim.net.pids(self.cut[host]["netns"])  # the machine's processes live on
            self.cut[host]["cut"] = time.monotonic()
            sim.set_link(host, False)
            self._watch_exits(host)
        deadline = time.monotonic() + DECLARED_DEAD_TIMEOUT_S
        waiting = set(hosts)
        while waiting:
            alive = _alive_nodes()
            for host in sorted(waiting):
                if self.cut[host]["node"] not in alive:
                    self.cut[host]["dead_s"] = round(time.monotonic() - self.cut[host]["cut"], 1)
                    waiting.discard(host)
            if waiting and time.monotonic() > deadline:
                raise HarnessError(
                    f"hosts {sorted(waiting)} were cut off {DECLARED_DEAD_TIMEOUT_S:.0f}s ago and Ray "
                    f"still lists them alive"
                )
            time.sleep(0.2)
        with infrastructure(f"adding replacements of partitioned hosts {list(hosts)}"):
            for host in hosts:
                self.h.pool.forget(host)  # Ray has given its rank process up
                # A new machine takes the host's place (and slot) while the old one is still cut off.
                sim.add_host(host, beside=True)
            self.h.pool.respawn(hosts)

    def reconnect(self) -> None:
        """Bring the partitioned links back (no sooner than each fault's ``seconds`` after the cut)."""
        for f in self.s.faults:
            if isinstance(f, PartitionHost) and f.host in self.cut and "up" not in self.cut[f.host]:
                wait = self.cut[f.host]["cut"] + f.seconds - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.h.sim.net.set_link(self.cut[f.host]["netns"], True)
                self.cut[f.host]["up"] = time.monotonic()

    def _watch_exits(self, host: int) -> None:
        """Note when each of the cut-off machine's processes exits (a thread, every 0.5 s, until
        all have or :data:`RAY_EXIT_S` after the link came back). A process has exited when its
        pid runs no more, is a zombie, or is another process now (its start time)."""
        from gemini_ckpt.hoststore.fence import process_identity

        c = self.cut[host]
        c["names"] = {pid: _names([pid]) for pid in c["pids"]}
        c["exits"], c["lock"] = {}, threading.Lock()
        first = {pid: process_identity(pid) for pid in c["pids"]}

        def watch() -> None:
            left = {pid for pid, ident in first.items() if ident is not None}
            with c["lock"]:
                c["exits"].update((pid, c["cut"]) for pid in set(first) - left)
            while left:
                t = time.monotonic()
                try:
                    gone = {pid for pid in left if process_identity(pid) != first[pid]}
                except OSError as exc:  # cannot tell now: ask again
                    c["watch_error"] = f"{type(exc).__name__}: {exc}"
                    gone = set()
                with c["lock"]:
                    c["exits"].update((pid, t) for pid in gone)
                left -= gone
                if "up" in c and t > c["up"] + RAY_EXIT_S:
                    return
                time.sleep(0.5)

        c["watcher"] = threading.Thread(target=watch, name=f"chaos-fence-watch-{host}", daemon=True)
        c["watcher"].start()

    def check_fenced(self) -> list[Check]:
        """After the link came back: Ray keeps the node dead, and its old processes exit instead of
        rejoining (ours within :data:`OURS_EXIT_S`, Ray's own within :data:`RAY_EXIT_S`); none of
        them may be counted in the job."""
        checks = []
        for host, c in sorted(self.cut.items()):
            if "up" not in c:
                continue
            watcher, names = c["watcher"], c["names"]
            ours = {pid for pid, name in names.items() if any(title in name for title in OURS)}
            missing = [title for title in OURS if not any(title in names[p] for p in ours)]

            def exits() -> dict[int, float]:
                with c["lock"]:
                    return dict(c["exits"])

            while watcher.is_alive() and ours - exits().keys() and time.monotonic() < c["up"] + OURS_EXIT_S:
                time.sleep(0.2)
            if not ours - exits().keys():  # ours are gone: wait for Ray's own
                watcher.join(max(0.0, c["up"] + RAY_EXIT_S + 2 - time.monotonic()))
            after = {pid: round(t - c["up"], 1) for pid, t in exits().items()}  # < 0: before the link came back
            ours_left = sorted(p for p in ours if p not in after or after[p] > OURS_EXIT_S)
            left = sorted(p for p in names if p not in after)
            still_dead = c["node"] not in _alive_nodes()
            c["ours_exited_s"] = max((after[p] for p in ours if p in after), default=None)
            c["exited_s"] = max(after.values(), default=None) if not left else None
            detail = (
                f"host {host}: declared dead {c.get('dead_s')}s after the cut; link up "
                f"{c['up'] - c['cut']:.0f}s after the cut; Ray {'still lists' if still_dead else 'LISTS'} "
                f"node {c['node'][:12]} {'dead' if still_dead else 'ALIVE again'}; "
            )
            if missing:
                detail += (
                    f"{' and '.join(missing)} not found among its {len(names)} processes at the cut, so "
                    f"their fencing was not checked: {'; '.join(names.values())}"
                )
            elif ours_left:
                detail += (
                    f"its host store / rank process ran on past {OURS_EXIT_S:.0f}s after the link came back: "
                    + "; ".join(
                        f"{names[p]} ({'still running' if p not in after else f'{after[p]}s'})" for p in ours_left
                    )
                )
            elif left:
                detail += (
                    f"ours exited {c['ours_exited_s']}s after the link came back (< 0: before); "
                    f"{len(left)} of Ray's own process(es) still running {RAY_EXIT_S:.0f}s after it: "
                    + "; ".join(names[p] for p in left)
                )
            else:
                last = max(after, key=after.get) if after else None
                detail += (
                    f"its {len(names)} old processes exited: ours {c['ours_exited_s']}s after the link came "
                    f"back (< 0: before), the last {c['exited_s']}s" + (f" ({names[last]})" if last else "")
                )
            if c.get("watch_error"):
                detail += f" (/proc could not be read once: {c['watch_error']})"
            checks.append(Check("fenced", still_dead and not left and not ours_left and not missing, detail))
        return checks

    # --- always, last -------------------------------------------------------------------------------
    def restore(self) -> None:
        """Every link up and at the cluster's rate; a host Ray declared dead is replaced."""
        if not self.active or self.h.sim is None or self.h.sim.net is None:
            return
        sim = self.h.sim
        if self._flapper is not None:
            self._flapper.join(60)
        with infrastructure("restoring the scenario's links"):
            if self.flap is not None and self.flap.host in sim.present():
                sim.set_link(self.flap.host, True)
            if self.slow is not None and self.slow.host in sim.present():
                sim.shape(self.slow.host, self.h.config.link or UNSHAPED)
            for host, c in self.cut.items():
                if "netns" in c and c["netns"] != sim.netns_index(host):
                    sim.net.remove_host(c["netns"])  # the old machine, and whatever it still runs
                elif host in sim.present():
                    sim.set_link(host, True)  # cut, never declared dead: back as it was


def _names(pids: list[int]) -> str:
    out = []
    for pid in pids[:8]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid} {argv[:60].strip()}")
        except OSError:
            out.append(str(pid))
    return "; ".join(out)
