"""What a host store is told for an epoch (one builder). Ranks build it at their rendezvous from
their compiled settings; the registry builds it for a store without ranks (a replacement it
adopts) from the job settings the ranks sent. Before, the registry's own copy of the builder
left ``metrics`` out: a job with metrics off had its replacement's store publish them."""

from __future__ import annotations

import dataclasses

from gemini_ckpt import CheckpointConfig
from gemini_ckpt.hoststore.actors.state import EpochConfig, store_config
from gemini_ckpt.settings import compile_config

FACTS = dict(
    epoch=3,
    slot=1,
    nodes=("a" * 56, "b" * 56, "c" * 56),
    ranks_here=(1,),
    world_size=3,
    keep=2,
    timeout_s=45,
    dead=frozenset({2}),
    idle=frozenset(),
    committed=((2, 9),),
    secret="ab" * 16,
    domains=("r0", "r0", "r1"),
)


def test_every_setting_of_the_job_reaches_the_store_and_the_job_settings_are_plain_values():
    config = CheckpointConfig(
        namespace="told",
        replicas=3,
        placement="ring",
        replication_bandwidth=5 << 20,
        interleave="network",
        metrics=False,
        failure_domain="rack",
        keep_in_memory=2,
        signing_key=b"\x01\x02",
    )
    job = compile_config(config).store.job()
    assert job == {
        "replicas": 3,
        "strategy": "ring",
        "budget": None,
        "key": "0102",
        "bandwidth": 5 << 20,
        "domain": "rack",
        "interleave": "network",
        "metrics": False,
    }
    told = store_config(job, **FACTS)
    assert isinstance(told, EpochConfig)
    assert (told.replicas, told.strategy, told.key, told.bandwidth, told.interleave, told.metrics) == (
        3,
        "ring",
        "0102",
        5 << 20,
        "network",
        False,
    )
    assert (told.epoch, told.slot, told.world_size, told.timeout_s, told.dead, told.committed) == (
        3,
        1,
        3,
        45.0,
        frozenset({2}),
        ((2, 9),),
    )
    # the registry keeps the job settings and tells a replacement's store from them: the same answer
    adopted = store_config(dict(job), **{**FACTS, "ranks_here": (), "idle": frozenset({1})})
    assert dataclasses.replace(adopted, ranks_here=(1,), idle=frozenset()) == told


def test_job_settings_from_an_older_rank_fall_back_to_the_defaults():
    told = store_config({"replicas": 2}, **FACTS)  # a rank that sent fewer settings
    assert (told.strategy, told.key, told.bandwidth, told.interleave, told.metrics) == (
        "auto",
        None,
        None,
        "gate",
        True,
    )
