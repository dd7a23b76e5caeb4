"""A GCS stopped (SIGSTOP) for longer than the host stores' lease, on a cluster of its own (issue
40, finding 5): a host store that holds a committed version must outlive the stall, in the same
process, and still serve that version afterwards. Run by tests/integration/hoststore/test_gcs_stall.py
in its own process: it starts and stops its own Ray."""

from __future__ import annotations

import os
import signal
import sys
import time

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tier_contract import save_filled  # noqa: E402

from gemini_ckpt import CheckpointConfig  # noqa: E402
from gemini_ckpt.hoststore.client import connect  # noqa: E402
from gemini_ckpt.settings import store_settings  # noqa: E402
from gemini_ckpt.hoststore.cluster import start_host_stores  # noqa: E402
from gemini_ckpt.testing.cluster import LocalCluster  # noqa: E402


def main(stall_s: float) -> None:
    cluster = LocalCluster(1, head_cpus=0, namespace="gcs_stall").start()
    try:
        config = CheckpointConfig(namespace="gcs-stall", replicas=1, timeout_s=60)
        stores = start_host_stores(config)  # the head's (the driver's, rank 0's) and host 0's
        tier = connect(store_settings(config), rank=0, world_size=1)
        save_filled(tier, 1, 3.0)
        assert cluster.node_id(0) in stores and len(stores) == 2
        pids = ray.get([s.__ray_call__.remote(lambda self: os.getpid()) for s in stores.values()], timeout=60)
        gcs = cluster.cluster.head_node.all_processes["gcs_server"][0].process.pid
        print(f"store pids {pids}, GCS pid {gcs}: stopping the GCS for {stall_s:.0f}s", flush=True)
        os.kill(gcs, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < stall_s:
                time.sleep(1)
                if not all(_runs(p) for p in pids):
                    print(f"STORE ENDED {time.monotonic() - t0:.1f}s into the stall", flush=True)
                    break
        finally:
            os.kill(gcs, signal.SIGCONT)
        alive = [_runs(p) for p in pids]
        print(f"after the stall the store processes run: {alive}", flush=True)
        assert all(alive)
        same = ray.get([s.__ray_call__.remote(lambda self: os.getpid()) for s in stores.values()], timeout=60)
        steps = tier.committed_steps()
        print(f"store pids after: {same}; committed steps: {steps}", flush=True)
        assert same == pids and steps == [1], (same, steps)
        view = tier.open(1)
        view.close()
        print("OK", flush=True)
    finally:
        cluster.shutdown()


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    main(float(sys.argv[1]))
