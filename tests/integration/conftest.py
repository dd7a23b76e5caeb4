"""The one Ray cluster of the integration tier: a head node (no CPUs) plus ``HOSTS`` simulated
hosts (:class:`gemini_ckpt.ray.local.LocalCluster`), started once per session.

Every test module gets the cluster whole (hosts a previous module removed are added back) and
leaves no gemini_ckpt actor behind (``sweep`` after each module). Tests add and remove hosts
only from the main thread.
"""

from __future__ import annotations

import sys

import pytest

HOSTS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    import ray_helpers
    from gemini_ckpt.ray.local import LocalCluster

    cluster = LocalCluster(HOSTS, head_cpus=0, namespace="gemini_tests").start()
    # Rank actors cannot import tests/ (not on their path): ship the support module by value.
    ray.cloudpickle.register_pickle_by_value(ray_helpers)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _whole_cluster(request, ray_cluster):
    """Each module starts with every host present and ends without leftover host stores."""
    import ray

    ray_cluster.ensure_hosts()
    module = sys.modules.get(request.module.__name__)
    if module is not None:
        ray.cloudpickle.register_pickle_by_value(module)  # its rank-side functions travel by value too
    yield
    ray_cluster.sweep()


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    """One training rank per host (:class:`ray_helpers.Ranks`), shared by a module's tests."""
    from ray_helpers import Ranks

    group = Ranks(HOSTS)
    yield group
    group.teardown()
    group.kill()
