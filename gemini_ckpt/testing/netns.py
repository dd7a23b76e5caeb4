"""Simulated hosts with their own network: one Linux network namespace per host, joined to a
bridge by a veth pair, with an address from the benchmarking range 198.18.0.0/15 and its link
shaped in both directions (``tc tbf``; ``tc htb`` with ``qos``). :class:`~gemini_ckpt.testing.cluster.LocalCluster` with
``network="netns"`` runs each host's Ray node (raylet, workers, host store) inside one, so
replication, training collectives and Ray's own traffic between hosts cross real (virtual)
links: a link has a rate, traffic on it contends, and a host can be cut off while alive.

Layout of network ``k`` (one per cluster, ``k`` in 0..511, the ``k``-th /24 of the range)::

    root namespace:  bridge gck<k>br  198.18.k.1   (the head node, the driver)
                       |-- veth gck<k>h<i>  (shaped: what host i receives)
    namespace gck<k>h<i>:  eth0  198.18.k.(10+i)   (shaped: what host i sends)

Everything is named after the network and recorded, as it is made, in a state file
(``/run/gemini_ckpt/netns/gck<k>.json``) with the owning process; :meth:`Network.destroy`
removes it all, and the next :meth:`Network.create` removes what an owner that died left
behind. Only names recorded in a state file are ever touched.

With ``qos=True`` a link also honours traffic priority, as a switch port configured with a
lower-effort class does: the shaper is an HTB with two classes, and packets whose DSCP is
:data:`LOWER_EFFORT_DSCP` (CS1, which the data plane marks its sockets with under
``CheckpointConfig(interleave="network")``) go after the other class's, with what it leaves of
the link (1% of the rate is theirs, so they never starve; ``tc -s class show dev <link>``: class
``1:20``). Without it a link is one FIFO (tbf's queue).

Making namespaces needs CAP_NET_ADMIN (root) and the ``ip`` and ``tc`` tools:
:func:`unavailable_reason` says why they can't be made here, and
:class:`~gemini_ckpt.errors.NetworkUnavailable` carries it.

Example::

    net = Network.create(link="1gbit")
    try:
        net.add_host(0)
        net.exec(0, ["python", "-c", "print('inside host 0')"]).wait()
        with net.partitioned(0):      # host 0's link down
            ...
    finally:
        net.destroy()
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional

from ..errors import ConfigError, NetworkUnavailable
from ..dataplane import LOWER_EFFORT_DSCP
from .netns_check import parse_rate, unavailable_reason

log = logging.getLogger("gemini_ckpt")

__all__ = ["MAX_HOSTS", "Network", "parse_rate", "sweep_stale", "unavailable_reason"]

RANGE = ipaddress.ip_network("198.18.0.0/15")
NETWORKS = 512  # the /24s of RANGE
MAX_HOSTS = 240
STATE_DIR = Path(os.environ.get("GEMINI_CKPT_NETNS_STATE", "/run/gemini_ckpt/netns"))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkUnavailable(f"'ip {' '.join(args)}' failed: {done.stderr.strip()}")
    return done


def _tc(ns: Optional[str], *args: str) -> str:
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["tc", *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkUnavailable(f"'{' '.join(argv)}' failed: {done.stderr.strip()}")
    return done.stdout


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (field 22 of /proc/PID/stat): tells a live owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def namespace_pids(ns: str) -> list[int]:
    """The processes running in namespace ``ns`` (none when it does not exist)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _kill_all(ns: str, deadline_s: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` (a machine that loses power), until none is left."""
    deadline = time.monotonic() + deadline_s
    while True:
        pids = namespace_pids(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            log.warning("processes %s in namespace %s outlived SIGKILL", pids, ns)
            return
        time.sleep(0.05)


class Network:
    """One cluster's namespaces, veths and bridge (see the module docstring). Make it with
    :meth:`create`; every method runs ``ip``/``tc`` and raises
    :class:`~gemini_ckpt.errors.NetworkUnavailable` when one fails."""

    def __init__(self, index: int, link_bits: Optional[int], state_file: Path, qos: bool = False) -> None:
        self.index, self.link_bits, self.state_file, self.qos = index, link_bits, state_file, qos
        self.bridge = f"gck{index}br"
        self._hosts: dict[int, Optional[int]] = {}  # host -> its link's rate (None: unshaped)
        self._record: dict = {
            "owner": os.getpid(),
            "owner_start": _start_time(os.getpid()),
            "index": index,
            "bridge": None,
            "namespaces": [],
            "links": [],
        }

    # -- names -----------------------------------------------------------------------------
    def namespace(self, host: int) -> str:
        return f"gck{self.index}h{host}"

    def link(self, host: int) -> str:
        """The root side of host ``host``'s veth (its inside end is ``eth0``)."""
        return f"gck{self.index}h{host}"

    def address(self, host: Optional[int] = None) -> str:
        """Host ``host``'s address; the head's (on the bridge) for None."""
        base = int(RANGE.network_address) + 256 * self.index
        return str(ipaddress.ip_address(base + (1 if host is None else 10 + host)))

    def mac(self, host: int) -> str:
        """Host ``host``'s MAC address: locally administered, derived from its IPv4 address."""
        return "02:00:" + ":".join(f"{b:02x}" for b in ipaddress.ip_address(self.address(host)).packed)

    @property
    def head_address(self) -> str:
        return self.address(None)

    def hosts(self) -> list[int]:
        return sorted(self._hosts)

    # -- life ------------------------------------------------------------------------------
    @classmethod
    def create(cls, *, link: str | int | None = None, qos: bool = False) -> "Network":
        """Sweep what dead owners left, claim a free network, make its bridge. ``qos``: shaped
        links honour priority (module docstring); it needs ``link``."""
        link_bits = parse_rate(link) if link is not None else None
        if qos and link_bits is None:
            raise ConfigError("Network.create(qos=True) prioritizes traffic on shaped links: give it a link rate too")
        reason = unavailable_reason()
        if reason is not None:
            raise NetworkUnavailable(
                f"LocalCluster(network='netns') can't make network namespaces here: {reason}; use network='loopback'"
            )
        sweep_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        for index in range(NETWORKS):
            path = STATE_DIR / f"gck{index}.json"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            os.close(fd)
            net = cls(index, link_bits, path, qos)
            try:
                net._save()
                if _ip("link", "show", net.bridge, check=False).returncode == 0:
                    raise NetworkUnavailable(
                        f"a device named {net.bridge} exists but no state file claims it; "
                        f"remove it (ip link del {net.bridge}) if nothing of yours uses it"
                    )
                _ip("link", "add", net.bridge, "type", "bridge")
                net._record["bridge"] = net.bridge
                net._save()
                _ip("addr", "add", f"{net.head_address}/24", "dev", net.bridge)
                _ip("link", "set", net.bridge, "up")
            except BaseException:
                net.destroy()
                raise
            return net
        raise NetworkUnavailable(f"all {NETWORKS} networks of {RANGE} are claimed by live owners ({STATE_DIR})")

    def _save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._record))
        os.replace(tmp, self.state_file)

    def add_host(self, host: int) -> str:
        """Make host ``host``'s namespace, veth, address and shaping; returns its address."""
        if not 0 <= host < MAX_HOSTS:
            raise ConfigError(f"host {host}: a netns network has hosts 0..{MAX_HOSTS - 1}")
        if host in self._hosts:
            raise RuntimeError(f"host {host} already has a namespace ({self.namespace(host)})")
        ns, veth = self.namespace(host), self.link(host)
        self._record["namespaces"].append(ns)
        self._record["links"].append(veth)
        self._save()
        _ip("netns", "add", ns)
        # The inside end's MAC follows from the address: a replacement host (same address, new
        # namespace) answers at the MAC its peers' neighbour tables already hold; with a random
        # one they keep sending to the old MAC until the entry expires (tens of seconds: docs/chaos.md).
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "address", self.mac(host), "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self._hosts[host] = None
        if self.link_bits is not None:
            self.shape(host, self.link_bits)
        return self.address(host)

    def kill(self, host: int) -> None:
        """SIGKILL every process of host ``host`` (its machine's processes are gone), keeping its
        namespace and link: peers that connect are refused at once, as by a machine whose
        processes died (Ray knows the node dead in ~3 s; a partition is the silent kind)."""
        _kill_all(self.namespace(host))

    def remove_host(self, host: int) -> None:
        """Kill every process of host ``host`` (SIGKILL: a machine lost) and remove its namespace."""
        ns, veth = self.namespace(host), self.link(host)
        _kill_all(ns)
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", veth, check=False)  # gone with the namespace, or soon after
        self._hosts.pop(host, None)
        self._record["namespaces"] = [n for n in self._record["namespaces"] if n != ns]
        self._record["links"] = [n for n in self._record["links"] if n != veth]
        self._save()

    def destroy(self) -> None:
        """Remove everything this network made (processes in its namespaces included)."""
        _teardown(self._record)
        self._hosts.clear()
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()

    # -- the links ---------------------------------------------------------------------------
    def shape(self, host: int, rate: str | int) -> None:
        """Shape host ``host``'s link to ``rate`` in both directions (tbf, or htb with ``qos``;
        replaces a former rate)."""
        bits = parse_rate(rate)
        byte_rate = bits // 8
        # a real port never sends faster than its rate: a bucket of 1 ms at the rate, but at least
        # one GSO packet (tbf drops a packet larger than its bucket)
        burst = max(64 << 10, byte_rate // 1000)
        for ns, dev in ((None, self.link(host)), (self.namespace(host), "eth0")):
            if self.qos:
                self._shape_qos(ns, dev, bits, burst, change=self._hosts.get(host) is not None)
            else:
                verb = "change" if self._hosts.get(host) is not None else "add"
                _tc(ns, *f"qdisc {verb} dev {dev} root tbf rate {bits}bit burst {burst} latency 50ms".split())
        self._hosts[host] = bits

    @staticmethod
    def _shape_qos(ns: Optional[str], dev: str, bits: int, burst: int, *, change: bool) -> None:
        """HTB at ``bits``: class 1:10 (everything, first) and 1:20 (DSCP CS1, only what 1:10
        leaves: its own share, 1%, is what keeps it from starving)."""
        verb = "change" if change else "add"
        if not change:
            _tc(ns, *f"qdisc add dev {dev} root handle 1: htb default 10".split())
        common = f"burst {burst} cburst {burst} quantum 60000".split()
        low = max(8000, bits // 100)
        for parent, classid, rate, prio in (
            ("1:", "1:1", bits, None),
            ("1:1", "1:10", max(8000, bits - low), "0"),
            ("1:1", "1:20", low, "1"),
        ):
            args = f"class {verb} dev {dev} parent {parent} classid {classid} htb rate {rate}bit ceil {bits}bit"
            _tc(ns, *args.split(), *(["prio", prio] if prio is not None else []), *common)
        if not change:
            tos = f"{LOWER_EFFORT_DSCP << 2:#04x}"
            _tc(
                ns,
                *f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip tos {tos} 0xfc flowid 1:20".split(),
            )

    def class_bytes(self, host: int, *, inside: bool = True) -> dict[str, int]:
        """Bytes sent so far through each class of host ``host``'s link (``qos=True``): what host
        ``host`` sent (``inside``) or received, by class (``"1:10"``, ``"1:20"``)."""
        ns, dev = (self.namespace(host), "eth0") if inside else (None, self.link(host))
        found, current = {}, None
        for line in _tc(ns, "-s", "class", "show", "dev", dev).splitlines():
            m = re.match(r"class htb (\S+) ", line)
            if m:
                current = m.group(1)
            m = re.match(r"\s*Sent (\d+) bytes", line)
            if m and current is not None:
                found[current] = int(m.group(1))
        return found

    def rate(self, host: int) -> Optional[int]:
        """Host ``host``'s link rate in bits per second (None: unshaped)."""
        return self._hosts.get(host)

    def set_link(self, host: int, up: bool) -> None:
        """Host ``host``'s link up or down (down: alive, but cut off from every other host)."""
        _ip("link", "set", self.link(host), "up" if up else "down")

    @contextlib.contextmanager
    def partitioned(self, host: int) -> Iterator[None]:
        """Host ``host`` cut off inside the block, its link back up after it."""
        self.set_link(host, False)
        try:
            yield
        finally:
            self.set_link(host, True)

    def exec(self, host: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], **popen)

    def pids(self, host: int) -> list[int]:
        return namespace_pids(self.namespace(host))


def _teardown(record: dict) -> None:
    for ns in record.get("namespaces", []):
        _kill_all(ns)
        _ip("netns", "del", ns, check=False)
    for veth in record.get("links", []):
        _ip("link", "del", veth, check=False)
    if record.get("bridge"):
        _ip("link", "del", record["bridge"], check=False)


def sweep_stale() -> list[str]:
    """Remove what networks whose owner died left behind (their state files name it all);
    returns the state files swept. Networks of live owners and anything not recorded in a
    state file are left alone."""
    if not STATE_DIR.is_dir():
        return []
    swept = []
    for path in sorted(STATE_DIR.glob("gck*.json")):
        try:
            record = json.loads(path.read_text())
            owner, started = int(record["owner"]), record.get("owner_start")
        except (OSError, ValueError, KeyError, TypeError):
            if time.time() - path.stat().st_mtime < 10:
                continue  # being written right now
            record, owner, started = {}, -1, None
        if owner > 0 and _start_time(owner) is not None and _start_time(owner) == started:
            continue
        if record:
            log.warning("removing network %s left by process %d, which is gone", path.stem, owner)
            _teardown(record)
        path.unlink(missing_ok=True)
        swept.append(path.name)
    return swept
