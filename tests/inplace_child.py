"""A rank of the in-place rounds tests (no Ray): ``python inplace_child.py SCRIPT OUT`` with the
round store's environment set as the in-place backend sets it (``_rounds.worker_env``).

The training function, run under ``recoverable``: ``STEPS`` all-reduces of a counter over the
current round. ``SCRIPT`` says what goes wrong, once per rank and attempt: ``kill@R:I`` (rank R
SIGKILLs itself before all-reduce I of its first attempt), ``recv@R:P:I`` (rank R blocks in a
receive from rank P, a survivor, at step I: only a cut of the round's connections wakes it), ``raise@R``
(rank R raises a ValueError in every attempt), ``end@R`` (rank R raises a ValueError once
its training is done, after the others returned: an error in its last ``close()``), ``timeout@R`` (rank R raises
``TimeoutError("timed out")``, which reads like a peer's failure, in every attempt), ``fail@R:I`` (rank R's checkpointing fails before
all-reduce I of its first attempt: the BackgroundError a version that did not commit raises, which
names no peer), ``stop@R:I`` (rank R SIGSTOPs itself before all-reduce I of its first attempt: a
hung worker the controller replaces; resumed, it is the replaced worker's zombie), ``pace@MS`` (each
step takes MS milliseconds). Each attempt appends a JSON line to ``OUT/<rank>``:
pid, round, attempt, and how it ended.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from gemini_ckpt.errors import BackgroundError
from gemini_ckpt.integrations._inplace_worker import Session, recoverable

STEPS = 30
script, out = sys.argv[1], sys.argv[2]
# ``pace@MS``: each step takes MS milliseconds more (a run long enough for something to happen meanwhile)
PACE_S = next((int(r[5:]) / 1000 for r in script.split(",") if r.startswith("pace@")), 0.02)
rank = int(os.environ["RANK"])
fresh = os.environ.get("GEMINI_TEST_FRESH", "1") == "1"  # a first worker, not a replacement
attempt = {"n": 0}


def note(**fields) -> None:
    with open(os.path.join(out, str(rank)), "a") as f:
        f.write(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "round": Session.current().round,
                    "attempt": attempt["n"],
                    "t": time.time(),
                    **fields,
                }
            )
            + "\n"
        )


def train() -> int:
    attempt["n"] += 1
    note(event="start")
    counter = torch.zeros(1)
    for i in range(STEPS):
        for rule in script.split(","):
            what, _, where = rule.partition("@")
            if what == "kill" and fresh and attempt["n"] == 1 and where == f"{rank}:{i}":
                note(event="kill")
                os.kill(os.getpid(), signal.SIGKILL)
            if what == "stop" and fresh and attempt["n"] == 1 and where == f"{rank}:{i}":
                note(event="stop")
                os.kill(os.getpid(), signal.SIGSTOP)
                note(event="resumed")
            if (
                what == "recv"
                and attempt["n"] == 1
                and where.split(":")[0] == str(rank)
                and i == int(where.split(":")[2])
            ):
                note(event="blocked")
                dist.recv(torch.zeros(1), src=int(where.split(":")[1]))
            if what == "fail" and fresh and attempt["n"] == 1 and where == f"{rank}:{i}":
                note(event="fail")
                raise BackgroundError(
                    f"rank {rank}: version {i} was not committed: CheckpointError: slot {rank}: "
                    f"the host store of slot 1 died"
                )
            if what == "raise" and where == str(rank) and i == 3:
                note(event="raise")
                raise ValueError("the user's code fails here")
            if what == "timeout" and where == str(rank) and i == 3:  # reads like a peer's failure
                note(event="raise")
                raise TimeoutError("timed out")
        one = torch.ones(1)
        dist.all_reduce(one)
        counter += one
        time.sleep(PACE_S)
    note(event="done", counter=float(counter.item()))
    if f"end@{rank}" in script.split(","):
        time.sleep(0.5)  # the others have returned
        raise ValueError("the user's code fails after the last step")
    return 0


if __name__ == "__main__":
    session = Session.current()
    session.ensure_formed()
    recoverable(train)()
    dist.destroy_process_group()
