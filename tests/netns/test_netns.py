"""Simulated hosts with their own network (:mod:`gemini_ckpt.testing.netns`): namespaces, addresses,
shaped links, partitions, and that only what a network made is removed, also after its owner
was killed. Where namespaces can't be made (no CAP_NET_ADMIN, no ``ip``), the tests that need
them skip with the reason; the configuration checks run everywhere.

Ray runs in child processes here (a process joins one Ray cluster, and the integration tier's
session cluster is another), so these tests don't use the ``ray_cluster`` fixture.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gemini_ckpt.errors import ConfigError
from gemini_ckpt.testing import netns
from gemini_ckpt.testing.cluster import LocalCluster

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")


def _names(prefix: str) -> tuple[set[str], set[str]]:
    """Namespaces and links whose names start with ``prefix``."""
    spaces = {
        line.split()[0]
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        if line.strip()
    }
    links = {
        line.split(":")[1].strip().split("@")[0]
        for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
    }
    return {s for s in spaces if s.startswith(prefix)}, {n for n in links if n.startswith(prefix)}


def _running(pid) -> bool:
    """A process that exists and is not a zombie (here nobody may reap an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(prefix: str, timeout: float = 10.0) -> tuple[set[str], set[str]]:
    """What is left of ``prefix`` once the kernel finished removing (veth removal is asynchronous)."""
    deadline = time.monotonic() + timeout
    left = _names(prefix)
    while any(left) and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _names(prefix)
    return left


# --- configuration: everywhere ---------------------------------------------------------------------
def test_rates_are_read_as_tc_writes_them():
    assert netns.parse_rate("1gbit") == 10**9
    assert netns.parse_rate("10mbit") == 10**7
    assert netns.parse_rate("500kbit") == 500_000
    assert netns.parse_rate("100mbps") == 8 * 10**8
    assert netns.parse_rate(2_000_000) == 2_000_000
    with pytest.raises(ConfigError, match="as tc does"):
        netns.parse_rate("fast")
    with pytest.raises(ConfigError, match="at least 100kbit"):
        netns.parse_rate("10kbit")


def test_a_wrong_network_setting_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match="network='wifi'.*loopback, netns"):
        LocalCluster(2, network="wifi")
    with pytest.raises(ConfigError, match="needs network='netns'"):
        LocalCluster(2, link="1gbit")
    with pytest.raises(ConfigError, match="as tc does"):
        LocalCluster(2, network="netns", link="quick")
    with pytest.raises(ConfigError, match="start it with network='netns'"):
        LocalCluster(2).set_link(0, False)


def test_without_the_ip_tool_the_error_says_why_and_what_to_use(tmp_path):
    child = textwrap.dedent("""
        from gemini_ckpt.errors import NetworkUnavailable
        from gemini_ckpt.testing.cluster import LocalCluster
        try:
            LocalCluster(2, network="netns").start()
        except NetworkUnavailable as exc:
            print("REFUSED", exc)
    """)
    env = {**os.environ, "PATH": str(tmp_path), "GEMINI_CKPT_NETNS_STATE": str(tmp_path / "state")}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in done.stdout, done.stderr[-2000:]
    assert "'ip' tool is not installed" in done.stdout and "network='loopback'" in done.stdout
    assert not (tmp_path / "state").exists()


# --- the network itself: where namespaces can be made ---------------------------------------------
_SERVE = textwrap.dedent("""
    import socket, sys, time
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 5201
    s = socket.socket(); s.bind((sys.argv[1], port)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); n = 0; t = None; buf = bytearray(1 << 16)
    while True:
        k = c.recv_into(buf)
        if not k: break
        t = t or time.monotonic(); n += k
    print(n, time.monotonic() - t, flush=True)
""")
_SEND = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[5]) if len(sys.argv) > 5 else 5201),
                                 timeout=float(sys.argv[3]))
    if len(sys.argv) > 4 and sys.argv[4] != "-":
        from gemini_ckpt.dataplane._tcp import mark
        mark(c, int(sys.argv[4]))
    data = b"x" * (1 << 16)
    for _ in range(int(sys.argv[2]) >> 16): c.sendall(data)
    c.close()
""")


def _stream(
    net, src: int, dst: int, nbytes: int, timeout: float = 30.0, *, dscp: int | None = None, port: int = 5201
) -> float:
    """Bytes per second of one TCP stream from host ``src`` to host ``dst`` (its packets marked
    with ``dscp`` as the data plane marks them)."""
    server = net.exec(
        dst, [sys.executable, "-c", _SERVE, net.address(dst), str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        sender = net.exec(
            src,
            [
                sys.executable,
                "-c",
                _SEND,
                net.address(dst),
                str(nbytes),
                "5",
                "-" if dscp is None else str(dscp),
                str(port),
            ],
        )
        assert sender.wait(timeout) == 0
        got, seconds = server.communicate(timeout=timeout)[0].split()
        assert int(got) == nbytes
        return nbytes / float(seconds)
    finally:
        server.kill()


@needs_netns
def test_hosts_get_their_own_addresses_and_shaped_links_and_everything_goes_on_destroy():
    net = netns.Network.create(link="100mbit")
    prefix = f"gck{net.index}"
    try:
        assert net.add_host(0) == f"198.18.{net.index}.10" if net.index < 256 else True
        net.add_host(1)
        addresses = subprocess.run(
            ["ip", "-n", net.namespace(1), "-o", "-4", "addr", "show", "eth0"], capture_output=True, text=True
        ).stdout
        assert net.address(1) + "/24" in addresses
        # one stream of 4 MiB over a 100 Mbit/s link: at the rate, not above it (the tbf burst is
        # 64 KiB) and not far below it
        rate = _stream(net, 0, 1, 4 << 20) * 8
        assert 0.75e8 < rate < 1.05e8, f"{rate / 1e6:.1f} Mbit/s over a 100 Mbit/s link"
        net.shape(1, "20mbit")
        rate = _stream(net, 0, 1, 1 << 20) * 8
        assert 1.4e7 < rate < 2.15e7, f"{rate / 1e6:.1f} Mbit/s over a link reshaped to 20 Mbit/s"
        # cut off: a connection attempt to the host times out; back up: it connects again
        with net.partitioned(1):
            probe = net.exec(
                0, [sys.executable, "-c", _SEND, net.address(1), "65536", "1.5"], stderr=subprocess.PIPE, text=True
            )
            assert probe.wait(10) != 0 and "timed out" in probe.stderr.read()
        assert _stream(net, 0, 1, 1 << 16) > 0
        state = json.loads(net.state_file.read_text())
        assert state["owner"] == os.getpid() and sorted(state["namespaces"]) == [net.namespace(0), net.namespace(1)]
    finally:
        net.destroy()
    assert _gone(prefix) == (set(), set())
    assert not net.state_file.exists()


@needs_netns
def test_links_with_qos_send_lower_effort_packets_only_when_other_traffic_leaves_the_link_idle():
    """``qos=True``: what the data plane marks (DSCP CS1) is counted in its own class on both
    ends of a link, and a stream of unmarked packets gets the link while a marked one saturates
    it (one FIFO would split it about evenly, as two TCP streams do)."""
    net = netns.Network.create(link="100mbit", qos=True)
    marked, errors = 24 << 20, []  # ~2 s alone at 100 Mbit/s

    def background():
        try:
            _stream(net, 0, 1, marked, dscp=netns.LOWER_EFFORT_DSCP, port=5202)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    try:
        net.add_host(0)
        net.add_host(1)
        alone = _stream(net, 0, 1, 2 << 20)
        thread = threading.Thread(target=background)
        thread.start()
        deadline = time.monotonic() + 20
        while net.class_bytes(0).get("1:20", 0) < (1 << 20) and time.monotonic() < deadline:
            time.sleep(0.02)  # until the marked stream is on the wire
        during = _stream(net, 0, 1, 2 << 20)
        still = net.class_bytes(0)["1:20"]
        thread.join(60)
        assert not thread.is_alive() and not errors, errors
        sent, received = net.class_bytes(0), net.class_bytes(1, inside=False)
        net.shape(0, "50mbit")  # a QoS link reshaped (the chaos harness's slow link): its classes follow
        classes = subprocess.run(["tc", "class", "show", "dev", net.link(0)], capture_output=True, text=True).stdout
    finally:
        net.destroy()
    assert (1 << 20) <= still < marked, "the marked stream was not running beside the unmarked one"
    assert during > 0.75 * alone, f"{during * 8e-6:.0f} Mbit/s beside a marked stream, {alone * 8e-6:.0f} alone"
    for counted in (sent, received):  # payload plus headers
        assert marked <= counted["1:20"] < marked * 1.1, counted
        assert (4 << 20) <= counted["1:10"] < (5 << 20), counted
    assert "class htb 1:1 root rate 50Mbit ceil 50Mbit" in classes, classes
    assert "class htb 1:20 parent 1:1 prio 1 rate 500Kbit ceil 50Mbit" in classes, classes


def test_qos_needs_a_shaped_link():
    with pytest.raises(ConfigError, match="link"):
        netns.Network.create(qos=True)
    with pytest.raises(ConfigError, match="link='1gbit'"):
        LocalCluster(2, network="netns", qos=True)


@needs_netns
def test_a_replacement_host_is_reachable_at_once_at_the_same_address():
    """Its MAC follows from its address, so its peers' neighbour entries for the old machine
    still hold (with a random MAC they pointed at the dead one for ~45 s)."""
    net = netns.Network.create(link="1gbit")
    try:
        for h in (0, 1):
            net.add_host(h)
        mac = subprocess.run(
            ["ip", "-n", net.namespace(0), "-o", "link", "show", "eth0"], capture_output=True, text=True
        ).stdout
        assert net.mac(0) in mac and net.mac(0) != net.mac(1)
        assert _stream(net, 1, 0, 1 << 20) > 0  # host 1 knows host 0's MAC now
        net.remove_host(0)
        net.add_host(0)
        t0 = time.monotonic()
        assert _stream(net, 1, 0, 1 << 20, timeout=5.0) > 0
        assert time.monotonic() - t0 < 5
    finally:
        net.destroy()


_CRASHING_OWNER = textwrap.dedent("""
    import os, sys
    from gemini_ckpt.testing import netns
    net = netns.Network.create(link="1gbit")
    net.add_host(0)
    sleeper = net.exec(0, ["sleep", "600"])
    print(net.index, net.namespace(0), sleeper.pid, flush=True)
    sys.stdin.read()   # killed here, never destroyed
""")


@needs_netns
def test_what_a_killed_owner_left_is_removed_by_the_next_create_and_nothing_else():
    owner = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    index, space, sleeper = owner.stdout.readline().split()
    foreign = f"gckforeign{os.getpid()}"  # a namespace no state file names: never ours to touch
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert space in _names(f"gck{index}h")[0] and _running(sleeper)
        net = netns.Network.create()
        try:
            assert _gone(f"gck{index}h") == (set(), set())
            assert not _running(sleeper), "the left-behind host's processes were not killed"
            assert foreign in _names("gckforeign")[0]
        finally:
            net.destroy()
    finally:
        subprocess.run(["ip", "netns", "del", foreign])
        owner.kill()


_RAY_HOSTS = textwrap.dedent("""
    import json, time, ray
    from gemini_ckpt.testing.cluster import LocalCluster
    cluster = LocalCluster(2, network="netns", link="1gbit", namespace="netns-test").start()
    out = {"index": cluster.net.index}
    try:
        where = ray.remote(num_cpus=0)(lambda: ray.util.get_node_ip_address())
        out["addresses"] = ray.get([where.options(resources={f"host{i}": 0.01}).remote() for i in range(2)],
                                   timeout=60)
        out["expected"] = [cluster.host_address(i) for i in range(2)]
        t0 = time.monotonic()
        cluster.remove_hosts((1,), timeout=30)
        out["dead_after_s"] = time.monotonic() - t0
        cluster.add_host(1)
        out["back"] = ray.get(where.options(resources={"host1": 0.01}).remote(), timeout=60)
    finally:
        cluster.shutdown()
    print("RESULT", json.dumps(out), flush=True)
""")


@needs_netns
@pytest.mark.ray
def test_ray_hosts_run_inside_their_namespaces_and_a_lost_host_is_known_dead_fast():
    done = subprocess.run([sys.executable, "-c", _RAY_HOSTS], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    out = json.loads(line[len("RESULT ") :])
    assert out["addresses"] == out["expected"]
    assert out["back"] == out["expected"][1]
    # the host's processes die but its namespace answers (connection refused), as on loopback
    assert out["dead_after_s"] < 10, out
    assert _gone(f"gck{out['index']}") == (set(), set())
