"""A process that keeps shards or trains ends itself once its node is lost to the cluster.

A machine cut off from the cluster (a switch failure) is declared dead by the GCS and replaced;
when its link comes back, its old host store and rank processes must not live on beside the
replacement. Ray ends a worker whose raylet is gone (it checks the raylet's pid every second),
but in the chaos matrix under network namespaces (issue 24):

- once, a returning machine's raylet exited at once (the GCS told it it was dead), yet its host
  store and rank process ran on for more than 30 s and never logged Ray's shutdown;
- in most partitions every old process took 27-30 s after the link came back to end. A TCP
  connection whose packets were lost retransmits with exponential backoff (0.2 s doubling:
  ~25 s and ~51 s after the cut), so after a ~22 s outage nothing on the old machine hears from
  the GCS until the retransmission ~51 s after the cut, whatever the link does meanwhile.

:func:`fence_when_node_lost` starts one daemon thread that ends the process (``os._exit(1)``)
on the first of:

1. **The raylet is gone**: its pid (``RAY_RAYLET_PID``, which Ray gives every worker) no longer
   runs, is a zombie, or is another process now. Checked every second; needs no network.
2. **The GCS lists this node dead** (asked every :data:`ASK_EVERY_S`): a GCS never brings a dead
   node back.
3. **The lease ran out**: no answer from the GCS for longer than the GCS takes to declare a node
   dead (:func:`lease_s`, from Ray's own health-check settings). A live GCS has given the node up
   by then, so the process would only be fenced later. Only time this process was running
   counts: a process that was stopped or starved for a minute does not wake up to a spent lease.
   With Ray's default settings the lease (77 s) is longer than Ray's own limit on a worker that
   cannot reach the GCS (60 s), so it changes nothing there; it matters where the cluster
   declares deaths fast (``LocalCluster``: 15 s, lease 22 s). Under GCS fault tolerance a GCS
   restart that takes longer than the lease ends the stores: raise the health-check settings
   (which is what makes a node's death slow to declare) rather than ignore the GCS.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

import ray

log = logging.getLogger("gemini_ckpt")

TICK_S = 1.0
"""How often the thread looks at the raylet and the lease."""
ASK_EVERY_S = 3.0
"""How often it asks the GCS whether this node is still alive (the whole node table, ~1 KB per
node: fine at tens of hosts; at thousands a subscription to node changes would be the way)."""
LEASE_SLACK_S = 3.0
"""Slack on top of the lease's margin (a slow answer, the GCS's own jitter)."""
LEASE_MARGIN_S = ASK_EVERY_S + TICK_S + LEASE_SLACK_S
"""Added to the GCS's time to declare a node dead. The GCS counts from its last health check,
the fence from its last answer, which may be a question, a tick and a slow answer older."""


def lease_s() -> float:
    """How long without an answer from the GCS means this node is surely declared dead: the GCS
    fails a node after ``health_check_failure_threshold`` checks in a row, one every
    ``health_check_period_ms``, each allowed ``health_check_timeout_ms`` (Ray's settings, as the
    cluster was started with them), plus :data:`LEASE_MARGIN_S`."""
    from ray._raylet import Config

    period, timeout = Config.health_check_period_ms() / 1e3, Config.health_check_timeout_ms() / 1e3
    declared = Config.health_check_initial_delay_ms() / 1e3 + Config.health_check_failure_threshold() * (period + timeout)
    return declared + LEASE_MARGIN_S


def process_identity(pid: int) -> Optional[str]:
    """The start time of ``pid`` while it runs, None once it has exited (no such process, or a
    zombie). Raises OSError when that cannot be told (out of file descriptors, say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]  # starttime (field 22 of stat)


class Fence:
    """The three checks of the module docstring, one step at a time (``step(now)``); what the
    thread runs. ``ask()`` is True when the GCS lists this node dead, False when alive, and
    raises when the GCS cannot be reached."""

    def __init__(self, what: str, ask: Callable[[], bool], *, raylet_pid: Optional[int], lease: float,
                 exit: Callable[[str], None]) -> None:
        self.what, self.ask, self.lease, self._exit = what, ask, lease, exit
        self.raylet_pid = raylet_pid
        self.raylet_identity: Optional[str] = None
        self.child_of_raylet = False  # this process's parent is the raylet (as a Ray worker's is)
        if raylet_pid:
            try:
                self.raylet_identity = process_identity(raylet_pid)
            except OSError as exc:
                log.warning("%s: the raylet (pid %d) cannot be looked at (%s); fenced by the GCS only", what,
                            raylet_pid, exc)
            if self.raylet_identity is None:
                log.warning("%s: the raylet (pid %d) is not running; fenced by the GCS only", what, raylet_pid)
            self.child_of_raylet = os.getppid() == raylet_pid
        self.silent_s = 0.0  # running time since the GCS last answered
        self._asked_at: Optional[float] = None
        self._answer = threading.Event()  # set by the asking thread on each answer
        self._dead = False
        self._asking = False
        self._errors = 0

    def raylet_gone(self) -> bool:
        if self.raylet_identity is None:
            return False
        if self.child_of_raylet and os.getppid() != self.raylet_pid:
            return True  # orphaned: the raylet exited (whatever now runs under its pid)
        try:
            return process_identity(self.raylet_pid) != self.raylet_identity
        except OSError:
            return False  # cannot tell (out of fds?): not a reason to end a store

    def _ask_once(self) -> None:
        dead = None
        try:
            dead = self.ask()
        except Exception:  # noqa: BLE001 - an unreachable GCS: the lease runs on
            pass
        finally:
            if dead is not None:
                self._dead = dead
                self._answer.set()
            self._asking = False

    def idle(self) -> bool:
        """No question in flight (tests wait for it)."""
        return not self._asking

    def step(self, now: float, elapsed: float) -> Optional[str]:
        """Why this process must end now, or None. ``elapsed``: running time since the last step."""
        if self.raylet_gone():
            return f"its raylet (pid {self.raylet_pid}) is gone"
        if self._answer.is_set():
            self._answer.clear()
            self.silent_s = 0.0
            if self._dead:
                return "the cluster declared this node dead"
        else:
            self.silent_s += min(elapsed, 2 * TICK_S)  # a stopped or starved process does not spend its lease
            if self.silent_s > self.lease:
                return f"no answer from the GCS for {self.silent_s:.0f}s (the lease: {self.lease:.0f}s)"
        if not self._asking and (self._asked_at is None or now - self._asked_at >= ASK_EVERY_S):
            self._asking, self._asked_at = True, now  # an unanswered call may hang: it gets its own thread
            try:
                threading.Thread(target=self._ask_once, name="gemini-fence-ask", daemon=True).start()
            except BaseException:
                self._asking = False
                raise
        return None

    def run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            try:
                why = self.step(now, now - last)
            except Exception as exc:  # noqa: BLE001 - no thread to spare, say: the fence goes on
                why = None
                self._errors += 1
                if self._errors in (1, 10, 100) or self._errors % 1000 == 0:
                    log.warning("%s: the fence's check failed (%s: %s; %d times)", self.what, type(exc).__name__,
                                exc, self._errors)
            last = now
            if why is not None:
                self._exit(why)
                return


def _exit(what: str, node_id: str) -> Callable[[str], None]:
    def end(why: str) -> None:
        log.error("%s on node %s: %s; exiting (fenced)", what, node_id[:12], why)
        os._exit(1)  # no logging.shutdown(): a handler's lock held by a stuck thread must not keep us
    return end


def declared_dead(nodes: list[dict], node_id: str) -> bool:
    """Whether ``nodes`` (``ray.nodes()``) says ``node_id`` is dead: listed dead, or no longer
    listed at all (dropped from the GCS's table of dead nodes) while others are."""
    mine = [n for n in nodes if n["NodeID"] == node_id]
    return bool(nodes) and (not mine or not all(n["Alive"] for n in mine))


def fence_when_node_lost(what: str) -> threading.Thread:
    """End this process (``os._exit(1)``) once its node is lost to the cluster (see the module
    docstring). ``what`` names the process in the log line it leaves."""
    node_id = ray.get_runtime_context().get_node_id()
    pid = os.environ.get("RAY_RAYLET_PID", "")

    fence = Fence(what, lambda: declared_dead(ray.nodes(), node_id), raylet_pid=int(pid) if pid.isdigit() else None, lease=lease_s(),
                  exit=_exit(what, node_id))
    thread = threading.Thread(target=fence.run, name="gemini-fence", daemon=True)
    thread.start()
    return thread
