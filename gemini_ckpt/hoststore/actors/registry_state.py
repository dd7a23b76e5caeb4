"""What the registry's collaborators share (see :mod:`.registry`): the slots and epoch, the
commit coordinator, the job's settings, the recovery timeline, and the failures and events
``gemini_ckpt status`` shows.
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


class RegistryState:
    """One registry's shared state; its fields are read and written on the actor's event loop."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.nodes: list[str] = []
        self.domains: Optional[tuple] = None  # slot -> failure domain, read at each rendezvous
        self.epoch = 0
        self.failures: list[dict] = []
        self.events: list[dict] = []
        self.secret = os.urandom(32).hex()
        self.coordinator: Optional[Coordinator] = None
        self.started: dict[Any, float] = {}  # version -> when the coordinator first heard of it
        self.timeout_s = TIMEOUTS.version_s
        self.dead: set[int] = set()
        self.idle: frozenset = frozenset()
        self.handles: dict[int, Any] = {}
        self.job: dict = {}
        self.keep = 2
        self.node_info: dict[str, dict] = {}  # node id -> its resources and labels, as Ray reported them
        self.rerep_pending = False
        self.rerep_held = False
        self.recovery: list[dict] = []  # what happened after each host loss, when (see Registry.recovery())
        self.epoch_opened = 0.0

    def store(self, slot: int):
        handle = self.handles.get(slot)
        if handle is None and 0 <= slot < len(self.nodes):
            handle = self.handles[slot] = find_store(self.namespace, self.nodes[slot])
        return handle

    def report_failure(self, slot: int, node_id: str, message: str) -> None:
        self.failures.append({"unix": time.time(), "slot": slot, "node_id": node_id, "message": message})
        del self.failures[:-MAX_REPORTS]

    def event(self, message: str) -> None:
        log.info("registry %s: %s", self.namespace, message)
        self.events.append({"unix": time.time(), "message": message})
        del self.events[:-MAX_REPORTS]
