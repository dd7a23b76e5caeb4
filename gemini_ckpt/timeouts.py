"""Every deadline of the library, in one place: how long each kind of wait may take before it is
treated as a failure. The user sets one of them (``CheckpointConfig.timeout_s``: a version's
whole replication and commit); the others are the library's, chosen as each docstring says.

The data plane (:mod:`gemini_ckpt.dataplane`) keeps its own pre-authentication deadlines:
it is a self-contained package shipped to the host stores by value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    version_s: float = 300.0
    """A version's replication and commit, end to end (the default of ``CheckpointConfig.timeout_s``,
    and what a host store and the registry use before they are told the job's)."""
    progress_s: float = 5.0
    """A data-plane peer that makes no progress this long fails the transfer. A peer that dies is
    noticed at once (its connections reset); this catches one that hangs. Shorter gives false
    alarms on busy hosts, where a live peer's CPU is taken by its ranks (docs/transport.md)."""
    abort_s: float = 10.0
    """A reader that gave up on pushes waiting for its data plane to confirm that no stream still
    writes into their buffers (streams stop as soon as they are scheduled after their
    connections are shut down; this bounds a loaded host)."""
    serve_s: float = 600.0
    """A host store pushing a restoring trainer the bytes it asked for (one batch of items)."""
    reader_idle_s: float = 30.0
    """A host store closes its channel to a reader that no push has used this long (a restore
    reads for seconds; the reader's next read connects again)."""
    handshake_s: float = 5.0
    """A process attaching to its host store's local channel, from connect to proof."""
    ping_every_s: float = 1.0
    """How often the registry checks that each host store answers."""
    ping_s: float = 5.0
    """A host store that does not answer the registry's ping (or index call) this long is down."""


TIMEOUTS = Timeouts()
"""The library's deadlines (the dataclass's defaults)."""
