"""Memory stays bounded when a hostile writer plants oversized files: nothing is read
before its size is checked against the signed marker, and an allocation is bounded by what was
recorded (pickle and ``torch.load`` bombs, deflated tensor items, crafted numpy arrays).
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from collections import OrderedDict

import pytest
import torch

from forge import forge_item, reseal
from gemini_ckpt.checksum import checksum
from gemini_ckpt.durable.tier import DurableTier
from durable_hostile_support import (
    BOMB,
    DATA,
    DEADLINE_S,
    MARKER,
    METADATA,
    NEWEST,
    OLDER,
    SLACK,
    MiB,
    PeakMemory,
    JOBS,
    version_bytes,
)
from toy_jobs import copy_versions, within

# fixtures (a redundant alias: pytest finds them here, ruff sees them used)
from durable_hostile_support import versions as versions
import paths

KEY = "hostile-test-key"


@pytest.fixture(scope="module")
def signed_versions(tmp_path_factory):
    return JOBS.make_versions(tmp_path_factory.mktemp("hostile-signed") / "d", signing_key=KEY)


# --- forging (the test's own files: pickle.loads here is of bytes the test wrote) ----------------
# a writer without the key: every CRC recomputed, the signature dropped
_reseal = functools.partial(reseal, unsign=True)
_forge_item = functools.partial(forge_item, unsign=True)


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _assert_bomb_refused(root, versions) -> None:
    """The newest version holds an allocation bomb: the older one is restored, ``verify`` names
    the allocation, and memory never rose past twice a version."""
    bound = 2 * version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        JOBS.assert_restored(root, versions, 0)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "allocat" in " ".join(problems), problems


def _bytearray_bomb(n: int, protocol: int = 4) -> bytes:
    """A pickle of a few dozen bytes that asks the allow-listed ``bytearray`` for ``n`` bytes."""
    return pickle.dumps(_Reduce(bytearray, (n,)), protocol=protocol)


class _Storage:
    pass


class _TensorPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
        return None


def _deflated_tensor_item(numel: int) -> bytes:
    """A ``torch.save``-shaped archive of a float tensor of ``numel`` zeros whose storage record
    is deflated: a few hundred KiB that inflate to ``4 * numel`` bytes in ``torch.load``."""
    storage = _Storage()
    storage.numel = numel
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=2).dump(
        _Reduce(torch._utils._rebuild_tensor_v2, (storage, 0, (numel,), (1,), False, OrderedDict()))
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        info = zipfile.ZipInfo("archive/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        chunk = bytes(4 * MiB)
        with z.open(info, "w", force_zip64=True) as rec:
            left = 4 * numel
            while left:
                rec.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
        z.writestr("archive/version", "3\n")
    return out.getvalue()


# === 3. nothing is read before its size is checked against the signed marker ======================
def test_a_sparse_oversized_metadata_is_refused_before_it_is_read(signed_versions, tmp_path):
    root = copy_versions(signed_versions, tmp_path)
    os.truncate(root / NEWEST / METADATA, 2 * BOMB)  # 4 KiB on disk
    bound = 2 * version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        JOBS.assert_restored(root, signed_versions, 0, signing_key=KEY)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1, signing_key=KEY)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "bytes" in problems[0], problems


def test_a_sparse_oversized_metadata_with_a_forged_size_is_refused_by_the_signature_first(signed_versions, tmp_path):
    root = copy_versions(signed_versions, tmp_path)
    os.truncate(root / NEWEST / METADATA, 2 * BOMB)
    marker = json.loads((root / NEWEST / MARKER).read_text())
    marker["metadata_bytes"] = 2 * BOMB  # checksum recomputed, as anyone can; the signature no longer matches
    fields = {k: v for k, v in marker.items() if k not in ("manifest_crc", "signature")}
    marker["manifest_crc"] = checksum(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    (root / NEWEST / MARKER).write_text(json.dumps(marker))
    bound = 2 * version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        JOBS.assert_restored(root, signed_versions, 0, signing_key=KEY)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1, signing_key=KEY)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "signature" in problems[0], problems


def test_a_sparse_oversized_data_file_is_refused(versions, tmp_path):
    root = copy_versions(versions, tmp_path)
    os.truncate(root / NEWEST / DATA, BOMB)
    JOBS.assert_restored(root, versions, 0)
    problems = DurableTier(str(root)).verify(1)
    assert problems and "size" in problems[0] or "bytes" in problems[0], problems


# === 4. allocation is bounded by what was recorded ================================================
def test_a_48_byte_metadata_cannot_allocate_a_gigabyte(versions, tmp_path):
    root = copy_versions(versions, tmp_path)
    (root / NEWEST / METADATA).write_bytes(_bytearray_bomb(BOMB))
    _reseal(root / NEWEST)  # no key: every checksum recomputed
    assert len((root / NEWEST / METADATA).read_bytes()) < 64
    bound = 2 * version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        JOBS.assert_restored(root, versions, 0)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "allocat" in problems[0], problems


def test_an_opaque_value_cannot_allocate_beyond_its_size(versions, tmp_path):
    """The ``extra`` item: ``torch.save`` of bytes that unpickle (through the value allow-list)
    to a huge bytearray."""
    root = copy_versions(versions, tmp_path)
    buf = io.BytesIO()
    torch.save(_bytearray_bomb(BOMB), buf)
    _forge_item(root / NEWEST, "rank_local.0.extra", buf.getvalue())
    _assert_bomb_refused(root, versions)


def test_a_non_tensor_item_cannot_allocate_in_torch_load(versions, tmp_path):
    """torch's own weights-only unpickler allows ``bytearray(n)`` too."""
    root = copy_versions(versions, tmp_path)
    src = io.BytesIO()
    torch.save({"x": 1}, src)
    with zipfile.ZipFile(io.BytesIO(src.getvalue())) as z, zipfile.ZipFile(out := io.BytesIO(), "w") as o:
        for info in z.infolist():
            data = z.read(info.filename)
            o.writestr(info.filename, _bytearray_bomb(BOMB, 2) if info.filename.endswith("data.pkl") else data)
    _forge_item(root / NEWEST, "rank_local.0.extra", out.getvalue())
    _assert_bomb_refused(root, versions)


def test_a_crafted_numpy_object_array_is_refused_not_a_crash(tmp_path):
    """numpy's own ``ndarray.__setstate__`` crashes the process on an object array whose list is
    short; the value allow-list refuses object dtypes (in a child process: on failure it dies)."""
    script = tmp_path / "child.py"
    script.write_text(
        "import pickle, numpy as np\n"
        "from numpy._core.multiarray import _reconstruct\n"
        "from gemini_ckpt.errors import VerificationError\n"
        "from gemini_ckpt.trust.values import value_loads\n"
        "class C:\n"
        "    def __reduce__(self):\n"
        "        return (_reconstruct, (np.ndarray, (0,), b'b'), (1, (10**6,), np.dtype('O'), False, []))\n"
        "try:\n"
        "    value_loads(pickle.dumps(C()), 'rank_local.0.extra')\n"
        "except VerificationError as exc:\n"
        "    print('refused:', exc)\n"
    )
    repo = str(paths.ROOT)  # this checkout's gemini_ckpt, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=DEADLINE_S, env=env)
    assert child.returncode == 0, f"the decoder died (status {child.returncode}): {child.stderr[-500:]}"
    assert "refused:" in child.stdout and "objects" in child.stdout, child.stdout


def test_a_deflated_tensor_item_is_refused_before_it_inflates(versions, tmp_path):
    root = copy_versions(versions, tmp_path)
    item = _deflated_tensor_item(BOMB // 4)
    assert len(item) < BOMB // 100
    _forge_item(root / NEWEST, "model.pos", item)
    bound = 2 * version_bytes(root, OLDER) + SLACK
    with PeakMemory() as mem:
        JOBS.assert_restored(root, versions, 0)
        problems = within(DEADLINE_S, DurableTier(str(root)).verify, 1)
    assert mem.rise < bound, f"memory rose {mem.rise / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)"
    assert problems and "compressed" in " ".join(problems), problems
