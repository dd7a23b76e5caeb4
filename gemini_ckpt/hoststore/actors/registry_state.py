"""What the registry's collaborators share (see :mod:`.registry`), in named parts: the slots and
epoch (:class:`Slots`), the job's terms, the commit coordinator, re-replication and its timeline,
and the failures and events ``gemini_ckpt status`` shows.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

from ...timeouts import TIMEOUTS
from ...commit import Coordinator
from ..names import find_store

log = logging.getLogger("gemini_ckpt")

MAX_REPORTS = 50  # failure reports and events kept for status


class Slots:
    """This epoch's slots: which node holds each, which are dead or idle (fixed per epoch), their
    failure domains, what Ray said of each node, the stores' handles, and the namespace's secret."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.nodes: list[str] = []
        self.domains: Optional[tuple] = None  # slot -> failure domain, read at each rendezvous
        self.epoch = 0
        self.epoch_opened = 0.0
        self.dead: set[int] = set()
        self.idle: frozenset = frozenset()
        self.handles: dict[int, Any] = {}
        self.node_info: dict[str, dict] = {}  # node id -> its resources and labels, as Ray reported them
        self.secret = os.urandom(32).hex()

    def store(self, slot: int):
        handle = self.handles.get(slot)
        if handle is None and 0 <= slot < len(self.nodes):
            handle = self.handles[slot] = find_store(self.namespace, self.nodes[slot])
        return handle


class JobTerms:
    """What the job asked for at its last rendezvous: its settings (``StoreSettings.job()``), the
    versions kept, and the deadline of every wait."""

    def __init__(self) -> None:
        self.job: dict = {}
        self.keep = 2
        self.timeout_s = TIMEOUTS.version_s


class Commits:
    """The commit coordinator of this epoch, and when it first heard of each version."""

    def __init__(self) -> None:
        self.coordinator: Optional[Coordinator] = None
        self.started: dict[Any, float] = {}


class Rereplication:
    """Copies to make again after a host loss: whether a pass is due (``pending``) or held back
    while the ranks rendezvous (``held``), and what happened after each loss, when (``timeline``,
    see ``Registry.recovery()``)."""

    def __init__(self) -> None:
        self.pending = False
        self.held = False
        self.timeline: list[dict] = []  # wall-clock stamps, for reports across processes
        self.changed = float("-inf")  # time.monotonic() of the newest loss or replacement: for waits

    def change(self) -> None:
        """A loss or a replacement now (the copies of older versions wait a while after it)."""
        self.changed = time.monotonic()


class Reports:
    """The failures and events ``gemini_ckpt status`` shows (the newest ``MAX_REPORTS`` of each)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.failures: list[dict] = []
        self.events: list[dict] = []

    def report_failure(self, slot: int, node_id: str, message: str) -> None:
        self.failures.append({"unix": time.time(), "slot": slot, "node_id": node_id, "message": message})
        del self.failures[:-MAX_REPORTS]

    def event(self, message: str) -> None:
        log.info("registry %s: %s", self.namespace, message)
        self.events.append({"unix": time.time(), "message": message})
        del self.events[:-MAX_REPORTS]


class RegistryState:
    """One registry's state, in named parts each collaborator takes what it needs of; read and
    written on the actor's event loop."""

    def __init__(self, namespace: str) -> None:
        self.slots = Slots(namespace)
        self.terms = JobTerms()
        self.commits = Commits()
        self.rerep = Rereplication()
        self.reports = Reports(namespace)

    def parts(self) -> tuple[Slots, JobTerms, Commits, Rereplication, Reports]:
        return self.slots, self.terms, self.commits, self.rerep, self.reports
