"""One small actor per node of an in-place job, which ends a failed training worker at once.

Ray Train replaces a worker that stopped answering its health checks (a stopped or wedged
process) by asking it to shut down, waiting 5 s, then ``ray.kill``, which waits another few
seconds for a graceful exit before the raylet kills it: ten seconds during which the bundle
is not free for its replacement and the survivors stay blocked on it. The in-place backend asks
this actor, already running on the worker's node, to SIGKILL the process as soon as Ray Train
decides to replace it.

Standard library only, so the actor starts in about a second and costs a bare Ray worker.
"""

from __future__ import annotations

import os
import signal

WORKER_TITLE = b"RayTrainWorker"  # Ray Train's worker actors carry it in their process title


class Reaper:
    """Kills this node's Ray Train workers on request (and nothing else)."""

    def kill(self, pid: int) -> str:
        """SIGKILL ``pid`` if it is one of this user's Ray Train worker processes on this node;
        returns what happened."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
            return "refused: not a worker pid"
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read(4096)
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return "gone"
        if WORKER_TITLE not in title or owner != os.getuid():
            return "refused: not a Ray Train worker of this user"
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return "gone"
        return "killed"

    def ping(self) -> bool:
        return True
