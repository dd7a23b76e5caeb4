"""Restore: pick the newest healthy committed version, verify it, check its structure, load it.

Any failure reading a version (a missing or damaged marker, manifest or ``.metadata``, a bad
signature, an item that fails its checksum or the allow-lists, a value the live objects
reject) skips it, with a warning naming why, for the next older one; so does a version whose
state failed its health checks, as its verified records (or manifest) say
(:mod:`gemini_ckpt.health`), unless it was asked for by name (``restore(step=...)``). Every
rank takes the same decision: ranks walk rank 0's survey, exchange their outcome for each
candidate before loading (one ``all_gather_object``) and after applying it, and DCP's load
raises on every rank. Only a structure mismatch (the job changed, not the version) is raised
instead.

The path, module by module:

1. :mod:`.newest`: survey the tiers (rank 0's, shared), walk the candidates newest first;
2. :mod:`.version`: one candidate on every rank: open it, target the live state, check its
   structure, agree, load, apply, agree;
3. :mod:`.opening`: the candidate's verified views (:mod:`gemini_ckpt.stores.views`), best first;
4. :mod:`.direct` (same world size, a memory version: bytes straight into the live tensors) or
   :mod:`.loader` (DCP's load planner, which reshards at any world size).
"""

from .newest import UnhealthyRestoreWarning, restore_newest, survey
from .version import Restored, WorldSizeChangeWarning, check_structure, load_version

__all__ = [
    "Restored",
    "UnhealthyRestoreWarning",
    "WorldSizeChangeWarning",
    "check_structure",
    "load_version",
    "restore_newest",
    "survey",
]
