"""Failure domains at runtime: ``CheckpointConfig.failure_domain``, the domain-aware holders rule
(:func:`gemini_ckpt.hoststore.slots.holders_for`, the one rule the client, the host stores, recovery,
the commit simulator and the chaos predictor use), ``placement`` with the same domains, and the
chaos harness's ``kill-rack`` (pure: no Ray cluster)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest

import placement
from gemini_ckpt import CheckpointConfig, ConfigError
from gemini_ckpt.chaos import ChaosConfig, RemoveHosts, Scenario, At, ScenarioError, full_matrix, ci_matrix, kill_rack
from gemini_ckpt.chaos import plan_scenario
from gemini_ckpt.hoststore.slots import SlotTable, holders_for, node_domains, placement_for, unlabelled
import paths

ROOT = paths.ROOT
RACKS = ["0", "0", "1", "1"]


def _unseen(*labels: str) -> list[str]:
    """``labels`` made unique to the calling test: each domain warning is given once per process
    (and a placement is computed once), so a test that wants one uses a layout no other test did."""
    tag = uuid.uuid4().hex[:8]
    return [f"{label}-{tag}" for label in labels]


def _holders(*, replicas=2, strategy="group", domains=None, dead=()):
    hosts = len(domains or RACKS)
    return {
        s: holders_for(s, hosts=hosts, replicas=replicas, strategy=strategy, domains=domains, dead=dead)
        for s in range(hosts)
        if s not in dead
    }


# --- config -----------------------------------------------------------------------------------------
def test_failure_domain_is_a_label_name_or_none():
    assert CheckpointConfig().failure_domain is None
    assert CheckpointConfig(failure_domain="rack").failure_domain == "rack"
    for bad in ("", "  ", 3, ["rack"]):
        with pytest.raises(ConfigError, match=r"CheckpointConfig.failure_domain .*--labels rack="):
            CheckpointConfig(failure_domain=bad)


# --- the holders rule ---------------------------------------------------------------------------------
def test_every_shard_has_a_copy_in_each_rack():
    held = _holders(domains=RACKS)
    assert held == {0: (0, 2), 1: (1, 3), 2: (2, 0), 3: (3, 1)}
    assert all(len({RACKS[h] for h in hs}) == 2 for hs in held.values())
    # without domains (or with every slot its own domain) exactly the rule of before
    assert _holders() == _holders(domains=["a", "b", "c", "d"]) == {0: (0, 1), 1: (1, 0), 2: (2, 3), 3: (3, 2)}
    assert _holders(domains=None) == _holders()


def test_ring_and_mixed_spread_too_and_a_lost_rack_leaves_a_copy_of_every_shard():
    racks = ["a", "a", "a", "b", "b", "b"]
    for strategy in ("ring", "mixed", "group"):
        held = _holders(domains=racks, strategy=strategy)
        assert all(len({racks[h] for h in hs}) == 2 for hs in held.values()), (strategy, held)
        p = placement_for(hosts=6, replicas=2, strategy=strategy, domains=racks)
        assert {s: p.holders(s) for s in range(6)} == held  # what the planner sees is what the stores do
        assert placement.survives(p, failed={0, 1, 2}) and placement.survives(p, failed={3, 4, 5})


def test_a_dead_holder_is_replaced_in_another_rack():
    racks = ["0", "0", "0", "1", "1", "1"]
    base = _holders(domains=racks)
    dead = {h for h in base[0] if h != 0}  # slot 0's copy in rack 1
    held = _holders(domains=racks, dead=dead)
    assert all(len({racks[h] for h in hs}) == 2 for hs in held.values()), held
    # the next live slot after the owner in ring order, skipping the owner's own rack
    (other,) = dead
    assert held[0] == (0, min(h for h in range(1, 6) if racks[h] == "1" and h != other))
    # deterministic: every rank computes the same
    assert held == _holders(domains=racks, dead=dead)


def test_fewer_domains_than_replicas_warns_once_and_falls_back(caplog):
    with caplog.at_level(logging.WARNING, logger="gemini_ckpt"):
        domains = _unseen("a", "a", "a", "a")
        held = _holders(domains=domains)
        _holders(domains=domains)
    assert held == _holders()  # the rule without domains
    warnings = [r.getMessage() for r in caplog.records if "failure domains" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"only 1 domain(s) ({domains[0]})" in warnings[0] and "lower replicas" in warnings[0]


def test_a_lost_rack_leaves_too_few_live_domains_warns_and_falls_back(caplog):
    with caplog.at_level(logging.WARNING, logger="gemini_ckpt"):
        racks = _unseen(*RACKS)
        held = _holders(domains=racks, dead={2, 3})
        _holders(domains=racks, dead={2, 3})
    assert held == {0: (0, 1), 1: (1, 0)}
    warnings = [r.getMessage() for r in caplog.records if "failure domains" in r.getMessage()]
    assert len(warnings) == 1 and f"only 1 domain(s) with live hosts ({racks[0]})" in warnings[0], warnings


def test_uneven_domains_warn_naming_the_clashing_slots(caplog):
    with caplog.at_level(logging.WARNING, logger="gemini_ckpt"):
        placement_for(hosts=4, replicas=2, strategy="group", domains=_unseen("a", "a", "a", "b"))
    assert any("keeps the copies of slot(s)" in r.getMessage() for r in caplog.records)


def test_nodes_without_the_label_are_their_own_domain():
    labels = {"n0": {"rack": "x"}, "n1": {"rack": "x"}, "n2": {}, "n3": {"rack": "y"}}
    domains = node_domains(["n0", "n1", "n2", "n3"], labels, "rack")
    assert domains == ("x", "x", None, "y")
    assert node_domains(["n0"], labels, None) is None
    assert "slot 2 (node n2) has no 'rack' node label" in unlabelled(["n0", "n1", "n2", "n3"], domains, "rack")
    assert unlabelled(["n0", "n1"], ("x", "x"), "rack") == ""
    held = _holders(domains=list(domains))
    assert held[0][1] in (2, 3) and held[1][1] in (2, 3)  # slot 2 is not rack x


def test_the_slot_table_carries_domains_and_reads_a_table_without_them():
    old = SlotTable.from_registry("ns", {"nodes": ["a", "b"], "epoch": 3, "ranks": {}})
    assert old.domains is None
    new = SlotTable.from_registry("ns", {"nodes": ["a", "b"], "epoch": 3, "ranks": {}, "domains": ["r1", None]})
    assert new.domains == ("r1", None)


# --- placement CLI with the same domains ---------------------------------------------------------------
def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "placement", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_placement_cli_with_domains_draws_what_the_library_does():
    out = _cli("show", "--hosts", "4", "--replicas", "2", "--strategy", "group", "--domains", "0,0,1,1", "--json")
    assert out.returncode == 0, out.stderr
    shown = {int(h): tuple(v) for h, v in json.loads(out.stdout)["holders"].items()}
    assert shown == _holders(domains=RACKS)
    report = _cli(
        "report", "--hosts", "4", "--replicas", "2", "--strategy", "group", "--domains", "0,0,1,1", "--failed", "2,3"
    )
    assert report.returncode == 0, report.stderr
    assert "LOST" not in report.stdout and "host 2: read from host 0" in report.stdout


def test_the_advisor_no_longer_says_the_library_cannot_spread():
    advice = placement.advise(hosts=16, domain_size=4, domain_mtbf_h=20000)
    assert not any("cannot spread" in n for n in advice.notes)
    assert any("failure_domain" in n for n in advice.notes), advice.notes


# --- chaos: kill-rack, predicted with the same placement -----------------------------------------------
def test_kill_rack_is_in_the_matrix_and_predicted_from_memory():
    cfg = ChaosConfig(domains=("0", "0", "1", "1"))
    racks = [s for s in full_matrix(cfg) if s.name.startswith("kill-rack-")]
    assert [s.name for s in racks] == ["kill-rack-0", "kill-rack-1"]
    assert [s.name for s in ci_matrix(cfg) if s.name.startswith("kill-rack-")] == ["kill-rack-0", "kill-rack-1"]
    assert racks[1].removed_hosts() == (2, 3) and "kill rack 1" in racks[1].describe()
    for s in racks:
        cfg.check(s)
        assert plan_scenario(s, cfg).outcome == "memory", plan_scenario(s, cfg).reason
    # without domains the same loss takes both copies of a group: the durable tier
    plain = Scenario(name="lose-2-3", at=racks[1].at, faults=(RemoveHosts((2, 3)),))
    assert plan_scenario(plain, ChaosConfig()).outcome == "durable"
    assert not [s for s in full_matrix(ChaosConfig()) if s.name.startswith("kill-rack-")]


def test_kill_rack_must_be_the_whole_domain():
    cfg = ChaosConfig(domains=("0", "0", "1", "1"))
    assert kill_rack(cfg.domains, "1") == RemoveHosts((2, 3), domain="1")
    with pytest.raises(ScenarioError, match="no host is in domain"):
        kill_rack(cfg.domains, "9")
    half = Scenario(name="half", at=At(step=1), faults=(RemoveHosts((2,), domain="1"),))
    with pytest.raises(ScenarioError, match="not every host of domain"):
        cfg.check(half)
    with pytest.raises(ScenarioError, match="one non-empty label per host"):
        ChaosConfig(domains=("0", "1"))
    assert cfg.host_labels(3) == {"rack": "1"} and ChaosConfig().host_labels(3) == {}


# --- the commit protocol with the same rule --------------------------------------------------------------
def test_the_commit_simulator_with_domains_commits_across_racks_after_a_store_dies():
    from gemini_ckpt.testing.commit_sim import Simulator

    plans = []

    def rule(slot, dead):  # the placement rule the stores use, as the simulator is given it
        plans.append(held := holders_for(slot, hosts=4, replicas=2, strategy="group", dead=dead, domains=RACKS))
        return held

    sim = Simulator(hosts=4, replicas=2, holders=rule, seed=3)
    assert sim.run_version(0).outcome is True
    assert sorted(plans) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    plans.clear()
    sim.kill(2)
    report = sim.run_version(1)
    assert report.outcome is True and report.acknowledged
    assert sorted(plans) == [(0, 3), (1, 3), (3, 1)]  # host 0's copy stays in rack 1
