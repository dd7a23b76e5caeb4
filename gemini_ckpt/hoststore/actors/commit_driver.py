"""The host store's part in a version's commit: the protocol's messages in and out (fire-and-forget
Ray calls to peers and the registry's coordinator), the actions they lead to, deadlines, and the
chaos harness's held votes. The protocol itself is sans-I/O (:mod:`gemini_ckpt.commit`);
roles and messages in ``docs/commit.md``.

One of the host store's collaborators (:mod:`.host_store`); the state they share is :class:`.state.StoreState`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import ray
from ray.exceptions import RayActorError

from ...commit import COORDINATOR, Aborted, Committed, Release, Replicate, Send, VersionId, VersionState, Vote
from ..names import find_registry, find_store
from .ranks import tell
from .state import StoreState

log = logging.getLogger("gemini_ckpt")


class CommitDriver:
    """This store's side of the commit protocol (see the module docstring)."""

    def __init__(self, state: StoreState) -> None:
        self.s = state
        # The driver's own, under the store's lock:
        self.registry = None  # the registry's actor handle, once looked up
        self.peers: dict[int, Any] = {}  # slot -> actor handle
        self.refs: list[tuple[Any, int]] = []  # fire-and-forget control calls (ref, to whom)
        self.vote_hold: Optional[int] = None  # fault injection: see hold_vote
        self.held_votes: list = []

    # --- the commit protocol ---------------------------------------------------------------------
    def commit_message(self, message) -> None:
        """A control message from a peer store or the coordinator (fire-and-forget)."""
        with self.s.lock:
            if self.s.commit is None or message.version.epoch != self.s.epoch:
                return  # an earlier epoch's, or this store holds copies only
            actions = self.s.commit.on_message(message)
        self.apply(actions)

    def peer_dead(self, slot: int) -> None:
        """The registry saw the host store of ``slot`` die (the host store drops its channel)."""
        with self.s.lock:
            actions = self.s.commit.on_peer_dead(slot) if self.s.commit is not None else []
        self.apply(actions)

    def new_epoch(self) -> None:
        """A new epoch: its peers' handles and the registry's are looked up afresh."""
        with self.s.lock:
            self.peers, self.registry = {}, None

    def apply(self, actions: list) -> None:
        if actions and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "node %s: %s",
                self.s.node_id[:12],
                "; ".join(
                    type(a).__name__
                    + ("->" + str(a.to) + " " + type(a.message).__name__ if isinstance(a, Send) else "")
                    for a in actions
                ),
            )
        # Retention first: when a rank hears its version committed, the segments the commit
        # released are free for its next save.
        for a in sorted(actions, key=lambda a: not isinstance(a, Release)):
            if isinstance(a, Send) and self.hold(a):
                continue
            if isinstance(a, Send):
                self.send(a.to, a.message)
            elif isinstance(a, Replicate):
                pass  # the copies began when the shards were handed off (see _staged)
            elif isinstance(a, Committed):
                self.decided(a.version, True, "", a.unhealthy, a.checked)
            elif isinstance(a, Aborted):
                self.decided(a.version, False, a.reason)
            elif isinstance(a, Release):
                with self.s.lock:
                    v = self.s.table.versions.get(a.version.step)
                    if v is not None and v.key == (a.version.epoch, a.version.step):
                        self.s.table.release(v)

    def decided(self, vid: VersionId, committed: bool, reason: str, unhealthy: str = "", checked: bool = False) -> None:
        with self.s.lock:
            v = self.s.table.versions.get(vid.step)
            if v is not None and v.key == (vid.epoch, vid.step):
                v.mark("decided")
                v.state = VersionState.COMMITTED if committed else VersionState.ABORTED
                v.unhealthy = unhealthy if committed else ""
                if not committed:
                    self.s.table.release(v, force=True)
            waiters = self.s.waiters.pop((vid.epoch, vid.step), [])
        for conn, _rank in waiters:
            tell(conn, vid.step, committed, reason, unhealthy, checked)
        if not committed:
            log.info("node %s: step %d was not committed: %s", self.s.node_id[:12], vid.step, reason)

    def send(self, to: int, message) -> None:
        try:
            target = self.registry_handle() if to == COORDINATOR else self.peer(to)
            if target is None:
                raise LookupError(f"no host store for slot {to}")
            ref = target.commit_message.remote(message)
        except Exception as exc:  # noqa: BLE001 - a peer we cannot reach: the registry decides if it died
            self.suspect(to, f"{type(exc).__name__}: {exc}")
            return
        with self.s.lock:
            self.refs.append((ref, to))

    def peer(self, slot: int):
        with self.s.lock:
            handle = self.peers.get(slot)
            cfg = self.s.cfg
        if handle is None and cfg is not None:
            handle = find_store(self.s.namespace, cfg.nodes[slot])
            with self.s.lock:
                self.peers[slot] = handle
        return handle

    def registry_handle(self):
        if self.registry is None:
            self.registry = find_registry(self.s.namespace)
        return self.registry

    def suspect(self, slot: int, why: str) -> None:
        if slot == COORDINATOR:
            log.error("node %s: cannot reach the registry: %s", self.s.node_id[:12], why)
            return
        registry = self.registry_handle()
        if registry is not None:
            registry.suspect.remote(slot, f"node {self.s.node_id[:12]}: {why}")

    # --- deadlines and lost messages ----------------------------------------------------------------
    def check_timeouts(self) -> None:
        actions = []
        with self.s.lock:
            if self.s.commit is None or self.s.cfg is None:
                return
            now = time.monotonic()  # not the wall clock: a step of it must not fail the versions in flight
            for vid in self.s.commit.pending():
                v = self.s.table.versions.get(vid.step)
                started = v.started_mono if v is not None else now
                if now - started > self.s.cfg.timeout_s:
                    actions += self.s.commit.on_timeout(vid)
        self.apply(actions)

    def check_refs(self) -> None:
        with self.s.lock:
            refs, self.refs = self.refs, []
        if not refs:
            return
        ready, _ = ray.wait([r for r, _ in refs], num_returns=len(refs), timeout=0)
        ready = set(ready)
        keep = []
        for ref, to in refs:
            if ref not in ready:
                keep.append((ref, to))
                continue
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                self.suspect(to, f"a control message was lost ({type(exc).__name__})")
            except Exception:  # noqa: BLE001 - a peer's own error is its business
                pass
        with self.s.lock:
            self.refs = keep + self.refs

    # --- fault injection (the chaos harness) ----------------------------------------------------------
    def hold_vote(self, step: int) -> None:
        """Fault injection (the chaos harness): keep this store's yes vote for ``step`` until
        :meth:`release_vote`, so a fault lands after every copy is acknowledged and before the
        coordinator decides."""
        with self.s.lock:
            self.vote_hold, self.held_votes = step, []

    def held(self) -> Optional[int]:
        """The step whose vote is being held, once it is (else None)."""
        with self.s.lock:
            return self.vote_hold if self.held_votes else None

    def release_vote(self) -> None:
        with self.s.lock:
            held, self.held_votes, self.vote_hold = self.held_votes, [], None
        self.apply(held)

    def hold(self, action: Send) -> bool:
        message = action.message
        with self.s.lock:
            if (
                self.vote_hold is None
                or not isinstance(message, Vote)
                or not message.ok
                or message.version.step != self.vote_hold
            ):
                return False
            self.held_votes.append(action)
            return True
