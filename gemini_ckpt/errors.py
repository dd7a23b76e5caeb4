"""One exception hierarchy for the library.

Every error derives from :class:`CheckpointError` and, where one fits, from a built-in
(``ValueError``, ``TimeoutError``, ``LookupError``) so callers can catch what they already know.
All of them pickle, so they survive crossing a Ray actor boundary intact. The one exception to
"all errors live here": the data plane's (:mod:`gemini_ckpt.dataplane`), a package that is
shipped to the host stores by value and imports nothing of ours; the stores turn them into
:class:`ReplicationError` before a user sees one.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by gemini_ckpt."""

    def __reduce__(self):
        # Exceptions with keyword-only constructors do not pickle by default; ours keep one
        # message string so a plain (cls, args) reduction is always enough.
        return (self.__class__, (str(self),))


class ConfigError(CheckpointError, ValueError):
    """A configuration value is unknown or impossible; the message names the field and the fix."""


class StructureMismatchError(CheckpointError, ValueError):
    """The state being restored does not have the structure of the saved version."""


class ChecksumError(CheckpointError, ValueError):
    """Bytes read back do not match the checksum recorded when they were written."""


class VerificationError(ChecksumError):
    """A version failed verification (damaged, unsigned, wrongly signed, or holding something
    the allow-lists refuse); restore skips it for the next older version."""


class VersionNotFoundError(CheckpointError, LookupError):
    """The requested version is not committed in the store."""


class BackgroundError(CheckpointError):
    """Background work (serialize, replicate, commit, persist) of a version failed.

    Raised on the training thread at the next ``save``/``wait``/``close``; ``__cause__`` is
    the original exception when it could be kept.
    """


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A blocking call did not finish within its timeout."""


class MemoryBudgetError(CheckpointError, MemoryError):
    """Keeping the requested versions would exceed the configured memory budget."""


class FencedError(CheckpointError):
    """A newer ``Checkpointer`` opened this namespace: writes from this (older) one are refused,
    so a zombie of an earlier attempt, or a second job sharing the namespace by mistake, can
    never overwrite or drop the newer one's versions."""


class UnhealthyVersionError(CheckpointError):
    """A version's state failed its health checks (``CheckpointConfig.health_check``): raised
    at the next ``save``/``wait``/``close`` with ``on_unhealthy="raise"``, so a job can stop and
    restart from the last healthy version; and by ``restore()`` when every version it could
    load is unhealthy. ``step`` and ``health`` (a :class:`gemini_ckpt.health.Health`) say which
    version and why, when known."""

    def __init__(self, message: str, *, step=None, health=None) -> None:
        super().__init__(message)
        self.step, self.health = step, health

    def __reduce__(self):
        return (self.__class__, (str(self),), {"step": self.step, "health": self.health})


class ReplicationError(CheckpointError, RuntimeError):
    """A version could not be committed in the host stores (a holder died or refused its copy)."""


class ShardFormatError(CheckpointError, ValueError):
    """Bytes that claim to be a shard plan or record are damaged, forged or malformed."""


class DamagedFileError(ChecksumError):
    """A file under a durable root (or an ``init_from`` directory) is not what may be read or
    replaced there: a link, a FIFO, a device, a directory, or not of its recorded size."""


class TemplateError(CheckpointError, ValueError):
    """``torch.save`` of this tensor signature does not have a layout a template can capture."""


class AttachError(CheckpointError, ConnectionError):
    """The attach channel (a trainer and its host store) broke, refused the trainer, or the store
    answered with an error."""


class CommitProtocolError(CheckpointError, RuntimeError):
    """Participants of the commit protocol disagree about a decision: a bug in the protocol or
    its driver."""


class NetworkUnavailable(CheckpointError, OSError):
    """Simulated hosts with their own network (``LocalCluster(network="netns")``) can't be made
    here: the message says why (no CAP_NET_ADMIN, no ``ip``/``tc``) or which command failed."""


class ReadNotStoppedError(CheckpointError, RuntimeError):
    """A read that restore gave up on (a peer too slow, or gone) could not be confirmed stopped,
    so bytes may still land in the live state: the restore stops rather than load anything over
    them. Never expected; restart the process."""


class UnreadableCandidate(CheckpointError):
    """Inside restore (:mod:`gemini_ckpt.restore`): this candidate version cannot be read on some
    rank (corrupt bytes, a failed check); the walk moves to an older one. Users meet what the
    walk raises when none is left (:class:`ChecksumError`), never this."""


class UnhealthyCandidate(UnreadableCandidate):
    """Inside restore: this candidate version's state failed its health checks; an older one
    may be healthy (users meet :class:`UnhealthyVersionError` when none is)."""


class RecoveryGaveUpError(CheckpointError):
    """In-place recovery stopped making progress (the same failure again and again, or a worker
    that cannot come back): Ray Train's controller ends the run with this error."""


class RoundTimeoutError(CheckpointError, TimeoutError):
    """The ranks of an in-place job did not all arrive at a round of the process group in time
    (a worker never came back)."""


class AttemptInterruptedError(CheckpointError):
    """In-place recovery: a newer round was asked for (a peer failed) while this rank waited in
    something no cut connection ends (the host stores' rendezvous); the attempt ends here and the
    training function runs again in the new round. Seen only by code that catches errors inside a
    recoverable training function."""


class SupersededError(CheckpointError):
    """This process's incarnation is not a member of the in-place round it reached: a newer
    process took its rank (it is a replaced worker's zombie). It must not train; the process ends."""
