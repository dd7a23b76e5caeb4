"""Fuzzing: truncations, byte flips and crafted pickles of any file of the newest
durable version, and of the shard records and plans a memory tier keeps as bytes, never run
code, and the older version is restored.
"""

from __future__ import annotations

import random
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from gemini_ckpt import CheckpointConfig, Checkpointer
from gemini_ckpt.durable.tier import DurableTier
from gemini_ckpt.stores.views import MemoryVersion
from gemini_ckpt.stores.memory import LocalTier
from gemini_ckpt.format.shards import ShardPlan, ShardRecord
from gemini_ckpt.toy import lm_loss
from forge import forge_item, reseal
from helpers import local_tier
from toy_jobs import copy_versions
from trust_support import EXTRA_KEY, JOBS, METADATA, NEWEST, Evil, evil_pickle, torch_saved

# fixtures (a redundant alias: pytest finds them here, ruff sees them used)
from trust_support import versions as versions


# --- 4. fuzz ---------------------------------------------------------------------------------------
def _fuzz_cases(root: Path, rng: random.Random, pwned: Path):
    """(name, mutate(root)) for every file of the newest version and ``latest``: truncations at
    sampled lengths, byte flips at sampled offsets, crafted pickles with CRCs recomputed."""
    files = sorted(p.name for p in (root / NEWEST).iterdir()) + ["latest"]
    for name in files:
        path = lambda r, n=name: r / "latest" if n == "latest" else r / NEWEST / n
        size = path(root).stat().st_size
        for keep in sorted({0, 1, size // 3, size - 1, rng.randrange(size)}):
            yield f"{name}:truncate@{keep}", (lambda r, p=path, k=keep: p(r).write_bytes(p(r).read_bytes()[:k]))
        for offset in sorted({0, size - 1, *(rng.randrange(size) for _ in range(4))}):
            bit = 1 << rng.randrange(8)

            def flip(r, p=path, o=offset, b=bit):
                data = bytearray(p(r).read_bytes())
                data[o] ^= b
                p(r).write_bytes(bytes(data))

            yield f"{name}:flip@{offset}^{bit}", flip
        for how in ("system", "eval"):
            if name == METADATA:
                yield (
                    f"{name}:crafted-{how}",
                    (
                        lambda r, h=how: (
                            (r / NEWEST / METADATA).write_bytes(evil_pickle(pwned, h)),
                            reseal(r / NEWEST),
                        )
                    ),
                )
            elif name.endswith(".distcp"):
                yield (
                    f"{name}:crafted-extra-{how}",
                    (lambda r, h=how: forge_item(r / NEWEST, EXTRA_KEY, torch_saved(evil_pickle(pwned, h)))),
                )
                yield (
                    f"{name}:crafted-rng-{how}",
                    (lambda r, h=how: forge_item(r / NEWEST, "rank_local.0.rng", torch_saved(Evil(pwned, h)))),
                )
            else:
                yield f"{name}:crafted-{how}", (lambda r, p=path, h=how: p(r).write_bytes(evil_pickle(pwned, h)))


def test_fuzz_damage_to_any_file_never_runs_code_and_restores_the_older_version(versions, tmp_path):
    rng, pwned = random.Random(13), tmp_path / "pwned"
    t0, n = time.perf_counter(), 0
    for name, mutate in _fuzz_cases(versions[0], rng, pwned):
        root = copy_versions(versions, tmp_path)
        mutate(root)
        intact = DurableTier(str(root)).verify(1) == []
        # Only damage to ``latest`` leaves step 1 good (restore does not need ``latest``).
        assert intact == name.startswith("latest"), name
        result, extra, params = JOBS.restore(root)
        assert not pwned.exists(), name
        expected = 1 if intact else 0
        assert result is not None and result.step == expected, name
        assert tuple(result.skipped_steps) == (() if intact else (1,)), name
        assert extra == {"tokens": expected + 1}, name
        assert all(torch.equal(params[k], v) for k, v in versions[1][expected].items()), name
        shutil.rmtree(root)
        n += 1
    took = time.perf_counter() - t0
    print(f"\nfuzz: {n} durable cases in {took:.1f}s")
    assert n >= 40


def test_fuzz_shard_records_and_plans_held_in_memory(tmp_path):
    """The records and plans a memory tier keeps as bytes (as host stores do): truncations,
    flips and crafted pickles never run code; a damaged newest one means the older version is
    restored."""
    pwned, rng = tmp_path / "pwned", random.Random(7)
    t, extra, state = JOBS.state(0)
    tier = _EncodedTier()
    ckpt = Checkpointer(state, CheckpointConfig(store="local", keep_in_memory=5), store=tier)
    for step in range(2):
        lm_loss(t.model, next(t.batches())).backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        extra["tokens"] = step + 1
        ckpt.save(step)
    ckpt.close()
    cases = []
    for kind in ("record", "plan"):
        good = tier.encoded[(1, kind)]
        offsets = sorted({0, 5, 16, 20, len(good) - 1, *(rng.randrange(len(good)) for _ in range(10))})
        cases += [(kind, f"truncate@{k}", good[:k]) for k in (0, 10, 30, len(good) - 1)]
        cases += [(kind, f"flip@{o}", good[:o] + bytes([good[o] ^ 0x10]) + good[o + 1 :]) for o in offsets]
        cases += [(kind, "pickled", evil_pickle(pwned))]
    plan = ShardPlan.decode(tier.encoded[(1, "plan")])
    cases.append(("plan", "crafted-metadata", replace(plan, metadata=evil_pickle(pwned)).encode()))
    t0 = time.perf_counter()
    for kind, name, blob in cases:
        good = tier.encoded[(1, kind)]
        tier.encoded[(1, kind)] = blob
        t2, extra2, state2 = JOBS.state(9)
        reader = Checkpointer(state2, CheckpointConfig(store="local"), store=tier.reader())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = reader.restore()
        reader.close()
        tier.encoded[(1, kind)] = good
        assert not pwned.exists(), name
        assert result.step == 0 and tuple(result.skipped_steps) == (1,) and extra2 == {"tokens": 1}, (kind, name)
    print(f"\nfuzz: {len(cases)} memory-tier record/plan cases in {time.perf_counter() - t0:.1f}s")
    assert len(cases) >= 40


class _EncodedTier(LocalTier):
    """A memory tier that keeps each version's plan and record as bytes (as host stores do)
    and decodes them, checked, whenever a version is opened."""

    def __init__(self, base=None, encoded=None):
        base = base or local_tier(keep=5)
        super().__init__(base.store, base.epoch, base.keep)
        self.encoded: dict = encoded if encoded is not None else {}

    def _commit(self, step, plan, segment, blobs, persist):
        outcome = super()._commit(step, plan, segment, blobs, persist)
        view = super().open(step)
        self.encoded[(step, "plan")] = view.plans[0].encode()
        self.encoded[(step, "record")] = view.records[0].encode()
        return outcome

    def open(self, step, *, key=None):
        view = super().open(step)
        plan = ShardPlan.decode(self.encoded[(step, "plan")], key)
        record = ShardRecord.decode(self.encoded[(step, "record")], key)
        return MemoryVersion(step, {0: plan}, {0: record}, view.copies)

    def reader(self):
        """Another Checkpointer's view of the same versions (a new job, the same host)."""
        return _EncodedTier(self, self.encoded)
