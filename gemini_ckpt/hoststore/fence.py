"""A process that keeps shards or trains ends itself once its node is lost to the cluster.

A machine cut off from the cluster (a switch failure) is declared dead by the GCS and replaced;
when its link comes back, its old host store and rank processes must not live on beside the
replacement. Ray's own checks were not enough under partitions (docs/chaos.md, "fenced": what
was seen, and TCP's retransmission backoff that keeps a returning machine deaf for a while).

:func:`fence_when_node_lost` starts one daemon thread that ends the process (``os._exit(1)``)
on the first of:

1. **The raylet is gone**: its pid (``RAY_RAYLET_PID``, which Ray gives every worker) no longer
   runs, is a zombie, or is another process now. Checked every second; needs no network.
2. **The GCS lists this node dead** (asked every :data:`ASK_EVERY_S`): a GCS never brings a dead
   node back.
3. **The lease ran out, and the GCS's machine does not answer either**: no answer from the GCS
   for longer than the GCS takes to declare a node dead (:func:`lease_s`, from Ray's own
   health-check settings). A live GCS has given the node up by then, so the process would only
   be fenced later. Only time this process was running counts: a process that was stopped or
   starved for a minute does not wake up to a spent lease. With Ray's default settings the
   lease (77 s) is longer than Ray's own limit on a worker that cannot reach the GCS (60 s), so
   it changes nothing there; it matters where the cluster declares deaths fast
   (``LocalCluster``: 15 s, lease 22 s).

   A silent GCS is not always a lost node: a GCS that is stopped, starved or restarting is
   silent to every node at once, and ending every host store then would lose every in-memory
   version together. So when the lease runs out the fence takes a second look
   (:func:`second_look`) on fresh connections: a TCP connection to the GCS's address, then the
   same question on a new GCS client. The GCS answering decides (dead: end; alive: renew). The
   GCS's machine answering while the GCS does not (connected, or refused) means the GCS is what
   is silent: serve on, warning once, until Ray's own limit (:func:`limit_s`). No answer at all
   is a partition: end. The look runs on a thread of its own, so the raylet is still watched.

The question of check 2 is about this node only (the GCS's ``CheckAlive``, a few bytes), not
the whole node table, so it stays small on a large cluster.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

import ray

log = logging.getLogger("gemini_ckpt")

TICK_S = 1.0
"""How often the thread looks at the raylet and the lease."""
ASK_EVERY_S = 3.0
"""How often it asks the GCS whether this node is still alive (this node only: a few bytes)."""
ASK_TIMEOUT_S = 2 * ASK_EVERY_S
"""How long one question may wait for its answer (an unanswered one counts as silence)."""
PROBE_TIMEOUT_S = 2.0
"""How long the fresh connection to the GCS's machine may take to be answered (connected or
refused): a round trip within a cluster is well under a millisecond, a SYN lost to a partition
is retried only after 1 s."""
RAY_RECONNECT_S = 60.0
"""Ray's default ``gcs_rpc_server_reconnect_timeout_s``: how long Ray's own processes wait for a
GCS that does not answer before they exit."""
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
    declared = Config.health_check_initial_delay_ms() / 1e3 + Config.health_check_failure_threshold() * (
        period + timeout
    )
    return declared + LEASE_MARGIN_S


def limit_s(lease: float) -> float:
    """How long a process may serve on while the GCS is silent but its machine answers: the
    longer of ``lease`` and Ray's own reconnect limit (``RAY_gcs_rpc_server_reconnect_timeout_s``,
    60 s by default), plus :data:`LEASE_MARGIN_S`. By then Ray's own processes on this node have
    given the GCS up."""
    raw = os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", "")
    try:
        reconnect = float(raw) if raw else RAY_RECONNECT_S
    except ValueError:
        reconnect = RAY_RECONNECT_S
    return max(lease, reconnect) + LEASE_MARGIN_S


def head_answers(address: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Whether the machine at ``address`` (``host:port``, the GCS's) answers a fresh TCP
    connection within ``timeout``: how it answered (``connected``, ``refused``), or None (no
    answer: a timeout, an unreachable network or host; this node is cut off)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return "connected"
    except ConnectionRefusedError:
        return "refused"  # an RST came back: the machine is there, nothing listens (a GCS restarting)
    except (OSError, ValueError):
        return None


ALIVE, DEAD, STALLED, CUT_OFF = "alive", "dead", "stalled", "cut off"
"""What :func:`second_look` sees: the GCS answers (this node alive, or declared dead); the GCS's
machine answers but the GCS does not; nothing answers."""


def second_look(address: str, cluster_id: str, node_id: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """Past the lease, look again on fresh connections: the GCS's machine (:func:`head_answers`),
    then the GCS itself (a new client, ``CheckAlive`` for ``node_id``); see the module docstring."""
    how = head_answers(address, timeout)
    if how is None:
        return CUT_OFF
    if how == "refused":
        return STALLED  # the machine is there, its GCS is not listening: restarting
    try:
        from ray._raylet import InnerGcsClient, NodeID

        client = InnerGcsClient.standalone(address, cluster_id, int(timeout * 1000))
        alive = client.check_alive([NodeID.from_hex(node_id)], timeout=timeout)[0]
    except Exception:  # noqa: BLE001 - no answer in time (a stopped GCS), or a client that cannot be made
        return STALLED
    return ALIVE if alive else DEAD


def process_identity(pid: int) -> Optional[str]:
    """The start time of ``pid`` while it runs, None once it has exited (no such process, or a
    zombie). Raises OSError when that cannot be told (out of file descriptors, say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]  # starttime (field 22 of stat)


class Fence:
    """The three checks of the module docstring, one step at a time (``step(now)``); what the
    thread runs. ``ask()`` is True when the GCS lists this node dead, False when alive, and
    raises when the GCS cannot be reached. ``reach()`` (None: no such check, the lease alone
    decides) is the second look past the lease (:func:`second_look`): :data:`ALIVE`,
    :data:`DEAD`, :data:`STALLED` or :data:`CUT_OFF`; ``limit``: how long to serve on while the
    GCS is stalled (:func:`limit_s`)."""

    def __init__(
        self,
        what: str,
        ask: Callable[[], bool],
        *,
        raylet_pid: Optional[int],
        lease: float,
        exit: Callable[[str], None],
        reach: Optional[Callable[[], str]] = None,
        limit: Optional[float] = None,
    ) -> None:
        self.what, self.ask, self.lease, self._exit = what, ask, lease, exit
        self.reach, self.limit = reach, max(lease, limit if limit is not None else lease)
        self._probed_at: Optional[float] = None  # when the last second look began, this silence
        self._looking = False  # a second look is in flight (on its own thread: it takes seconds)
        self._seen: Optional[str] = None  # what the last second look saw, until a step takes it
        self.serving_on = False  # the lease ran out, but the GCS's machine answers: a stalled GCS
        self.raylet_pid = raylet_pid
        self.raylet_identity: Optional[str] = None
        self.child_of_raylet = False  # this process's parent is the raylet (as a Ray worker's is)
        if raylet_pid:
            try:
                self.raylet_identity = process_identity(raylet_pid)
            except OSError as exc:
                log.warning(
                    "%s: the raylet (pid %d) cannot be looked at (%s); fenced by the GCS only", what, raylet_pid, exc
                )
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
        """No question and no second look in flight (tests wait for it)."""
        return not self._asking and not self._looking

    def _look_once(self) -> None:
        seen = STALLED
        try:
            seen = self.reach()
        except Exception:  # noqa: BLE001 - second_look does not raise; another reach might: not a partition
            pass
        finally:
            self._seen, self._looking = seen, False

    def step(self, now: float, elapsed: float) -> Optional[str]:
        """Why this process must end now, or None. ``elapsed``: running time since the last step."""
        if self.raylet_gone():
            return f"its raylet (pid {self.raylet_pid}) is gone"
        if self._answer.is_set():
            self._answer.clear()
            if self.serving_on:
                log.warning("%s: the GCS answers again after %.0fs of silence", self.what, self.silent_s)
            self.silent_s, self._probed_at, self.serving_on, self._seen = 0.0, None, False, None
            if self._dead:
                return "the cluster declared this node dead"
        else:
            self.silent_s += min(elapsed, 2 * TICK_S)  # a stopped or starved process does not spend its lease
            if self.silent_s > self.lease:
                why = self._past_lease(now)
                if why is not None:
                    return why
        if not self._asking and (self._asked_at is None or now - self._asked_at >= ASK_EVERY_S):
            self._asked_at = now  # an unanswered call may hang: it gets its own thread
            self._in_thread("_asking", self._ask_once, "gemini-fence-ask")
        return None

    def _in_thread(self, flag: str, target: Callable[[], None], name: str) -> None:
        """Run ``target`` on a daemon thread with ``flag`` (an attribute) set until it clears it;
        if no thread can be started, the flag is cleared again and the error raised."""
        setattr(self, flag, True)
        try:
            threading.Thread(target=target, name=name, daemon=True).start()
        except BaseException:
            setattr(self, flag, False)
            raise

    def _past_lease(self, now: float) -> Optional[str]:
        """The lease ran out: why this process must end, or None while the second look finds
        the GCS alive or stalled (looked at again every :data:`ASK_EVERY_S`) and Ray's own
        limit is not reached."""
        silent = f"no answer from the GCS for {self.silent_s:.0f}s (the lease: {self.lease:.0f}s)"
        if self.reach is None:
            return silent
        if self.silent_s > self.limit:
            return f"{silent}; its machine answers, but Ray's own limit ({self.limit:.0f}s) is past"
        seen, self._seen = self._seen, None
        if seen is None:  # none yet: look (on its own thread, so the raylet is still watched each tick)
            if not self._looking and (self._probed_at is None or now - self._probed_at >= ASK_EVERY_S):
                self._probed_at = now
                self._in_thread("_looking", self._look_once, "gemini-fence-look")
            return None
        if seen == DEAD:
            return f"{silent}; asked on a new connection, the cluster declared this node dead"
        if seen == ALIVE:  # the old connection was stuck; a new one is answered: renewed
            log.warning("%s: %s, but the GCS answers a new connection: lease renewed", self.what, silent)
            self.silent_s, self._probed_at, self.serving_on = 0.0, None, False
            return None
        if seen != STALLED:
            return f"{silent}, and its machine does not answer a new connection either: this node is cut off"
        if not self.serving_on:
            self.serving_on = True
            log.warning(
                "%s: %s, but its machine answers a new connection: the GCS is stalled or restarting, "
                "not this node cut off. Serving on, up to Ray's own limit (%.0fs)",
                self.what,
                silent,
                self.limit,
            )
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
                    log.warning(
                        "%s: the fence's check failed (%s: %s; %d times)",
                        self.what,
                        type(exc).__name__,
                        exc,
                        self._errors,
                    )
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


def asker(node_id: str) -> Callable[[], bool]:
    """The question of check 2 for ``node_id``: the GCS's ``CheckAlive`` for this one node
    (False for a node it lists dead or no longer knows), with a deadline. Where this Ray's
    client cannot ask that by node id (Ray before 2.49 asks by address), the whole node table
    (:func:`declared_dead`), with a note in the log."""
    from ray._raylet import NodeID

    client = getattr(ray._private.worker.global_worker, "gcs_client", None)
    check = getattr(client, "check_alive", None)
    node = NodeID.from_hex(node_id)
    try:
        if check is None:
            raise TypeError("no check_alive")
        check([node], timeout=PROBE_TIMEOUT_S)
    except TypeError:
        log.info(
            "this Ray's GCS client cannot ask about one node by id: the fence asks for the whole node table "
            "every %.0fs",
            ASK_EVERY_S,
        )
        return lambda: declared_dead(ray.nodes(), node_id)
    except Exception:  # noqa: BLE001 - a GCS slow to answer right now: the question itself is the right one
        pass
    return lambda: not check([node], timeout=ASK_TIMEOUT_S)[0]


def gcs_address() -> tuple[str, str]:
    """The GCS's ``host:port`` as this process reaches it, and the cluster's id (hex)."""
    client = ray._private.worker.global_worker.gcs_client
    return client.address, client.cluster_id.hex()


def fence_when_node_lost(what: str) -> threading.Thread:
    """End this process (``os._exit(1)``) once its node is lost to the cluster (see the module
    docstring). ``what`` names the process in the log line it leaves."""
    node_id = ray.get_runtime_context().get_node_id()
    pid = os.environ.get("RAY_RAYLET_PID", "")
    lease = lease_s()
    try:
        address, cluster = gcs_address()
        reach: Optional[Callable[[], str]] = lambda: second_look(address, cluster, node_id)  # noqa: E731
    except Exception as exc:  # noqa: BLE001 - a Ray whose client hides them: the lease alone decides, as before
        log.warning(
            "%s: the GCS's address is not known here (%s: %s): past the lease the fence takes no second look",
            what,
            type(exc).__name__,
            exc,
        )
        reach = None
    fence = Fence(
        what,
        asker(node_id),
        raylet_pid=int(pid) if pid.isdigit() else None,
        lease=lease,
        exit=_exit(what, node_id),
        reach=reach,
        limit=limit_s(lease),
    )
    thread = threading.Thread(target=fence.run, name="gemini-fence", daemon=True)
    thread.start()
    return thread
