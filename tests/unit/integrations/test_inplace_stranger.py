"""A stranger on the round store's network (issue 61, 3): a process that reaches the store's port
but does not hold the run's secret writes what it likes there while the ranks train; nothing it
writes starts a recovery, revokes a rank, cuts a connection or ends the run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gemini_ckpt.integrations import _bounds, _rounds
from rounds_support import WORLD, Job

# ``python -c STRANGER PORT SECONDS``: everything the audit did to the store, every 50 ms, using
# only what anyone who reaches the port can do (list, read, set, add).
STRANGER = r"""
import datetime, re, sys, time
import torch.distributed as dist
port, seconds = int(sys.argv[1]), float(sys.argv[2])
P = "gemini/rounds/"
s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
end, writes = time.monotonic() + seconds, 0
while time.monotonic() < end:
    s.add(P + "latest", 1)  # ask for the next round
    s.set(P + "formed", "x")  # not a number: made the controller raise ValueError
    s.set(P + "gave_up", "forged: the ranks gave up")  # would end the run at the next start
    s.set(P + "finished", "7")
    writes += 4
    for key in s.list_keys():
        if key.endswith("/members") and key.startswith(P):
            for token in re.findall(r'"(i[0-9a-f]+)"', s.get(key).decode(errors="replace")):
                s.set(P + "revoked/" + token, "1")  # revoke every member it can read
                writes += 1
        elif "/listeners/" in key:
            s.set(key, "127.0.0.1|%d" % port)  # every rank would cut its own round-store connection
            writes += 1
    time.sleep(0.05)
print(writes)
"""


@pytest.mark.multiproc
def test_a_strangers_writes_to_the_round_store_start_no_recovery(tmp_path):
    job = Job(tmp_path, "pace@150")  # 30 steps of ~150 ms
    controller = _bounds.Attempts(max_stuck=3, max_starts=9)
    assert controller.start(job.store) is None  # the first group
    stranger = subprocess.Popen(
        [sys.executable, "-c", STRANGER, str(job.store.port), "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        codes = job.run(timeout=90)
    finally:
        out, err = stranger.communicate(timeout=30)
    assert stranger.returncode == 0 and int(out) > 100, err.decode()[-2000:]
    assert codes == {rank: 0 for rank in range(WORLD)}, {r: p.stderr.read()[-2000:] for r, p in job.procs.items()}
    lines = job.lines()
    for rank in range(WORLD):  # one process, one attempt, every step
        assert [x["event"] for x in lines[rank]] == ["start", "done"], lines[rank]
        assert lines[rank][1]["counter"] == 30.0 * WORLD
    assert job.replaced == []
    stderr = b"".join(p.stderr.read() for p in job.procs.values())
    assert b"holds a value this run did not write" in stderr  # said, once per key and process
    # The controller reads nothing the stranger wrote: no reason to end the run, no round asked
    # for after the first (its ~100 adds to ``latest`` included), none formed after it.
    assert _rounds.gave_up(job.store) == "" and _rounds.latest(job.store) == 1 and _rounds.formed(job.store) <= 1
    assert controller.start(job.store) is None  # its gave_up ended the run, its formed raised, before
