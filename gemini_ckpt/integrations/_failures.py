"""What failed, as an in-place recovery sees it: a peer (its process or connection gone), or this
rank's own code. Decided from the exception's type where torch and this library give one, and from
the transport's messages where older torch releases raise a plain ``RuntimeError``."""

from __future__ import annotations

from ..errors import (
    AttachError,
    AttemptInterruptedError,
    BackgroundError,
    CheckpointTimeoutError,
    ReplicationError,
    RoundTimeoutError,
)

# What torch.distributed's gloo and NCCL backends say when a peer is gone (older releases raise
# a plain RuntimeError with the transport's message rather than a DistError).
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "connectFullMesh",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "ncclSystemError",
    "Socket Timeout",
    "Timed out waiting",
    "timed out",
    "Read error",
    "Write error",
    "gloo/transport/tcp",
)


# Errors of this library's that a peer's loss causes, often before anything names the peer: a
# version whose copy to the lost host failed is not committed (a BackgroundError on the training
# thread, at every rank at once), a wait for it times out, an attach finds a store gone.
AFTERMATH = (BackgroundError, CheckpointTimeoutError, ReplicationError, AttachError)


def chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a peer process or its connection is gone."""
    import torch.distributed as dist

    from ..dataplane import PeerLostError

    for e in chain(exc):
        if isinstance(e, (dist.DistError, RoundTimeoutError, AttemptInterruptedError, PeerLostError)):
            return True
        if isinstance(e, (RuntimeError, ConnectionError, OSError)) and any(m in str(e) for m in PEER_GONE):
            return True
    return False
