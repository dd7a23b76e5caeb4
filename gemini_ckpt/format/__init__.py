"""The format: how a version is laid out, as bytes and as names, with no torch and nothing of
ours above the base modules (``errors``, ``signing``, ``health``, ``checksum``). Everything
else builds on it: the trainer's snapshot (:mod:`gemini_ckpt.save`), the tiers
(:mod:`gemini_ckpt.stores`), the host stores (which import no torch), restore.

- :mod:`.shards`: a shard's plan and per-version record, as checked (and signed) JSON;
- :mod:`.segments`: the memory a shard lives in (a memfd or anonymous mapping) and its pool;
- :mod:`.finite`: the CRC32C of every item and, in the same pass, the health check of its values;
- :mod:`.framing`: a shard as DCP's ``FileSystemWriter`` file, from its raw bytes;
- :mod:`.manifest`: the durable tier's per-version manifest (what the completion marker holds).

How a version sits on a filesystem is the durable tier's (:mod:`gemini_ckpt.durable.layout`).

Importing this package imports nothing.
"""
