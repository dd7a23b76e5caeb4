"""A memory tier whose shards live in a directory every rank of a multi-process test can see.

For tests of several ranks without Ray (planning, resharding, persisting at world size > 1):
each rank writes its shard's plan, record and region as files and the version is committed
once every rank's record is there. Everything else (plans, records, checksums, views) is the
library's own code.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future

import numpy as np

from gemini_ckpt.errors import VersionNotFoundError
from gemini_ckpt.stores.views import MemoryVersion, ShardCopy
from gemini_ckpt.stores.base import Capabilities, MemoryTier, Outcome
from gemini_ckpt.format.segments import Segment
from gemini_ckpt.format.shards import ShardPlan, ShardRecord, make_record


class DirTier(MemoryTier):
    capabilities = Capabilities()

    def __init__(self, root: str, *, rank: int, world_size: int, timeout_s: float = 60.0) -> None:
        self.root, self.rank, self.world_size, self.timeout_s = root, rank, world_size, timeout_s
        os.makedirs(root, exist_ok=True)

    def _dir(self, step: int) -> str:
        return os.path.join(self.root, f"{step:09d}")

    def segment(self, plan: ShardPlan) -> Segment:
        return Segment(plan.region_bytes)

    def give_back(self, segment: Segment) -> None:
        segment.close()

    def record(self, step, plan, segment, blobs, verdict):
        """The shard's record, as a host store makes it: checksums, the tensor check, the verdict."""
        return make_record(plan, segment.array, blobs, epoch=0, step=step, verdict=verdict)

    def hand_off(self, step, plan, segment, blobs, *, persist=False, verdict=None) -> Future:
        record = self.record(step, plan, segment, blobs, verdict)
        d = self._dir(step)
        os.makedirs(d, exist_ok=True)
        for suffix, data in (
            ("plan", plan.encode()),
            ("region", segment.array.tobytes()),
            ("record", record.encode()),
        ):  # the record last: it marks the shard complete
            tmp = os.path.join(d, f"{self.rank}.{suffix}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(d, f"{self.rank}.{suffix}"))
        segment.close()
        deadline = time.monotonic() + self.timeout_s
        while step not in self.committed_steps():
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}: not every rank's shard arrived")
            time.sleep(0.05)
        fut: Future = Future()
        fut.set_result(Outcome(step, True, health=record.health))
        return fut

    def unpin(self, step: int) -> None:
        pass

    def discard(self, step: int) -> None:
        pass

    def committed_steps(self) -> list[int]:
        out = []
        for name in sorted(os.listdir(self.root)):
            if name.isdigit() and self._saved_world(os.path.join(self.root, name)):
                out.append(int(name))
        return out

    @staticmethod
    def _saved_world(d: str) -> int:
        """The world size the step was saved at, once every rank's record is there (else 0)."""
        try:
            with open(os.path.join(d, "0.record"), "rb") as f:
                world = ShardRecord.decode(f.read()).world_size
        except FileNotFoundError:
            return 0
        return world if all(os.path.exists(os.path.join(d, f"{r}.record")) for r in range(world)) else 0

    def open(self, step: int, *, key=None) -> MemoryVersion:
        if step not in self.committed_steps():
            raise VersionNotFoundError(f"step {step} is not in {self.root}")
        d = self._dir(step)
        plans, records, copies = {}, {}, {}
        for r in range(self._saved_world(d)):
            with open(os.path.join(d, f"{r}.plan"), "rb") as f:
                plans[r] = ShardPlan.decode(f.read(), key)
            with open(os.path.join(d, f"{r}.record"), "rb") as f:
                records[r] = ShardRecord.decode(f.read(), key)
            region = np.fromfile(os.path.join(d, f"{r}.region"), dtype=np.uint8)
            copies[r] = [ShardCopy("local", lambda o, n, region=region: region[o : o + n], d)]
        return MemoryVersion(step, plans, records, copies)
