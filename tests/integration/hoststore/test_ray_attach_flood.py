"""On the cluster: another local process floods a host store's abstract
attach socket with connects (the audit's four connect loops made 4 of 5 job restarts fail with
``AttachError ... [Errno 11] Resource temporarily unavailable``). Every restart of the job must
still attach and commit: the trainer's connect retries a full queue until its deadline
(``gemini_ckpt.hoststore.attach_client.connect_until``). With a single try instead (the code before
the fix) this test fails."""

from __future__ import annotations


import pytest
import ray

from attach_flood_support import kill_flooders, start_flooders, stop_flooders
from ray_helpers import node_id_of_host

RESTARTS = 3
FLOODERS = 4


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.ci  # four busy flooders take both cores for a minute: CI runs it after the default suite
def test_every_restart_attaches_and_commits_while_local_processes_flood_the_attach_socket(ray_cluster, ranks):
    from gemini_ckpt import CheckpointConfig
    from gemini_ckpt.hoststore.names import find_store

    namespace = "attach-flood"
    ranks.restart(namespace)
    assert all(r[0]["committed"] for r in ranks.train([0])), "the job before the flood"
    store = find_store(CheckpointConfig(namespace=namespace).resolved_namespace, node_id_of_host(0))
    address = ray.get(store.__ray_call__.remote(lambda self: self.attach_server.address), timeout=60)
    assert address.startswith("\0gemini-ckpt-")
    flooders = start_flooders(address[1:], 240, FLOODERS, held=256)
    try:
        failed = []
        for restart in range(1, RESTARTS + 1):
            ranks.restart(namespace)
            out = ranks.train([restart])
            failed += [(restart, rank, r[0]["error"]) for rank, r in enumerate(out) if not r[0]["committed"]]
        assert all(f.poll() is None for f in flooders), "a flooder stopped early: the flood was not on throughout"
        stop_flooders(flooders)
        assert not failed, f"{len(failed)} rank-restarts of {RESTARTS * len(out)} failed under the flood: {failed[:3]}"
    finally:
        kill_flooders(flooders)
