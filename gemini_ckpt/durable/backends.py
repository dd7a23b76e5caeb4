"""Durable backends by URI scheme: how a ``durable_uri`` becomes a ``pyarrow.fs`` filesystem.

The scheme of a URI (``acme`` in ``acme://bucket/run``) picks its *opener*, a function
``opener(uri) -> (pyarrow.fs.FileSystem, root path)``, looked up in this order:

1. one registered in this process with :func:`register_durable_backend`;
2. one an installed package declares under the entry point group ``gemini_ckpt.durable_backends``
   (name: the scheme; value: ``module:function``), found in every process that looks;
3. pyarrow's own (``file``, ``s3``, ``gs``, ``hdfs``, ... : ``pyarrow.fs.FileSystem.from_uri``);
   a path without a scheme is a local directory.

Anything pyarrow can wrap can be a backend: an fsspec filesystem through
``pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))``, or a ``FileSystemHandler`` of your own.

Host stores write a persisted version's data files themselves, in parallel, each in its own
process: the trainer sends them the opener it found with every such write (Ray pickles it, by
value where its module is not importable there), so a backend registered only in the trainer
works on every host. The opener runs on those hosts too: it should find credentials where it
runs (the environment, an instance profile) rather than carry them. Sending code to the host
stores is no new trust: any member of the Ray cluster can run code on every node already.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Callable, Optional

import pyarrow.fs as pafs

from ..errors import ConfigError

ENTRY_POINT_GROUP = "gemini_ckpt.durable_backends"
Opener = Callable[[str], "tuple[pafs.FileSystem, str]"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_registered: dict[str, Opener] = {}
_from_entry_points: Optional[dict[str, object]] = None  # scheme -> its entry point, read once
_lock = threading.Lock()


def register_durable_backend(scheme: str, opener: Opener) -> None:
    """Open ``scheme://...`` durable URIs with ``opener(uri) -> (pyarrow.fs.FileSystem, root)``
    in this process (and in the host stores that write for it). Replaces an earlier registration
    of the same scheme, pyarrow's own included.

    Example::

        import fsspec, pyarrow.fs as pafs
        from gemini_ckpt import register_durable_backend

        def open_acme(uri):  # acme://bucket/run -> the bucket through an fsspec filesystem
            fs = fsspec.filesystem("acme")
            return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), uri.split("://", 1)[1]

        register_durable_backend("acme", open_acme)
        CheckpointConfig(durable_uri="acme://bucket/run", persist_every=10)
    """
    if not isinstance(scheme, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise ConfigError(
            f"register_durable_backend(scheme={scheme!r}): a URI scheme (letters, digits, '+', '-', "
            f"'.'; starting with a letter), without '://'"
        )
    if not callable(opener):
        raise ConfigError(
            f"register_durable_backend({scheme!r}, opener={opener!r}): a function "
            f"opener(uri) -> (pyarrow.fs.FileSystem, root path)"
        )
    with _lock:
        _registered[scheme.lower()] = opener


def unregister_durable_backend(scheme: str) -> None:
    """Forget this process's registration of ``scheme`` (entry points and pyarrow's own remain)."""
    with _lock:
        _registered.pop(scheme.lower(), None)


def scheme_of(uri: str) -> Optional[str]:
    m = _SCHEME.match(uri)
    return m.group(1).lower() if m else None


def opener_for(uri: str) -> Optional[Opener]:
    """The opener registered or declared for ``uri``'s scheme; None for a local path and for
    the schemes pyarrow opens itself."""
    scheme = scheme_of(uri)
    if scheme is None:
        return None
    with _lock:
        found = _registered.get(scheme)
    if found is not None:
        return found
    entry = _entry_points().get(scheme)
    if entry is None:
        return None
    try:
        opener = entry.load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin: say which, not a bare ImportError
        raise ConfigError(
            f"durable URI {uri!r}: the backend {entry.value!r} that package entry point "
            f"{ENTRY_POINT_GROUP}:{scheme} names cannot be loaded ({type(exc).__name__}: {exc})"
        ) from exc
    if not callable(opener):
        raise ConfigError(
            f"durable URI {uri!r}: entry point {ENTRY_POINT_GROUP}:{scheme} ({entry.value!r}) is not "
            f"a function opener(uri) -> (pyarrow.fs.FileSystem, root path)"
        )
    return opener


def _entry_points() -> dict[str, object]:
    global _from_entry_points
    if _from_entry_points is None:
        from importlib.metadata import entry_points

        _from_entry_points = {ep.name.lower(): ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _from_entry_points


def open_uri(uri: str, opener: Optional[Opener] = None) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, root path)`` of a durable URI: through ``opener`` when given (what a
    trainer sent a host store), else as the module docstring says."""
    opener = opener if opener is not None else opener_for(uri)
    if opener is not None:
        opened = opener(uri)
        if (
            not isinstance(opened, tuple)
            or len(opened) != 2
            or not isinstance(opened[0], pafs.FileSystem)
            or not isinstance(opened[1], str)
        ):
            raise ConfigError(
                f"durable URI {uri!r}: its backend {_name(opener)} returned {type(opened).__name__}, "
                f"not (pyarrow.fs.FileSystem, root path)"
            )
        return opened
    if scheme_of(uri) is None:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # pyarrow: ArrowInvalid "Unrecognized filesystem type", or a bad URI
        if "nrecognized filesystem" not in str(exc):
            raise
        raise ConfigError(
            f"durable URI {uri!r}: no backend for scheme {scheme_of(uri)!r} (pyarrow opens file, s3, "
            f"gs, hdfs, ...). Register one: gemini_ckpt.register_durable_backend({scheme_of(uri)!r}, "
            f"opener), or declare it as a package entry point in {ENTRY_POINT_GROUP!r}"
        ) from exc


def _name(opener) -> str:
    return getattr(opener, "__qualname__", None) or repr(opener)
