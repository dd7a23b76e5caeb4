"""A Ray node inside a simulated host's network namespace (``LocalCluster(network="netns")``).

``ray start --block`` runs inside the namespace (:meth:`gemini_ckpt.testing.netns.Network.exec`)
with the host's own address, joins the head on the bridge, and the raylet, the workers and
the host store it starts all live there. Losing the machine is SIGKILL to every process in
the namespace and the namespace removed (:meth:`NetnsNode.kill`). Nodes start one at a
time: two raylets starting at once in one Ray session race for the same socket names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..errors import NetworkUnavailable
from .netns import Network

START_TIMEOUT_S = 90.0


def _ray_cli() -> str:
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise NetworkUnavailable("the 'ray' command is not installed beside this Python; pip install ray")
    return found


class NetnsNode:
    """Simulated host ``host``'s Ray node, started by :meth:`start`; ``node_id`` is its Ray node id."""

    def __init__(self, net: Network, host: int, process: subprocess.Popen, log_path: str) -> None:
        self.net, self.host, self.process, self.log_path = net, host, process, log_path
        self.node_id: Optional[str] = None

    @classmethod
    def start(
        cls,
        net: Network,
        host: int,
        *,
        address: str,
        cpus: int,
        resources: dict,
        labels: dict,
        object_store_bytes: int,
        timeout: float = START_TIMEOUT_S,
    ) -> "NetnsNode":
        """Make host ``host``'s namespace and start its node; returns once Ray lists it alive."""
        import ray

        if host in net.hosts():
            net.remove_host(host)  # what a lost machine left: a replacement starts clean
        ip = net.add_host(host)
        argv = [
            _ray_cli(),
            "start",
            "--block",
            "--address",
            address,
            "--node-ip-address",
            ip,
            "--num-cpus",
            str(cpus),
            "--resources",
            json.dumps(resources),
            "--labels",
            ",".join(f"{k}={v}" for k, v in labels.items()),
            "--object-store-memory",
            str(object_store_bytes),
            "--disable-usage-stats",
        ]
        log_path = os.path.join(tempfile.gettempdir(), f"gemini_ckpt-{net.namespace(host)}.log")
        # Inside a namespace the host's one interface is eth0: gloo's pairs (which otherwise use
        # the address the hostname resolves to, not in the namespace) go over it.
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
        with open(log_path, "w") as log_file:
            process = net.exec(
                host,
                argv,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        node = cls(net, host, process, log_path)
        deadline = time.monotonic() + timeout
        while node.node_id is None:
            node.node_id = next(
                (n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip), None
            )
            if node.node_id is not None:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                tail = Path(log_path).read_text(errors="replace")[-2000:]
                node.kill()
                why = (
                    f"exited with {process.returncode}"
                    if process.returncode is not None
                    else f"did not join within {timeout:.0f}s"
                )
                raise NetworkUnavailable(
                    f"host {host}'s Ray node in namespace {net.namespace(host)} {why}; "
                    f"its log ({log_path}) ends:\n{tail}"
                )
            time.sleep(0.1)
        return node

    def raylet_pid(self) -> int:
        for pid in self.net.pids(self.host):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    return pid
            except OSError:
                continue
        raise LookupError(f"host {self.host} has no raylet running")

    def kill(self) -> None:
        """The machine is lost: every process in its namespace killed (the namespace stays until
        a replacement is started or the network is destroyed, :meth:`Network.kill`)."""
        self.net.kill(self.host)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
