"""Verify before interpret: manifest encoding, checksums, HMAC signatures, allow-listed unpickling.

Bytes from the durable tier or from a host store are hostile until verified:

1. A manifest travels as JSON (``manifest_to_json`` for the durable marker; a memory
   version's shard plans and records are JSON too, :mod:`gemini_ckpt.format.shards`), never
   as a pickle. Its canonical encoding
   (``canonical_bytes``: sorted keys, no whitespace) carries a CRC32C of the DCP ``.metadata``
   bytes and of every data item; the marker also records a CRC32C of that canonical encoding,
   so accidental damage anywhere is caught before anything is decoded further.
2. With a signing key (``CheckpointConfig.signing_key`` or ``$GEMINI_CKPT_SIGNING_KEY``) the
   canonical encoding is signed with HMAC-SHA256; a reader with a key refuses an unsigned or
   wrongly signed version. Only the key holder can forge a version.
3. Whatever passes is still decoded through allow-lists, so a crafted file can never run code
   even without a key: DCP ``Metadata`` through an unpickler that resolves only DCP's metadata
   classes, ``torch.Size``, dtypes and plain builtins; non-tensor items with
   ``torch.load(weights_only=True)``; our opaque blobs (RNG streams, data-loader, scheduler,
   scaler, ``extra``) through an unpickler that knows builtins, numpy arrays and torch tensors,
   plus anything the user registered with ``torch.serialization.add_safe_globals``. The
   unpickler itself, which also budgets what a pickle may allocate, is :mod:`gemini_ckpt.unpickle`.
"""

from __future__ import annotations

# The modules by concept: ``manifest`` (keys, signatures, the marker as JSON), ``metadata`` (the
# DCP ``.metadata`` allow-list), ``values`` (our values and torch.save archives), ``items`` (one
# DCP item), with ``common`` and ``viewfile`` under them. Import from those.
