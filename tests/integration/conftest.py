"""The one Ray cluster of the integration tier: a head node (no CPUs) plus ``HOSTS`` simulated
hosts (:class:`gemini_ckpt.testing.cluster.LocalCluster`, each labelled ``rack=i // 2``), started once per
session.

Every test module gets the cluster whole (hosts a previous module removed are added back) and
leaves no gemini_ckpt actor behind (``sweep`` after each module). Tests add and remove hosts
only from the main thread.

The session heals: after every test, a host that Ray declared dead although no test removed it
(a false death on a loaded machine, a crashed raylet) is replaced, and the test that saw it is
named, with the cluster's state, in its report and in the session's "cluster incidents" summary,
so one incident cannot fail every test after it.
"""

from __future__ import annotations

import sys

import pytest

HOSTS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    import ray_helpers
    import watch
    from gemini_ckpt.testing.cluster import LocalCluster

    # Hosts 0, 1 in rack "0", hosts 2, 3 in rack "1" (only jobs with failure_domain="rack" look).
    cluster = LocalCluster(HOSTS, head_cpus=0, namespace="gemini_tests", labels=lambda i: {"rack": str(i // 2)}).start()
    # Rank actors cannot import tests/ (not on their path): ship the support module by value.
    ray.cloudpickle.register_pickle_by_value(ray_helpers)
    watch.describe = cluster.describe
    try:
        yield cluster
    finally:
        watch.describe = None
        cluster.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _whole_cluster(request, ray_cluster):
    """Each module starts with every host present and ends without leftover host stores."""
    import ray

    ray_cluster.ensure_hosts()  # and replaces hosts that died unasked
    module = sys.modules.get(request.module.__name__)
    if module is not None:
        ray.cloudpickle.register_pickle_by_value(module)  # its rank-side functions travel by value too
    yield
    ray_cluster.sweep()


@pytest.fixture(autouse=True)
def _healthy_cluster(request, ray_cluster):
    """Replace hosts that died without the test asking (see the module docstring)."""
    import watch

    yield
    dead = ray_cluster.unasked_deaths()
    if not dead:
        return
    state = ray_cluster.describe()
    ray_cluster.heal()
    message = (
        f"{request.node.nodeid}: hosts {dead} were declared dead by Ray although no test removed them; "
        f"replaced. The cluster before the replacement:\n{state}"
    )
    watch.incidents.append(message)
    watch.say("CLUSTER INCIDENT " + message)
    request.node.add_report_section("teardown", "cluster incident", message)


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    """One training rank per host (:class:`ray_helpers.Ranks`), shared by a module's tests."""
    from ray_helpers import Ranks

    group = Ranks(HOSTS)
    yield group
    group.teardown()
    group.kill()
