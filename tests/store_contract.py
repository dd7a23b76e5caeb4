"""The Store contract: what every store (MemoryStore, RayStore, ...) must do, as one function.

Run it on a fresh, empty store: ``check_store_contract(store)``. It uses steps 1000-1003 and
leaves the store empty again. The call order is the one documented in ``gemini_ckpt._store``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemini_ckpt import VersionNotFoundError
from gemini_ckpt._store import ItemChecksum, VersionManifest

BASE = 1000


def _manifest(step: int, files: dict[str, np.ndarray], world_size: int = 2) -> VersionManifest:
    return VersionManifest(
        step=step,
        world_size=world_size,
        metadata=b"pickled-dcp-metadata-" + str(step).encode(),
        checksums=tuple(ItemChecksum(name, 0, arr.nbytes, 0) for name, arr in sorted(files.items())),
        file_sizes={name: int(arr.nbytes) for name, arr in files.items()},
        job={"test": "contract"},
    )


def _files(step: int, sizes=(1000, 3333)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {f"__{r}_0.distcp": rng.integers(0, 256, size=n, dtype=np.uint8) for r, n in enumerate(sizes)}


def check_store_contract(store) -> None:
    s0, s1, s2, s3 = BASE, BASE + 1, BASE + 2, BASE + 3
    assert not [s for s in store.committed_steps() if s >= BASE], "the contract needs an empty store"

    # 1. put_file: not visible as a version before commit.
    f0 = _files(s0)
    for name, arr in f0.items():
        store.put_file(s0, name, arr)
    assert s0 not in store.committed_steps()
    with pytest.raises(VersionNotFoundError):
        store.manifest(s0)

    # 2. commit: the manifest names exactly what was put.
    m0 = _manifest(s0, f0)
    store.commit(s0, m0)
    assert s0 in store.committed_steps()
    got = store.manifest(s0)
    assert got == m0 and got.metadata == m0.metadata and got.file_sizes == m0.file_sizes

    # 3. read_range: exact bytes, any range, bytes-like of the requested length.
    for name, arr in f0.items():
        n = arr.nbytes
        for offset, length in ((0, n), (0, 1), (n - 1, 1), (17, 100), (n // 2, n - n // 2), (5, 0)):
            view = store.read_range(s0, name, offset, length)
            assert len(memoryview(view).cast("B")) == length
            assert bytes(view) == arr[offset : offset + length].tobytes()
        with pytest.raises(ValueError):
            store.read_range(s0, name, n - 10, 11)
        with pytest.raises(ValueError):
            store.read_range(s0, name, -1, 5)
    with pytest.raises(VersionNotFoundError):
        store.read_range(s0, "__9_0.distcp", 0, 1)
    with pytest.raises(VersionNotFoundError):
        store.read_range(s3 + 50, "__0_0.distcp", 0, 1)

    # 4. saving a committed step again replaces it: uncommitted from the first put_file on,
    #    then the new bytes once committed (never a mix of the two).
    f0 = _files(s0 + 100)
    store.put_file(s0, "__0_0.distcp", f0["__0_0.distcp"])
    assert s0 not in store.committed_steps()
    with pytest.raises(VersionNotFoundError):
        store.manifest(s0)
    store.put_file(s0, "__1_0.distcp", f0["__1_0.distcp"])
    m0 = _manifest(s0 + 100, f0)
    store.commit(s0, m0)
    assert s0 in store.committed_steps() and store.manifest(s0) == m0
    for name, arr in f0.items():
        assert bytes(store.read_range(s0, name, 0, arr.nbytes)) == arr.tobytes()

    # 5. commit refuses a manifest naming a file that was never put, or of the wrong size.
    f1 = _files(s1)
    store.put_file(s1, "__0_0.distcp", f1["__0_0.distcp"])
    with pytest.raises(ValueError):
        store.commit(s1, _manifest(s1, f1))  # __1_0 was never put
    assert s1 not in store.committed_steps()
    store.put_file(s1, "__1_0.distcp", f1["__1_0.distcp"][:-1])
    with pytest.raises(ValueError):
        store.commit(s1, _manifest(s1, f1))  # __1_0 is one byte short
    assert s1 not in store.committed_steps()

    # 6. a re-put replaces the file; several versions are listed in ascending order.
    store.put_file(s1, "__1_0.distcp", f1["__1_0.distcp"])
    store.commit(s1, _manifest(s1, f1))
    f2 = _files(s2, sizes=(0, 70_000))  # an empty data file is a valid file
    for name, arr in f2.items():
        store.put_file(s2, name, arr)
    store.commit(s2, _manifest(s2, f2))
    assert [s for s in store.committed_steps() if s >= BASE] == [s0, s1, s2]
    assert bytes(store.read_range(s2, "__0_0.distcp", 0, 0)) == b""
    assert bytes(store.read_range(s2, "__1_0.distcp", 69_990, 10)) == f2["__1_0.distcp"][-10:].tobytes()
    assert bytes(store.read_range(s1, "__1_0.distcp", 0, 3333)) == f1["__1_0.distcp"].tobytes()

    # 7. drop: idempotent, the step is gone, the others stay.
    store.drop(s0)
    store.drop(s0)
    store.drop(s3 + 99)  # never existed
    assert [s for s in store.committed_steps() if s >= BASE] == [s1, s2]
    with pytest.raises(VersionNotFoundError):
        store.manifest(s0)
    with pytest.raises(VersionNotFoundError):
        store.read_range(s0, "__0_0.distcp", 0, 1)
    assert bytes(store.read_range(s2, "__1_0.distcp", 0, 5)) == f2["__1_0.distcp"][:5].tobytes()

    # 8. a dropped step can be written again (a rolled-back run re-saving that step).
    f0b = _files(s0 + 200)
    for name, arr in f0b.items():
        store.put_file(s0, name, arr)
    store.commit(s0, _manifest(s0, f0b))
    assert bytes(store.read_range(s0, "__1_0.distcp", 0, 50)) == f0b["__1_0.distcp"][:50].tobytes()

    for step in (s0, s1, s2, s3):
        store.drop(step)
    assert not [s for s in store.committed_steps() if s >= BASE]
