"""The failure-injection harness without Ray: scenarios are validated, predictions follow the
planner, the fate of the version in flight, the report, the CLI listing, the rendezvous
store. (The scenarios themselves run in ``tests/integration/tools/test_chaos.py``.)"""

from __future__ import annotations

import argparse
import json

import pytest

import placement
from gemini_ckpt.chaos import (
    CI_SCENARIOS,
    At,
    ChaosConfig,
    Check,
    CorruptReplica,
    DurableUnreachable,
    DurableWriteOutage,
    FlappingLink,
    KillStore,
    KillWorker,
    MatrixReport,
    NanInState,
    PartitionHost,
    RemoveHosts,
    Scenario,
    ScenarioError,
    ScenarioResult,
    SlowLink,
    add_chaos_command,
    ci_matrix,
    full_matrix,
    plan_scenario,
    versions_after,
)
from helpers import listening
from gemini_ckpt.testing.ranks import Rendezvous
from gemini_ckpt.chaos._scenarios import CI_NETWORK_SCENARIOS

CONFIG = ChaosConfig()  # 4 hosts, replicas 2, steps 0..5, persisted 1, 3, 5


def test_scenarios_are_validated_with_the_field_and_the_fix():
    with pytest.raises(ScenarioError, match="only on the coordinator: use rank=0"):
        At(step=3, phase="commit", rank=1)
    with pytest.raises(ScenarioError, match="is not a phase"):
        At(step=3, phase="flush")
    with pytest.raises(ScenarioError, match="names a host twice"):
        RemoveHosts((1, 1))
    with pytest.raises(ScenarioError, match="non-empty word"):
        Scenario(name="two words", at=At(step=1))
    with pytest.raises(ScenarioError, match="not persisted.*needs one of \\[1, 3, 5\\]"):
        CONFIG.check(Scenario(name="x", at=At(step=2, phase="persist")))
    with pytest.raises(ScenarioError, match="leaves no step to continue"):
        CONFIG.check(Scenario(name="x", at=At(step=5)))
    with pytest.raises(ScenarioError, match="includes removed hosts"):
        CONFIG.check(Scenario(name="x", at=At(step=2), faults=(RemoveHosts((3,), replace=False),)))


def test_every_matrix_scenario_is_valid_and_pairs_follow_the_planner():
    scenarios = full_matrix(CONFIG)
    assert len({s.name for s in scenarios}) == len(scenarios)
    assert [s.name for s in ci_matrix(CONFIG)] == list(CI_SCENARIOS)
    for s in scenarios:
        CONFIG.check(s)
        pred = plan_scenario(s, CONFIG)
        if s.name.startswith("pair-"):
            p = placement.make(s.placement, hosts=4, replicas=2)
            survives = placement.survives(p, s.failed_slots())
            assert (pred.outcome, pred.step) == (("memory", 2) if survives else ("durable", 1)), s.name
    preds = {s.name: plan_scenario(s, CONFIG).label() for s in scenarios}
    # Mixed with replicas dividing hosts is group placement: the same predictions.
    assert all(preds[f"pair-mixed-{a}-{b}"] == preds[f"pair-group-{a}-{b}"] for a in range(4) for b in range(a + 1, 4))
    assert [k for k, v in preds.items() if k.startswith("pair-ring") and v.startswith("durable")] == [
        "pair-ring-0-1",
        "pair-ring-0-3",
        "pair-ring-1-2",
        "pair-ring-2-3",
    ]
    expected = {
        "kill-worker-replicate": "memory@2",  # the version in flight is never committed
        "kill-store-commit": "memory@2",
        "kill-worker-committed": "memory@3",
        "remove-host-persist": "memory@3",  # committed; its persist dies with the coordinator
        "group-lost-during-persist": "durable@1",  # the persist cannot read the lost group's shards
        "durable-write-outage": "durable@1",  # the failed persist of step 3 does not count
        "durable-outage-recovers": "durable@3",
        "durable-unreachable-memory-ok": "memory@2",
        "durable-unreachable-group-lost": "error",
        "corrupt-durable": "durable@1",  # step 3's bad file is skipped
        "corrupt-replica-local": "memory@2",  # the peer's copy is good
        "corrupt-replica-only-copy-left": "memory@1",
        "resize-after-loss": "memory@2",
        "nan-in-optimizer-state": "memory@2",  # step 3 is unhealthy: never restored
        "nan-in-replica-after-commit": "memory@2",  # the other holder's copy is good
    }
    assert {k: preds[k] for k in expected} == expected
    nan = plan_scenario(next(s for s in scenarios if s.name == "nan-in-optimizer-state"), CONFIG)
    assert nan.memory_steps == (1, 2) and nan.durable_steps == (1,)  # 3 is neither kept nor persisted


def test_an_unhealthy_version_is_never_a_candidate_nor_counted():
    p = placement.make("group", hosts=4, replicas=2)
    s = Scenario(name="x", at=At(step=3), conditions=(NanInState(rank=2),), faults=(RemoveHosts((2, 3)),))
    v = versions_after(s, CONFIG, committed=[0, 1, 2, 3], persisted=[1, 3], p=p, hosts=(0, 1, 2, 3))
    assert (v.committed, v.persisted) == ((1, 2), (1,))
    assert plan_scenario(s, CONFIG).label() == "durable@1"  # group 2-3 lost; step 3 never persisted
    with pytest.raises(ScenarioError, match="phase='step'"):
        CONFIG.check(Scenario(name="x", at=At(step=3, phase="replicate", rank=1), conditions=(NanInState(),)))
    with pytest.raises(ScenarioError, match="outside 4 ranks"):
        CONFIG.check(Scenario(name="x", at=At(step=3), conditions=(NanInState(rank=4),)))


def test_the_fate_of_the_version_in_flight_follows_phase_and_fault():
    p = placement.make("group", hosts=4, replicas=2)
    hosts = (0, 1, 2, 3)

    def fate(phase, faults, rank=0, step=3):
        s = Scenario(name="x", at=At(step=step, phase=phase, rank=rank), faults=faults)
        v = versions_after(s, CONFIG, committed=[0, 1, 2], persisted=[1], p=p, hosts=hosts)
        return v.committed, v.persisted

    assert fate("replicate", (KillWorker((1,)),), rank=1) == ((1, 2), (1,))
    assert fate("replicate", (CorruptReplica(),), rank=1) == ((2, 3), (1, 3))  # nothing died: it commits
    assert fate("committed", (KillWorker((1,)),), rank=1) == ((2, 3), (1, 3))  # rank 0 still persists it
    assert fate("persist", (KillWorker((0,)),)) == ((2, 3), (1,))
    assert fate("persist", (KillStore((1,)),)) == ((2, 3), (1, 3))  # written from the other holder
    assert fate("persist", (RemoveHosts((2, 3)),)) == ((2, 3), (1,))  # shards 2, 3 have no copy left
    s = Scenario(name="x", at=At(step=3, phase="persist"), conditions=(DurableWriteOutage((3,)),))
    assert versions_after(s, CONFIG, committed=[0, 1, 2], persisted=[1], p=p, hosts=hosts).persisted == (1,)


def test_report_table_and_json(tmp_path):
    s = Scenario(name="demo", at=At(step=2), faults=(RemoveHosts((0, 1)),), conditions=(DurableUnreachable(),))
    good = ScenarioResult(
        scenario=s,
        prediction=plan_scenario(s, CONFIG),
        observed={"outcome": "error", "step": None},
        checks=[Check("prediction", True, "ok")],
        recovery_s=3.21,
    )
    bad = ScenarioResult(
        scenario=Scenario(name="other", at=At(step=2)),
        prediction=None,
        observed={"outcome": "memory", "step": 1},
        steps_lost=1,
        checks=[Check("prediction", False, "predicted memory@2; observed memory@1")],
    )
    report = MatrixReport(results=[good, bad], config=CONFIG, seconds=12.0)
    table = report.format_table()
    lines = table.splitlines()
    assert lines[0].split() == ["scenario", "predicted", "observed", "steps", "lost", "recovery", "s", "verdict"]
    assert lines[2].split() == ["demo", "error", "error", "-", "3.2", "PASS"]
    assert lines[3].split() == ["other", "-", "memory@1", "1", "-", "MISMATCH"]
    assert "other: prediction: predicted memory@2; observed memory@1" in table
    assert report.exit_code == 1 and not report.ok
    path = tmp_path / "r.json"
    report.write_json(str(path))
    doc = json.loads(path.read_text())
    assert doc["ok"] is False and doc["counts"] == {"MISMATCH": 1, "PASS": 1}
    assert doc["scenarios"][0]["predicted"]["outcome"] == "error"
    assert doc["scenarios"][1]["checks"][0] == {
        "name": "prediction",
        "ok": False,
        "detail": "predicted memory@2; observed memory@1",
    }


def test_cli_lists_the_matrix(capsys):
    parser = argparse.ArgumentParser()
    add_chaos_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chaos", "--matrix", "ci", "--list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    from gemini_ckpt.chaos._inplace import CI_SCENARIOS as CI_INPLACE

    assert [line.split()[0] for line in out] == list(CI_SCENARIOS) + list(CI_INPLACE)
    args = parser.parse_args(["chaos", "--matrix", "inplace", "--list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and all(line.startswith("inplace-") and "in place:" in line for line in out)
    args = parser.parse_args(["chaos", "--list", "-k", "pair-ring-*"])
    assert args.func(args) == 0
    assert len(capsys.readouterr().out.splitlines()) == 6
    args = parser.parse_args(["chaos", "--steps", "3"])
    assert args.func(args) == 2  # too few steps for the matrix: a clear error, nothing started


def test_an_infrastructure_failure_is_its_own_verdict_and_fails_the_run():
    s = Scenario(name="x", at=At(step=2))
    infra = ScenarioResult(scenario=s, error="InfraError: rank 1 (host 1): rendezvous failed", infra=True)
    other = ScenarioResult(scenario=Scenario(name="y", at=At(step=2)), error="HarnessError: no commit")
    ok = ScenarioResult(scenario=Scenario(name="z", at=At(step=2)), checks=[Check("prediction", True)])
    report = MatrixReport(results=[infra, other, ok], config=CONFIG)
    assert [r.verdict for r in report.results] == ["INFRA-ERROR", "ERROR", "PASS"]
    assert report.counts() == {"INFRA-ERROR": 1, "ERROR": 1, "PASS": 1} and report.exit_code == 1
    table = report.format_table()
    assert "x: infrastructure error (not a verdict on the library): InfraError" in table
    assert report.to_json()["scenarios"][0]["verdict"] == "INFRA-ERROR"


def test_the_rendezvous_port_is_bound_by_its_store_from_the_start():
    """No port is found free, released and bound again later: the store binds port 0 and
    holds the port the kernel gave it until ``close``."""
    import datetime

    import torch.distributed as dist

    rendezvous = Rendezvous(world_size=2, timeout_s=10)
    host, port = rendezvous.address
    try:
        assert port > 0 and listening(port)
        client = dist.TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client
    finally:
        rendezvous.close()
    assert rendezvous.closed and not listening(port)


# --- the network scenarios (ChaosConfig.network="netns") -----------------------------------------------
NETNS = ChaosConfig(network="netns", link="1gbit")
NETWORK = ("partition-host", "partition-during-persist", "slow-link", "flapping-link")


def test_network_scenarios_join_the_matrix_only_with_their_own_links():
    assert not [s for s in full_matrix(CONFIG) if s.needs_network()]
    assert [s.name for s in ci_matrix(CONFIG)] == list(CI_SCENARIOS)  # CI needs no root
    scenarios = {s.name: s for s in full_matrix(NETNS)}
    assert [n for n in scenarios if scenarios[n].needs_network()] == list(NETWORK)
    assert [s.name for s in ci_matrix(NETNS)] == list(CI_SCENARIOS) + list(CI_NETWORK_SCENARIOS)
    for name in NETWORK:
        NETNS.check(scenarios[name])
        with pytest.raises(ScenarioError, match="needs ChaosConfig.network='netns'"):
            CONFIG.check(scenarios[name])


def test_network_settings_and_faults_are_validated_with_the_field_and_the_fix():
    with pytest.raises(ScenarioError, match="network='wifi'.*loopback, netns"):
        ChaosConfig(network="wifi")
    with pytest.raises(ScenarioError, match="needs network='netns'"):
        ChaosConfig(link="1gbit")
    with pytest.raises(ScenarioError, match="ChaosConfig.link.*as tc does"):
        ChaosConfig(network="netns", link="fast")
    with pytest.raises(ScenarioError, match="SlowLink.rate"):
        SlowLink(rate="slow")
    with pytest.raises(ScenarioError, match="positive number of seconds"):
        PartitionHost(1, seconds=0)
    with pytest.raises(ScenarioError, match="not a short outage.*PartitionHost"):
        FlappingLink(down_s=20.0)
    with pytest.raises(ScenarioError, match="outside 4 hosts"):
        NETNS.check(Scenario(name="x", at=At(step=2), conditions=(SlowLink(host=4),)))


def test_a_partitioned_host_is_planned_as_a_lost_one():
    scenarios = {s.name: s for s in full_matrix(NETNS)}
    cut = scenarios["partition-host"]
    assert cut.partitioned_hosts() == (1,) and cut.failed_slots() == {1} and cut.dead_ranks((0, 1, 2, 3)) == {1}
    assert cut.restart_hosts is None and cut.destructive()  # on a replacement
    preds = {name: plan_scenario(scenarios[name], NETNS) for name in NETWORK}
    # Group placement: host 1's copies live on host 0 too, so memory holds every shard.
    assert {k: v.label() for k, v in preds.items()} == {
        "partition-host": "memory@2",
        "partition-during-persist": "memory@3",
        "slow-link": "memory@2",
        "flapping-link": "memory@2",
    }
    assert preds["partition-host"].tier == "memory" and preds["partition-host"].failed_slots == (1,)
    # Cut off while step 3 is persisted: rank 0 lives and every shard keeps a live copy, so the
    # durable version is expected whole; with host 1's whole group cut off it is expected absent.
    p = placement.make("group", hosts=4, replicas=2)
    v = versions_after(
        scenarios["partition-during-persist"], NETNS, committed=[0, 1, 2], persisted=[1], p=p, hosts=(0, 1, 2, 3)
    )
    assert (v.committed, v.persisted) == ((2, 3), (1, 3))
    both = Scenario(
        name="x", at=At(step=3, phase="persist"), faults=(PartitionHost(2), PartitionHost(3)), restart_hosts=(0, 1)
    )
    v = versions_after(both, NETNS, committed=[0, 1, 2], persisted=[1], p=p, hosts=(0, 1, 2, 3))
    assert v.persisted == (1,) and plan_scenario(both, NETNS).label() == "durable@1"


def test_cli_takes_the_network_and_lists_its_scenarios(capsys):
    parser = argparse.ArgumentParser()
    add_chaos_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chaos", "--network", "netns", "--link", "1gbit", "--list", "-k", "*link*"])
    assert args.func(args) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["slow-link", "flapping-link"]
    args = parser.parse_args(["chaos", "--link", "1gbit", "--list"])
    assert args.func(args) == 2  # a link rate without namespaces: a clear error
    assert "needs network='netns'" in capsys.readouterr().err


def test_the_rendezvous_binds_and_advertises_the_address_it_is_given():
    rendezvous = Rendezvous(world_size=1, timeout_s=10, host="127.0.0.1")
    try:
        assert rendezvous.address[0] == "127.0.0.1" and listening(rendezvous.address[1])
    finally:
        rendezvous.close()


def test_the_elastic_below_min_end_is_read_from_the_controllers_own_failure():
    """Ray Train raises the controller's failure wrapped in ControllerError: the check reads the
    wrapped error's type, so the designed end passes and any other end is a mismatch."""
    from ray.train.v2.api.exceptions import ControllerError

    from gemini_ckpt.chaos._elastic import SCENARIOS, check
    from gemini_ckpt.errors import RecoveryGaveUpError

    below = next(s for s in SCENARIOS if s.world is None)
    designed = ControllerError(RecoveryGaveUpError("2 worker(s) left, below ScalingConfig min_workers=3"))
    assert check(below, designed, [], failure=1.0).verdict == "PASS"
    for other in (ControllerError(RuntimeError("min_workers")), RecoveryGaveUpError("3 recoveries in a row"), None):
        assert check(below, other, [], failure=1.0).verdict == "MISMATCH"


def test_two_elastic_recoveries_of_one_version_at_one_size_are_two():
    """A shrink to 3 restores step 7; a host lost as the run grows back shrinks it to 3 again,
    restoring step 7 again: two recoveries of 3 ranks each (they were read as one of "6 of 3")."""
    from gemini_ckpt.chaos._elastic import SCENARIOS, check

    during_grow = next(s for s in SCENARIOS if s.name == "elastic-loss-during-grow")
    events = [{"kind": "start", "rank": r, "pid": 10 + r, "unix": 0.0, "world": 4} for r in range(4)]
    events += [{"kind": "commit", "step": 7, "unix": 0.5}, {"kind": "saved_full", "step": 7, "world": 4, "digest": "d"}]
    for t in (2.0, 9.0):  # failure at 1.0; the second recovery's ranks are the first's processes
        events += [
            {"kind": "restore", "rank": r, "pid": 10 + r, "unix": t, "world": 3, "step": 7, "source": "memory"}
            for r in range(3)
        ]
        events += [{"kind": "step", "rank": 0, "step": 8, "unix": t + 1.0}]
    events += [{"kind": "restored_full", "step": 7, "world": 3, "digest": "d"}]
    res = check(during_grow, None, events, failure=1.0)
    assert res.verdict == "PASS", [(c.name, c.detail) for c in res.checks if c.ok is False]
    assert sum(c.name.endswith("one version, from memory") for c in res.checks) == 2
    assert res.recovery_s == 2.0  # the first recovery's next step


def test_the_late_replacement_scenario_accepts_either_outcome_of_the_lost_ranks_race():
    """Host 1 lost, its replacement after the survivors' wait: the survivors end and every worker is
    replaced, or (the lost host's rank reached the next round before it died) they all wait for the
    replacement and keep their processes. Anything in between is a mismatch."""
    from types import SimpleNamespace

    from gemini_ckpt.chaos._inplace import SCENARIOS, check

    scenario = next(s for s in SCENARIOS if s.name == "inplace-host-lost-late-replacement")
    outcome = SimpleNamespace(return_value={"digest": "d"})

    def events(kept: set[int]) -> list[dict]:
        out = [{"kind": "start", "rank": r, "pid": 10 + r, "unix": 1.0} for r in range(4)]
        out += [{"kind": "commit", "step": 7, "unix": 90.0}, {"kind": "step", "step": 7, "unix": 90.0}]
        out += [{"kind": "start", "rank": r, "pid": 10 + r if r in kept else 20 + r, "unix": 130.0} for r in range(4)]
        out += [{"kind": "restore", "rank": r, "step": 7, "source": "memory", "unix": 131.0} for r in range(4)]
        return out + [{"kind": "step", "step": 8, "unix": 132.0}]

    def verdict(kept: set[int]) -> str:
        return check(scenario, outcome, events(kept), 100.0, "d", 4, settled=100.5).verdict

    assert verdict(set()) == "PASS"
    assert verdict({0, 2, 3}) == "PASS"
    assert verdict({0}) == "MISMATCH"
