"""What the in-place rounds tests share: a round's membership, written as the backend writes it,
and :class:`Job`, the controller's part over plain processes (``inplace_child.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from gemini_ckpt.integrations import _members, _rounds
import paths


def world(**ranks: int) -> _members.Membership:
    """A membership of the incarnations named, each at its rank (one per node)."""
    return _members.membership({t: (r, 0, 1, r) for t, r in ranks.items()})


HERE = str(paths.TESTS)
CHILD = os.path.join(HERE, "inplace_child.py")
WORLD = 3


class Job:
    """The controller's part: a round store, and a new round for every start of workers."""

    def __init__(
        self,
        tmp_path,
        script: str,
        *,
        reform_s: float = 60.0,
        grace_s: float = _rounds.GRACE_S,
        notice_s: float = 0.0,
        max_stuck: int = 3,
    ) -> None:
        self.store = _rounds.server("127.0.0.1", timeout_s=30)
        self.out = str(tmp_path)
        self.script = script
        self.reform_s, self.grace_s, self.max_stuck = reform_s, grace_s, max_stuck
        self.notice_s = notice_s  # how long after a death the controller finds it (Ray Train's polls)
        self.dead_at: dict[int, float] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.replaced: list[int] = []
        self.tokens = {rank: _rounds.new_token(self.store) for rank in range(WORLD)}
        first = self.open()
        for rank in range(WORLD):
            self.start(rank, first, fresh=True)

    def open(self) -> int:
        """A new round with the current incarnations as members (as the backend's on_start does)."""
        return _rounds.open_round(
            self.store, _members.membership({t: (r, r, WORLD, 0) for r, t in self.tokens.items()})
        )

    def start(self, rank: int, round_: int, *, fresh: bool) -> None:
        env = dict(
            os.environ,
            GEMINI_TEST_FRESH="1" if fresh else "0",
            **_members.worker_env(
                host="127.0.0.1",
                port=self.store.port,
                round_=round_,
                rank=rank,
                world_size=WORLD,
                local_rank=rank,
                local_world_size=WORLD,
                node_rank=0,
                backend="gloo",
                timeout_s=120,
                reform_timeout_s=self.reform_s,
                token=self.tokens[rank],
                secret=self.store.secret,
                grace_s=self.grace_s,
                max_stuck=self.max_stuck,
            ),
        )
        self.procs[rank] = subprocess.Popen(
            [sys.executable, CHILD, self.script, self.out], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def run(self, timeout: float = 120.0) -> dict[int, int]:
        """Replace every rank that dies until all have ended; returns each rank's exit code."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        while len(codes) < WORLD:
            assert time.monotonic() < deadline, f"the job did not end in {timeout}s: {self.lines()}"
            for rank, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None or rank in codes:
                    continue
                if code == -9:  # killed: Ray Train shuts it down and starts a replacement at the same rank
                    if time.monotonic() - self.dead_at.setdefault(rank, time.monotonic()) < self.notice_s:
                        continue
                    del self.dead_at[rank]
                    _rounds.revoke(self.store, self.tokens[rank])  # as the in-place backend's on_shutdown does
                    _rounds.worker_failed(self.store)
                    self.replaced.append(rank)
                    self.tokens[rank] = _rounds.new_token(self.store)
                    self.start(rank, self.open(), fresh=False)
                else:
                    codes[rank] = code
            time.sleep(0.05)
        return codes

    def replace_hung(self, rank: int, *, resume_after_s: float) -> subprocess.Popen:
        """Rank ``rank`` stopped: replace it as the controller does a hung worker whose process it
        could not end, and resume the stopped process ``resume_after_s`` later (a zombie)."""
        deadline = time.monotonic() + 60
        while not any(x["event"] == "stop" for x in self.lines()[rank]):
            assert time.monotonic() < deadline, self.lines()
            time.sleep(0.05)
        zombie = self.procs[rank]
        _rounds.revoke(self.store, self.tokens[rank])  # as the backend's on_shutdown does
        _rounds.worker_failed(self.store)
        self.tokens[rank] = _rounds.new_token(self.store)
        self.start(rank, self.open(), fresh=False)
        time.sleep(resume_after_s)
        os.kill(zombie.pid, signal.SIGCONT)
        return zombie

    def lines(self) -> dict[int, list[dict]]:
        out = {}
        for rank in range(WORLD):
            path = os.path.join(self.out, str(rank))
            out[rank] = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
        return out
