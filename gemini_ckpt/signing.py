"""Canonical JSON and HMAC-SHA256 signatures: the one encoding every signed thing uses (durable
manifests in :mod:`gemini_ckpt.trust`, shard plans and records in
:mod:`gemini_ckpt.format.shards`). Each kind of thing signs under its own ``context`` prefix,
so a signature made for one kind never verifies as another; and the signing key a job uses
(:func:`resolve_key`). Stdlib only."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Optional, Union

ENV_KEY = "GEMINI_CKPT_SIGNING_KEY"


def resolve_key(key: Union[bytes, str, None] = None) -> Optional[bytes]:
    """The signing key: ``key`` if given, else ``$GEMINI_CKPT_SIGNING_KEY``, else None."""
    if key is None:
        key = os.environ.get(ENV_KEY) or None
    if key is None:
        return None
    return key.encode() if isinstance(key, str) else bytes(key)


def canonical(obj: Any) -> bytes:
    """``obj`` (JSON-ready) as bytes that depend only on its value: keys sorted, no spaces, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def mac(key: bytes, context: bytes, payload: bytes) -> str:
    """The hex HMAC-SHA256 of ``context + payload`` under ``key``."""
    return hmac.new(key, context + payload, hashlib.sha256).hexdigest()


def mac_matches(signature: Any, key: bytes, context: bytes, payload: bytes) -> bool:
    """Whether ``signature`` is ``mac(key, context, payload)`` (compared in constant time)."""
    return isinstance(signature, str) and hmac.compare_digest(signature, mac(key, context, payload))
